"""What a training run does around the algorithm: the bookkeeping train.py calls.

Owns what train.py's loop calls around its cycles: `start` (the output folder, the checkpoint to
resume from), `begin` (restore, open the logs), `cycle`, `crossed` (is a save or an evaluation
due), `finish`, `dry_run`, and `main`: one-line errors (`--help` is run/configurator.py's). It
never calls train.py: train.py calls it. The parts, one file each: the output folder, its lock,
the checks before step 1 and the embedded default's tiny checkpoint (run/outdir.py), which
checkpoint a run resumes from and what it restores (run/resume.py), saving on schedule, on a stop
and after an error (run/saving.py), stopping every rank on Ctrl-C or SIGTERM and naming a rank's
failure (run/stops.py). What a run reports (metrics, console, trackers, summary) is
run/report.py's; the files of a checkpoint-<step>/ are run/checkpoints.py's; the dry run's plan
is run/plan.py's.

Does not know about: the GRPO math, sampling, or log-probs.

Of trainer.py's `Trainer` it reads named fields (cfg, info, sched, model, ref, optimizer, scheduler,
tok, prompts, step, round, entropy_coef, last_entropy, reward_weights) to report, save and restore
them, and begin takes its cfg (max_steps counted) as the run's.
"""

import atexit
import json
import os
import sys
import time
from contextlib import contextmanager

import torch

from nanogrpo import checkpoint, distributed as dist
from nanogrpo.rewards import RewardError
from nanogrpo.run import async_rollouts, plan, report  # noqa: F401 (async_rollouts: train.py's)
from nanogrpo.run.config import TrainConfig
from nanogrpo.run.configurator import help_text, load_config

# the run's parts, one file each; what train.py and the tests call is here by name too
from nanogrpo.run.outdir import (  # noqa: F401
    Run,
    check_out_dir,
    claim_out_dir,
    clear_out_dir,
    ensure_tiny_checkpoint,
    remove_unfinished_saves,
)
from nanogrpo.run.resume import config_record, find_checkpoint, restore, restored_config  # noqa: F401
from nanogrpo.run.saving import save, save_merged, unsaveable  # noqa: F401
from nanogrpo.run.stops import (  # noqa: F401
    Abandoned,
    RankFailure,
    Stopped,
    saving_on_stop,
    signalled,
    stop_if_signalled,
    stopping,
)

# -----------------------------------------------------------------------------
# Starting: the output folder and the checkpoint to resume from (run/outdir.py, run/resume.py)


def start(cfg: TrainConfig, info, command=None) -> tuple[Run, TrainConfig]:
    """Check out_dir and take its lock, check the hub, decide fresh or
    resumed, build the embedded default's checkpoint. -> (the run, the
    config the run will use: on resume, the optimizer settings come from
    the checkpoint)."""
    if info.sampler:  # async_rollouts' rollout process: the out_dir is the trainers'
        return Run(cfg=cfg, info=info, command=command), async_rollouts.rollout_config(cfg, info)
    async_rollouts.not_in_a_sampler()
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


# -----------------------------------------------------------------------------
# Restoring and saving the trainer


def open_logs(run: Run, t):
    """metrics.jsonl (rewritten on resume: the records of history's steps) and trackers."""
    if run.info.is_main:
        os.makedirs(run.cfg.output_dir, exist_ok=True)
        path = os.path.join(run.cfg.output_dir, "metrics.jsonl")
        with open(path, "w") as f:
            for m in report.logged_records(run.history, run.cfg):
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
    if t.info.device.type == "cpu":
        threads = torch.get_num_threads()
        line += f", {threads} thread{'s' * (threads > 1)} each (torch_num_threads)"
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


@contextmanager
def cycle(run: Run, t):
    """Around one of train.py's cycles: where a stop inside it goes back
    to (the prompt sampler's state and the step at its start). An error
    leaves them set for saving_on_stop."""
    run.cycle_begin = t.prompts.state_dict()
    run.cycle_start_step = t.step
    yield
    run.cycle_begin = None


# -----------------------------------------------------------------------------
# Around the loop


def crossed(every: int, before: int, after: int) -> bool:
    """Whether a multiple of `every` (0 = never) is in (before, after]."""
    return every > 0 and after // every > before // every


def dry_run(cfg: TrainConfig) -> list:
    """--dry_run: nothing loaded, nothing started; rank 0 prints and writes the plan of the run
    (run/plan.py) for dry_run_world_size processes (default: WORLD_SIZE). -> [] (no steps)."""
    world_size = cfg.dry_run_world_size or int(os.environ.get("WORLD_SIZE", "1"))
    cfg.validate(world_size)
    if int(os.environ.get("RANK", "0")) == 0:
        plan.dry_run(cfg, world_size)
    return []


def begin(run: Run, t, sample_round=None, kernels=None) -> bool:
    """Restore a resumed run's trainer and history, then open the logs; with async_rollouts start
    its sampler process (train.py's sample_round and kernels: async_rollouts.start). -> False when
    there is nothing left to do (max_steps reached and nothing pending: said, processes torn down).
    The run reads the trainer's config from here on: its max_steps counted (num_train_epochs)."""
    run.cfg = t.cfg
    if run.info.sampler:  # async_rollouts' rollout process: it draws the trainers' rounds
        async_rollouts.serve(t, sample_round)
        return False
    if run.resume_from:
        restore(run, t)
    if t.step >= run.cfg.max_steps and not run.pending:
        report.nothing_to_do(t)
        dist.teardown()
        return False
    run.threads_before = torch.get_num_threads()  # saving_on_stop restores it
    torch.set_num_threads(cpu_threads(run.cfg, t))
    open_logs(run, t)
    if run.cfg.async_rollouts:
        t.rollouts = async_rollouts.start(t, sample_round, kernels, run.resume_from)
    return True


# A model this small runs each op in microseconds, where a thread pool's barrier waits on any of
# its threads another process has descheduled: two runs of the embedded default at once on 2
# cores took 6x as long as one (bench/bench_threads.py measures where more threads pay).
ONE_THREAD_BELOW = 20_000_000  # parameters


def cpu_threads(cfg: TrainConfig, t) -> int:
    """torch's CPU threads for the run: torch_num_threads; else, when OMP_NUM_THREADS is set (as
    torchrun sets it), torch's count from it; else 1 for a model on CPU under ONE_THREAD_BELOW
    parameters; else torch's default (the cores)."""
    if cfg.torch_num_threads:
        return cfg.torch_num_threads
    if os.environ.get("OMP_NUM_THREADS") or t.info.device.type != "cpu":
        return torch.get_num_threads()
    params = sum(p.numel() for p in t.model.parameters())
    return 1 if params < ONE_THREAD_BELOW else torch.get_num_threads()


def finish(run: Run, t) -> list[dict]:
    """After the last step: merge_adapter's merged model, the summary, processes torn down.
    -> per-step metrics (also metrics.jsonl)."""
    if run.cfg.merge_adapter:
        save_merged(run, t)
    report.summarize(run, t)
    dist.teardown()
    return run.history


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
