"""run/report.py: the completions table, TRL's `epoch` in every step record, the end-of-run
summary."""

import json
import math
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
