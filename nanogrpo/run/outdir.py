"""A run's output folder: one run at a time holds it (a lock), a fresh run never replaces another
(check_out_dir, clear_out_dir), what is checked before step 1 so that the first save cannot fail
(a writable folder, the hub), the embedded default's tiny checkpoint, and `Run`, a run's
bookkeeping between rounds.

Does not know about: the GRPO math, sampling, or log-probs.
"""

import fcntl
import os
import re
import shlex
import shutil
import socket
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch

from nanogrpo import checkpoint, distributed as dist
from nanogrpo.model import ModelConfig, Transformer
from nanogrpo.run.config import ConfigError, TrainConfig
from nanogrpo.tokenizer import char_level_tokenizer

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
    threads_before: int = 0  # torch's CPU threads before the run (begin sets the run's)


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
