"""model.py: parity with transformers' logits, the KV cache, gradient checkpointing, RoPE placement."""

import json
import os

import pytest
import torch
from conftest import FAMILIES, fixture_path, tiny_config
from safetensors.torch import load_file

from nanogrpo.checkpoint import load_model
from nanogrpo.checkpoint.hf_format import config_from_hf
from nanogrpo.model import Transformer


def _rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family):
    path = fixture_path(family)
    model = load_model(path)
    expected = load_file(os.path.join(path, "expected.safetensors"))
    with torch.no_grad():
        logits = model(expected["input_ids"])
        padded = model(expected["input_ids"], attention_mask=expected["attention_mask"])
    assert logits.shape == expected["logits"].shape
    assert _rel_err(logits, expected["logits"]) < 1e-4
    real = expected["attention_mask"].bool()  # left-padded row: compare real positions only
    assert _rel_err(padded[real], expected["padded_logits"][real]) < 1e-4
    assert torch.isfinite(padded).all()


def test_family_features_are_read():
    assert config_from_hf(json.load(open(fixture_path("qwen2") + "/config.json"))).attention_bias
    qwen3 = load_model(fixture_path("qwen3"))
    assert (
        qwen3.config.head_dim == 16 != qwen3.config.hidden_size // qwen3.config.num_attention_heads
    )
    assert hasattr(qwen3.layers[0].self_attn, "q_norm")
    llama = load_model(fixture_path("llama3"))
    assert llama.config.rope_scaling["rope_type"] == "llama3"
    assert llama.lm_head.weight.data_ptr() != llama.embed_tokens.weight.data_ptr()
    qwen2 = load_model(fixture_path("qwen2"))
    assert qwen2.lm_head.weight is qwen2.embed_tokens.weight


@pytest.mark.parametrize("family", ["qwen2", "llama3", "qwen3"])
def test_kv_cache_matches_uncached_forward(family):
    model = load_model(fixture_path(family))
    ids = torch.randint(0, 300, (3, 10))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(3, 16)
        steps = [model(ids[:, :4], cache=cache, cache_start=0)]  # prefill 4, then decode one by one
        for t in range(4, 10):
            steps.append(model(ids[:, t : t + 1], cache=cache, cache_start=t))
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-4)


def test_left_padded_batch_equals_each_row_alone():
    model = Transformer(tiny_config())
    a, b = torch.randint(0, 97, (7,)), torch.randint(0, 97, (4,))
    ids = torch.stack([a, torch.cat([torch.zeros(3, dtype=torch.long), b])])
    mask = torch.tensor([[1] * 7, [0] * 3 + [1] * 4])
    with torch.no_grad():
        batched = model(ids, attention_mask=mask)
        assert torch.allclose(batched[0], model(a[None])[0], atol=1e-5)
        assert torch.allclose(batched[1, 3:], model(b[None])[0], atol=1e-5)
        assert torch.isfinite(batched).all()  # pad queries see only themselves: no NaN


def test_gradient_checkpointing_same_gradients():
    model = Transformer(tiny_config())
    ids = torch.randint(0, 97, (2, 9))
    grads = []
    for flag in (False, True):
        model.zero_grad()
        model.gradient_checkpointing = flag
        model(ids).logsumexp(-1).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for g0, g1 in zip(*grads):
        assert torch.allclose(g0, g1, atol=1e-6)


def test_rope_table_moves_to_the_input_device_once():
    """inv_freq follows the model to its device on the first forward and stays there (it used to be
    copied from the CPU on every forward: one host-to-device copy per decode step on a GPU)."""
    with torch.device("meta"):
        model = Transformer(tiny_config())
    ids = torch.zeros(2, 5, dtype=torch.long, device="meta")
    model(ids)
    table = model.inv_freq
    assert table.device.type == "meta"
    model(ids)
    assert model.inv_freq is table
