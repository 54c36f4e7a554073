"""async_rollouts (nanogrpo/run/async_rollouts.py): a sampler process draws the rounds ahead of the
update. With max_staleness=0 the run is the synchronous one (every logged value but timings); with
max_staleness 1 and 2 (and weights sent every 2 steps) it is its synchronous replay bit for bit:
round r drawn in the trainer's process from the saved weights after step r - max_staleness; the
unreproducible mode keeps its staleness within max_staleness; a sampler that fails ends the run in
one line; what it does not run with is refused in one line."""

import json
import os
import types

import pytest
import torch
from safetensors.torch import load_file
from test_stops import args as stop_args, launch, metrics
from test_train import tiny

import train
from nanogrpo import run
from nanogrpo.run import async_rollouts
from nanogrpo.run.async_rollouts import SNAPSHOTS
from nanogrpo.run.config import ConfigError
from nanogrpo.run.configurator import load_config

ARGS = ("--max_steps=5", "--beta=0.04", "--max_completion_length=8", "--eval_steps=3")


def logged(history, timings=False):
    """Every logged value but the timings (and async_rollouts' own metrics)."""
    out = []
    for m in history:
        kept = {
            k: v
            for k, v in m.items()
            if timings
            or not (k.startswith(("time/", "async/")) or k in ("step_time", "tokens_per_sec"))
        }
        out.append(kept)
    return out


def test_max_staleness_0_trains_as_the_synchronous_trainer(tmp_path, capsys):
    sync = train.train(tiny(tmp_path / "sync", *ARGS))
    capsys.readouterr()
    drawn = train.train(
        tiny(tmp_path / "async", *ARGS, "--async_rollouts=true", "--max_staleness=0")
    )
    assert logged(drawn) == logged(sync)
    steps = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(steps) == 5 and all("s (wait " in line and "n/a" not in line for line in steps)
    assert all(m["async/staleness/max"] == 0.0 for m in drawn)
    assert all("time/wait_for_rollouts" in m and "time/wait_for_weights" in m for m in drawn)


@pytest.mark.parametrize("staleness, sync_steps", [(1, 1), (2, 1), (2, 2)])
def test_the_run_is_its_synchronous_replay(tmp_path, monkeypatch, staleness, sync_steps):
    how = (f"--max_staleness={staleness}", f"--weight_sync_steps={sync_steps}")
    drawn = train.train(tiny(tmp_path / "async", *ARGS, "--async_rollouts=true", *how))
    monkeypatch.setattr(run.async_rollouts, "start", async_rollouts.Replay)
    replay = train.train(tiny(tmp_path / "replay", *ARGS, "--async_rollouts=true", *how))
    assert logged(drawn) == logged(replay)
    # the staleness it reports: round r trained at step r on the weights after needed_step(r)
    lags = [m["async/staleness/max"] for m in drawn]
    assert lags == [r - async_rollouts.needed_step(r, staleness, sync_steps) for r in range(5)]
    # and it is off-policy: not the synchronous run
    sync = train.train(tiny(tmp_path / "sync", *ARGS))
    assert [m["loss"] for m in sync] != [m["loss"] for m in drawn]


@pytest.mark.parametrize("staleness, sync_steps", [(2, 1), (2, 2)])
def test_a_resumed_run_redraws_its_rounds_in_flight_exactly(tmp_path, staleness, sync_steps):
    """Stopped after step 3, rounds 3 and 4 were drawn (or queued) with the weights after steps
    1, 2 (weights every step) or 0, 2 (every 2): the checkpoint keeps them, the resumed run's
    sampler draws with them, and the run is the uninterrupted one."""
    how = (
        "--async_rollouts=true",
        f"--max_staleness={staleness}",
        f"--weight_sync_steps={sync_steps}",
        "--beta=0.04",
        "--max_completion_length=8",
    )
    full = train.train(tiny(tmp_path / "a", "--max_steps=6", *how))
    first = train.train(tiny(tmp_path / "b", "--max_steps=3", *how))
    kept = load_file(str(tmp_path / "b" / "run" / "checkpoint-3" / "trainer" / SNAPSHOTS))
    assert sorted(kept) == [f"step-{s}" for s in ((1, 2) if sync_steps == 1 else (0, 2))]
    resumed = train.train(
        tiny(tmp_path / "b", "--max_steps=6", "--resume_from_checkpoint=true", *how)
    )
    assert logged(first) == logged(full[:3])
    assert logged(resumed) == logged(full)
    assert [m["async/staleness/max"] for m in resumed[3:]] == [
        m["async/staleness/max"] for m in full[3:]
    ]


def test_sigterm_saves_and_the_resumed_run_redraws_what_was_in_flight(tmp_path):
    """SIGTERM to the trainer while its sampler scores round 3 (rounds ahead of the update): the
    trainer saves its last step, ends the sampler and exits 143; resumed, it is the uninterrupted
    run."""
    how = ("--max_steps=6", "--async_rollouts=true", "--max_staleness=2", "--beta=0.04")
    rc, out, _ = launch(tmp_path, stop_args(tmp_path, "full", *how))
    assert rc == 0, out[-3000:]
    rc, out, _ = launch(tmp_path, stop_args(tmp_path, "run", *how), at=4, action="parent:SIGTERM")
    assert rc == 143, out[-3000:]
    assert "SIGTERM: stopped at step" in out and "Traceback" not in out
    rc, out, _ = launch(tmp_path, stop_args(tmp_path, "run", *how, "--resume_from_checkpoint=true"))
    assert rc == 0, out[-3000:]
    assert "resumed from" in out
    assert logged(metrics(tmp_path / "run")) == logged(metrics(tmp_path / "full"))


def test_with_lora_the_sampler_receives_the_adapters_alone_and_the_run_is_its_replay(
    tmp_path, monkeypatch
):
    """LoRA, its dropout on (TRL's defaults: the sampler scores the trainer's log-probs for the
    importance-sampling correction after the rewards, with its round's adapters), two rounds in
    flight: only the adapters travel, and the run is its replay."""
    lora = ("--use_peft=true", "--lora_target_modules=all-linear", "--lora_r=4")
    how = (*ARGS, *lora, "--learning_rate=1e-2", "--async_rollouts=true", "--max_staleness=2")
    sizes = []
    send = async_rollouts.Rollouts.send

    def sending(self, step, flat):
        sizes.append(flat.numel())
        return send(self, step, flat)

    monkeypatch.setattr(async_rollouts.Rollouts, "send", sending)
    drawn = train.train(tiny(tmp_path / "async", *how))
    monkeypatch.setattr(run.async_rollouts, "start", async_rollouts.Replay)
    replay = train.train(tiny(tmp_path / "replay", *how))
    assert logged(drawn) == logged(replay)
    assert "sampling/importance_sampling_ratio/mean" in drawn[0]
    adapters = load_file(tmp_path / "async" / "run" / "checkpoint" / "adapter_model.safetensors")
    assert set(sizes) == {sum(v.numel() for v in adapters.values())}
    assert len(sizes) == 5  # the weights after steps 0..4: the rounds' and the last step's


def test_a_synchronous_checkpoint_resumed_asynchronously_says_it_does_not_replay(tmp_path, capsys):
    train.train(tiny(tmp_path, "--max_steps=2"))
    how = ("--async_rollouts=true", "--max_staleness=2", "--resume_from_checkpoint=true")
    history = train.train(tiny(tmp_path, "--max_steps=4", *how))
    assert len(history) == 4
    assert "holds no async_rollouts weights" in capsys.readouterr().out


def test_the_newest_weights_mode_keeps_within_max_staleness(tmp_path):
    drawn = train.train(
        tiny(
            tmp_path / "a",
            *ARGS,
            "--async_rollouts=true",
            "--max_staleness=1",
            "--async_reproducible=false",
        )
    )
    assert len(drawn) == 5
    assert all(m["async/staleness/max"] <= 1 for m in drawn)
    with open(os.path.join(tmp_path / "a" / "run", "metrics.jsonl")) as f:
        assert all("async/dropped" in json.loads(line) for line in f if line.strip())


def test_a_dead_sampler_ends_the_run_in_one_line(tmp_path):
    """The trainer waits at most heartbeat_stale_after_s; a sampler that died is named at once."""
    from nanogrpo import distributed as dist
    from nanogrpo.trainer import setup

    cfg = tiny(tmp_path, "--async_rollouts=true", "--heartbeat_stale_after_s=20")
    cfg.validate()
    run.start(cfg, dist.DistInfo(), None)
    t = setup(cfg, dist.DistInfo(), kernels=train.kernels(cfg))
    t.cfg = cfg
    rollouts = async_rollouts.start(t, train.sample_round, train.kernels)
    try:
        rollouts.process.kill()
        rollouts.process.join(timeout=30)
        with pytest.raises(async_rollouts.SamplerFailed, match="the sampler process died"):
            rollouts.take(t, 0)
    finally:
        rollouts.close()


CONFIG_CODE = """
class Length:
    def __call__(self, completions, **kwargs):
        return [len(c) / 8 for c in completions]


def has_a(completions, **kwargs):
    return [float("a" in c) for c in completions]


reward_funcs = [has_a, Length()]
"""


def test_a_config_files_own_reward_functions_reach_the_sampler_process(tmp_path, monkeypatch):
    """A function and a callable object defined in a config file (not importable by name in the
    sampler process): the run is its replay, which scores in the trainer's process."""
    config = tmp_path / "mine.py"
    config.write_text(CONFIG_CODE)
    how = ("--config", str(config), "--async_rollouts=true", "--max_staleness=1")
    drawn = train.train(tiny(tmp_path / "async", *how))
    assert "rewards/has_a/mean" in drawn[0] and "rewards/Length/mean" in drawn[0]
    monkeypatch.setattr(run.async_rollouts, "start", async_rollouts.Replay)
    assert logged(drawn) == logged(train.train(tiny(tmp_path / "replay", *how)))


def test_a_reward_the_sampler_process_cannot_be_given_is_named(tmp_path):
    cfg = tiny(tmp_path, "--async_rollouts=true")
    cfg.reward_funcs = [lambda completions, **kwargs: [0.0] * len(completions)]
    with pytest.raises(ValueError, match="async_rollouts: the sampler process is given .*lambda"):
        train.train(cfg)


LOCKED = """
import threading


class LockedGame(WordGame):
    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()  # a handle on something: it cannot be pickled


environment_factory = LockedGame
"""


@pytest.mark.parametrize("with_tools", [False, True])
def test_environments_and_tools_are_played_in_the_sampler_process(
    tmp_path, monkeypatch, with_tools
):
    """TRL's docs' WordGame (its tool `guess`, its get_reward) from a config file, holding a
    lock, or the calculator tool offered: each completion plays its own environment (reset with
    its row) in the sampler process, the environments stay there, and the run is its replay,
    which plays them in the trainer's process (fails when a sampler passes over one round's
    prompts too many)."""
    from test_environments import GAME, word_game

    code, tools = GAME + LOCKED, {}
    if with_tools:  # the calculator in place of the game
        code = "reward_funcs = ['examples/tool_calculator.py:tool_called']\n"
        tools = dict(tools=["examples/tool_calculator.py:multiply"])
    config = word_game(
        tmp_path, code, per_device_train_batch_size=8, max_steps=3, beta=0.04, **tools
    )
    how = ("--config", str(config), "--async_rollouts=true", "--max_staleness=2")
    drawn = train.train(load_config([*how, f"--output_dir={tmp_path}/async"]))
    monkeypatch.setattr(run.async_rollouts, "start", async_rollouts.Replay)
    replay = train.train(load_config([*how, f"--output_dir={tmp_path}/replay"]))
    assert len(drawn) == 3 and logged(drawn) == logged(replay)
    assert "tools/call_frequency" in drawn[0]
    if not with_tools:
        assert all(m["rewards/own_word/mean"] == 1.0 for m in drawn)


def step_reward(completions, trainer_state, **kwargs):
    """The step the round trains at, as a reward function reads it (a curriculum's clock)."""
    return [float(trainer_state.global_step)] * len(completions)


def step_rollout(prompts, trainer):
    """A rollout_func that records the step it reads."""
    from nanogrpo.extras.custom_rollout import generate_rollout_completions

    outputs = generate_rollout_completions(trainer, prompts)
    return {
        "prompt_ids": [o["prompt_ids"] for o in outputs],
        "completion_ids": [o["completion_ids"] for o in outputs],
        "logprobs": [o["logprobs"] for o in outputs],
        "step_seen": float(trainer.state.global_step),
    }


def step_seen(completions, step_seen, **kwargs):
    return step_seen


@pytest.mark.parametrize("replay", [False, True])
def test_rewards_and_a_rollout_func_read_the_step_their_round_trains_at(
    tmp_path, monkeypatch, replay
):
    """trainer_state.global_step in the sampler process is the step its round trains at, as the
    synchronous trainer's state reads it while it samples the round (rounds overlap: the
    sampler's own step is not it), in the replay too."""
    rewards = f"--reward_funcs={__name__}:step_reward,{__name__}:step_seen"
    how = (rewards, f"--rollout_func={__name__}:step_rollout", "--max_steps=4")
    if replay:
        monkeypatch.setattr(run.async_rollouts, "start", async_rollouts.Replay)
    drawn = train.train(tiny(tmp_path, *how, "--async_rollouts=true", "--max_staleness=2"))
    for name in ("step_reward", "step_seen"):
        assert [m[f"rewards/{name}/mean"] for m in drawn] == [0.0, 1.0, 2.0, 3.0]


def no_logprobs(prompts, trainer):
    """A rollout_func that does not return the sampler's log-probs."""
    from nanogrpo.extras.custom_rollout import generate_rollout_completions

    outputs = generate_rollout_completions(trainer, prompts)
    return {
        "prompt_ids": [o["prompt_ids"] for o in outputs],
        "completion_ids": [o["completion_ids"] for o in outputs],
        "logprobs": None,
    }


def test_a_rollout_func_runs_in_the_sampler_process(tmp_path, monkeypatch):
    """TRL's openenv pattern (an environment's tokens masked, its reward an extra field): the run
    is its replay; one that returns no log-probs is named (they are the old policy)."""
    how = (
        "--async_rollouts=true",
        "--max_staleness=1",
        "--rollout_func=test_environments:rollout_with_an_environment",
        "--reward_funcs=test_environments:from_env,default_task",
    )
    drawn = train.train(tiny(tmp_path / "async", *how))
    assert "rewards/from_env/mean" in drawn[0]
    monkeypatch.setattr(run.async_rollouts, "start", async_rollouts.Replay)
    assert logged(drawn) == logged(train.train(tiny(tmp_path / "replay", *how)))
    monkeypatch.undo()
    bare = ("--async_rollouts=true", f"--rollout_func={__name__}:no_logprobs")
    with pytest.raises(ValueError, match="round 0 came without the sampler's log-probs"):
        train.train(tiny(tmp_path / "bare", *bare))


@pytest.mark.parametrize("queue_maxsize", [1, 3])
def test_the_sampler_draws_at_most_queue_maxsize_rounds_ahead(tmp_path, queue_maxsize):
    """max_staleness=4 lets the sampler draw rounds 0..4 with the first weights; queue_maxsize
    rounds wait for the trainer, no more, until it takes one."""
    import time

    from nanogrpo import distributed as dist
    from nanogrpo.trainer import setup

    extra = ("--max_steps=8", "--max_staleness=4", f"--queue_maxsize={queue_maxsize}")
    cfg = tiny(tmp_path, "--async_rollouts=true", *extra)
    cfg.validate()
    run.start(cfg, dist.DistInfo(), None)
    t = setup(cfg, dist.DistInfo(), kernels=train.kernels(cfg))
    rollouts = async_rollouts.start(t, train.sample_round, train.kernels)

    def waiting(n):  # the rounds waiting, once n wait (or 60 s), and 2 s later
        deadline = time.time() + 60
        while rollouts.queued() < n and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(2)  # the tiny model draws a round well within it
        return rollouts.queued()

    try:
        assert waiting(queue_maxsize) == queue_maxsize
        rollouts.take(t, 0)
        assert waiting(queue_maxsize) == queue_maxsize
    finally:
        rollouts.close()


def test_a_sampler_that_dies_before_it_connects_is_named_at_once(tmp_path, monkeypatch):
    """Its process cannot even unpickle its target (a module only the trainer's process holds):
    it exits before it connects, and the trainer says so at once, not after the heartbeat's
    600 s."""
    import sys
    import types

    from nanogrpo import distributed as dist
    from nanogrpo.trainer import setup

    gone = types.ModuleType("only_here")
    exec("def sampler_main(*args):\n    pass\n", vars(gone))
    monkeypatch.setitem(sys.modules, "only_here", gone)
    monkeypatch.setattr(async_rollouts, "sampler_main", gone.sampler_main)
    cfg = tiny(tmp_path, "--async_rollouts=true", "--heartbeat_stale_after_s=600")
    cfg.validate()
    run.start(cfg, dist.DistInfo(), None)
    t = setup(cfg, dist.DistInfo(), kernels=train.kernels(cfg))
    with pytest.raises(async_rollouts.SamplerFailed, match="the sampler process died"):
        async_rollouts.start(t, train.sample_round, train.kernels)


def test_a_failing_sampler_names_its_error(tmp_path):
    reward = tmp_path / "bad_reward.py"
    reward.write_text("def broken(completions, **kw):\n    raise RuntimeError('judge is down')\n")
    cfg = tiny(tmp_path, "--async_rollouts=true", f"--reward_funcs=['{reward}:broken']")
    with pytest.raises(async_rollouts.SamplerFailed, match="judge is down"):
        train.train(cfg)


def test_a_round_that_cannot_be_sent_back_names_why(tmp_path):
    """A column logged for the completions table that cannot be pickled: the trainer gets the
    sampler's one line for that very round, not a silent end."""
    reward = tmp_path / "odd_reward.py"
    reward.write_text(
        "import threading\n\n\n"
        "def odd(completions, log_extra, **kw):\n"
        "    log_extra('handle', [threading.Lock() for _ in completions])\n"
        "    return [0.0] * len(completions)\n"
    )
    cfg = tiny(tmp_path, "--async_rollouts=true", f"--reward_funcs=['{reward}:odd']")
    with pytest.raises(async_rollouts.SamplerFailed, match="failed: TypeError: cannot pickle"):
        train.train(cfg)


@pytest.mark.parametrize(
    "setting, match",
    [
        ("--max_staleness=-1", "max_staleness=-1: must be >= 0"),
        ("--weight_sync_steps=3", r"weight_sync_steps=3: must be in \[1, max_staleness \+ 1"),
        ("--num_iterations=2", "num_iterations=2: with async_rollouts=true"),
        ("--dynamic_sampling=true", "dynamic_sampling=True: with async_rollouts=true"),
        ("--steps_per_generation=4", "steps_per_generation=4: with async_rollouts=true"),
    ],
)
def test_what_async_rollouts_does_not_run_with_is_refused(setting, match):
    args = ["--config", "tiny.py", "--async_rollouts=true", "--max_staleness=1", setting]
    with pytest.raises(ConfigError, match=match):
        load_config(args).validate()


@pytest.mark.parametrize(
    "setting, launched, match",
    [
        ("--rollout_processes=2", 2, "rollout_processes=2: .* must be < the 2 processes launched"),
        ("--rollout_processes=0", 3, "rollout_processes=0: .* must be >= 1"),
        ("--per_device_train_batch_size=2", 3, "each trains whole groups: 4 completions"),
    ],
)
def test_what_torchrun_cannot_launch_is_refused(monkeypatch, setting, launched, match):
    monkeypatch.setenv("WORLD_SIZE", str(launched))  # as torchrun sets it: load_config validates
    with pytest.raises(ConfigError, match=match):
        load_config(["--config", "tiny.py", "--async_rollouts=true", setting])


REPLAY = """import sys

sys.path.insert(0, {root!r})
import train
from nanogrpo import distributed, run
from nanogrpo.run import async_rollouts

plain = distributed.setup
distributed.setup = lambda device, timeout, samplers=0: plain(device, timeout)  # all train
async_rollouts.start = async_rollouts.Replay  # each trainer draws the round, takes its share
run.exit_process(run.main(sys.argv[1:], train.train))
"""


@pytest.mark.parametrize("rollout_processes", [1, 2])
def test_under_torchrun_rollout_processes_draw_for_two_trainers_as_their_replay(
    tmp_path, rollout_processes
):
    """2 gloo trainers sharding the model, and 1 or 2 processes drawing the rounds for both (round
    r on the (r mod 2)-th), equal 2 trainers that draw each round themselves from the saved
    weights of step r - max_staleness."""
    from test_dist import torchrun
    from test_train import INIT

    def common(name):
        out = tmp_path / name
        return (
            *("--config", "tiny.py", f"--model={tmp_path}/init", INIT, f"--output_dir={out}"),
            *("--gradient_accumulation_steps=2", "--num_generations=4"),
            *("--per_device_train_batch_size=8", "--max_completion_length=6"),
            *("--eval_strategy=no", "--max_steps=4", "--beta=0.04"),
            *("--async_rollouts=true", "--max_staleness=1"),
        )

    R = rollout_processes
    drawn = torchrun(*common("async"), f"--rollout_processes={R}", nproc=2 + R)
    assert drawn.returncode == 0, drawn.stderr[-3000:]
    ranks = f"{R} rollout process(es), rank(s) 2..{1 + R} (round r on rank 2 + r mod {R})"
    assert ranks in drawn.stdout
    assert "up to 1 round(s) ahead for 2 trainer process(es)" in drawn.stdout
    assert "2 process(es) on cpu" in drawn.stdout
    script = tmp_path / "replay.py"
    script.write_text(REPLAY.format(root=os.path.dirname(os.path.dirname(__file__))))
    replay = torchrun(*common("replay"), nproc=2, script=str(script))
    assert replay.returncode == 0, replay.stderr[-3000:]
    drawn, replayed = (metrics(tmp_path / name) for name in ("async", "replay"))
    assert len(drawn) == 4 and logged(drawn) == logged(replayed)
    assert [m["async/staleness/max"] for m in drawn] == [0.0, 1.0, 1.0, 1.0]


def test_the_memory_plan_counts_the_sampler_process():
    from nanogrpo.run.plan import plan

    sync = plan(load_config(["--config", "tiny.py"]), 1)
    drawn = plan(load_config(["--config", "tiny.py", "--async_rollouts=true"]), 1)
    weights = drawn["bytes"]["sampler_process_weights"]
    assert weights == sync["bytes"]["parameters"] > 0
    # on CPU the trainable weights it keeps: for max_staleness (4) rounds in flight and the newest
    kept = drawn["bytes"]["sampler_received_weights"]
    assert kept == 5 * weights
    weights += kept
    assert drawn["total"] == sync["total"] - max(sync["sampling_peak"], sync["update_peak"]) + (
        sync["sampling_peak"] + sync["update_peak"] + weights
    )


class Sent:
    """The trainer's end of a weights channel, in this process, for a Receiver: the weights of
    `steps` ({step: flattened weights}) already sent, in order, then the run's END."""

    done = types.SimpleNamespace(wait=lambda: None, is_completed=lambda: True)

    def __init__(self, steps: dict):
        self.messages = [m for s, w in sorted(steps.items()) for m in (torch.tensor([s]), w)]
        self.messages.append(torch.tensor([async_rollouts.END]))

    def recv(self, tensors, src, tag):
        tensors[0].copy_(self.messages.pop(0))
        return self.done


def trainable(model):
    return async_rollouts.trainable_parameters(model)


def flat_weights(model):
    return torch.cat([p.detach().reshape(-1) for p in trainable(model)])


def test_an_async_reward_is_awaited_while_the_next_round_draws_and_awaits_its_own(tmp_path):
    """Round 0's judge answers only once round 1's judge is asking: it cannot unless round 0's
    coroutine is awaited without the model's lock."""
    import asyncio

    from nanogrpo import distributed as dist
    from nanogrpo.trainer import setup

    cfg = tiny(tmp_path, "--async_rollouts=true", "--max_staleness=2")
    cfg.validate()
    run.start(cfg, dist.DistInfo(), None)
    t = setup(cfg, dist.DistInfo(), kernels=train.kernels(cfg))
    asking = []  # the rounds whose judge has been called, in order

    async def judge(completions, **kwargs):
        asking.append(len(asking))
        if asking[-1] == 0:
            for _ in range(3000):  # up to 30 s
                if len(asking) > 1:
                    break
                await asyncio.sleep(0.01)
            else:
                raise TimeoutError("round 1's judge was not called while round 0's waited")
        return [float(len(c)) for c in completions]

    t.reward_funcs = [("judge", judge)]
    receiver = async_rollouts.Receiver(Sent({0: flat_weights(t.model)}), trainable(t.model))
    pipeline = async_rollouts.Pipeline(t, train.sample_round, receiver, in_flight=2)
    drawn = list(pipeline.run(range(3), 0))
    assert [step for _, _, step, _ in drawn] == [0, 0, 0]
    assert asking == [0, 1, 2]


def test_a_round_whose_reward_waits_takes_the_model_back_with_its_own_weights(tmp_path):
    """Round 0's reward returns only once round 1 has drawn, with the weights after step 1: round
    0 then finds its own (step 0's) in the model, as what it scores after its rewards needs (the
    trainer log-probs of the importance-sampling correction, with LoRA's dropout)."""
    import threading

    from nanogrpo import distributed as dist
    from nanogrpo.trainer import setup

    cfg = tiny(tmp_path, "--async_rollouts=true", "--max_staleness=0")  # round r: step r's
    cfg.validate()
    run.start(cfg, dist.DistInfo(), None)
    t = setup(cfg, dist.DistInfo(), kernels=train.kernels(cfg))
    base = flat_weights(t.model)
    drawn = threading.Event()  # round 1 has drawn

    def judge(rnd):
        if rnd == 0 and not drawn.wait(20):
            raise TimeoutError("round 1 did not draw while round 0's reward waited")

    def sample_round(t, rnd):  # -> the steps of the weights it draws and scores with
        steps = [round(float(flat_weights(t.model)[0] - base[0]))]
        if rnd == 1:
            drawn.set()
        t.reward_funcs[0][1](rnd)  # (Pipeline's: without the model's lock)
        steps.append(round(float(flat_weights(t.model)[0] - base[0])))
        return steps, {"timing": {}}

    t.reward_funcs = [("judge", judge)]
    receiver = async_rollouts.Receiver(Sent({0: base, 1: base + 1.0}), trainable(t.model))
    pipeline = async_rollouts.Pipeline(t, sample_round, receiver, in_flight=2)
    assert [steps for steps, _, _, _ in pipeline.run(range(2), 0)] == [[0, 0], [1, 1]]


RELAY = """
import threading


class Relay(WordGame):
    called = []  # the words of the environments whose relay was called, in order
    answered = threading.Event()

    def relay(self) -> str:
        \"""
        Pass the turn.

        Returns:
            Whether another round called it while this call waited.
        \"""
        self.called.append(self.word)
        if len(self.called) > 1:
            self.answered.set()
            return "next"
        return "overlapped" if self.answered.wait(20) else "alone"


environment_factory = Relay
"""


def test_a_round_waiting_on_its_environment_lets_the_next_draw_and_resumes_with_its_own(
    tmp_path, monkeypatch
):
    """Round 0's first environment step (a tool call) returns only once round 1 has drawn and
    called its own: it cannot unless the step runs without the model's lock. Round 0's next turn
    is then drawn with its own weights (those after step 0, not round 1's), and its rewards read
    its own environments (round 1 reset its own, not round 0's)."""
    from test_environments import CALL, GAME, chat_tokenizer, scripted, word_game

    from nanogrpo import distributed as dist, rollout as rollout_module
    from nanogrpo.extras import tool_rounds
    from nanogrpo.trainer import setup

    how = dict(async_rollouts=True, max_staleness=0, max_completion_length=200)
    config = word_game(tmp_path, GAME + RELAY, **how)
    cfg = load_config(["--config", config, f"--output_dir={tmp_path}/run"])
    cfg.validate()
    run.start(cfg, dist.DistInfo(), None)
    t = setup(cfg, dist.DistInfo(), kernels=train.kernels(cfg))
    base = flat_weights(t.model)
    steps = {0: base, 1: base + 1.0}  # max_staleness=0: round r is drawn with step r's

    def policy(context, j, k):  # call the relay, then say which weights drew the turn
        return CALL.format("relay", "{}") if "tool\n" not in context else f"on {drawn_with[-1]}"

    drawn_with, inner = [], scripted(chat_tokenizer(), policy)

    def generate(model, *args, **kwargs):
        drawn_with.append(round(float(flat_weights(model)[0] - base[0])))
        return inner(model, *args, **kwargs)

    monkeypatch.setattr(rollout_module, "generate", generate)
    monkeypatch.setattr(tool_rounds, "generate", generate)
    own_word = [name for name, _ in t.reward_funcs].index("own_word")
    receiver = async_rollouts.Receiver(Sent(steps), trainable(t.model))
    pipeline = async_rollouts.Pipeline(t, train.sample_round, receiver, in_flight=2)
    drawn = list(pipeline.run(range(2), 0))
    assert [step for _, _, step, _ in drawn] == [0, 1]
    first = drawn[0][0].completions[0]
    assert first[1] == {"role": "tool", "name": "relay", "content": "overlapped"}
    for rnd, (ro, sampled, _, _) in enumerate(drawn):
        assert {c[-1]["content"] for c in ro.completions} == {f"on {rnd}"}
        assert sampled["local"][:, own_word].tolist() == [1.0] * len(ro.completions)
    # round 1's first turn drawn while round 0 waited, then each one's second, in either order
    assert drawn_with[:2] == [0, 1] and sorted(drawn_with[2:]) == [0, 1]
    # the newest only, once no round draws with step 0's, whose buffer is received into next
    assert receiver.kept.keys() == {1} and len(receiver.spare) == 1


def test_sigterm_to_torchrun_saves_and_the_resumed_run_redraws_what_was_in_flight(tmp_path):
    """SIGTERM to torchrun's process group while the rollout process scores round 4: the rollout
    process ends at once, the trainers save their last step; resumed with the same launch, the
    run is the uninterrupted one."""
    how = ("--max_steps=6", "--async_rollouts=true", "--max_staleness=2", "--beta=0.04")
    rc, out, _ = launch(tmp_path, stop_args(tmp_path, "full", *how), nproc=3)
    assert rc == 0, out[-3000:]
    stop = dict(at=4, action="group:SIGTERM", rank=2)
    rc, out, _ = launch(tmp_path, stop_args(tmp_path, "run", *how), nproc=3, **stop)
    assert "SIGTERM: stopped at step" in out and "[rank" not in out, out[-3000:]
    assert "Continue with:\n  torchrun --nproc_per_node 3 train.py" in out
    resume = stop_args(tmp_path, "run", *how, "--resume_from_checkpoint=true")
    rc, out, _ = launch(tmp_path, resume, nproc=3)
    assert rc == 0, out[-3000:]
    assert logged(metrics(tmp_path / "run")) == logged(metrics(tmp_path / "full"))


@pytest.mark.parametrize("rollout_processes", [1, 2])
def test_a_failing_rollout_process_under_torchrun_names_its_error(tmp_path, rollout_processes):
    R = rollout_processes
    how = ("--max_steps=4", "--async_rollouts=true", "--max_staleness=1")
    stop = dict(at=2, action="raise", rank=1 + R)  # the last rollout process's 2nd reward call
    args = stop_args(tmp_path, "run", *how, f"--rollout_processes={R}")
    rc, out, _ = launch(tmp_path, args, nproc=2 + R, **stop)
    assert rc != 0
    failed = f"error: the rollout process (rank {1 + R}) failed: "
    assert failed in out and "the reward broke" in out, out[-3000:]
