"""What a training run does around the algorithm: the bookkeeping train.py calls.

Owns: the output folder (a fresh run never replaces another), which
checkpoint a run resumes from and what it restores, saving (on schedule,
on Ctrl-C, after an error), metrics.jsonl and the experiment trackers,
the console lines, warnings about rewards that cannot teach, the
end-of-run summary and reward curve, the embedded default's tiny
checkpoint, and `train.py --help`.

Does not know about: the GRPO math. It reads a few named fields of
train.py's `Trainer` (model, optimizer, scheduler, tok, prompts, step,
round, round_begin) to save and restore them.
"""

import inspect
import json
import math
import os
import re
import shlex
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, replace

import torch

from nanogrpo import checkpoint, dist, lora
from nanogrpo.config import ConfigError, TrainConfig, load_config
from nanogrpo.grpo import nanstd
from nanogrpo.model import ModelConfig, Transformer
from nanogrpo.rewards import RewardError, total_reward
from nanogrpo.tokenizer import char_level_tokenizer

# Settings a resumed run takes from its checkpoint, whatever is passed.
RESTORED_ON_RESUME = {
    "learning_rate": "the optimizer's state",
    "adam_beta1": "the optimizer's state",
    "adam_beta2": "the optimizer's state",
    "adam_epsilon": "the optimizer's state",
    "weight_decay": "the optimizer's state",
}
# Files train.py writes into out_dir: a fresh run refuses to replace them.
RUN_FILES = r"metrics\.jsonl|checkpoint(-\d+)?(\.tmp)?"


@dataclass
class Run:
    """A run's bookkeeping between rounds (train.py's Trainer holds the
    algorithm's state)."""

    cfg: TrainConfig
    info: dist.DistInfo
    resume_from: str | None = None  # a checkpoint dir, or None
    resume_source: str | None = None  # its real path: never pruned
    history: list = field(default_factory=list)  # per-step metrics
    written: list = field(default_factory=list)  # checkpoints, oldest first
    pending: list = field(default_factory=list)  # records not yet logged
    samples: list = field(default_factory=list)  # shown completions
    reporters: list = field(default_factory=list)  # fn(metrics, step)
    started: tuple = (0.0, 0)  # (time, step) at start: for the ETA
    warned: set = field(default_factory=set)  # warnings already given
    zero_spread_rounds: int = 0  # rounds in a row without spread
    command: list = field(default_factory=list)  # for the resume hint


# -----------------------------------------------------------------------------
# Starting: the output folder and the checkpoint to resume from


def start(cfg: TrainConfig, info, command=None) -> tuple[Run, TrainConfig]:
    """Decide fresh or resumed, check out_dir, build the embedded
    default's checkpoint. -> (the run, the config the run will use:
    on resume, the optimizer settings come from the checkpoint)."""
    check_out_dir(cfg.out_dir)
    run = Run(cfg=cfg, info=info, command=command or ["train.py"])
    run.resume_from = find_checkpoint(cfg)
    if run.resume_from:
        saved_path = os.path.join(run.resume_from, "train_config.json")
        cfg = restored_config(checkpoint.read_json(saved_path), cfg)
        run.cfg = cfg
    else:
        clear_out_dir(cfg, info)
    ensure_tiny_checkpoint(cfg, info)
    return run, cfg


def check_out_dir(out_dir: str):
    """out_dir must be a directory this process can write. Checked by
    writing there; folders made for the check are removed again."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError(f"out_dir={out_dir!r} is a file, not a directory: "
                          "choose another --out_dir")
    made = []
    path = os.path.abspath(out_dir)
    while not os.path.exists(path):
        made.append(path)
        path = os.path.dirname(path)
    try:
        os.makedirs(out_dir, exist_ok=True)
        probe = os.path.join(out_dir, f".write-test-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"out_dir={out_dir!r} cannot be written "
                          f"({e.strerror}): choose another --out_dir") from None
    finally:
        for folder in made:  # deepest first; another rank may use it
            try:
                os.rmdir(folder)
            except OSError:
                pass


def find_checkpoint(cfg: TrainConfig) -> str | None:
    """The checkpoint to resume from: `resume` may be a path (it must
    hold a trainer state) or true (out_dir/checkpoint, when there is
    one); None starts fresh."""
    resume = cfg.resume
    if isinstance(resume, str) and resume.lower() in ("true", "false"):
        resume = resume.lower() == "true"
    if not resume:
        return None
    if isinstance(resume, str):
        if not os.path.exists(os.path.join(resume, "trainer")):
            raise FileNotFoundError(
                f"resume={resume!r}: no trainer state at {resume}/trainer; "
                "point it at an out_dir/checkpoint written by train.py, "
                "or use --resume=true")
        return resume
    latest = os.path.join(cfg.out_dir, "checkpoint")
    if os.path.exists(os.path.join(latest, "trainer")):
        return latest
    dist.print0(f"resume=true: no checkpoint in {cfg.out_dir} yet, "
                "so this run starts fresh")
    return None


def restored_config(saved: dict, cfg: TrainConfig) -> TrainConfig:
    """The config of a resumed run: what it will really use. Names every
    setting that differs from the checkpoint's run; the optimizer's
    settings are the checkpoint's; another model is an error."""
    if saved.get("model") not in (None, cfg.model):
        raise ConfigError(
            f"this checkpoint was trained from model={saved['model']!r}, "
            f"not {cfg.model!r}: resume without --model, or start a new "
            "run in another --out_dir")
    now = asdict(cfg)
    restored = {}
    skip = ("resume", "max_steps")
    changed = [k for k in now if k in saved and saved[k] != now[k]]
    for key in sorted(k for k in changed if k not in skip):
        note = f"note: {key} was {saved[key]!r} in the checkpoint's run"
        if key in RESTORED_ON_RESUME:
            restored[key] = saved[key]
            why = RESTORED_ON_RESUME[key]
            dist.print0(f"{note}; {now[key]!r} is ignored ({why} wins)")
        else:
            dist.print0(f"{note}, now {now[key]!r}")
    return replace(cfg, **restored)


def clear_out_dir(cfg: TrainConfig, info):
    """A fresh run never silently replaces another: an out_dir holding
    what train.py writes is an error, unless overwrite_output_dir asks
    to delete those files (only those)."""
    if not os.path.isdir(cfg.out_dir):
        return
    names = sorted(n for n in os.listdir(cfg.out_dir)
                   if re.fullmatch(RUN_FILES, n))
    if not names:
        return
    if not cfg.overwrite_output_dir:
        raise ConfigError(
            f"out_dir={cfg.out_dir!r} holds a run ({', '.join(names[:4])}): "
            "continue it with --resume=true, start over with "
            "--overwrite_output_dir=true (deletes them), or choose "
            "another --out_dir")
    if info.is_main:
        for name in names:
            remove(os.path.join(cfg.out_dir, name))
    dist.barrier(info)


def remove(path: str):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


def ensure_tiny_checkpoint(cfg: TrainConfig, info):
    """For the embedded default: build a random model and a char-level
    tokenizer and save them in HF format at cfg.model, so the run loads
    them like any checkpoint. init.json records the recipe; a changed
    recipe rebuilds it. A checkpoint not written here is left alone."""
    if cfg.init_model is None:
        return
    recipe = {
        "init_model": cfg.init_model,
        "init_tokenizer_chars": cfg.init_tokenizer_chars,
        "seed": cfg.seed,
    }
    marker = os.path.join(cfg.model, "init.json")
    if os.path.exists(os.path.join(cfg.model, "config.json")):
        if not os.path.exists(marker):
            return
        if checkpoint.read_json(marker) == recipe:
            return
        dist.print0(f"{cfg.model} was built from another init_model, "
                    "init_tokenizer_chars or seed: rebuilding it")
    if info.is_main:
        write_tiny_checkpoint(cfg.model, recipe)
    dist.barrier(info)


def write_tiny_checkpoint(path: str, recipe: dict):
    tok = char_level_tokenizer(recipe["init_tokenizer_chars"])
    torch.manual_seed(recipe["seed"])
    config = ModelConfig(vocab_size=tok.vocab_size, **recipe["init_model"])
    model = Transformer(config)
    generation_config = {
        "eos_token_id": sorted(tok.eos_token_ids),
        "pad_token_id": tok.pad_token_id,
    }
    with checkpoint.atomic_dir(path) as tmp:
        checkpoint.write_model(tmp, model.config, model.state_dict(),
                               tokenizer=tok,
                               generation_config=generation_config)
        checkpoint.write_json(os.path.join(tmp, "init.json"), recipe)


# -----------------------------------------------------------------------------
# Restoring and saving the trainer


def restore(run: Run, t):
    """Load the trainer state of run.resume_from into t (a Trainer)."""
    cfg = run.cfg
    state = checkpoint.load_trainer_state(run.resume_from, t.model,
                                          t.optimizer, run.info)
    t.step = state["step"]
    t.round = state.get("round", t.step // t.sched.updates_per_round)
    t.scheduler.load_state_dict(state["scheduler"])
    t.prompts.load_state_dict(state["prompts"])
    run.history = state["history"]
    run.written = [n for n in state.get("checkpoints", [])
                   if os.path.isdir(os.path.join(cfg.out_dir, n))]
    # the `checkpoint` link moves on: keep what it pointed at
    run.resume_source = os.path.realpath(run.resume_from)
    dist.print0(f"resumed from {run.resume_from} at step {t.step}")


def open_logs(run: Run, t):
    """metrics.jsonl (rewritten from history on resume) and trackers."""
    if run.info.is_main:
        os.makedirs(run.cfg.out_dir, exist_ok=True)
        path = os.path.join(run.cfg.out_dir, "metrics.jsonl")
        with open(path, "w") as f:
            for m in run.history:
                f.write(json.dumps(m) + "\n")
    run.reporters = open_reporters(run.cfg, run.info)
    run.started = (time.time(), t.step)
    announce(t)


def announce(t):
    """The run's first lines: model, sizes, processes, batch schedule."""
    total = sum(p.numel() for p in t.model.parameters()) / 1e6
    line = f"nanogrpo: {t.cfg.model} | {total:.2f}M params"
    if hasattr(t.model, "lora_config"):
        params = t.optimizer.param_groups[0]["params"]
        trained = sum(p.numel() for p in params) / 1e6
        line += f" ({trained:.3f}M trainable: LoRA)"
    line += f" | {t.info.world_size} process(es) on {t.info.device}"
    dist.print0(line)
    dist.print0(t.sched.table())


def save(run: Run, t):
    """checkpoint-<step> (policy, tokenizer, optimizer, trainer state);
    then prune to save_total_limit. A checkpoint counts as written only
    once it is on disk."""
    cfg = run.cfg
    name = f"checkpoint-{t.step}"
    state = {
        "step": t.step,
        "round": t.round,
        "scheduler": t.scheduler.state_dict(),
        "prompts": t.prompts.state_dict(),
        "history": run.history,
        "checkpoints": run.written + [name],
    }
    checkpoint.save_checkpoint(cfg.out_dir, t.step, t.model, t.optimizer,
                               t.tok, state, asdict(cfg), run.info)
    run.written.append(name)
    if run.info.is_main:
        run.written = checkpoint.prune_checkpoints(
            cfg.out_dir, run.written, cfg.save_total_limit,
            keep=run.resume_source)


def save_merged(run: Run, t):
    """merge_adapter: the adapters folded into the base weights, a full
    HF checkpoint at out_dir/merged."""
    state = dist.full_state_dict(t.model)  # every rank gathers
    if run.info.is_main:
        merged = lora.merged_state_dict(state, t.model.lora_config)
        path = os.path.join(run.cfg.out_dir, "merged")
        with checkpoint.atomic_dir(path) as tmp:
            checkpoint.write_model(tmp, t.model.config, merged,
                                   t.model.generation_config, t.tok)
    dist.barrier(run.info)


@contextmanager
def saving_on_stop(run: Run, t):
    """Ctrl-C or an error inside: save what was trained, then re-raise."""
    try:
        yield
    except KeyboardInterrupt:
        save_on_stop(run, t, "interrupted")
        raise
    except Exception:
        try:
            save_on_stop(run, t, "stopped by an error")
        except Exception as e:  # the error may be the disk itself
            dist.print0(f"could not save after the error: {e}")
        raise


def saved(run: Run, step: int) -> bool:
    return bool(run.written) and run.written[-1] == f"checkpoint-{step}"


def save_on_stop(run: Run, t, why: str):
    """Ctrl-C or an error: keep what was trained (the last completed
    step) and say how to continue. Stopped inside a round before its
    first optimizer step, the checkpoint records the prompt sampler
    where the round began, so the resumed run redoes that round."""
    cfg = run.cfg
    where = f"{why} at step {t.step}/{cfg.max_steps}"
    latest = os.path.join(cfg.out_dir, "checkpoint")
    reason = unsaveable(run, t)
    if reason:
        dist.print0(f"\n{where}: not saved ({reason}); "
                    f"the latest checkpoint is {latest}")
        return
    log(run)  # a finished round's records, if stopped in its evaluation
    if not saved(run, t.step):
        if t.round_begin is not None:
            t.prompts.load_state_dict(t.round_begin)
        save(run, t)
    args = [a for a in run.command
            if not a.startswith(("--resume", "--overwrite_output_dir"))]
    again = shlex.join(args + ["--resume=true"])
    dist.print0(f"\n{where}: saved {cfg.out_dir}/checkpoint-{t.step}. "
                f"Continue with:\n  python {again}")


def unsaveable(run: Run, t) -> str | None:
    """Why the state at a stop cannot be saved exactly, or None."""
    if run.info.world_size > 1:
        return "several processes cannot save together after a stop"
    if t.step == 0:
        return "no optimizer step was taken yet"
    if t.round_begin is not None and t.step > t.round_start_step:
        return "it stopped between two optimizer steps of one round"
    return None


# -----------------------------------------------------------------------------
# Logging: metrics.jsonl, trackers, console


def log(run: Run):
    """Move run.pending to history and metrics.jsonl (NaN as null), send
    it to the trackers, print the step lines."""
    records = [without_nan(m) for m in run.pending]
    run.pending = []
    run.history.extend(records)
    if not run.info.is_main:
        return
    path = os.path.join(run.cfg.out_dir, "metrics.jsonl")
    with open(path, "a") as f:
        for m in records:
            f.write(json.dumps(m) + "\n")
    for m in records:
        for report in run.reporters:
            report(m, m["step"])
        last = m["step"] == run.cfg.max_steps
        if m["step"] % run.cfg.log_every == 0 or last:
            print_step(m, run)


def without_nan(m: dict) -> dict:
    return {k: None if isinstance(v, float) and math.isnan(v) else v
            for k, v in m.items()}


def eta_minutes(run: Run, step: int) -> float:
    t0, step0 = run.started
    per_step = (time.time() - t0) / max(1, step - step0)
    return per_step * (run.cfg.max_steps - step) / 60


def print_step(m: dict, run: Run):
    """One console line per optimizer step (and a few completions)."""
    def num(key, spec):
        if m.get(key) is None:
            return "n/a"
        return format(m[key], spec)

    parts = [
        f"step {m['step']:4d}/{run.cfg.max_steps}",
        f"reward {num('reward', '.3f')} ± {num('reward_std', '.3f')}",
    ]
    if "kl" in m:
        parts.append(f"kl {num('kl', '.4f')}")
    parts += [
        f"loss {m['loss']:+.4f}",
        f"len {m['completions/mean_length']:.1f}",
        f"grad {m['grad_norm']:.3f}",
        f"lr {m['lr']:.2e}",
        f"{m['step_time']:.2f}s (sample {m['time/sample']:.2f}, "
        f"update {m['time/update']:.2f})",
        f"eta {eta_minutes(run, m['step']):.1f} min",
    ]
    if "eval/reward" in m:
        parts.append(f"eval {num('eval/reward', '.3f')}")
    print(" | ".join(parts), flush=True)
    if run.cfg.log_completions:
        print_samples(run.samples)


def print_samples(samples):
    for prompt, completion, reward in samples:
        print(f"    {prompt!r} -> {completion!r} (reward {reward:.2f})")


def tracker_names(m: dict) -> dict:
    """Metric names as TRL logs them: train/<name>, eval/<name>."""
    out = {}
    for k, v in m.items():
        if not isinstance(v, (int, float)) or k == "step":
            continue
        if k.startswith("eval/"):
            out[k] = v
        elif k == "lr":
            out["train/learning_rate"] = v
        else:
            out["train/" + k] = v
    return out


def open_reporters(cfg: TrainConfig, info) -> list:
    """report_to's trackers (main process only), each fn(metrics, step)."""
    if not info.is_main:
        return []
    out = []
    for name in cfg.reporters():
        try:
            out.append(open_reporter(name, cfg))
        except ImportError as e:
            raise ConfigError(
                f"report_to={name!r}, but {name} cannot be imported ({e}): "
                f"pip install {name}, or use --report_to=none") from None
    return out


def open_reporter(name: str, cfg: TrainConfig):
    if name == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(os.path.join(cfg.out_dir, "runs"))

        def report(m, step):
            for k, v in tracker_names(m).items():
                writer.add_scalar(k, v, step)
            writer.flush()
        return report
    if name == "wandb":
        import wandb
        project = os.environ.get("WANDB_PROJECT", "nanogrpo")
        wb = wandb.init(project=project, config=asdict(cfg), dir=cfg.out_dir)
        return lambda m, step: wb.log(tracker_names(m), step=step)
    import trackio
    project = os.environ.get("TRACKIO_PROJECT", "nanogrpo")
    trackio.init(project=project, config=asdict(cfg))
    return lambda m, step: trackio.log(tracker_names(m), step=step)


def nothing_to_do(t):
    dist.print0(f"nothing to do: the checkpoint is at step {t.step} and "
                f"max_steps={t.cfg.max_steps}; raise --max_steps to "
                "train further")


# -----------------------------------------------------------------------------
# Metrics: TRL's names and definitions


def add_round_metrics(run: Run, t, ro, local, rewards, records, timing):
    """Put the round's reward, completion and timing metrics into each of
    its step records. local: [n, K] this rank's rewards; rewards:
    [N, K] all ranks'. Also checks the rewards and keeps a few samples."""
    info = t.info
    gen = generation_metrics(t, ro, rewards)
    total = total_reward(rewards, t.reward_weights)
    check_rewards(run, total, gen["frac_reward_zero_std"])
    run.samples = shown_samples(ro, local, t.reward_weights)
    updates = sum(m["time/update"] for m in records)
    round_time = sum(timing.values()) + updates
    tokens = torch.tensor(float(ro.num_tokens()), device=info.device)
    tokens = dist.all_reduce_sum(tokens, info).item()
    for m in records:
        m.update(gen)
        m.update(timing)
        m["step_time"] = round_time / len(records)
        m["tokens_per_sec"] = tokens / round_time


def generation_metrics(t, ro, rewards: torch.Tensor) -> dict:
    """TRL's reward and completion-length metrics over the whole round
    on all ranks. rewards: [N, K]."""
    info = t.info
    total = total_reward(rewards, t.reward_weights)  # [N], NaN = unscored
    scored = total[~torch.isnan(total)]
    groups = total.view(-1, ro.num_generations)  # [N/G, G]
    group_std = nanstd(groups, dim=1)  # NaN where < 2 scored
    zero_std = torch.isclose(group_std, torch.zeros_like(group_std))
    lengths = dist.all_gather_rows(ro.completion_lengths.float(), info)
    truncated = dist.all_gather_rows(ro.truncated.float(), info)
    m = {
        "reward": scored.mean().item(),
        "reward_std": scored.std().item() if len(scored) > 1 else 0.0,
        "frac_reward_zero_std": zero_std.float().mean().item(),
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": truncated.mean().item(),
    }
    if t.tools:
        m.update(tool_metrics(ro, info, num_rows=len(total)))
    for k, (name, _) in enumerate(t.reward_funcs):
        column = rewards[:, k][~torch.isnan(rewards[:, k])]
        mean = column.mean().item() if len(column) else math.nan
        std = column.std().item() if len(column) > 1 else 0.0
        m[f"rewards/{name}/mean"] = mean
        m[f"rewards/{name}/std"] = std
    return m


def tool_metrics(ro, info, num_rows: int) -> dict:
    """TRL's tool metrics: calls per completion, the failed share of the
    calls, assistant turns per completion."""
    counts = torch.tensor([float(ro.tool_calls), float(ro.tool_failures)],
                          device=info.device)
    calls, failures = dist.all_reduce_sum(counts, info).tolist()
    turns = dist.all_gather_rows(ro.turns.float(), info)
    return {
        "tools/call_frequency": calls / num_rows,
        "tools/failure_frequency": failures / calls if calls else 0.0,
        "tools/mean_turns": turns.mean().item(),
    }


def eval_metrics(rewards: torch.Tensor, reward_funcs, weights) -> dict:
    """Mean reward per function and in total (unscored rows left out);
    pass@1 = the share whose first function gives >= 1. rewards [E, K]."""
    m = {}
    for k, (name, _) in enumerate(reward_funcs):
        m[f"eval/rewards/{name}/mean"] = torch.nanmean(rewards[:, k]).item()
    total = total_reward(rewards, weights)
    m["eval/reward"] = torch.nanmean(total).item()
    m["eval/pass@1"] = (rewards[:, 0] >= 1.0).float().mean().item()
    return m


def shown_samples(ro, rewards: torch.Tensor, weights, k: int = 2) -> list:
    """(prompt, completion, total reward) of the first sample of the
    first k prompts. rewards: [n, K] this rank's."""
    G = ro.num_generations
    out = []
    for i in range(0, min(k * G, len(ro.prompts)), G):
        prompt = ro.prompts[i]
        completion = ro.completions[i]
        if not isinstance(prompt, str):
            prompt = prompt[-1]["content"]
        if not isinstance(completion, str):
            completion = conversation_text(completion)
        reward = total_reward(rewards[i:i + 1], weights).item()
        out.append((prompt, completion, reward))
    return out


def conversation_text(messages: list[dict]) -> str:
    """A completion's messages on one line: assistant text, its tool
    calls as [call name {args}], tool results as [tool: result]."""
    parts = []
    for m in messages:
        if m["role"] != "assistant":
            parts.append(f"[{m['role']}: {m['content']}]")
            continue
        parts.append(m.get("content") or "")
        for call in m.get("tool_calls") or []:
            fn = call["function"]
            parts.append(f"[call {fn['name']} {json.dumps(fn['arguments'])}]")
    return " ".join(p for p in parts if p)


# -----------------------------------------------------------------------------
# Warnings about rewards that cannot teach


def warn_once(run: Run, key: str, message: str):
    if key not in run.warned:
        run.warned.add(key)
        dist.print0(f"warning: {message}")


def check_rewards(run: Run, total: torch.Tensor, frac_zero_std: float,
                  patience: int = 10):
    """Say so (once each) when a round's rewards cannot teach: none
    scored, too large for float32 statistics, or no spread in any group
    for `patience` rounds in a row. total: [N] weighted rewards."""
    scored = total[~torch.isnan(total)]
    if len(scored) == 0:
        warn_once(run, "unscored",
                  "no completion got a reward this round: every reward "
                  "function returned None or NaN for every completion, "
                  "so nothing is learned")
    elif scored.abs().max() > 1e18:
        warn_once(run, "overflow",
                  f"rewards up to {scored.abs().max():.2e} overflow float32 "
                  "statistics (the group std becomes inf, advantages 0): "
                  "rescale the reward functions")
    if frac_zero_std == 1.0:
        run.zero_spread_rounds += 1
    else:
        run.zero_spread_rounds = 0
    if run.zero_spread_rounds >= patience:
        warn_once(run, "zero_spread",
                  f"every group's rewards were identical for {patience} "
                  "rounds in a row: advantages are 0 and nothing is "
                  "learned; make the task easier, the reward more graded, "
                  "or num_generations larger")


# -----------------------------------------------------------------------------
# The end of a run


def summarize(run: Run, t):
    """Mean reward over the first and last tenth of the steps, a few
    completions, the reward curve and a sample command that works."""
    history = run.history
    if not run.info.is_main or not history:
        return
    k = max(1, len(history) // 10)
    rewards = [m["reward"] for m in history if m["reward"] is not None]
    if rewards:
        first = sum(rewards[:k]) / len(rewards[:k])
        last = sum(rewards[-k:]) / len(rewards[-k:])
        change = f"mean reward {first:.3f} -> {last:.3f} (first/last {k})"
    else:
        change = "no step had a scored reward"
    print(f"done: {len(history)} steps, {change}. Last round:")
    print_samples(run.samples)
    ckpt = os.path.join(run.cfg.out_dir, "checkpoint")
    prompt = t.prompts.rows[0]["prompt"]
    if isinstance(prompt, str):
        text = f"--prompt {shlex.quote(prompt)}"
    else:
        text = f"--chat {shlex.quote(prompt[-1]['content'])}"
    print(f"Checkpoint: {ckpt}")
    print(f"Reward curve: {plot_rewards(run.cfg)}")
    print(f"Sample from it: python sample.py --model {ckpt} {text}",
          flush=True)


def plot_rewards(cfg: TrainConfig) -> str:
    """Draw out_dir/reward.png from metrics.jsonl when matplotlib is
    installed; otherwise say how to get it."""
    metrics = os.path.join(cfg.out_dir, "metrics.jsonl")
    png = os.path.join(cfg.out_dir, "reward.png")
    try:
        import matplotlib
    except ImportError:
        return (f"pip install matplotlib, then: "
                f"python bench/plot.py {metrics} -o {png}")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(metrics) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    steps = [r["step"] for r in rows]
    rewards = [math.nan if r["reward"] is None else r["reward"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, rewards)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward")
    ax.set_title(cfg.out_dir)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


# -----------------------------------------------------------------------------
# train.py --help


def help_text() -> str:
    """Every setting with its default and comment, grouped as in
    TrainConfig's source: a '# title' line starts a group, a field's
    comment is on its line, and '#  ' lines below it continue it."""
    lines = [
        "usage: train.py [--config FILE] [--key=value ...]",
        "  FILE: a config of configs/ by name, or a .py path of your own.",
        "Command-line values override the file's. Keys and TrainConfig's "
        "defaults (a config file sets its own):",
    ]
    defaults = TrainConfig()
    comments, groups = field_comments()
    for f in fields(TrainConfig):
        if f.name in groups:
            lines.append(f"\n  {groups[f.name]}:")
        default = repr(getattr(defaults, f.name))
        lines.append(f"  --{f.name}={default}")
        for comment in comments.get(f.name, []):
            lines.append(f"      {comment}")
    return "\n".join(lines)


def field_comments() -> tuple[dict, dict]:
    """({field: [comment lines]}, {first field of a group: its title})
    read from TrainConfig's source, up to its first method."""
    names = {f.name for f in fields(TrainConfig)}
    comments = {}
    groups = {}
    title = None
    previous = None  # the last field seen
    for raw in inspect.getsource(TrainConfig).splitlines()[1:]:
        line = raw.strip()
        if line.startswith(("def ", "@")):
            break
        match = re.match(r"(\w+)\s*:", line)
        if line.startswith("#  ") and previous:
            comments[previous].append(line[1:].strip())
        elif line.startswith("#"):
            title = line.lstrip("#").strip(" -")
        elif match and match.group(1) in names:
            previous = match.group(1)
            inline = line.split("  # ", 1)[1:]
            comments[previous] = inline
            if title:
                groups[previous] = title
            title = None
    return comments, groups


# -----------------------------------------------------------------------------
# The command line


def main(argv: list[str], train) -> int:
    """`python train.py [--config FILE] [--key=value ...]`: user errors
    are one line (the traceback with --debug or NANOGRPO_DEBUG=1);
    Ctrl-C saves and exits with 130."""
    debug = "--debug" in argv or os.environ.get("NANOGRPO_DEBUG") == "1"
    argv = [a for a in argv if a != "--debug"]
    command = ["train.py"] + argv
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    has_config = any(a == "--config" or a.startswith("--config=")
                     for a in argv)
    if not has_config:
        argv = ["--config", "tiny"] + argv  # the embedded default
    try:
        train(load_config(argv), command)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError, RewardError) as e:  # ConfigError too
        if debug:
            raise
        print(f"train.py: error: {e}\n(the traceback: add --debug)",
              file=sys.stderr)
        return 2
    return 0
