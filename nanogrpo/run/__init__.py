"""What a training run does around the algorithm: the bookkeeping train.py calls.

Owns: the output folder (one run at a time holds it; a fresh run never replaces another), which
checkpoint a run resumes from and what it restores, what is checked before step 1 so that the
first save cannot fail (a writable folder, the hub), saving (on schedule, on Ctrl-C or SIGTERM,
after an error; a LoRA run's merged checkpoint), stopping every rank where a cycle ends or, while
a round samples before the cycle's first step, at once (`abandonable`: the round is dropped), the
embedded default's tiny checkpoint, `train`: the loop of train.py's cycles with all of that around
them (evaluation and saves on schedule), and `main`: one-line errors (`--help` is
run/configurator.py's). What a run reports (metrics, console, trackers, summary) is
run/report.py's; the files of a checkpoint-<step>/ are run/checkpoints.py's.

Does not know about: the GRPO math, sampling, or log-probs.

It reads a few named fields of trainer.py's `Trainer` (cfg, info, sched, model, optimizer,
scheduler, tok, prompts, step, round, entropy_coef, last_entropy) to save and restore them.
"""

import atexit
import fcntl
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import sys
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace

import torch

from nanogrpo import checkpoint, distributed as dist
from nanogrpo.extras import lora
from nanogrpo.model import ModelConfig, Transformer
from nanogrpo.rewards import RewardError
from nanogrpo.run import checkpoints, plan, report
from nanogrpo.run.config import ConfigError, TrainConfig
from nanogrpo.run.configurator import help_text, load_config
from nanogrpo.tokenizer import char_level_tokenizer

# Settings a resumed run takes from its checkpoint, whatever is passed.
RESTORED_ON_RESUME = {
    "learning_rate": "the optimizer's state",
    "adam_beta1": "the optimizer's state",
    "adam_beta2": "the optimizer's state",
    "adam_epsilon": "the optimizer's state",
    "weight_decay": "the optimizer's state",
}
# A resumed LoRA run loads the checkpoint's adapters (their
# adapter_config.json): their dropout is restored as above, and what
# shapes them cannot change.
ADAPTER_RESTORED = {
    "lora_dropout": "the checkpoint's adapter",
    "disable_dropout": "the checkpoint's adapter",
}
ADAPTER_SHAPE = [
    "use_peft",
    "lora_r",
    "lora_alpha",
    "lora_target_modules",
    "lora_modules_to_save",
    "use_rslora",
]
# Files train.py writes into out_dir: a fresh run refuses to replace them.
RUN_FILES = r"metrics\.jsonl|checkpoint(-\d+)?(\.tmp)?"
# What a save killed before its rename leaves (run/checkpoints.py's save_checkpoint)
UNFINISHED_SAVE = r"checkpoint(-\d+)?\.tmp"
# out_dir's lock file: the run holding it wrote who it is there
LOCK_FILE = "run.lock"
HUB_TIMEOUT = 30  # seconds the hub has to answer before step 1


@dataclass
class Run:
    """A run's bookkeeping between rounds (nanogrpo.trainer's Trainer
    holds the algorithm's state)."""

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
    # rounds in a row a warning's condition held (report.streak)
    streaks: dict = field(default_factory=dict)
    command: list = field(default_factory=list)  # for the resume hint
    progress: object = None  # report.Progress: the status line on a terminal
    # inside a cycle (`cycle`): the prompt sampler's state and the step at
    # its start, where a stop inside it goes back to; None between cycles
    cycle_begin: dict | None = None
    cycle_start_step: int = 0


# -----------------------------------------------------------------------------
# Starting: the output folder and the checkpoint to resume from


def start(cfg: TrainConfig, info, command=None) -> tuple[Run, TrainConfig]:
    """Check out_dir and take its lock, check the hub, decide fresh or
    resumed, build the embedded default's checkpoint. -> (the run, the
    config the run will use: on resume, the optimizer settings come from
    the checkpoint)."""
    check_out_dir(cfg.output_dir)
    run = Run(cfg=cfg, info=info, command=command or ["train.py"])
    claim_out_dir(run)
    if cfg.resume_from_checkpoint:
        remove_unfinished_saves(cfg, info)
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
    writing a file in it, or in the nearest folder above it that exists:
    nothing is created, so ranks checking at once cannot race."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError(
            f"output_dir={out_dir!r} is a file, not a directory: choose another --output_dir"
        )
    path = os.path.abspath(out_dir)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    probe = os.path.join(path, f".write-test-{os.getpid()}")
    try:
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise ConfigError(
            f"output_dir={out_dir!r} cannot be written ({e.strerror}): choose another --output_dir"
        ) from None


def claim_out_dir(run: Run):
    """Rank 0 takes out_dir's lock and checks the hub; every rank raises
    its verdict, the same one-line error."""
    problem = None
    if run.info.is_main:
        problem = lock_out_dir(run) or hub_problem(run.cfg)
    problem = dist.broadcast_object(problem)
    if problem:
        raise ConfigError(problem)


# out_dir's lock file (its real path) -> the open file that holds this
# process's lock on it. The lock goes when its Run is collected; a run that
# ended in an exception may live on in the traceback, and the next run of
# this process into the same out_dir takes its lock over (train() calls
# never nest).
_held_locks = {}


def lock_out_dir(run: Run) -> str | None:
    """Lock out_dir for the life of `run` (rank 0 alone): a second run into
    it is refused while this one lives. An flock on out_dir/run.lock,
    which the OS releases when the process ends, even by kill -9: no
    stale lock outlives a crash. -> why the lock cannot be had, or None."""
    out_dir = run.cfg.output_dir
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.realpath(os.path.join(out_dir, LOCK_FILE))
    earlier = _held_locks.pop(path, None)
    if earlier is not None:
        earlier.close()
    f = open(path, "a+")  # not "w": that would erase the holder's line
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "its pid is not written yet"
        f.close()
        return (
            f"output_dir={out_dir!r} is in use by another run ({holder}): "
            "wait for it to end, or choose another --output_dir"
        )
    f.truncate(0)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    f.write(
        f"pid {os.getpid()} on {socket.gethostname()}, since {started}: {shlex.join(run.command)}\n"
    )
    f.flush()
    _held_locks[path] = f
    weakref.finalize(run, f.close)
    return None


def remove_unfinished_saves(cfg: TrainConfig, info):
    """What a save killed before its rename left in out_dir
    (checkpoint-<step>.tmp), removed with a note. Safe only because this
    run holds out_dir's lock: no other run is saving there."""
    if info.is_main and os.path.isdir(cfg.output_dir):
        for name in sorted(os.listdir(cfg.output_dir)):
            if re.fullmatch(UNFINISHED_SAVE, name):
                path = os.path.join(cfg.output_dir, name)
                remove(path)
                dist.print0(f"note: removed {path}, a save that did not finish")
    dist.barrier()


def find_checkpoint(cfg: TrainConfig) -> str | None:
    """The checkpoint to resume from: `resume` may be a path (it must
    hold, whole, all a resume reads) or true: the newest checkpoint-<step>
    of out_dir that does, as TRL's get_last_checkpoint (each passed over
    is named, with the file that is missing or damaged); None starts
    fresh."""
    resume = cfg.resume_from_checkpoint  # False, True or a path (TrainConfig normalises text)
    if not resume:
        return None
    if isinstance(resume, str):
        problem = checkpoints.unresumable(resume)
        if problem:
            lacks = problem.startswith("no ")
            error = FileNotFoundError if lacks else ValueError
            why = "holds no trainer state" if lacks else "cannot be resumed"
            raise error(
                f"resume_from_checkpoint={resume!r} {why} ({problem}): point it at an "
                "intact out_dir/checkpoint-<step> written by train.py, or use "
                "--resume_from_checkpoint=true"
            )
        return resume
    out_dir = cfg.output_dir
    passed = []  # checkpoints that cannot be resumed
    for name in step_dirs(out_dir):
        path = os.path.join(out_dir, name)
        problem = checkpoints.unresumable(path)
        if problem is None:
            note_link(out_dir, path)
            return path
        dist.print0(f"note: {path} cannot be resumed ({problem}): passed over")
        passed.append(name)
    if passed and not cfg.overwrite_output_dir:
        raise ConfigError(
            f"resume_from_checkpoint=true: no checkpoint in {out_dir} can be "
            f"resumed ({', '.join(passed)} lack files or hold damaged ones): start over with "
            "--overwrite_output_dir=true (deletes them), or choose another "
            "--output_dir"
        )
    dist.print0(
        f"resume_from_checkpoint=true: no checkpoint in {out_dir} yet, so this run starts fresh"
    )
    return None


def step_dirs(out_dir: str) -> list[str]:
    """out_dir's checkpoint-<step> folders, the highest step first."""
    if not os.path.isdir(out_dir):
        return []
    steps = []
    for name in os.listdir(out_dir):
        match = re.fullmatch(r"checkpoint-(\d+)", name)
        if match and os.path.isdir(os.path.join(out_dir, name)):
            steps.append(int(match[1]))
    return [f"checkpoint-{s}" for s in sorted(steps, reverse=True)]


def note_link(out_dir: str, chosen: str):
    """A note when out_dir/checkpoint (the newest save's link) does not
    lead to `chosen`: it dangles, or names a checkpoint passed over."""
    link = os.path.join(out_dir, "checkpoint")
    if not os.path.islink(link):
        return
    if os.path.realpath(link) == os.path.realpath(chosen):
        return
    gone = "" if os.path.exists(link) else ", which is gone"
    dist.print0(
        f"note: {link} points at {os.readlink(link)}{gone}: "
        f"resuming from {chosen}, the newest that can be resumed"
    )


def restored_config(saved: dict, cfg: TrainConfig) -> TrainConfig:
    """The config of a resumed run: what it will really use, so that
    train_config.json records the truth. Names every setting that differs
    from the checkpoint's run; the optimizer's settings (and a LoRA run's
    dropout) are the checkpoint's; another model, or other adapters,
    are errors."""
    if saved.get("model") not in (None, cfg.model):
        raise ConfigError(
            f"this checkpoint was trained from model={saved['model']!r}, "
            f"not {cfg.model!r}: resume without --model, or start a new "
            "run in another --output_dir"
        )
    now = json.loads(json.dumps(config_record(cfg)))  # tuples as lists, as saved
    restored = {}
    skip = ("resume_from_checkpoint", "max_steps")
    changed = [k for k in now if k in saved and saved[k] != now[k]]
    keep = dict(RESTORED_ON_RESUME)
    if saved.get("use_peft") or cfg.use_peft:
        check_adapter_shape(saved, now, changed)
        keep.update(ADAPTER_RESTORED)
    for key in sorted(k for k in changed if k not in skip):
        note = f"note: {key} was {saved[key]!r} in the checkpoint's run"
        if key in keep:
            restored[key] = saved[key]
            dist.print0(f"{note}; {now[key]!r} is ignored ({keep[key]} wins)")
        else:
            dist.print0(f"{note}, now {now[key]!r}")
    return replace(cfg, **restored)


def check_adapter_shape(saved: dict, now: dict, changed: list):
    """A resumed LoRA run continues the checkpoint's adapters (and a full
    run its full weights): a setting that would change which parameters
    train is refused, by name."""
    refused = [k for k in ADAPTER_SHAPE if k in changed]
    if not refused:
        return
    given = ", ".join(f"{k}={now[k]!r}" for k in refused)
    had = ", ".join(f"{k}={saved[k]!r}" for k in refused)
    flags = " ".join(f"--{k}" for k in refused)
    raise ConfigError(
        f"{given}, but the checkpoint's run trained with {had}, and a resumed "
        f"run continues what it trained: drop {flags} to resume it, or start "
        "a new run in another --output_dir"
    )


def config_record(cfg: TrainConfig) -> dict:
    """The config as JSON can hold it: a function or class defined in the
    config file is recorded by name (the file defines it again on resume)."""
    record = asdict(cfg)

    def named(item):
        if item is None or isinstance(item, str):
            return item
        return f"{getattr(item, '__name__', type(item).__name__)} (config file)"

    for key in ("reward_funcs", "tools"):
        record[key] = [named(item) for item in record[key]]
    record["rollout_func"] = named(record["rollout_func"])
    factory = record["environment_factory"]
    if isinstance(factory, dict):
        record["environment_factory"] = {k: named(v) for k, v in factory.items()}
    else:
        record["environment_factory"] = named(factory)
    return record


def clear_out_dir(cfg: TrainConfig, info):
    """A fresh run never silently replaces another: an out_dir holding
    what train.py writes is an error, unless overwrite_output_dir asks
    to delete those files (only those), or resume_from_checkpoint=true
    found nothing saved to continue. What a run that stopped before its
    first step leaves (an empty metrics.jsonl, run.lock) is no run."""
    names = []  # rank 0 looks and decides: another rank could look after it deleted
    if info.is_main and os.path.isdir(cfg.output_dir):
        names = sorted(n for n in os.listdir(cfg.output_dir) if re.fullmatch(RUN_FILES, n))
        # a run that never took a step leaves metrics.jsonl empty: nothing to keep
        # (open_logs rewrites it)
        if names == ["metrics.jsonl"] and not os.path.getsize(
            os.path.join(cfg.output_dir, names[0])
        ):
            names = []
    names = dist.broadcast_object(names)
    if not names:
        return
    # resume_from_checkpoint=true found none: what is here was never saved
    # (find_checkpoint refuses checkpoints it passed over)
    unsaved = cfg.resume_from_checkpoint is True
    if not cfg.overwrite_output_dir and not unsaved:
        raise ConfigError(
            f"output_dir={cfg.output_dir!r} holds a run ({', '.join(names[:4])}): "
            "continue it with --resume_from_checkpoint=true, start over with "
            "--overwrite_output_dir=true (deletes them), or choose "
            "another --output_dir"
        )
    if unsaved and not cfg.overwrite_output_dir:
        dist.print0(f"note: replacing {', '.join(names)}: nothing there can be resumed")
    if info.is_main:
        for name in names:
            remove(os.path.join(cfg.output_dir, name))
    dist.barrier()


def remove(path: str):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


def ensure_tiny_checkpoint(cfg: TrainConfig, info):
    """For the embedded default: build a random model and a char-level
    tokenizer and save them in HF format at cfg.model, so the run loads
    them like any checkpoint. init.json records the recipe; a changed
    recipe rebuilds it. A checkpoint not written here is left alone.
    Rank 0 decides and writes; every rank waits for it."""
    if cfg.init_model is None:
        return
    recipe = {
        "init_model": cfg.init_model,
        "init_tokenizer_chars": cfg.init_tokenizer_chars,
        "seed": cfg.seed,
    }
    if info.is_main and tiny_checkpoint_due(cfg.model, recipe):
        write_tiny_checkpoint(cfg.model, recipe)
    dist.barrier()


def tiny_checkpoint_due(path: str, recipe: dict) -> bool:
    """Whether `path` needs (re)building from `recipe`."""
    marker = os.path.join(path, "init.json")
    if not os.path.exists(os.path.join(path, "config.json")):
        return True
    if not os.path.exists(marker):
        return False  # not written here: left alone
    if checkpoint.read_json(marker) == recipe:
        return False
    print(f"{path} was built from another init_model, init_tokenizer_chars or seed: rebuilding it")
    return True


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
        checkpoint.write_model(
            tmp,
            model.config,
            model.state_dict(),
            tokenizer=tok,
            generation_config=generation_config,
        )
        checkpoint.write_json(os.path.join(tmp, "init.json"), recipe)


# -----------------------------------------------------------------------------
# Restoring and saving the trainer


def restore(run: Run, t):
    """Load the trainer state of run.resume_from into t (a Trainer)."""
    cfg = run.cfg
    state = checkpoints.load_trainer_state(run.resume_from, t.model, t.optimizer, run.info)
    t.step = state["step"]
    cycles = t.step // t.sched.steps_per_cycle  # a checkpoint without it
    t.round = state.get("round", cycles * t.sched.rounds_per_cycle)
    t.scheduler.load_state_dict(state["scheduler"])
    t.prompts.load_state_dict(state["prompts"])
    entropy = state.get("entropy_control")  # use_adaptive_entropy's state
    if entropy:
        t.entropy_coef = entropy["entropy_coef"]
        last = entropy["last_entropy"]
        t.last_entropy = math.inf if last is None else last
    saved_by = state.get("world_size", run.info.world_size)
    if saved_by != run.info.world_size:
        dist.print0(
            f"note: {run.resume_from} was saved by {saved_by} "
            f"process(es), this run has {run.info.world_size}: the "
            "optimizer state is the same, each step's batch is not "
            "(per_device_train_batch_size stays, as in TRL)"
        )
    run.history = state["history"]
    run.pending = state.get("pending", [])
    run.written = [
        n for n in state.get("checkpoints", []) if os.path.isdir(os.path.join(cfg.output_dir, n))
    ]
    # the `checkpoint` link moves on: keep what it pointed at
    run.resume_source = os.path.realpath(run.resume_from)
    dist.print0(f"resumed from {run.resume_from} at step {t.step}")


def open_logs(run: Run, t):
    """metrics.jsonl (rewritten from history on resume) and trackers."""
    if run.info.is_main:
        os.makedirs(run.cfg.output_dir, exist_ok=True)
        path = os.path.join(run.cfg.output_dir, "metrics.jsonl")
        with open(path, "w") as f:
            for m in run.history:
                f.write(json.dumps(m) + "\n")
    run.reporters = report.open_reporters(run.cfg, run.info)
    run.started = (time.time(), t.step)
    run.progress = report.open_progress(run, t)  # None unless stdout is a terminal
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
    per_cycle = t.sched.steps_per_cycle
    if t.cfg.max_steps % per_cycle:
        # the round's samples are not checkpointed
        dist.print0(
            f"warning: max_steps={t.cfg.max_steps} ends inside a "
            f"cycle of {per_cycle} optimizer steps: the last one is "
            "cut short, and a run resumed from its checkpoint starts "
            "a new round (not what an uninterrupted run would do); "
            f"use a multiple of {per_cycle} to resume exactly"
        )


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
        "entropy_control": {
            "entropy_coef": t.entropy_coef,
            "last_entropy": None if math.isinf(t.last_entropy) else t.last_entropy,
        },
        "history": run.history,
        "checkpoints": run.written + [name],
        "world_size": run.info.world_size,
    }
    if run.pending:  # a cycle's records whose evaluation a stop dropped: the resumed run does it
        state["pending"] = run.pending
    checkpoints.save_checkpoint(
        cfg.output_dir, t.step, t.model, t.optimizer, t.tok, state, config_record(cfg), run.info
    )
    run.written.append(name)
    if run.info.is_main:
        run.written = checkpoints.prune_checkpoints(
            cfg.output_dir, run.written, cfg.save_total_limit, keep=run.resume_source
        )
        if cfg.push_to_hub:
            push_to_hub(cfg, os.path.join(cfg.output_dir, name), t.step)


def hub_repo(cfg: TrainConfig) -> str:
    """TRL's hub_model_id, or the output_dir's name (as transformers)."""
    return cfg.hub_model_id or os.path.basename(os.path.abspath(cfg.output_dir))


def hub_problem(cfg: TrainConfig) -> str | None:
    """With push_to_hub, the first upload comes at the first save, maybe
    hours in: what would fail it is tried before step 1 (a token, the hub
    answering, the repo created or there). -> why it fails, or None."""
    if not cfg.push_to_hub:
        return None
    from huggingface_hub import HfApi, get_token

    fix = "or set --push_to_hub=false"
    if not get_token():
        return (
            "push_to_hub=true but no Hugging Face token is set: log in "
            f"with `hf auth login` or set HF_TOKEN, {fix}"
        )
    repo = hub_repo(cfg)
    outcome = []  # the exception create_repo raised, or None

    # huggingface-hub's requests have no timeout: a thread bounds the wait
    def create():
        try:
            HfApi().create_repo(repo, exist_ok=True)
            outcome.append(None)
        except Exception as e:
            outcome.append(e)

    thread = threading.Thread(target=create, daemon=True)
    thread.start()
    thread.join(HUB_TIMEOUT)
    if not outcome:
        return (
            f"push_to_hub=true: the hub did not answer in {HUB_TIMEOUT} s "
            f"(creating the repo {repo!r}): check the network, {fix}"
        )
    error = outcome[0]
    if error is None:
        return None
    why = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return (
        f"push_to_hub=true: the hub repo {repo!r} cannot be created "
        f"({why}): check the network and the token (`hf auth login`, "
        f"HF_TOKEN), {fix}"
    )


def push_to_hub(cfg: TrainConfig, folder: str, step: int):
    """Upload a checkpoint's model files (not the optimizer) to the hub
    repo (hub_problem created it before step 1), through huggingface-hub's
    upload API (token: HF_TOKEN or `hf auth login`)."""
    from huggingface_hub import HfApi

    api = HfApi()
    repo = hub_repo(cfg)
    api.upload_folder(
        repo_id=repo,
        folder_path=folder,
        commit_message=f"nanogrpo: step {step}",
        ignore_patterns=["trainer/*"],
    )


def save_merged(run: Run, t):
    """merge_adapter: the adapters folded into the base weights, a full
    HF checkpoint at out_dir/merged."""
    state = dist.full_state_dict(t.model)  # every rank gathers
    if run.info.is_main:
        merged = lora.merged_state_dict(state, t.model.lora_config)
        path = os.path.join(run.cfg.output_dir, "merged")
        with checkpoint.atomic_dir(path) as tmp:
            checkpoint.write_model(tmp, t.model.config, merged, t.model.generation_config, t.tok)
    dist.barrier()


@contextmanager
def cycle(run: Run, t):
    """Around one of train.py's cycles: where a stop inside it goes back
    to (the prompt sampler's state and the step at its start). An error
    leaves them set for saving_on_stop."""
    run.cycle_begin = t.prompts.state_dict()
    run.cycle_start_step = t.step
    yield
    run.cycle_begin = None


@contextmanager
def saving_on_stop(run: Run, t):
    """Inside: Ctrl-C (SIGINT) or SIGTERM stops the run at once while it
    samples or scores before the cycle's first step (abandonable: the
    round is dropped, the last step saved), else where the cycle ends
    (on_stop_signal, stop_if_signalled; in the last cycle the run ends as
    usual); a second Ctrl-C stops at once (save_on_stop keeps what is
    exact). An error saves the last completed step, then is re-raised.
    With several processes an error saves nothing (the others may be
    inside a collective): rank_error names it with this rank and step,
    for main's one line."""
    previous = catch_stop_signals(run, t)
    try:
        yield
    except Abandoned as e:  # every rank together (abandonable's exit)
        stop(run, t, e.signum)
    except KeyboardInterrupt:
        if run.info.sharded:
            dist.tell_peers(f"rank {run.info.rank}: interrupted")
        save_on_stop(run, t, "interrupted")
        raise
    except Exception as e:
        if run.info.sharded:
            failure = rank_error(run, t, e)
            if failure:
                raise failure from e
            raise
        try:
            save_on_stop(run, t, "stopped by an error")
        except Exception as e:  # the error may be the disk itself
            dist.print0(f"could not save after the error: {e}")
        raise
    finally:
        restore_signals(previous)
        stopping.update(run=None, t=None, window=False)
        signalled["signum"] = 0


def saved(run: Run, step: int) -> bool:
    return bool(run.written) and run.written[-1] == f"checkpoint-{step}"


def save_on_stop(run: Run, t, why: str):
    """A second Ctrl-C or an error: keep what was trained (the last
    completed step) and say how to continue. Stopped inside a round
    before its first optimizer step, the checkpoint records the prompt
    sampler where the round began, so the resumed run redoes that round."""
    cfg = run.cfg
    where = f"{why} at step {t.step}/{cfg.max_steps}"
    reason = unsaveable(run, t)
    if reason:
        dist.print0(f"\n{where}: not saved ({reason}); {after_unsaved(run)}")
        return
    report.log(run)  # a finished round's records, if stopped in its evaluation
    if not saved(run, t.step):
        if run.cycle_begin is not None:
            t.prompts.load_state_dict(run.cycle_begin)
        save(run, t)
    dist.print0(
        f"\n{where}: saved {cfg.output_dir}/checkpoint-{t.step}. "
        f"Continue with:\n  {resume_command(run)}"
    )


def after_unsaved(run: Run) -> str:
    """What a stop that saved nothing leaves to continue from: the newest
    checkpoint this run wrote or resumed from; else, when no step was
    logged, nothing (clear_out_dir keeps nothing of a run without steps)."""
    if run.written:
        latest = os.path.join(run.cfg.output_dir, run.written[-1])
        return f"the latest checkpoint is {latest}. Continue with:\n  {resume_command(run)}"
    if run.resume_from:
        return f"the same command resumes {run.resume_from} again"
    if not run.history:
        return "nothing was saved, so the same command starts over"
    return "nothing was saved: start over with --overwrite_output_dir=true"


def unsaveable(run: Run, t) -> str | None:
    """Why the state at a stop cannot be saved exactly, or None."""
    if run.info.world_size > 1:
        return "several processes cannot save together after a stop"
    if t.step == 0:
        return "no optimizer step was taken yet"
    if run.cycle_begin is not None and t.step > run.cycle_start_step:
        return "it stopped between two optimizer steps of one round"
    return None


def resume_command(run: Run) -> str:
    """The command that continues this run from its latest checkpoint."""
    args = [a for a in run.command if not a.startswith(("--resume", "--overwrite_output_dir"))]
    launcher = "python"
    if run.info.sharded:
        per_node = os.environ.get("LOCAL_WORLD_SIZE", run.info.world_size)
        launcher = f"torchrun --nproc_per_node {per_node}"
    return f"{launcher} {shlex.join(args + ['--resume_from_checkpoint=true'])}"


def current_step(run: Run, t) -> int:
    """The step a stop or a failure came at: the one being trained inside
    a cycle, else the last one completed."""
    return t.step if run.cycle_begin is None else t.step + 1


def rank_error(run: Run, t, e: Exception) -> Exception | None:
    """An error on one of several ranks, told to the others (they look
    when torchrun stops them: on_stop_signal). -> RankFailure, one line,
    when a collective failed (another rank hung or died); else None, and
    e carries this rank and step as a note (main's line, a traceback)."""
    where = f"rank {run.info.rank}"
    what = dist.collective_failure(e, run.info, run.cfg.ddp_timeout)
    if what is None:
        e.add_note(f"{where}, at step {current_step(run, t)}")
        dist.tell_peers(f"{where}: {type(e).__name__}: {e}")
        return None
    line = f"{where}: at step {current_step(run, t)}, {what}: {dist.first_sentence(str(e))}"
    dist.tell_peers(line)
    return RankFailure(line)


# -----------------------------------------------------------------------------
# Stopping on a signal: every rank where the same cycle ends

STOP_SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}
# the stop signal this process received inside saving_on_stop; 0 = none
signalled = {"signum": 0}
# the run inside saving_on_stop (one at a time) and its Trainer, for abandonable;
# window: inside abandonable
stopping = {"run": None, "t": None, "window": False}


class Stopped(BaseException):
    """The run stopped on a signal, its last step saved: main exits with
    128 + signum (130 for Ctrl-C, 143 for SIGTERM), as a shell reports a
    signal. Not an Exception: no `except Exception` takes it for an error."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class Abandoned(KeyboardInterrupt):
    """A stop signal inside `abandonable`: the round being sampled or
    scored is dropped. A KeyboardInterrupt, so that what passes Ctrl-C
    through (asyncio's tasks, `except Exception`) passes it through too."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class RankFailure(Exception):
    """A collective failed: another rank stopped answering or is gone.
    The message is the line main prints."""


def catch_stop_signals(run: Run, t) -> dict:
    """Route SIGINT and SIGTERM to on_stop_signal. -> the handlers
    replaced, for restore_signals. Where no handler can be installed (not
    the main thread) nothing changes; an ignored signal (a background
    job's SIGINT) stays ignored."""
    signalled["signum"] = 0
    stopping.update(run=run, t=t, window=False)
    previous = {}

    def handler(signum, frame):
        on_stop_signal(run, t, signum, frame)

    for signum in STOP_SIGNALS:
        old = signal.getsignal(signum)
        if old == signal.SIG_IGN:
            continue
        try:
            signal.signal(signum, handler)
        except ValueError:  # only the main thread may install handlers
            break
        previous[signum] = signal.SIG_DFL if old is None else old
    return previous


def restore_signals(previous: dict):
    for signum, old in previous.items():
        signal.signal(signum, old)


def on_stop_signal(run: Run, t, signum: int, frame):
    """A stop signal sets a flag (a signal arriving mid-step corrupts
    nothing): the loop stops where the cycle ends (stop_if_signalled).
    Inside `abandonable` before the cycle's first step it also raises
    Abandoned, at once. A second Ctrl-C stops at once; a repeated
    SIGTERM changes nothing (SLURM signals every process, and torchrun
    passes it on too). SIGTERM after another rank failed is torchrun
    stopping this one: it ends at once."""
    if signum == signal.SIGTERM and run.info.sharded and dist.peer_failed():
        end_now(run, t, frame)
    if signalled["signum"]:
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        return
    signalled["signum"] = signum
    if run.info.is_main:
        say(stopping_line(run, t, signum))
    if stopping["window"] and nothing_moved(run, t):
        raise Abandoned(signum)


def nothing_moved(run: Run, t) -> bool:
    """Whether no parameter moved in the current cycle (or none is
    running): dropping what it sampled loses no step."""
    return run.cycle_begin is None or t.step == run.cycle_start_step


@contextmanager
def abandonable():
    """Around local work of a round that moves no parameter (train.py's
    sampling and scoring, evaluation's): a stop signal inside drops it at
    once when no parameter moved in the cycle (on_stop_signal raises
    Abandoned). Nothing inside may be a collective (train.py gathers
    FSDP's parameters before): a rank leaves it at any point. At the exit
    every rank learns whether any was signalled (one small all-reduce, so
    no rank starts a collective another left); if one was, all raise
    Abandoned together, and saving_on_stop saves the last step. Outside a
    run (saving_on_stop) it does nothing."""
    run = stopping["run"]
    t = stopping["t"]
    if run is None:
        yield
        return
    try:
        stopping["window"] = True
        try:
            yield
        finally:
            stopping["window"] = False
    except Abandoned:
        pass  # the ranks agree below
    signum = dist.max_over_ranks(signalled["signum"], run.info)
    if signum and nothing_moved(run, t):
        raise Abandoned(signum)


def stopping_line(run: Run, t, signum: int) -> str:
    """What a stop signal's arrival prints: the step the run will stop
    after (checkpoints are exact where a cycle ends)."""
    name = STOP_SIGNALS[signum]
    if run.cycle_begin is None and t.step == 0:
        return f"\n{name}: stopping before the first step"
    if stopping["window"] and nothing_moved(run, t):
        if t.step == 0:
            return f"\n{name}: stopping now, before the first step"
        dropped = "evaluation" if run.cycle_begin is None else "round"
        return f"\n{name}: stopping now (the {dropped} in flight is dropped): saving step {t.step}"
    end = t.step
    if run.cycle_begin is not None:  # inside a cycle
        cycle_end = run.cycle_start_step + t.sched.steps_per_cycle
        end = min(cycle_end, run.cfg.max_steps)
    line = f"\n{name}: stopping after step {end}: saving it then"
    if run.info.sharded:
        return line + (
            " (a signalled torchrun kills its processes after "
            "--shutdown-timeout seconds: 30 unless set)"
        )
    return line + "; Ctrl-C again stops at once"


def say(line: str):
    """Print from a signal handler: one write, which cannot collide with a
    print the signal interrupted (print would raise a reentrant call)."""
    try:
        os.write(sys.stdout.fileno(), (line + "\n").encode())
    except (OSError, ValueError):  # a stdout without a file (captured)
        print(line, flush=True)


def end_now(run: Run, t, frame):
    """torchrun stopping this rank after another failed: say where this
    rank was (a hung reward function shows here) and exit at once: the
    others are gone, so there is nothing to save or to wait for."""
    where = ""
    if frame is not None:
        code = frame.f_code
        where = (
            f"; it was in {code.co_name} ({os.path.basename(code.co_filename)}:{frame.f_lineno})"
        )
    say(
        f"train.py: rank {run.info.rank}: ended at step {current_step(run, t)} "
        f"after another rank failed{where}"
    )
    os._exit(128 + signal.SIGTERM)  # not sys.exit: it could wait on threads


def stop_if_signalled(run: Run, t):
    """Where a cycle ends (a checkpoint is exact there): if a stop signal
    reached any rank, every rank saves the last step together and the run
    ends (Stopped). One small all-reduce a cycle."""
    signum = dist.max_over_ranks(signalled["signum"], run.info)
    if signum:
        stop(run, t, signum)


def stop(run: Run, t, signum: int):
    """Every rank together, on a signal (stop_if_signalled, or an
    abandoned round): the round in flight is dropped (the prompt sampler
    goes back to where its cycle began; round_seed redraws it on resume),
    the last step saved, then Stopped."""
    if run.cycle_begin is not None:
        t.prompts.load_state_dict(run.cycle_begin)
        run.cycle_begin = None
    cfg = run.cfg
    where = f"{STOP_SIGNALS[signum]}: stopped at step {t.step}/{cfg.max_steps}"
    if t.step == 0:
        dist.print0(
            f"{where}: nothing to save (no optimizer step was taken yet), "
            "so the same command starts over"
        )
    else:
        if not saved(run, t.step):
            save(run, t)
        dist.print0(
            f"{where}: saved {cfg.output_dir}/checkpoint-{t.step}. "
            f"Continue with:\n  {resume_command(run)}"
        )
    dist.teardown()
    raise Stopped(signum)


# -----------------------------------------------------------------------------
# The command line


# -----------------------------------------------------------------------------
# The run around the algorithm's cycles


def crossed(every: int, before: int, after: int) -> bool:
    """Whether a multiple of `every` (0 = never) is in (before, after]."""
    return every > 0 and after // every > before // every


def train(algo, cfg: TrainConfig, command=None) -> list[dict]:
    """Run GRPO as configured: the run around `algo`'s cycles (train.py: its setup, kernels,
    train_cycle and evaluate, looked up on it at each call). -> per-step metrics (also
    metrics.jsonl)."""
    if cfg.dry_run:  # nothing loaded, nothing started: the plan of the run
        world_size = cfg.dry_run_world_size or int(os.environ.get("WORLD_SIZE", "1"))
        cfg.validate(world_size)
        if int(os.environ.get("RANK", "0")) == 0:
            plan.dry_run(cfg, world_size)
        return []
    info = dist.setup(cfg.device, cfg.ddp_timeout)
    cfg.validate(info.world_size)
    r, cfg = start(cfg, info, command)
    t = algo.setup(cfg, info, r.resume_from)
    t.kernels = algo.kernels(cfg)
    if r.resume_from:
        restore(r, t)
    if t.step >= cfg.max_steps and not r.pending:
        report.nothing_to_do(t)
        dist.teardown()
        return r.history
    open_logs(r, t)
    with saving_on_stop(r, t):
        if cfg.eval_on_start:  # transformers' check before any step, on resume too
            report.log_eval(r, {"step": t.step, **algo.evaluate(t)})
        if r.pending:  # saved on a stop that dropped their evaluation
            if t.eval_rows:
                r.pending[-1].update(algo.evaluate(t))
            report.log(r)
        while t.step < cfg.max_steps:
            stop_if_signalled(r, t)  # Ctrl-C, SIGTERM: save, then end
            first_step = t.step
            with cycle(r, t):  # where a stop inside it goes back to
                records, rounds = algo.train_cycle(t)
            report.add_round_metrics(r, t, rounds, records)
            r.pending = records
            eval_due = crossed(cfg.eval_every(), first_step, t.step)
            last = t.step == cfg.max_steps
            if t.eval_rows and cfg.eval_every() and (eval_due or last):
                r.pending[-1].update(algo.evaluate(t))
            report.log(r)
            if crossed(cfg.save_steps, first_step, t.step) or last:
                save(r, t)
    if cfg.merge_adapter:
        save_merged(r, t)
    report.summarize(r, t)
    dist.teardown()
    return r.history


def main(argv: list[str], train) -> int:
    """`python train.py [--config FILE] [--key=value ...]`: user errors
    are one line (the traceback with --debug or NANOGRPO_DEBUG=1), and so
    is a hung or dead rank (exit 1); Ctrl-C and SIGTERM save and exit with
    130 and 143. Which values run without --config is load_config's rule;
    `--help` prints them."""
    debug = "--debug" in argv or os.environ.get("NANOGRPO_DEBUG") == "1"
    argv = [a for a in argv if a != "--debug"]
    command = ["train.py"] + argv
    asks_help = "--help" in argv or "-h" in argv
    try:
        if asks_help:
            print(help_text([a for a in argv if a not in ("--help", "-h")]))
            return 0
        train(load_config(argv), command)
    except Stopped as e:
        return 128 + e.signum
    except KeyboardInterrupt:
        return 130
    except RankFailure as e:
        if debug:
            raise
        print(f"train.py: error: {e}", file=sys.stderr, flush=True)
        return 1
    except (ValueError, OSError, RewardError) as e:  # ConfigError too
        if debug:
            raise
        # several processes: rank_error's note names the rank and step
        where = "".join(f"{note}: " for note in getattr(e, "__notes__", []))
        print(
            f"train.py: error: {where}{e}\n(the traceback: add --debug)",
            file=sys.stderr,
            flush=True,
        )
        return 2
    return 0


def exit_process(rc: int):
    """Leave with exit status rc. Under torchrun the interpreter's own teardown is skipped once
    every atexit handler has run (trackers' final sync) and the streams are flushed: gloo's
    threads can abort a finished rank in C++ static destructors ("terminate called without an
    active exception", status -6), and torchrun would call the whole run failed."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)
