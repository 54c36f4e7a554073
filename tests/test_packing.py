"""fast/packing.py: a micro-batch packed into one row scores what the padded rows score (logprobs.py's
token_logprobs and policy_logprobs), log-probs, entropies and their gradients, in float64 to 1e-12
and float32 to 1e-5, over random prompt and completion lengths; a 5-step run with padding_free=true
stays close to the padded run; what cannot pack is refused in one line."""

import pytest
import torch
import torch.multiprocessing as mp
from conftest import GEMMA3, QWEN3_5, tiny_config
from hypothesis import given, settings, strategies as st
from test_dist import free_port, one_step
from test_train import tiny

import nanogrpo.models  # noqa: F401 (registers Gemma 3 and Qwen3.5)
import train
from nanogrpo import logprobs
from nanogrpo.extras.lora import apply_lora
from nanogrpo.fast import logprobs as fast_logprobs, packing
from nanogrpo.model import Transformer, sdpa
from nanogrpo.run.config import ConfigError
from nanogrpo.run.configurator import load_config

V = 97
FAMILIES = {
    "qwen2": {},
    "smollm3": {"model_type": "smollm3", "no_rope_layers": [1, 0]},
    "gemma3": GEMMA3,  # sliding layers with a window of 3: shorter than most sequences here
    "qwen3_5": QWEN3_5,  # Gated DeltaNet layers: a state from zero at each sequence
}
MODELS = {}


def model_of(family, dtype=torch.float64):
    if (family, dtype) not in MODELS:
        torch.manual_seed(0)
        MODELS[family, dtype] = Transformer(tiny_config(vocab_size=V, **FAMILIES[family])).to(dtype)
    return MODELS[family, dtype]


def batch(prompt_lens, completion_lens, holes=(), seed=0, same=()):
    """Left-padded prompts, right-padded completions (attention 1 over the whole completion, as
    rollout.join_prompt_completion lays it), completion_mask 1 on each completion's tokens but the
    (row, column) pairs of `holes` (tool results); each (row, earlier row) of `same`: the row's
    prompt is the earlier row's (a group; give them one length): ids, attention_mask [n, P+C],
    completion_mask [n,C]."""
    g = torch.Generator().manual_seed(seed)
    n, P, C = len(prompt_lens), max(prompt_lens), max(max(completion_lens), 1)
    ids = torch.randint(1, V, (n, P + C), generator=g)
    for row, earlier in same:
        ids[row, :P] = ids[earlier, :P]
    prompt = torch.arange(P)[None] >= P - torch.tensor(prompt_lens)[:, None]
    attention = torch.cat([prompt, torch.ones(n, C, dtype=torch.bool)], 1).long()
    ids = torch.where(attention.bool(), ids, 0)
    mask = (torch.arange(C)[None] < torch.tensor(completion_lens)[:, None]).float()
    for row, col in holes:
        mask[row, col] = 0.0
    return ids, attention, mask


def grads(model, logps, entropies, seed=1):
    """Every parameter's gradient of a random combination of the log-probs and entropies."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(logps.shape, generator=g, dtype=logps.dtype)
    u = torch.randn(logps.shape, generator=g, dtype=logps.dtype)
    total = (w * logps).sum() + (u * entropies).sum()
    return torch.autograd.grad(total, list(model.parameters()))


def assert_same(model, padded, packed, atol, rtol=0.0, shared=None):
    """packed's values equal padded's; their gradients equal padded's, or shared's where given:
    the padded rows scored with each prompt's forward once (fast/logprobs.py), as packed runs it.
    (A model's RMSNorm runs in float32 whatever its dtype, as transformers' does, so a float64
    model's gradients round to float32 where a prompt's gradient is summed over its rows before
    the norm's backward rather than after: 1e-6 relative.)"""
    for a, b in zip(padded, packed):  # log-probs, entropies
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(b, a, atol=atol, rtol=rtol)
    for a, b in zip(grads(model, *(shared or padded)), grads(model, *packed)):
        torch.testing.assert_close(b, a, atol=atol, rtol=max(rtol, 1e-9))


rows = st.lists(
    st.tuples(st.integers(1, 7), st.integers(0, 9)),  # (prompt length, completion length)
    min_size=1,
    max_size=5,
)


@st.composite
def groups(draw):
    """rows of (prompt length, completion length), and `same` pairs: some rows repeat an earlier
    row's prompt (a group), in any order."""
    drawn = draw(rows)
    same = []
    for i in range(1, len(drawn)):
        earlier = draw(st.integers(-1, i - 1))  # -1: a prompt of its own
        if earlier >= 0:
            drawn[i] = (drawn[earlier][0], drawn[i][1])
            same.append((i, earlier))
    return drawn, same


@pytest.mark.parametrize("family", list(FAMILIES))
@settings(max_examples=15, deadline=None)
@given(drawn=groups(), temperature=st.sampled_from([1.0, 0.7]), seed=st.integers(0, 99))
def test_packed_equals_padded_in_float64(family, drawn, temperature, seed):
    rows, same = drawn
    prompt_lens, completion_lens = zip(*rows)
    holes = [(0, 1)] if completion_lens[0] > 2 else []  # a masked token inside a completion
    ids, att, mask = batch(prompt_lens, completion_lens, holes, seed, same)
    model = model_of(family)
    padded = logprobs.token_logprobs(model, ids, att, mask, temperature)
    packed = packing.token_logprobs(model, ids, att, mask, temperature, entropy_grad=True)
    shared = fast_logprobs.token_logprobs(model, ids, att, mask, temperature, entropy_grad=True)
    assert_same(model, padded, packed, atol=1e-12, shared=shared if same else None)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_equals_padded_in_float32(family):
    ids, att, mask = batch([5, 1, 7, 3], [9, 0, 4, 1], holes=[(0, 2)])
    model = model_of(family, torch.float32)
    padded = logprobs.token_logprobs(model, ids, att, mask)
    packed = packing.token_logprobs(model, ids, att, mask, entropy_grad=True)
    assert_same(model, padded, packed, atol=1e-5, rtol=1e-5)


def test_one_row_and_vocab_size():
    ids, att, mask = batch([4], [6])
    model = model_of("qwen2")
    padded = logprobs.token_logprobs(model, ids, att, mask, vocab_size=90)
    packed = packing.token_logprobs(model, ids, att, mask, vocab_size=90, entropy_grad=True)
    assert_same(model, padded, packed, atol=1e-12)


def test_nothing_scored_still_ties_every_parameter_to_the_graph():
    ids, att, mask = batch([3, 2], [0, 0])
    model = model_of("qwen2")
    logps, entropies = packing.token_logprobs(model, ids, att, mask)
    assert torch.equal(logps, torch.zeros_like(logps)) and logps.shape == mask.shape
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads(model, logps, entropies))


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_policy_logprobs_equal_the_course_ones(beta):
    """The update's kernel: rows without advantage scored under no_grad (beta = 0) as fast/logprobs.py
    does, each call packed; the log-gradient equals the course's for an advantage-weighted loss."""
    ids, att, mask = batch([5, 2, 6, 3], [7, 3, 0, 8], holes=[(0, 4)])
    advantages = torch.tensor([0.5, 0.0, -1.0, 0.0], dtype=torch.float64)
    model = model_of("qwen3_5")
    how = dict(beta=beta, entropy_bonus=False)
    padded = logprobs.policy_logprobs(model, ids, att, mask, advantages, **how)
    packed = packing.policy_logprobs(model, ids, att, mask, advantages, **how)
    for a, b in zip(padded, packed):
        torch.testing.assert_close(b, a, atol=1e-12, rtol=0)
    loss = lambda lp: -(advantages[:, None] * lp).sum()  # noqa: E731
    params = list(model.parameters())
    for a, b in zip(
        torch.autograd.grad(loss(padded[0]), params), torch.autograd.grad(loss(packed[0]), params)
    ):
        torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-9)


def test_gradient_checkpointing_and_lora():
    torch.manual_seed(0)
    model = apply_lora(Transformer(tiny_config(vocab_size=V)).double(), r=4, lora_dropout=0.0)
    model.gradient_checkpointing = True
    model.train()
    ids, att, mask = batch([5, 1, 7], [9, 2, 5])
    padded = logprobs.token_logprobs(model, ids, att, mask)
    packed = packing.token_logprobs(model, ids, att, mask, entropy_grad=True)
    trained = [p for p in model.parameters() if p.requires_grad]
    assert trained and len(trained) < len(list(model.parameters()))
    for a, b in zip(padded, packed):
        torch.testing.assert_close(b, a, atol=1e-12, rtol=0)
    g = torch.randn(mask.shape, dtype=torch.float64)
    for a, b in zip(
        torch.autograd.grad((g * padded[0]).sum(), trained),
        torch.autograd.grad((g * packed[0]).sum(), trained),
    ):
        torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-9)


def test_the_row_holds_only_real_tokens_up_to_the_last_scored_one():
    ids, att, mask = batch([3, 1], [4, 2])  # row 1's completion is padded by 2
    mask[0, 3] = 0.0  # row 0's last token not scored: not run either
    packed_ids, positions, row, where, at = packing.pack(model_of("qwen2"), ids, att, mask)
    # row 0: 3 prompt + 2 completion tokens (the 3rd predicts the last scored one); row 1: 1 + 1;
    # each completion's segment sees its prompt's
    assert row.segments == [(0, 3, 0, 0), (3, 5, 0, 3), (5, 6, 5, 5), (6, 7, 5, 6)]
    assert positions.tolist() == [[0, 1, 2, 3, 4, 0, 1]]
    assert packed_ids[0, :5].tolist() == ids[0, :5].tolist()
    assert packed_ids[0, 5:].tolist() == ids[1, 2:4].tolist()
    assert at.tolist() == [2, 3, 4, 5, 6]


def test_a_group_runs_its_prompt_once():
    """Rows 0 and 2 share a prompt: it is in the row once, before both completions, whose first
    tokens are both predicted by its last slot; row 1 (its own prompt) comes after them."""
    ids, att, mask = batch([2, 3, 2], [3, 1, 2], same=[(2, 0)])
    packed_ids, positions, row, where, at = packing.pack(model_of("qwen2"), ids, att, mask)
    # prompt 0 (0,2); row 0's completion (2,4); row 2's (4,5); prompt 1 (5,8); row 1's (8,8)
    assert row.segments == [(0, 2, 0, 0), (2, 4, 0, 2), (4, 5, 0, 2), (5, 8, 5, 5), (8, 8, 5, 8)]
    assert positions.tolist() == [[0, 1, 2, 3, 2, 0, 1, 2]]
    P = ids.shape[1] - mask.shape[1]
    assert packed_ids[0].tolist() == [
        *ids[0, P - 2 : P + 2].tolist(),
        *ids[2, P : P + 1].tolist(),
        *ids[1, P - 3 : P].tolist(),
    ]
    assert at.tolist() == [1, 2, 3, 7, 1, 4]  # row 0's 3 tokens, row 1's, row 2's 2


def whole_row(self, q, k, v, mask, scale, layer, start):
    """A broken attend: one causal attention over the whole row."""
    return sdpa(q, k, v, None, scale)


@pytest.mark.parametrize(
    "family, broken",
    [("qwen2", ("PackedRow.attend", whole_row)), ("gemma3", ("window_mask", lambda *a: None))],
)
def test_a_broken_mask_fails_the_comparison(monkeypatch, family, broken):
    """The tests above can fail: sequences that see the ones before them in the row, or Gemma 3's
    sliding layers without their window, are caught."""
    name, replacement = broken
    owner = packing.PackedRow if name.startswith("PackedRow.") else packing
    monkeypatch.setattr(owner, name.removeprefix("PackedRow."), replacement)
    ids, att, mask = batch([5, 2, 6], [7, 3, 4])
    model = model_of(family)
    padded = logprobs.token_logprobs(model, ids, att, mask)
    packed = packing.token_logprobs(model, ids, att, mask)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(packed[0], padded[0], atol=1e-6, rtol=0)


# -----------------------------------------------------------------------------
# Refusals, the kernels train.py picks


def test_padding_holes_are_refused():
    ids, att, mask = batch([3, 2], [4, 4])
    att[1, -3] = 0  # a padding slot before a scored token
    with pytest.raises(ValueError, match="follows a padding slot"):
        packing.token_logprobs(model_of("qwen2"), ids, att, mask)


def test_train_picks_the_packed_kernels_and_refuses_batch_invariant():
    for plain in ("true", "false"):
        cfg = load_config(["--config", "tiny.py", "--padding_free=true", f"--plain={plain}"])
        k = train.kernels(cfg)
        assert k.policy_logprobs is packing.policy_logprobs
        assert k.token_logprobs is packing.token_logprobs
    with pytest.raises(ConfigError, match="padding_free=True: batch_invariant=true"):
        load_config(["--config", "tiny.py", "--padding_free=true", "--batch_invariant=true"])


def test_two_processes_packed_match_one(tmp_path):
    """FSDP2: an optimizer step packed on 2 ranks (rows without advantage in their own no_grad
    call) equals it packed on one to 1e-5, and padded on one to 1e-4 (AdamW's first step is about
    lr x sign(gradient): a rounding difference in a near-zero gradient entry moves its weight)."""
    results = {}
    for world, packed in ((1, False), (1, True), (2, True)):
        out = tmp_path / f"w{world}-{packed}.pt"
        mp.start_processes(
            one_step,
            args=(world, free_port(), "gemma3", str(out), None, False, packed),
            nprocs=world,
            start_method="spawn",
            join=True,
        )
        results[world, packed] = torch.load(out)
    two, one, padded = results[2, True], results[1, True], results[1, False]
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    assert two["grad_norm"] == pytest.approx(padded["grad_norm"], rel=1e-5)
    for k, v in two["state"].items():
        torch.testing.assert_close(v, one["state"][k], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, padded["state"][k], atol=1e-4, rtol=1e-4)


# -----------------------------------------------------------------------------
# Training: 5 steps packed against 5 padded

EXACT = ("reward", "reward_std", "num_tokens", "learning_rate")


@pytest.mark.parametrize("budget", [None, 60])
def test_a_packed_run_trains_as_the_padded_one(tmp_path, capsys, budget):
    """The draw does not change, so rewards and token counts are exact; the log-probs differ by
    float32 rounding only (other matmul shapes), so gradient norm, entropy and KL agree to 1e-5
    relative and the loss (a sum of terms of both signs, near 0) to 1e-6 absolute. With a
    token_budget of 60 (the 64-row micro-batches cut into forwards of a few groups) loss and
    gradient norm too (its entropy and KL are means over the forwards, not the micro-batches:
    other numbers)."""
    args = ("--max_steps=5", "--beta=0.04", "--max_completion_length=12")
    padded = train.train(tiny(tmp_path / "padded", *args))
    more = () if budget is None else (f"--token_budget={budget}",)
    packed = train.train(tiny(tmp_path / "packed", *args, "--padding_free=true", *more))
    assert len(padded) == len(packed) == 5
    worst = dict.fromkeys(("loss", "grad_norm", "entropy", "kl"), 0.0)
    for a, b in zip(padded, packed):
        for key in EXACT:
            assert a[key] == b[key], key
        for key in worst if budget is None else ("loss", "grad_norm"):
            worst[key] = max(worst[key], abs(b[key] - a[key]))
            tolerance = dict(abs=1e-6) if key == "loss" else dict(rel=1e-5, abs=1e-7)
            assert b[key] == pytest.approx(a[key], **tolerance), key
    with capsys.disabled():
        print("largest absolute differences, packed - padded:", worst)


# -----------------------------------------------------------------------------
# token_budget: an optimizer step's forwards cut by tokens, the padded step's loss and gradient

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "sapo", "luspo", "cispo", "vespo"]


def rollout(drawn, seed, advantages_seed=0):
    """A Rollout of the (prompt length, completion length) rows and same-prompt pairs drawn,
    with advantages, old log-probs and the step's token count."""
    from nanogrpo.rollout import Rollout

    rows, same = drawn
    prompt_lens, completion_lens = zip(*rows)
    ids, att, mask = batch(prompt_lens, completion_lens, seed=seed, same=same)
    g = torch.Generator().manual_seed(advantages_seed)
    n, C = mask.shape
    return Rollout(
        rows=[],
        num_generations=1,
        prompt_ids=[],
        input_ids=ids,
        attention_mask=att,
        completion_mask=mask,
        completion_lengths=mask.sum(1).long(),
        truncated=torch.zeros(n, dtype=torch.bool),
        prompts=[],
        completions=[],
        completion_token_ids=[],
        advantages=torch.randn(n, generator=g, dtype=torch.float64),
        old_logps=-torch.rand(n, C, generator=g, dtype=torch.float64) * 3,
        num_items=mask.sum(),
    )


class RecordingSGD(torch.optim.SGD):
    """SGD (lr 0) that keeps a copy of the gradients it stepped with."""

    def step(self, closure=None):
        self.grads = [p.grad.clone() for p in self.param_groups[0]["params"]]


def budget_step(model, ro, micro, loss_type, kernels):
    """train.optimizer_step over micro [(ro, rows)] with `kernels`: (its losses' sum, the gradients)."""
    from types import SimpleNamespace

    from nanogrpo.distributed import DistInfo
    from nanogrpo.extras.loss_terms import loss_settings
    from nanogrpo.run.config import TrainConfig

    level = "sequence" if loss_type == "luspo" else "token"  # (LUSPO's is sequence-level)
    how = dict(importance_sampling_level=level, max_completion_length=10)
    loss_cfg, _ = loss_settings(loss_type=loss_type, beta=0.0, **how)
    optimizer = RecordingSGD(model.parameters(), lr=0.0)
    t = SimpleNamespace(
        model=model,
        optimizer=optimizer,
        cfg=TrainConfig(temperature=1.0, max_grad_norm=0.0),
        loss_cfg=loss_cfg,
        loss_terms=None,
        info=DistInfo(),
        autocast=torch.autocast("cpu", enabled=False),
        tok=SimpleNamespace(vocab_size=None),
        sched=SimpleNamespace(steps_per_generation=len(micro)),
        kernels=kernels,
        entropy_coef=0.0,
        last_entropy=float("inf"),
    )
    record = train.optimizer_step(t, micro)
    return float(sum(record["losses"])), optimizer.grads, len(record["micro_batches"])


many_rows = st.lists(st.tuples(st.integers(1, 7), st.integers(0, 9)), min_size=2, max_size=8)


@st.composite
def steps(draw):
    """rows with groups, the step's micro-batch size, a loss type and a budget of at least the
    longest sequence."""
    drawn = draw(groups())
    rows, _ = drawn
    size = draw(st.integers(1, len(rows)))
    longest = max(p + max(c - 1, 0) for p, c in rows)
    budget = draw(st.integers(longest, longest + 25))
    return drawn, size, draw(st.sampled_from(LOSS_TYPES)), budget


@settings(max_examples=40, deadline=None)
@given(step=steps(), seed=st.integers(0, 99), dtype=st.sampled_from([torch.float64, torch.float32]))
def test_token_budget_forwards_give_the_padded_step(step, seed, dtype):
    """An optimizer step whose micro-batches are cut into forwards of at most token_budget packed
    tokens: the losses sum to the padded micro-batches' and the gradient is theirs (every loss
    type: per-sequence means, bnpo's token mean per micro-batch, dr_grpo's and dapo's
    normalisers; gradient accumulation over the micro-batches), to 1e-6 relative, or 1e-5 of the
    gradient's largest value where sums of float32 terms cancel (float64 too: the models'
    RMSNorm rounds to float32, as transformers')."""
    drawn, size, loss_type, budget = step
    ro = rollout(drawn, seed)
    for name in ("advantages", "old_logps"):
        setattr(ro, name, getattr(ro, name).to(dtype))
    n = ro.input_ids.shape[0]
    micro = [(ro, torch.arange(i, min(i + size, n))) for i in range(0, n, size)]
    model = model_of("qwen2", dtype)
    padded = budget_step(model, ro, micro, loss_type, train.Kernels())
    kernels = train.Kernels(**packing.packed_kernels(True, budget))
    packed = budget_step(model, ro, micro, loss_type, kernels)
    scale = max(g.abs().max() for g in padded[1])
    assert packed[0] == pytest.approx(padded[0], rel=1e-6, abs=1e-7)
    for a, b in zip(padded[1], packed[1]):
        torch.testing.assert_close(b, a, atol=1e-5 * float(scale), rtol=1e-6)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_token_budget_cuts_a_micro_batch_and_keeps_its_loss(loss_type):
    """A fixed step, two micro-batches of 4 rows (two groups of 2, lengths uneven), each cut into
    forwards by a budget of 14 tokens: more forwards than micro-batches, the padded step's loss and
    gradient."""
    rows = [(3, 9), (3, 2), (5, 1), (5, 7), (2, 4), (2, 8), (4, 3), (4, 0)]
    drawn = rows, [(1, 0), (3, 2), (5, 4), (7, 6)]
    ro = rollout(drawn, seed=3)
    micro = [(ro, torch.arange(0, 4)), (ro, torch.arange(4, 8))]
    model = model_of("qwen2")
    padded = budget_step(model, ro, micro, loss_type, train.Kernels())
    packed = budget_step(
        model, ro, micro, loss_type, train.Kernels(**packing.packed_kernels(True, 14))
    )
    assert padded[2] == 2 and packed[2] > 2  # forwards
    assert packed[0] == pytest.approx(padded[0], rel=1e-6, abs=1e-9)
    scale = max(g.abs().max() for g in padded[1])
    for a, b in zip(padded[1], packed[1]):
        torch.testing.assert_close(b, a, atol=1e-5 * float(scale), rtol=1e-6)


def test_token_budget_refuses_a_longer_sequence_before_any_forward():
    ro = rollout(([(3, 9), (2, 2)], []), seed=0)
    calls = []
    kernels = packing.packed_kernels(True, 10) | dict(policy_logprobs=lambda *a: calls.append(1))
    kernels = train.Kernels(**kernels)
    with pytest.raises(ValueError, match=r"token_budget=10: one sequence is 11 tokens \(prompt 3 "):
        budget_step(model_of("qwen2"), ro, [(ro, torch.arange(2))], "grpo", kernels)
    assert calls == []


def test_token_budget_settings_and_the_plan():
    with pytest.raises(
        ConfigError, match="token_budget=64: cuts packed forwards: set padding_free"
    ):
        load_config(["--config", "tiny.py", "--token_budget=64"])
    with pytest.raises(ConfigError, match="token_budget=64: top_entropy_quantile < 1 and the"):
        load_config(
            [
                "--config",
                "tiny.py",
                "--padding_free=true",
                "--token_budget=64",
                "--entropy_coef=0.1",
            ]
        )
    from nanogrpo.run.plan import plan

    whole = plan(load_config(["--config", "tiny.py", "--padding_free=true"]), 1)
    cut = plan(load_config(["--config", "tiny.py", "--padding_free=true", "--token_budget=40"]), 1)
    assert whole["update_tokens"] > 40 and cut["update_tokens"] == 40
    assert (
        cut["bytes"]["activations"] * whole["update_tokens"] == whole["bytes"]["activations"] * 40
    )
