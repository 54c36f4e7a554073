"""The memory plan of a run before it starts (`python train.py ... --dry_run=true`): the model built
on the meta device from its config.json alone, and per process the bytes of what a step holds:
parameters, gradients, AdamW state, the reference model, the parameters gathered to sample, the
sampler's KV cache and logits, the update's activations (with and without gradient checkpointing)
and its LM head. Printed with the batch table and written as output_dir/plan.json.

What each line assumes (nanogrpo's own code paths, not a general model):
- parameters in the weight dtype (float32 unless model_init_kwargs says otherwise), sharded over
  the processes by FSDP2 when there are several, as are their gradients and AdamW's two moments;
- sampling: with several processes every rank gathers the whole model (bf16 under mixed
  precision); the KV cache holds every row of a round at prompt + completion length in the
  compute dtype; one [rows, vocab] fp32 logits block a step;
- the update: a micro-batch's completions with gradient (each distinct prompt once), per layer
  and token the tensors autograd keeps (the two norms' inputs and outputs, q/k/v and RoPE's
  products, the grouped-query keys and values repeated to every head, attention's output, the
  MLP's gate, up, SiLU and product); with gradient checkpointing one layer's input per layer plus
  one layer's activations; the chunked LM head's kept probabilities (up to 1 GiB) and three
  [256, vocab] fp32 blocks.
The peak is the static part plus the larger of sampling and the update (with one micro-batch a
step, the gradients are made as backward frees the activations: the larger of the two).

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
from nanogrpo.tokenizer import char_level_tokenizer

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


def prompt_tokens(cfg) -> tuple[int, str]:
    """The longest prompt a round may hold, and where that figure comes from."""
    if cfg.max_prompt_length:
        return cfg.max_prompt_length, "max_prompt_length"
    try:
        from nanogrpo.extras.datasets import load_dataset
        from nanogrpo.tokenizer import Tokenizer

        tok = (
            char_level_tokenizer(cfg.init_tokenizer_chars)
            if cfg.init_model is not None
            else Tokenizer.from_pretrained(cfg.model)
        )
        rows = load_dataset(cfg.dataset, split=cfg.dataset_split, seed=cfg.seed)
        kwargs = cfg.chat_template_kwargs or {}
        longest = max(len(tok.encode_prompt(r["prompt"], **kwargs)) for r in rows[:5000])
        return longest, f"the longest of {min(len(rows), 5000)} {cfg.dataset} prompts"
    except Exception as e:  # the data or the tokenizer is not here: say what was assumed
        return ASSUMED_PROMPT_TOKENS, f"assumed ({type(e).__name__}: set max_prompt_length)"


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
    """The memory plan of cfg on world_size processes: bytes per process, and what they assume."""
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
    P, prompt_source = prompt_tokens(cfg)
    C = cfg.max_completion_length
    rows = sched.completions_per_round_per_rank
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
    sampling = {
        "gathered_parameters": n_params * compute if W > 1 else 0,
        "kv_cache": rows * layers * 2 * kv * (P + C) * compute,
        "sampler_logits": rows * V * 4,
    }
    # a micro-batch: its completions with gradient, each distinct prompt once
    tokens = B * C + max(1, B // cfg.num_generations) * P
    per_layer = layer_bytes_per_token(mc, compute) * tokens
    head_blocks = 3 * LM_HEAD_CHUNK * V * 4
    kept = min(KEEP_BYTES, B * C * V * 4)
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
    sampling_peak = sum(sampling.values())
    held = sum(static.values())
    if sched.gradient_accumulation_steps == 1:
        # gradients are freed after each step (set_to_none) and made during backward as the
        # activations go: at most all activations and the LM head's gradient, or all gradients
        held -= grads
        head_grad = V * mc.hidden_size * 4 // W
        update_peak = max(update_peak + head_grad, grads)
    total = held + max(sampling_peak, update_peak)
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
        "micro_batch": B,
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
        f"({p['trainable_parameters']:,} trainable), per process of {p['world_size']}",
        f"  prompts {p['prompt_tokens']} tokens ({p['prompt_tokens_from']}), completions "
        f"{p['completion_tokens']}, {p['completions_per_rank_per_round']} completions a round, "
        f"micro-batch {p['micro_batch']}",
    ]
    for name, n in p["bytes"].items():
        lines.append(f"  {name:<28}{mib(n)}")
    checkpointing = "with" if p["gradient_checkpointing"] else "without"
    lines += [
        f"  {'sampling peak':<28}{mib(p['sampling_peak'])}",
        f"  {'update peak':<28}{mib(p['update_peak'])}  ({checkpointing} gradient checkpointing)",
        f"  {'total (static + larger peak)':<28}{mib(p['total'])}",
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
