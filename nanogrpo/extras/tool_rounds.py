"""Tool rounds (TRL's `tools=` and `_tool_call_loop`): completions that call tools continue.

Owns: `ToolTurns` (what rollout.rollout takes as `turns`: each completion's
tools and their schemas, the `ToolRules` the rounds follow, and `play`, the
tool rounds on the sampler's first turn), `tool_rules` (a TrainConfig's),
`ToolRows` (the batch's rows as they grow), `continue_with_tools`
(parse each completion's tool calls, run them, append the results and
sample again, round after round) and `pad_tool_rows` (the rows of
different lengths it leaves, as the [n,C] tensors a Rollout holds,
tool-result ids masked out).

Does not know about: where a row's functions come from (TRL's `tools`
through trainer.py's setup, or an environment's), rewards, losses, or
other processes.

Tool schemas, parsing and running are extras/tools.py's.

Choices, as TRL's:
- A completion is the model's turns and the tool results between them,
  one token sequence; reward functions get it as messages.
- Tool-result ids are context only: 0 in the completion mask, not in the
  completion's length, but within max_completion_length (a round of
  results that would not fit is dropped: the row ends).
- Calling rows continue together, one `generate` per tool round,
  re-prefilling the conversation so far; the sampler's log-probs of
  tool-result ids are 0.
"""

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from nanogrpo.extras.tools import (
    assistant_message,
    parser_for,
    run_tools,
    tool_message,
    tool_schema,
    tool_suffix_ids,
    typed_arguments,
)
from nanogrpo.sampler import Generation, generate


@dataclass(frozen=True)
class ToolRules:
    """How the tool rounds run: TrainConfig's fields of these names, with its defaults."""

    # how calls are written in the text: hermes, qwen3_5, or auto (the chat template's form)
    tool_call_format: str = "auto"
    max_tool_calling_iterations: int | None = None  # tool rounds per completion; None: unbounded
    tool_timeout: float = 30.0  # seconds an async tool may run before its result is an error


def tool_rules(cfg) -> ToolRules:
    """A TrainConfig's rules of the tool rounds."""
    return ToolRules(
        tool_call_format=cfg.tool_call_format,
        max_tool_calling_iterations=cfg.max_tool_calling_iterations,
        tool_timeout=cfg.tool_timeout,
    )


@dataclass
class ToolTurns:
    """The tool rounds of a rollout: `tools`, {name: function} of every completion or one per
    completion (an environment's methods with the config's tools), their JSON schemas
    (`schemas`: one list for all, or one per completion; None = the tools' own), the `rules`
    the rounds follow, and `run_tools`, what runs a tool round's calls (tools.run_tools; the
    asynchronous sampler's lets go of its model while they run: run/async_rollouts.py)."""

    tools: dict | list[dict]
    schemas: list | None = None
    rules: ToolRules = field(default_factory=ToolRules)
    run_tools: Callable = run_tools

    def __post_init__(self):
        if self.schemas is None and isinstance(self.tools, dict):
            self.schemas = [tool_schema(f) for f in self.tools.values()] or None

    def schemas_of(self, n: int) -> list:
        """[n] the schemas each completion's prompt is rendered with."""
        return self.schemas if isinstance(self.tools, list) else [self.schemas] * n

    def play(self, model, tok, first, *, prompt_of, generator, settings):
        """The tool rounds after the sampler's first turn, `first` = (a sampler.Generation, its
        rows' ids, their texts). prompt_of[r]: row r's prompt ids; settings: the first turn's
        sampler.Sampling. -> (the whole completions as a Generation, tool-result ids 0 in its
        mask; their message lists; {turns, tool_calls, tool_failures}, each [n] long)."""
        out, token_ids, texts = first
        rows = ToolRows(
            ids=token_ids,
            logps=[x[: len(t)] for x, t in zip(out.logprobs.tolist(), token_ids)],
            texts=texts,
            truncated=out.truncated.tolist(),
        )
        more = dict(prompt_of=prompt_of, generator=generator, settings=settings)
        continue_with_tools(model, tok, rows, self, **more)
        whole, counts = pad_tool_rows(rows, tok.pad_token_id, out.completion_ids.device)
        return whole, rows.messages, counts


@dataclass
class ToolRows:
    """The rows of a batch through the tool rounds, one list entry per row, extended in place:
    the generated ids (tool-result ids included), the sampler's log-probs of them (0.0 on tool
    results), the first turn's texts, whether each ran out of room; continue_with_tools fills
    the rest."""

    ids: list[list[int]]
    logps: list[list[float]]
    texts: list[str]
    truncated: list[bool]
    masks: list[list[int]] | None = None  # 1 on the model's tokens, 0 on tool results
    messages: list[list[dict]] | None = None  # the completion as messages
    calls: list[int] | None = None  # tool calls made (failed ones included)
    failures: list[int] | None = None  # of which failed


def continue_with_tools(
    model, tok, rows: ToolRows, turns: ToolTurns, *, prompt_of, generator, settings
):
    """The tool rounds (TRL's `_tool_call_loop`) on `rows`, extended in place (ids, logps,
    truncated) and filled in (masks, messages, calls, failures), with the tools and rules of
    `turns`. prompt_of[r]: row r's prompt ids; settings: the first turn's sampler.Sampling
    (generation_kwargs.sampling_of), whose max_new_tokens (max_completion_length) bounds the
    whole completion."""
    ids, logps, texts, truncated = rows.ids, rows.logps, rows.texts, rows.truncated
    tools, rules = turns.tools, turns.rules
    M, limit = settings.max_new_tokens, model.config.max_position_embeddings
    parser = parser_for(rules.tool_call_format, tok.chat_template)

    def parse(text, r):  # -> (content, calls), arguments typed by row r's tools' schemas
        content, row_calls = parser(text)
        row_tools = tools if isinstance(tools, dict) else tools[r]
        return content, [typed_arguments(c, row_tools) for c in row_calls]

    parsed = [parse(t, r) for r, t in enumerate(texts)]
    messages, calls = [[assistant_message(*p)] for p in parsed], [p[1] for p in parsed]
    masks = [[1] * len(x) for x in ids]
    num_calls, num_failed = [0] * len(ids), [0] * len(ids)  # per row
    rounds = 0
    active = [r for r in range(len(ids)) if calls[r]]
    most = rules.max_tool_calling_iterations
    while active and (most is None or rounds < most):
        row_tools = tools if isinstance(tools, dict) else [tools[r] for r in active]
        results = turns.run_tools([calls[r] for r in active], row_tools, rules.tool_timeout)
        going = []
        for r, row_results in zip(active, results):
            num_calls[r] += len(row_results)
            num_failed[r] += sum(failed for _, _, failed in row_results)
            replies = [tool_message(name, res) for name, res, _ in row_results]
            suffix = tool_suffix_ids(tok, replies)
            if (
                len(ids[r]) + len(suffix) > M
                or len(prompt_of[r]) + len(ids[r]) + len(suffix) >= limit
            ):
                continue  # the results would not fit: dropped, the row ends as it is (TRL)
            messages[r] += replies
            ids[r] += suffix
            logps[r] += [0.0] * len(suffix)  # not sampled
            masks[r] += [0] * len(suffix)
            going.append(r)
        if not going:
            break
        contexts = [prompt_of[r] + ids[r] for r in going]
        max_new = max(1, min(max(M - len(ids[r]) for r in going), limit - max(map(len, contexts))))
        seeds = torch.randint(
            0,
            2**31 - 1,
            (len(going),),
            generator=generator,
            device=generator.device if generator is not None else "cpu",
        ).tolist()
        out = generate(model, contexts, replace(settings, max_new_tokens=max_new), seeds=seeds)
        new_ids, new_texts = tok.decode_completions(out.completion_ids, out.completion_mask)
        new_truncated = out.truncated.tolist()  # one device-to-host transfer
        new_logps = out.logprobs.tolist()  # [len(going)][C'], and one more transfer
        for k, r in enumerate(going):
            room = M - len(ids[r])  # the whole completion stays within max_completion_length
            new = new_ids[k][:room]
            truncated[r] = new_truncated[k] or len(new) < len(new_ids[k])
            ids[r] += new
            logps[r] += new_logps[k][: len(new)]
            masks[r] += [1] * len(new)
            calls[r] = []
            if new:
                content, calls[r] = parse(
                    new_texts[k] if len(new) == len(new_ids[k]) else tok.decode(new), r
                )
                messages[r].append(assistant_message(content, calls[r]))
        active = [r for r in going if calls[r]]
        rounds += 1
    rows.masks, rows.messages, rows.calls, rows.failures = masks, messages, num_calls, num_failed


def pad_tool_rows(rows: ToolRows, pad_id: int, device) -> tuple[Generation, dict]:
    """continue_with_tools' rows -> (a sampler.Generation of them, right-padded to the longest
    row C, tool-result ids 0 in its mask; {turns, tool_calls, tool_failures}, each [n] long)."""
    C = max(map(len, rows.ids))
    whole = Generation(
        completion_ids=torch.tensor([x + [pad_id] * (C - len(x)) for x in rows.ids], device=device),
        completion_mask=torch.tensor(
            [m + [0] * (C - len(m)) for m in rows.masks], device=device, dtype=torch.bool
        ),
        logprobs=torch.tensor(
            [x + [0.0] * (C - len(x)) for x in rows.logps], device=device, dtype=torch.float32
        ),
        truncated=torch.tensor(rows.truncated, device=device),
    )
    turns = [sum(m["role"] == "assistant" for m in c) for c in rows.messages]
    counts = dict(turns=turns, tool_calls=rows.calls, tool_failures=rows.failures)
    return whole, {k: torch.tensor(v, device=device) for k, v in counts.items()}
