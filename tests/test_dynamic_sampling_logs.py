"""What is logged per completion under dynamic sampling follows the completions that train: the
columns reward functions logged (log_extra), the tool counts and so tools/*; log_metric is the
mean of every value reported, every draw's call included (TRL logs each call's report)."""

from types import SimpleNamespace

import pytest
import torch
from test_train import DYNAMIC, tiny

import train
from nanogrpo.distributed import DistInfo
from nanogrpo.extras.dynamic_sampling import dynamic_sampling
from nanogrpo.rollout import Rollout
from nanogrpo.run import report

G = 2


def drawn(tag, rewards, calls, failures, turns, P=2, C=3):
    """A batch of len(rewards) / G groups: completion r is f"{tag}{r}"; rewards [n, 1]."""
    n = len(rewards)
    ids = torch.randint(1, 50, (n, P + C), generator=torch.Generator().manual_seed(len(tag)))
    return Rollout(
        rows=[{"prompt": f"{tag}-prompt{g}"} for g in range(n // G)],
        num_generations=G,
        prompt_ids=[ids[g * G, :P].tolist() for g in range(n // G)],
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        completion_mask=torch.ones(n, C),
        completion_lengths=torch.full((n,), C),
        truncated=torch.zeros(n, dtype=torch.bool),
        prompts=[f"{tag}-prompt{r // G}" for r in range(n)],
        completions=[f"{tag}{r}" for r in range(n)],
        completion_token_ids=[ids[r, P:].tolist() for r in range(n)],
        tool_calls=torch.tensor(calls),
        tool_failures=torch.tensor(failures),
        turns=torch.tensor(turns),
    ), torch.tensor(rewards)[:, None]


# batch a: group 0 has no spread, group 1 has; batch b: group 0 has, group 1 has not
A = drawn("a", [1.0, 1.0, 0.0, 1.0], calls=[5, 5, 1, 0], failures=[5, 0, 1, 0], turns=[3, 1, 2, 1])
B = drawn("b", [1.0, 0.0, 0.0, 0.0], calls=[2, 3, 7, 7], failures=[0, 3, 7, 0], turns=[2, 3, 1, 1])


def sample(max_batches):
    """dynamic_sampling over batch a then b, each with the columns its reward functions logged:
    `id` (each completion's own name) in both, `only_b` in b."""
    columns_b = {"id": list(B[0].completions), "only_b": [f"x{r}" for r in range(4)]}
    more = iter([(*B, columns_b)])
    columns_a = {"id": list(A[0].completions)}
    return dynamic_sampling(
        *A,
        columns_a,
        lambda: next(more),
        weights=torch.ones(1),
        max_batches=max_batches,
        pad_id=0,
        info=DistInfo(),
    )


def test_kept_completions_keep_their_columns_and_tool_counts():
    ro, rewards, columns, stats = sample(max_batches=5)
    assert ro.completions == ["a2", "a3", "b0", "b1"]  # a's group 1, b's group 0
    assert rewards[:, 0].tolist() == [0.0, 1.0, 1.0, 0.0]
    assert columns == {"id": ro.completions, "only_b": [None, None, "x0", "x1"]}
    assert ro.tool_calls.tolist() == [1, 0, 2, 3] and ro.tool_failures.tolist() == [1, 0, 0, 3]
    assert stats["dynamic_sampling/gen_batches"] == 2
    # TRL's definitions over the completions that train: 6 calls in 4, 4 of them failed
    assert report.tool_metrics(ro, DistInfo()) == {
        "tools/call_frequency": 1.5,
        "tools/failure_frequency": 4 / 6,
        "tools/mean_turns": 2.0,
    }
    t = SimpleNamespace(
        info=DistInfo(),
        reward_weights=torch.ones(1),
        tools={"f": None},
        cfg=SimpleNamespace(num_generations=G),
        reward_funcs=[("r", None)],
    )
    assert report.generation_metrics(t, ro, rewards)["tools/call_frequency"] == 1.5


def test_at_the_bound_the_filling_group_keeps_its_columns():
    ro, rewards, columns, _ = sample(max_batches=1)
    assert ro.completions == ["a2", "a3", "a0", "a1"]  # the group with spread, then a filler
    assert columns == {"id": ro.completions}
    assert ro.tool_calls.tolist() == [1, 0, 5, 5]


def test_a_run_shows_each_completion_with_what_was_logged_for_it(tmp_path, monkeypatch):
    """End to end: every completion the samples are taken from carries the log_extra value its
    own reward call logged for it, with its own reward; log_metric logs the mean of every
    value reported, one per call, so one per drawn batch."""
    calls = []  # per reward call: (global_step, {id: (completion, reward)})

    def logging_reward(completions, trainer_state, log_metric, log_extra, **kwargs):
        rewards = [float(c.startswith("a")) for c in completions]
        ids = [f"{len(calls)}:{i}" for i in range(len(completions))]
        calls.append((trainer_state.global_step, dict(zip(ids, zip(completions, rewards)))))
        log_metric("my/call", len(calls))
        log_extra("id", ids)
        return rewards

    shown = []
    show = report.shown_samples

    def spy(ro, rewards, weights, k=2, columns=None):
        shown.append((ro, rewards, columns))
        return show(ro, rewards, weights, k, columns)

    monkeypatch.setattr(report, "shown_samples", spy)
    cfg = tiny(tmp_path, *DYNAMIC, "--max_num_gen_batches=20", "--max_steps=2")
    cfg.reward_funcs = [logging_reward]
    history = train.train(cfg)
    assert any(m["dynamic_sampling/gen_batches"] > 1 for m in history)  # some rows were dropped
    logged = {i: row for _, rows in calls for i, row in rows.items()}
    for ro, rewards, columns in shown:
        assert len(columns["id"]) == len(ro.completions)
        for i, completion, reward in zip(columns["id"], ro.completions, rewards[:, 0].tolist()):
            assert logged[i] == (completion, reward)
    for step, m in enumerate(history):
        numbers = [k + 1 for k, (s, _) in enumerate(calls) if s == step]
        assert len(numbers) == m["dynamic_sampling/gen_batches"]
        assert m["my/call"] == pytest.approx(sum(numbers) / len(numbers))
