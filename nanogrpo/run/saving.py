"""Saving: a checkpoint on schedule, on a stop and after an error (what is exact to keep, and
the command that continues), a save that fails (one line: the cause, the previous checkpoint
checked whole, the command that resumes it), the hub upload, a LoRA run's merged checkpoint.

Does not know about: the GRPO math, sampling, or log-probs.
"""

import math
import os
import shlex

from nanogrpo import checkpoint, distributed as dist
from nanogrpo.extras import lora
from nanogrpo.run import checkpoints, report
from nanogrpo.run.config import TrainConfig
from nanogrpo.run.outdir import Run, hub_repo
from nanogrpo.run.resume import config_record


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
    try:
        checkpoints.save_checkpoint(
            cfg.output_dir,
            t.step,
            t.model,
            t.optimizer,
            tokenizer=t.tok,
            trainer_state=state,
            train_config=config_record(cfg),
            info=run.info,
            # sync_ref_model's reference has moved with the policy: the initial one would not do
            ref=t.ref if cfg.sync_ref_model else None,
            # async_rollouts: the weights its queued rounds were due (run/async_rollouts.py)
            tensors=t.rollouts.checkpoint_tensors(t.step) if t.rollouts else None,
        )
    except checkpoints.SaveFailed as e:
        raise checkpoints.SaveFailed(f"{e}: {after_failed_save(run)}") from e.__cause__
    run.written.append(name)
    if run.info.is_main:
        run.written = checkpoints.prune_checkpoints(
            cfg.output_dir, run.written, cfg.save_total_limit, keep=run.resume_source
        )
        if cfg.push_to_hub:
            push_to_hub(cfg, os.path.join(cfg.output_dir, name), t.step)


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


def after_failed_save(run: Run) -> str:
    """What a save that failed leaves to continue from, in one line: the
    newest checkpoint this run wrote or resumed from, checked whole, and
    the command that resumes it once the cause is fixed."""
    previous = run.resume_from
    if run.written:
        previous = os.path.join(run.cfg.output_dir, run.written[-1])
    if previous is None:
        if not run.history:
            return "nothing was saved before it, so the same command starts over"
        return "nothing was saved before it: start over with --overwrite_output_dir=true"
    problem = checkpoints.unresumable(previous)
    if problem:
        return f"the previous checkpoint, {previous}, cannot be resumed either ({problem})"
    return (
        f"the previous checkpoint, {previous}, is intact; once that is fixed, continue with: "
        f"{resume_command(run)}"
    )


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
    if run.info.launched > 1:  # (async_rollouts: its rollout processes too)
        per_node = os.environ.get("LOCAL_WORLD_SIZE", run.info.launched)
        launcher = f"torchrun --nproc_per_node {per_node}"
    return f"{launcher} {shlex.join(args + ['--resume_from_checkpoint=true'])}"


def current_step(run: Run, t) -> int:
    """The step a stop or a failure came at: the one being trained inside
    a cycle, else the last one completed."""
    return t.step if run.cycle_begin is None else t.step + 1
