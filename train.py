"""GRPO training, top to bottom as the algorithm.

    python train.py                                   # embedded default: tiny model, CPU, ~2 minutes
    python train.py --config small.py --learning_rate=2e-6
    torchrun --nproc_per_node 8 train.py --config small.py

One *round* of GRPO:
    prompts -> G completions each (sampler) -> rewards -> group advantages
    -> old log-probs (only when the update is off-policy) -> reference log-probs (only when beta > 0)
    -> micro-batched grpo_step with gradient accumulation -> clip -> AdamW step -> log / eval / checkpoint

Batch arithmetic (config.Schedule, printed at the start of every run): each optimizer step trains on
`prompts_per_step` prompts x `num_generations` completions (all ranks together), in micro-batches of
`micro_batch_size` completions with gradient accumulation. A round samples `steps_per_generation`
micro-batches at once (TRL's meaning) and replays them `num_iterations` times (TRL's mu); `step`
counts optimizer steps, as TRL's global_step does.

Left out on purpose (TRL has them): vLLM generation and its importance-sampling correction, PEFT,
tool calling, the entropy bonus, reward models (any Python function is a reward function).
Known gap: with sync_ref_model (TR-DPO) the synced reference weights are not checkpointed, so a
resumed run restarts from the initial reference model.
"""

import json
import math
import os
import sys
import time

import torch

from nanogrpo import dist
from nanogrpo.config import ConfigError, TrainConfig, load_config
from nanogrpo.data import PromptSampler, columns_of, load_dataset
from nanogrpo.grpo import LossConfig, group_advantages, grpo_step, nanstd
from nanogrpo.logprobs import token_logprobs
from nanogrpo import checkpoint
from nanogrpo.model import ModelConfig, Transformer
from nanogrpo.rewards import resolve_reward_funcs, score_completions, total_reward
from nanogrpo.sampler import generate
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


def load_policy(path: str, cfg: TrainConfig, info: dist.DistInfo):
    """The model in fp32 master weights (bf16 compute on CUDA), sharded with FSDP2 when world > 1."""
    return checkpoint.load_model(path, dtype=torch.float32, device=info.device, info=info,
                                 mixed_precision=cfg.bf16(info.device))


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
# One round: sample, score, compute advantages


def join_prompt_completion(prompt_ids: list[list[int]], completion_ids, pad_id: int, num_generations: int):
    """Left-padded prompts (each repeated G times) followed by the completions.
    -> input_ids [N, P+C], attention_mask [N, P+C] (1 on real prompt tokens and on the completion)."""
    P = max(len(p) for p in prompt_ids)
    N, C = completion_ids.shape
    input_ids = torch.full((N, P + C), pad_id, dtype=torch.long, device=completion_ids.device)
    attention_mask = torch.zeros((N, P + C), dtype=torch.long, device=completion_ids.device)
    for i, p in enumerate(prompt_ids):
        rows = slice(i * num_generations, (i + 1) * num_generations)
        input_ids[rows, P - len(p):P] = torch.tensor(p, device=completion_ids.device)
        attention_mask[rows, P - len(p):] = 1
    input_ids[:, P:] = completion_ids
    return input_ids, attention_mask


def rollout(model, tok, prompt_ids, cfg, num_samples, generator, autocast):
    """num_samples completions per prompt with the config's sampling settings; the parameters are
    gathered once for the whole phase (FSDP), not once per decode step."""
    model.eval()
    with torch.no_grad(), dist.gathered(model), autocast:
        out = generate(model, prompt_ids, num_samples=num_samples, max_new_tokens=cfg.max_completion_length,
                       temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, min_p=cfg.min_p,
                       repetition_penalty=cfg.repetition_penalty, stop_ids=tok.eos_token_ids,
                       pad_id=tok.pad_token_id, generator=generator, vocab_size=tok.vocab_size)
    model.train()
    return out


def score(tok, reward_funcs, rows, out, num_samples):
    """Decode the completions (special tokens skipped) and call every reward function with TRL's
    convention: prompts and dataset columns repeated per completion, completions as strings or as
    assistant messages (conversational prompts). -> rewards [n,K] (NaN = unscored), prompts, completions."""
    prompts = [r["prompt"] for r in rows for _ in range(num_samples)]
    columns = {k: [v for v in vals for _ in range(num_samples)] for k, vals in columns_of(rows).items()}
    ids, completions = tok.decode_completions(out.completion_ids, out.completion_mask)
    if not isinstance(rows[0]["prompt"], str):
        completions = [[{"role": "assistant", "content": c}] for c in completions]
    return score_completions(reward_funcs, prompts, completions, ids, columns), prompts, completions


def sample_and_score(model, tok, rows, cfg, reward_funcs, info, generator, autocast):
    """Sample G completions for each prompt of this rank and score them.
    Returns the batch dict for the update and the generation metrics."""
    G = cfg.num_generations
    prompt_ids = [tok.encode_prompt(r["prompt"]) for r in rows]
    t0 = time.time()
    out = rollout(model, tok, prompt_ids, cfg, G, generator, autocast)
    t_sample = time.time() - t0

    t0 = time.time()
    local_rewards, prompts, completions = score(tok, reward_funcs, rows, out, G)  # [n, K]
    rewards = dist.all_gather_rows(local_rewards.to(info.device), info).float()  # [N_global, K]
    weights = torch.tensor(cfg.reward_weights or [1.0] * len(reward_funcs), device=rewards.device)
    advantages = group_advantages(rewards, G, reward_weights=weights, scale_rewards=cfg.scale_rewards,
                                  multi_objective_aggregation=cfg.multi_objective_aggregation)
    n = len(rows) * G
    advantages = advantages[info.rank * n:(info.rank + 1) * n]  # this rank's groups
    t_score = time.time() - t0

    mask = out.completion_mask.float()
    if cfg.mask_truncated_completions:
        mask = mask * (~out.truncated).float()[:, None]
    input_ids, attention_mask = join_prompt_completion(prompt_ids, out.completion_ids, tok.pad_token_id, G)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "mask": mask, "advantages": advantages,
             "num_items": dist.all_reduce_sum(mask.sum(), info),
             "num_tokens": torch.tensor(float(sum(map(len, prompt_ids)) * G + out.completion_mask.sum().item()),
                                       device=info.device)}
    metrics = generation_metrics(rewards, weights, out, reward_funcs, G, info)
    metrics.update({"time/sample": t_sample, "time/score": t_score})
    shown = total_reward(rewards[: 2 * G: G], weights).tolist()  # the weighted total, as training sees it
    samples = [(p if isinstance(p, str) else p[-1]["content"], c if isinstance(c, str) else c[0]["content"], r)
               for p, c, r in zip(prompts[: 2 * G: G], completions[: 2 * G: G], shown)]
    return batch, metrics, samples


def generation_metrics(rewards, weights, out, reward_funcs, G, info) -> dict:
    """TRL's reward and completion-length metrics, over the whole generation batch on all ranks."""
    total = total_reward(rewards, weights)  # [N], NaN = unscored
    ok = ~torch.isnan(total)
    group_std = nanstd(total.view(-1, G), dim=1)  # [N/G], NaN where < 2 scored
    lengths = dist.all_gather_rows(out.completion_mask.sum(1).float(), info)
    truncated = dist.all_gather_rows(out.truncated.float(), info)
    m = {"reward": total[ok].mean().item(), "reward_std": total[ok].std().item() if ok.sum() > 1 else 0.0,
         "frac_reward_zero_std": torch.isclose(group_std, torch.zeros_like(group_std)).float().mean().item(),
         "completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
         "completions/max_length": lengths.max().item(), "completions/clipped_ratio": truncated.mean().item()}
    for k, (name, _) in enumerate(reward_funcs):
        col = rewards[:, k][~torch.isnan(rewards[:, k])]
        m[f"rewards/{name}/mean"] = col.mean().item() if len(col) else float("nan")
        m[f"rewards/{name}/std"] = col.std().item() if len(col) > 1 else 0.0
    return m


# -----------------------------------------------------------------------------
# Log-probs of the sampled tokens under a model (policy now, policy at sampling time, reference)


@torch.no_grad()
def batch_logprobs(model, batch, cfg, autocast, vocab_size):
    """Per-token log-probs [N,C] of the completions, micro-batch by micro-batch, without gradient."""
    C = batch["mask"].shape[1]
    parts = []
    for i in range(0, len(batch["mask"]), cfg.micro_batch_size):
        sl = slice(i, i + cfg.micro_batch_size)
        with autocast:
            logps, _ = token_logprobs(model, batch["input_ids"][sl], batch["attention_mask"][sl],
                                      batch["mask"][sl], temperature=cfg.temperature, vocab_size=vocab_size)
        parts.append(logps[:, -C:])
    return torch.cat(parts)


# -----------------------------------------------------------------------------
# The update: micro-batched grpo_step with gradient accumulation


def update(model, optimizer, batch, micro_rows, cfg, loss_cfg, info, autocast, spg, vocab_size=None):
    """One optimizer step over `micro_rows` (a list of GA index tensors). `spg` = micro-batches per
    generation round (TRL's steps_per_generation), which sets the dapo/cispo/vespo normalizer.
    Returns the loss metrics, averaged over micro-batches."""
    GA = len(micro_rows)
    sums: dict[str, list[float]] = {}
    total_loss = 0.0
    for k, idx in enumerate(micro_rows):
        dist.gradient_sync(model, enabled=(k == GA - 1))
        with autocast:
            logps, entropies = token_logprobs(model, batch["input_ids"][idx], batch["attention_mask"][idx],
                                              batch["mask"][idx], temperature=cfg.temperature,
                                              vocab_size=vocab_size)
        loss, metrics = grpo_step(
            logps.float(), batch["old_logps"][idx] if "old_logps" in batch else None,
            batch["ref_logps"][idx] if "ref_logps" in batch else None, batch["advantages"][idx],
            batch["mask"][idx], loss_cfg, num_items=batch["num_items"], grad_accum=GA,
            world_size=info.world_size, entropies=entropies.float(), steps_per_generation=spg)
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
def evaluate(model, tok, rows, cfg, reward_funcs, info, autocast) -> dict:
    """One sample per eval prompt (at the training temperature): mean reward per function, and
    pass@1 = fraction whose first reward function gives >= 1. Every eval row counts exactly once,
    on any number of ranks."""
    num_rows = len(rows)
    rows = [rows[i] for i in eval_indices(num_rows, info.rank, info.world_size)]
    prompt_ids = [tok.encode_prompt(r["prompt"]) for r in rows]
    generator = torch.Generator(info.device).manual_seed(round_seed(cfg, 0, info.rank, salt=17))
    out = rollout(model, tok, prompt_ids, cfg, 1, generator, autocast)
    rewards, _, _ = score(tok, reward_funcs, rows, out, 1)
    rewards = dist.all_gather_rows(rewards.to(info.device), info)[:num_rows]  # drop the wrapped-around padding
    m = {f"eval/rewards/{name}/mean": torch.nanmean(rewards[:, k]).item() for k, (name, _) in enumerate(reward_funcs)}
    m["eval/reward"] = torch.nanmean(total_reward(rewards, cfg.reward_weights)).item()  # unscored rows excluded
    m["eval/pass@1"] = (rewards[:, 0] >= 1.0).float().mean().item()
    return m


# -----------------------------------------------------------------------------
# The loop


def train(cfg: TrainConfig) -> list[dict]:
    """Run GRPO as configured; returns the list of per-step metrics (also in out_dir/metrics.jsonl)."""
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
    resume_source = os.path.realpath(ckpt) if resuming else None  # never pruned (the link moves on)
    model = load_policy(ckpt if resuming else cfg.model, cfg, info)
    model.gradient_checkpointing = cfg.gradient_checkpointing
    ref = None
    if cfg.beta > 0:  # the reference model exists only when the KL term is on
        ref = load_policy(cfg.model, cfg, info).eval().requires_grad_(False)
    autocast = dist.autocast(info, cfg.bf16(info.device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  weight_decay=cfg.weight_decay, eps=cfg.adam_epsilon)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, cfg))
    loss_cfg = LossConfig(**cfg.loss_config())
    reward_funcs = resolve_reward_funcs(cfg.reward_funcs, max_completion_length=cfg.max_completion_length,
                                        soft_punish_cache=cfg.soft_punish_cache)

    rows = load_dataset(cfg.dataset, split=cfg.dataset_split, seed=cfg.seed)
    eval_rows = None
    if cfg.eval_dataset and cfg.eval_every:
        eval_rows = load_dataset(cfg.eval_dataset, split=cfg.eval_split, seed=cfg.seed)[: cfg.eval_size]
    sched = cfg.schedule(info.world_size)
    prompts = PromptSampler(rows, sched.prompts_per_round, seed=cfg.seed)
    W, GA = info.world_size, sched.micro_batches_per_step

    step, history, written = 0, [], []  # written: the checkpoints this run (and the runs it resumes) wrote
    if resuming:
        state = checkpoint.load_trainer_state(ckpt, model, optimizer, info)
        step = state["step"]
        scheduler.load_state_dict(state["scheduler"])
        prompts.load_state_dict(state["prompts"])
        history = state["history"]
        written = [n for n in state.get("checkpoints", []) if os.path.isdir(os.path.join(cfg.out_dir, n))]
        dist.print0(f"resumed from {ckpt} at step {step}")
    if info.is_main:
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, "metrics.jsonl"), "w") as f:  # rewritten from history on resume
            f.writelines(json.dumps(m) + "\n" for m in history)
    dist.print0(f"nanogrpo: {cfg.model} | {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params | "
                f"{W} process(es) on {info.device}\n{sched.table()}")

    while step < cfg.max_steps:
        t_round, first_step = time.time(), step
        rnd = step // sched.updates_per_round
        # 1. prompts: this rank's share of the round's prompts (each prompt's G samples stay on one rank)
        batch_rows = prompts.next_batch()
        per_rank = len(batch_rows) // W
        my_rows = batch_rows[info.rank * per_rank:(info.rank + 1) * per_rank]
        # 2-4. sample G completions per prompt, score them, group advantages
        generator = torch.Generator(info.device).manual_seed(round_seed(cfg, rnd, info.rank))
        batch, gen_metrics, samples = sample_and_score(model, tok, my_rows, cfg, reward_funcs, info, generator, autocast)
        # 5. old log-probs only when off-policy; reference log-probs only when beta > 0
        t0 = time.time()
        if sched.off_policy:
            model.eval()
            batch["old_logps"] = batch_logprobs(model, batch, cfg, autocast, tok.vocab_size)
            model.train()
        if ref is not None:
            batch["ref_logps"] = batch_logprobs(ref, batch, cfg, autocast, tok.vocab_size)
        t_logps = time.time() - t0
        # 6. updates: shuffle once per round, replay the same micro-batches num_iterations times
        n = sched.completions_per_round_per_rank
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(round_seed(cfg, rnd, info.rank, 1)))
        micro = [perm[i:i + cfg.micro_batch_size].to(info.device) for i in range(0, n, cfg.micro_batch_size)]
        records = []
        for j in sched.replay_order()[: cfg.max_steps - step]:
            t0 = time.time()
            m = update(model, optimizer, batch, micro[j:j + GA], cfg, loss_cfg, info, autocast,
                       sched.steps_per_generation, tok.vocab_size)
            scheduler.step()
            step += 1
            if ref is not None and cfg.sync_ref_model and step % cfg.ref_model_sync_steps == 0:
                sync_ref_model(ref, model, cfg.ref_model_mixup_alpha)
            m.update(gen_metrics)
            m.update({"step": step, "lr": scheduler.get_last_lr()[0], "time/update": time.time() - t0})
            records.append(m)
        # 7. log, eval, checkpoint (at round boundaries, so a resume restarts a round exactly)
        round_time = time.time() - t_round
        tokens = dist.all_reduce_sum(batch["num_tokens"], info).item()
        for m in records:
            m["time/update"] += t_logps / len(records)
            m.update({"step_time": round_time / len(records), "tokens_per_sec": tokens / round_time})
        if eval_rows and (step // cfg.eval_every > first_step // cfg.eval_every or step == cfg.max_steps):
            records[-1].update(evaluate(model, tok, eval_rows, cfg, reward_funcs, info, autocast))
        history.extend(records)
        if info.is_main:
            with open(os.path.join(cfg.out_dir, "metrics.jsonl"), "a") as f:
                f.writelines(json.dumps(m) + "\n" for m in records)
            for m in records:
                if m["step"] % cfg.log_every == 0 or m["step"] == cfg.max_steps:
                    print_step(m, samples if cfg.log_completions else [])
        if (cfg.save_every and step // cfg.save_every > first_step // cfg.save_every) or step == cfg.max_steps:
            written.append(f"checkpoint-{step}")
            state = {"step": step, "scheduler": scheduler.state_dict(), "prompts": prompts.state_dict(),
                     "history": history, "checkpoints": written}
            checkpoint.save_checkpoint(cfg.out_dir, step, model, optimizer, tok, state, cfg.to_dict(), info)
            if info.is_main:
                written = checkpoint.prune_checkpoints(cfg.out_dir, written, cfg.save_total_limit,
                                                       keep=resume_source)
    summarize(history, cfg, info)
    dist.teardown()
    return history


def print_step(m: dict, samples):
    """One console line per optimizer step (and a few completions when asked)."""
    kl = f" kl {m['kl']:.4f} |" if "kl" in m else ""
    ev = f" | eval {m['eval/reward']:.3f}" if "eval/reward" in m else ""
    print(f"step {m['step']:4d} | reward {m['reward']:.3f} ± {m['reward_std']:.3f} |{kl} loss {m['loss']:+.4f} | "
          f"len {m['completions/mean_length']:.1f} | grad {m['grad_norm']:.3f} | lr {m['lr']:.2e} | "
          f"{m['step_time']:.2f}s (sample {m['time/sample']:.2f}, update {m['time/update']:.2f}){ev}", flush=True)
    for prompt, completion, reward in samples:
        print(f"    {prompt!r} -> {completion!r} (reward {reward:.2f})")


def summarize(history, cfg, info):
    """Final line: mean reward over the first and last tenth of the run, and where the model is."""
    if not info.is_main or not history:
        return
    k = max(1, len(history) // 10)
    start = sum(m["reward"] for m in history[:k]) / k
    end = sum(m["reward"] for m in history[-k:]) / k
    ckpt = os.path.join(cfg.out_dir, "checkpoint")
    print(f"done: {len(history)} steps, mean reward {start:.3f} -> {end:.3f} (first/last {k} steps). "
          f"Checkpoint: {ckpt}\nSample from it: python sample.py --model {ckpt} --prompt '...'", flush=True)


if __name__ == "__main__":
    argv = sys.argv[1:]
    if not any(a == "--config" or a.startswith("--config=") for a in argv):
        argv = ["--config", "tiny"] + argv  # the embedded default (the built-in configs/tiny.py)
    train(load_config(argv))
