"""Rollouts: prompts -> G finished completions each (tool turns included), laid out for scoring and the update.

Owns: the `Rollout` record (one generation round of one rank, every field the rest of the round
reads, by name) and `rollout(...)`, which encodes the prompts, samples with `sampler.generate`, runs
the tools the completions call and continues them (TRL's `tools=`), decodes, and joins prompt and
completion into the [n, P+C] rows the log-prob pass scores. Tool helpers: `tool_schema` (transformers'
`get_json_schema`), `parse_tool_calls` (the Hermes/Qwen `<tool_call>` form; more in TOOL_CALL_PARSERS).

Does not know about: rewards, advantages or losses (train.py fills the `advantages`, `old_logps`,
`ref_logps` and `num_items` fields), optimizers, or files.

Choices:
- Rows are grouped: prompt i's G completions are rows i*G .. i*G+G-1, as in the sampler and TRL.
- One completion mask: `completion_mask` [n,C] is 1 on exactly the tokens the loss trains on
  (generated tokens up to and including the first stop token; a truncated row is all 0 when
  mask_truncated_completions is on). Lengths for metrics come from `completion_lengths`.
- Completions reach reward functions as TRL passes them: strings for plain-text prompts, a message
  list `[{"role": "assistant", "content": text}, ...]` for conversational ones (special tokens
  skipped); the ids up to each row's end go to `completion_ids` of reward functions.
- The sampling phase runs in eval mode, without gradient, with FSDP2 parameters gathered once for
  the whole phase (`dist.gathered`), never once per decode step.
- Tools, as TRL: a completion is the model's turns and the tool results between them, one token
  sequence; reward functions get it as messages (assistant turns with `tool_calls`, tool messages).
  Tool-result ids = the difference between two renderings (with and without the tool messages), so
  the template must preserve prefixes (else an error). They are context only: 0 in `completion_mask`
  (out of the loss, the dapo/bnpo token count, entropy and KL), not in `completion_lengths`, but
  within max_completion_length: a round of results that would not fit is dropped (the row ends).
  Calling rows continue together, one `generate` per tool round (per-row seeds), re-prefilling the
  conversation so far (no KV cache is kept across rounds).
"""

import asyncio
import enum
import inspect
import json
import re
import types
import typing
from dataclasses import dataclass

import torch

from nanogrpo import dist
from nanogrpo.fast_sampling import StaticDecoder, sample_next_token_fast
from nanogrpo.sampler import generate


@dataclass
class Rollout:
    """One generation round on one rank. n = prompts x G rows, P = longest prompt, C = longest completion."""

    rows: list[dict]  # the dataset rows sampled, one per prompt (their columns go to reward functions)
    num_generations: int  # G
    prompt_ids: list[list[int]]  # one list of token ids per prompt
    input_ids: torch.Tensor  # [n, P+C] long: left-padded prompt, then the right-padded completion
    attention_mask: torch.Tensor  # [n, P+C] long: 1 on real prompt tokens and on every completion slot
    completion_mask: torch.Tensor  # [n, C] float: 1 on the tokens the loss trains on
    completion_lengths: torch.Tensor  # [n] long: generated tokens per row (the stop token included)
    truncated: torch.Tensor  # [n] bool: no stop token within max_completion_length
    prompts: list  # [n] each row's prompt, as reward functions receive it (str or message list)
    completions: list  # [n] decoded completion: str, or a message list (assistant turns, tool results)
    completion_token_ids: list[list[int]]  # [n] each row's ids up to its end (tool-result ids included)
    tool_calls: int = 0  # tool calls made in this round on this rank (failed ones included)
    tool_failures: int = 0  # of which failed: malformed, unknown tool, exception or timeout
    turns: torch.Tensor | None = None  # [n] long: assistant turns per completion (1 without tool calls)
    # Filled in by the trainer before the update:
    advantages: torch.Tensor | None = None  # [n] fp32, one per completion
    old_logps: torch.Tensor | None = None  # [n, C] under the policy that sampled (off-policy updates only)
    ref_logps: torch.Tensor | None = None  # [n, C] under the reference model (beta > 0 only)
    num_items: torch.Tensor | None = None  # scalar: trained tokens of the whole round's step on all ranks

    def num_tokens(self) -> int:
        """Real tokens processed in this round on this rank (prompts x G + generated), for throughput."""
        return sum(map(len, self.prompt_ids)) * self.num_generations + int(self.completion_lengths.sum())


# -----------------------------------------------------------------------------
# Tool schemas: a Python function -> the JSON schema transformers' `get_json_schema` makes of it

_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
_BARE = {**{t: {"type": k} for t, k in _SCALARS.items()}, list: {"type": "array"}, tuple: {"type": "array"},
         dict: {"type": "object"}, typing.Any: {}}


def _enum_schema(values: list) -> dict:
    """{"type": t or [t1, t2, ...] (JSON types in order of first appearance), "enum": values}."""
    kinds = list(dict.fromkeys(_SCALARS.get(type(v)) for v in values))
    if None in kinds:
        raise ValueError(f"enum values {values!r}: only int, float, str, bool and None can be JSON enum values")
    return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": list(values)}


def _type_schema(hint) -> dict:
    """A type hint -> its JSON schema (a new dict). ValueError for hints JSON cannot describe."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is None and isinstance(hint, type) and issubclass(hint, enum.Enum) and list(hint):
        return _enum_schema([m.value for m in hint])
    if origin is None:
        if hint in _BARE:
            return dict(_BARE[hint])
        raise ValueError(f"type hint {hint!r} has no JSON schema: use int, float, str, bool, None, Enum, Literal, "
                         "or list/tuple/dict/Union of those")
    if origin in (typing.Union, types.UnionType):
        parts = [_type_schema(a) for a in args if a is not type(None)]
        if len(parts) == 1:
            out = parts[0]
        elif all(set(p) == {"type"} and isinstance(p["type"], str) for p in parts):  # plain types: a type list
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
            raise ValueError(f"type hint {hint!r}: use list[...] for a variable-length or one-element tuple")
        return {"type": "array", **({"prefixItems": [_type_schema(a) for a in args]} if args else {})}
    if origin is dict:
        return {"type": "object", **({"additionalProperties": _type_schema(args[1])} if len(args) == 2 else {})}
    raise ValueError(f"type hint {hint!r} has no JSON schema")


def _docstring_parts(doc: str) -> tuple[str, dict, str | None]:
    """A Google-style docstring -> (description, {argument: description}, returns description or None)."""
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
    """The JSON schema of a tool function, equal to transformers' `get_json_schema(fn)`: its type hints and
    Google-style docstring (Args:, Returns:, a trailing `(choices: [...])` -> enum); required = arguments
    without a default. ValueError naming the function where transformers raises."""
    name = getattr(fn, "__name__", "operation")
    doc = inspect.getdoc(fn)
    if not doc:
        raise ValueError(f"tool {name}: has no docstring; write a Google-style one with an Args: block")
    description, arg_docs, returns_doc = _docstring_parts(doc.strip())
    params = list(inspect.signature(fn).parameters.values())
    if params and params[0].name in ("self", "cls") and params[0].annotation is inspect.Parameter.empty:
        params = params[1:]
    hints, properties = typing.get_type_hints(fn), {}
    for p in params:
        if p.annotation is inspect.Parameter.empty:
            raise ValueError(f"tool {name}: argument {p.name!r} has no type hint")
        if p.name not in arg_docs:
            raise ValueError(f"tool {name}: the docstring's Args: block does not describe argument {p.name!r}")
        try:
            schema, desc = _type_schema(hints[p.name]), arg_docs[p.name]
        except ValueError as e:
            raise ValueError(f"tool {name}: argument {p.name!r}: {e}") from None
        choices = re.search(r"\(choices:\s*(.*?)\)\s*$", desc, flags=re.IGNORECASE)
        if choices:
            schema["enum"] = [c.strip() if isinstance(c, str) else c for c in json.loads(choices.group(1))]
            desc = desc[:choices.start()].strip()
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
# [call]); a call is {"name": str, "arguments": dict}, plus "error": str when it could not be read.


def parse_hermes(text: str) -> tuple[str, list[dict]]:
    """The Hermes/Qwen form: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""
    calls = []
    for body in re.findall(r"<tool_call>(.*?)</tool_call>", text, flags=re.DOTALL):
        try:
            call = json.loads(body)
            args = call.get("arguments", {}) if isinstance(call, dict) else None
            args = json.loads(args) if isinstance(args, str) else args
            if not isinstance(args, dict) or not isinstance(call.get("name"), str):
                raise ValueError('expected {"name": str, "arguments": object}')
            calls.append({"name": call["name"], "arguments": args})
        except ValueError as e:  # json.JSONDecodeError is a ValueError
            calls.append({"name": "unknown", "arguments": {}, "error": f"malformed tool call {body.strip()!r}: {e}"})
    return text.split("<tool_call>", 1)[0].rstrip(), calls


TOOL_CALL_PARSERS = {"hermes": parse_hermes}  # another model family's format plugs in here


def parse_tool_calls(text: str, format: str = "hermes") -> list[dict]:
    """The tool calls in a text: [{"name", "arguments"}]; one that could not be read: name "unknown", + "error"."""
    return TOOL_CALL_PARSERS[format](text)[1]


def assistant_message(content: str, calls: list[dict]) -> dict:
    """One assistant turn as transformers' chat templates read it (OpenAI-style `tool_calls`)."""
    tool_calls = [{"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
    return {"role": "assistant", "content": content, **({"tool_calls": tool_calls} if calls else {})}


def resolve_tools(specs) -> dict:
    """Config entries ("module:function", "path/file.py:function") or callables -> {name: function}."""
    from nanogrpo.rewards import import_function
    out = {}
    for spec in specs or ():
        if not callable(spec):
            spec = import_function(spec, kind="tool")
        tool_schema(spec)  # a bad signature fails here, before the first rollout
        out[spec.__name__] = spec
    return out


def run_tools(calls: list[list[dict]], tools: dict, timeout: float) -> list[list[tuple[str, object, bool]]]:
    """Run every row's calls: sync tools in order, async ones all concurrently, each under `timeout`
    seconds. A malformed call, an unknown tool, an exception or a timeout gives {"error": message}.
    -> per row, per call: (name, result, failed)."""
    out = [[None] * len(row) for row in calls]
    pending = []  # (row, call index, coroutine)
    for i, row in enumerate(calls):
        for j, call in enumerate(row):
            fn = tools.get(call["name"])
            try:
                if "error" in call or fn is None:  # TRL's message for an unknown tool
                    raise ValueError(call.get("error") or f"Tool {call['name']} not found.")
                result = fn(**call["arguments"])
                if inspect.isawaitable(result):
                    pending.append((i, j, result))
                else:
                    out[i][j] = (call["name"], result, False)
            except Exception as e:
                out[i][j] = (call["name"], {"error": str(e)}, True)
    if pending:
        async def gather():
            return await asyncio.gather(*(asyncio.wait_for(c, timeout) for _, _, c in pending), return_exceptions=True)

        for (i, j, _), result in zip(pending, asyncio.run(gather())):
            if isinstance(result, asyncio.TimeoutError):
                result = TimeoutError(f"timed out after {timeout} s")
            failed = isinstance(result, Exception)
            out[i][j] = (calls[i][j]["name"], {"error": str(result)} if failed else result, failed)
    return out


def tool_suffix_ids(tok, tool_messages: list[dict]) -> list[int]:
    """The ids that follow an assistant turn's end token when `tool_messages` answer it: the tool
    turns and the next generation prompt, as the chat template renders them (TRL's construction: a
    small user -> assistant(tool call) conversation rendered with and without the tool messages)."""
    call = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    head = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": call}]
    prefix = tok.encode(tok.apply_chat_template(head, add_generation_prompt=False), add_special_tokens=False)
    full = tok.encode(tok.apply_chat_template(head + tool_messages, add_generation_prompt=True),
                      add_special_tokens=False)
    ends = [k for k, t in enumerate(prefix) if t in tok.eos_token_ids]
    prefix = prefix[:ends[-1] + 1] if ends else prefix  # the turn as generated ends at its stop token
    if full[:len(prefix)] != prefix:
        raise ValueError("this chat template does not preserve prefixes (a conversation renders differently once tool"
                         " messages follow), so tool results cannot be appended to the generated ids; give the "
                         "checkpoint a prefix-preserving chat_template.jinja (TRL swaps in its own for some families)")
    return full[len(prefix):]


# -----------------------------------------------------------------------------
# Rollout


def join_prompt_completion(prompt_ids: list[list[int]], completion_ids, pad_id: int, num_generations: int):
    """Left-padded prompts (each repeated G times) followed by the completions.
    -> input_ids [n, P+C], attention_mask [n, P+C] (1 on real prompt tokens and on the completion)."""
    P = max(len(p) for p in prompt_ids)
    n, C = completion_ids.shape
    input_ids = torch.full((n, P + C), pad_id, dtype=torch.long, device=completion_ids.device)
    attention_mask = torch.zeros((n, P + C), dtype=torch.long, device=completion_ids.device)
    for i, p in enumerate(prompt_ids):
        rows = slice(i * num_generations, (i + 1) * num_generations)
        input_ids[rows, P - len(p):P] = torch.tensor(p, device=completion_ids.device)
        attention_mask[rows, P - len(p):] = 1
    input_ids[:, P:] = completion_ids
    return input_ids, attention_mask


def sampling_kwargs(cfg) -> dict:
    """The sampler settings of a TrainConfig, as `generate` takes them. Training draws with the sort-free
    sample_next_token_fast (equal to the plain one) and, with torch_compile, the compiled StaticDecoder."""
    return dict(max_new_tokens=cfg.max_completion_length, temperature=cfg.temperature, top_k=cfg.top_k,
                top_p=cfg.top_p, min_p=cfg.min_p, repetition_penalty=cfg.repetition_penalty,
                sample_token=sample_next_token_fast, decoder=StaticDecoder if cfg.torch_compile else None)


def _continue_with_tools(model, tok, prompt_of, ids, texts, truncated, tools, cfg, generator):
    """The tool rounds (TRL's `_tool_call_loop`) on rows of generated `ids` (lists, extended in place).
    prompt_of[r]: row r's prompt ids. -> (per-row model-token masks, message lists, truncated, calls, failures)."""
    M, limit = cfg.max_completion_length, model.config.max_position_embeddings
    parse = TOOL_CALL_PARSERS[cfg.tool_call_format]
    parsed = [parse(t) for t in texts]
    messages, calls = [[assistant_message(*p)] for p in parsed], [p[1] for p in parsed]
    masks = [[1] * len(x) for x in ids]
    num_calls = num_failed = rounds = 0
    active = [r for r in range(len(ids)) if calls[r]]
    while active and (cfg.max_tool_calling_iterations is None or rounds < cfg.max_tool_calling_iterations):
        results = run_tools([calls[r] for r in active], tools, cfg.tool_timeout)
        going = []
        for r, row_results in zip(active, results):
            num_calls += len(row_results)
            num_failed += sum(failed for _, _, failed in row_results)
            replies = [{"role": "tool", "name": name, "content": str(res)} for name, res, _ in row_results]
            suffix = tool_suffix_ids(tok, replies)
            if len(ids[r]) + len(suffix) > M or len(prompt_of[r]) + len(ids[r]) + len(suffix) >= limit:
                continue  # the results would not fit: dropped, the row ends as it is (TRL)
            messages[r] += replies
            ids[r] += suffix
            masks[r] += [0] * len(suffix)
            going.append(r)
        if not going:
            break
        contexts = [prompt_of[r] + ids[r] for r in going]
        max_new = max(1, min(max(M - len(ids[r]) for r in going), limit - max(map(len, contexts))))
        seeds = torch.randint(0, 2**31 - 1, (len(going),), generator=generator,
                              device=generator.device if generator is not None else "cpu").tolist()
        out = generate(model, contexts, num_samples=1, stop_ids=tok.eos_token_ids, pad_id=tok.pad_token_id,
                       seeds=seeds, vocab_size=tok.vocab_size, **{**sampling_kwargs(cfg), "max_new_tokens": max_new})
        new_ids, new_texts = tok.decode_completions(out.completion_ids, out.completion_mask)
        new_truncated = out.truncated.tolist()  # one device-to-host transfer
        for k, r in enumerate(going):
            new = new_ids[k][:M - len(ids[r])]  # the whole completion stays within max_completion_length
            truncated[r] = new_truncated[k] or len(new) < len(new_ids[k])
            ids[r] += new
            masks[r] += [1] * len(new)
            calls[r] = []
            if new:
                content, calls[r] = parse(new_texts[k] if len(new) == len(new_ids[k]) else tok.decode(new))
                messages[r].append(assistant_message(content, calls[r]))
        active = [r for r in going if calls[r]]
        rounds += 1
    return masks, messages, truncated, num_calls, num_failed


def rollout(model, tok, rows: list[dict], cfg, num_generations: int, generator=None, autocast=None,
            tools: dict | None = None) -> Rollout:
    """Sample `num_generations` completions for each row's prompt with the config's sampling settings, calling
    `tools` ({name: function}, see resolve_tools) -> a Rollout (advantages and log-probs not yet filled in)."""
    schemas = [tool_schema(f) for f in tools.values()] if tools else None
    if tools and isinstance(rows[0]["prompt"], str):
        raise ValueError("tools need conversational prompts (message lists); this dataset's are plain strings")
    prompt_ids = [tok.encode_prompt(r["prompt"], tools=schemas) for r in rows]
    was_training = model.training
    model.eval()
    with torch.no_grad(), dist.gathered(model), autocast or torch.autocast("cpu", enabled=False):
        out = generate(model, prompt_ids, num_samples=num_generations, stop_ids=tok.eos_token_ids,
                       pad_id=tok.pad_token_id, generator=generator, vocab_size=tok.vocab_size,
                       **sampling_kwargs(cfg))
        token_ids, texts = tok.decode_completions(out.completion_ids, out.completion_mask)
        truncated = out.truncated.tolist()
        if tools:
            prompt_of = [prompt_ids[r // num_generations] for r in range(len(token_ids))]
            masks, completions, truncated, calls, failures = _continue_with_tools(
                model, tok, prompt_of, token_ids, texts, truncated, tools, cfg, generator)
    model.train(was_training)
    prompts = [r["prompt"] for r in rows for _ in range(num_generations)]
    if tools:  # rows of different lengths, tool-result tokens masked out
        dev, C = out.completion_ids.device, max(map(len, token_ids))
        completion_ids = torch.tensor([x + [tok.pad_token_id] * (C - len(x)) for x in token_ids], device=dev)
        model_mask = torch.tensor([m + [0] * (C - len(m)) for m in masks], device=dev, dtype=torch.bool)
        truncated = torch.tensor(truncated, device=dev)
        turns = torch.tensor([sum(m["role"] == "assistant" for m in c) for c in completions], device=dev)
    else:
        completion_ids, model_mask, truncated, turns = out.completion_ids, out.completion_mask, out.truncated, None
        completions = texts if isinstance(rows[0]["prompt"], str) else [[{"role": "assistant", "content": t}]
                                                                      for t in texts]
        calls = failures = 0
    mask = model_mask.float() * ((~truncated).float()[:, None] if cfg.mask_truncated_completions else 1.0)
    input_ids, attention_mask = join_prompt_completion(prompt_ids, completion_ids, tok.pad_token_id, num_generations)
    return Rollout(rows, num_generations, prompt_ids, input_ids, attention_mask, mask, model_mask.sum(1), truncated,
                   prompts, completions, token_ids, calls, failures, turns)
