"""tokenizer.py: encodings, decodings and chat renderings match transformers (fixture)."""

import json
import os

import pytest
from conftest import fixture_path

from nanogrpo.tokenizer import Tokenizer

EXPECTED = json.load(open(os.path.join(fixture_path("tokenizer"), "expected.json")))


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_pretrained(fixture_path("tokenizer"))


@pytest.mark.parametrize("case", EXPECTED["encode"], ids=lambda c: repr(c["text"])[:20])
def test_encode(tok, case):
    assert tok.encode(case["text"]) == case["ids"]


@pytest.mark.parametrize("case", EXPECTED["decode"], ids=lambda c: repr(c["text"])[:20])
def test_decode(tok, case):
    assert tok.decode(case["ids"], skip_special_tokens=True) == case["text"]


@pytest.mark.parametrize("case", EXPECTED["chat"], ids=lambda c: c["messages"][-1]["content"][:10])
def test_chat_template(tok, case):
    text = tok.apply_chat_template(
        case["messages"], add_generation_prompt=case["add_generation_prompt"], tools=case["tools"]
    )
    assert text == case["text"]


def test_a_pickled_tokenizer_renders_and_encodes_as_the_original(tok):
    """async_rollouts hands its sampler process the trainer's tokenizer, pickled after its chat
    template was compiled (local functions, which pickle cannot take)."""
    import pickle

    case = EXPECTED["chat"][0]
    how = dict(add_generation_prompt=case["add_generation_prompt"], tools=case["tools"])
    tok.apply_chat_template(case["messages"], **how)
    copy = pickle.loads(pickle.dumps(tok))
    assert copy.apply_chat_template(case["messages"], **how) == case["text"]
    assert copy.encode(case["text"]) == tok.encode(case["text"])


def test_eos_and_pad(tok):
    assert tok.eos_token_ids == set(
        EXPECTED["eos_token_ids"]
    )  # tokenizer eos + generation_config's
    assert tok.pad_token_id == EXPECTED["pad_token_id"]
    assert tok.vocab_size == 384


def test_template_errors(tok):
    import jinja2

    with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_pad_falls_back_to_eos_and_bos_added(tmp_path, tok):
    cfg = dict(tok.config, pad_token=None, bos_token="<|im_start|>", add_bos_token=True)
    tok.tokenizer.save(str(tmp_path / "tokenizer.json"))
    json.dump(cfg, open(tmp_path / "tokenizer_config.json", "w"))
    t2 = Tokenizer.from_pretrained(tmp_path)
    assert t2.pad_token_id == t2.eos_token_id == tok.token_to_id("<|im_end|>")
    assert t2.encode("Hello")[0] == tok.token_to_id("<|im_start|>")
    assert t2.encode("Hello", add_special_tokens=False) == tok.encode("Hello")
    assert t2.eos_token_ids == {t2.eos_token_id}  # no generation_config.json here


def test_chat_template_jinja_file_and_save(tmp_path, tok):
    tok.save_pretrained(tmp_path)
    cfg = json.load(open(tmp_path / "tokenizer_config.json"))
    template = cfg.pop("chat_template")
    json.dump(cfg, open(tmp_path / "tokenizer_config.json", "w"))
    (tmp_path / "chat_template.jinja").write_text(template)
    t2 = Tokenizer.from_pretrained(tmp_path)
    case = EXPECTED["chat"][1]
    assert t2.apply_chat_template(case["messages"]) == case["text"]
    assert t2.encode_prompt(case["messages"]) == tok.encode(case["text"], add_special_tokens=False)


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


def test_messages_seen_as_transformers_shows_them(tok):
    """None values are dropped (an OpenAI-style tool call has content None) and reasoning under
    `reasoning_content`, `thinking` or `reasoning` reaches the template under the first two names.
    Expected string rendered by transformers 5.23 (apply_chat_template with this chat_template)."""
    template = (
        "{% for m in messages %}{{ m.role }}:{{ m.content if m.content is defined else '(none)' }}"
        "{% if m.reasoning_content is defined %} r={{ m.reasoning_content }}{% endif %}"
        "{% if m.thinking is defined %} t={{ m.thinking }}{% endif %}"
        "{% if m.tool_calls %} calls={{ m.tool_calls | length }}{% endif %};{% endfor %}"
    )
    messages = [
        {"role": "user", "content": "hi", "reasoning_content": None},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}],
        },
        {"role": "assistant", "content": "4", "reasoning": "2+2"},
        {
            "role": "assistant",
            "content": "5",
            "thinking": "2+3",
            "reasoning_content": "two plus three",
        },
    ]
    t2 = Tokenizer(tok.tokenizer, tok.config, chat_template=template)
    assert t2.apply_chat_template(messages, add_generation_prompt=False) == (
        "user:hi;assistant:(none) calls=1;assistant:4 r=2+2 t=2+2;assistant:5 r=two plus three t=2+3;"
    )
    assert messages[0] == {
        "role": "user",
        "content": "hi",
        "reasoning_content": None,
    }  # the caller's are untouched


def test_decode_completions_cuts_each_row_at_its_mask():
    import torch

    from nanogrpo.tokenizer import char_level_tokenizer

    tok = char_level_tokenizer("ab=")
    a, b, eq = (tok.encode(c) for c in "ab=")
    ids = torch.tensor([a + b + [0], eq + [0, 0]])  # right-padded with the eos/pad id 0
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    rows, texts = tok.decode_completions(ids, mask)
    assert rows == [a + b + [0], eq + [0]] and texts == [
        "ab",
        "=",
    ]  # eos kept in ids, skipped in text


def test_tokenize_true_gives_ids_as_transformers_and_text_stays_the_default(tok):
    """transformers' tokenize argument with its meaning: the rendered text encoded without adding
    special tokens; return_dict (transformers' default) gives {"input_ids", "attention_mask"},
    one list of ids for one conversation and a list per conversation for a batch. Without
    tokenize, the text, as every nanogrpo caller reads it."""
    cases = EXPECTED["chat"][:2]
    texts = [tok.apply_chat_template(c["messages"]) for c in cases]
    ids = [tok.encode(text, add_special_tokens=False) for text in texts]
    assert texts == [tok.apply_chat_template(c["messages"], tokenize=False) for c in cases]
    one = tok.apply_chat_template(cases[0]["messages"], tokenize=True)
    assert one == {"input_ids": ids[0], "attention_mask": [1] * len(ids[0])}
    plain = tok.apply_chat_template(cases[0]["messages"], tokenize=True, return_dict=False)
    assert plain == ids[0] and all(isinstance(i, int) for i in plain)
    batch = [c["messages"] for c in cases]
    assert tok.apply_chat_template(batch) == texts
    assert tok.apply_chat_template(batch, tokenize=True, return_dict=False) == ids
    assert tok.apply_chat_template(batch, tokenize=True)["input_ids"] == ids
    with pytest.raises(ValueError, match=r"\['padding', 'return_tensors'\] are not supported"):
        tok.apply_chat_template(batch, tokenize=True, return_tensors="pt", padding=True)


def test_tokenize_true_matches_transformers_on_gemma3():
    """Gemma 3's template writes `<bos>` itself: tokenize=True gives transformers' ids (computed
    once by transformers 5, tests/fixtures/make_gemma3_fixtures.py), with one `<bos>`."""
    from conftest import real_folder

    expected = json.load(open(os.path.join(fixture_path("real"), "gemma3_tokenizer.json")))
    gemma = Tokenizer.from_pretrained(real_folder("tokenizer-gemma3"))
    cases = [c for c in expected["chat"] if "ids" in c]
    assert cases
    for c in cases:
        conversation = expected["conversations"][c["conversation"]]
        got = gemma.apply_chat_template(
            conversation,
            tokenize=True,
            return_dict=False,
            add_generation_prompt=c["add_generation_prompt"],
        )
        assert got == c["ids"], c
