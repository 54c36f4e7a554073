"""What TRL 1.16 computes around its loss: the entropy bonus and its adaptive control, the
off-policy sequence mask (OPSM) (extras/loss_terms.py), and the importance-sampling correction
between the sampler and the trainer (grpo.py's sampler_correction). Parity in float64 against
vectors that tests/fixtures/make_algo_vectors.py writes from TRL's own code, then properties."""

import json
import math

import pytest
import torch
from conftest import fixture_path
from hypothesis import given, settings, strategies as st

from nanogrpo.extras.loss_terms import (
    applied_entropy_coef,
    entropy_window,
    grpo_step_with_terms,
    loss_settings,
    next_entropy_coef,
    off_policy_mask,
)
from nanogrpo.grpo import LossInputs, LossScale, grpo_step, importance_weights, sampler_correction
from nanogrpo.run.metrics import sampler_metrics

F64 = torch.float64
PROPS = settings(max_examples=25, deadline=None)

with open(fixture_path("algo_vectors.json")) as f:
    VECTORS = json.load(f)
CASES = VECTORS["cases"]
ADAPTIVE = VECTORS["adaptive"]


def t64(rows):
    return None if rows is None else torch.tensor(rows, dtype=F64)


def micro_batch_loss(inputs, settings, scale, sampling_logps, trainer_logps=None, coef=None):
    """What train.py's optimizer_step computes of one micro-batch: the sampler correction's
    weights, then grpo_step, or grpo_step_with_terms when an option is on, and the metrics
    run/metrics.py makes of it. settings: the pair loss_settings returns."""
    cfg, terms = settings
    inputs.weights, compared = sampler_correction(inputs, sampling_logps, cfg, trainer_logps)
    mask = inputs.completion_mask.bool()
    sampling = {} if compared is None else sampler_metrics(*compared, inputs.weights, mask)
    if terms.on():
        how = dict(sampling_logps=sampling_logps, entropy_coef=coef)
        loss, metrics = grpo_step_with_terms(inputs, cfg, terms, scale, **how)
    else:
        loss, metrics = grpo_step(inputs, cfg, scale)
    return loss, {**{k: float(v) for k, v in sampling.items()}, **metrics}


def step(logps, adv, mask, cfg, sampling_logps=None, entropies=None, trainer_logps=None, **scale):
    """One micro-batch on-policy without a reference; cfg: loss_settings' pair; **scale:
    LossScale's fields."""
    inputs = LossInputs(logps=logps, advantages=adv, completion_mask=mask, entropies=entropies)
    return micro_batch_loss(inputs, cfg, LossScale(**scale), sampling_logps, trainer_logps)


def run_case(cfg, inputs, call, entropy_coef=None):
    """grpo_step on a fixture's inputs -> (loss, d/d logp, d/d entropies, metrics)."""
    x = {k: t64(v) for k, v in inputs.items()}
    logp = x["logp"].clone().requires_grad_(True)
    ent = x["ent"].clone().requires_grad_(True)
    call = dict(call)
    inputs = LossInputs(
        logps=logp,
        advantages=x["adv"],
        completion_mask=x["mask"],
        old_logps=x["old"],
        ref_logps=x["ref"],
        entropies=ent,
    )
    scale = LossScale(steps_per_generation=call.pop("spg", None), **call)
    loss, metrics = micro_batch_loss(inputs, cfg, scale, x.get("sampling"), coef=entropy_coef)
    grad, grad_ent = torch.autograd.grad(loss, (logp, ent), allow_unused=True)
    if grad_ent is None:
        grad_ent = torch.zeros_like(ent)
    return loss, grad, grad_ent, metrics


def errors(case, loss, grad, grad_ent):
    return (
        abs(loss.item() - case["loss"]),
        (grad - t64(case["grad"])).abs().max().item(),
        (grad_ent - t64(case["grad_entropy"])).abs().max().item(),
    )


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_matches_trl(case):
    """Loss, gradients (log-probs and entropies) and every metric TRL logs."""
    cfg = loss_settings(**case["cfg"])
    loss, grad, grad_ent, metrics = run_case(cfg, case["inputs"], case["call"])
    assert max(errors(case, loss, grad, grad_ent)) < 1e-9
    expected = dict(case["metrics"])
    # the trainer logs entropy_coef (the coefficient it holds), not grpo_step
    assert expected.pop("entropy_coef", cfg[1].entropy_coef) == cfg[1].entropy_coef
    # beyond TRL 1.16's: the raw sampler/trainer ratios (trl#5231), tested below
    ours = {k for k in metrics if k.startswith("sampling/raw_importance_sampling_ratio/")}
    assert set(metrics) - ours == set(expected)
    for k, v in expected.items():  # TRL takes some metrics in float32
        assert (math.isnan(v) and math.isnan(metrics[k])) or abs(metrics[k] - v) < 1e-6, k


@pytest.mark.parametrize("run", ADAPTIVE, ids=[r["name"] for r in ADAPTIVE])
def test_adaptive_entropy_matches_trl(run):
    """Steps of micro-batches: the coefficient each applies, the window entropy summed over
    micro-batches, and the coefficient after each step are TRL's."""
    cfg = loss_settings(**run["cfg"])
    GA = run["grad_accum"]
    coef = cfg[1].entropy_coef
    last = math.inf
    window = torch.zeros(2, dtype=F64)
    for k, micro in enumerate(run["micro_batches"]):
        applied = applied_entropy_coef(cfg[1], coef, last)
        loss, grad, grad_ent, _ = run_case(cfg, micro["inputs"], {"grad_accum": GA}, applied)
        assert max(errors(micro, loss, grad, grad_ent)) < 1e-9
        window += entropy_window(t64(micro["inputs"]["ent"]), t64(micro["inputs"]["mask"]), cfg[1])
        if k % GA == GA - 1:
            last = (window[0] / window[1].clamp(min=1)).item()
            coef = next_entropy_coef(cfg[1], coef, last)
            window = torch.zeros(2, dtype=F64)
            assert coef == pytest.approx(micro["entropy_coef"], abs=1e-15)
            assert last == pytest.approx(micro["last_world_entropy"], rel=1e-12)


def test_parity_worst_errors(capsys):
    """One line per group of vectors: the worst error against TRL (printed with -s)."""
    worst = {}
    for case in CASES:
        cfg = loss_settings(**case["cfg"])
        loss, grad, grad_ent, _ = run_case(cfg, case["inputs"], case["call"])
        group = case["name"].split("/")[0]
        seen = worst.get(group, (0, 0.0, 0.0, 0.0))
        err = errors(case, loss, grad, grad_ent)
        worst[group] = (seen[0] + 1, *(max(a, b) for a, b in zip(seen[1:], err)))
    with capsys.disabled():
        for group, (n, dl, dg, de) in sorted(worst.items()):
            print(
                f"\n{group:8s} {n:3d} cases vs TRL: loss {dl:.1e}, d/dlogp {dg:.1e}, "
                f"d/dentropy {de:.1e}",
                end="",
            )
    assert max(max(v[1:]) for v in worst.values()) < 1e-9
    assert sum(v[0] for v in worst.values()) == len(CASES)


# -----------------------------------------------------------------------------
# Validation


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(vllm_importance_sampling_mode="token"), "vllm_importance_sampling_mode"),
        (dict(vllm_importance_sampling_clip_min=3.0), "vllm_importance_sampling_clip_min"),
        (
            dict(
                vllm_importance_sampling_mode="token_truncate",
                vllm_importance_sampling_clip_max=None,
            ),
            "vllm_importance_sampling_clip_max",
        ),
        (dict(off_policy_mask_threshold=-0.1), "off_policy_mask_threshold"),
        (dict(entropy_coef_min=0.5, entropy_coef_max=0.1), "entropy_coef_min"),
        (dict(entropy_coef_delta=-0.01), "entropy_coef_delta"),
    ],
)
def test_loss_settings_reject(kw, field):
    with pytest.raises(ValueError, match=f"Loss(Config|Terms).{field}=.*allowed"):
        loss_settings(**kw)


def test_truncate_without_bounds_is_fine_when_the_correction_is_off():
    loss_settings(
        vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_max=None,
        vllm_importance_sampling_correction=False,
    )


def test_vespo_refuses_a_sequence_level_correction():
    cfg = loss_settings(loss_type="vespo")  # default mode: sequence_mask
    x = torch.zeros(2, 3, dtype=F64)
    with pytest.raises(ValueError, match="token_truncate or token_mask"):
        step(x, torch.ones(2, dtype=F64), torch.ones(2, 3), cfg, sampling_logps=x)


def test_entropy_bonus_needs_entropies():
    with pytest.raises(ValueError, match="need entropies"):
        step(torch.zeros(2, 3), torch.ones(2), torch.ones(2, 3), loss_settings(entropy_coef=0.1))


# -----------------------------------------------------------------------------
# Properties


def random_batch(seed, n, c, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    logp = -3 * torch.rand(n, c, generator=g, dtype=F64)
    sampling = logp + scale * torch.randn(n, c, generator=g, dtype=F64)
    lengths = torch.randint(0, c + 1, (n,), generator=g)
    mask = torch.arange(c)[None] < lengths[:, None]
    adv = torch.randn(n, generator=g, dtype=F64)
    ent = 2 * torch.rand(n, c, generator=g, dtype=F64)
    return logp, sampling, mask, adv, ent


@PROPS
@given(
    seed=st.integers(0, 10**6),
    n=st.integers(1, 6),
    c=st.integers(1, 6),
    mode=st.sampled_from(["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]),
)
def test_agreeing_engines_change_nothing(seed, n, c, mode):
    """Sampler log-probs equal to the trainer's: every weight is 1, so loss and gradient are
    those without the correction, in every mode."""
    logp, _, mask, adv, _ = random_batch(seed, n, c)
    plain = loss_settings(vllm_importance_sampling_correction=False)
    corrected = loss_settings(vllm_importance_sampling_mode=mode)
    results = []
    for cfg, sampling in ((plain, None), (corrected, logp.clone())):
        x = logp.clone().requires_grad_(True)
        loss, _ = step(x, adv, mask, cfg, sampling_logps=sampling)
        results.append((loss, torch.autograd.grad(loss, x)[0]))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


@PROPS
@given(
    seed=st.integers(0, 10**6),
    n=st.integers(1, 6),
    c=st.integers(1, 6),
    mode=st.sampled_from(["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]),
)
def test_trainer_logps_stand_for_the_trainer_in_the_correction(seed, n, c, mode):
    """With trainer_logps equal to the sampler's, the weights are 1 whatever the update's own
    log-probs (noisy with dropout): loss and gradient are those without the correction."""
    logp, sampling, mask, adv, _ = random_batch(seed, n, c)
    plain = loss_settings(vllm_importance_sampling_correction=False)
    corrected = loss_settings(vllm_importance_sampling_mode=mode)
    results = []
    for cfg, trainer in ((plain, None), (corrected, sampling)):
        x = logp.clone().requires_grad_(True)
        loss, metrics = step(x, adv, mask, cfg, sampling_logps=sampling, trainer_logps=trainer)
        results.append((loss, torch.autograd.grad(loss, x)[0]))
    if mask.any():  # (no token: the metrics report 0)
        assert metrics["sampling/importance_sampling_ratio/min"] == 1.0
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


@PROPS
@given(
    seed=st.integers(0, 10**6),
    n=st.integers(1, 6),
    c=st.integers(1, 6),
    low=st.sampled_from([None, 0.5, 0.9]),
    high=st.sampled_from([None, 1.1, 3.0]),
)
def test_importance_weights_respect_their_bounds(seed, n, c, low, high):
    """truncate: every weight in [low, high]; mask: a weight is its ratio or 0, and 0 exactly
    where the ratio leaves [low, high]; masked positions weigh 1 at token level."""
    logp, sampling, mask, _, _ = random_batch(seed, n, c, scale=1.0)
    for level in ("token", "sequence"):
        for how in ("truncate", "mask"):
            if how == "truncate" and low is None and high is None:
                continue
            cfg = loss_settings(
                vllm_importance_sampling_mode=f"{level}_{how}",
                vllm_importance_sampling_clip_min=low,
                vllm_importance_sampling_clip_max=high,
            )
            w = importance_weights(logp, sampling, mask, cfg[0])
            diff = torch.where(mask, logp - sampling, 0)
            if level == "sequence":
                diff = diff.sum(-1, keepdim=True)
            ratio = diff.exp()
            lo = -math.inf if low is None else low
            hi = math.inf if high is None else high
            if how == "truncate":
                assert ((w >= lo) & (w <= hi)).all()
                assert torch.equal(w, ratio.clamp(min=low, max=high))
            else:
                outside = (ratio < lo) | (ratio > hi)
                assert torch.equal(w, torch.where(outside, 0.0, ratio))
            if level == "token":
                assert (w[~mask] == 1).all() or (hi < 1 and how == "mask")


@PROPS
@given(
    seed=st.integers(0, 10**6),
    n=st.integers(1, 8),
    c=st.integers(1, 6),
    threshold=st.floats(0.0, 1.0),
)
def test_opsm_keeps_every_non_negative_advantage(seed, n, c, threshold):
    """A sequence with A >= 0 is always kept; one with A < 0 is dropped exactly when its mean
    KL from the sampler exceeds the threshold; the sequences dropped get no gradient."""
    logp, sampling, mask, adv, _ = random_batch(seed, n, c, scale=1.0)
    keep = off_policy_mask(adv[:, None], logp, sampling, mask, threshold)[:, 0]
    assert keep[adv >= 0].all()
    kl = torch.where(mask, sampling - logp, 0).sum(-1) / mask.sum(-1).clamp(min=1)
    assert torch.equal(keep[adv < 0], (kl <= threshold)[adv < 0])
    cfg = loss_settings(
        off_policy_mask_threshold=threshold, vllm_importance_sampling_correction=False
    )
    x = logp.clone().requires_grad_(True)
    loss, _ = step(x, adv, mask, cfg, sampling_logps=sampling)
    (grad,) = torch.autograd.grad(loss, x)
    assert (grad[~keep] == 0).all()


@PROPS
@given(
    seed=st.integers(0, 10**6),
    n=st.integers(1, 6),
    c=st.integers(1, 6),
    coef=st.floats(-1.0, 1.0).filter(lambda v: v != 0),
    accum=st.integers(1, 4),
)
def test_entropy_gradient_is_minus_coef_over_tokens(seed, n, c, coef, accum):
    """d loss / d entropy = -coef / (active tokens x grad_accum) on every active token, 0
    elsewhere, whatever the loss type; the policy gradient is unchanged by the bonus."""
    logp, _, mask, adv, ent = random_batch(seed, n, c)
    grads = []
    for cfg in (loss_settings(), loss_settings(entropy_coef=coef)):
        x = logp.clone().requires_grad_(True)
        e = ent.clone().requires_grad_(True)
        loss, _ = step(x, adv, mask, cfg, entropies=e, grad_accum=accum)
        grads.append(torch.autograd.grad(loss, (x, e), allow_unused=True))
    assert torch.equal(grads[0][0], grads[1][0])
    tokens = max(int(mask.sum()), 1)
    expected = torch.where(mask, torch.tensor(-coef / tokens / accum, dtype=F64), 0.0)
    assert torch.allclose(grads[1][1], expected, rtol=1e-12, atol=1e-15)


@PROPS
@given(
    seed=st.integers(0, 10**6),
    n=st.integers(1, 6),
    c=st.integers(1, 6),
    quantile=st.sampled_from([1.0, 0.5, 0.2]),
)
def test_entropy_window_covers_the_tokens_the_bonus_acts_on(seed, n, c, quantile):
    """entropy_window = [sum, count] over exactly the tokens whose entropy the bonus pulls on
    (all active ones, or the top-quantile ones); masked positions may hold NaN."""
    logp, _, mask, adv, ent = random_batch(seed, n, c)
    ent = torch.where(mask, ent, math.nan)
    cfg = loss_settings(entropy_coef=0.1, top_entropy_quantile=quantile)
    e = ent.clone().requires_grad_(True)
    loss, _ = step(logp.clone().requires_grad_(True), adv, mask, cfg, entropies=e)
    (grad_ent,) = torch.autograd.grad(loss, e)
    bonus = grad_ent != 0
    window = entropy_window(ent, mask, cfg[1])
    assert window.dtype == F64 and window.shape == (2,)
    assert window[1].item() == bonus.sum().item()
    assert window[0].item() == pytest.approx(ent[bonus].sum().item(), rel=1e-12, abs=1e-12)


@PROPS
@given(coef=st.floats(0.0, 1.0), entropy=st.floats(0.0, 5.0), steps=st.integers(1, 30))
def test_adaptive_coefficient_stays_in_bounds(coef, entropy, steps):
    """The coefficient moves one delta a step, toward the target's side, within its bounds."""
    cfg = loss_settings(
        use_adaptive_entropy=True,
        entropy_coef_min=0.1,
        entropy_coef_max=0.4,
        entropy_coef_delta=0.05,
        entropy_target=1.0,
    )
    c = min(max(coef, 0.1), 0.4)
    for _ in range(steps):
        new = next_entropy_coef(cfg[1], c, entropy)
        assert 0.1 <= new <= 0.4
        assert abs(new - c) <= 0.05 + 1e-12
        assert (new >= c) == (entropy <= 1.0) or new == c
        c = new
    assert applied_entropy_coef(cfg[1], c, entropy) == (c if entropy <= 1.0 else 0.0)
    assert applied_entropy_coef(cfg[1], c, math.inf) == 0.0


# --- the raw sampler/trainer ratio (trl#5231): before any clip or mask, correction on or off ------


@PROPS
@given(
    seed=st.integers(0, 2**16),
    correcting=st.booleans(),
    mode=st.sampled_from(["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]),
)
def test_raw_sampler_ratios_are_the_unclipped_ratios(seed, correcting, mode):
    """sampling/raw_importance_sampling_ratio/{token,sequence}/{min,mean,max} are exp(log pi_trainer
    - log pi_sampler) over the completion's tokens and exp(its sum) over rows with tokens, whether
    or not the correction is on and whatever it clips or masks; the corrected weights
    (importance_sampling_ratio) stay within the clip where the raw ones do not."""
    g = torch.Generator().manual_seed(seed)
    N, C = 5, 7
    logps = -torch.rand(N, C, generator=g, dtype=F64) * 3
    sampling = logps + torch.randn(N, C, generator=g, dtype=F64) * 0.8  # a large mismatch
    mask = torch.rand(N, C, generator=g) < 0.7
    mask[0] = False  # a row without tokens: not a sequence
    mask[1, 0] = True
    cfg = loss_settings(
        vllm_importance_sampling_correction=correcting,
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=0.5,
        vllm_importance_sampling_clip_max=2.0,
    )
    adv = torch.randn(N, generator=g, dtype=F64)
    _, metrics = step(logps, adv, mask.double(), cfg, sampling_logps=sampling)
    token = (logps - sampling)[mask].exp()
    sequence = torch.where(mask, logps - sampling, 0).sum(-1)[mask.any(-1)].exp()
    for level, want in (("token", token), ("sequence", sequence)):
        key = f"sampling/raw_importance_sampling_ratio/{level}"
        assert metrics[f"{key}/min"] == pytest.approx(want.min().item(), rel=1e-12)
        assert metrics[f"{key}/mean"] == pytest.approx(want.mean().item(), rel=1e-12)
        assert metrics[f"{key}/max"] == pytest.approx(want.max().item(), rel=1e-12)
    assert ("sampling/importance_sampling_ratio/max" in metrics) == correcting
    if correcting:  # the weights the loss uses are clipped or masked; the raw ones are not
        assert metrics["sampling/importance_sampling_ratio/max"] <= 2.0
        raw = token if mode.startswith("token") else sequence
        assert raw.max().item() > 2.0 or raw.min().item() < 0.5  # the case tests a clip


def test_raw_sampler_ratios_with_nothing_to_measure_are_one():
    cfg = loss_settings(vllm_importance_sampling_correction=False)
    zeros = torch.zeros(2, 3, dtype=F64)
    _, metrics = step(zeros, torch.ones(2, dtype=F64), zeros, cfg, sampling_logps=zeros - 1)
    raw = {k: v for k, v in metrics.items() if "raw_importance" in k}
    assert len(raw) == 6 and set(raw.values()) == {1.0}
