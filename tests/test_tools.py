"""tools.py against transformers and TRL: tool schemas (= get_json_schema), the real Qwen3 chat template,
TRL's tool-result suffix ids, parsing tool calls, running sync and async tools.

Expected values come from tests/fixtures/make_tool_fixtures.py, stored in tests/fixtures/tools/expected.json."""

import asyncio
import copy
import functools
import json
import os
import sys

import pytest
from conftest import fixture_path
from hypothesis import assume, given, settings, strategies as st

from nanogrpo.extras import tools as tools_module
from nanogrpo.extras.tools import (
    parse_hermes,
    parse_qwen3_5,
    parser_for,
    resolve_tools,
    run_tools,
    tool_message,
    tool_schema,
    tool_suffix_ids,
    typed_arguments,
)
from nanogrpo.tokenizer import Tokenizer

sys.path.insert(0, fixture_path("tools"))
import signatures  # noqa: E402

EXPECTED = json.load(open(os.path.join(fixture_path("tools"), "expected.json")))
TEMPLATE = open(os.path.join(fixture_path("tools"), "hermes_chatml.jinja")).read()
QWEN3 = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "real", "tokenizer-qwen3"
)
SCHEMAS = [signatures.multiply, signatures.search]


# --- schemas ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", signatures.SIGNATURES, ids=lambda f: f.__name__)
def test_tool_schema_is_get_json_schema(fn):
    expected = EXPECTED["schemas"][fn.__name__]
    if "error" in expected:  # transformers refuses it: so do we, naming the function
        with pytest.raises(ValueError, match=fn.__name__):
            tool_schema(fn)
    else:  # equal, key order included (templates render the schema with tojson)
        assert json.dumps(tool_schema(fn)) == json.dumps(expected)


def tool_calls_of(text):
    """The calls parse_hermes reads in a text (its content part dropped)."""
    return parse_hermes(text)[1]


def test_tool_schema_errors_say_what_is_missing():
    with pytest.raises(ValueError, match="argument 'b'"):
        tool_schema(signatures.undocumented_arg)
    with pytest.raises(ValueError, match="no docstring"):
        tool_schema(signatures.no_docstring)
    with pytest.raises(ValueError, match="no type hint"):
        tool_schema(signatures.paint)


# --- chat templates: the real Qwen3 one, and ours (prefix-preserving) against TRL ---------------


@functools.cache
def _qwen3_tokenizer():
    return Tokenizer.from_pretrained(QWEN3)


def qwen3_tokenizer():
    """The real Qwen3 tokenizer with its own template (loaded once), or skip when it is not fetched."""
    if not os.path.exists(os.path.join(QWEN3, "SOURCE.json")) or "qwen3" not in EXPECTED:
        pytest.skip(f"{QWEN3} is missing: `python tests/fetch_real.py` builds it")
    tok = copy.copy(_qwen3_tokenizer())
    return tok


@pytest.mark.parametrize("name", list(EXPECTED["conversations"]))
def test_qwen3_renders_tools_as_transformers(name):
    tok = qwen3_tokenizer()
    messages, gen = EXPECTED["conversations"][name]
    schemas = [tool_schema(f) for f in SCHEMAS]
    assert (
        tok.apply_chat_template(messages, tools=schemas, add_generation_prompt=gen)
        == EXPECTED["qwen3"]["renderings"][name]
    )
    tok.chat_template, tok._template = TEMPLATE, None
    assert (
        tok.apply_chat_template(messages, tools=schemas, add_generation_prompt=gen)
        == EXPECTED["hermes"]["renderings"][name]
    )


def test_tool_suffix_ids_are_trls():
    tok = qwen3_tokenizer()
    assert (
        EXPECTED["qwen3"]["prefix_preserving"] is False
    )  # TRL swaps in its own template; we stop and say so
    with pytest.raises(ValueError, match="does not preserve prefixes"):
        tool_suffix_ids(tok, EXPECTED["replies"][0])
    tok.chat_template, tok._template = TEMPLATE, None
    assert EXPECTED["hermes"]["prefix_preserving"] is True
    for replies, ids in zip(EXPECTED["replies"], EXPECTED["hermes"]["suffix_ids"]):
        assert tool_suffix_ids(tok, replies) == ids


# --- parsing -------------------------------------------------------------------------------------

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
CALLS = st.lists(
    st.fixed_dictionaries(
        {
            "name": st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True),
            "arguments": st.dictionaries(st.text(max_size=5), JSON, max_size=3),
        }
    ),
    max_size=3,
)


@settings(max_examples=60, deadline=None)
@given(content=st.text(max_size=20), calls=CALLS, spacing=st.sampled_from(["", "\n", " \n "]))
def test_parse_tool_calls_round_trip(content, calls, spacing):
    text = content + "".join(
        f"<tool_call>{spacing}{json.dumps(c)}{spacing}</tool_call>" for c in calls
    )
    assume(
        "<tool_call>" not in content and "</tool_call>" not in json.dumps(calls)
    )  # the format cannot quote its tags
    assert tool_calls_of(text) == calls
    assert tools_module.parse_hermes(text)[0] == (content.rstrip() if calls else text.rstrip())


@pytest.mark.parametrize(
    "body",
    [
        '{"name": "f", "arguments": {"a": 1}',  # JSON that does not parse
        "not json",
        '{"arguments": {}}',  # no name
        '{"name": 3, "arguments": {}}',
        "[1, 2]",  # not an object
    ],
)
def test_a_block_that_is_not_a_call_makes_the_turn_plain_text(body):
    """As TRL reads a turn (transformers' parse_response raises, TRL's fallback decodes the text):
    the whole turn is text as written, with no calls, even beside a well-formed call."""
    for text in (
        f"x <tool_call>{body}</tool_call>",
        f'x<tool_call>{{"name": "add", "arguments": {{}}}}</tool_call><tool_call>{body}</tool_call>',
    ):
        assert parse_hermes(text) == (text, [])


def test_arguments_that_are_not_an_object_fail_when_run():
    """A call whose arguments are not an object is read (TRL's parse_response keeps it) and fails
    when run, as TRL's `tool(**arguments)` does; missing or null arguments are none."""
    ((call,),) = [tool_calls_of('<tool_call>{"name": "add", "arguments": [1]}</tool_call>')]
    assert call == {"name": "add", "arguments": [1]}
    ((name, result, failed),) = run_tools([[call]], resolve_tools([add]), 1.0)[0]
    assert failed and "must be a mapping" in result["error"]
    for args in ("", ', "arguments": null'):
        text = f'<tool_call>{{"name": "f"{args}}}</tool_call>'
        assert tool_calls_of(text) == [{"name": "f", "arguments": {}}]


def test_arguments_as_a_json_string():
    assert tool_calls_of('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>') == [
        {"name": "f", "arguments": {"a": 1}}
    ]


@pytest.mark.parametrize("typed", [True, False])
def test_qwen3_5_calls_parse_as_transformers_parse_response(typed):
    """Qwen3.5's XML form, as transformers' parse_response reads it with TRL's Qwen3.5 response
    template: names, arguments typed by the tools' schemas (or left text without tools), content."""
    case = EXPECTED["qwen3_5_parse"]
    tools = {f.__name__: f for f in (signatures.multiply, signatures.search, signatures.convert)}
    for text, want in zip(case["texts"], case["typed" if typed else "untyped"]):
        content, calls = parse_qwen3_5(text.removesuffix("<|im_end|>"))
        calls = [typed_arguments(c, tools if typed else {}) for c in calls]
        got = [
            {"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls
        ]
        assert got == want.get("tool_calls", []), text
        assert content == want.get("content", ""), text


def test_qwen3_5_malformed_call_and_the_format_a_template_picks():
    """A block without <function=NAME> is text, not a call (transformers' parser with TRL's
    Qwen3.5 response template): no call, the turn's text as written."""
    text = 'hi <tool_call>\n{"name": "f"}\n</tool_call>'
    assert parse_qwen3_5(text) == (text, [])
    good = "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>"
    content, calls = parse_qwen3_5(text + "\n" + good)
    assert content == text and [c["name"] for c in calls] == ["f"]
    xml = "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
    assert parser_for("auto", xml) is parse_qwen3_5
    assert parser_for("auto", TEMPLATE) is parse_hermes and parser_for("auto", None) is parse_hermes
    assert parser_for("hermes", xml) is parse_hermes  # named: taken as named


# --- running tools -------------------------------------------------------------------------------


def add(a: int, b: int) -> int:
    """Add.

    Args:
        a: First.
        b: Second.
    """
    return a + b


def boom(a: int) -> int:
    """Fail.

    Args:
        a: Anything.
    """
    raise RuntimeError(f"boom {a}")


async def slow_add(a: int, b: int) -> int:
    """Add, slowly.

    Args:
        a: First.
        b: Second.
    """
    await asyncio.sleep(0.01)
    return a + b


async def sleepy(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    await asyncio.sleep(seconds)
    return "awake"


def test_run_tools_results_and_failures():
    tools = resolve_tools([add, boom, slow_add, sleepy])
    rows = [
        [
            {"name": "add", "arguments": {"a": 1, "b": 2}},
            {"name": "slow_add", "arguments": {"a": 3, "b": 4}},
        ],
        [
            {"name": "boom", "arguments": {"a": 5}},
            {"name": "nope", "arguments": {}},
            {"name": "sleepy", "arguments": {"seconds": 30}},
            {"name": "add", "arguments": {"c": 1}},
        ],
    ]
    out = run_tools(rows, tools, timeout=0.2)
    assert out[0] == [("add", 3, False), ("slow_add", 7, False)]
    assert [failed for _, _, failed in out[1]] == [True] * 4
    assert out[1][0][1] == {"error": "boom 5"} and out[1][1][1] == {"error": "Tool nope not found."}
    assert (
        out[1][2][1] == {"error": "timed out after 0.2 s"}
        and "unexpected keyword" in out[1][3][1]["error"]
    )


def test_tool_message_refuses_images():
    """A result is str()'d into the tool message; an image (a PIL image, or TRL's multimodal
    content blocks) would reach the model as a repr, so it is refused, naming the tool."""
    assert tool_message("add", 3) == {"role": "tool", "name": "add", "content": "3"}
    assert tool_message("ls", [{"type": "text", "text": "a"}])["content"].startswith("[{")
    pil_image = type("Image", (), {"__module__": "PIL.Image"})()
    for result in (pil_image, [{"type": "text", "text": "a"}, {"type": "image", "image": "a.png"}]):
        with pytest.raises(ValueError, match="tool snap returned an image.*text-only"):
            tool_message("snap", result)


def test_async_tools_run_concurrently():
    """Two async tools that each wait for the other: they only finish if they run at the same time."""
    events = {}

    async def ping(name: str, other: str) -> str:
        """Ping.

        Args:
            name: Mine.
            other: Theirs.
        """
        events.setdefault(name, asyncio.Event()).set()
        await events.setdefault(other, asyncio.Event()).wait()
        return name

    calls = [
        [{"name": "ping", "arguments": {"name": "a", "other": "b"}}],
        [{"name": "ping", "arguments": {"name": "b", "other": "a"}}],
    ]
    assert run_tools(calls, {"ping": ping}, timeout=5.0) == [
        [("ping", "a", False)],
        [("ping", "b", False)],
    ]


def test_resolve_tools_from_config_strings(tmp_path):
    path = tmp_path / "mytools.py"
    path.write_text(
        'def twice(x: int) -> int:\n    """Twice.\n\n    Args:\n        x: A number.\n    """\n'
        "    return 2 * x\n"
    )
    assert resolve_tools([f"{path}:twice"])["twice"](4) == 8
    with pytest.raises(ValueError, match="tool .* no function 'thrice'"):
        resolve_tools([f"{path}:thrice"])
    with pytest.raises(ValueError, match="no docstring"):
        resolve_tools([signatures.no_docstring])
