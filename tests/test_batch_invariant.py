"""The batch-invariant mode (nanogrpo/fast/batch_invariant.py, TrainConfig.batch_invariant): its
operations equal the plain ones within rounding, a row's bits never depend on its batch, and the
sampler's log-prob of every drawn token equals the trainer's recomputation bit for bit: every
family, fp32 and bf16 autocast, with and without LoRA, in a training run (the importance ratio
exactly 1) and under FSDP2 with two processes."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import FAMILIES, QWEN3_5, fixture_path, real_folder, tiny_config
from hypothesis import given, settings, strategies as st

from nanogrpo.checkpoint import load_model
from nanogrpo.extras import lora
from nanogrpo.fast import batch_invariant as bi
from nanogrpo.logprobs import token_logprobs
from nanogrpo.model import Transformer
from nanogrpo.rollout import join_prompt_completion
from nanogrpo.run.config import ConfigError, TrainConfig
from nanogrpo.sampler import Sampling, generate

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 30)), [40]]


@settings(max_examples=30, deadline=None)
@given(M=st.integers(1, 40), K=st.sampled_from([8, 32, 96]), N=st.sampled_from([8, 64, 97]))
def test_linear_rows_do_not_depend_on_the_batch(M, K, N):
    g = torch.Generator().manual_seed(M * 1000 + K + N)
    x = torch.randn(300, K, generator=g)
    w, b = torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    full = bi.linear(x, w, b)  # [300,N]
    assert torch.equal(bi.linear(x[:M], w, b), full[:M])
    assert torch.equal(bi.linear(x[M : M + 1], w, b), full[M : M + 1])
    torch.testing.assert_close(full, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(bi.linear(x[:M], w, b), bi.linear(x, w, b)[:M])


@pytest.mark.parametrize("N", [2, 4, 8])  # LoRA's A at ranks 2 to 8
def test_few_output_rows_do_not_depend_on_the_batch_under_bf16(N):
    """A bf16 product with 2 to 8 outputs took another kernel on an AMD EPYC with AVX512-BF16, one
    whose rows round by the batch's size: 1 to 4 elements in 80,000 differed between a 1,024-row
    call and its 16-row blocks (a LoRA run's sampled log-prob then missed the trainer's by 2e-6)."""
    g = torch.Generator().manual_seed(N)
    for _ in range(20):
        x, w = torch.randn(1024, 32, generator=g), torch.randn(N, 32, generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            full = bi.linear(x, w)  # [1024,N]
            blocks = torch.cat([bi.linear(x[i : i + 16], w) for i in range(0, 1024, 16)])
        assert torch.equal(blocks, full)


def masks(B, T, S, g):
    """A causal mask with left padding, as model.attention_mask_for builds: [B,1,T,S] bool."""
    pads = torch.randint(0, S - T + 1, (B,), generator=g)
    k_slot, q_slot = torch.arange(S)[None, :], torch.arange(S - T, S)[:, None]
    valid = torch.arange(S)[None, :] >= pads[:, None]  # [B,S]
    return ((valid[:, None, :] & (k_slot <= q_slot)) | (k_slot == q_slot))[:, None]


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 3), H=st.integers(1, 3), S=st.integers(2, 150), D=st.sampled_from([8, 16]))
def test_attention_equals_sdpa_and_a_decode_step_equals_the_full_forward(B, H, S, D):
    g = torch.Generator().manual_seed(B * 7 + H * 131 + S * 17 + D)
    q, k, v = (torch.randn(B, H, S, D, generator=g) for _ in range(3))
    mask = masks(B, S, S, g)
    full = bi.attention(q, k, v, attn_mask=mask, scale=0.3)  # [B,H,S,D]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
    torch.testing.assert_close(full, want, rtol=1e-5, atol=1e-5)
    additive = torch.where(mask, 0.0, -math.inf)
    assert torch.equal(bi.attention(q, k, v, attn_mask=additive, scale=0.3), full)
    for t in {0, S // 2, S - 1}:  # query t against the keys up to it, as a decode step sees them
        step = bi.attention(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1],
                            attn_mask=mask[:, :, t : t + 1, : t + 1], scale=0.3)  # fmt: skip
        assert torch.equal(step, full[:, :, t : t + 1])
    causal = bi.attention(q, k, v, is_causal=True)
    torch.testing.assert_close(
        causal, F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=1e-5, atol=1e-5
    )


def sampled_and_scored(model, bf16, temperature=0.9, rows=None, **settings):
    """(the sampler's log-probs, the trainer's) of PROMPTS x 3 samples in the mode."""
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    with torch.no_grad(), bi.BatchInvariant(autocast):
        how = Sampling(
            max_new_tokens=24, temperature=temperature, sample_token=bi.sample_next_token,
            decoder=bi.InvariantDecoder, **settings,
        )  # fmt: skip
        out = generate(model, PROMPTS, how, num_samples=3, seeds=[1, 2, 3, 4])
        ids, mask = join_prompt_completion(PROMPTS, out.completion_ids, 0, 3)
        rows = rows or slice(None)  # the trainer scores a micro-batch of the rows
        logps, _ = token_logprobs(
            model, ids[rows], mask[rows], out.completion_mask[rows], temperature=temperature
        )
    return out.logprobs[rows], logps


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("adapters", [False, True], ids=["", "lora"])
def test_the_sampler_is_the_trainer_bit_for_bit(family, bf16, adapters):
    model = load_model(fixture_path(family)).eval()
    if adapters:
        lora.apply_lora(model, r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
        for name, p in model.named_parameters():
            if "lora_B" in name:  # PEFT starts B at 0: make the adapters count
                torch.nn.init.normal_(p, std=0.1)
    sampled, scored = sampled_and_scored(model, bf16, rows=slice(2, 9))
    assert torch.equal(sampled, scored)
    assert sampled.abs().sum() > 0


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_qwen3_5_with_odd_head_counts_bit_for_bit(bf16):
    """Qwen3.5's linear attention at shapes where its gates' pointwise loops end in a scalar tail
    (6 value heads): without `pointwise`, fp32 rows differed by ~5e-7 on an AMD EPYC."""
    config = tiny_config(**{**QWEN3_5, "hidden_size": 48, "linear_num_key_heads": 3,
                            "linear_num_value_heads": 6, "linear_key_head_dim": 12,
                            "linear_value_head_dim": 10})  # fmt: skip
    model = Transformer(config).eval()
    for rows in (slice(None), slice(0, 1)):
        sampled, scored = sampled_and_scored(model, bf16, rows=rows)
        assert torch.equal(sampled, scored)


FUNCS = [torch.sigmoid, torch.exp, F.softplus, F.silu]


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 300), cut=st.integers(1, 40), f=st.sampled_from(FUNCS),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))  # fmt: skip
def test_pointwise_bits_do_not_depend_on_the_tensor_length(n, cut, f, dtype):
    x = (torch.randn(n) * 4).to(dtype)
    whole = bi.pointwise(f, x)
    assert torch.equal(torch.cat([bi.pointwise(f, part) for part in x.split(cut)]), whole)
    torch.testing.assert_close(whole, f(x), rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=0)


@settings(max_examples=30, deadline=None)
@given(B=st.integers(1, 6), T=st.integers(1, 20), D=st.sampled_from([8, 12, 128]),
       dim=st.sampled_from([-1, -2]), keepdim=st.booleans())  # fmt: skip
def test_a_sum_does_not_depend_on_the_layout(B, T, D, dim, keepdim):
    """reduce_sum of a strided view (a slice of a transposed tensor, as Qwen3.5's keys are) equals
    that of the same values laid out contiguously, bit for bit, and torch.sum within rounding."""
    x = torch.randn(B, D, T)
    strided, contiguous = x.transpose(1, 2), x.transpose(1, 2).contiguous()  # [B,T,D]
    out = bi.reduce_sum(strided, dim, keepdim=keepdim)
    assert torch.equal(out, bi.reduce_sum(contiguous, dim, keepdim=keepdim))
    torch.testing.assert_close(out, contiguous.sum(dim, keepdim=keepdim))
    one = bi.reduce_sum(strided[:1], dim, keepdim=keepdim)  # a row alone: the same bits
    assert torch.equal(one, out[:1])


def test_a_filtered_draw_reports_the_filtered_log_prob():
    """With top-k on, the drawn token's log-prob is that of the filtered distribution it was
    drawn from (TRL's processed log-probs), computed as the trainer computes log-probs."""
    model = Transformer(tiny_config()).eval()
    sampled, scored = sampled_and_scored(model, False, top_k=5)
    on = sampled != 0
    assert (sampled[on] >= scored[on]).all() and (sampled[on] > scored[on]).any()


def test_real_smollm2_bf16_bit_for_bit():
    model = load_model(real_folder("smollm2-135m-instruct")).eval()
    sampled, scored = sampled_and_scored(model, True)
    assert torch.equal(sampled, scored)


def test_a_run_has_no_sampler_mismatch(tmp_path):
    """train.py with batch_invariant=true: the logged mismatch is exactly 0 at every step and the
    importance ratio exactly 1, in fp32 and in bf16 autocast."""
    from test_train import tiny

    import train

    for bf16 in (False, True):
        args = ("--batch_invariant=true", f"--bf16={bf16}", "--max_completion_length=12")
        history = train.train(tiny(tmp_path / f"bf16-{bf16}", *args))
        steps = [m for m in history if "sampling/sampling_logp_difference/max" in m]
        assert len(steps) == 3
        for m in steps:
            assert m["sampling/sampling_logp_difference/max"] == 0.0
            for kind in ("token", "sequence"):
                for stat in ("min", "max"):
                    assert m[f"sampling/raw_importance_sampling_ratio/{kind}/{stat}"] == 1.0


def test_the_mode_names_what_it_cannot_do():
    with pytest.raises(ConfigError, match="tool rounds re-lay"):
        TrainConfig(batch_invariant=True, tools=["math:sqrt"]).validate(1)
    with pytest.raises(ConfigError, match="decodes eagerly"):
        TrainConfig(batch_invariant=True, torch_compile=True).validate(1)


def test_two_processes_fsdp2_bf16_have_no_sampler_mismatch(tmp_path):
    """torchrun with 2 processes: FSDP2 shards the policy and computes in bf16 (its mixed
    precision); each rank's sampler still agrees with the trainer bit for bit."""
    from test_dist import torchrun

    out = tmp_path / "run"
    args = ("--max_steps=2", "--batch_invariant=true", "--bf16=true", "--eval_strategy=no")
    done = torchrun(*args, f"--output_dir={out}", "--save_steps=0")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 process(es)" in done.stdout
    lines = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        assert m["sampling/sampling_logp_difference/max"] == 0.0
        assert m["sampling/raw_importance_sampling_ratio/token/max"] == 1.0


def test_the_bench_measures_both_arms_on_the_same_draws(tmp_path):
    """bench/bench_batch_invariant.py on a random tiny model: a JSON line per dtype and arm, the
    invariant arm's mismatch exactly 0, the table with its speed ratios."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    from nanogrpo.checkpoint import save_model

    save_model(Transformer(tiny_config(vocab_size=300)), tmp_path / "m")
    cmd = [sys.executable, os.path.join(ROOT, "bench", "bench_batch_invariant.py"),
           f"--model={tmp_path / 'm'}", "--new=6", "--repeats=1", "--prompts=2", "--generations=3"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [(r["dtype"], r["arm"]) for r in rows] == [
        (d, a) for d in ("fp32", "bf16") for a in ("default", "plain", "invariant")
    ]
    assert all(r["mismatch_max"] == 0.0 for r in rows if r["arm"] == "invariant")
    assert "| bf16 | invariant | 0.00e+00 | 0.00e+00 |" in done.stdout
