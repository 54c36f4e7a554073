"""Learning-rate schedules = transformers' get_scheduler, step for step (fixtures/make_trl_config_fixtures.py)."""

import json
import os

import pytest
import torch

from nanogrpo import schedules

CASES = json.load(open(os.path.join(os.path.dirname(__file__), "fixtures", "trl", "schedules.json")))["cases"]


@pytest.mark.parametrize("case", CASES, ids=[f"{c['kind']}-{c['max_steps']}-{c['warmup']}" for c in CASES])
def test_every_step_runs_at_transformers_rate(case):
    warmup = schedules.warmup_length(case["max_steps"], case["warmup_steps"], case["warmup_ratio"])
    assert warmup == case["warmup"]
    fn = schedules.lr_lambda(case["kind"], warmup, case["max_steps"], case["learning_rate"], case["kwargs"])
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=case["learning_rate"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
    lrs = []
    for _ in range(case["max_steps"]):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx(case["lrs"], rel=1e-12, abs=1e-15)


def test_the_first_warmup_step_runs_at_zero_and_a_ratio_rounds_up():
    assert schedules.warmup_length(10, warmup_ratio=0.15) == 2  # ceil(1.5)
    assert schedules.lr_lambda("linear", 2, 10, 1.0)(0) == 0.0


def test_bad_schedules_are_named():
    with pytest.raises(ValueError, match="lr_scheduler_type='polynomial' is not supported"):
        schedules.lr_lambda("polynomial", 0, 10, 1.0)
    with pytest.raises(ValueError, match="needs exactly one of min_lr or min_lr_rate"):
        schedules.lr_lambda("cosine_with_min_lr", 0, 10, 1.0)
    with pytest.raises(ValueError, match=r"\['num_cycles'\] do not apply to lr_scheduler_type='linear'"):
        schedules.lr_lambda("linear", 0, 10, 1.0, {"num_cycles": 2})
