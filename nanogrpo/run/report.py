"""What a run reports: metrics, console lines, trackers, warnings.

Owns: each round's metrics (computed by run/metrics.py, under TRL's names
and definitions), the run's history (a record per step), metrics.jsonl and
report_to's trackers (a record every logging_steps, its window's mean, as
TRL logs), the console line of each logged step, the status line on a
terminal (`Progress`: sampling, tokens/s, ETA), warnings about rewards that
cannot teach, and the end-of-run summary with its reward curve.

Does not know about: the model, the optimizer, checkpoints, or how a run
starts and resumes (run/__init__.py).

Of sampler.py it uses the decode-step callback it sets
(`on_decode_step`); of extras/trainer_info.py
`epochs_done` (each step's `epoch`, as reward functions see it in
trainer_state).
"""

import json
import math
import os
import shlex
import shutil
import sys
import time
from dataclasses import asdict

import torch

from nanogrpo import distributed as dist, sampler
from nanogrpo.extras.trainer_info import epochs_done
from nanogrpo.run.config import ConfigError, TrainConfig
from nanogrpo.run.metrics import (  # noqa: F401 (the names train.py and the tests call here)
    across_micro_batches,
    conversation_text,
    eval_metrics,
    generation_metrics,
    micro_batch_weights,
    read_floats,
    shown_samples,
    step_metrics,
    tool_metrics,
)

# -----------------------------------------------------------------------------
# Logging: metrics.jsonl, trackers, console


def log(run):
    """Move run.pending to history (a value that is not finite as None:
    JSON null), say once when a loss or grad norm is not finite, and log
    each step as TRL does: at each logging step (logs_at) its window's
    record (logged_record) goes to metrics.jsonl and the trackers and is
    printed; an evaluation at a step that logs none gets its own record
    and line; a step that logs nothing redraws the status line."""
    for m in run.pending:
        check_finite(run, m)
    records = [finite_or_none(m) for m in run.pending]
    run.pending = []
    first = len(run.history)
    run.history.extend(records)
    if not run.info.is_main:
        return
    path = os.path.join(run.cfg.output_dir, "metrics.jsonl")
    for i, m in enumerate(records, start=first):
        logged = logged_record(run.history, i, run.cfg)
        if logged is not None:
            write_record(run, path, logged)
        if logged is not None and "loss" in logged:
            print_step(logged, run)
        elif logged is not None:
            print_eval(logged, f"eval at step {m['step']}", run)
        elif run.progress is not None:
            run.progress.draw_step(m, run)
        if m["step"] == run.cfg.max_steps:
            close_progress(run)


def log_eval(run, m: dict):
    """An evaluation apart from a step (eval_on_start, before step
    t.step + 1), as transformers logs it: its own record in history,
    metrics.jsonl and the trackers, and one console line."""
    m = finite_or_none(m)
    run.history.append(m)
    if not run.info.is_main:
        return
    write_record(run, os.path.join(run.cfg.output_dir, "metrics.jsonl"), m)
    print_eval(m, f"eval before step {m['step'] + 1}", run)


def write_record(run, path: str, m: dict):
    """One record to metrics.jsonl and to each tracker."""
    with open(path, "a") as f:
        f.write(json.dumps(m) + "\n")
    for report in run.reporters:
        report(m, m["step"])


def finite_or_none(m: dict) -> dict:
    """m with each NaN or infinite float as None: JSON null (json.dumps
    would write NaN and Infinity, which JSON does not have)."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in m.items()}


# -----------------------------------------------------------------------------
# logging_steps: a record per window of steps, as TRL's GRPOTrainer.log

# values taken at the logging step, not averaged: transformers' grad_norm,
# learning_rate and epoch, TRL's num_tokens (a running total)
AT_THE_STEP = ("step", "grad_norm", "learning_rate", "epoch", "num_tokens")


def logs_at(step: int, cfg) -> bool:
    """Whether a step is logged: every logging_steps, step 1 with
    logging_first_step (transformers' DefaultFlowCallback), and the run's
    last step (TRL's final log holds what its window has gathered)."""
    first = step == 1 and cfg.logging_first_step
    return step % cfg.logging_steps == 0 or step == cfg.max_steps or first


def logged_record(history: list, i: int, cfg) -> dict | None:
    """What metrics.jsonl and the trackers get at history[i], a step:
    at a logging step, the mean over its window (window_mean); at another
    step that evaluated, its eval/* metrics alone (transformers logs an
    evaluation as its own record); else None."""
    m = history[i]
    if logs_at(m["step"], cfg):
        return window_mean(window(history, i, cfg))
    evals = {k: v for k, v in m.items() if k.startswith("eval/")}
    if evals:
        return {"step": m["step"], **evals}
    return None


def window(history: list, i: int, cfg) -> list[dict]:
    """The step records history[i]'s log averages: those after the last
    step before it that was logged, up to it. The window is the steps'
    own, not the process's: a resumed run logs what an uninterrupted one
    does."""
    out = [history[i]]
    for j in range(i - 1, -1, -1):
        m = history[j]
        if "loss" not in m:  # eval_on_start's record, not a step
            continue
        if logs_at(m["step"], cfg):
            break
        out.append(m)
    return out[::-1]


def window_mean(records: list[dict]) -> dict:
    """One record for a window of step records: each metric's mean over
    the steps that have a value for it (None where none does: TRL leaves
    NaN out of its means), the AT_THE_STEP values and eval/* metrics of
    the last step. One step's record is itself."""
    last = records[-1]
    if len(records) == 1:
        return dict(last)
    out = {}
    keys = dict.fromkeys(k for m in (last, *records) for k in m)
    for key in keys:
        if key in AT_THE_STEP or key.startswith("eval/"):
            if key in last:
                out[key] = last[key]
            continue
        values = [m[key] for m in records if m.get(key) is not None]
        if all(isinstance(v, (int, float)) for v in values):
            out[key] = sum(values) / len(values) if values else None
        else:  # not a number: the last step's
            out[key] = values[-1]
    return out


def logged_records(history: list, cfg) -> list[dict]:
    """The records metrics.jsonl holds for a history (rewritten from it on
    resume): eval_on_start's, and each step's logged_record."""
    out = []
    for i, m in enumerate(history):
        logged = m if "loss" not in m else logged_record(history, i, cfg)
        if logged is not None:
            out.append(logged)
    return out


def check_finite(run, m: dict):
    """Say once, at the first step whose loss or grad norm is NaN or
    infinite, that training has diverged. The run goes on and saves as
    configured; each such value is null in metrics.jsonl, n/a on the
    console, and the summary counts the steps."""
    bad = [
        f"{name} is {m[key]}"
        for key, name in (("loss", "loss"), ("grad_norm", "grad norm"))
        if isinstance(m.get(key), float) and not math.isfinite(m[key])
    ]
    if bad:
        warn_once(
            run,
            "not_finite",
            f"step {m['step']}: the {' and the '.join(bad)}, not finite: "
            "training has diverged (lower learning_rate, set "
            "max_grad_norm, or look for rewards that are inf). Said once; "
            "metrics.jsonl writes null for each value that is not finite",
        )


def eta_minutes(run, step: int) -> float:
    t0, step0 = run.started
    per_step = (time.time() - t0) / max(1, step - step0)
    return per_step * (run.cfg.max_steps - step) / 60


def num(m: dict, key: str, spec: str) -> str:
    """m[key] formatted by spec; n/a where it is None (not finite)."""
    if m.get(key) is None:
        return "n/a"
    return format(m[key], spec)


def print_step(m: dict, run):
    """The console line of a logged step (and a few completions)."""
    if run.progress is not None:
        run.progress.clear()
    parts = [
        f"step {m['step']:4d}/{run.cfg.max_steps}",
        f"reward {num(m, 'reward', '.3f')} ± {num(m, 'reward_std', '.3f')}",
    ]
    if "kl" in m:
        parts.append(f"kl {num(m, 'kl', '.4f')}")
    # async_rollouts: the trainer waits for the rounds the sampler draws (run/async_rollouts.py)
    first = "wait", "time/wait_for_rollouts"
    if first[1] not in m:
        first = "sample", "time/sample"
    timing = f"{first[0]} {num(m, first[1], '.2f')}, update {num(m, 'time/update', '.2f')}"
    parts += [
        f"loss {num(m, 'loss', '+.4f')}",
        f"len {num(m, 'completions/mean_length', '.1f')}",
        f"grad {num(m, 'grad_norm', '.3f')}",
        f"lr {num(m, 'learning_rate', '.2e')}",
        f"{num(m, 'step_time', '.2f')}s ({timing})",
        f"eta {eta_minutes(run, m['step']):.1f} min",
    ]
    if "eval/reward" in m:
        parts.append(f"eval {num(m, 'eval/reward', '.3f')}")
    print(" | ".join(parts), flush=True)
    if run.cfg.log_completions:
        print_samples(run.samples)


def print_eval(m: dict, where: str, run):
    """The console line of an evaluation logged on its own."""
    if run.progress is not None:
        run.progress.clear()
    reward = num(m, "eval/reward", ".3f")
    line = f"{where}: reward {reward}, pass@1 {num(m, 'eval/pass@1', '.3f')}"
    print(f"{line}, loss {num(m, 'eval/loss', '+.4f')}", flush=True)


def print_samples(samples: list[dict]):
    """The completions table (shown_samples' rows): a header, then a line
    per completion, each column padded to its widest cell."""
    if not samples:
        return
    header = list(samples[0])
    lines = [header] + [[table_cell(name, row[name]) for name in header] for row in samples]
    widths = [max(len(line[j]) for line in lines) for j in range(len(header))]
    for line in lines:
        cells = [cell.ljust(width) for cell, width in zip(line, widths)]
        print("    " + " | ".join(cells).rstrip())


def table_cell(column: str, value) -> str:
    """A value of the completions table as text: prompts and completions
    quoted (their whitespace shows), the reward to two decimals, what
    log_extra logged as str() writes it."""
    if column in ("prompt", "completion"):
        return repr(value)
    if column == "reward":
        return f"{value:.2f}"
    return str(value)


# -----------------------------------------------------------------------------
# Progress on a terminal: one status line, redrawn in place

PROGRESS_INTERVAL = 1.0  # seconds between two redraws of the status line


class Progress:
    """A status line on a terminal, so that long work is never silent:
    while sampling, the decode position and tokens/s (the object is
    sampler.on_decode_step); after a step that prints no line,
    the step, tokens/s and ETA. Redrawn in place (a carriage return) at
    most every PROGRESS_INTERVAL seconds; `where()` -> the text it
    starts with ("step 3/200 | eta 1.2 min | ")."""

    def __init__(self, where=lambda: ""):
        self.where = where
        self.shown = False  # a status line is on the screen
        self.drawn_at = 0.0  # when it was last drawn
        self.started = 0.0  # when this generate call began decoding
        self.tokens = 0  # the tokens it has sampled since

    def __call__(self, done: int, total: int, rows: int):
        """After each decode step: `done` of `total` positions sampled,
        `rows` rows decoding (each sampled a token)."""
        now = time.time()
        if done == 1:  # a new generate call: its rate counts from here
            self.started = now
            self.tokens = 0
            return
        self.tokens += rows
        # the rate is drawn once there is an interval to measure it over
        if min(now - self.drawn_at, now - self.started) >= PROGRESS_INTERVAL:
            rate = self.tokens / (now - self.started)
            self.draw(f"{self.where()}sampling {done}/{total} tokens, {rate:.0f} tok/s")

    def draw_step(self, m: dict, run):
        """After a step whose line is not printed (logging_steps)."""
        if time.time() - self.drawn_at >= PROGRESS_INTERVAL:
            self.draw(
                f"step {m['step']}/{run.cfg.max_steps} | "
                f"eta {eta_minutes(run, m['step']):.1f} min | "
                f"{num(m, 'tokens_per_sec', '.0f')} tok/s | {num(m, 'step_time', '.2f')} s/step"
            )

    def draw(self, text: str):
        """Replace the status line with `text`, cut to the terminal's
        width (a line that wraps cannot be redrawn)."""
        width = shutil.get_terminal_size().columns - 1
        # back to column 0 after it: a print from elsewhere writes over it
        sys.stdout.write("\r" + text[:width] + "\033[K\r")
        sys.stdout.flush()
        self.shown = True
        self.drawn_at = time.time()

    def clear(self):
        """Erase the status line, before a line that stays."""
        if self.shown:
            sys.stdout.write("\r\033[K")
            sys.stdout.flush()
            self.shown = False


def open_progress(run, t) -> Progress | None:
    """The run's status line when rank 0 writes to a terminal, else None
    (a log file gets the step lines only); it becomes the sampler's
    decode-step callback (sampler.on_decode_step) until the run's last
    step is logged (a run stopped by an error leaves it there until the
    next run opens its logs)."""
    progress = None
    if run.info.is_main and sys.stdout.isatty():

        def where():
            step = min(t.step + 1, run.cfg.max_steps)
            text = f"step {step}/{run.cfg.max_steps} | "
            if t.step > run.started[1]:  # a step to measure the ETA by
                text += f"eta {eta_minutes(run, t.step):.1f} min | "
            return text

        progress = Progress(where)
    sampler.on_decode_step = progress
    return progress


def close_progress(run):
    """Erase the status line and stop the sampler's calls to it."""
    if run.progress is not None:
        run.progress.clear()
    run.progress = None
    sampler.on_decode_step = None


def open_sampling_progress() -> Progress | None:
    """sample.py's status line: a Progress when stdout is a terminal."""
    return Progress() if sys.stdout.isatty() else None


def tracker_names(m: dict) -> dict:
    """Metric names as TRL logs them: train/<name>, eval/<name>."""
    out = {}
    for k, v in m.items():
        if not isinstance(v, (int, float)) or k == "step":
            continue
        if k.startswith("eval/"):
            out[k] = v
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
                f"pip install {name}, or use --report_to=none"
            ) from None
    return out


def open_reporter(name: str, cfg: TrainConfig):
    if name == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(os.path.join(cfg.output_dir, "runs"))

        def report(m, step):
            for k, v in tracker_names(m).items():
                writer.add_scalar(k, v, step)
            writer.flush()

        return report
    if name == "wandb":
        import wandb

        project = os.environ.get("WANDB_PROJECT", "nanogrpo")
        wb = wandb.init(project=project, name=cfg.run_name, config=asdict(cfg), dir=cfg.output_dir)
        return lambda m, step: wb.log(tracker_names(m), step=step)
    import trackio

    project = os.environ.get("TRACKIO_PROJECT", "nanogrpo")
    trackio.init(project=project, name=cfg.run_name, config=asdict(cfg))
    return lambda m, step: trackio.log(tracker_names(m), step=step)


def nothing_to_do(t):
    dist.print0(
        f"nothing to do: the checkpoint is at step {t.step} and "
        f"max_steps={t.cfg.max_steps}; raise --max_steps to "
        "train further"
    )


# -----------------------------------------------------------------------------
# Metrics: TRL's names and definitions


def add_round_metrics(run, t, rounds: list[dict], records):
    """Put the reward, completion and timing metrics of the rounds a
    cycle sampled (train.sample_round's records: ro, local [n, K] this
    rank's rewards, rewards [N, K] all ranks', timing) into each of its
    step records: one round's own values, the mean of several rounds'.
    Each record also gets TRL's `epoch` at its step. Also checks the
    rewards and keeps a few samples."""
    info = t.info
    for m in records:  # the steps' loss metrics, read from the device at once
        m.update(step_metrics(m, t))
    checks = {}  # check_rewards' numbers, of the last round
    gens = [generation_metrics(t, s["ro"], s["rewards"], checks) for s in rounds]
    gen = {k: sum(g[k] for g in gens) / len(gens) for k in gens[0]}
    timing = {}
    for s in rounds:
        for k, v in s["timing"].items():
            timing[k] = timing.get(k, 0.0) + v
    last = rounds[-1]
    check_rewards(run, checks["scored"], checks["max_abs"], gens[-1]["frac_reward_zero_std"])
    check_lengths(run, gen["completions/clipped_ratio"], t.cfg.max_completion_length)
    shown = t.cfg.num_completions_to_print or 2
    run.samples = shown_samples(
        last["ro"], last["local"], t.reward_weights, shown, last["logs"].columns
    )
    # what reward functions logged (log_metric): each name's mean over the
    # cycle's calls, as TRL
    logged = {}
    for s in rounds:
        for k, v in s["logs"].metrics.items():
            logged.setdefault(k, []).extend(v)
    user_metrics = {k: sum(v) / len(v) for k, v in logged.items()}
    updates = sum(m["time/update"] for m in records)
    cycle_time = sum(timing.values()) + updates
    tokens = float(sum(s["ro"].num_tokens() for s in rounds))
    if info.world_size > 1:
        tokens = torch.tensor(tokens, device=info.device)
        tokens = dist.all_reduce_sum(tokens, info).item()
    # TRL's num_tokens: prompt + completion tokens seen so far, all ranks
    seen = run.history[-1].get("num_tokens", 0) if run.history else 0
    num_prompts = len(t.prompts.rows)
    for m in records:
        m.update(gen)
        m.update(timing)
        m.update(last.get("async", {}))  # async_rollouts' (run/async_rollouts.py)
        m.update(user_metrics)
        # TRL's epoch: transformers' fractional passes over the prompts
        m["epoch"] = epochs_done(t.cfg, m["step"], num_prompts, info.world_size)
        m["step_time"] = cycle_time / len(records)
        m["tokens_per_sec"] = tokens / cycle_time
        m["num_tokens"] = seen + tokens
        for s in rounds:
            m.update(s["stats"])  # dynamic sampling's, if on
    for s in rounds:
        if s["stats"]:
            wanted = len(s["ro"].rows) * info.world_size
            check_dynamic_sampling(
                run, s["stats"]["dynamic_sampling/groups_kept"], wanted, t.cfg.max_num_gen_batches
            )


# -----------------------------------------------------------------------------
# Warnings about rewards that cannot teach


def warn_once(run, key: str, message: str):
    if key not in run.warned:
        run.warned.add(key)
        dist.print0(f"warning: {message}")


def check_rewards(run, scored: int, max_abs: float, frac_zero_std: float, patience: int = 10):
    """Say so (once each) when a round's rewards cannot teach: none
    scored, too large for float32 statistics, or no spread in any group
    for `patience` rounds in a row. scored: rows with a weighted reward;
    max_abs: their largest |reward| (generation_metrics' checks)."""
    if scored == 0:
        warn_once(
            run,
            "unscored",
            "no completion got a reward this round: every reward "
            "function returned None or NaN for every completion, "
            "so nothing is learned",
        )
    elif max_abs > 1e18:
        warn_once(
            run,
            "overflow",
            f"rewards up to {max_abs:.2e} overflow float32 "
            "statistics (the group std becomes inf, advantages 0): "
            "rescale the reward functions",
        )
    if streak(run, "zero_spread", frac_zero_std == 1.0) >= patience:
        warn_once(
            run,
            "zero_spread",
            f"every group's rewards were identical for {patience} "
            "rounds in a row: advantages are 0 and nothing is "
            "learned; make the task easier, the reward more graded, "
            "or num_generations larger",
        )


def streak(run, name: str, hit: bool) -> int:
    """Rounds in a row that `hit` (0 once one does not)."""
    run.streaks[name] = run.streaks.get(name, 0) + 1 if hit else 0
    return run.streaks[name]


def check_lengths(run, clipped_ratio: float, max_length: int, patience: int = 5):
    """Say so (once) when most completions hit max_completion_length for
    `patience` rounds in a row: the most common cause of a reward stuck
    at 0 (the answer never gets written)."""
    if streak(run, "clipped", clipped_ratio > 0.5) >= patience:
        warn_once(
            run,
            "clipped",
            f"most completions hit max_completion_length={max_length} "
            f"for {patience} rounds in a row: they are cut before "
            "their answer; raise max_completion_length or ask for "
            "shorter answers",
        )


def check_dynamic_sampling(run, kept: float, wanted: int, max_batches: int):
    """Say so (once) when dynamic sampling could not find the round's
    groups with differing rewards within max_num_gen_batches batches."""
    if kept < wanted:
        warn_once(
            run,
            "dynamic_sampling",
            f"dynamic_sampling found {int(kept)} groups with differing "
            f"rewards of the {wanted} a round trains, in "
            f"max_num_gen_batches={max_batches} batches: groups of "
            "equal rewards (no learning signal) fill the round. Said "
            "once; dynamic_sampling/groups_kept counts them each round",
        )


# -----------------------------------------------------------------------------
# The end of a run


def summarize(run, t):
    """Mean reward over the first and last tenth of the steps, a few
    completions, the reward curve and a sample command that works."""
    history = [m for m in run.history if "loss" in m]  # steps, not eval_on_start's record
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
    # check_finite said so at the first; how many followed
    diverged = [m["step"] for m in history if m["loss"] is None or m.get("grad_norm") is None]
    if diverged:
        change += (
            f"; {len(diverged)} steps with a loss or grad norm that was not finite "
            f"(the first: step {diverged[0]})"
        )
    print(f"done: {len(history)} steps, {change}. Last round:")
    print_samples(run.samples)
    ckpt = os.path.join(run.cfg.output_dir, "checkpoint")
    print(f"Checkpoint: {ckpt}")
    print(f"Reward curve: {plot_rewards(run.cfg)}")
    print(f"Sample from it: python sample.py --model {ckpt} {sample_text(run, t)}", flush=True)


def sample_text(run, t) -> str:
    """sample.py's prompt argument for the summary: the first row's
    prompt; where an environment writes it (a row without one, or TRL's
    empty placeholder), the last round's first prompt as it was sampled."""
    prompt = t.prompts.rows[0].get("prompt")
    if isinstance(prompt, str):
        return f"--prompt {shlex.quote(prompt)}"
    if prompt and prompt[-1]["content"]:
        return f"--chat {shlex.quote(prompt[-1]['content'])}"
    # environments: conversational, reset() wrote the last message
    shown = run.samples[0]["prompt"] if run.samples else "..."
    return f"--chat {shlex.quote(shown)}"


def plot_rewards(cfg: TrainConfig) -> str:
    """Draw out_dir/reward.png from metrics.jsonl when matplotlib is
    installed; otherwise say how to get it."""
    metrics = os.path.join(cfg.output_dir, "metrics.jsonl")
    png = os.path.join(cfg.output_dir, "reward.png")
    try:
        import matplotlib
    except ImportError:
        return f"pip install matplotlib, then: python bench/plot.py {metrics} -o {png}"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(metrics) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = [r for r in rows if "reward" in r]  # not eval_on_start's record: no training reward
    steps = [r["step"] for r in rows]
    rewards = [math.nan if r["reward"] is None else r["reward"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, rewards)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward")
    ax.set_title(cfg.output_dir)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png
