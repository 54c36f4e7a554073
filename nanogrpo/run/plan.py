"""The memory plan of a run before it starts (`python train.py ... --dry_run=true`): the model built
on the meta device from its config.json alone, and per process the bytes of the tensors a step
holds: parameters, gradients, AdamW state, the reference model, the parameters gathered to sample,
the sampler's KV cache, logits and step (a round's, and an evaluation's), the update's activations
(with and without gradient checkpointing) and its LM head. Printed with the batch table and
written as output_dir/plan.json. Tensors only: the CUDA context, the allocator's cached and
fragmented blocks and the Python process come on top. Nothing is downloaded but a hub model's
config.json: the longest prompt comes from max_prompt_length, or from the datasets and tokenizer
where this machine has them (a hub dataset or tokenizer from huggingface_hub's cache only), else
it is assumed and the plan says so.

What each line assumes (nanogrpo's own code paths, not a general model):
- parameters in the weight dtype (float32 unless model_init_kwargs says otherwise), sharded over
  the processes by FSDP2 when there are several, as are their gradients and AdamW's two moments;
- sampling: with several processes every rank gathers the whole model (bf16 under mixed
  precision); the KV cache holds every row of a round at prompt + completion length in the
  compute dtype; one [rows, vocab] fp32 logits block a step, and a layer's MLP and hidden states
  per row; an evaluation samples its rank's share of the eval prompts (eval_size, or the
  dataset's rows when read), num_generations_eval each, in one call, between rounds: the
  larger of the two counts;
- the update: a micro-batch's completions with gradient (each distinct prompt once; with
  token_budget a forward's tokens, at most the budget), per layer
  and token the tensors autograd keeps (the two norms' inputs and outputs, q/k/v and RoPE's
  products, the grouped-query keys and values repeated to every head, attention's output, the
  MLP's gate, up, SiLU and product); with gradient checkpointing one layer's input per layer plus
  one layer's activations; the chunked LM head's kept probabilities (up to 1 GiB) and three
  [256, vocab] fp32 blocks.
The peak is the static part plus the larger of sampling and the update (with one micro-batch a
step, the gradients are made as backward frees the activations: the larger of the two); with
async_rollouts the sampler process's weights (and reference model; on CPU the trainable weights
it keeps for the rounds in flight) and its sampling peak come on top of the update's, at the same
time.

Does not know about: the GRPO math, the sampler, rewards, or processes (it counts
their bytes from the configs alone; nothing runs).
"""

import json
import os

import torch

from nanogrpo import checkpoint
from nanogrpo.checkpoint.hf_format import config_from_hf
from nanogrpo.extras import lora
from nanogrpo.fast.logprobs import KEEP_BYTES
from nanogrpo.model import ModelConfig, Transformer
from nanogrpo.tokenizer import Tokenizer, char_level_tokenizer

ASSUMED_PROMPT_TOKENS = 512  # when neither max_prompt_length nor the data give it
LM_HEAD_CHUNK = 256  # fast/logprobs.py's chunk_size


def model_config(cfg) -> ModelConfig:
    """cfg.model's ModelConfig from its config.json alone (a hub id: that one file), or the
    embedded default's recipe."""
    if cfg.init_model is not None:
        vocab = char_level_tokenizer(cfg.init_tokenizer_chars).vocab_size
        return ModelConfig(vocab_size=vocab, **cfg.init_model)
    if os.path.isdir(cfg.model):
        path = os.path.join(cfg.model, "config.json")
    else:
        from huggingface_hub import hf_hub_download

        try:
            path = hf_hub_download(cfg.model, "config.json")
        except Exception as e:
            raise OSError(
                f"dry_run: cannot read {cfg.model}'s config.json ({type(e).__name__}); "
                "pass a local checkpoint directory as --model, or go online once"
            ) from e
    return config_from_hf(checkpoint.read_json(path))


def local_tokenizer(cfg):
    """cfg.model's tokenizer as this machine has it: a local checkpoint's, a hub id's from
    huggingface_hub's cache only (LocalEntryNotFoundError when it is not there)."""
    if cfg.init_model is not None:
        return char_level_tokenizer(cfg.init_tokenizer_chars)
    path = cfg.model
    if not os.path.isdir(path):
        from huggingface_hub import hf_hub_download

        path = os.path.dirname(hf_hub_download(path, "tokenizer.json", local_files_only=True))
    return Tokenizer.from_pretrained(path)


def prompt_tokens(cfg, spec: str, split: str | None) -> tuple[int, str, int | None]:
    """The longest prompt a round (or an evaluation) of spec may hold, where that figure comes
    from, and spec's row count (None: not read). Nothing is downloaded: a hub dataset (gsm8k,
    hf://) or a hub model's tokenizer is read from huggingface_hub's cache only, else assumed."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    from nanogrpo.extras.datasets import load_dataset

    if cfg.max_prompt_length:
        return cfg.max_prompt_length, "max_prompt_length", None
    what = f"{cfg.model}'s tokenizer"
    try:
        tok = local_tokenizer(cfg)
        what = spec
        rows = load_dataset(spec, split=split, seed=cfg.seed, offline=True)
        kwargs = cfg.chat_template_kwargs or {}
        longest = max(len(tok.encode_prompt(r["prompt"], **kwargs)) for r in rows[:5000])
    except LocalEntryNotFoundError:  # not in huggingface_hub's cache
        why = f"{what} is not downloaded, and a dry run downloads nothing"
        return ASSUMED_PROMPT_TOKENS, f"assumed: {why}; set max_prompt_length", None
    except Exception as e:  # the data or the tokenizer is not here: say what was assumed
        why = f"{type(e).__name__} reading {what}"
        return ASSUMED_PROMPT_TOKENS, f"assumed: {why}; set max_prompt_length", None
    return longest, f"the longest of {min(len(rows), 5000)} {spec} prompts", len(rows)


def eval_rows(cfg, world_size: int, counted: int | None) -> int:
    """The completions one process samples at once to evaluate (train.py's evaluate: its share
    of the eval prompts, num_generations_eval each, in one generate call); 0 when the run does
    not evaluate. counted: the eval dataset's rows when read (else eval_size's)."""
    if not cfg.evaluates():
        return 0
    prompts = min(cfg.eval_size, counted or cfg.eval_size)
    per_rank = -(-prompts // world_size)  # equal_shard's share, rounded up
    return per_rank * (cfg.num_generations_eval or cfg.num_generations)


def parameter_counts(mc: ModelConfig, cfg) -> tuple[int, int]:
    """(all parameters, trainable ones), counted on the meta device."""
    with torch.device("meta"):
        model = Transformer(mc)
        settings = cfg.lora_settings()
        if settings:
            lora.apply_lora(model, **settings)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in lora.trainable_parameters(model))
    return total, trainable


def layer_bytes_per_token(mc: ModelConfig, compute: int) -> int:
    """What autograd keeps per token of one layer (see the module docstring): the residual
    stream and norms in fp32, the products in the compute dtype."""
    D, F = mc.hidden_size, mc.intermediate_size
    q = mc.num_attention_heads * mc.head_dim
    kv = mc.num_key_value_heads * mc.head_dim
    fp32_part = 4 * (5 * D + 2)  # two norms' inputs and outputs, the residual, two rsqrt
    products = compute * (7 * q + 5 * kv + 4 * F)
    return fp32_part + products


def plan(cfg, world_size: int) -> dict:
    """The memory plan of cfg on world_size processes: bytes per process, and what they assume
    (async_rollouts under torchrun: per trainer process, of those that train)."""
    world_size = cfg.trainer_processes(world_size)
    mc = model_config(cfg)
    n_params, n_train = parameter_counts(mc, cfg)
    sched = cfg.schedule(world_size)
    device = cfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    bf16 = cfg.use_bf16(device)
    weight = torch.empty((), dtype=checkpoint.parse_dtype(cfg.weight_dtype())).element_size()
    compute = 2 if bf16 else weight
    W = world_size
    P, prompt_source, _ = prompt_tokens(cfg, cfg.dataset, cfg.dataset_split)
    C = cfg.max_completion_length
    rows = sched.completions_per_round_per_rank
    P_eval, eval_source, counted = P, prompt_source, None
    if cfg.evaluates():
        P_eval, eval_source, counted = prompt_tokens(cfg, cfg.eval_dataset, cfg.eval_split)
    E = eval_rows(cfg, W, counted)
    B = sched.micro_batch_size
    layers, V = mc.num_hidden_layers, mc.vocab_size
    kv = mc.num_key_value_heads * mc.head_dim
    peft = n_train < n_params
    grads = n_train * 4 // W
    static = {
        "parameters": n_params * weight // W,
        "gradients": grads,
        "optimizer": 2 * n_train * 4 // W,
        "reference_model": n_params * weight // W if cfg.beta > 0 and not peft else 0,
    }
    gathered = n_params * compute if W > 1 else 0
    # a decode step's layer per row: the MLP's gate, up and product, three hidden states
    step = (3 * mc.intermediate_size + 3 * mc.hidden_size) * compute
    sampling = {
        "gathered_parameters": gathered,
        "kv_cache": rows * layers * 2 * kv * (P + C) * compute,
        "sampler_logits": rows * V * 4,
        "sampler_activations": rows * step,
        # evaluate's one generate call, between cycles: instead of a round's, not beside it
        "eval_kv_cache": E * layers * 2 * kv * (P_eval + C) * compute,
        "eval_sampler_logits": E * V * 4,
        "eval_sampler_activations": E * step,
    }
    # a micro-batch: its completions with gradient, each distinct prompt once; a forward of
    # token_budget packed tokens at most
    tokens = B * C + max(1, B // cfg.num_generations) * P
    if cfg.token_budget is not None:
        tokens = min(tokens, cfg.token_budget)
    per_layer = layer_bytes_per_token(mc, compute) * tokens
    head_blocks = 3 * LM_HEAD_CHUNK * V * 4
    kept = min(KEEP_BYTES, min(B * C, tokens) * V * 4)
    update = {
        "activations": layers * per_layer,
        "activations_checkpointed": layers * tokens * mc.hidden_size * 4 + per_layer,
        "lm_head": kept + head_blocks,
        "lm_head_checkpointed": head_blocks,
    }
    if cfg.gradient_checkpointing:
        update_peak = update["activations_checkpointed"] + update["lm_head_checkpointed"]
    else:
        update_peak = update["activations"] + update["lm_head"]
    if bf16 and W == 1:  # autocast keeps a bf16 copy of each weight it casts, for backward
        update_peak += n_params * 2
    rounds = sum(v for k, v in sampling.items() if k.startswith(("kv_", "sampler_")))
    evals = sum(v for k, v in sampling.items() if k.startswith("eval_"))
    sampling_peak = gathered + max(rounds, evals)
    held = sum(static.values())
    if sched.gradient_accumulation_steps == 1:
        # gradients are freed after each step (set_to_none) and made during backward as the
        # activations go: at most all activations and the LM head's gradient, or all gradients
        held -= grads
        head_grad = V * mc.hidden_size * 4 // W
        update_peak = max(update_peak + head_grad, grads)
    total = held + max(sampling_peak, update_peak)
    if cfg.async_rollouts:  # the sampler process: its own weights (and reference), sampling
        # while the trainer updates: both peaks at once, on the same device
        sampler = static["parameters"] + static["reference_model"]
        update["sampler_process_weights"] = sampler
        # the trainable weights it receives, kept on the host while rounds in flight draw with
        # them: up to max_staleness rounds' and the newest (the device's memory only on CPU)
        received = n_train * weight * (cfg.rounds_in_flight() + 1)
        update["sampler_received_weights"] = received
        sampler += received if device == "cpu" else 0
        total = held + update_peak + sampler + sampling_peak
    return {
        "model": cfg.model,
        "world_size": W,
        "parameters": n_params,
        "trainable_parameters": n_train,
        "weight_bytes": weight,
        "compute_bytes": compute,
        "prompt_tokens": P,
        "prompt_tokens_from": prompt_source,
        "completion_tokens": C,
        "completions_per_rank_per_round": rows,
        "eval_prompt_tokens": P_eval,
        "eval_prompt_tokens_from": eval_source,
        "eval_completions_per_rank": E,
        "micro_batch": B,
        "update_tokens": tokens,
        "gradient_checkpointing": cfg.gradient_checkpointing,
        "bytes": {**static, **sampling, **update},
        "sampling_peak": sampling_peak,
        "update_peak": update_peak,
        "total": total,
        "batch_table": sched.table(),
    }


def mib(n: int) -> str:
    return f"{n / 2**20:12,.1f} MiB"


def report(p: dict) -> str:
    """The plan as the lines a dry run prints."""
    lines = [
        f"memory plan: {p['model']}, {p['parameters']:,} parameters "
        f"({p['trainable_parameters']:,} trainable), tensor bytes per process of {p['world_size']}",
        f"  prompts {p['prompt_tokens']} tokens ({p['prompt_tokens_from']}), completions "
        f"{p['completion_tokens']}, {p['completions_per_rank_per_round']} completions a round, "
        f"micro-batch {p['micro_batch']}, {p['update_tokens']:,} tokens an update's forward",
    ]
    if p["eval_completions_per_rank"]:
        line = f"  evaluation: {p['eval_completions_per_rank']} completions sampled at once, "
        if p["eval_prompt_tokens_from"] == p["prompt_tokens_from"]:
            line += "prompts as a round's"
        else:
            line += f"prompts {p['eval_prompt_tokens']} tokens ({p['eval_prompt_tokens_from']})"
        lines.append(line)
    for name, n in p["bytes"].items():
        lines.append(f"  {name:<28}{mib(n)}")
    checkpointing = "with" if p["gradient_checkpointing"] else "without"
    lines += [
        f"  {'sampling peak':<28}{mib(p['sampling_peak'])}",
        f"  {'update peak':<28}{mib(p['update_peak'])}  ({checkpointing} gradient checkpointing)",
        f"  {'total (static + larger peak)':<28}{mib(p['total'])}",
        "  tensors only: the CUDA context, the allocator's cached and fragmented blocks, and the "
        "Python process come on top",
        p["batch_table"],
    ]
    return "\n".join(lines)


def dry_run(cfg, world_size: int) -> dict:
    """Print the plan and write output_dir/plan.json; nothing else is written."""
    p = plan(cfg, world_size)
    print(report(p), flush=True)
    os.makedirs(cfg.output_dir, exist_ok=True)
    path = os.path.join(cfg.output_dir, "plan.json")
    with open(path, "w") as f:
        json.dump(p, f, indent=1)
    print(f"wrote {path}")
    return p
