"""checkpoint.py: HF checkpoint round trips, atomic writes, load errors, trainer state without pickle."""

import json
import os
import shutil

import pytest
import torch
from conftest import assert_no_pickle, fixture_path, forbid_unpickling, tiny_config
from safetensors.torch import load_file

from nanogrpo.checkpoint import load_model, save_model
from nanogrpo.checkpoint.hf_format import config_from_hf, config_to_hf
from nanogrpo.model import Transformer


def _rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("family", ["qwen2", "llama3", "qwen3", "smollm3", "gemma3", "qwen3_5"])
def test_save_load_round_trip_is_exact(family, tmp_path):
    model = load_model(fixture_path(family))
    out = tmp_path / "saved"
    save_model(model, out, max_shard_bytes=20_000)  # forces several shards
    assert (out / "model.safetensors.index.json").exists()
    again = load_model(out)
    for (n0, p0), (n1, p1) in zip(model.state_dict().items(), again.state_dict().items()):
        assert n0 == n1 and torch.equal(p0, p1)
    assert again.config == model.config
    assert again.generation_config == model.generation_config
    save_model(model, out)  # overwrite in place, now single-file
    assert (out / "model.safetensors").exists() and not (
        out / "model.safetensors.index.json"
    ).exists()
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_saved_checkpoint_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")  # a dev-only check, skipped in CI
    model = Transformer(
        tiny_config(
            model_type="llama",
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        )
    )
    save_model(model, tmp_path / "m")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    ids = torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        assert _rel_err(model(ids), hf(ids).logits) < 1e-4


def test_interrupted_save_keeps_old_checkpoint(tmp_path, monkeypatch):
    model = Transformer(tiny_config())
    out = tmp_path / "ckpt"
    save_model(model, out)
    before = load_file(out / "model.safetensors")
    import nanogrpo.checkpoint as M

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(M, "write_model", crash)
    with pytest.raises(KeyboardInterrupt):
        save_model(model, out)
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
        load_model(dst)


def test_missing_and_unexpected_tensors(tmp_path):
    from safetensors.torch import save_file

    dst = _copy_fixture(tmp_path)
    state = load_file(dst / "model.safetensors")
    state.pop("model.layers.1.mlp.up_proj.weight")
    state["model.layers.1.mlp.extra.weight"] = torch.zeros(2)
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"missing tensors \['layers.1.mlp.up_proj.weight'\].*unexpected.*extra"
    ):
        load_model(dst)


def test_wrong_shape(tmp_path):
    from safetensors.torch import save_file

    dst = _copy_fixture(tmp_path)
    state = load_file(dst / "model.safetensors")
    state["model.norm.weight"] = torch.ones(31)
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"norm.weight has shape \(31,\).*\(32,\)"):
        load_model(dst)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"model_type": "gpt2"}, "model_type='gpt2' is not supported"),
        ({"model_type": "mistral", "sliding_window": 4096}, "sliding_window=4096"),
        ({"num_experts": 8}, "num_experts=8"),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}},
            "rope_type='yarn'",
        ),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"model_type": "smollm3", "attention_bias": True}, "attention_bias=true"),
        (
            {"model_type": "smollm3", "use_sliding_window": True, "sliding_window": 8},
            "sliding_window=8",
        ),
        (
            {"model_type": "smollm3", "layer_types": ["sliding_attention", "full_attention"]},
            "layer_types contains 'sliding_attention'",
        ),
        ({"model_type": "gemma3_text", "final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"model_type": "gemma3_text", "attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"model_type": "gemma3_text", "hidden_activation": "gelu"}, "hidden_activation='gelu'"),
        ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, "bidirectional"),
        (
            {"model_type": "gemma3_text", "layer_types": ["chunked_attention"] * 2},
            "layer_types contains 'chunked_attention'",
        ),
    ],
)
def test_unsupported_configs(tmp_path, change, message):
    dst = _copy_fixture(tmp_path)
    cfg = json.load(open(dst / "config.json"))
    cfg.update(change)
    json.dump(cfg, open(dst / "config.json", "w"))
    with pytest.raises(ValueError, match=message):
        load_model(dst)


def test_missing_weights_and_bad_path(tmp_path):
    dst = _copy_fixture(tmp_path)
    os.remove(dst / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(dst)
    with pytest.raises(FileNotFoundError, match="no such directory"):
        load_model(str(tmp_path / "nope"))


def test_legacy_rope_layout_round_trip():
    hf = {
        "model_type": "llama",
        "vocab_size": 50,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "linear", "factor": 4.0},
        "torch_dtype": "bfloat16",
    }
    cfg = config_from_hf(hf)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    out = config_to_hf(cfg)
    assert (
        out["rope_theta"] == 500000.0
        and out["rope_scaling"]["factor"] == 4.0
        and out["torch_dtype"] == "bfloat16"
    )
    assert config_from_hf(out) == cfg


def test_bf16_load(tmp_path):
    model = load_model(fixture_path("qwen2"), dtype="bfloat16")
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.inv_freq.dtype == torch.float32
    ids = torch.randint(0, 300, (1, 6))
    with torch.no_grad():
        assert torch.isfinite(model(ids).float()).all()


def test_resume_never_unpickles_code(tmp_path, monkeypatch):
    """Security regression: optimizer.pt and trainer_state.pt were loaded with weights_only=False, so
    a pickle payload in a shared checkpoint ran on --resume. Now no file of a checkpoint is a pickle
    (JSON and safetensors) and resuming never calls an unpickler."""
    from nanogrpo import distributed as dist
    from nanogrpo.run.checkpoints import load_trainer_state, save_checkpoint

    model = Transformer(tiny_config())
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 3, dtype=torch.long)).sum().backward()
    opt.step()
    info = dist.DistInfo()
    state = {"step": 1, "history": [{"reward": 0.5}]}
    ckpt = save_checkpoint(
        tmp_path, 1, model, opt, tokenizer=None, trainer_state=state, train_config={}, info=info
    )
    files = [os.path.join(d, f) for d, _, names in os.walk(ckpt) for f in names]
    assert sorted(os.path.relpath(f, ckpt) for f in files) == [
        "config.json",
        "model.safetensors",
        "train_config.json",
        "trainer/optimizer-rank00000-of-00001.safetensors",
        "trainer/optimizer.json",
        "trainer/trainer_state.json",
    ]
    assert_no_pickle(files)
    forbid_unpickling(monkeypatch)
    fresh = torch.optim.AdamW(model.parameters())
    assert load_trainer_state(ckpt, model, fresh, info) == {"step": 1, "history": [{"reward": 0.5}]}
    for i, state in opt.state_dict()["state"].items():
        again = fresh.state_dict()["state"][i]
        assert all(torch.equal(state[k], again[k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    with open(os.path.join(ckpt, "trainer", "trainer_state.json"), "w") as f:
        f.write('{"step": ')  # truncated
    with pytest.raises(ValueError, match="trainer_state.json is not valid JSON"):
        load_trainer_state(ckpt, model, fresh, info)


def test_prune_keeps_the_newest_and_the_resume_source(tmp_path):
    from nanogrpo.run.checkpoints import prune_checkpoints

    names = [f"checkpoint-{i}" for i in (1, 2, 3, 4)]
    for n in names + ["checkpoint-other"]:
        os.makedirs(tmp_path / n)
    left = prune_checkpoints(tmp_path, names, 2, keep=str(tmp_path / "checkpoint-1"))
    assert left == ["checkpoint-1", "checkpoint-3", "checkpoint-4"]
    assert sorted(os.listdir(tmp_path)) == [
        "checkpoint-1",
        "checkpoint-3",
        "checkpoint-4",
        "checkpoint-other",
    ]
    assert prune_checkpoints(tmp_path, left, None) == left


def test_corrupt_files_name_themselves(tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(fixture_path("qwen2"), dst)
    with open(dst / "config.json", "w") as f:
        f.write("{")
    with pytest.raises(ValueError, match=r"config.json is not valid JSON"):
        load_model(dst)
    shutil.copy(os.path.join(fixture_path("qwen2"), "config.json"), dst / "config.json")
    data = open(dst / "model.safetensors", "rb").read()
    with open(dst / "model.safetensors", "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model.safetensors cannot be read"):
        load_model(dst)


def test_partial_rotary_factor_survives_a_save_in_any_family():
    """A config.json's partial_rotary_factor (transformers' RoPE reads it for any family) is
    written back: on the top level for the classic families, inside rope_parameters for Qwen3.5."""
    from nanogrpo.checkpoint.hf_format import config_from_hf, config_to_hf

    llama = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}
    saved = config_to_hf(config_from_hf({**llama, "partial_rotary_factor": 0.5}))
    assert saved["partial_rotary_factor"] == 0.5
    assert "partial_rotary_factor" not in config_to_hf(config_from_hf(llama))
    qwen = config_to_hf(config_from_hf({"model_type": "qwen3_5_text", "num_hidden_layers": 4}))
    assert qwen["rope_parameters"]["partial_rotary_factor"] == 0.25
    assert "partial_rotary_factor" not in qwen
