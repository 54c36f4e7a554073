"""model.py: parity with transformers' logits, the KV cache, gradient checkpointing, RoPE placement."""

import json
import os

import pytest
import torch
from conftest import FAMILIES, GEMMA3, NEW_FAMILIES, fixture_path, tiny_config
from safetensors.torch import load_file

from nanogrpo.checkpoint import load_model, save_model
from nanogrpo.checkpoint.hf_format import config_from_hf, config_to_hf
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


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_our_save_gives_transformers_logits(family, tmp_path):
    """What we save loads back to transformers' logits (make_family_fixtures.py checks that
    transformers itself loads our save to the same logits)."""
    save_model(load_model(fixture_path(family)), tmp_path / "saved")
    saved = json.load(open(tmp_path / "saved" / "config.json"))
    original = json.load(open(os.path.join(fixture_path(family), "config.json")))
    for key in ("model_type", "architectures", "rope_parameters", "layer_types", "no_rope_layers"):
        assert saved.get(key) == original.get(key), key
    model = load_model(tmp_path / "saved")
    expected = load_file(os.path.join(fixture_path(family), "expected.safetensors"))
    mask = expected["attention_mask"]
    with torch.no_grad():
        assert _rel_err(model(expected["input_ids"]), expected["logits"]) < 1e-4
        padded = model(expected["input_ids"], attention_mask=mask)
    assert _rel_err(padded[mask.bool()], expected["padded_logits"][mask.bool()]) < 1e-4


def test_smollm3_nope_layers():
    """no_rope_layers[i] == 0 turns RoPE off in layer i (1 = RoPE, as transformers reads it); without
    the key, a NoPE layer every no_rope_layer_interval layers, as SmolLM3Config makes it."""
    model = load_model(fixture_path("smollm3"))
    assert model.rope_layers == [True, False, True, True]
    assert model.lm_head.weight is model.embed_tokens.weight
    hf = json.load(open(fixture_path("smollm3") + "/config.json"))
    del hf["no_rope_layers"]
    assert config_from_hf(dict(hf, no_rope_layer_interval=2)).no_rope_layers == [1, 0, 1, 0]
    del hf["rope_parameters"], hf["tie_word_embeddings"]
    cfg = config_from_hf(hf)  # SmolLM3Config's defaults
    assert cfg.no_rope_layers == [1, 1, 1, 0] and cfg.rope_theta == 2e6 and cfg.tie_word_embeddings
    with pytest.raises(ValueError, match="no_rope_layers has 1 entries for 2 layers"):
        tiny_config(model_type="smollm3", no_rope_layers=[1])
    ids = torch.randint(0, 97, (2, 9))
    nope = Transformer(tiny_config(model_type="smollm3", no_rope_layers=[0, 0]))
    with torch.no_grad():  # larger-than-init weights, so that attention is far from uniform
        for p in nope.parameters():
            p.normal_(0, 0.3)
    rope = Transformer(tiny_config(model_type="smollm3", no_rope_layers=[1, 1]))
    rope.load_state_dict(nope.state_dict())
    with torch.no_grad():
        assert not torch.allclose(nope(ids), rope(ids), atol=1e-3)
        # no positions at all: a causal prefix's logits do not depend on where it starts
        shifted = nope(ids, positions=torch.arange(5, 14).expand(2, 9))
        assert torch.allclose(nope(ids), shifted, atol=1e-5)


def test_gemma3_config_and_layers():
    """Gemma 3's config.json in transformers 5's layout (rope_parameters per layer type) and the
    classic one (rope_theta, rope_local_base_freq, rope_scaling, no layer_types), each written
    back in its own layout; the embedding scale is rounded to the embedding's dtype."""
    from nanogrpo.models.gemma3 import Gemma3Embedding

    hf = json.load(open(fixture_path("gemma3") + "/config.json"))
    cfg = config_from_hf(hf)
    assert cfg.layer_types[2] == "full_attention" and cfg.sliding_window == 4
    assert (cfg.rope_theta, cfg.rope_local_base_freq) == (10000.0, 100.0)
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.query_pre_attn_scalar == 24 and cfg.head_dim == 16 and cfg.tie_word_embeddings
    assert config_to_hf(cfg)["rope_parameters"] == hf["rope_parameters"]
    model = load_model(fixture_path("gemma3"))
    assert model.sliding == [True, True, False, True] and model.rope_layers == [True] * 4
    legacy = {k: v for k, v in hf.items() if k not in ("rope_parameters", "layer_types")}
    legacy.update(rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=2)
    legacy["rope_scaling"] = {"rope_type": "linear", "factor": 8.0}
    cfg = config_from_hf(legacy)
    assert cfg.layer_types == ["sliding_attention", "full_attention"] * 2
    assert (cfg.rope_theta, cfg.rope_local_base_freq, cfg.rope_scaling["factor"]) == (1e6, 1e4, 8)
    out = config_to_hf(cfg)
    assert "rope_parameters" not in out and out["rope_local_base_freq"] == 1e4
    assert config_from_hf(out) == cfg
    embedding = Gemma3Embedding(4, 3072).to(torch.bfloat16)  # sqrt(3072) = 55.43 -> 55.5
    ids = torch.tensor([1])
    assert torch.equal(embedding(ids), embedding.weight[1:2] * 55.5)


def test_gemma3_sliding_window_counts_real_tokens():
    """A sliding layer sees the last sliding_window real tokens: a left-padded row equals its
    unpadded self, with prompts longer than the window, and a far-away token changes nothing in a
    model whose layers all slide (with one layer, nothing beyond the window reaches a query)."""
    model = Transformer(tiny_config(**GEMMA3)).eval()
    a, b = torch.randint(0, 97, (9,)), torch.randint(0, 97, (5,))
    ids = torch.stack([a, torch.cat([torch.zeros(4, dtype=torch.long), b])])
    mask = torch.tensor([[1] * 9, [0] * 4 + [1] * 5])
    with torch.no_grad():
        batched = model(ids, attention_mask=mask)
        assert torch.allclose(batched[0], model(a[None])[0], atol=1e-5)
        assert torch.allclose(batched[1, 4:], model(b[None])[0], atol=1e-5)
    one = Transformer(tiny_config(**dict(GEMMA3, num_hidden_layers=1, layer_types=None)))
    assert one.sliding == [True]  # (Gemma3TextConfig's default: a global layer every 6th)
    changed = a.clone()
    changed[0] = (a[0] + 1) % 97
    with torch.no_grad():
        near, far = one(a[None])[0], one(changed[None])[0]
    assert torch.allclose(near[3:], far[3:]) and not torch.allclose(near[:3], far[:3])


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


@pytest.mark.parametrize("family", ["qwen2", "llama3", "qwen3", "gemma3"])
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


def test_family_layers_not_registered_is_a_clear_error():
    """Gemma 3's and Qwen3.5's layers live in nanogrpo/models/, which registers them in
    model.FAMILIES when imported (the checkpoint loader imports it): a config of such a family built
    before that names the fix instead of building a Llama-style model silently."""
    import subprocess
    import sys

    code = (
        "from nanogrpo.model import ModelConfig\n"
        "try:\n    ModelConfig(model_type='gemma3_text')\nexcept ValueError as e:\n    print(e)\n"
        "import nanogrpo.models\n"
        "print(ModelConfig(model_type='gemma3_text').sliding_window)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    first, second = out.stdout.strip().splitlines()
    assert "import nanogrpo.models" in first and "gemma3_text" in first
    assert second == "4096"
