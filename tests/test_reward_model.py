"""Reward models: *ForSequenceClassification checkpoints as reward functions, scored as TRL scores them.

Expected values come from tests/fixtures/make_reward_model_fixtures.py (transformers + trl, run by hand):
TRL's texts, the reward tokenizer's right-padded ids, and transformers' `model(**inputs).logits[:, 0]`.
"""

import json
import os
import shutil

import pytest
import torch
from hypothesis import given, settings, strategies as st

import train
from nanogrpo.checkpoint import load_model, read_json, save_model
from nanogrpo.extras.reward_funcs import resolve_reward_funcs
from nanogrpo.extras.reward_model import score_texts
from nanogrpo.model import ModelConfig, Transformer
from nanogrpo.rewards import RewardError, score_completions
from nanogrpo.run.config import ConfigError, TrainConfig
from nanogrpo.tokenizer import Tokenizer

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "reward_models")
EXPECTED = read_json(os.path.join(HERE, "expected.json"))


def rm(name):
    return os.path.join(HERE, name)


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_scores_equal_transformers(case):
    """Same texts, same token ids, same label-0 logits as TRL + transformers (fp32, 1e-4): four texts of
    mixed lengths in micro-batches of 3 (TRL scores them in one batch)."""
    e = EXPECTED[case]
    model_name, _, kind = case.partition("/")
    model_name, _, other = model_name.partition("+")
    tokenizer = rm("qwen2_rm") if other else None
    [(name, fn)] = resolve_reward_funcs(
        [rm(model_name)], reward_processing_classes=[tokenizer], batch_size=3
    )
    assert name == model_name
    tok = Tokenizer.from_pretrained(tokenizer or rm(model_name))
    assert tok.pad_token_id == e["pad_token_id"]
    for text, ids, n in zip(e["texts"], e["input_ids"], e["lengths"]):
        if (
            kind == "chat"
        ):  # the reward tokenizer's own chat template over prompt + completion, no generation prompt
            assert text in [
                tok.apply_chat_template(p + c, add_generation_prompt=False)
                for p, c in zip(e["prompts"], e["completions"])
            ]
        assert tok.encode(text, add_special_tokens=False) == ids[:n]
    scores = fn(prompts=e["prompts"], completions=e["completions"], completion_ids=[[1]] * 4)
    assert isinstance(scores, list) and all(isinstance(s, float) for s in scores)
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(e["scores"]), rtol=0, atol=1e-4)


def test_pooled_position_skips_trailing_pad_id():
    """transformers pools the rightmost token whose id is not the pad id: with pad = eos (llama_rm's
    tokenizer has no pad token) a trailing eos is skipped, so appending it changes nothing; with a real
    pad token (qwen2_rm) the eos is scored."""
    text = "The answer is 4."
    for name, skipped in (("llama_rm", True), ("qwen2_rm", False)):
        model, tok = load_model(rm(name)).eval(), Tokenizer.from_pretrained(rm(name))
        a, b, c = score_texts(
            model, tok, [text, text + "<|im_end|>", text + "<|im_end|><|im_end|>"]
        )
        assert (
            (max(abs(a - b), abs(a - c)) < 1e-5)
            if skipped
            else (min(abs(a - b), abs(b - c)) > 1e-3)
        ), name


@settings(max_examples=10, deadline=None)
@given(
    st.lists(st.text(alphabet="ab 2+=.?\n", max_size=12), min_size=1, max_size=7), st.integers(1, 8)
)
def test_scores_do_not_depend_on_batching(texts, batch_size):
    model, tok = _qwen2()
    alone = [score_texts(model, tok, [t])[0] for t in texts]
    batched = score_texts(model, tok, texts, batch_size=batch_size)
    torch.testing.assert_close(torch.tensor(batched), torch.tensor(alone), rtol=0, atol=1e-5)


_CACHE = {}


def _qwen2():
    if not _CACHE:
        _CACHE["m"] = (load_model(rm("qwen2_rm")).eval(), Tokenizer.from_pretrained(rm("qwen2_rm")))
    return _CACHE["m"]


def test_mixes_with_callables_weights_and_async():
    async def half(completions, **kwargs):
        return [0.5] * len(completions)

    funcs = resolve_reward_funcs([rm("qwen2_rm"), half, "format"])
    e = EXPECTED["qwen2_rm/plain"]
    r = score_completions(funcs, e["prompts"], e["completions"], [[1]] * 4, {})
    assert [name for name, _ in funcs] == ["qwen2_rm", "half", "format"]
    torch.testing.assert_close(r[:, 0], torch.tensor(e["scores"]), rtol=0, atol=1e-4)
    assert r[:, 1].tolist() == [0.5] * 4


def _classifier(tmp_path, num_labels, name="two_labels"):
    torch.manual_seed(0)
    model = Transformer(
        ModelConfig(
            model_type="qwen2",
            vocab_size=400,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_labels=num_labels,
        )
    )
    save_model(model, tmp_path / name, tokenizer=Tokenizer.from_pretrained(rm("qwen2_rm")))
    return tmp_path / name


def test_num_labels_other_than_one_is_an_error_naming_the_checkpoint(tmp_path):
    path = _classifier(tmp_path, num_labels=2)
    assert read_json(path / "config.json")["architectures"] == ["Qwen2ForSequenceClassification"]
    assert load_model(path).score.weight.shape == (2, 16)
    with pytest.raises(
        ValueError, match=r"two_labels.*Qwen2ForSequenceClassification with num_labels=2.*1 label"
    ):
        resolve_reward_funcs([str(path)])


def test_not_a_reward_model_and_bad_tokenizer_lists_are_clear_errors(tmp_path):
    """A causal LM, an empty directory, an unknown name, a wrong-length tokenizer list: errors that say why
    (a tokenizer given for a function that is not a reward model is ignored, as TRL ignores it)."""
    causal = os.path.join(os.path.dirname(HERE), "qwen2")  # a *ForCausalLM checkpoint
    with pytest.raises(
        ValueError, match=r"qwen2'.*names Qwen2ForCausalLM.*a \*ForSequenceClassification"
    ):
        resolve_reward_funcs([causal])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty'.*names None"):
        resolve_reward_funcs([str(tmp_path / "empty")])
    with pytest.raises(ValueError, match="unknown reward function 'nothing'.*reward model"):
        resolve_reward_funcs(["nothing"])
    with pytest.raises(ValueError, match="reward_processing_classes: 1 entries, 2 functions"):
        resolve_reward_funcs([rm("qwen2_rm"), "format"], reward_processing_classes=[None])
    assert (
        resolve_reward_funcs(["format"], reward_processing_classes=[rm("qwen2_rm")])[0][0]
        == "format"
    )  # as TRL
    with pytest.raises(ConfigError, match="reward_processing_classes"):
        TrainConfig(reward_processing_classes=[None, None]).validate()
    [(_, fn)] = resolve_reward_funcs([rm("qwen2_rm")])
    with pytest.raises(RewardError, match="qwen2_rm"):  # a string prompt with message completions
        score_completions(
            [("qwen2_rm", fn)], ["p"], [[{"role": "assistant", "content": "c"}]], [[1]], {}
        )


def test_save_model_round_trips_a_classifier(tmp_path):
    """load -> save -> load keeps the score head, the architecture and the labels; the name of a path with a
    trailing slash is still its last component."""
    model = load_model(rm("llama_rm"))
    save_model(model, tmp_path / "copy")
    shutil.copy(os.path.join(rm("llama_rm"), "tokenizer.json"), tmp_path / "copy")
    shutil.copy(os.path.join(rm("llama_rm"), "tokenizer_config.json"), tmp_path / "copy")
    original = read_json(os.path.join(rm("llama_rm"), "config.json"))
    saved = read_json(tmp_path / "copy" / "config.json")
    for key in ("architectures", "id2label", "tie_word_embeddings"):
        assert saved[key] == original[key], key
    a, b = model.state_dict(), load_model(tmp_path / "copy").state_dict()
    assert (
        "score.weight" in b
        and "lm_head.weight" not in b
        and all(torch.equal(a[k], b[k]) for k in a)
    )
    [(name, fn)] = resolve_reward_funcs([str(tmp_path / "copy") + "/"])
    e = EXPECTED["llama_rm/plain"]
    assert name == "copy"
    torch.testing.assert_close(
        torch.tensor(fn(prompts=e["prompts"], completions=e["completions"])),
        torch.tensor(e["scores"]),
        rtol=0,
        atol=1e-4,
    )


def test_transformers_loads_a_saved_classifier(tmp_path):
    transformers = pytest.importorskip("transformers")
    path = _classifier(tmp_path, num_labels=1, name="one_label")
    ours = load_model(path).eval()
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
    theirs.config.pad_token_id = 0
    ids = torch.randint(1, 384, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids)[:, -1], theirs(ids).logits, rtol=0, atol=1e-5)


def length_reward(completions, **kwargs):
    """A plain callable beside the reward model in the training run below."""
    return [len(c) / 6 for c in completions]


def test_training_with_a_reward_model_and_a_callable(tmp_path):
    """A short run of train.py: a reward model plus a callable, weighted; both are logged."""
    from test_train import INIT

    from nanogrpo.run.configurator import load_config

    cfg = load_config(
        [
            "--config",
            "tiny.py",
            f"--model={tmp_path}/init",
            INIT,
            f"--output_dir={tmp_path}/run",
            "--gradient_accumulation_steps=1",
            "--num_generations=4",
            "--per_device_train_batch_size=8",
            "--max_completion_length=6",
            "--max_steps=2",
            "--learning_rate=1e-3",
            f"--reward_funcs={rm('qwen2_rm')},{__file__}:length_reward",
            "--reward_weights=0.5,1.0",
        ]
    )
    history = train.train(cfg)
    assert [m["step"] for m in history] == [1, 2]
    lines = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    for m in lines:
        rm_mean, length_mean = m["rewards/qwen2_rm/mean"], m["rewards/length_reward/mean"]
        assert all(isinstance(v, float) and v == v for v in (rm_mean, length_mean, m["reward"]))
        assert abs(m["reward"] - (0.5 * rm_mean + length_mean)) < 1e-5
