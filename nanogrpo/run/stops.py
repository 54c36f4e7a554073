"""Stopping: Ctrl-C or SIGTERM stops every rank where the same cycle ends or, while a round
samples before the cycle's first step, at once (distributed's local_work: the round is
dropped); an error on one of several ranks is told to the others and named in one line
(`RankFailure`).

Does not know about: the GRPO math, sampling, or log-probs.
"""

import os
import signal
import sys
from contextlib import contextmanager

import torch

from nanogrpo import distributed as dist
from nanogrpo.run.checkpoints import SaveFailed
from nanogrpo.run.outdir import Run
from nanogrpo.run.saving import current_step, resume_command, save, save_on_stop, saved


@contextmanager
def saving_on_stop(run: Run, t):
    """Inside: Ctrl-C (SIGINT) or SIGTERM stops the run at once while it
    samples or scores before the cycle's first step (local_work: the
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
    except Abandoned as e:  # every rank together (local_work's exit)
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
        if isinstance(e, SaveFailed):  # its line names what is kept; a retry would fail too
            raise
        try:
            save_on_stop(run, t, "stopped by an error")
        except Exception as e:  # the error may be the disk itself
            dist.print0(f"could not save after the error: {e}")
        raise
    finally:
        if getattr(t, "rollouts", None) is not None:  # async_rollouts' sampler process
            t.rollouts.close()
        restore_signals(previous)
        torch.set_num_threads(run.threads_before or torch.get_num_threads())
        stopping.update(run=None, t=None)
        signalled.update(signum=0, inside=False, droppable=None)


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
    line = f"{where}: at step {current_step(run, t)}, {what}"
    dist.tell_peers(line)
    return RankFailure(line)


STOP_SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


# the stop signal this process received inside saving_on_stop (0 = none), whether it is inside
# distributed's local_work, and when that work may be dropped: set by catch_stop_signals
signalled = dist.stop_request


# the run inside saving_on_stop (one at a time) and its Trainer
stopping = {"run": None, "t": None}


class Stopped(BaseException):
    """The run stopped on a signal, its last step saved: main exits with
    128 + signum (130 for Ctrl-C, 143 for SIGTERM), as a shell reports a
    signal. Not an Exception: no `except Exception` takes it for an error."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


# A stop signal inside distributed's local_work (train.py's sampling and scoring, evaluation's):
# the round being sampled or scored is dropped
Abandoned = dist.Dropped


class RankFailure(Exception):
    """A collective failed: another rank stopped answering or is gone.
    The message is the line main prints."""


def catch_stop_signals(run: Run, t) -> dict:
    """Route SIGINT and SIGTERM to on_stop_signal. -> the handlers
    replaced, for restore_signals. Where no handler can be installed (not
    the main thread) nothing changes; an ignored signal (a background
    job's SIGINT) stays ignored."""
    signalled.update(signum=0, inside=False, droppable=lambda: nothing_moved(run, t))
    stopping.update(run=run, t=t)
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
    Inside distributed's local_work before the cycle's first step it also raises
    Abandoned, at once. A second Ctrl-C stops at once; a repeated
    SIGTERM changes nothing (SLURM signals every process, and torchrun
    passes it on too). SIGTERM after another rank failed is torchrun
    stopping this one: it ends at once."""
    told = dist.peer_failure() if signum == signal.SIGTERM and run.info.sharded else None
    if told:
        say(ending_line(run, t, told, frame))
        os._exit(128 + signal.SIGTERM)  # not sys.exit: it could wait on threads
    if signalled["signum"]:
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        return
    signalled["signum"] = signum
    if run.info.is_main:
        say(stopping_line(run, t, signum))
    if signalled["inside"] and nothing_moved(run, t):
        raise Abandoned(signum)


def nothing_moved(run: Run, t) -> bool:
    """Whether no parameter moved in the current cycle (or none is
    running): dropping what it sampled loses no step."""
    return run.cycle_begin is None or t.step == run.cycle_start_step


def stopping_line(run: Run, t, signum: int) -> str:
    """What a stop signal's arrival prints: the step the run will stop
    after (checkpoints are exact where a cycle ends)."""
    name = STOP_SIGNALS[signum]
    if run.cycle_begin is None and t.step == 0:
        return f"\n{name}: stopping before the first step"
    if signalled["inside"] and nothing_moved(run, t):
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


def ending_line(run: Run, t, told: str, frame) -> str:
    """What a rank says when torchrun stops it after another rank failed
    (told: that rank's line, tell_peers), before it exits at once: the
    others are gone, so there is nothing to save or to wait for. If the
    other rank timed out waiting on this one, where this rank was (a hung
    reward function shows here); else rank_error's line for a rank that is
    gone, word for word: a rank sees either first, by a race."""
    step = current_step(run, t)
    if dist.STOPPED not in told or frame is None:
        return f"train.py: error: rank {run.info.rank}: at step {step}, {dist.peer_gone(run.info)}"
    code = frame.f_code
    return (
        f"train.py: rank {run.info.rank}: ended at step {step} after another rank failed; "
        f"it was in {code.co_name} ({os.path.basename(code.co_filename)}:{frame.f_lineno})"
    )


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
