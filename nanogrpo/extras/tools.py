"""Tool calling: tool schemas, parsing tool calls, running them.

Owns: `tool_schema` (a Python function -> the JSON schema transformers'
`get_json_schema` makes of it), the parsers of TOOL_CALL_PARSERS: `parse_hermes` (the
Hermes/Qwen2.5/Qwen3 `<tool_call>{json}` form) and `parse_qwen3_5` (Qwen3.5's
`<function=...>`/`<parameter=...>` form, its text arguments typed by `typed_arguments`),
`parser_for` (the format a chat template writes), `resolve_tools`, `run_tools` (sync and
async tools, with a timeout), `tool_message` (a result as a tool message; an image is refused:
the models are text-only) and the ids a chat template puts after a tool call
(`tool_suffix_ids`).

Does not know about: sampling, losses, or the model: extras/tool_rounds.py
runs the calls between generation rounds, with the functions the config's
`tools` and environments bring.

Of extras/reward_funcs.py it uses `import_function`, to resolve "module:function"; of
extras/datasets.py the content-part types that carry an image.
"""

import asyncio
import enum
import inspect
import json
import math
import re
import types
import typing

from nanogrpo.extras.datasets import IMAGE_PARTS

# -----------------------------------------------------------------------------
# Tool schemas: a Python function -> the JSON schema transformers' `get_json_schema` makes of it

_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
_BARE = {
    **{t: {"type": k} for t, k in _SCALARS.items()},
    list: {"type": "array"},
    tuple: {"type": "array"},
    dict: {"type": "object"},
    typing.Any: {},
}


def _enum_schema(values: list) -> dict:
    """{"type": t or [t1, t2, ...] (JSON types in order of first appearance), "enum": values}."""
    kinds = list(dict.fromkeys(_SCALARS.get(type(v)) for v in values))
    if None in kinds:
        raise ValueError(
            f"enum values {values!r}: only int, float, str, bool and None can be JSON enum values"
        )
    return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": list(values)}


def _type_schema(hint) -> dict:
    """A type hint -> its JSON schema (a new dict). ValueError for hints JSON cannot describe."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is None and isinstance(hint, type) and issubclass(hint, enum.Enum) and list(hint):
        return _enum_schema([m.value for m in hint])
    if origin is None:
        if hint in _BARE:
            return dict(_BARE[hint])
        raise ValueError(
            f"type hint {hint!r} has no JSON schema: use int, float, str, bool, None, Enum, "
            "Literal, or list/tuple/dict/Union of those"
        )
    if origin in (typing.Union, types.UnionType):
        parts = [_type_schema(a) for a in args if a is not type(None)]
        if len(parts) == 1:
            out = parts[0]
        elif all(
            set(p) == {"type"} and isinstance(p["type"], str) for p in parts
        ):  # plain types: a type list
            kinds = sorted({p["type"] for p in parts})
            out = {"type": kinds[0] if len(kinds) == 1 else kinds}
        else:
            out = {"anyOf": parts}
        return {**out, "nullable": True} if type(None) in args else out
    if origin is typing.Literal and args:
        return _enum_schema(list(args))
    if origin is list:
        return {"type": "array", **({"items": _type_schema(args[0])} if args else {})}
    if origin is tuple:
        if len(args) == 1 or ... in args:
            raise ValueError(
                f"type hint {hint!r}: use list[...] for a variable-length or one-element tuple"
            )
        return {
            "type": "array",
            **({"prefixItems": [_type_schema(a) for a in args]} if args else {}),
        }
    if origin is dict:
        return {
            "type": "object",
            **({"additionalProperties": _type_schema(args[1])} if len(args) == 2 else {}),
        }
    raise ValueError(f"type hint {hint!r} has no JSON schema")


def _docstring_parts(doc: str) -> tuple[str, dict, str | None]:
    """A Google-style docstring -> (description, {argument: description}, returns description or
    None)."""
    sections, current = {"": []}, ""
    for line in doc.split("\n"):
        if line.strip() in ("Args:", "Returns:", "Raises:"):
            current = line.strip()
            sections[current] = []
        else:
            sections[current].append(line)
    args, indent = {}, None
    for line in (x for x in sections.get("Args:", []) if x.strip()):
        depth, head = len(line) - len(line.lstrip()), re.match(r"\s*(\w+):(.*)", line)
        if head and (indent is None or depth <= indent):  # a new argument at the block's own depth
            indent, name = depth, head.group(1)
            args[name] = head.group(2).strip()
        elif indent is not None:  # a continuation line
            args[name] = (args[name] + " " + line.strip()).strip()
    returns = "\n".join(sections["Returns:"]).strip() if "Returns:" in sections else None
    return "\n".join(sections[""]).strip(), args, returns


def tool_schema(fn) -> dict:
    """The JSON schema of a tool function, equal to transformers' `get_json_schema(fn)`: its type
    hints and Google-style docstring (Args:, Returns:, a trailing `(choices: [...])` -> enum);
    required = arguments without a default. ValueError naming the function where transformers
    raises."""
    name = getattr(fn, "__name__", "operation")
    doc = inspect.getdoc(fn)
    if not doc:
        raise ValueError(
            f"tool {name}: has no docstring; write a Google-style one with an Args: block"
        )
    description, arg_docs, returns_doc = _docstring_parts(doc.strip())
    params = list(inspect.signature(fn).parameters.values())
    if (
        params
        and params[0].name in ("self", "cls")
        and params[0].annotation is inspect.Parameter.empty
    ):
        params = params[1:]
    hints, properties = typing.get_type_hints(fn), {}
    for p in params:
        if p.annotation is inspect.Parameter.empty:
            raise ValueError(f"tool {name}: argument {p.name!r} has no type hint")
        if p.name not in arg_docs:
            raise ValueError(
                f"tool {name}: the docstring's Args: block does not describe argument {p.name!r}"
            )
        try:
            schema, desc = _type_schema(hints[p.name]), arg_docs[p.name]
        except ValueError as e:
            raise ValueError(f"tool {name}: argument {p.name!r}: {e}") from None
        choices = re.search(r"\(choices:\s*(.*?)\)\s*$", desc, flags=re.IGNORECASE)
        if choices:
            schema["enum"] = [
                c.strip() if isinstance(c, str) else c for c in json.loads(choices.group(1))
            ]
            desc = desc[: choices.start()].strip()
        properties[p.name] = {**schema, "description": desc}
    parameters = {"type": "object", "properties": properties}
    required = [p.name for p in params if p.default is inspect.Parameter.empty]
    if required:
        parameters["required"] = required
    out = {"name": name, "description": description, "parameters": parameters}
    try:  # a return type JSON cannot describe is left out, as transformers does
        out["return"] = _type_schema(hints["return"])
        out["return"].update({"description": returns_doc} if returns_doc is not None else {})
    except (KeyError, ValueError):
        pass
    return {"type": "function", "function": out}


# -----------------------------------------------------------------------------
# Tool calls: parsed from the generated text, then run. A parser: text -> (the turn's text content,
# [call]); a call is {"name": str, "arguments": dict, or what the model wrote}. A turn with a
# block that does not read as a call is plain text with no calls, as TRL reads it (its
# parse_response falls back to the decoded text): the turn's text stays as written, nothing runs,
# nothing counts as a call or a failure, and the completion ends there.


def _hermes_call(body: str) -> dict | None:
    """One `<tool_call>` body -> {"name", "arguments"}, or None when it is not a call: JSON that
    does not parse, not an object, or no string "name". Missing or null arguments are {}; a JSON
    string of an object is read as that object; other arguments stay as written (running them
    fails, as in TRL)."""
    try:
        call = json.loads(body)
    except ValueError:  # json.JSONDecodeError is a ValueError
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    args = call.get("arguments")
    if args is None:
        args = {}
    if isinstance(args, str):
        try:
            decoded = json.loads(args)
        except ValueError:
            decoded = None
        args = decoded if isinstance(decoded, dict) else args
    return {"name": call["name"], "arguments": args}


def parse_hermes(text: str) -> tuple[str, list[dict]]:
    """The Hermes/Qwen form: each call is `<tool_call>{"name": ..., "arguments":
    {...}}</tool_call>`. One block that is not a call makes the whole turn plain text (text
    unchanged, no calls)."""
    calls = []
    for body in re.findall(r"<tool_call>(.*?)</tool_call>", text, flags=re.DOTALL):
        call = _hermes_call(body)
        if call is None:
            return text, []
        calls.append(call)
    return text.split("<tool_call>", 1)[0].rstrip(), calls


def parse_qwen3_5(text: str) -> tuple[str, list[dict]]:
    """Qwen3.5's form (Qwen3-Coder's XML): `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE
    \n</parameter>\n...</function>\n</tool_call>`. Values are text, as written (a string
    argument is not quoted); `typed_arguments` types them by the tool's schema. A block without
    `<function=NAME>` is not a call but text, as transformers' parser reads it with TRL's
    Qwen3.5 response template."""
    calls = []
    start = None  # where the first call begins: the content is the text before it
    for block in re.finditer(r"<tool_call>(.*?)</tool_call>", text, flags=re.DOTALL):
        body = block.group(1)
        name = re.match(r"\s*<function=([^\n>]+)>", body)
        if name is None:
            continue
        pairs = re.findall(r"<parameter=([^>\n]+)>\s*(.*?)\s*</parameter>", body, flags=re.DOTALL)
        calls.append({"name": name.group(1), "arguments": dict(pairs), "text_arguments": True})
        start = block.start() if start is None else start
    return text[:start].rstrip(), calls


TOOL_CALL_PARSERS = {"hermes": parse_hermes, "qwen3_5": parse_qwen3_5}  # more formats plug in here


def parser_for(tool_call_format: str, chat_template: str | None):
    """The parser of `tool_call_format`; "auto": the form the chat template writes its calls in
    (`<function=` for Qwen3.5's, else Hermes)."""
    if tool_call_format == "auto":
        xml = chat_template is not None and "<function=" in chat_template
        tool_call_format = "qwen3_5" if xml else "hermes"
    return TOOL_CALL_PARSERS[tool_call_format]


def _coerce(text: str, kinds: list) -> object:
    """text as the first JSON type of `kinds` it reads as; else the text itself."""
    for kind in kinds:
        try:
            if kind == "integer":
                number = float(text)
                if number.is_integer():
                    return int(text) if text.strip().lstrip("+-").isdigit() else int(number)
            elif kind == "number":
                number = float(text)
                if math.isfinite(number):
                    whole = number.is_integer() and "." not in text
                    return int(number) if whole else number
            elif kind == "boolean" and text.strip().lower() in ("true", "false", "1", "0"):
                return text.strip().lower() in ("true", "1")
            elif kind == "null" and text.strip() in ("null", "None"):
                return None
            elif kind in ("object", "array"):
                value = json.loads(text)
                if isinstance(value, dict if kind == "object" else list):
                    return value
        except ValueError:
            continue
    return text


def _kinds(schema: dict) -> list:
    """The JSON types a parameter's schema allows, in its order (anyOf's, then null if nullable)."""
    kind = schema.get("type")
    kinds = [kind] if isinstance(kind, str) else list(kind or [])
    for part in schema.get("anyOf") or schema.get("oneOf") or []:
        kinds += _kinds(part)
    return kinds + ["null"] * bool(schema.get("nullable"))


def typed_arguments(call: dict, tools: dict) -> dict:
    """A parsed call whose arguments are text (parse_qwen3_5) with each one read as its type in
    the tool's schema, as transformers' parse_response does given the tools: a string stays
    text, a number becomes one, an unknown parameter or tool or an unreadable value stays text."""
    if not call.get("text_arguments") or call["name"] not in tools:
        return call
    params = tool_schema(tools[call["name"]])["function"]["parameters"].get("properties", {})
    args = {
        k: _coerce(v, _kinds(params[k])) if k in params else v for k, v in call["arguments"].items()
    }
    return {"name": call["name"], "arguments": args}


def assistant_message(content: str, calls: list[dict]) -> dict:
    """One assistant turn as transformers' chat templates read it (OpenAI-style `tool_calls`)."""
    tool_calls = [
        {"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in calls
    ]
    return {
        "role": "assistant",
        "content": content,
        **({"tool_calls": tool_calls} if calls else {}),
    }


def resolve_tools(specs) -> dict:
    """Config entries ("module:function", "path/file.py:function") or callables -> {name:
    function}."""
    from nanogrpo.extras.reward_funcs import import_function

    out = {}
    for spec in specs or ():
        if not callable(spec):
            spec = import_function(spec, kind="tool")
        tool_schema(spec)  # a bad signature fails here, before the first rollout
        out[spec.__name__] = spec
    return out


def run_tools(
    calls: list[list[dict]], tools: dict | list[dict], timeout: float
) -> list[list[tuple[str, object, bool]]]:
    """Run every row's calls: sync tools in order, async ones all concurrently, each under `timeout`
    seconds. tools: {name: function} for every row, or one such dict per row (an environment's
    methods, bound to that row's instance). An unknown tool, arguments it does not take, an
    exception or a timeout gives {"error": message}. -> per row, per call: (name, result,
    failed)."""
    out = [[None] * len(row) for row in calls]
    pending = []  # (row, call index, coroutine)
    for i, row in enumerate(calls):
        row_tools = tools if isinstance(tools, dict) else tools[i]
        for j, call in enumerate(row):
            fn = row_tools.get(call["name"])
            try:
                if fn is None:  # TRL's message for an unknown tool
                    raise ValueError(f"Tool {call['name']} not found.")
                result = fn(**call["arguments"])
                if inspect.isawaitable(result):
                    pending.append((i, j, result))
                else:
                    out[i][j] = (call["name"], result, False)
            except Exception as e:
                out[i][j] = (call["name"], {"error": str(e)}, True)
    if pending:

        async def gather():
            return await asyncio.gather(
                *(asyncio.wait_for(c, timeout) for _, _, c in pending), return_exceptions=True
            )

        for (i, j, _), result in zip(pending, asyncio.run(gather())):
            if isinstance(result, asyncio.TimeoutError):
                result = TimeoutError(f"timed out after {timeout} s")
            failed = isinstance(result, Exception)
            out[i][j] = (calls[i][j]["name"], {"error": str(result)} if failed else result, failed)
    return out


def tool_message(name: str, result) -> dict:
    """A tool's result -> the tool message appended to the conversation: {"role": "tool", "name",
    "content": str(result)}. A result that is an image (a PIL image, or TRL's multimodal content
    blocks: a list with an {"type": "image"} part) is refused with a ValueError naming the tool:
    nanogrpo's models read text only, and str() would hand the model the object's repr."""
    parts = result if isinstance(result, list) else []
    is_image = type(result).__module__.split(".")[0] == "PIL" or any(
        isinstance(p, dict) and p.get("type") in IMAGE_PARTS for p in parts
    )
    if is_image:
        raise ValueError(
            f"tool {name} returned an image ({type(result).__name__}); nanogrpo trains text-only "
            "models, which cannot see it: return text instead (a description, or the image's path)"
        )
    return {"role": "tool", "name": name, "content": str(result)}


def tool_suffix_ids(tok, tool_messages: list[dict]) -> list[int]:
    """The ids that follow an assistant turn's end token when `tool_messages` answer it: the tool
    turns and the next generation prompt, as the chat template renders them (TRL's construction: a
    small user -> assistant(tool call) conversation rendered with and without the tool messages)."""
    call = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    head = [
        {"role": "user", "content": "dummy"},
        {"role": "assistant", "content": "", "tool_calls": call},
    ]
    prefix = tok.encode(
        tok.apply_chat_template(head, add_generation_prompt=False), add_special_tokens=False
    )
    full = tok.encode(
        tok.apply_chat_template(head + tool_messages, add_generation_prompt=True),
        add_special_tokens=False,
    )
    ends = [k for k, t in enumerate(prefix) if t in tok.eos_token_ids]
    # the turn as generated ends at its stop token
    prefix = prefix[: ends[-1] + 1] if ends else prefix
    if full[: len(prefix)] != prefix:
        raise ValueError(
            "this chat template does not preserve prefixes (a conversation renders differently "
            "once tool messages follow), so tool results cannot be appended to the generated ids; "
            "give the checkpoint a prefix-preserving chat_template.jinja (TRL swaps in its own "
            "for some families)"
        )
    return full[len(prefix) :]
