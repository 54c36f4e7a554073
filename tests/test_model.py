"""model.py: parity with transformers' logits, KV cache, checkpoint round trips and load errors."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import FAMILIES, fixture_path, tiny_config
from nanogrpo.model import ModelConfig, Transformer


def _rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family):
    path = fixture_path(family)
    model = Transformer.from_pretrained(path)
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
    assert ModelConfig.from_hf(json.load(open(fixture_path("qwen2") + "/config.json"))).attention_bias
    qwen3 = Transformer.from_pretrained(fixture_path("qwen3"))
    assert qwen3.config.head_dim == 16 != qwen3.config.hidden_size // qwen3.config.num_attention_heads
    assert hasattr(qwen3.layers[0].self_attn, "q_norm")
    llama = Transformer.from_pretrained(fixture_path("llama3"))
    assert llama.config.rope_scaling["rope_type"] == "llama3"
    assert llama.lm_head.weight.data_ptr() != llama.embed_tokens.weight.data_ptr()
    qwen2 = Transformer.from_pretrained(fixture_path("qwen2"))
    assert qwen2.lm_head.weight is qwen2.embed_tokens.weight


@pytest.mark.parametrize("family", ["qwen2", "llama3", "qwen3"])
def test_kv_cache_matches_uncached_forward(family):
    model = Transformer.from_pretrained(fixture_path(family))
    ids = torch.randint(0, 300, (3, 10))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(3, 16)
        steps = [model(ids[:, :4], cache=cache, cache_start=0)]  # prefill 4, then decode one by one
        for t in range(4, 10):
            steps.append(model(ids[:, t:t + 1], cache=cache, cache_start=t))
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


@pytest.mark.parametrize("family", ["qwen2", "llama3", "qwen3"])
def test_save_load_round_trip_is_exact(family, tmp_path):
    model = Transformer.from_pretrained(fixture_path(family))
    out = tmp_path / "saved"
    model.save_pretrained(out, max_shard_bytes=20_000)  # forces several shards
    assert (out / "model.safetensors.index.json").exists()
    again = Transformer.from_pretrained(out)
    for (n0, p0), (n1, p1) in zip(model.state_dict().items(), again.state_dict().items()):
        assert n0 == n1 and torch.equal(p0, p1)
    assert again.config == model.config
    assert again.generation_config == model.generation_config
    model.save_pretrained(out)  # overwrite in place, now single-file
    assert (out / "model.safetensors").exists() and not (out / "model.safetensors.index.json").exists()
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_saved_checkpoint_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")  # a dev-only check, skipped in CI
    model = Transformer(tiny_config(model_type="llama", tie_word_embeddings=False,
                                    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16}))
    model.save_pretrained(tmp_path / "m")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    ids = torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        assert _rel_err(model(ids), hf(ids).logits) < 1e-4


def test_interrupted_save_keeps_old_checkpoint(tmp_path, monkeypatch):
    model = Transformer(tiny_config())
    out = tmp_path / "ckpt"
    model.save_pretrained(out)
    before = load_file(out / "model.safetensors")
    import nanogrpo.model as M

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(M, "write_pretrained", crash)
    with pytest.raises(KeyboardInterrupt):
        model.save_pretrained(out)
    after = load_file(out / "model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def _copy_fixture(tmp_path, family="qwen2"):
    dst = tmp_path / family
    shutil.copytree(fixture_path(family), dst)
    return dst


def test_missing_config_json(tmp_path):
    dst = _copy_fixture(tmp_path)
    os.remove(dst / "config.json")
    with pytest.raises(FileNotFoundError, match="config.json"):
        Transformer.from_pretrained(dst)


def test_missing_and_unexpected_tensors(tmp_path):
    from safetensors.torch import save_file
    dst = _copy_fixture(tmp_path)
    state = load_file(dst / "model.safetensors")
    state.pop("model.layers.1.mlp.up_proj.weight")
    state["model.layers.1.mlp.extra.weight"] = torch.zeros(2)
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensors \['layers.1.mlp.up_proj.weight'\].*unexpected.*extra"):
        Transformer.from_pretrained(dst)


def test_wrong_shape(tmp_path):
    from safetensors.torch import save_file
    dst = _copy_fixture(tmp_path)
    state = load_file(dst / "model.safetensors")
    state["model.norm.weight"] = torch.ones(31)
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"norm.weight has shape \(31,\).*\(32,\)"):
        Transformer.from_pretrained(dst)


@pytest.mark.parametrize("change,message", [
    ({"model_type": "gpt2"}, "model_type='gpt2' is not supported"),
    ({"model_type": "mistral", "sliding_window": 4096}, "sliding_window=4096"),
    ({"num_experts": 8}, "num_experts=8"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "rope_type='yarn'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
])
def test_unsupported_configs(tmp_path, change, message):
    dst = _copy_fixture(tmp_path)
    cfg = json.load(open(dst / "config.json"))
    cfg.update(change)
    json.dump(cfg, open(dst / "config.json", "w"))
    with pytest.raises(ValueError, match=message):
        Transformer.from_pretrained(dst)


def test_missing_weights_and_bad_path(tmp_path):
    dst = _copy_fixture(tmp_path)
    os.remove(dst / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        Transformer.from_pretrained(dst)
    with pytest.raises(FileNotFoundError, match="neither a checkpoint directory nor a hub id"):
        Transformer.from_pretrained(str(tmp_path / "nope"))


def test_legacy_rope_layout_round_trip():
    hf = {"model_type": "llama", "vocab_size": 50, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
          "num_attention_heads": 2, "rope_theta": 500000.0,
          "rope_scaling": {"type": "linear", "factor": 4.0}, "torch_dtype": "bfloat16"}
    cfg = ModelConfig.from_hf(hf)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    out = cfg.to_hf()
    assert out["rope_theta"] == 500000.0 and out["rope_scaling"]["factor"] == 4.0 and out["torch_dtype"] == "bfloat16"
    assert ModelConfig.from_hf(out) == cfg


def test_bf16_load(tmp_path):
    model = Transformer.from_pretrained(fixture_path("qwen2"), dtype="bfloat16")
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.inv_freq.dtype == torch.float32
    ids = torch.randint(0, 300, (1, 6))
    with torch.no_grad():
        assert torch.isfinite(model(ids).float()).all()
