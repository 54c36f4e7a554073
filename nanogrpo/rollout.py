"""Rollouts: prompts -> G finished completions each, laid out for scoring and the update.

Owns: the `Rollout` record (one generation round of one rank: every field
the rest of the round reads, by name) and `rollout(...)`, which encodes
the prompts, samples with `sampler.generate`, continues completions that
call tools (tools.py runs them, TRL's `tools=`), decodes, and joins
prompt and completion into the [n, P+C] rows the log-prob pass scores.
With environments (TRL's `environment_factory`), an `Episodes` record of
environments.py gives each completion its prompt and tools: rollout takes
it as `episodes`, and knows nothing else of environments.
Also `select_groups` and `concat_rollouts`, for DAPO's dynamic sampling:
keep the groups of a round whose rewards differ, join rounds into one.

Does not know about: rewards, advantages or losses (train.py fills the
`advantages`, `old_logps`, `ref_logps` and `num_items` fields),
optimizers, or files.

Choices:
- Rows are grouped: prompt i's G completions are rows i*G .. i*G+G-1, as
  in the sampler and TRL.
- One completion mask: `completion_mask` [n,C] is 1 on exactly the tokens
  the loss trains on (generated tokens up to and including the first
  stop token; a truncated row is all 0 when mask_truncated_completions is
  on). Lengths for metrics come from `completion_lengths`.
- Completions reach reward functions as TRL passes them: strings for
  plain-text prompts, a message list for conversational ones (special
  tokens skipped); the ids up to each row's end go to `completion_ids`.
- The sampling phase runs in eval mode, without gradient, with FSDP2
  parameters gathered once for the whole phase (`dist.gathered`).
- Tools, as TRL: a completion is the model's turns and the tool results
  between them, one token sequence; reward functions get it as messages.
  Tool-result ids are context only: 0 in `completion_mask`, not in
  `completion_lengths`, but within max_completion_length (a round of
  results that would not fit is dropped: the row ends). Calling rows
  continue together, one `generate` per tool round, re-prefilling the
  conversation so far.
- The sampler's own log-probs are kept: `sampling_logps` [n,C] is each
  sampled token's log-prob under the distribution it was drawn from
  (after temperature, top-k, top-p, min-p), what vLLM returns with
  logprobs_mode="processed_logprobs"; TRL's importance-sampling
  correction compares it with the trainer's. 0 on tool-result ids.
- A group's G completions share one prompt, encoded and prefilled once,
  unless `episodes` gives them different prompts (different observations
  of their environments' reset): then each completion has its own, and
  `prompt_ids` holds one entry per completion.
- A rollout's rows can be picked by group and rollouts joined (before
  the trainer fills in its fields): the joined rows are re-padded to the
  longest prompt and completion, which changes no scored log-prob.
"""

from dataclasses import dataclass

import torch

from nanogrpo import dist
from nanogrpo.fast.sampling import StaticDecoder, sample_next_token_fast
from nanogrpo.sampler import generate, generation_settings
from nanogrpo.extras.tools import (
    TOOL_CALL_PARSERS,
    assistant_message,
    run_tools,
    tool_schema,
    tool_suffix_ids,
)


@dataclass
class Rollout:
    """One generation round on one rank. n = prompts x G rows, P = longest prompt, C = longest
    completion."""

    rows: list[
        dict
    ]  # the dataset rows sampled, one per prompt (their columns go to reward functions)
    num_generations: int  # G
    # token ids of each prompt, or of each completion's prompt (n lists) when the completions of
    # a prompt were given different ones (row_prompt_ids: each row's, either way)
    prompt_ids: list[list[int]]
    input_ids: torch.Tensor  # [n, P+C] long: left-padded prompt, then the right-padded completion
    # [n, P+C] long: 1 on real prompt tokens and on every completion slot
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor  # [n, C] float: 1 on the tokens the loss trains on
    completion_lengths: torch.Tensor  # [n] long: generated tokens per row (the stop token included)
    truncated: torch.Tensor  # [n] bool: no stop token within max_completion_length
    prompts: list  # [n] each row's prompt, as reward functions receive it (str or message list)
    # [n] decoded completion: str, or a message list (assistant turns, tool results)
    completions: list
    # [n] each row's ids up to its end (tool-result ids included)
    completion_token_ids: list[list[int]]
    # [n] long: tool calls each completion made (failed ones included); None without tools
    tool_calls: torch.Tensor | None = None
    # [n] long: of which failed (malformed, unknown tool, exception or timeout); None without tools
    tool_failures: torch.Tensor | None = None
    # [n] long: assistant turns per completion (1 without tool calls); None without tools
    turns: torch.Tensor | None = None
    # [n, C] fp32: the sampler's log-prob of each token it drew (after temperature and the
    # filters); 0 where the model sampled nothing (padding, tool results)
    sampling_logps: torch.Tensor | None = None
    # {name: [n] values} reward functions receive beside the dataset's columns: `environments`
    # (each completion's environment), a rollout_func's extra fields; None without
    extra_fields: dict | None = None
    # Filled in by the trainer before the update:
    advantages: torch.Tensor | None = None  # [n] fp32, one per completion
    # [n, C] under the policy that sampled (off-policy updates only)
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None  # [n, C] under the reference model (beta > 0 only)
    # [n, C] the policy's without dropout, for the sampler correction (on-policy LoRA dropout)
    trainer_logps: torch.Tensor | None = None
    # scalar: trained tokens of the whole round's step on all ranks
    num_items: torch.Tensor | None = None

    def num_tokens(self) -> int:
        """Real tokens processed in this round on this rank (prompts x G + generated), for
        throughput."""
        copies = len(self.completion_lengths) // max(1, len(self.prompt_ids))
        return sum(map(len, self.prompt_ids)) * copies + int(self.completion_lengths.sum())

    def row_prompt_ids(self) -> list[list[int]]:
        """[n] each row's prompt ids, whether prompt_ids holds one per prompt or one per row."""
        copies = len(self.completions) // max(1, len(self.prompt_ids))
        return [p for p in self.prompt_ids for _ in range(copies)]


# -----------------------------------------------------------------------------
# Rollout


def join_prompt_completion(
    prompt_ids: list[list[int]], completion_ids, pad_id: int, num_generations: int
):
    """Left-padded prompts (each repeated G times) followed by the completions.
    -> input_ids [n, P+C], attention_mask [n, P+C] (1 on real prompt tokens and on the completion).
    """
    P = max(len(p) for p in prompt_ids)
    n, C = completion_ids.shape
    input_ids = torch.full((n, P + C), pad_id, dtype=torch.long, device=completion_ids.device)
    attention_mask = torch.zeros((n, P + C), dtype=torch.long, device=completion_ids.device)
    for i, p in enumerate(prompt_ids):
        rows = slice(i * num_generations, (i + 1) * num_generations)
        input_ids[rows, P - len(p) : P] = torch.tensor(p, device=completion_ids.device)
        attention_mask[rows, P - len(p) :] = 1
    input_ids[:, P:] = completion_ids
    return input_ids, attention_mask


def sampling_kwargs(cfg, tok=None) -> dict:
    """The sampler settings of a TrainConfig, as `generate` takes them: the sampling fields, then
    generation_kwargs over them (TRL's order: its keys win). Stop strings are matched on
    `tok.decode` of the generated ids, so they need `tok`. Training draws with the sort-free
    sample_next_token_fast (equal to the plain one) and, with torch_compile, the compiled
    StaticDecoder.
    """
    settings = dict(
        max_new_tokens=cfg.max_completion_length,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        min_p=cfg.min_p or 0.0,
        repetition_penalty=cfg.repetition_penalty,
        sample_token=sample_next_token_fast,
        decoder=StaticDecoder if cfg.torch_compile else None,
    )
    settings.update(generation_settings(getattr(cfg, "generation_kwargs", None)))
    if settings.get("stop_strings"):
        if tok is None:
            raise ValueError("generation_kwargs' stop strings need the tokenizer: "
                             "sampling_kwargs(cfg, tok)")
        settings["decode"] = tok.decode
    return settings


def _continue_with_tools(
    model, tok, prompt_of, ids, logps, texts, truncated, tools, cfg, generator
):
    """The tool rounds (TRL's `_tool_call_loop`) on rows of generated `ids` and their sampler
    log-probs `logps` (lists of the same lengths, extended in place: 0.0 for tool-result ids).
    prompt_of[r]: row r's prompt ids; tools: {name: function} of every row, or one per row.
    -> (per-row model-token masks, message lists, truncated, tool calls, failed tool calls).
    """
    M, limit = cfg.max_completion_length, model.config.max_position_embeddings
    parse = TOOL_CALL_PARSERS[cfg.tool_call_format]
    parsed = [parse(t) for t in texts]
    messages, calls = [[assistant_message(*p)] for p in parsed], [p[1] for p in parsed]
    masks = [[1] * len(x) for x in ids]
    num_calls, num_failed = [0] * len(ids), [0] * len(ids)  # per row
    rounds = 0
    active = [r for r in range(len(ids)) if calls[r]]
    while active and (
        cfg.max_tool_calling_iterations is None or rounds < cfg.max_tool_calling_iterations
    ):
        row_tools = tools if isinstance(tools, dict) else [tools[r] for r in active]
        results = run_tools([calls[r] for r in active], row_tools, cfg.tool_timeout)
        going = []
        for r, row_results in zip(active, results):
            num_calls[r] += len(row_results)
            num_failed[r] += sum(failed for _, _, failed in row_results)
            replies = [
                {"role": "tool", "name": name, "content": str(res)} for name, res, _ in row_results
            ]
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
        out = generate(
            model,
            contexts,
            num_samples=1,
            stop_ids=tok.eos_token_ids,
            pad_id=tok.pad_token_id,
            seeds=seeds,
            vocab_size=tok.vocab_size,
            **{**sampling_kwargs(cfg, tok), "max_new_tokens": max_new}
        )
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
                    new_texts[k] if len(new) == len(new_ids[k]) else tok.decode(new)
                )
                messages[r].append(assistant_message(content, calls[r]))
        active = [r for r in going if calls[r]]
        rounds += 1
    return masks, messages, truncated, num_calls, num_failed


def encode_prompts(tok, prompts: list, schemas: list, G: int, cfg) -> tuple[list, int]:
    """Token ids of the prompts of n = groups x G completions (prompts[r], rendered with the tool
    schemas schemas[r]): each group's once when its G completions share prompt and tools (the
    sampler prefills it once for all G), else each completion's own.
    -> (the ids, completions per entry: G or 1)."""
    encode = dict(
        max_length=getattr(cfg, "max_prompt_length", None),
        **(getattr(cfg, "chat_template_kwargs", None) or {}),
    )
    shared = all(
        prompts[i + j] == prompts[i] and schemas[i + j] == schemas[i]
        for i in range(0, len(prompts), G)
        for j in range(1, G)
    )
    step = G if shared else 1
    ids = [
        tok.encode_prompt(prompts[r], tools=schemas[r], **encode)
        for r in range(0, len(prompts), step)
    ]
    return ids, step


def rollout(
    model,
    tok,
    rows: list[dict],
    cfg,
    num_generations: int,
    generator=None,
    autocast=None,
    tools: dict | None = None,
    episodes=None,
) -> Rollout:
    """Sample `num_generations` completions for each row's prompt with the config's sampling
    settings, calling `tools` ({name: function}, see resolve_tools) -> a Rollout (advantages and
    log-probs not yet filled in). With `episodes` (environments.Episodes, one entry per
    completion), each completion has the prompt and tools given there instead, and the Rollout's
    extra_fields hold its environment for the reward functions.
    """
    G = num_generations
    if episodes is None:
        prompts = [r["prompt"] for r in rows for _ in range(G)]
        row_tools = tools or {}
        schemas = [tool_schema(f) for f in tools.values()] if tools else None
        row_schemas = [schemas] * len(prompts)
    else:
        prompts, row_tools, row_schemas = episodes.prompts, episodes.tools, episodes.schemas
    calling = any(row_tools) if isinstance(row_tools, list) else bool(row_tools)
    if calling and isinstance(prompts[0], str):
        raise ValueError(
            "tools need conversational prompts (message lists); this dataset's are plain strings"
        )
    prompt_ids, step = encode_prompts(tok, prompts, row_schemas, G, cfg)
    was_training = model.training
    model.eval()
    with torch.no_grad(), dist.gathered(model), autocast or torch.autocast("cpu", enabled=False):
        out = generate(
            model,
            prompt_ids,
            num_samples=step,
            stop_ids=tok.eos_token_ids,
            pad_id=tok.pad_token_id,
            generator=generator,
            vocab_size=tok.vocab_size,
            **sampling_kwargs(cfg, tok)
        )
        token_ids, texts = tok.decode_completions(out.completion_ids, out.completion_mask)
        truncated = out.truncated.tolist()
        if calling:
            prompt_of = [prompt_ids[r // step] for r in range(len(token_ids))]
            # each row's sampler log-probs, as long as its ids
            logps = [x[: len(t)] for x, t in zip(out.logprobs.tolist(), token_ids)]
            masks, completions, truncated, calls, failures = _continue_with_tools(
                model, tok, prompt_of, token_ids, logps, texts, truncated, row_tools, cfg, generator
            )
    model.train(was_training)
    if calling:  # rows of different lengths, tool-result tokens masked out
        dev, C = out.completion_ids.device, max(map(len, token_ids))
        completion_ids = torch.tensor(
            [x + [tok.pad_token_id] * (C - len(x)) for x in token_ids], device=dev
        )
        model_mask = torch.tensor(
            [m + [0] * (C - len(m)) for m in masks], device=dev, dtype=torch.bool
        )
        sampling_logps = torch.tensor(
            [x + [0.0] * (C - len(x)) for x in logps], device=dev, dtype=torch.float32
        )  # [n,C]
        truncated = torch.tensor(truncated, device=dev)
        turns = torch.tensor(
            [sum(m["role"] == "assistant" for m in c) for c in completions], device=dev
        )
        calls, failures = torch.tensor(calls, device=dev), torch.tensor(failures, device=dev)
    else:
        completion_ids, model_mask, truncated, turns = (
            out.completion_ids,
            out.completion_mask,
            out.truncated,
            None,
        )
        sampling_logps = out.logprobs  # [n,C], 0 off the completion
        completions = (
            texts
            if isinstance(prompts[0], str)
            else [[{"role": "assistant", "content": t}] for t in texts]
        )
        calls = failures = None
    mask = model_mask.float() * (
        (~truncated).float()[:, None] if cfg.mask_truncated_completions else 1.0
    )
    input_ids, attention_mask = join_prompt_completion(
        prompt_ids, completion_ids, tok.pad_token_id, step
    )
    return Rollout(
        rows,
        num_generations,
        prompt_ids,
        input_ids,
        attention_mask,
        mask,
        model_mask.sum(1),
        truncated,
        prompts,
        completions,
        token_ids,
        calls,
        failures,
        turns,
        sampling_logps,
        {"environments": episodes.instances} if episodes is not None else None,
    )


# -----------------------------------------------------------------------------
# Picking groups and joining rounds (DAPO's dynamic sampling)

# filled in by the trainer: a rollout is picked from or joined before them
TRAINER_FIELDS = ("advantages", "old_logps", "ref_logps", "trainer_logps", "num_items")


def _check_unfilled(ro, caller):
    """ValueError if the trainer has filled in any of ro's TRAINER_FIELDS."""
    for name in TRAINER_FIELDS:
        if getattr(ro, name) is not None:
            raise ValueError(
                f"{caller} takes a rollout before the trainer fills it in; its {name} is set"
            )


def select_groups(ro: Rollout, groups: list[int]) -> Rollout:
    """The rollout of the prompts `groups` (indices into ro.rows, in the order given): group i is
    rows i*G .. i*G+G-1, and every per-row field is cut to those rows (the tool counts and extra
    fields too: those of the completions kept). Widths stay as they are. ValueError if the
    trainer's fields are filled or an index is out of range.
    """
    _check_unfilled(ro, "select_groups")
    G = ro.num_generations
    for i in groups:
        if not 0 <= i < len(ro.rows):
            raise ValueError(f"group {i} is not in [0, {len(ro.rows)})")
    picked = [i * G + j for i in groups for j in range(G)]  # the rows kept
    index = torch.tensor(picked, dtype=torch.long, device=ro.input_ids.device)  # [m]

    def rows_of(x):  # [n, ...] -> [m, ...]
        return None if x is None else x[index]

    if len(ro.prompt_ids) == len(ro.rows):  # one entry per prompt
        prompt_ids = [ro.prompt_ids[i] for i in groups]
    else:  # one per completion
        prompt_ids = [ro.prompt_ids[r] for r in picked]
    extra_fields = None
    if ro.extra_fields is not None:
        extra_fields = {k: [values[r] for r in picked] for k, values in ro.extra_fields.items()}
    return Rollout(
        rows=[ro.rows[i] for i in groups],
        num_generations=G,
        prompt_ids=prompt_ids,
        input_ids=rows_of(ro.input_ids),
        attention_mask=rows_of(ro.attention_mask),
        completion_mask=rows_of(ro.completion_mask),
        completion_lengths=rows_of(ro.completion_lengths),
        truncated=rows_of(ro.truncated),
        prompts=[ro.prompts[r] for r in picked],
        completions=[ro.completions[r] for r in picked],
        completion_token_ids=[ro.completion_token_ids[r] for r in picked],
        tool_calls=rows_of(ro.tool_calls),
        tool_failures=rows_of(ro.tool_failures),
        turns=rows_of(ro.turns),
        sampling_logps=rows_of(ro.sampling_logps),
        extra_fields=extra_fields,
    )


def _fit(x, width, fill, left=False):
    """x [n,W] -> [n,width]: padded with `fill` on the right (on the left if `left`), or cut
    there, keeping the columns on the other side."""
    n, W = x.shape
    k = min(W, width)  # columns kept
    out = x.new_full((n, width), fill)
    if left:
        out[:, width - k :] = x[:, W - k :]
    else:
        out[:, :k] = x[:, :k]
    return out


def concat_rollouts(rollouts: list[Rollout], pad_id: int) -> Rollout:
    """All the rows of `rollouts`, in order, as one Rollout. The rows are re-padded, as
    join_prompt_completion pads them, to P = the longest prompt and C = the longest completion
    of all (a wider rollout's extra columns are padding only, so they are cut): the prompt part
    is left-padded (pad_id, attention 0), the completion part right-padded (pad_id, attention 1,
    completion_mask and sampling_logps 0). A rollout without tools counts 0 tool calls and
    failures and 1 turn per row (None if no rollout has them); sampling_logps is None unless
    every rollout has it; an extra field a rollout lacks is None on its rows. prompt_ids holds
    one entry per prompt when every rollout's does, else one per completion.
    ValueError if the list is empty, the rollouts differ in num_generations, or the trainer's
    fields are filled.
    """
    if not rollouts:
        raise ValueError("concat_rollouts needs at least one rollout")
    G = rollouts[0].num_generations
    for ro in rollouts:
        _check_unfilled(ro, "concat_rollouts")
        if ro.num_generations != G:
            raise ValueError(
                f"rollouts of num_generations {G} and {ro.num_generations} cannot be joined"
            )
    P = max(len(p) for ro in rollouts for p in ro.prompt_ids)
    C = max(1, max(len(x) for ro in rollouts for x in ro.completion_token_ids))
    input_ids = []
    attention_mask = []
    for ro in rollouts:
        W = ro.completion_mask.shape[1]  # this rollout's completion width
        ids = ro.input_ids
        prompt = _fit(ids[:, :-W], P, pad_id, left=True)  # [n,P]
        input_ids.append(torch.cat([prompt, _fit(ids[:, -W:], C, pad_id)], dim=1))  # [n,P+C]
        mask = ro.attention_mask
        prompt = _fit(mask[:, :-W], P, 0, left=True)  # [n,P]
        attention_mask.append(torch.cat([prompt, _fit(mask[:, -W:], C, 1)], dim=1))  # [n,P+C]
    with_logps = all(ro.sampling_logps is not None for ro in rollouts)

    per_prompt = all(len(ro.prompt_ids) == len(ro.rows) for ro in rollouts)
    names = dict.fromkeys(name for ro in rollouts for name in ro.extra_fields or {})
    extra_fields = {
        name: [v for ro in rollouts
               for v in (ro.extra_fields or {}).get(name, [None] * len(ro.completions))]
        for name in names
    }

    def per_row(name, fill):  # [n] long of each rollout, `fill` where it has none
        values = [getattr(ro, name) for ro in rollouts]
        if all(x is None for x in values):
            return None
        return torch.cat([
            torch.full_like(ro.completion_lengths, fill) if x is None else x
            for ro, x in zip(rollouts, values)
        ])

    return Rollout(
        rows=[r for ro in rollouts for r in ro.rows],
        num_generations=G,
        prompt_ids=[p for ro in rollouts
                    for p in (ro.prompt_ids if per_prompt else ro.row_prompt_ids())],
        input_ids=torch.cat(input_ids),
        attention_mask=torch.cat(attention_mask),
        completion_mask=torch.cat([_fit(ro.completion_mask, C, 0) for ro in rollouts]),
        completion_lengths=torch.cat([ro.completion_lengths for ro in rollouts]),
        truncated=torch.cat([ro.truncated for ro in rollouts]),
        prompts=[p for ro in rollouts for p in ro.prompts],
        completions=[c for ro in rollouts for c in ro.completions],
        completion_token_ids=[x for ro in rollouts for x in ro.completion_token_ids],
        tool_calls=per_row("tool_calls", 0),
        tool_failures=per_row("tool_failures", 0),
        turns=per_row("turns", 1),
        sampling_logps=(
            torch.cat([_fit(ro.sampling_logps, C, 0.0) for ro in rollouts])
            if with_logps
            else None
        ),
        extra_fields=extra_fields or None,
    )
