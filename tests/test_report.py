"""run/report.py: the completions table, TRL's `epoch` in every step record, the end-of-run
summary."""

import contextlib
import io
import json
import math
import os
from types import SimpleNamespace

import pytest
import torch
from test_train import tiny

import train
from nanogrpo.extras.trainer_info import epochs_done
from nanogrpo.run import report


def test_log_extra_values_are_a_column_of_the_completions_table(capsys):
    """TRL's completions table has a column per log_extra name, after its own; the completion's
    text is the completion's alone."""
    ro = SimpleNamespace(
        num_generations=2,
        prompts=["abc=", "abc=", "de=", "de="],
        completions=["abc", "ab", "d", "de"],
    )
    rewards = torch.tensor([[1.0], [0.0], [0.5], [1.0]])  # [n, K]
    columns = {"difficulty": ["hard", "hard", "easy", "easy"], "tries": [3, 1, 2, 2]}
    rows = report.shown_samples(ro, rewards, torch.ones(1), k=2, columns=columns)
    assert rows == [
        {"prompt": "abc=", "completion": "abc", "reward": 1.0, "difficulty": "hard", "tries": 3},
        {"prompt": "de=", "completion": "d", "reward": 0.5, "difficulty": "easy", "tries": 2},
    ]
    report.print_samples(rows)
    assert capsys.readouterr().out.splitlines() == [
        "    prompt | completion | reward | difficulty | tries",
        "    'abc=' | 'abc'      | 1.00   | hard       | 3",
        "    'de='  | 'd'        | 0.50   | easy       | 2",
    ]


def transformers_epochs(steps_in_epoch: int, GA: int, max_steps: int) -> list[float]:
    """state.epoch after each optimizer step, as transformers' Trainer loop sets it: each epoch
    cut into updates of GA micro-batches, the last taking what is left."""
    epochs = []
    epoch = 0
    while len(epochs) < max_steps:
        step = -1
        remainder = steps_in_epoch % GA or GA
        updates = steps_in_epoch // GA + int(remainder < GA)
        for update in range(updates):
            step += GA if update < updates - 1 else remainder
            epochs.append(epoch + (step + 1) / steps_in_epoch)
        epoch += 1
    return epochs[:max_steps]


@pytest.mark.parametrize(
    "prompts, GA, spg, mu",
    [(8, 2, 2, 1), (10, 3, 3, 1), (12, 2, 4, 1), (9, 4, 2, 2), (5, 8, 1, 1), (20, 3, 2, 1)],
)
def test_epoch_is_transformers_count_over_trls_dataloader(prompts, GA, spg, mu):
    """TRL's dataloader yields each generation round's micro-batches steps_per_generation x
    num_iterations times, over the whole rounds of the prompts; transformers' epoch counts
    them, the last update of an epoch taking what is left."""
    cfg = tiny(
        "unused",
        f"--gradient_accumulation_steps={GA}",
        f"--steps_per_generation={spg}",
        f"--num_iterations={mu}",
        "--per_device_train_batch_size=4",
        "--num_generations=2",
        "--max_steps=30",
    )
    cfg.validate(1)
    per_round = 4 * spg // 2  # prompts
    steps_in_epoch = (prompts // per_round) * spg * mu
    expected = transformers_epochs(steps_in_epoch, GA, 30)
    got = [epochs_done(cfg, step, prompts) for step in range(1, 31)]
    assert got == pytest.approx(expected, abs=1e-12) and epochs_done(cfg, 0, prompts) == 0.0


def test_every_logged_step_has_trls_epoch(tmp_path):
    """8 prompts, 4 a round, one round a step: 2 steps an epoch, so 0.5, 1.0, 1.5 in
    metrics.jsonl (and in what train returns), as TRL logs `epoch`."""
    with open(tmp_path / "data.jsonl", "w") as f:
        for c in "abcdefgh":
            f.write(json.dumps({"prompt": "abc" + c + "=", "target": "abc" + c}) + "\n")
    history = train.train(tiny(tmp_path, f"--dataset={tmp_path}/data.jsonl", "--max_steps=3"))
    assert [m["epoch"] for m in history] == [0.5, 1.0, 1.5]
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        logged = [json.loads(line) for line in f]
    assert [m["epoch"] for m in logged] == [0.5, 1.0, 1.5]
    assert all(math.isfinite(m["loss"]) for m in logged)


# -----------------------------------------------------------------------------
# Values that are not finite: null in metrics.jsonl, n/a on the console, said once


def strict_json(line: str) -> dict:
    """json.loads refusing NaN and Infinity, which JSON does not have."""

    def refuse(token):
        raise ValueError(f"not JSON: {token}")

    return json.loads(line, parse_constant=refuse)


def a_run(tmp_path, **cfg):
    settings = dict(
        output_dir=str(tmp_path),
        max_steps=9,
        logging_steps=1,
        logging_first_step=False,
        log_completions=False,
    )
    return SimpleNamespace(
        cfg=SimpleNamespace(**{**settings, **cfg}),
        info=SimpleNamespace(is_main=True),
        history=[],
        pending=[],
        reporters=[],
        progress=None,
        samples=[],
        warned=set(),
        streaks={},
        started=(0.0, 0),
    )


def a_step(step: int, **values) -> dict:
    """A step record holding every value the console formats."""
    m = {
        "step": step,
        "reward": 0.5,
        "reward_std": 0.25,
        "kl": 0.01,
        "loss": 0.125,
        "completions/mean_length": 4.0,
        "grad_norm": 1.5,
        "learning_rate": 1e-3,
        "step_time": 2.0,
        "time/sample": 1.0,
        "time/update": 1.0,
        "tokens_per_sec": 100.0,
        "eval/reward": 0.75,
        "eval/pass@1": 0.5,
        "eval/loss": 0.0625,
    }
    m.update(values)
    return m


# what a step's line shows of each value when it is n/a
SHOWN = {
    "reward": "reward n/a ±",
    "reward_std": "± n/a |",
    "kl": "kl n/a",
    "loss": "loss n/a",
    "completions/mean_length": "len n/a",
    "grad_norm": "grad n/a",
    "learning_rate": "lr n/a",
    "step_time": "| n/as (",
    "time/sample": "(sample n/a,",
    "time/update": "update n/a)",
    "eval/reward": "eval n/a",
    "eval/pass@1": "",  # on an evaluation's own line (the next test)
    "eval/loss": "",
}


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, None], ids=repr)
@pytest.mark.parametrize("key", SHOWN)
def test_a_value_that_is_not_finite_is_null_and_n_a(tmp_path, capsys, key, value):
    """A step whose `key` is NaN, inf or None: its console line says n/a there, metrics.jsonl
    writes null (valid JSON), the run's history holds None. A loss or grad norm that is not
    finite is said in one line, naming the step."""
    run = a_run(tmp_path)
    run.pending = [a_step(1), a_step(2, **{key: value})]
    report.log(run)
    out = capsys.readouterr().out
    line = [s for s in out.splitlines() if s.startswith("step    2/9")][0]
    assert SHOWN[key] in line and line.count("n/a") == int(bool(SHOWN[key])), line
    with open(tmp_path / "metrics.jsonl") as f:
        records = [strict_json(line) for line in f]
    assert records[1][key] is None and run.history[1][key] is None
    said = [s for s in out.splitlines() if "not finite" in s]
    if key in ("loss", "grad_norm") and value is not None:
        name = key.replace("_", " ")
        assert said == [
            f"warning: step 2: the {name} is {value}, not finite: training has diverged (lower "
            "learning_rate, set max_grad_norm, or look for rewards that are inf). Said once; "
            "metrics.jsonl writes null for each value that is not finite"
        ]
    else:
        assert said == []


@pytest.mark.parametrize("value", [math.nan, math.inf, None], ids=repr)
@pytest.mark.parametrize("key", ["eval/reward", "eval/pass@1", "eval/loss"])
def test_an_evaluation_that_is_not_finite_is_null_and_n_a(tmp_path, capsys, key, value):
    """eval_on_start's record, and an evaluation at a step that logs none (logging_steps=3)."""
    run = a_run(tmp_path, logging_steps=3)
    evals = {k: v for k, v in a_step(0).items() if k.startswith("eval/")}
    report.log_eval(run, {"step": 0, **evals, key: value})
    run.pending = [a_step(1, **{key: value})]
    report.log(run)
    lines = capsys.readouterr().out.splitlines()
    name = {"eval/reward": "reward", "eval/pass@1": "pass@1", "eval/loss": "loss"}[key]
    assert lines[0].startswith("eval before step 1: ") and f"{name} n/a" in lines[0]
    assert lines[1].startswith("eval at step 1: ") and f"{name} n/a" in lines[1]
    with open(tmp_path / "metrics.jsonl") as f:
        records = [strict_json(line) for line in f]
    assert [r["step"] for r in records] == [0, 1] and "loss" not in records[1]
    assert records[0][key] is None and records[1][key] is None


def test_a_diverging_run_says_so_once_and_trains_on(tmp_path, monkeypatch, capsys):
    """From step 2 every loss is NaN (so is the gradient): one line says so at step 2, the run
    ends at max_steps with its checkpoints, metrics.jsonl is valid JSON with nulls, and the
    summary counts the steps."""
    calls = []
    step = train.grpo_step

    def diverging(*args, **kwargs):
        loss, metrics = step(*args, **kwargs)
        calls.append(1)
        if len(calls) > 2:  # two micro-batches a step: from step 2 on
            loss = loss * math.nan
        return loss, metrics

    monkeypatch.setattr(train, "grpo_step", diverging)
    history = train.train(tiny(tmp_path, "--max_steps=4", "--save_steps=2"))
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if "not finite" in line]
    assert len(said) == 2 and said[0].startswith("warning: step 2: the loss is nan and the ")
    assert "; 3 steps with a loss or grad norm that was not finite (the first: step 2)" in said[1]
    assert [m["step"] for m in history] == [1, 2, 3, 4]
    assert [m["loss"] is None for m in history] == [False, True, True, True]
    assert sorted(os.listdir(tmp_path / "run" / "checkpoint-4"))  # saved at the end
    assert os.path.isdir(tmp_path / "run" / "checkpoint-2")
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        records = [strict_json(line) for line in f]
    assert [r["grad_norm"] for r in records][1:] == [None, None, None]


# -----------------------------------------------------------------------------
# logging_steps: a record per window, its steps' mean, as TRL's GRPOTrainer.log

TRAIN_TIMING = ("step_time", "tokens_per_sec", "time/sample", "time/score", "time/logprobs")
AT_THE_STEP = ("step", "grad_norm", "learning_rate", "epoch", "num_tokens")


def window_means(history: list[dict], windows: list[list[int]]) -> list[dict]:
    """TRL's log over each window of steps: a metric's mean over the steps with a value for it
    (TRL drops NaN), transformers' loss the window's mean, grad_norm, learning_rate and epoch
    (and TRL's num_tokens, a running total) the logging step's. Timing left out."""
    by_step = {m["step"]: m for m in history if "loss" in m}
    out = []
    for steps in windows:
        last = by_step[steps[-1]]
        record = {}
        for key in last:
            if key in TRAIN_TIMING or key.startswith("time/") or key.startswith("eval/"):
                continue
            if key in AT_THE_STEP:
                record[key] = last[key]
                continue
            values = [by_step[s][key] for s in steps if by_step[s][key] is not None]
            record[key] = sum(values) / len(values) if values else None
        out.append(record)
    return out


def untimed(records: list[dict]) -> list[dict]:
    return [
        {k: v for k, v in m.items() if not (k in TRAIN_TIMING or k.startswith(("time/", "eval/")))}
        for m in records
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 7 steps logged every step and every 3 steps (with its trackers' records and
    console), and every 3 steps stopped at step 4 and resumed."""
    tmp = tmp_path_factory.mktemp("logging")
    every = train.train(tiny(tmp / "every", "--max_steps=7"))
    tracked = []
    console = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(console):
        tracker = lambda m, step: tracked.append((step, m))  # noqa: E731
        mp.setattr(report, "open_reporters", lambda cfg, info: [tracker])
        third = train.train(tiny(tmp / "third", "--max_steps=7", "--logging_steps=3"))
    train.train(tiny(tmp / "resumed", "--max_steps=4", "--logging_steps=3"))
    resumed = train.train(
        tiny(tmp / "resumed", "--max_steps=7", "--logging_steps=3", "--resume_from_checkpoint=true")
    )

    def logged(name):
        with open(tmp / name / "run" / "metrics.jsonl") as f:
            return [json.loads(line) for line in f]

    return SimpleNamespace(
        every=every,
        third=third,
        resumed=resumed,
        tracked=tracked,
        console=console.getvalue(),
        logged=logged,
    )


def test_logging_steps_logs_each_windows_mean_as_trl(runs):
    """logging_steps=3 over 7 steps: records at steps 3, 6 and 7 (the last step logs what its
    window holds, as TRL's final log), each the mean of its steps' values in the run logged
    every step; the trackers get the same records, the console a line each; the history train
    returns stays a record per step."""
    assert untimed(runs.third) == untimed(runs.every)  # logging_steps changes no step
    logged = runs.logged("third")
    assert [m["step"] for m in logged] == [3, 6, 7]
    expected = window_means(runs.every, [[1, 2, 3], [4, 5, 6], [7]])
    assert untimed(logged) == expected  # summed in the same order: equal, not close
    assert logged[0]["loss"] == pytest.approx(sum(m["loss"] for m in runs.every[:3]) / 3)
    assert logged[0]["grad_norm"] == runs.every[2]["grad_norm"]
    assert untimed(logged[2:]) == untimed(runs.every[6:])  # a window of one step is that step
    assert [(step, m) for step, m in runs.tracked] == [(m["step"], m) for m in logged]
    lines = [line for line in runs.console.splitlines() if line.startswith("step ")]
    assert [line.split("|")[0] for line in lines] == [
        "step    3/7 ",
        "step    6/7 ",
        "step    7/7 ",
    ]
    assert f"loss {logged[1]['loss']:+.4f}" in lines[1]
    assert untimed(runs.logged("every")) == untimed(runs.every)  # logging_steps=1: every step


def test_a_resumed_run_logs_the_windows_an_uninterrupted_one_does(runs):
    """Stopped at step 4 (its last: logged), resumed to 7: metrics.jsonl is rewritten from the
    history as a 7-step run logs it, the window 4-6 whole."""
    assert untimed(runs.resumed) == untimed(runs.third)
    logged = runs.logged("resumed")
    assert [m["step"] for m in logged] == [3, 6, 7]
    assert untimed(logged) == untimed(runs.logged("third"))


def test_the_windows_of_a_history():
    """logging_first_step logs step 1 alone; an evaluation at a step that logs none is a record of
    its own; eval_on_start's record stays; a value missing or None in some steps is the mean of
    the others (None when none has one); grad_norm, learning_rate, epoch, num_tokens are the
    logging step's."""

    def step(s, **more):
        m = {"step": s, "loss": float(s), "grad_norm": 10.0 * s, "learning_rate": 0.1 * s}
        return {**m, "epoch": s / 4, "num_tokens": 100.0 * s, "reward": float(s), **more}

    history = [
        {"step": 0, "eval/reward": 0.5},
        step(1),
        step(2, **{"eval/reward": 0.25}),
        step(3, reward=None, user=1.0),
        step(4, reward=None),
        step(5, reward=None),
    ]
    cfg = SimpleNamespace(logging_steps=4, max_steps=5, logging_first_step=True)
    records = report.logged_records(history, cfg)
    assert records == [
        {"step": 0, "eval/reward": 0.5},
        step(1),
        {"step": 2, "eval/reward": 0.25},
        {
            "step": 4,
            "loss": 3.0,
            "grad_norm": 40.0,
            "learning_rate": 0.4,
            "epoch": 1.0,
            "num_tokens": 400.0,
            "reward": 2.0,
            "user": 1.0,
        },
        step(5, reward=None),
    ]
    one = SimpleNamespace(logging_steps=1, max_steps=5, logging_first_step=False)
    assert report.logged_records(history, one) == history
