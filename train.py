"""GRPO training, top to bottom as the algorithm.

    python train.py                                   # embedded default: tiny model, CPU, ~30 seconds
    python train.py --config small.py --learning_rate=2e-6
    torchrun --nproc_per_node 8 train.py --config small.py

One *round* of GRPO (train_round; train() is setup, then rounds with log / eval / save between them):
    prompts -> G completions each (rollout.py) -> rewards -> group advantages
    -> old log-probs (only when the update is off-policy) -> reference log-probs (only when beta > 0)
    -> micro-batched grpo_step with gradient accumulation -> clip -> AdamW step -> log / eval / checkpoint

Batch arithmetic (config.Schedule, printed at the start of every run): each optimizer step trains on
`prompts_per_step` prompts x `num_generations` completions (all ranks together), in micro-batches of
`micro_batch_size` completions with gradient accumulation. A round samples `steps_per_generation`
micro-batches at once (TRL's meaning) and replays them `num_iterations` times (TRL's mu); `step`
counts optimizer steps, as TRL's global_step does.

With use_peft (TRL's LoRA settings, nanogrpo/lora.py) only the adapters train; the reference model is
the policy with its adapters off (no second copy), checkpoints hold the adapter in PEFT's format, and
merge_adapter writes the merged full model at the end.

Left out on purpose (TRL has them): vLLM generation and its importance-sampling correction, the
entropy bonus.
Known gap: with sync_ref_model (TR-DPO) the synced reference weights are not checkpointed, so a
resumed run restarts from the initial reference model.
"""

import json
import math
import os
import re
import shlex
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from nanogrpo import dist, lora
from nanogrpo.config import ConfigError, Schedule, TrainConfig, load_config
from nanogrpo.data import PromptSampler, check_prompts, check_reward_columns, columns_of, load_dataset
from nanogrpo.grpo import LossConfig, group_advantages, grpo_step, nanstd
from nanogrpo.logprobs import token_logprobs
from nanogrpo import checkpoint
from nanogrpo.model import ModelConfig, Transformer
from nanogrpo.rewards import RewardError, resolve_reward_funcs, score_completions, total_reward
from nanogrpo.rollout import Rollout, resolve_tools, rollout
from nanogrpo.tokenizer import Tokenizer, char_level_tokenizer

# -----------------------------------------------------------------------------
# Setup: model, tokenizer, optimizer, data


def ensure_tiny_checkpoint(cfg: TrainConfig, info: dist.DistInfo):
    """For the embedded default: build a random model + char-level tokenizer and save them in HF
    format at cfg.model, so the run then loads them like any other checkpoint. The directory records
    what built it (init.json); when init_model, the characters or the seed change, it is rebuilt
    rather than silently reused. A checkpoint there that this function did not write is left alone."""
    if cfg.init_model is None:
        return
    recipe = {"init_model": cfg.init_model, "init_tokenizer_chars": cfg.init_tokenizer_chars, "seed": cfg.seed}
    marker = os.path.join(cfg.model, "init.json")
    if os.path.exists(os.path.join(cfg.model, "config.json")):
        if not os.path.exists(marker) or checkpoint.read_json(marker) == recipe:
            return
        dist.print0(f"{cfg.model} was built from another init_model/init_tokenizer_chars/seed: rebuilding it")
    if info.is_main:
        tok = char_level_tokenizer(cfg.init_tokenizer_chars)
        torch.manual_seed(cfg.seed)
        model = Transformer(ModelConfig(vocab_size=tok.vocab_size, **cfg.init_model))
        with checkpoint.atomic_dir(cfg.model) as tmp:
            checkpoint.write_model(tmp, model.config, model.state_dict(), tokenizer=tok, generation_config={
                "eos_token_id": sorted(tok.eos_token_ids), "pad_token_id": tok.pad_token_id})
            checkpoint.write_json(os.path.join(tmp, "init.json"), recipe)
    dist.barrier(info)


def load_policy(path: str, cfg: TrainConfig, info: dist.DistInfo, lora_settings: dict | None = None):
    """The model in fp32 master weights (bf16 compute on CUDA), sharded with FSDP2 when world > 1;
    with lora_settings, fresh LoRA adapters on it (a PEFT adapter directory brings its own)."""
    return checkpoint.load_model(path, dtype=torch.float32, device=info.device, info=info,
                                 mixed_precision=cfg.bf16(info.device), lora_settings=lora_settings)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning-rate multiplier: linear warmup, then constant or cosine decay to 0 at max_steps."""
    warmup = cfg.warmup_steps or int(cfg.warmup_ratio * cfg.max_steps)
    if step < warmup:
        return (step + 1) / warmup
    if cfg.lr_scheduler == "cosine":
        progress = (step - warmup) / max(1, cfg.max_steps - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return 1.0


def round_seed(cfg: TrainConfig, rnd: int, rank: int, salt: int = 0) -> int:
    """A seed for one round of one rank: sampling is reproducible and resume needs no RNG state."""
    return (cfg.seed * 1_000_003 + rnd * 7919 + rank * 104_729 + salt) % (2**63)


# -----------------------------------------------------------------------------
# Setup: everything a run holds between rounds


@dataclass
class Run:
    """The state of a run between rounds: what setup() builds and the loop reads and advances."""

    cfg: TrainConfig
    info: dist.DistInfo
    sched: Schedule  # every derived batch count (printed at the start)
    tok: Tokenizer
    model: torch.nn.Module  # the policy (FSDP2-sharded when world_size > 1)
    ref: torch.nn.Module | None  # the reference model, only when beta > 0 without LoRA (else adapters off)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    loss_cfg: LossConfig
    reward_funcs: list  # [(name, fn)]
    reward_weights: torch.Tensor  # [K]
    tools: dict  # {name: function} the policy may call (empty = single-turn completions)
    prompts: PromptSampler  # the round's prompts, all ranks together (resumable)
    eval_rows: list | None
    autocast: object  # bf16 autocast context on CUDA, a no-op otherwise
    step: int = 0  # optimizer steps done
    history: list = field(default_factory=list)  # per-step metrics (also out_dir/metrics.jsonl)
    written: list = field(default_factory=list)  # checkpoints this run lineage wrote, oldest first
    resume_source: str | None = None  # the checkpoint resumed from: never pruned
    samples: list = field(default_factory=list)  # a few (prompt, completion, reward) of the last round
    reporters: list = field(default_factory=list)  # report_to's trackers: function(metrics, step)
    pending: list = field(default_factory=list)  # the current round's per-step records, not yet logged
    round_prompts_state: dict | None = None  # the prompt sampler where the current round began
    round_start_step: int = 0  # the step the current round began at
    started: tuple = (0.0, 0)  # (time, step) when this process started training: for the ETA
    warned: set = field(default_factory=set)  # warnings already printed
    zero_spread_steps: int = 0  # consecutive steps in which every group's rewards were all equal


def clear_out_dir(cfg: TrainConfig, info: dist.DistInfo):
    """A fresh run never silently replaces another: an out_dir holding what train.py writes (metrics.jsonl,
    checkpoint-<step>) is an error, unless overwrite_output_dir asks to delete those (only those)."""
    if not os.path.isdir(cfg.out_dir):
        return
    names = sorted(n for n in os.listdir(cfg.out_dir) if re.fullmatch(r"metrics\.jsonl|checkpoint(-\d+)?(\.tmp)?", n))
    if not names:
        return
    if not cfg.overwrite_output_dir:
        raise ConfigError(f"out_dir={cfg.out_dir!r} holds a run ({', '.join(names[:4])}): continue it with "
                          "--resume=true, start over with --overwrite_output_dir=true (deletes them), or choose "
                          "another --out_dir")
    if info.is_main:
        for name in names:
            path = os.path.join(cfg.out_dir, name)
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
    dist.barrier(info)


IGNORED_ON_RESUME = {"learning_rate": "the optimizer's", "adam_beta1": "the optimizer's", "adam_beta2": "the optimizer's",
                     "adam_epsilon": "the optimizer's", "weight_decay": "the optimizer's",
                     "model": "the checkpoint's weights (the reference model and tokenizer do load it)"}


def report_changes(saved: dict, cfg: TrainConfig):
    """On resume, name every setting that differs from the checkpoint's run, and which of them are
    ignored because the checkpoint's state wins."""
    now = asdict(cfg)
    for key in sorted(k for k in now if k in saved and saved[k] != now[k] and k not in ("resume", "max_steps")):
        ignored = f" (ignored: {IGNORED_ON_RESUME[key]} is restored)" if key in IGNORED_ON_RESUME else ""
        dist.print0(f"note: {key} was {saved[key]!r} in the checkpoint's run, now {now[key]!r}{ignored}")


def open_reporters(cfg: TrainConfig, info: dist.DistInfo) -> list:
    """report_to's experiment trackers (main process only), each a function(metrics, step). Metrics
    are named as TRL logs them: train/<name> (learning_rate for lr), eval/<name> as they are."""
    def names(m):
        return {(k if k.startswith("eval/") else "train/" + ("learning_rate" if k == "lr" else k)): v
                for k, v in m.items() if isinstance(v, (int, float)) and k != "step"}

    out = []
    for name in (cfg.reporters() if info.is_main else []):
        try:
            if name == "tensorboard":
                from torch.utils.tensorboard import SummaryWriter
                writer = SummaryWriter(os.path.join(cfg.out_dir, "runs"))
                out.append(lambda m, step: [writer.add_scalar(k, v, step) for k, v in names(m).items()] + [writer.flush()])
            elif name == "wandb":
                import wandb
                wb = wandb.init(project=os.environ.get("WANDB_PROJECT", "nanogrpo"), config=asdict(cfg), dir=cfg.out_dir)
                out.append(lambda m, step: wb.log(names(m), step=step))
            else:
                import trackio
                trackio.init(project=os.environ.get("TRACKIO_PROJECT", "nanogrpo"), config=asdict(cfg))
                out.append(lambda m, step: trackio.log(names(m), step=step))
        except ImportError as e:
            raise ConfigError(f"report_to={name!r}, but {name} cannot be imported ({e}): pip install {name}, "
                              "or use --report_to=none") from None
    return out


def setup(cfg: TrainConfig) -> Run:
    """Processes, model (+ reference), tokenizer, optimizer, reward functions, data; restores the
    trainer state when resuming."""
    info = dist.setup(cfg.device)
    cfg.validate(info.world_size)
    if cfg.temperature <= 0:
        raise ConfigError(f"temperature={cfg.temperature}: training samples, so it must be > 0 (0 = greedy is for sample.py)")
    torch.manual_seed(cfg.seed + info.rank)
    ensure_tiny_checkpoint(cfg, info)
    tok = Tokenizer.from_pretrained(cfg.model)
    ckpt = os.path.join(cfg.out_dir, "checkpoint")
    if isinstance(cfg.resume, str) and cfg.resume.lower() not in ("true", "false"):
        ckpt = cfg.resume  # an explicit checkpoint must exist; resume=True without one starts fresh
        if not os.path.exists(os.path.join(ckpt, "trainer")):
            raise FileNotFoundError(f"resume={ckpt!r}: no trainer state at {ckpt}/trainer; point it at an "
                                    "out_dir/checkpoint written by train.py, or use --resume=true")
    resuming = cfg.resume not in (False, "false") and os.path.exists(os.path.join(ckpt, "trainer"))
    if cfg.resume not in (False, "false") and not resuming:
        dist.print0(f"resume={cfg.resume}: no checkpoint in {cfg.out_dir} yet, so this run starts fresh")
    elif not resuming:
        clear_out_dir(cfg, info)
    model = load_policy(ckpt if resuming else cfg.model, cfg, info, cfg.lora_settings())
    context = model.config.max_position_embeddings
    if cfg.max_completion_length >= context:
        raise ConfigError(f"max_completion_length={cfg.max_completion_length}: the model's context is {context} "
                          "positions and the prompt needs some; lower it")
    model.gradient_checkpointing = cfg.gradient_checkpointing
    peft = hasattr(model, "lora_config")  # use_peft, or cfg.model is a PEFT adapter directory
    if peft and cfg.sync_ref_model:
        raise ConfigError("sync_ref_model is refused with LoRA adapters, as TRL does")
    ref = None
    if cfg.beta > 0 and not peft:  # the reference model exists only when the KL term is on
        ref = load_policy(cfg.model, cfg, info).eval().requires_grad_(False)
    # fused: one kernel for the whole step (0.12 s vs 0.46 s for 135M parameters on 2 CPU cores); FSDP2's
    # sharded parameters keep the default implementation
    optimizer = torch.optim.AdamW(lora.trainable_parameters(model), lr=cfg.learning_rate,
                                  betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.weight_decay,
                                  eps=cfg.adam_epsilon, fused=info.world_size == 1)
    reward_funcs = resolve_reward_funcs(cfg.reward_funcs, max_completion_length=cfg.max_completion_length,
                                        soft_punish_cache=cfg.soft_punish_cache, batch_size=cfg.micro_batch_size,
                                        reward_processing_classes=cfg.reward_processing_classes, device=info.device,
                                        dtype=torch.bfloat16 if cfg.bf16(info.device) else torch.float32)
    rows = load_dataset(cfg.dataset, split=cfg.dataset_split, seed=cfg.seed)
    eval_rows = None
    if cfg.eval_dataset and cfg.eval_every:
        eval_rows = load_dataset(cfg.eval_dataset, split=cfg.eval_split, seed=cfg.seed)[: cfg.eval_size]
    elif cfg.eval_dataset or cfg.eval_every:
        dist.print0(f"warning: eval_dataset={cfg.eval_dataset!r} with eval_every={cfg.eval_every}: no evaluation "
                    "(both are needed)")
    for source, checked in ((cfg.dataset, rows), (cfg.eval_dataset, eval_rows or [])):
        check_prompts(checked, source, tok, context - cfg.max_completion_length)
        check_reward_columns(reward_funcs, checked, source)
    sched = cfg.schedule(info.world_size)
    run = Run(cfg, info, sched, tok, model, ref, optimizer,
              torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, cfg)), LossConfig(**cfg.loss_config()),
              reward_funcs, torch.tensor(cfg.reward_weights or [1.0] * len(reward_funcs), device=info.device),
              resolve_tools(cfg.tools),
              PromptSampler(rows, sched.prompts_per_round, seed=cfg.seed), eval_rows,
              dist.autocast(info, cfg.bf16(info.device)))
    if resuming:
        state = checkpoint.load_trainer_state(ckpt, model, optimizer, info)
        run.step, run.history = state["step"], state["history"]
        run.scheduler.load_state_dict(state["scheduler"])
        run.prompts.load_state_dict(state["prompts"])
        run.written = [n for n in state.get("checkpoints", []) if os.path.isdir(os.path.join(cfg.out_dir, n))]
        run.resume_source = os.path.realpath(ckpt)  # never pruned (the link moves on)
        dist.print0(f"resumed from {ckpt} at step {run.step}")
        report_changes(checkpoint.read_json(os.path.join(ckpt, "train_config.json")), cfg)
    if info.is_main:
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, "metrics.jsonl"), "w") as f:  # rewritten from history on resume
            f.writelines(json.dumps(m) + "\n" for m in run.history)
    run.reporters = open_reporters(cfg, info)
    trainable = f" ({sum(p.numel() for p in optimizer.param_groups[0]['params']) / 1e6:.3f}M trainable: LoRA)"
    dist.print0(f"nanogrpo: {cfg.model} | {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params"
                f"{trainable if peft else ''} | {info.world_size} process(es) on {info.device}\n{sched.table()}")
    return run


# -----------------------------------------------------------------------------
# One round: prompts -> completions (rollout.py) -> rewards -> advantages


def round_prompts(run: Run) -> list[dict]:
    """This rank's share of the round's prompts (each prompt's G samples stay on one rank)."""
    run.round_prompts_state, run.round_start_step = run.prompts.state_dict(), run.step  # for a Ctrl-C save
    rows = run.prompts.next_batch()
    per_rank = len(rows) // run.info.world_size
    return rows[run.info.rank * per_rank:(run.info.rank + 1) * per_rank]


def score(ro: Rollout, reward_funcs) -> torch.Tensor:
    """Call every reward function with TRL's convention: prompts and dataset columns repeated per
    completion. -> rewards [n, K] float32, NaN = not scored."""
    G = ro.num_generations
    columns = {k: [v for v in vals for _ in range(G)] for k, vals in columns_of(ro.rows).items()}
    return score_completions(reward_funcs, ro.prompts, ro.completions, ro.completion_token_ids, columns)


def compute_advantages(run: Run, ro: Rollout, rewards: torch.Tensor) -> torch.Tensor:
    """Gather every rank's rewards (groups are normalised over the whole batch when scale_rewards is
    "batch"), compute group advantages, fill ro.advantages with this rank's share.
    -> the gathered rewards [N_global, K]."""
    cfg, info = run.cfg, run.info
    rewards = dist.all_gather_rows(rewards.to(info.device), info).float()  # [N_global, K]
    advantages = group_advantages(rewards, ro.num_generations, reward_weights=run.reward_weights,
                                  scale_rewards=cfg.scale_rewards,
                                  multi_objective_aggregation=cfg.multi_objective_aggregation)
    n = len(ro.completions)
    ro.advantages = advantages[info.rank * n:(info.rank + 1) * n]
    return rewards


def generation_metrics(run: Run, ro: Rollout, rewards: torch.Tensor) -> dict:
    """TRL's reward and completion-length metrics, over the whole generation batch on all ranks.
    rewards: [N_global, K] (all ranks)."""
    total = total_reward(rewards, run.reward_weights)  # [N], NaN = unscored
    ok = ~torch.isnan(total)
    group_std = nanstd(total.view(-1, ro.num_generations), dim=1)  # [N/G], NaN where < 2 scored
    lengths = dist.all_gather_rows(ro.completion_lengths.float(), run.info)
    truncated = dist.all_gather_rows(ro.truncated.float(), run.info)
    m = {"reward": total[ok].mean().item(), "reward_std": total[ok].std().item() if ok.sum() > 1 else 0.0,
         "frac_reward_zero_std": torch.isclose(group_std, torch.zeros_like(group_std)).float().mean().item(),
         "completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
         "completions/max_length": lengths.max().item(), "completions/clipped_ratio": truncated.mean().item()}
    if run.tools:  # TRL's tool metrics: calls per completion, failed share of the calls; turns per completion
        calls, failures = (dist.all_reduce_sum(torch.tensor(float(x), device=run.info.device), run.info).item()
                           for x in (ro.tool_calls, ro.tool_failures))
        m["tools/call_frequency"] = calls / len(total)
        m["tools/failure_frequency"] = failures / calls if calls else 0.0
        m["tools/mean_turns"] = dist.all_gather_rows(ro.turns.float(), run.info).mean().item()
    for k, (name, _) in enumerate(run.reward_funcs):
        col = rewards[:, k][~torch.isnan(rewards[:, k])]
        m[f"rewards/{name}/mean"] = col.mean().item() if len(col) else float("nan")
        m[f"rewards/{name}/std"] = col.std().item() if len(col) > 1 else 0.0
    warn_about_rewards(run, total, m["frac_reward_zero_std"])
    return m


def warn_about_rewards(run: Run, total: torch.Tensor, frac_zero_std: float, patience: int = 10):
    """Say so (once each) when the rewards cannot teach anything: none scored, too large for float32
    statistics (advantages become 0), or no spread within any group for `patience` steps in a row."""
    def warn(key, message):
        if key not in run.warned:
            run.warned.add(key)
            dist.print0(f"warning: {message}")

    if torch.isnan(total).all():
        warn("unscored", "no reward function scored any completion this round (all returned None)")
    elif (largest := total[~torch.isnan(total)].abs().max()) > 1e18:
        warn("overflow", f"rewards up to {largest:.2e} overflow float32 statistics (the group "
             "std becomes inf, advantages 0): rescale the reward functions")
    run.zero_spread_steps = run.zero_spread_steps + 1 if frac_zero_std == 1.0 else 0
    if run.zero_spread_steps >= patience:
        warn("zero_spread", f"every group's rewards were identical for {patience} steps in a row: advantages are 0 "
             "and nothing is learned; make the task easier, the reward more graded, or num_generations larger")


def shown_samples(ro: Rollout, rewards: torch.Tensor, weights, k: int = 2) -> list[tuple[str, str, float]]:
    """(prompt, completion, weighted total reward) of the first sample of the first k prompts."""
    G, out = ro.num_generations, []
    for i in range(0, min(k * G, len(ro.prompts)), G):
        p, c = ro.prompts[i], ro.completions[i]
        out.append((p if isinstance(p, str) else p[-1]["content"], c if isinstance(c, str) else conversation_text(c),
                    total_reward(rewards[i:i + 1], weights).item()))
    return out


def conversation_text(messages: list[dict]) -> str:
    """A completion's messages on one line: assistant text, its tool calls as [call name {args}], tool results
    as [tool: result]."""
    parts = []
    for m in messages:
        calls = [f"[call {c['function']['name']} {json.dumps(c['function']['arguments'])}]"
                 for c in m.get("tool_calls") or []]
        parts += [m.get("content") or ""] + calls if m["role"] == "assistant" else [f"[{m['role']}: {m['content']}]"]
    return " ".join(p for p in parts if p)


# -----------------------------------------------------------------------------
# Log-probs of the sampled tokens under a model (policy at sampling time, reference)


@torch.no_grad()
def batch_logprobs(model, ro: Rollout, cfg, autocast, vocab_size):
    """Per-token log-probs [n,C] of the completions, micro-batch by micro-batch, without gradient."""
    was_training = model.training
    model.eval()
    parts = []
    for i in range(0, len(ro.input_ids), cfg.micro_batch_size):
        sl = slice(i, i + cfg.micro_batch_size)
        with autocast:
            logps, _ = token_logprobs(model, ro.input_ids[sl], ro.attention_mask[sl], ro.completion_mask[sl],
                                      temperature=cfg.temperature, vocab_size=vocab_size)
        parts.append(logps)
    model.train(was_training)
    return torch.cat(parts)


# -----------------------------------------------------------------------------
# The update: micro-batched grpo_step with gradient accumulation


def micro_batches(run: Run, rnd: int) -> list[torch.Tensor]:
    """The round's rows shuffled once (seeded by the round), cut into micro-batches of index tensors."""
    n, size = run.sched.completions_per_round_per_rank, run.cfg.micro_batch_size
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(round_seed(run.cfg, rnd, run.info.rank, 1)))
    return [perm[i:i + size].to(run.info.device) for i in range(0, n, size)]


# A backward costs ~4 FLOPs per parameter and token. Skipping it pays once that outweighs the extra forward call:
# ~10 ms of per-op overhead on a CPU (the tiny default's update got 15% slower without this floor), a few ms of
# kernel launches on a GPU, where 1e12 FLOPs take about as long (an estimate: unmeasured, no GPU here).
SKIP_MIN_FLOPS = {"cpu": 1e9, "cuda": 1e12}


def policy_logprobs(model, ro: Rollout, idx, cfg, beta: float, world_size: int, vocab_size=None):
    """token_logprobs of rows `idx` [n] -> (logps, entropies) [n,C], with a gradient only where one flows.

    With beta = 0 every loss type's per-token loss is the row's advantage times something, so a row whose
    advantage is exactly 0 (its group's completions all scored alike) adds nothing to the gradient. Such
    rows are scored under no_grad: no backward, no stored activations. Their log-probs and entropies still
    go to grpo_step, so the loss, the logged entropy and clip ratios, and the top_entropy_quantile threshold
    are TRL's. One row always keeps its gradient, so every parameter gets a (zero) gradient and AdamW steps
    as TRL's does; with several ranks the no_grad forward always runs (on a throwaway row if need be),
    so that every rank makes the same FSDP collectives. The split costs a second forward call, so it is made
    only when the backward it saves is worth more (SKIP_MIN_FLOPS): never for the embedded tiny model."""
    def score(rows):
        return token_logprobs(model, ro.input_ids[rows], ro.attention_mask[rows], ro.completion_mask[rows],
                              temperature=cfg.temperature, vocab_size=vocab_size)

    free = ro.advantages[idx] == 0 if beta == 0 else torch.zeros(len(idx), dtype=torch.bool, device=idx.device)
    if free.any():
        saved_flops = 4 * sum(p.numel() for p in model.parameters()) * int(free.sum()) * ro.input_ids.shape[1]
        if saved_flops < SKIP_MIN_FLOPS.get(idx.device.type, SKIP_MIN_FLOPS["cuda"]):
            free[:] = False
    if free.all():
        free[0] = False
    if not free.any() and world_size == 1:
        return score(idx)
    with torch.no_grad():
        free_logps, free_entropies = score(idx[free] if free.any() else idx[:1])
    logps, entropies = score(idx[~free])
    if not free.any():
        return logps, entropies
    order = torch.cat([(~free).nonzero()[:, 0], free.nonzero()[:, 0]]).argsort()  # back to idx's row order
    return torch.cat([logps, free_logps])[order], torch.cat([entropies, free_entropies])[order]


def update(model, optimizer, ro: Rollout, micro_rows, cfg, loss_cfg, info, autocast, spg, vocab_size=None) -> dict:
    """One optimizer step over `micro_rows` (a list of GA index tensors into the rollout's rows).
    `spg` = micro-batches per generation round (TRL's steps_per_generation), which sets the
    dapo/cispo/vespo normalizer. Returns the loss metrics, averaged over micro-batches."""
    GA = len(micro_rows)
    sums: dict[str, list[float]] = {}
    total_loss = 0.0
    for k, idx in enumerate(micro_rows):
        dist.gradient_sync(model, enabled=(k == GA - 1))
        with autocast:
            logps, entropies = policy_logprobs(model, ro, idx, cfg, loss_cfg.beta, info.world_size, vocab_size)
        loss, metrics = grpo_step(
            logps.float(), None if ro.old_logps is None else ro.old_logps[idx],
            None if ro.ref_logps is None else ro.ref_logps[idx], ro.advantages[idx], ro.completion_mask[idx],
            loss_cfg, num_items=ro.num_items, grad_accum=GA, world_size=info.world_size,
            entropies=entropies.float(), steps_per_generation=spg)
        loss.backward()
        total_loss += loss.item()
        for key, value in metrics.items():
            sums.setdefault(key, []).append(value)
    grad_norm = dist.clip_grad_norm(model, cfg.max_grad_norm or 0.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    out = {k: sum(v) / len(v) for k, v in sums.items()}
    out.update({"loss": total_loss, "grad_norm": grad_norm})
    return out


def updates(run: Run, ro: Rollout, rnd: int) -> list[dict]:
    """The round's optimizer steps: the same micro-batches replayed num_iterations times
    (Schedule.replay_order), the TR-DPO reference sync after each step when due. -> one record per step."""
    cfg, GA = run.cfg, run.sched.micro_batches_per_step
    micro, records = micro_batches(run, rnd), []
    for j in run.sched.replay_order()[: cfg.max_steps - run.step]:
        t0 = time.time()
        m = update(run.model, run.optimizer, ro, micro[j:j + GA], cfg, run.loss_cfg, run.info, run.autocast,
                   run.sched.steps_per_generation, run.tok.vocab_size)
        run.scheduler.step()
        run.step += 1
        if run.ref is not None and cfg.sync_ref_model and run.step % cfg.ref_model_sync_steps == 0:
            sync_ref_model(run.ref, run.model, cfg.ref_model_mixup_alpha)
        m.update({"step": run.step, "lr": run.scheduler.get_last_lr()[0], "time/update": time.time() - t0})
        records.append(m)
    return records


@torch.no_grad()
def sync_ref_model(ref, policy, alpha: float):
    """TR-DPO: ref <- alpha * policy + (1 - alpha) * ref."""
    for r, p in zip(ref.parameters(), policy.parameters()):
        r.mul_(1 - alpha).add_(p.detach(), alpha=alpha)


# -----------------------------------------------------------------------------
# Evaluation and checkpoints


def eval_indices(num_rows: int, rank: int, world_size: int) -> list[int]:
    """The eval rows one rank scores: a contiguous block of ceil(num_rows / world_size), so every rank
    has the same count (all_gather needs equal shapes). Past the end the indices wrap around; the
    gathered results are cut back to num_rows, so each row counts exactly once."""
    n = -(-num_rows // world_size)
    return [(rank * n + i) % num_rows for i in range(n)]


@torch.no_grad()
def evaluate(model, tok, rows, cfg, reward_funcs, info, autocast, tools=None) -> dict:
    """One sample per eval prompt (at the training temperature): mean reward per function, and
    pass@1 = fraction whose first reward function gives >= 1. Every eval row counts exactly once,
    on any number of ranks."""
    num_rows = len(rows)
    rows = [rows[i] for i in eval_indices(num_rows, info.rank, info.world_size)]
    generator = torch.Generator(info.device).manual_seed(round_seed(cfg, 0, info.rank, salt=17))
    rewards = score(rollout(model, tok, rows, cfg, 1, generator, autocast, tools), reward_funcs)
    rewards = dist.all_gather_rows(rewards.to(info.device), info)[:num_rows]  # drop the wrapped-around padding
    m = {f"eval/rewards/{name}/mean": torch.nanmean(rewards[:, k]).item() for k, (name, _) in enumerate(reward_funcs)}
    m["eval/reward"] = torch.nanmean(total_reward(rewards, cfg.reward_weights)).item()  # unscored rows excluded
    m["eval/pass@1"] = (rewards[:, 0] >= 1.0).float().mean().item()
    return m


def save(run: Run):
    """checkpoint-<step> (policy, tokenizer, optimizer, trainer state), then prune to save_total_limit."""
    cfg = run.cfg
    run.written.append(f"checkpoint-{run.step}")
    state = {"step": run.step, "scheduler": run.scheduler.state_dict(), "prompts": run.prompts.state_dict(),
             "history": run.history, "checkpoints": run.written}
    checkpoint.save_checkpoint(cfg.out_dir, run.step, run.model, run.optimizer, run.tok, state, asdict(cfg), run.info)
    if run.info.is_main:
        run.written = checkpoint.prune_checkpoints(cfg.out_dir, run.written, cfg.save_total_limit,
                                                   keep=run.resume_source)


def save_merged(run: Run):
    """merge_adapter: the adapters folded into the base weights, a full HF checkpoint at out_dir/merged."""
    state = dist.full_state_dict(run.model)  # every rank gathers, rank 0 writes
    if run.info.is_main:
        with checkpoint.atomic_dir(os.path.join(run.cfg.out_dir, "merged")) as tmp:
            checkpoint.write_model(tmp, run.model.config, lora.merged_state_dict(state, run.model.lora_config),
                                   run.model.generation_config, run.tok)
    dist.barrier(run.info)


def log(run: Run):
    """Move the round's records (run.pending) to history and metrics.jsonl (NaN written as null, never
    as a number), send them to report_to's trackers, print the step lines with an ETA."""
    records = [{k: None if isinstance(v, float) and math.isnan(v) else v for k, v in m.items()} for m in run.pending]
    run.pending = []
    run.history.extend(records)
    if not run.info.is_main:
        return
    with open(os.path.join(run.cfg.out_dir, "metrics.jsonl"), "a") as f:
        f.writelines(json.dumps(m) + "\n" for m in records)
    t0, step0 = run.started
    eta = (time.time() - t0) / max(1, run.step - step0) * (run.cfg.max_steps - run.step)
    for m in records:
        for report in run.reporters:
            report(m, m["step"])
        if m["step"] % run.cfg.log_every == 0 or m["step"] == run.cfg.max_steps:
            print_step(m, run.cfg.max_steps, eta, run.samples if run.cfg.log_completions else [])


# -----------------------------------------------------------------------------
# The loop


def train_round(run: Run) -> list[dict]:
    """One generation round: sample, score, advantages, (old/ref log-probs), the round's optimizer
    steps. -> one metrics record per optimizer step."""
    cfg, info = run.cfg, run.info
    t_round, rnd = time.time(), run.step // run.sched.updates_per_round
    generator = torch.Generator(info.device).manual_seed(round_seed(cfg, rnd, info.rank))
    torch.manual_seed(round_seed(cfg, rnd, info.rank, 2))  # LoRA dropout's masks: per round, so resume is exact
    ro = rollout(run.model, run.tok, round_prompts(run), cfg, cfg.num_generations, generator, run.autocast,
                 run.tools)
    t_sample = time.time() - t_round
    local = score(ro, run.reward_funcs)  # [n, K] this rank's rewards
    rewards = compute_advantages(run, ro, local)  # [N_global, K]
    ro.num_items = dist.all_reduce_sum(ro.completion_mask.sum(), info)
    gen_metrics = generation_metrics(run, ro, rewards)
    run.samples = shown_samples(ro, local, run.reward_weights)
    t_score = time.time() - t_round - t_sample
    if run.sched.off_policy:  # the policy changes within the round: freeze its sampling-time log-probs
        ro.old_logps = batch_logprobs(run.model, ro, cfg, run.autocast, run.tok.vocab_size)
    if run.ref is not None:  # beta > 0: the reference model
        ro.ref_logps = batch_logprobs(run.ref, ro, cfg, run.autocast, run.tok.vocab_size)
    elif cfg.beta > 0:  # with LoRA: the policy with its adapters off
        with lora.disable_adapters(run.model):
            ro.ref_logps = batch_logprobs(run.model, ro, cfg, run.autocast, run.tok.vocab_size)
    t_logps = time.time() - t_round - t_sample - t_score
    records = updates(run, ro, rnd)
    round_time = time.time() - t_round
    tokens = dist.all_reduce_sum(torch.tensor(float(ro.num_tokens()), device=info.device), info).item()
    for m in records:
        m.update(gen_metrics)
        m.update({"time/sample": t_sample, "time/score": t_score, "time/update": m["time/update"] + t_logps / len(records),
                  "step_time": round_time / len(records), "tokens_per_sec": tokens / round_time})
    return records


def crossed(every: int, before: int, after: int) -> bool:
    """Whether a multiple of `every` (0 = never) lies in (before, after]: an eval or save is due."""
    return every > 0 and after // every > before // every


def train(cfg: TrainConfig) -> list[dict]:
    """Run GRPO as configured; returns the list of per-step metrics (also in out_dir/metrics.jsonl)."""
    run = setup(cfg)
    if run.step >= cfg.max_steps:
        dist.print0(f"nothing to do: the checkpoint is at step {run.step} and max_steps={cfg.max_steps}; "
                    "raise --max_steps to train further")
        return run.history
    run.started = (time.time(), run.step)
    try:
        while run.step < cfg.max_steps:
            first_step = run.step
            run.pending = train_round(run)  # rollout -> score -> advantages -> update
            run.round_prompts_state = None  # the round's optimizer steps are all taken
            if run.eval_rows and (crossed(cfg.eval_every, first_step, run.step) or run.step == cfg.max_steps):
                try:
                    run.pending[-1].update(evaluate(run.model, run.tok, run.eval_rows, cfg, run.reward_funcs,
                                                    run.info, run.autocast, run.tools))
                except Exception:
                    log(run)
                    save(run)  # what was trained is kept even when the evaluation fails
                    raise
            log(run)
            if crossed(cfg.save_every, first_step, run.step) or run.step == cfg.max_steps:
                save(run)  # at round boundaries, so a resumed run continues exactly
    except KeyboardInterrupt:
        save_on_interrupt(run)
        raise
    if cfg.merge_adapter:
        save_merged(run)
    summarize(run)
    dist.teardown()
    return run.history


def save_on_interrupt(run: Run):
    """Ctrl-C: keep what was trained and say how to continue. Interrupted inside a round before its
    first optimizer step (always so with on-policy updates: the step is the round's last act), the
    checkpoint records the prompt sampler where the round began, and the resumed run redoes that
    round exactly."""
    cfg = run.cfg
    mid_round = run.round_prompts_state is not None
    why = ("several processes cannot save together after an interrupt" if run.info.world_size > 1 else
           "no optimizer step was taken yet" if run.step == 0 else
           "it stopped between two optimizer steps of one round" if mid_round and run.step > run.round_start_step
           else None)
    if why:
        dist.print0(f"\ninterrupted at step {run.step}/{cfg.max_steps}: not saved ({why}); the latest checkpoint "
                    f"is {os.path.join(cfg.out_dir, 'checkpoint')}")
        return
    log(run)  # a finished round's records, when the interrupt came during its evaluation
    if not (run.written and run.written[-1] == f"checkpoint-{run.step}"):
        if mid_round:
            run.prompts.load_state_dict(run.round_prompts_state)
        save(run)
    args = [a for a in (COMMAND or ["train.py"]) if not a.startswith(("--resume", "--overwrite_output_dir"))]
    dist.print0(f"\ninterrupted at step {run.step}/{cfg.max_steps}: saved {cfg.out_dir}/checkpoint-{run.step}. "
                f"Continue with:\n  python {shlex.join(args + ['--resume=true'])}")


def print_step(m: dict, max_steps: int, eta_s: float, samples):
    """One console line per optimizer step (and a few completions when asked)."""
    def num(key, spec):
        return "n/a" if m.get(key) is None else format(m[key], spec)

    kl = f" kl {num('kl', '.4f')} |" if "kl" in m else ""
    ev = f" | eval {num('eval/reward', '.3f')}" if "eval/reward" in m else ""
    print(f"step {m['step']:4d}/{max_steps} | reward {num('reward', '.3f')} ± {num('reward_std', '.3f')} |{kl} "
          f"loss {m['loss']:+.4f} | len {m['completions/mean_length']:.1f} | grad {m['grad_norm']:.3f} | "
          f"lr {m['lr']:.2e} | {m['step_time']:.2f}s (sample {m['time/sample']:.2f}, update "
          f"{m['time/update']:.2f}) | eta {eta_s / 60:.1f} min{ev}", flush=True)
    for prompt, completion, reward in samples:
        print(f"    {prompt!r} -> {completion!r} (reward {reward:.2f})")


def summarize(run: Run):
    """The end of a run: mean reward over the first and last tenth, a few completions of the last
    round with their rewards, the reward curve (out_dir/reward.png), and a sample command that works."""
    cfg, history = run.cfg, run.history
    if not run.info.is_main or not history:
        return
    k = max(1, len(history) // 10)
    rewards = [m["reward"] for m in history if m["reward"] is not None]
    start, end = sum(rewards[:k]) / max(1, len(rewards[:k])), sum(rewards[-k:]) / max(1, len(rewards[-k:]))
    print(f"done: {len(history)} steps, mean reward {start:.3f} -> {end:.3f} (first/last {k} steps). Last round:")
    for prompt, completion, reward in run.samples:
        print(f"    {prompt!r} -> {completion!r} (reward {reward:.2f})")
    ckpt = os.path.join(cfg.out_dir, "checkpoint")
    prompt = run.prompts.rows[0]["prompt"]
    text = f"--prompt {shlex.quote(prompt)}" if isinstance(prompt, str) else f"--chat {shlex.quote(prompt[-1]['content'])}"
    print(f"Checkpoint: {ckpt}\nReward curve: {plot_rewards(cfg)}\n"
          f"Sample from it: python sample.py --model {ckpt} {text}", flush=True)


def plot_rewards(cfg: TrainConfig) -> str:
    """Draw out_dir/reward.png from metrics.jsonl with bench/plot.py when matplotlib is installed;
    otherwise say how to get it."""
    metrics, png = os.path.join(cfg.out_dir, "metrics.jsonl"), os.path.join(cfg.out_dir, "reward.png")
    try:
        import matplotlib  # noqa: F401
        from bench import plot
    except ImportError:
        return f"pip install matplotlib, then: python bench/plot.py {metrics} -o {png}"
    plot.main([metrics, "-o", png, "--quiet"])
    return png


def help_text() -> str:
    """Every key with its default and comment, grouped as in TrainConfig (for `train.py --help`)."""
    import inspect
    lines = ["usage: train.py [--config FILE] [--key=value ...]   (FILE: a built-in of configs/ or your own .py)",
             "Command-line values override the file's. Keys, with TrainConfig's defaults (a config file sets its own):"]
    body = inspect.getsource(TrainConfig).split('"""', 2)[2].split("# --- derived sizes")[0]
    for raw in body.splitlines():
        line = raw.strip()
        if line.startswith("#  "):  # the continuation of a field's comment
            lines.append(f"      {line[1:].strip()}")
        elif line.startswith("#"):  # a group title
            lines.append(f"\n  {line[1:].strip()}:")
        elif ":" in line and "=" in line:
            name = line.split(":")[0]
            default = line.split("=", 1)[1].split("  #")[0].strip()
            if default.startswith("field("):
                default = repr(getattr(TrainConfig(), name))
            comment = line.split("  # ", 1)[1] if "  # " in line else ""
            lines.append(f"  --{name}={default}    {comment}")
    return "\n".join(lines)


COMMAND = None  # the command line of this process, for the resume hint (set when run as a script)


def main(argv: list[str]) -> int:
    """`python train.py [--config FILE] [--key=value ...]`: user errors are one line (the traceback with
    --debug or NANOGRPO_DEBUG=1); Ctrl-C saves and exits with 130."""
    global COMMAND
    debug = "--debug" in argv or os.environ.get("NANOGRPO_DEBUG") == "1"
    argv = [a for a in argv if a != "--debug"]
    COMMAND = ["train.py"] + argv
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    if not any(a == "--config" or a.startswith("--config=") for a in argv):
        argv = ["--config", "tiny"] + argv  # the embedded default (the built-in configs/tiny.py)
    try:
        train(load_config(argv))
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError, RewardError) as e:  # ConfigError is a ValueError
        if debug:
            raise
        print(f"train.py: error: {e}\n(the traceback: add --debug)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
