"""Stopping a run (run.py, dist.py): SIGTERM and Ctrl-C save the last step, with one process and
under torchrun, and the resumed run is the uninterrupted one; a hung or dead rank ends a torchrun
run within ddp_timeout, in one line that names the rank and the step."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
from conftest import ROOT
from test_train import strip_timing, tiny

import train
from nanogrpo import distributed as dist, run
from nanogrpo.run import stops
from nanogrpo.run.configurator import read_config_file

# A reward function that, on call STOP_AT of rank STOP_RANK, does STOP_ACTION:
# self:SIG (the signal to its own process), parent:SIG (to its parent), group:SIG (to torchrun's process
# group, as a terminal's Ctrl-C; then it scores for a minute), hang (in the
# reward function) or raise.
REWARD = """
import os
import signal
import time

calls = 0


def length(completions, **kwargs):
    global calls
    calls += 1
    mine = os.environ.get("RANK", "0") == os.environ.get("STOP_RANK", "0")
    if mine and calls == int(os.environ.get("STOP_AT", "0")):
        action = os.environ["STOP_ACTION"]
        if action.startswith("self:"):
            os.kill(os.getpid(), getattr(signal, action[5:]))
        if action.startswith("parent:"):  # async_rollouts' sampler: its trainer
            os.kill(os.getppid(), getattr(signal, action[7:]))
        if action.startswith("group:"):  # torchrun's agent is this process's parent
            os.killpg(os.getpgid(os.getppid()), getattr(signal, action[6:]))
            time.sleep(60)  # a slow reward: torchrun's forwarded signal ends it
        if action == "hang":
            with open(os.environ["STOP_MARK"], "w") as f:
                f.write(str(time.time()))
            time.sleep(120)
        if action == "raise":
            raise ValueError("the reward broke")
    return [float(len(c)) for c in completions]
"""
# rounds of one generation and two optimizer steps: a stop waits for the cycle's end
CYCLES_OF_2 = ["--max_steps=6", "--num_iterations=2", "--loss_type=grpo"]


def args(tmp_path, out: str, *more) -> list[str]:
    """The embedded default made small, scored by REWARD, its outputs in tmp_path/out."""
    (tmp_path / "stop_reward.py").write_text(REWARD)
    init = f"--init_model={read_config_file('tiny')['init_model']!r}"
    return [
        "--config",
        "tiny.py",
        f"--model={tmp_path}/init",
        init,
        f"--output_dir={tmp_path}/{out}",
        "--gradient_accumulation_steps=2",
        "--num_generations=4",
        "--per_device_train_batch_size=4",
        "--max_completion_length=6",
        "--eval_strategy=no",
        "--logging_steps=1",
        "--reward_funcs=stop_reward:length",
        *more,
    ]


def launch(tmp_path, argv, nproc=1, timeout=150, **stop) -> tuple[int, str, float]:
    """python train.py (nproc=1) or torchrun, in a session of its own as a terminal starts a job;
    stop: STOP_* settings of REWARD. -> (exit status, stdout and stderr as they came, end time)."""
    cmd = [sys.executable, "train.py", *argv]
    if nproc > 1:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(nproc),
            "train.py",
            *argv,
        ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.update({f"STOP_{key.upper()}": str(value) for key, value in stop.items()})
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    p = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail(f"still running after {timeout} s:\n{out[-3000:]}")
    return p.returncode, out, time.time()


def metrics(path) -> list[dict]:
    return strip_timing([json.loads(line) for line in open(path / "metrics.jsonl")])


def test_sigterm_saves_the_last_step_and_the_resumed_run_is_exact(tmp_path):
    """SIGTERM (what timeout, SLURM and Kubernetes send) while the second round is scored: the run
    drops that round at once (it waited for the round's cycle to end: minutes on a real model,
    past Kubernetes' 30 s), saves step 2 and exits 143; resumed, it is the uninterrupted run."""
    rc, out, _ = launch(tmp_path, args(tmp_path, "full", *CYCLES_OF_2))
    assert rc == 0, out[-3000:]
    rc, out, _ = launch(tmp_path, args(tmp_path, "run", *CYCLES_OF_2), at=2, action="self:SIGTERM")
    assert rc == 143, out[-3000:]  # 128 + SIGTERM, as a shell reports it
    assert "SIGTERM: stopping now (the round in flight is dropped): saving step 2" in out
    assert "SIGTERM: stopped at step 2/6: saved" in out and "--resume_from_checkpoint=true" in out
    assert "Traceback" not in out
    assert os.path.realpath(tmp_path / "run" / "checkpoint").endswith("checkpoint-2")
    resume = args(tmp_path, "run", *CYCLES_OF_2, "--resume_from_checkpoint=true")
    rc, out, _ = launch(tmp_path, resume)
    assert rc == 0, out[-3000:]
    assert metrics(tmp_path / "run") == metrics(tmp_path / "full")


def signal_on_call(monkeypatch, name: str, at: int, sig=signal.SIGTERM, times=1) -> list:
    """train.<name> sends `sig` to this process `times` times on its call number `at`.
    -> the calls, as they come."""
    calls, real = [], getattr(train, name)

    def signalling(*args):
        calls.append(1)
        if len(calls) == at:
            for _ in range(times):
                os.kill(os.getpid(), sig)
        return real(*args)

    monkeypatch.setattr(train, name, signalling)
    return calls


EVAL = ["--max_steps=4", "--eval_strategy=steps", "--eval_steps=2", "--eval_size=8"]


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """The uninterrupted run, evaluated every 2 steps, that stopped ones must resume to."""
    return strip_timing(train.train(tiny(tmp_path_factory.mktemp("full"), *EVAL)))


@pytest.mark.parametrize(
    "call,step,dropped",
    [(2, 1, "round"), (3, 2, "evaluation")],  # sample calls: round 1, round 2, eval at 2, ...
)
def test_a_stop_while_sampling_drops_it_at_once_and_the_resumed_run_is_exact(
    tmp_path, monkeypatch, capsys, evaluated, call, step, dropped
):
    """SIGTERM while a round or an evaluation samples: the run stops at once (it sampled and
    scored to the end of the round's cycle first), saves the last step; the resumed run draws the
    dropped round again (or evaluates first), bit for bit the uninterrupted run."""
    calls = signal_on_call(monkeypatch, "sample", at=call)
    with pytest.raises(run.Stopped) as stopped:
        train.train(tiny(tmp_path, *EVAL))
    assert stopped.value.signum == signal.SIGTERM and len(calls) == call  # it sampled no more
    out = capsys.readouterr().out
    assert f"SIGTERM: stopping now (the {dropped} in flight is dropped): saving step {step}" in out
    assert f"SIGTERM: stopped at step {step}/4: saved {tmp_path}/run/checkpoint-{step}" in out
    assert run.stopping["run"] is None and run.signalled["signum"] == 0  # nothing left for the next
    monkeypatch.undo()
    resumed = train.train(tiny(tmp_path, *EVAL, "--resume_from_checkpoint=true"))
    assert strip_timing(resumed) == evaluated
    lines = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert strip_timing(lines) == evaluated


def test_a_stop_after_a_step_of_the_cycle_waits_for_the_cycle_end(tmp_path, monkeypatch, capsys):
    """SIGTERM during an update: parameters moved in this cycle, so the round sampled after it is
    not dropped; the run stops where the cycle ends (3 steps from 2 rounds here), saved."""
    shape = ["--steps_per_generation=3", "--per_device_train_batch_size=4", "--max_steps=6"]
    samples = signal_on_call(monkeypatch, "sample", at=0)
    signal_on_call(monkeypatch, "optimizer_step", at=1)
    with pytest.raises(run.Stopped):
        train.train(tiny(tmp_path, *shape))
    out = capsys.readouterr().out
    assert "SIGTERM: stopping after step 3: saving it then" in out
    assert "SIGTERM: stopped at step 3/6: saved" in out and "dropped" not in out
    assert len(samples) == 2


def test_a_run_stopped_before_its_first_step_can_simply_run_again(tmp_path, monkeypatch, capsys):
    """A reward function that raised, or Ctrl-C, before step 1 said "the latest checkpoint is
    <dir>/checkpoint" (there was none) and left an empty metrics.jsonl: the same command then
    refused to run ("holds a run: continue it with --resume_from_checkpoint=true")."""
    score = train.reward_rollout

    def broken(*args):
        raise ValueError("the reward broke")

    monkeypatch.setattr(train, "reward_rollout", broken)
    with pytest.raises(ValueError, match="the reward broke"):
        train.train(tiny(tmp_path, "--max_steps=1"))
    out = capsys.readouterr().out
    assert "stopped by an error at step 0/1: not saved (no optimizer step was taken yet); " in out
    assert "nothing was saved, so the same command starts over" in out
    assert "latest checkpoint" not in out
    monkeypatch.setattr(train, "reward_rollout", score)
    signal_on_call(monkeypatch, "sample", at=1, sig=signal.SIGINT)
    with pytest.raises(run.Stopped) as stopped:
        train.train(tiny(tmp_path, "--max_steps=1"))  # the same command runs
    assert stopped.value.signum == signal.SIGINT
    out = capsys.readouterr().out
    assert "Ctrl-C: stopping now, before the first step" in out
    assert (
        "nothing to save (no optimizer step was taken yet), so the same command starts over" in out
    )
    assert sorted(os.listdir(tmp_path / "run")) == ["metrics.jsonl", "run.lock"]
    monkeypatch.undo()
    history = train.train(tiny(tmp_path, "--max_steps=1"))  # and again
    assert [m["step"] for m in history] == [1]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The 2-process run the stopped ones must resume to."""
    path = tmp_path_factory.mktemp("full")
    rc, out, _ = launch(path, args(path, "run", *CYCLES_OF_2), nproc=2)
    assert rc == 0, out[-3000:]
    return metrics(path / "run")


@pytest.mark.parametrize("sig,name", [("SIGINT", "Ctrl-C"), ("SIGTERM", "SIGTERM")])
def test_a_signal_to_torchrun_saves_the_last_step(tmp_path, uninterrupted, sig, name):
    """Ctrl-C or SIGTERM to torchrun (its process group, as a terminal's Ctrl-C) while the second
    round is scored: torchrun passes it to each rank; each drops the round, they agree, save step 2
    together and say how to continue."""
    rc, out, _ = launch(
        tmp_path, args(tmp_path, "run", *CYCLES_OF_2), nproc=2, at=2, action=f"group:{sig}"
    )
    assert f"{name}: stopping now (the round in flight is dropped): saving step 2" in out, out[
        -3000:
    ]
    assert f"{name}: stopped at step 2/6: saved" in out
    assert "Continue with:\n  torchrun --nproc_per_node 2 train.py" in out
    assert "not saved" not in out and "[rank" not in out  # no rank's traceback
    assert os.path.realpath(tmp_path / "run" / "checkpoint").endswith("checkpoint-2")
    resume = args(tmp_path, "run", *CYCLES_OF_2, "--resume_from_checkpoint=true")
    rc, out, _ = launch(tmp_path, resume, nproc=2)
    assert rc == 0, out[-3000:]
    assert metrics(tmp_path / "run") == uninterrupted


def test_a_hung_rank_ends_the_run_within_ddp_timeout(tmp_path):
    """Rank 1 hangs in its reward function: rank 0's collective fails after ddp_timeout and says so
    in one line; torchrun then stops rank 1, which says where it hung."""
    mark = tmp_path / "hung_at"
    argv = args(tmp_path, "run", "--max_steps=4", "--ddp_timeout=10")
    rc, out, end = launch(tmp_path, argv, nproc=2, at=2, rank=1, action="hang", mark=mark)
    assert rc != 0
    assert 10 <= end - float(mark.read_text()) < 20, out[-3000:]
    ours = out.split("ChildFailedError")[0]  # what comes before torchrun's summary
    assert (
        "train.py: error: rank 0: at step 2, rank 1 stopped answering (ddp_timeout=10 s): "
        "Timed out" in ours
    ), out[-3000:]
    assert (
        "train.py: rank 1: ended at step 2 after another rank failed; it was in length "
        "(stop_reward.py:" in ours
    )
    assert "[rank" not in ours  # no rank's traceback


def test_the_error_of_a_rank_that_raises_is_read_first(tmp_path):
    """Rank 1's reward function raises: its error is the first error line, then rank 0 says in one
    line that rank 1 is gone; no rank prints a traceback."""
    rc, out, _ = launch(
        tmp_path, args(tmp_path, "run", "--max_steps=4"), nproc=2, at=2, rank=1, action="raise"
    )
    assert rc != 0
    errors = [
        line
        for line in out.splitlines()
        if line.startswith("train.py:") or "Traceback" in line or "Error:" in line
    ]
    assert errors[0] == (
        "train.py: error: rank 1, at step 2: reward function 'length' raised "
        "ValueError: the reward broke"
    ), out[-3000:]
    # whether rank 0's collective fails first or torchrun's SIGTERM reaches it first is a race;
    # either way it says the same (test_a_rank_says_the_same_whichever_it_sees_first)
    assert (
        errors[1] == "train.py: error: rank 0: at step 2, rank 1 is gone (it failed or was killed)"
    )
    assert "[rank" not in out.split("ChildFailedError")[0]


GLOO_GONE = [
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1",
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:589] Read error [127.0.0.1]:1: Connection "
    "reset by peer",
]


def frame_in(fn):
    """A frame of fn's, as a signal handler receives it."""
    return fn()


def test_a_rank_says_the_same_whichever_it_sees_first(tmp_path):
    """Rank 1 fails: rank 0's line is the same whether its collective fails first (any of gloo's
    messages) or torchrun's SIGTERM reaches it first, in whatever frame it was then; a rank that
    another timed out waiting for says where it hung."""
    info = dist.DistInfo(rank=0, world_size=2)
    r = SimpleNamespace(info=info, cfg=SimpleNamespace(ddp_timeout=1800), cycle_begin={})
    t = SimpleNamespace(step=1)
    lines = {f"train.py: error: {stops.rank_error(r, t, RuntimeError(m))}" for m in GLOO_GONE}
    told = "rank 1: ValueError: the reward broke"
    frames = [sys._getframe(), frame_in(sys._getframe), frame_in(lambda: sys._getframe()), None]
    lines |= {stops.ending_line(r, t, told, f) for f in frames}
    assert lines == {"train.py: error: rank 0: at step 2, rank 1 is gone (it failed or was killed)"}
    timed_out = stops.rank_error(r, t, RuntimeError("[../gloo/pair.cc:1] Timed out waiting 10ms."))
    assert str(timed_out) == (
        "rank 0: at step 2, rank 1 stopped answering (ddp_timeout=1800 s): Timed out waiting 10ms."
    )
    assert stops.ending_line(r, t, str(timed_out), frame_in(sys._getframe)) == (
        "train.py: rank 0: ended at step 2 after another rank failed; it was in "
        f"frame_in (test_stops.py:{frame_in.__code__.co_firstlineno + 2})"
    )


def test_a_second_ctrl_c_stops_at_once_and_handlers_live_only_in_a_run(
    tmp_path, monkeypatch, capsys
):
    """The first Ctrl-C during an update asks for a stop where the cycle ends; a second stops now
    (saving what is exact, as before). A run off the main thread, where no handler can be set,
    trains as usual."""
    signal_on_call(monkeypatch, "optimizer_step", at=2, sig=signal.SIGINT, times=2)
    with pytest.raises(KeyboardInterrupt):
        train.train(tiny(tmp_path, "--max_steps=4", "--save_steps=0"))
    out = capsys.readouterr().out
    assert "Ctrl-C: stopping after step 2: saving it then; Ctrl-C again stops at once" in out
    assert "interrupted at step 1/4: saved" in out
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    monkeypatch.undo()
    history = []
    thread = threading.Thread(
        target=lambda: history.extend(
            train.train(tiny(tmp_path, "--max_steps=1", "--overwrite_output_dir=true"))
        )
    )
    thread.start()
    thread.join()
    assert [m["step"] for m in history] == [1]
