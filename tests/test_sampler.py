"""sampler.py: cached decoding, batched == alone, parity with transformers' greedy generate, the logit
filters against naive references, stop handling, log-probs, seeds and argument errors; the trainer's
log-probs against the sampler's (their ratio is 1 without filters, the kept mass with top-k)."""

import json
import math
import os
from types import SimpleNamespace

import pytest
import torch
from conftest import FAMILIES, GEMMA3, QWEN3_5, RecordOps, fixture_path, tiny_config
from hypothesis import assume, given, settings, strategies as st

from nanogrpo.checkpoint import load_model
from nanogrpo.fast import sampling as fast_sampling
from nanogrpo.fast.sampling import StaticDecoder, filter_candidates, sample_next_token_fast
from nanogrpo.model import KVCache, Transformer, lm_head_linear
from nanogrpo.sampler import (
    Sampling,
    apply_min_p,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    generate,
    lm_logits,
    sample_from,
    sample_next_token,
    uniforms,
)

TOKENIZER_VOCAB, EOS, PAD = (
    384,
    [2, 0],
    0,
)  # tests/fixtures/tokenizer: 384 real ids, eos {2, 0}, pad 0 == eos
PROMPTS = [
    [5, 17, 99, 2, 31, 8, 200],
    [44],
    [150, 151, 152, 9],
    [7, 7, 7, 7, 7, 7, 7, 7, 7, 300, 12],
]
_models = {}


def load(family="qwen2"):
    if family not in _models:
        _models[family] = load_model(fixture_path(family))
    return _models[family]


def left_pad(seqs, pad=PAD):
    L = max(map(len, seqs))
    ids = torch.tensor([[pad] * (L - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (L - len(s)) + [1] * len(s) for s in seqs], dtype=torch.bool)
    return ids, mask


def filtered(logits, seen, temperature, top_k, top_p, min_p, penalty):
    """The sampler's processing of [B,V] logits, in transformers' order."""
    logits = apply_repetition_penalty(logits, seen, penalty)
    if temperature == 0:
        return logits
    return apply_min_p(
        apply_top_p(apply_top_k(apply_temperature(logits, temperature), top_k), top_p), min_p
    )


# -----------------------------------------------------------------------------
# The KV cache as the sampler drives it: left-padded prompts, per-row positions, decode steps


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_decode_matches_full_forward(family):
    model = load(family)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (7, 2, 5)]
    steps = torch.randint(3, 384, (3, 4), generator=g)  # 4 decode tokens per row
    full_ids, full_mask = left_pad([p + s.tolist() for p, s in zip(prompts, steps)])
    ids, valid = left_pad(prompts)
    L, lens = ids.shape[1], valid.sum(1)
    with torch.no_grad():
        full = model(full_ids, attention_mask=full_mask)  # [3, L+4, V], positions from the mask
        cache = model.new_cache(3, L + 4)
        cached = [
            model(
                ids, attention_mask=valid, positions=(valid.cumsum(1) - 1).clamp(min=0), cache=cache
            )[:, -1]
        ]
        key_valid = torch.cat([valid, torch.ones(3, 4, dtype=torch.bool)], 1)
        for t in range(4):
            cached.append(
                model(
                    steps[:, t : t + 1],
                    attention_mask=key_valid[:, : L + t + 1],
                    positions=(lens + t)[:, None],
                    cache=cache,
                    cache_start=L + t,
                )[:, 0]
            )
    # full_ids are left-padded to L+4, so prompt end and decode steps line up with columns L-1 .. L+3;
    # Qwen3.5's linear-attention layers run a whole sequence chunk by chunk and a decode step by the
    # recurrence, two float32 sums in different orders (2.4e-5 apart at logits of 6 on an Intel Xeon)
    atol = 5e-5 if family == "qwen3_5" else 1e-5
    assert torch.allclose(torch.stack(cached, 1), full[:, L - 1 :], atol=atol, rtol=1e-4)


# -----------------------------------------------------------------------------
# Parity with transformers' greedy generate (tests/fixtures/make_generate_fixtures.py)

EXPECTED = json.load(open(os.path.join(fixture_path("generate_expected.json"))))
NEW = json.load(open(fixture_path("family_generate_expected.json")))  # (make_family_fixtures.py)
assert all(NEW[k] == EXPECTED[k] for k in ("max_new_tokens", "pad_id", "repetition_penalty"))
EXPECTED["families"].update(NEW["families"])


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers(family):
    case, model = EXPECTED["families"][family], load(family)
    for key, penalty in (("greedy", 1.0), ("greedy_penalty", EXPECTED["repetition_penalty"])):
        out = generate_with(
            model,
            case["prompts"],
            num_samples=2,
            max_new_tokens=EXPECTED["max_new_tokens"],
            temperature=0,
            repetition_penalty=penalty,
            stop_ids=case["stop_ids"],
            pad_id=PAD,
        )
        for i, want in enumerate(case[key]):
            for row in (2 * i, 2 * i + 1):
                got = out.completion_ids[row][out.completion_mask[row]].tolist()
                assert got == want, (key, i)
                assert bool(out.truncated[row]) == (want[-1] not in case["stop_ids"])


# -----------------------------------------------------------------------------
# Batched == alone, log-probs == a recomputation, stops, masks


def generate_with(model, prompt_ids, **kwargs):
    """generate, the Sampling fields among `kwargs` as its settings, the rest (num_samples,
    generator, seeds) as they are."""
    call = {k: kwargs.pop(k) for k in ("num_samples", "generator", "seeds") if k in kwargs}
    return generate(model, prompt_ids, Sampling(**kwargs), **call)


def sampling_args(**overrides):
    args = dict(
        num_samples=3,
        max_new_tokens=12,
        temperature=0.8,
        top_k=40,
        top_p=0.9,
        min_p=0.02,
        repetition_penalty=1.3,
        stop_ids=[2, 0, *range(100, 130)],
        pad_id=PAD,
        vocab_size=TOKENIZER_VOCAB,
    )
    args.update(overrides)
    return args


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_batched_equals_each_prompt_alone(temperature):
    model, args = load("llama3"), sampling_args(temperature=temperature)
    seeds = [11, 22, 33, 44]
    out = generate_with(model, PROMPTS, seeds=seeds, **args)
    G = args["num_samples"]
    assert out.completion_mask.sum(1).min() < out.completion_mask.shape[1]  # some rows stop early
    for i, p in enumerate(PROMPTS):
        alone = generate_with(model, [p], seeds=[seeds[i]], **args)
        rows = slice(i * G, i * G + G)
        C = alone.completion_ids.shape[1]
        assert torch.equal(out.completion_ids[rows, :C], alone.completion_ids)
        assert not out.completion_mask[rows, C:].any()
        assert torch.allclose(out.logprobs[rows, :C], alone.logprobs, atol=1e-5)
        assert torch.equal(out.truncated[rows], alone.truncated)


@pytest.mark.parametrize("family,temperature", [("qwen2", 0.7), ("qwen3", 0), ("mistral", 1.3)])
def test_logprobs_equal_recomputation(family, temperature):
    """Each sampled token's log-prob is log_softmax of the filtered, tempered logits of an uncached full
    forward at that token; sampled tokens always survived the filters; masked slots hold 0."""
    model, args = load(family), sampling_args(temperature=temperature)
    out = generate_with(model, PROMPTS, seeds=[1, 2, 3, 4], **args)
    N, C = out.completion_ids.shape
    prompts = [p for p in PROMPTS for _ in range(args["num_samples"])]
    ids, mask = left_pad([p + c.tolist() for p, c in zip(prompts, out.completion_ids)])
    mask[:, -C:] &= out.completion_mask
    with torch.no_grad():
        logits = model(ids, attention_mask=mask)[
            :, -C - 1 : -1, :TOKENIZER_VOCAB
        ].float()  # predicts completion tokens
    for t in range(C):
        seen = torch.where(
            mask[:, : ids.shape[1] - C + t], ids[:, : ids.shape[1] - C + t], -1
        )  # prompt + earlier tokens
        z = filtered(
            logits[:, t],
            seen,
            temperature,
            args["top_k"],
            args["top_p"],
            args["min_p"],
            args["repetition_penalty"],
        )
        want = z.log_softmax(-1).gather(-1, out.completion_ids[:, t : t + 1]).squeeze(-1)
        live = out.completion_mask[:, t]
        assert torch.allclose(out.logprobs[live, t], want[live], atol=2e-4)
        assert torch.isfinite(want[live]).all()  # never a filtered-out token
        if temperature == 0:
            assert torch.equal(out.completion_ids[live, t], z[live].argmax(-1))
    assert (out.logprobs[~out.completion_mask] == 0).all() and (out.logprobs <= 0).all()


def test_stops_masks_and_truncation():
    model = load("qwen2")
    stops = [0, 2, *range(40, 120)]  # pad (0) is also a stop id; ~20% of the vocabulary stops a row
    out = generate_with(
        model,
        PROMPTS,
        **sampling_args(
            num_samples=4,
            max_new_tokens=20,
            temperature=1.2,
            stop_ids=stops,
            top_k=0,
            top_p=1.0,
            min_p=0.0,
            repetition_penalty=1.0,
        ),
    )
    ids, mask = out.completion_ids, out.completion_mask
    N, C = ids.shape
    length = mask.sum(1)
    assert torch.equal(mask, torch.arange(C)[None] < length[:, None])  # a prefix per row
    assert length.max() == C <= 20
    is_stop = torch.isin(ids, torch.tensor(stops)) & mask
    for r in range(N):
        n = int(length[r])
        assert is_stop[r].sum() == (
            0 if out.truncated[r] else 1
        )  # exactly one stop, the last real token
        if out.truncated[r]:
            assert n == 20
        else:
            assert is_stop[r, n - 1]
        assert (ids[r, n:] == PAD).all()
    assert out.truncated.any() or C < 20
    assert (~out.truncated).sum() >= N // 2  # the stop ids fire
    assert out.completion_ids.dtype == torch.long and out.logprobs.dtype == torch.float32
    x = torch.ones(
        N, C, requires_grad=True
    )  # outputs are ordinary tensors: they may enter autograd
    torch.where(out.completion_mask, x * out.logprobs, 0).sum().backward()


def test_pad_equal_to_eos_keeps_the_eos_in_the_mask():
    model = load("qwen2")
    free = generate_with(model, PROMPTS, max_new_tokens=8, temperature=0)
    row = free.completion_ids[0].tolist()
    eos = next(
        t for i, t in enumerate(row) if i >= 2 and t not in row[:i]
    )  # first produced at step i
    out = generate_with(model, PROMPTS, max_new_tokens=8, temperature=0, stop_ids=[eos], pad_id=eos)
    n = row.index(eos) + 1
    assert out.completion_mask[0].tolist() == [True] * n + [False] * (
        out.completion_ids.shape[1] - n
    )
    assert (
        out.completion_ids[0, :n].tolist() == row[:n] and (out.completion_ids[0, n:] == eos).all()
    )
    assert not out.truncated[0]


def test_stop_id_inside_prompt_is_irrelevant():
    model = load("qwen2")
    free = generate_with(model, [[9, 8, 7]], max_new_tokens=6, temperature=0)
    first = int(
        free.completion_ids[0, 0]
    )  # make the greedy first token a stop id inside the prompt too
    out = generate_with(
        model, [[first, 9, first, 8, 7]], max_new_tokens=6, temperature=0, stop_ids=[first]
    )
    again = generate_with(model, [[first, 9, first, 8, 7]], max_new_tokens=6, temperature=0)
    stop_at = (again.completion_ids[0] == first).nonzero()
    want = int(stop_at[0]) + 1 if len(stop_at) else 6
    assert int(out.completion_mask.sum()) == want and bool(out.truncated[0]) == (len(stop_at) == 0)


def test_all_rows_stop_early_gives_narrow_output_and_compacts(monkeypatch):
    model = load("qwen2")
    calls = []
    select = KVCache.select
    monkeypatch.setattr(
        KVCache, "select", lambda self, rows: calls.append(len(rows)) or select(self, rows)
    )
    out = generate_with(
        model,
        PROMPTS,
        **sampling_args(
            num_samples=4,
            max_new_tokens=40,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            min_p=0.0,
            stop_ids=range(0, 200),
        ),
    )
    assert out.completion_ids.shape[1] < 40 and not out.truncated.any()
    assert (
        calls[0] == 16 and len(calls) >= 2 and calls[-1] < 16
    )  # prefill copied to 16 rows, then compacted


def test_padded_vocab_never_sampled():
    model = Transformer(tiny_config(vocab_size=97, tie_word_embeddings=False))
    with torch.no_grad():
        model.lm_head.weight[90:] *= 50  # the padded rows would dominate every distribution
    out = generate_with(
        model, [[1, 2, 3], [4]], num_samples=8, max_new_tokens=10, vocab_size=90, temperature=1.5
    )
    assert out.completion_ids.max() < 90
    greedy = generate_with(model, [[1, 2, 3]], max_new_tokens=10, vocab_size=90, temperature=0)
    assert greedy.completion_ids.max() < 90


def test_seeds_and_generators():
    model, args = load("qwen2"), sampling_args(stop_ids=[], top_k=0, top_p=1.0, min_p=0.0)
    a = generate_with(model, PROMPTS, generator=torch.Generator().manual_seed(5), **args)
    b = generate_with(model, PROMPTS, generator=torch.Generator().manual_seed(5), **args)
    c = generate_with(model, PROMPTS, generator=torch.Generator().manual_seed(6), **args)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logprobs, b.logprobs)
    assert (a.completion_ids != c.completion_ids).float().mean() > 0.5
    torch.manual_seed(3)
    d = generate_with(model, PROMPTS, **args)
    torch.manual_seed(3)
    assert torch.equal(d.completion_ids, generate_with(model, PROMPTS, **args).completion_ids)
    G = args["num_samples"]  # the G samples of one prompt differ from each other
    assert (a.completion_ids[0] != a.completion_ids[1]).any() and (
        a.completion_ids[G] != a.completion_ids[G + 1]
    ).any()


def test_bf16_model():
    model = Transformer(tiny_config()).to(torch.bfloat16)
    out = generate_with(
        model, [[1, 2, 3], [4, 5]], num_samples=2, max_new_tokens=5, seeds=[0, 1], top_p=0.9
    )
    assert out.logprobs.dtype == torch.float32 and torch.isfinite(out.logprobs).all()
    assert out.completion_ids.shape == (4, 5)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"num_samples": 0}, "num_samples"),
        ({"prompt_ids": []}, "prompt_ids"),
        ({"prompt_ids": [[1, 2], []]}, "prompt_ids"),
        ({"prompt_ids": [[1, 400]]}, "prompt_ids"),
        ({"max_new_tokens": 250}, "max_new_tokens"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"vocab_size": -1}, "vocab_size"),
        ({"seeds": [1, 2]}, "seeds"),
    ],
)
def test_invalid_arguments(kwargs, name):
    args = {"prompt_ids": [[1] * 10], "max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=name):
        generate_with(load("qwen2"), args.pop("prompt_ids"), **args)


def test_a_tokenizer_larger_than_the_model_draws_the_models_rows():
    """A tokenizer with ids past the model's rows (Gemma 3 270M's has 262,145 for 262,144): those
    ids are never drawn, as transformers' logits never cover them; the rest is unchanged."""
    model = load("qwen2")  # 400 rows
    args = dict(num_samples=4, max_new_tokens=6, seeds=[3], temperature=1.5)
    wide = generate_with(model, [[1, 2, 3]], vocab_size=401, **args)
    assert torch.equal(
        wide.completion_ids, generate_with(model, [[1, 2, 3]], **args).completion_ids
    )


# -----------------------------------------------------------------------------
# Filters and the sampling draw against naive references

ties = st.sampled_from(
    [-3.0, -1.5, -0.5, 0.0, 0.25, 1.0, 2.0, 4.5]
)  # repeated values make ties likely
values = st.lists(ties | st.floats(-8, 8, width=32), min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(values, st.integers(0, 14))
def test_top_k_keeps_the_k_largest(xs, k):
    out = apply_top_k(torch.tensor([xs]), k)[0].tolist()
    kth = sorted(xs, reverse=True)[min(k, len(xs)) - 1] if k else -math.inf
    assert [o != -math.inf for o in out] == [x >= kth for x in xs]  # ties with the k-th are kept
    if len(set(xs)) == len(xs):
        assert sum(o != -math.inf for o in out) == min(k, len(xs)) if k else len(xs)


@settings(max_examples=150, deadline=None)
@given(values, st.floats(0.01, 1.0))
def test_top_p_keeps_smallest_set_reaching_p(xs, p):
    probs = torch.tensor(xs, dtype=torch.float64).softmax(0).tolist()
    order = sorted(range(len(xs)), key=lambda i: -xs[i])
    mass, cutoff = 0.0, None
    for i in order:  # walk down the ranking until the kept mass reaches p
        assume(abs(mass - p) > 1e-5)
        if mass >= p:
            break
        mass, cutoff = mass + probs[i], xs[i]
    out = apply_top_p(torch.tensor([xs]), p)[0].tolist()
    assert [o != -math.inf for o in out] == [x >= cutoff for x in xs]
    assert sum(probs[i] for i in range(len(xs)) if out[i] != -math.inf) >= min(p, 1.0) - 1e-5


@settings(max_examples=150, deadline=None)
@given(values, st.floats(0.0, 1.0))
def test_min_p(xs, min_p):
    probs = torch.tensor(xs, dtype=torch.float64).softmax(0)
    assume(((probs / probs.max() - min_p).abs() > 1e-5).all())
    out = apply_min_p(torch.tensor([xs]), min_p)[0]
    assert torch.equal(out != -math.inf, probs >= min_p * probs.max())
    assert out.max() == max(xs)


@settings(max_examples=100, deadline=None)
@given(values, st.floats(0.1, 3.0), st.data())
def test_repetition_penalty_and_temperature(xs, penalty, data):
    seen_ids = data.draw(st.lists(st.integers(-1, len(xs) - 1), max_size=6))
    want = [
        (x / penalty if x > 0 else x * penalty) if i in seen_ids else x for i, x in enumerate(xs)
    ]
    logits = torch.tensor([xs])
    by_ids = apply_repetition_penalty(logits, torch.tensor([seen_ids + [-1]]), penalty)[0]
    mask = torch.tensor([[i in seen_ids for i in range(len(xs))]])
    assert torch.allclose(by_ids, torch.tensor(want), atol=1e-6)
    assert torch.equal(apply_repetition_penalty(logits, mask, penalty), by_ids[None])
    t = data.draw(st.floats(0.05, 5.0))
    assert torch.allclose(apply_temperature(logits, t), logits / t)


@settings(max_examples=60, deadline=None)
@given(values, st.integers(0, 5), st.floats(0.05, 1.0))
def test_filtered_tokens_are_never_sampled(xs, k, p):
    logits = apply_top_p(apply_top_k(torch.tensor([xs]), k), p).expand(512, -1)
    u = torch.cat(
        [torch.tensor([0.0, 1 - 2**-52], dtype=torch.float64), uniforms(torch.arange(510), 0)]
    )
    ids, logp = sample_from(logits, u)
    assert torch.isfinite(logits[0, ids]).all()
    assert torch.allclose(
        logp, logits.log_softmax(-1).gather(-1, ids[:, None]).squeeze(-1), atol=1e-5
    )


def test_sampling_frequencies_match_probabilities():
    """The hashed uniforms + inverse CDF draw tokens with the softmax's probabilities (chi-square)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -math.inf, -3.0, 1.5]])
    n = 40_000
    ids, _ = sample_from(logits.expand(n, -1), uniforms(torch.arange(n) * 7919, 3))
    expected = logits.softmax(-1)[0] * n
    counts = torch.bincount(ids, minlength=8).double()
    assert counts[5] == 0
    live = expected > 0
    chi2 = ((counts[live] - expected[live]) ** 2 / expected[live]).sum()
    assert chi2 < 24.3  # 6 degrees of freedom, p = 0.9995
    u = uniforms(torch.arange(n), 0)  # and the uniforms themselves look uniform, step by step
    assert abs(u.mean() - 0.5) < 0.01 and u.min() >= 0 and u.max() < 1
    assert not torch.equal(uniforms(torch.arange(8), 0), uniforms(torch.arange(8), 1))


# -----------------------------------------------------------------------------
# The fast filters (top-k candidates, no vocabulary sort) against the reference filters, bit for bit


@st.composite
def logit_rows(draw):
    """[B,V] logits: peaked to flat, often tied (rounded to a grid), some -inf; V spans the K ladder."""
    B, V = draw(st.integers(1, 4)), draw(st.sampled_from([1, 2, 7, 64, 300, 700, 3000]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    x = torch.randn(B, V, generator=g) * draw(st.sampled_from([0.05, 1.0, 4.0, 20.0]))
    step = draw(st.sampled_from([0.0, 0.25, 2.0]))
    if step:
        x = (x / step).round() * step
    x[torch.rand(B, V, generator=g) < draw(st.sampled_from([0.0, 0.3, 0.99]))] = float("-inf")
    top = x.nan_to_num(neginf=0).max() + draw(st.sampled_from([0.0, 1e-3, 5.0]))
    x[:, draw(st.integers(0, V - 1))] = top  # a finite max per row
    return x


p_values = st.sampled_from([1.0, 0.95, 0.9, 0.5, 1e-6, 1 - 1e-7, 0.999999, 0.3]) | st.floats(
    1e-4, 1.0
)


def spread(logits, vals, ids):
    """filter_candidates' (vals, ids) [B,K] back at their vocabulary ids: [B,V] logits like
    logits, the others -inf (amax: the -inf padding at id 0 never hides a kept token 0)."""
    return torch.full_like(logits, float("-inf")).scatter_reduce_(1, ids, vals, "amax")


@settings(max_examples=200, deadline=None)
@given(
    logit_rows(),
    st.sampled_from([0, 0, 1, 3, 50, 100, 5000]),
    p_values,
    st.sampled_from([0.0, 0.0, 0.01, 0.5, 1.0]),
)
def test_fast_filters_equal_the_reference(logits, top_k, top_p, min_p):
    want = apply_min_p(apply_top_p(apply_top_k(logits, top_k), top_p), min_p)  # [B,V]
    vals, ids = filter_candidates(logits, top_k, top_p, min_p)
    assert torch.equal(spread(logits, vals, ids), want)
    B = logits.shape[0]
    u = torch.cat(
        [torch.tensor([0.0, 1 - 2**-52], dtype=torch.float64), uniforms(torch.arange(30), 1)]
    )  # [32]
    rows = torch.arange(B).repeat_interleave(len(u))
    tok, logp = sample_next_token_fast(logits[rows], u.repeat(B), 1.0, top_k, top_p, min_p)
    want_tok, want_logp = sample_from(
        want[rows], u.repeat(B)
    )  # the same token for the same uniform
    assert torch.equal(tok, want_tok) and torch.equal(logp, want_logp)
    plain_tok, plain_logp = sample_next_token(logits[rows], u.repeat(B), 1.0, top_k, top_p, min_p)
    assert torch.equal(plain_tok, want_tok) and torch.equal(plain_logp, want_logp)


def test_fast_filters_take_few_candidates_on_a_peaked_row():
    logits = torch.randn(8, 32000) * 6
    vals, ids = filter_candidates(logits, 0, 0.95, 0.0)
    assert vals.shape[1] < 4096 and torch.equal(
        spread(logits, vals, ids), apply_top_p(logits, 0.95)
    )
    assert (
        (ids[:, 1:] > ids[:, :-1]).logical_or(vals[:, 1:] == float("-inf")).all()
    )  # vocabulary order, then padding
    logits[3] = torch.randn(32000) * 0.5  # one flat row: the whole vocabulary, as the reference
    vals, ids = filter_candidates(logits, 0, 0.95, 0.0)
    assert vals.shape[1] == 32000 and torch.equal(vals, apply_top_p(logits, 0.95))


@pytest.mark.parametrize("min_p", [0.0, 0.5])
def test_nucleus_cutoff_sorts_a_handful_of_tokens(monkeypatch, min_p):
    """The radix select: on peaked and flat rows (a nucleus of a few tokens to ~90% of V) the
    cutoff is top_p_cutoff's without calling it, and the tokens left to sort are few."""
    calls, widths = [], []
    monkeypatch.setattr(fast_sampling, "top_p_cutoff", lambda *a: calls.append(1))
    mass_above = fast_sampling.mass_above  # takes the sorted tokens
    monkeypatch.setattr(
        fast_sampling, "mass_above", lambda r, t: widths.append(r.shape[1]) or mass_above(r, t)
    )
    g = torch.Generator().manual_seed(0)
    scale = torch.empty(64, 1).uniform_(0.3, 7.0, generator=g)
    logits = torch.randn(64, 32000, generator=g) * scale
    vals, ids = filter_candidates(logits, 0, 0.95, min_p)
    kept = apply_top_p(logits, 0.95) > float("-inf")
    assert torch.equal(spread(logits, vals, ids), apply_min_p(apply_top_p(logits, 0.95), min_p))
    assert kept.sum(1).min() < 10 and kept.sum(1).max() > 20000  # peaked and flat rows
    assert not calls and max(widths) < 200  # one 17-bit bin's tokens, the widest row's


@pytest.mark.parametrize(
    "scale,top_p,min_p",
    [
        ([6.0, 9.0, 8.0, 10.0, 5.0, 7.0], 0.95, 0.0),  # candidates of each width, joined
        ([6.0, 3.0, 0.4, 6.0, 0.3, 5.0], 0.95, 0.0),  # flat rows: the whole vocabulary
        ([6.0, 3.0, 0.4, 6.0, 0.3, 5.0], 0.9, 0.01),
        ([6.0, 3.0, 0.4, 6.0, 0.3, 5.0], 1 - 1e-7, 0.0),  # rows redone by the sort
    ],
)
def test_nucleus_cutoff_in_blocks_of_rows(scale, top_p, min_p):
    """At a large vocabulary the CPU search runs three rows at a time: blocks of compacted
    candidates (of different widths), blocks that keep the whole vocabulary (flat rows) and
    rows redone by the sort (p near 1) join into the course's result."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 2**17, generator=g) * torch.tensor(scale)[:, None]
    vals, ids = filter_candidates(logits, 0, top_p, min_p)
    assert torch.equal(spread(logits, vals, ids), apply_min_p(apply_top_p(logits, top_p), min_p))


def test_rows_near_the_goal_are_sorted(monkeypatch):
    """Where a deciding mass is within rounding of the goal (here exactly on it: four tied tokens
    at p = 0.5), the row is redone by top_p_cutoff's sort, and only that row."""
    calls = []
    cutoff = fast_sampling.top_p_cutoff
    monkeypatch.setattr(
        fast_sampling, "top_p_cutoff", lambda x, p: calls.append(len(x)) or cutoff(x, p)
    )
    inf = float("inf")
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, -inf], [0.0, 0.1, 0.2, 0.3, -inf]])
    for min_p in (0.0, 0.01):
        vals, ids = filter_candidates(logits, 0, 0.5, min_p)
        want = apply_min_p(apply_top_p(logits, 0.5), min_p)
        assert torch.equal(spread(logits, vals, ids), want)
    assert calls == [1, 1]


# -----------------------------------------------------------------------------
# The static-shape, compiled decode step


@pytest.mark.parametrize("family", [{}, GEMMA3, QWEN3_5])  # (Gemma 3: a sliding window of 3)
def test_compiled_decode_equals_eager_and_never_recompiles(monkeypatch, family):
    """StaticDecoder (the compiled step, made once and passed in): the same completions as eager, and after the first round no recompile, though the
    prompt lengths change. fullgraph=True proves the step has no graph break (no host sync, no Python branch on
    data). The aot_eager backend traces what inductor would compile, in seconds; inductor's own C++ build
    takes minutes on a cold CPU box, so its speed and output are checked by bench/bench_sampler.py --compile."""
    torch._dynamo.reset()
    step = torch.compile(
        fast_sampling._decode_step, backend="aot_eager", dynamic=False, fullgraph=True
    )
    monkeypatch.setattr(fast_sampling, "_COMPILED", {None: step})
    model = Transformer(tiny_config(**family))
    args = dict(
        num_samples=3,
        max_new_tokens=6,
        seeds=[1, 2],
        top_p=0.9,
        temperature=1.3,
        stop_ids=[3, 4, 5],
    )
    for prompts in ([[1, 2, 3], [4, 5]], [[9, 8, 7, 6, 5, 4, 3], [4, 5, 9, 9]]):
        with torch._dynamo.config.patch(error_on_recompile=prompts[0][0] == 9):
            fast = generate_with(model, prompts, decoder=StaticDecoder, **args)
        want = generate_with(model, prompts, **args)
        assert torch.equal(fast.completion_ids, want.completion_ids) and torch.equal(
            fast.truncated, want.truncated
        )
        assert torch.equal(fast.completion_mask, want.completion_mask)
        assert torch.allclose(fast.logprobs, want.logprobs, atol=1e-5)
    assert not want.truncated.all() and want.truncated.any()  # some rows stop, some run on masked


@pytest.mark.parametrize(
    "family", [{}, {"num_key_value_heads": 4}, {"num_key_value_heads": 1}, GEMMA3, QWEN3_5]
)
def test_static_cache_decodes_as_the_kv_cache(family):
    """The compiled step's StaticCache, run eagerly (written at a tensor slot, attending over all
    its slots under the key mask), gives the logits of the course's KVCache up to float64's
    rounding (SDPA adds over more slots, in another order: 2e-16 apart on Gemma 3)."""
    model = Transformer(tiny_config(**family)).double()
    ids, valid = left_pad([[5, 17, 90, 31], [44, 8]])  # [2,L]
    L, C, S = ids.shape[1], 3, 16  # S: the static cache's slots, the slack hidden by the key mask
    steps = torch.tensor([[7, 9, 11], [30, 12, 13]])  # [2,C] one decode token a step
    positions = (valid.cumsum(1) - 1).clamp(min=0)
    slack = torch.zeros(2, S - L - C, dtype=torch.bool)
    key_valid = torch.cat([valid, torch.ones(2, C, dtype=torch.bool), slack], 1)  # [2,S]
    with torch.no_grad():
        cache = model.new_cache(2, L + C)
        model(ids, attention_mask=valid, positions=positions, cache=cache)
        static = fast_sampling._decode_cache(model, cache, torch.arange(2), S)
        assert type(static) is fast_sampling.StaticCache
        for t in range(C):
            tok, pos = steps[:, t : t + 1], positions[:, -1:] + 1 + t
            mask = key_valid[:, : L + t + 1]
            want = model(tok, attention_mask=mask, positions=pos, cache=cache, cache_start=L + t)
            slot = torch.tensor(L + t)
            got = model(
                tok, attention_mask=key_valid, positions=pos, cache=static, cache_start=slot
            )
            assert torch.allclose(got, want, rtol=0, atol=1e-13)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "family",
    [
        {},
        {"num_key_value_heads": 2},
        {"num_key_value_heads": 1, "model_type": "qwen3"},
        GEMMA3,
        QWEN3_5,
    ],
    ids=["mha", "gqa", "mqa-qwen3", "gemma3-sliding", "qwen3_5-linear"],
)
def test_shared_prefix_decoder_equals_the_plain_one(family, dtype):
    """SharedPrefixDecoder (each prompt's keys read once per group): the plain decoder's completions
    and log-probs, with left-padded prompts of different lengths, rows finishing (compaction), one
    sample per prompt, and a repetition penalty; bit-equal log-probs in float64. Gemma 3's sliding
    windows (3 tokens, shorter than the prompts) and Qwen3.5's per-row recurrent states too."""
    from nanogrpo.fast.shared_prefix import SharedPrefixCache, SharedPrefixDecoder

    torch.manual_seed(0)
    model = Transformer(tiny_config(**family)).to(dtype).eval()
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [10, 11, 12]]
    caches = []
    attention = next(b.self_attn for b in model.layers if hasattr(b, "self_attn"))
    attention.register_forward_pre_hook(lambda m, a: caches.append(type(a[4])))
    for G, penalty in ((4, 1.0), (3, 1.3), (1, 1.0)):
        args = dict(
            num_samples=G,
            max_new_tokens=10,
            seeds=[1, 2, 3],
            stop_ids=[3, 17, 30],
            repetition_penalty=penalty,
        )
        shared = generate_with(model, prompts, decoder=SharedPrefixDecoder, **args)
        plain = generate_with(model, prompts, **args)
        assert torch.equal(shared.completion_ids, plain.completion_ids)
        assert torch.equal(shared.completion_mask, plain.completion_mask)
        tol = 0 if dtype == torch.float64 else 1e-5
        torch.testing.assert_close(shared.logprobs, plain.logprobs, rtol=0, atol=tol)
        lengths = plain.completion_mask.sum(1)
        assert lengths.min() < 10 and lengths.max() == 10  # rows finished early: compacted away
    assert SharedPrefixCache in caches


@pytest.mark.parametrize(
    "top_k,top_p,min_p", [(0, 1.0, 0.0), (5, 0.9, 0.0), (0, 0.95, 0.05), (20, 0.8, 0.5)]
)
def test_generate_with_the_fast_draw_equals_the_plain_one(top_k, top_p, min_p):
    """generate_with(sample_token=sample_next_token_fast), what training uses, = the plain sample_next_token."""
    model = load("qwen2")
    args = sampling_args(
        num_samples=3,
        max_new_tokens=12,
        temperature=1.2,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seeds=[11, 12, 13, 14],
    )
    plain = generate_with(model, PROMPTS, **args)
    fast = generate_with(model, PROMPTS, sample_token=sample_next_token_fast, **args)
    assert torch.equal(plain.completion_ids, fast.completion_ids)
    assert torch.equal(plain.logprobs, fast.logprobs) and torch.equal(
        plain.completion_mask, fast.completion_mask
    )


# -----------------------------------------------------------------------------
# The LM head in slices: one batched product, the numbers of a product per slice


def head_model(V, D, dtype=torch.float32, fp32=False):
    """What lm_logits reads of a model: its lm_head and cast_lm_head_to_fp32."""
    torch.manual_seed(0)
    head = torch.nn.Linear(D, V, bias=False).to(dtype)
    return SimpleNamespace(lm_head=head, cast_lm_head_to_fp32=fp32)


def logits_per_slice(model, h, V, chunk):
    """The plain LM head: one product per `chunk`-row slice, joined."""
    W = model.lm_head.weight[:V]
    fp32 = model.cast_lm_head_to_fp32
    parts = [lm_head_linear(h, W[i : i + chunk], fp32).float() for i in range(0, V, chunk)]
    return torch.cat(parts, dim=-1)


@pytest.mark.parametrize(
    "dtype,fp32,autocast",
    [
        (torch.float32, False, False),
        (torch.bfloat16, False, False),
        (torch.bfloat16, True, False),
        (torch.float32, False, True),
        (torch.float32, True, True),
    ],
)
@pytest.mark.parametrize("n,D", [(1, 32), (4, 32), (32, 96)])
def test_lm_logits_equals_a_product_per_slice(dtype, fp32, autocast, n, D):
    """lm_logits multiplies the whole slices in one batched product: the logits of a product per
    slice, with a shorter last slice or none, in bf16, with cast_lm_head_to_fp32 and under bf16
    autocast (as a bf16 rollout runs), and padded rows left out. Bit for bit wherever the product
    is float32 (a float32 batched product runs a product per slice); a bf16 product goes to
    oneDNN, whose batched kernels may block another way on another CPU: there to bf16's
    resolution (its outputs round to 8 bits), though equal bits were seen."""
    model = head_model(5 * 512 + 40, D, dtype, fp32)
    h = torch.randn(n, D).to(dtype)
    bf16_product = not fp32 and (dtype == torch.bfloat16 or autocast)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        for V, chunk in ((5 * 512 + 7, 512), (4 * 512, 512), (300, 512)):
            got = lm_logits(model, h, V, chunk)
            want = logits_per_slice(model, h, V, chunk)
            assert got.dtype == torch.float32 and got.shape == (n, V)
            if bf16_product:
                torch.testing.assert_close(got, want, rtol=2**-7, atol=0)
            else:
                assert torch.equal(got, want)


def test_lm_logits_is_one_product_for_many_slices():
    """A 32-wide model over a 262k vocabulary is 128 slices of 2048 rows: one batched product
    and one for the shorter last slice, not a product (a fork and join of the CPU threads) per
    slice each token."""
    model = head_model(262144, 32)
    h = torch.randn(4, 32)
    with RecordOps() as rec:
        logits = lm_logits(model, h, 262144 - 3, 2048)
    aten = torch.ops.aten
    products = [f for f, _ in rec.ops if f.overloadpacket in (aten.mm, aten.bmm, aten.addmm)]
    assert len(products) <= 2
    assert torch.equal(logits, logits_per_slice(model, h, 262144 - 3, 2048))


# -----------------------------------------------------------------------------
# The trainer's log-probs against the sampler's: the importance ratio between them

# max |trainer - sampler| log-prob of one token on fp32 CPU, no filters: float rounding only.
# Measured worst 9.5e-7 (10 random models x 4 prompts x 4 samples x 24 tokens, both draws).
RATIO_BOUND = 1e-5


def sampled_and_scored(top_k, sample_token, seed=0):
    """A tiny random fp32 model, 4 prompts x 4 samples at temperature 0.7 -> (model, the rows as
    rollout joins them, the Generation, the trainer's log-probs [N,C])."""
    from nanogrpo.fast.logprobs import token_logprobs
    from nanogrpo.rollout import join_prompt_completion

    torch.manual_seed(seed)
    model = Transformer(tiny_config()).eval()
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (5, 12, 1, 8)]
    out = generate_with(
        model,
        prompts,
        num_samples=4,
        max_new_tokens=24,
        temperature=0.7,
        top_k=top_k,
        stop_ids=[2],
        pad_id=0,
        seeds=[1, 2, 3, 4],
        sample_token=sample_token,
    )
    ids, attention = join_prompt_completion(prompts, out.completion_ids, 0, 4)
    with torch.no_grad():
        trainer, _ = token_logprobs(model, ids, attention, out.completion_mask, temperature=0.7)
    return model, ids, attention, out, trainer


@pytest.mark.parametrize("sample_token", [sample_next_token, sample_next_token_fast])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_trainer_over_sampler_ratio_is_one_without_filters(sample_token, seed):
    """The issue's item 3: on fp32 CPU, without filters, exp(trainer - sampler) is 1 to within float
    rounding, per token and per sequence."""
    _, _, _, out, trainer = sampled_and_scored(0, sample_token, seed)
    mask = out.completion_mask
    diff = torch.where(mask, trainer - out.logprobs, 0.0)  # [N,C]
    assert diff.abs().max() <= RATIO_BOUND
    longest = int(mask.sum(1).max())
    assert ((diff.sum(1).exp() - 1).abs() <= RATIO_BOUND * longest).all()  # the sequence ratio


def test_ratio_with_top_k_is_the_kept_mass():
    """With top-k on, the sampler's log-prob is under the renormalized top-k distribution, so
    exp(trainer - sampler) is the probability mass of the k kept tokens: below 1 by design, the
    true importance weight from the sampling distribution to the trainer's."""
    model, ids, attention, out, trainer = sampled_and_scored(3, sample_next_token_fast)
    C, mask = out.completion_ids.shape[1], out.completion_mask
    with torch.no_grad():
        logits = model(ids, attention_mask=attention)[:, -C - 1 : -1].float() / 0.7  # [N,C,V]
    kept = logits.softmax(-1).topk(3, dim=-1).values.sum(-1)  # [N,C] mass of the top 3
    ratio = (trainer - out.logprobs).exp()  # [N,C]
    assert torch.allclose(ratio[mask], kept[mask], atol=1e-5, rtol=0)
    assert (ratio[mask] < 1).all()


def test_compiled_decode_under_bf16_autocast_over_fp32_weights(monkeypatch):
    """One unsharded bf16 training process samples under autocast with fp32 weights: the static
    cache is bf16 (what its keys are computed in; under autocast k leaves RoPE in fp32 and v in
    bf16), the compiled step writes both into it and equals the eager step."""
    torch._dynamo.reset()
    step = torch.compile(
        fast_sampling._decode_step, backend="aot_eager", dynamic=False, fullgraph=True
    )
    monkeypatch.setattr(fast_sampling, "_COMPILED", {None: step})
    model = Transformer(tiny_config())
    args = dict(num_samples=3, max_new_tokens=6, seeds=[1, 2], top_p=0.9, stop_ids=[3])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model.new_cache(1, 4).k[0].dtype == torch.bfloat16
        fast = generate_with(model, [[1, 2, 3], [4, 5]], decoder=StaticDecoder, **args)
        want = generate_with(model, [[1, 2, 3], [4, 5]], **args)
    assert model.new_cache(1, 4).k[0].dtype == torch.float32
    assert torch.equal(fast.completion_ids, want.completion_ids)
    # the static step attends over every slot of its bucket (masked), eager over the filled ones:
    # bf16 attention sums in another order (seen 5e-4 at |logp| ~4.5)
    torch.testing.assert_close(fast.logprobs, want.logprobs, rtol=0, atol=1e-2)
