"""What a training run does around the algorithm: the bookkeeping train.py calls.

Owns: the output folder (a fresh run never replaces another), which
checkpoint a run resumes from and what it restores, saving (on schedule,
on Ctrl-C, after an error), the embedded default's tiny checkpoint, and
`main`: one-line errors (`--help` is configurator.py's). What a run
reports (metrics, console, trackers, summary) is report.py's.

Does not know about: the GRPO math. It reads a few named fields of
nanogrpo.trainer's `Trainer` (model, optimizer, scheduler, tok, prompts,
step, round, round_begin, entropy_coef, last_entropy) to save and
restore them.
"""

import json
import math
import os
import re
import shlex
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace

import torch

from nanogrpo import checkpoint, dist, lora, report, trainer_state
from nanogrpo.config import ConfigError, TrainConfig
from nanogrpo.configurator import help_text, load_config
from nanogrpo.model import ModelConfig, Transformer
from nanogrpo.rewards import RewardError
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


# -----------------------------------------------------------------------------
# Starting: the output folder and the checkpoint to resume from


def start(cfg: TrainConfig, info, command=None) -> tuple[Run, TrainConfig]:
    """Decide fresh or resumed, check out_dir, build the embedded
    default's checkpoint. -> (the run, the config the run will use:
    on resume, the optimizer settings come from the checkpoint)."""
    check_out_dir(cfg.output_dir)
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
    writing a file in it, or in the nearest folder above it that exists:
    nothing is created, so ranks checking at once cannot race."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError(f"output_dir={out_dir!r} is a file, not a directory: "
                          "choose another --output_dir")
    path = os.path.abspath(out_dir)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    probe = os.path.join(path, f".write-test-{os.getpid()}")
    try:
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"output_dir={out_dir!r} cannot be written "
                          f"({e.strerror}): choose another --output_dir") from None


def find_checkpoint(cfg: TrainConfig) -> str | None:
    """The checkpoint to resume from: `resume` may be a path (it must
    hold a trainer state) or true (out_dir/checkpoint, when there is
    one); None starts fresh."""
    resume = cfg.resume_from_checkpoint  # False, True or a path (TrainConfig normalises text)
    if not resume:
        return None
    if isinstance(resume, str):
        if not os.path.exists(os.path.join(resume, "trainer")):
            raise FileNotFoundError(
                f"resume_from_checkpoint={resume!r}: no trainer state at {resume}/trainer; "
                "point it at an out_dir/checkpoint written by train.py, "
                "or use --resume_from_checkpoint=true")
        return resume
    latest = os.path.join(cfg.output_dir, "checkpoint")
    if os.path.exists(os.path.join(latest, "trainer")):
        return latest
    dist.print0(f"resume_from_checkpoint=true: no checkpoint in {cfg.output_dir} yet, "
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
            "run in another --output_dir")
    now = config_record(cfg)
    restored = {}
    skip = ("resume_from_checkpoint", "max_steps")
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


def config_record(cfg: TrainConfig) -> dict:
    """The config as JSON can hold it: a function defined in the config
    file is recorded by name (the file defines it again on resume)."""
    record = asdict(cfg)
    for key in ("reward_funcs", "tools"):
        names = [item if isinstance(item, str) else f"{item.__name__} (config file)"
                 for item in record[key]]
        record[key] = names
    return record


def clear_out_dir(cfg: TrainConfig, info):
    """A fresh run never silently replaces another: an out_dir holding
    what train.py writes is an error, unless overwrite_output_dir asks
    to delete those files (only those)."""
    if not os.path.isdir(cfg.output_dir):
        return
    names = sorted(n for n in os.listdir(cfg.output_dir)
                   if re.fullmatch(RUN_FILES, n))
    if not names:
        return
    if not cfg.overwrite_output_dir:
        raise ConfigError(
            f"output_dir={cfg.output_dir!r} holds a run ({', '.join(names[:4])}): "
            "continue it with --resume_from_checkpoint=true, start over with "
            "--overwrite_output_dir=true (deletes them), or choose "
            "another --output_dir")
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
    print(f"{path} was built from another init_model, "
          "init_tokenizer_chars or seed: rebuilding it")
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
        checkpoint.write_model(tmp, model.config, model.state_dict(),
                               tokenizer=tok,
                               generation_config=generation_config)
        checkpoint.write_json(os.path.join(tmp, "init.json"), recipe)


# -----------------------------------------------------------------------------
# Restoring and saving the trainer


def restore(run: Run, t):
    """Load the trainer state of run.resume_from into t (a Trainer)."""
    cfg = run.cfg
    state = trainer_state.load_trainer_state(run.resume_from, t.model,
                                          t.optimizer, run.info)
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
    run.history = state["history"]
    run.written = [n for n in state.get("checkpoints", [])
                   if os.path.isdir(os.path.join(cfg.output_dir, n))]
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
        dist.print0(f"warning: max_steps={t.cfg.max_steps} ends inside a "
                    f"cycle of {per_cycle} optimizer steps: the last one is "
                    "cut short, and a run resumed from its checkpoint starts "
                    "a new round (not what an uninterrupted run would do); "
                    f"use a multiple of {per_cycle} to resume exactly")


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
    }
    trainer_state.save_checkpoint(cfg.output_dir, t.step, t.model, t.optimizer,
                               t.tok, state, config_record(cfg), run.info)
    run.written.append(name)
    if run.info.is_main:
        run.written = trainer_state.prune_checkpoints(
            cfg.output_dir, run.written, cfg.save_total_limit,
            keep=run.resume_source)
        if cfg.push_to_hub:
            push_to_hub(cfg, os.path.join(cfg.output_dir, name), t.step)


def hub_repo(cfg: TrainConfig) -> str:
    """TRL's hub_model_id, or the output_dir's name (as transformers)."""
    return cfg.hub_model_id or os.path.basename(os.path.abspath(cfg.output_dir))


def push_to_hub(cfg: TrainConfig, folder: str, step: int):
    """Upload a checkpoint's model files (not the optimizer) to the hub
    repo, through huggingface-hub's upload API (token: HF_TOKEN or
    `hf auth login`)."""
    from huggingface_hub import HfApi

    api = HfApi()
    repo = hub_repo(cfg)
    api.create_repo(repo, exist_ok=True)
    api.upload_folder(repo_id=repo, folder_path=folder,
                      commit_message=f"nanogrpo: step {step}",
                      ignore_patterns=["trainer/*"])


def save_merged(run: Run, t):
    """merge_adapter: the adapters folded into the base weights, a full
    HF checkpoint at out_dir/merged."""
    state = dist.full_state_dict(t.model)  # every rank gathers
    if run.info.is_main:
        merged = lora.merged_state_dict(state, t.model.lora_config)
        path = os.path.join(run.cfg.output_dir, "merged")
        with checkpoint.atomic_dir(path) as tmp:
            checkpoint.write_model(tmp, t.model.config, merged,
                                   t.model.generation_config, t.tok)
    dist.barrier()


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
    latest = os.path.join(cfg.output_dir, "checkpoint")
    reason = unsaveable(run, t)
    if reason:
        dist.print0(f"\n{where}: not saved ({reason}); "
                    f"the latest checkpoint is {latest}")
        return
    report.log(run)  # a finished round's records, if stopped in its evaluation
    if not saved(run, t.step):
        if t.round_begin is not None:
            t.prompts.load_state_dict(t.round_begin)
        save(run, t)
    args = [a for a in run.command
            if not a.startswith(("--resume", "--overwrite_output_dir"))]
    again = shlex.join(args + ["--resume_from_checkpoint=true"])
    dist.print0(f"\n{where}: saved {cfg.output_dir}/checkpoint-{t.step}. "
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
# The command line


def main(argv: list[str], train) -> int:
    """`python train.py [--config FILE] [--key=value ...]`: user errors
    are one line (the traceback with --debug or NANOGRPO_DEBUG=1);
    Ctrl-C saves and exits with 130. Which values run without --config is
    load_config's rule; `--help` prints them."""
    debug = "--debug" in argv or os.environ.get("NANOGRPO_DEBUG") == "1"
    argv = [a for a in argv if a != "--debug"]
    command = ["train.py"] + argv
    asks_help = "--help" in argv or "-h" in argv
    try:
        if asks_help:
            print(help_text([a for a in argv if a not in ("--help", "-h")]))
            return 0
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
