"""Qwen3.5: the Gated DeltaNet rule's two forms, its cache, and Qwen3.5 checkpoints.

The logits, round trip, greedy decoding, LoRA and training against transformers run with the other
families (test_model, test_checkpoint, test_sampler, test_lora, test_train, test_dist); fixtures by
tests/fixtures/make_family_fixtures.py.
"""

import json
import os

import pytest
import torch
from conftest import QWEN3_5, fixture_path, tiny_config
from hypothesis import given, settings, strategies as st
from safetensors.torch import load_file

from nanogrpo.checkpoint import load_model, save_model
from nanogrpo.checkpoint.hf_format import config_from_hf
from nanogrpo.model import Transformer
from nanogrpo.models.gated_deltanet import chunked_delta_rule, l2_normalize, recurrent_delta_rule


def rule_inputs(B, T, H, Dk, Dv, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(B, T, H, Dk, generator=g, dtype=dtype)) * Dk**-0.5
    k = l2_normalize(torch.randn(B, T, H, Dk, generator=g, dtype=dtype))
    v = torch.randn(B, T, H, Dv, generator=g, dtype=dtype)
    decay = -torch.rand(B, T, H, generator=g, dtype=dtype) * 2  # g in (-2, 0]
    beta = torch.rand(B, T, H, generator=g, dtype=dtype)
    state = torch.randn(B, H, Dk, Dv, generator=g, dtype=dtype)
    return q, k, v, decay, beta, state


@settings(max_examples=40, deadline=None)
@given(
    T=st.integers(1, 40),
    chunk=st.sampled_from([1, 3, 8, 16, 64]),
    H=st.integers(1, 3),
    Dk=st.integers(1, 6),
    Dv=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_chunked_rule_equals_the_recurrence(T, chunk, H, Dk, Dv, seed):
    """Any length (a multiple of the chunk or not), any chunk, from any state: the same outputs
    and final state as one token at a time, in float64."""
    q, k, v, g, beta, state = rule_inputs(2, T, H, Dk, Dv, seed)
    out, end = recurrent_delta_rule(q, k, v, g, beta, state)
    out_c, end_c = chunked_delta_rule(q, k, v, g, beta, state, chunk=chunk)
    assert out_c.shape == out.shape and end_c.shape == end.shape
    torch.testing.assert_close(out_c, out, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(end_c, end, rtol=1e-9, atol=1e-9)


def test_chunked_rule_gradients_equal_the_recurrence():
    inputs = [x.requires_grad_() for x in rule_inputs(2, 21, 2, 4, 3, seed=5)]
    weights = torch.randn(2, 21, 2, 3, dtype=torch.float64)
    grads = []
    for rule in (recurrent_delta_rule, lambda *a: chunked_delta_rule(*a, chunk=8)):
        out, end = rule(*inputs)
        grads.append(torch.autograd.grad((out * weights).sum() + end.sum(), inputs))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_the_rule_is_what_its_docstring_says():
    """One token from a zero state: S = beta k v^T, out = S^T q = beta (q.k) v."""
    q, k, v, g, beta, state = rule_inputs(1, 1, 1, 3, 2, seed=1)
    out, end = recurrent_delta_rule(q, k, v, g, beta, torch.zeros_like(state))
    torch.testing.assert_close(end[0, 0], beta[0, 0, 0] * torch.outer(k[0, 0, 0], v[0, 0, 0]))
    torch.testing.assert_close(out[0, 0, 0], beta[0, 0, 0] * (q[0, 0, 0] @ k[0, 0, 0]) * v[0, 0, 0])


def qwen3_5_model(**overrides):
    torch.manual_seed(0)
    model = Transformer(tiny_config(**QWEN3_5, **overrides)).double().eval()
    with torch.no_grad():  # weights large enough that the layers matter
        for p in model.parameters():
            p.normal_(0, 0.2 if p.dim() > 1 else 1.0)
    return model


def test_the_cache_continues_a_sequence_exactly():
    """Prefill in two pieces, then one token at a time through the cache: the same logits as one
    forward over the whole sequence (the convolution's window and the recurrent state carry)."""
    model = qwen3_5_model()
    ids = torch.randint(0, 97, (3, 20), generator=torch.Generator().manual_seed(0))
    full = model(ids)
    cache = model.new_cache(3, 20)
    parts = [model(ids[:, :7], cache=cache), model(ids[:, 7:12], cache=cache, cache_start=7)]
    parts += [model(ids[:, t : t + 1], cache=cache, cache_start=t) for t in range(12, 20)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-9, atol=1e-9)
    assert cache.v[0].dtype == torch.float64 and cache.v[0].shape == (3, 4, 8, 8)  # [B,Hv,Dk,Dv]
    assert cache.k[0].shape == (3, 2 * 2 * 8 + 4 * 8, 3)  # [B, conv_dim, K-1]


def test_left_padding_is_invisible():
    """A left-padded row's logits at its real tokens equal the row alone, longer than a chunk."""
    model = qwen3_5_model()
    ids = torch.randint(0, 97, (2, 70), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 70, dtype=torch.bool)
    mask[1, :9] = False
    padded = model(ids, attention_mask=mask)
    alone = model(ids[1:, 9:])
    torch.testing.assert_close(padded[1, 9:], alone[0], rtol=1e-9, atol=1e-9)


def test_a_multimodal_checkpoint_loads_its_language_model(tmp_path):
    """qwen3_5 (Qwen3_5ForConditionalGeneration): the language model under
    model.language_model.*, the vision tower left out; transformers' logits; saved as the
    qwen3_5_text model it is, with the same partial RoPE and multimodal sections."""
    path = fixture_path("qwen3_5_vl")
    hf = json.load(open(os.path.join(path, "config.json")))
    assert hf["model_type"] == "qwen3_5" and any(
        k.startswith("model.visual.") for k in load_file(os.path.join(path, "model.safetensors"))
    )
    model = load_model(path).eval()
    expected = load_file(os.path.join(path, "expected.safetensors"))
    with torch.no_grad():
        torch.testing.assert_close(
            model(expected["input_ids"]), expected["logits"], rtol=0, atol=1e-4
        )
    assert model.config.partial_rotary_factor == 0.5
    save_model(model, tmp_path / "text")
    saved = json.load(open(tmp_path / "text" / "config.json"))
    assert saved["model_type"] == "qwen3_5_text"
    assert saved["architectures"] == ["Qwen3_5ForCausalLM"]
    assert saved["rope_parameters"] == hf["text_config"]["rope_parameters"]
    assert "text_config" not in saved and "vision_config" not in saved
    names = load_file(tmp_path / "text" / "model.safetensors").keys()
    assert not any("visual" in n or "language_model" in n for n in names)
    same = load_model(tmp_path / "text").eval()
    with torch.no_grad():
        torch.testing.assert_close(same(expected["input_ids"]), model(expected["input_ids"]))


def test_qwen3_5_config_json():
    """Qwen3_5TextConfig's defaults for missing keys; what is not implemented is refused."""
    hf = {"model_type": "qwen3_5_text", "num_hidden_layers": 8, "hidden_size": 64}
    cfg = config_from_hf(hf)
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"] + [
        "linear_attention"
    ] * 3 + ["full_attention"]
    assert (cfg.partial_rotary_factor, cfg.head_dim, cfg.linear_num_value_heads) == (0.25, 256, 32)
    old = {**hf, "partial_rotary_factor": 0.5}  # top-level, as older configs wrote it
    assert config_from_hf(old).partial_rotary_factor == 0.5
    with pytest.raises(ValueError, match="attention_bias=true"):
        config_from_hf({**hf, "attention_bias": True})
    with pytest.raises(ValueError, match="'sliding_attention'"):
        config_from_hf({**hf, "layer_types": ["sliding_attention"] * 8})
    with pytest.raises(ValueError, match="must be a multiple of linear_num_key_heads"):
        Transformer(tiny_config(**{**QWEN3_5, "linear_num_value_heads": 3}))
    with pytest.raises(ValueError, match="model_type='qwen3_5_moe' is not supported; supported:"):
        config_from_hf({"model_type": "qwen3_5_moe"})
