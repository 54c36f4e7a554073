"""Rollouts: prompts -> G finished completions each, laid out for scoring and the update.

Owns: the `Rollout` record (one generation round of one rank: every field
the rest of the round reads, by name) and `rollout(...)`, which encodes
the prompts, samples with `sampler.generate`, continues completions that
call tools (tools.py runs them, TRL's `tools=`), decodes, and joins
prompt and completion into the [n, P+C] rows the log-prob pass scores.

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
"""

from dataclasses import dataclass

import torch

from nanogrpo import dist
from nanogrpo.fast_sampling import StaticDecoder, sample_next_token_fast
from nanogrpo.sampler import generate
from nanogrpo.tools import (
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
    prompt_ids: list[list[int]]  # one list of token ids per prompt
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
    tool_calls: int = 0  # tool calls made in this round on this rank (failed ones included)
    tool_failures: int = 0  # of which failed: malformed, unknown tool, exception or timeout
    # [n] long: assistant turns per completion (1 without tool calls)
    turns: torch.Tensor | None = None
    # Filled in by the trainer before the update:
    advantages: torch.Tensor | None = None  # [n] fp32, one per completion
    # [n, C] under the policy that sampled (off-policy updates only)
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None  # [n, C] under the reference model (beta > 0 only)
    # scalar: trained tokens of the whole round's step on all ranks
    num_items: torch.Tensor | None = None

    def num_tokens(self) -> int:
        """Real tokens processed in this round on this rank (prompts x G + generated), for
        throughput."""
        return sum(map(len, self.prompt_ids)) * self.num_generations + int(
            self.completion_lengths.sum()
        )


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


def sampling_kwargs(cfg) -> dict:
    """The sampler settings of a TrainConfig, as `generate` takes them. Training draws with the
    sort-free sample_next_token_fast (equal to the plain one) and, with torch_compile, the
    compiled StaticDecoder.
    """
    return dict(
        max_new_tokens=cfg.max_completion_length,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        min_p=cfg.min_p or 0.0,
        repetition_penalty=cfg.repetition_penalty,
        sample_token=sample_next_token_fast,
        decoder=StaticDecoder if cfg.torch_compile else None,
    )


def _continue_with_tools(model, tok, prompt_of, ids, texts, truncated, tools, cfg, generator):
    """The tool rounds (TRL's `_tool_call_loop`) on rows of generated `ids` (lists, extended in
    place). prompt_of[r]: row r's prompt ids. -> (per-row model-token masks, message lists,
    truncated, calls, failures).
    """
    M, limit = cfg.max_completion_length, model.config.max_position_embeddings
    parse = TOOL_CALL_PARSERS[cfg.tool_call_format]
    parsed = [parse(t) for t in texts]
    messages, calls = [[assistant_message(*p)] for p in parsed], [p[1] for p in parsed]
    masks = [[1] * len(x) for x in ids]
    num_calls = num_failed = rounds = 0
    active = [r for r in range(len(ids)) if calls[r]]
    while active and (
        cfg.max_tool_calling_iterations is None or rounds < cfg.max_tool_calling_iterations
    ):
        results = run_tools([calls[r] for r in active], tools, cfg.tool_timeout)
        going = []
        for r, row_results in zip(active, results):
            num_calls += len(row_results)
            num_failed += sum(failed for _, _, failed in row_results)
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
            **{**sampling_kwargs(cfg), "max_new_tokens": max_new}
        )
        new_ids, new_texts = tok.decode_completions(out.completion_ids, out.completion_mask)
        new_truncated = out.truncated.tolist()  # one device-to-host transfer
        for k, r in enumerate(going):
            new = new_ids[k][
                : M - len(ids[r])
            ]  # the whole completion stays within max_completion_length
            truncated[r] = new_truncated[k] or len(new) < len(new_ids[k])
            ids[r] += new
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


def rollout(
    model,
    tok,
    rows: list[dict],
    cfg,
    num_generations: int,
    generator=None,
    autocast=None,
    tools: dict | None = None,
) -> Rollout:
    """Sample `num_generations` completions for each row's prompt with the config's sampling
    settings, calling `tools` ({name: function}, see resolve_tools) -> a Rollout (advantages and
    log-probs not yet filled in).
    """
    schemas = [tool_schema(f) for f in tools.values()] if tools else None
    if tools and isinstance(rows[0]["prompt"], str):
        raise ValueError(
            "tools need conversational prompts (message lists); this dataset's are plain strings"
        )
    encode = dict(
        tools=schemas,
        max_length=getattr(cfg, "max_prompt_length", None),
        **(getattr(cfg, "chat_template_kwargs", None) or {}),
    )
    prompt_ids = [tok.encode_prompt(r["prompt"], **encode) for r in rows]
    was_training = model.training
    model.eval()
    with torch.no_grad(), dist.gathered(model), autocast or torch.autocast("cpu", enabled=False):
        out = generate(
            model,
            prompt_ids,
            num_samples=num_generations,
            stop_ids=tok.eos_token_ids,
            pad_id=tok.pad_token_id,
            generator=generator,
            vocab_size=tok.vocab_size,
            **sampling_kwargs(cfg)
        )
        token_ids, texts = tok.decode_completions(out.completion_ids, out.completion_mask)
        truncated = out.truncated.tolist()
        if tools:
            prompt_of = [prompt_ids[r // num_generations] for r in range(len(token_ids))]
            masks, completions, truncated, calls, failures = _continue_with_tools(
                model, tok, prompt_of, token_ids, texts, truncated, tools, cfg, generator
            )
    model.train(was_training)
    prompts = [r["prompt"] for r in rows for _ in range(num_generations)]
    if tools:  # rows of different lengths, tool-result tokens masked out
        dev, C = out.completion_ids.device, max(map(len, token_ids))
        completion_ids = torch.tensor(
            [x + [tok.pad_token_id] * (C - len(x)) for x in token_ids], device=dev
        )
        model_mask = torch.tensor(
            [m + [0] * (C - len(m)) for m in masks], device=dev, dtype=torch.bool
        )
        truncated = torch.tensor(truncated, device=dev)
        turns = torch.tensor(
            [sum(m["role"] == "assistant" for m in c) for c in completions], device=dev
        )
    else:
        completion_ids, model_mask, truncated, turns = (
            out.completion_ids,
            out.completion_mask,
            out.truncated,
            None,
        )
        completions = (
            texts
            if isinstance(rows[0]["prompt"], str)
            else [[{"role": "assistant", "content": t}] for t in texts]
        )
        calls = failures = 0
    mask = model_mask.float() * (
        (~truncated).float()[:, None] if cfg.mask_truncated_completions else 1.0
    )
    input_ids, attention_mask = join_prompt_completion(
        prompt_ids, completion_ids, tok.pad_token_id, num_generations
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
    )
