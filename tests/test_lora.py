"""lora.py and the PEFT-format adapter files: PEFT's arithmetic, reference = adapters off, merge,
only adapters train, round trips with peft (fixtures from tests/fixtures/make_lora_fixtures.py)."""

import json
import os
import shutil
import subprocess
import sys
from contextlib import nullcontext

import conftest
import pytest
import torch
from conftest import FIXTURES, QWEN3_5, ROOT, fixture_path, tiny_config
from hypothesis import given, settings, strategies as st
from safetensors.torch import load_file

from nanogrpo import fast
from nanogrpo.checkpoint import load_model, save_model
from nanogrpo.extras import lora
from nanogrpo.fast.logprobs import token_logprobs
from nanogrpo.model import Transformer
from nanogrpo.run.config import ConfigError
from nanogrpo.run.configurator import load_config
from nanogrpo.trainer import Kernels

sys.path.insert(0, FIXTURES)
from make_lora_fixtures import OUR_SETTINGS, input_ids, make_ours  # noqa: E402  (nanogrpo only, no peft)

IDS = torch.randint(0, 97, (3, 11), generator=torch.Generator().manual_seed(0))


def perturbed(model, scale=0.1, seed=1):
    """Move every trainable tensor (so B is nonzero and modules_to_save differ from the base); B by
    scale / scaling, so that the update scaling * B A stays of the weights' size for any lora_alpha."""
    g = torch.Generator().manual_seed(seed)
    scalings = {f"{n}.lora_B.weight": m.scaling for n, m in lora.lora_layers(model).items()}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.add_(scale / scalings.get(name, 1.0) * torch.randn(p.shape, generator=g))
    return model.eval()


@settings(max_examples=8, deadline=None)
@given(
    r=st.integers(1, 8),
    alpha=st.sampled_from([1, 8, 32]),
    rslora=st.booleans(),
    tied=st.booleans(),
    targets=st.sampled_from([None, "all-linear", ["k_proj", "down_proj"], ["o_proj"]]),
    save=st.sampled_from([[], ["lm_head"], ["embed_tokens", "lm_head"]]),
)
def test_fresh_adapter_is_base_and_merge_is_exact(r, alpha, rslora, tied, targets, save):
    if tied and save == ["lm_head"]:
        save = ["embed_tokens", "lm_head"]  # a tied model needs both names (tested in test_errors)
    torch.manual_seed(0)
    model = Transformer(tiny_config(tie_word_embeddings=tied)).eval()
    base = model(IDS)
    lora.apply_lora(
        model,
        r=r,
        lora_alpha=alpha,
        target_modules=targets,
        modules_to_save=save,
        use_rslora=rslora,
    )
    assert torch.equal(model(IDS), base)  # B = 0: a fresh adapter changes no logit
    with_adapter = perturbed(model)(IDS)
    assert not torch.allclose(with_adapter, base, atol=1e-4)
    with lora.disable_adapters(model):
        assert torch.equal(
            model(IDS), base
        )  # adapters off = the base model, modules_to_save included
    state = lora.merged_state_dict(model.state_dict(), model.lora_config)
    merged = lora.merge_lora(model)
    assert not lora.lora_layers(merged) and not hasattr(merged, "lora_config")
    assert torch.allclose(merged(IDS), with_adapter, atol=1e-5)
    assert state.keys() == merged.state_dict().keys()
    assert all(
        torch.equal(state[k], v) for k, v in merged.state_dict().items()
    )  # the dict path is the same merge


def test_peft_arithmetic_scaling_init_and_names():
    torch.manual_seed(0)
    model = lora.apply_lora(Transformer(tiny_config()), r=4, lora_alpha=8, use_rslora=True)
    layer = model.layers[0].self_attn.q_proj
    assert isinstance(layer, lora.LoRALinear) and not isinstance(
        model.layers[0].self_attn.k_proj, lora.LoRALinear
    )
    assert (
        layer.scaling == 8 / 2
        and lora.apply_lora(Transformer(tiny_config()), r=4, lora_alpha=8)
        .layers[0]
        .self_attn.q_proj.scaling
        == 2
    )
    bound = 1 / 32**0.5  # kaiming-uniform(a=sqrt(5)) on [r, in=32]: U(-1/sqrt(in), 1/sqrt(in))
    assert layer.lora_A.weight.abs().max() <= bound and layer.lora_A.weight.std() > bound / 3
    assert torch.equal(layer.lora_B.weight, torch.zeros(32, 4))
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        layer.lora_B.weight.normal_()
        want = (
            x @ layer.weight.T
            + layer.bias
            + 4 * (x @ layer.lora_A.weight.T @ layer.lora_B.weight.T)
        )
    assert torch.allclose(layer.eval()(x), want, atol=1e-5)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {
        f"layers.{i}.self_attn.{m}.lora_{ab}.weight"
        for i in (0, 1)
        for m in ("q_proj", "v_proj")
        for ab in "AB"
    }
    assert (
        lora.to_peft_name("layers.1.mlp.up_proj.lora_B.weight")
        == "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    )
    assert lora.to_peft_name("lm_head.weight") == "base_model.model.lm_head.weight"
    for name in trainable | {"lm_head.weight", "embed_tokens.weight"}:
        assert lora.from_peft_name(lora.to_peft_name(name)) == name


def test_reference_logprobs_with_adapters_off_are_the_base_models():
    base = load_model(fixture_path("llama3"))
    model = perturbed(
        load_model(
            fixture_path("llama3"),
            lora_settings=dict(r=4, target_modules="all-linear", modules_to_save=["lm_head"]),
        )
    )
    ids = input_ids()
    mask = torch.ones(2, 4)
    attention = torch.ones_like(ids)
    attention[0, :2] = 0
    want, _ = token_logprobs(base, ids, attention, mask, temperature=0.7)
    with torch.no_grad(), lora.disable_adapters(model):
        got, _ = token_logprobs(model, ids, attention, mask, temperature=0.7)
    assert torch.equal(got, want)
    policy, _ = token_logprobs(model, ids, attention, mask, temperature=0.7)
    assert not torch.allclose(policy, want, atol=1e-3)  # and with them on, the policy differs


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_step_changes_only_adapters_and_modules_to_save(checkpointing):
    from nanogrpo import distributed as dist
    from nanogrpo.grpo import LossConfig
    from nanogrpo.rollout import Rollout
    from nanogrpo.run.config import TrainConfig

    torch.manual_seed(0)
    model = perturbed(
        load_model(
            fixture_path("qwen2"),
            lora_settings=dict(
                r=4, target_modules="all-linear", modules_to_save=["embed_tokens", "lm_head"]
            ),
        ),
        seed=2,
    ).train()
    model.gradient_checkpointing = checkpointing
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(lora.trainable_parameters(model), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 400, (4, 10), generator=g)
    mask = torch.ones(4, 5)
    ro = Rollout(
        rows=[],
        num_generations=2,
        prompt_ids=[],
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        completion_mask=mask,
        completion_lengths=mask.sum(1).long(),
        truncated=torch.zeros(4, dtype=torch.bool),
        prompts=[],
        completions=[],
        completion_token_ids=[],
        advantages=torch.randn(4, generator=g),
        num_items=mask.sum(),
    )
    cfg = TrainConfig(per_device_train_batch_size=2)
    micro = [torch.arange(0, 2), torch.arange(2, 4)]
    torch.manual_seed(3)  # the dropout masks
    from types import SimpleNamespace

    t = SimpleNamespace(
        model=model,
        optimizer=optimizer,
        cfg=cfg,
        loss_cfg=LossConfig(),
        loss_terms=None,
        info=dist.DistInfo(),
        autocast=nullcontext(),
        tok=SimpleNamespace(vocab_size=None),
        sched=SimpleNamespace(steps_per_generation=2),
        kernels=Kernels(**fast.kernels()),
        entropy_coef=0.0,
        last_entropy=float("inf"),
    )
    m = conftest.optimizer_step(t, [(ro, idx) for idx in micro])
    after = model.state_dict()
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    adapters = {k for k in after if ".lora_" in k}
    assert changed == adapters | {"embed_tokens.weight", "lm_head.weight"}
    assert model.lm_head.weight is model.embed_tokens.weight  # still tied
    if checkpointing:  # the same step without checkpointing gives the same weights
        test_a_step_changes_only_adapters_and_modules_to_save.result = (m["grad_norm"], after)
    elif hasattr(test_a_step_changes_only_adapters_and_modules_to_save, "result"):
        norm, other = test_a_step_changes_only_adapters_and_modules_to_save.result
        assert m["grad_norm"] == pytest.approx(norm, rel=1e-5)
        assert all(torch.allclose(other[k], after[k], atol=1e-6) for k in adapters)


def copied_adapter(tmp_path, name, family):
    """A fixture adapter copied to tmp_path, its base_model_name_or_path pointed at this checkout's fixture."""
    out = tmp_path / name
    shutil.copytree(os.path.join(FIXTURES, "lora", name), out)
    cfg = json.load(open(out / "adapter_config.json"))
    json.dump(
        dict(cfg, base_model_name_or_path=fixture_path(family)),
        open(out / "adapter_config.json", "w"),
    )
    return out, cfg


# Qwen3.5's linear attention rounds differently from transformers' (within fp32's 1e-4 for logits)
PEFT_TOL = {"qwen3_5": 1e-4}


@pytest.mark.parametrize("family", ["llama3", "qwen2", "smollm3", "gemma3", "qwen3_5"])
def test_an_adapter_made_by_peft_loads_with_peft_logits(tmp_path, family):
    path, cfg = copied_adapter(tmp_path, f"peft-{family}", family)
    model = load_model(path).eval()
    expected = load_file(path / "expected.safetensors")
    tol = PEFT_TOL.get(family, 1e-5)
    assert torch.allclose(model(expected["input_ids"]), expected["logits"], atol=tol)
    assert model.lora_config["r"] == cfg["r"] and lora.lora_layers(model)
    assert all(
        ".lora_" in n or n.startswith("lm_head")
        for n, p in model.named_parameters()
        if p.requires_grad
    )
    save_model(model, tmp_path / "again")  # and it saves back to the same tensors
    again, original = (
        load_file(tmp_path / "again" / "adapter_model.safetensors"),
        load_file(path / "adapter_model.safetensors"),
    )
    assert again.keys() == original.keys() and all(
        torch.equal(again[k], original[k]) for k in again
    )


@pytest.mark.parametrize("family", ["llama3", "qwen2", "smollm3", "gemma3", "qwen3_5"])
def test_our_adapter_loaded_by_peft_gives_our_logits(tmp_path, family):
    model = make_ours(family)
    save_model(model, tmp_path / "ours")
    committed = os.path.join(FIXTURES, "lora", f"ours-{family}")
    ours, theirs = (
        load_file(tmp_path / "ours" / "adapter_model.safetensors"),
        load_file(os.path.join(committed, "adapter_model.safetensors")),
    )
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    cfg = json.load(open(tmp_path / "ours" / "adapter_config.json"))
    assert (
        cfg["peft_type"] == "LORA"
        and cfg["task_type"] == "CAUSAL_LM"
        and cfg["r"] == OUR_SETTINGS[family]["r"]
    )
    assert cfg["base_model_name_or_path"] == fixture_path(family)
    assert {k: v for k, v in cfg.items() if k != "base_model_name_or_path"} == {
        k: v
        for k, v in json.load(open(os.path.join(committed, "adapter_config.json"))).items()
        if k != "base_model_name_or_path"
    }
    expected = load_file(
        os.path.join(committed, "expected.safetensors")
    )  # peft's logits on our adapter
    with torch.no_grad():
        tol = PEFT_TOL.get(family, 1e-5)
        assert torch.allclose(model(expected["input_ids"]), expected["logits"], atol=tol)
    assert torch.allclose(
        load_model(tmp_path / "ours").eval()(expected["input_ids"]),
        expected["logits"],
        atol=PEFT_TOL.get(family, 1e-5),
    )


def test_without_lora_imported_an_adapter_is_an_error_naming_the_import(tmp_path):
    """checkpoint/ imports no option: in a process that never imported extras/lora.py, an adapter
    directory (or lora_settings) fails with one line saying what to import, never the base alone."""
    path, _ = copied_adapter(tmp_path, "peft-qwen2", "qwen2")
    code = (
        "import sys\n"
        "from nanogrpo.checkpoint import load_model\n"
        "assert 'nanogrpo.extras.lora' not in sys.modules\n"
        "for path, kw in [(sys.argv[1], {}), (sys.argv[2], {'lora_settings': {'r': 2}})]:\n"
        "    try:\n"
        "        load_model(path, **kw)\n"
        "    except RuntimeError as e:\n"
        "        print(e)\n"
    )
    cmd = [sys.executable, "-c", code, str(path), fixture_path("qwen2")]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    fix = "which is not registered: import nanogrpo.extras.lora first"
    assert done.stdout.splitlines() == [
        f"{path} (a PEFT adapter) needs the LoRA adapter format, {fix} "
        "(importing it registers the format with the loader)",
        f"load_model(lora_settings=...) needs the LoRA adapter format, {fix} "
        "(importing it registers the format with the loader)",
    ]


def test_merged_model_saves_as_a_plain_checkpoint(tmp_path):
    model = make_ours("llama3")
    with torch.no_grad():
        want = model(input_ids())
    save_model(lora.merge_lora(model), tmp_path / "merged")
    assert not os.path.exists(tmp_path / "merged" / "adapter_config.json")
    merged = load_model(tmp_path / "merged")
    assert not lora.lora_layers(merged)
    assert torch.allclose(merged(input_ids()), want, atol=1e-5)


def test_errors(tmp_path):
    model = Transformer(tiny_config(tie_word_embeddings=True))
    with pytest.raises(ValueError, match="lora_r=0"):
        lora.apply_lora(model, r=0)
    with pytest.raises(
        ValueError, match="'qkv_proj' names no linear.*q_proj, k_proj, v_proj, o_proj, gate_proj"
    ):
        lora.apply_lora(model, target_modules=["q_proj", "qkv_proj"])
    with pytest.raises(ValueError, match="must be named for a smollm3 model"):  # as PEFT 0.21
        lora.apply_lora(Transformer(tiny_config(model_type="smollm3")))
    with pytest.raises(ValueError, match="a qwen3_5_text model .* in_proj_qkv, in_proj_z"):
        lora.apply_lora(Transformer(tiny_config(**QWEN3_5)))
    with pytest.raises(
        ValueError, match="'norm' is not supported; valid names: embed_tokens, lm_head"
    ):
        lora.apply_lora(model, modules_to_save=["norm"])
    with pytest.raises(ValueError, match="ties embed_tokens and lm_head.*name both"):
        lora.apply_lora(model, modules_to_save=["lm_head"])
    with pytest.raises(ValueError, match="lora_dropout=1"):
        lora.apply_lora(model, lora_dropout=1)
    lora.apply_lora(model)
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        lora.apply_lora(model)
    path, cfg = copied_adapter(tmp_path, "peft-qwen2", "qwen2")
    for bad, match in [
        ({"use_dora": True}, "use_dora=True is not supported"),
        ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
        ({"peft_type": "IA3"}, "only LORA"),
        ({"base_model_name_or_path": None}, "base_model_name_or_path is empty"),
        ({"r": 5}, "shape"),
    ]:
        json.dump(
            {**cfg, "base_model_name_or_path": fixture_path("qwen2"), **bad},
            open(path / "adapter_config.json", "w"),
        )
        with pytest.raises(ValueError, match=match):
            load_model(path)
    args = ["--config", "tiny.py", "--use_peft=true"]
    with pytest.raises(ConfigError, match="sync_ref_model.*use_peft"):
        load_config(args + ["--beta=0.1", "--sync_ref_model=true"])
    with pytest.raises(ConfigError, match="merge_adapter.*needs use_peft"):
        load_config(["--config", "tiny.py", "--merge_adapter=true"])
    with pytest.raises(ConfigError, match="lora_r"):
        load_config(args + ["--lora_r=0"])
    assert (
        load_config(args + ["--lora_target_modules=all-linear"]).lora_settings()["target_modules"]
        == "all-linear"
    )
    assert load_config(args + ["--lora_target_modules=q_proj,o_proj"]).lora_settings()[
        "target_modules"
    ] == ["q_proj", "o_proj"]


def test_train_with_lora_resumes_exactly_samples_and_merges(tmp_path, capsys):
    from test_train import strip_timing, tiny

    import sample
    import train

    args = [
        "--use_peft=true",
        "--lora_target_modules=all-linear",
        "--lora_r=4",
        "--learning_rate=1e-2",
        "--beta=0.04",
        "--merge_adapter=true",
    ]
    full = train.train(tiny(tmp_path / "a", "--max_steps=2", *args))
    assert (
        "kl" in full[-1] and full[-1]["kl"] > 0
    )  # the reference = adapters off, and the policy moved away
    train.train(tiny(tmp_path / "b", "--max_steps=1", *args))
    resumed = train.train(
        tiny(tmp_path / "b", "--resume_from_checkpoint=true", "--max_steps=2", *args)
    )
    assert strip_timing(resumed) == strip_timing(full)
    ckpt = tmp_path / "b" / "run" / "checkpoint"
    files = set(os.listdir(ckpt))
    assert {
        "adapter_config.json",
        "adapter_model.safetensors",
        "tokenizer.json",
        "trainer",
    } <= files
    assert "model.safetensors" not in files  # the adapter, not a second copy of the base
    a, b = (
        load_file(tmp_path / x / "run" / "checkpoint" / "adapter_model.safetensors") for x in "ab"
    )
    assert all(torch.equal(a[k], b[k]) for k in a)
    adapter = load_model(ckpt).eval()  # base + adapter, from the checkpoint directory alone
    merged = load_model(
        tmp_path / "b" / "run" / "merged"
    )  # merge_adapter: a plain, full HF checkpoint
    assert not lora.lora_layers(merged)
    assert torch.allclose(merged(input_ids() % 10), adapter(input_ids() % 10), atol=1e-5)
    assert torch.equal(
        load_model(tmp_path / "b" / "init").layers[0].mlp.up_proj.weight,
        adapter.layers[0].mlp.up_proj.weight,
    )  # the base never moved
    capsys.readouterr()
    sample.main(
        [
            "--model",
            str(ckpt),
            "--prompt",
            "abcd=",
            "--num_samples",
            "2",
            "--max_new_tokens",
            "6",
            "--device",
            "cpu",
            "--dtype",
            "float32",
        ]
    )
    assert capsys.readouterr().out.count("--- sample") == 2
