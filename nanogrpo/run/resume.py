"""Which checkpoint a run resumes from (the newest complete one, a link passed over when damaged)
and what it restores: the saved config's fields that must not change, the trainer's state,
sync_ref_model's reference. What cannot be replayed is said in one line: another number of
processes, or an older checkpoint without the synced reference.

Does not know about: the GRPO math, sampling, or log-probs.
"""

import json
import math
import os
import re
from dataclasses import asdict, replace

from nanogrpo import checkpoint, distributed as dist
from nanogrpo.run import checkpoints
from nanogrpo.run.config import ConfigError, TrainConfig
from nanogrpo.run.outdir import Run

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
    restore_reference(run, t)
    saved_by = state.get("world_size", run.info.world_size)
    if saved_by != run.info.world_size:
        dist.print0(
            f"note: {run.resume_from} was saved by {saved_by} "
            f"process(es), this run has {run.info.world_size}: it continues the run "
            "but does not replay it (sampling is seeded per process, and a step "
            "takes per_device_train_batch_size completions from each, as in TRL), "
            "so its draws are not those of an uninterrupted run; the optimizer "
            "state is the same"
        )
    run.history = state["history"]
    run.pending = state.get("pending", [])
    run.written = [
        n for n in state.get("checkpoints", []) if os.path.isdir(os.path.join(cfg.output_dir, n))
    ]
    # the `checkpoint` link moves on: keep what it pointed at
    run.resume_source = os.path.realpath(run.resume_from)
    dist.print0(f"resumed from {run.resume_from} at step {t.step}")


def restore_reference(run: Run, t):
    """sync_ref_model's reference as the checkpoint saved it. A checkpoint
    without it (one saved before the reference was, or by a run that never
    synced) leaves the initial reference setup loaded, which is exact until
    the checkpoint's run first synced: past that, said."""
    if t.ref is None:
        return
    if checkpoints.load_ref_model(os.path.join(run.resume_from, "trainer"), t.ref):
        return
    saved = checkpoint.read_json(os.path.join(run.resume_from, "train_config.json"))
    synced = saved.get("sync_ref_model") and t.step >= saved.get("ref_model_sync_steps", 1)
    if synced:
        dist.print0(
            f"note: {run.resume_from} holds no synced reference model (saved before "
            f"sync_ref_model's reference was checkpointed): the reference restarts from "
            f"{run.cfg.model}, the initial weights, as TRL's resume does, so this run continues "
            "the run but does not replay it"
        )
