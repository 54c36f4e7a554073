"""Rollouts: prompts -> G finished completions each, laid out for scoring and the update.

Owns: the `Rollout` record (one generation round of one rank: every field the rest of the round
reads, by name) and `rollout(...)`, which encodes the prompts, samples with `sampler.generate`
(with the sampler.Sampling `settings` it is given), decodes, and joins prompt and completion into
the [n, P+C] rows the log-prob pass scores.

Does not know about: rewards, advantages or losses (train.py fills the `advantages`,
`old_logps`, `ref_logps`, `trainer_logps` and `num_items` fields), optimizers, or files.

Left out, and where it lives: the config's sampler settings and generation_kwargs
(nanogrpo/extras/generation_kwargs.py's sampling_of, taken as `settings`), the tool rounds of
completions that call tools (nanogrpo/extras/tool_rounds.py's ToolTurns, taken as `turns`),
environments (nanogrpo/extras/environments.py: an `Episodes` record gives each completion its
prompt and turns, taken as `episodes`), a config's rollout_func in place of all of this
(nanogrpo/extras/custom_rollout.py), picking groups and joining rounds for DAPO's dynamic sampling
(nanogrpo/extras/dynamic_sampling.py), and the fast draw and compiled decode step
(nanogrpo/fast/sampling.py, in `settings`).

Choices:
- Rows are grouped: prompt i's G completions are rows i*G .. i*G+G-1, as in the sampler and TRL.
- One completion mask: `completion_mask` [n,C] is 1 on exactly the tokens the loss trains on
  (generated tokens up to and including the first stop token; a truncated row is all 0 when
  mask_truncated_completions is on). Lengths for metrics come from `completion_lengths`.
- Completions reach reward functions as TRL passes them: strings for plain-text prompts, a
  message list for conversational ones (special tokens skipped); the ids up to each row's end go
  to `completion_ids`.
- The sampling phase runs in eval mode, without gradient, with FSDP2 parameters gathered once
  for the whole phase (`dist.gathered`).
- The sampler's own log-probs are kept: `sampling_logps` [n,C] is each sampled token's log-prob
  under the distribution it was drawn from (after temperature, top-k, top-p, min-p), what vLLM
  returns with logprobs_mode="processed_logprobs"; TRL's importance-sampling correction compares
  it with the trainer's.
- A group's G completions share one prompt, encoded and prefilled once, unless `episodes` gives
  them different prompts (different observations of their environments' reset), or a group
  spans ranks (train.py's round_prompts hands each completion out as its own row): then each
  completion has its own, and `prompt_ids` holds one entry per completion.
"""

from dataclasses import dataclass

import torch

from nanogrpo import distributed as dist
from nanogrpo.model import eval_mode
from nanogrpo.sampler import Sampling, generate


@dataclass(kw_only=True)
class Rollout:
    """One generation round on one rank. n = prompts x G rows, P = longest prompt, C = longest
    completion."""

    # the dataset rows sampled, one per prompt (their columns go to reward functions)
    rows: list[dict]
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
    # [n] long: of which failed (unknown tool, bad arguments, exception, timeout); None: no tools
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


def join_prompt_completion(prompt_ids, completion_ids, pad_id, num_generations):
    """Each prompt left-padded, num_generations times, then the completions [n,C] -> input_ids,
    attention_mask [n, P+C] (1 on real prompt tokens and on the completion)."""
    P = max(len(p) for p in prompt_ids)
    n, C = completion_ids.shape
    both = torch.zeros((2, n, P), dtype=torch.long)  # prompt [ids, mask]: on the CPU, one copy
    both[0] = pad_id
    for i, p in enumerate(prompt_ids):
        rows = slice(i * num_generations, (i + 1) * num_generations)
        both[0, rows, P - len(p) :] = torch.tensor(p, dtype=torch.long)
        both[1, rows, P - len(p) :] = 1
    ids, mask = dist.to_device(both, completion_ids.device)
    ones = torch.ones_like(completion_ids)
    return torch.cat([ids, completion_ids], 1), torch.cat([mask, ones], 1)


def trained_mask(model_mask, truncated, mask_truncated_completions: bool) -> torch.Tensor:
    """The completion mask the loss trains on [n,C] float: the model's tokens, none of a truncated
    row with mask_truncated_completions (TRL's rule)."""
    mask = model_mask.float()
    if mask_truncated_completions:
        mask = mask * (~truncated).float()[:, None]
    return mask


def encode_prompts(tok, prompts: list, schemas: list, G: int, encode: dict) -> tuple[list, int]:
    """Token ids of the prompts of n = groups x G completions (with their tool schemas and
    tok.encode_prompt's keyword arguments `encode`), a group's once where its G share prompt and
    tools (see Choices above) -> (the ids, completions per entry: G or 1)."""
    shared = all(
        prompts[i + j] == prompts[i] and schemas[i + j] == schemas[i]
        for i in range(0, len(prompts), G)
        for j in range(1, G)
    )
    step = G if shared else 1
    starts = range(0, len(prompts), step)
    ids = [tok.encode_prompt(prompts[r], tools=schemas[r], **encode) for r in starts]
    return ids, step


def rollout(
    model,
    tok,
    rows: list[dict],
    *,
    num_generations: int,
    settings: Sampling,
    encode: dict | None = None,
    mask_truncated_completions: bool = False,
    generator=None,
    turns=None,
    episodes=None,
) -> Rollout:
    """Sample `num_generations` completions of each row's prompt as `settings` say -> a Rollout
    (advantages and log-probs not yet filled in), under the caller's autocast if any. encode:
    tok.encode_prompt's keyword arguments (max_length: TRL's max_prompt_length, template
    variables). turns, episodes: None, or the tool rounds and environments (see Left out above);
    with episodes, extra_fields hold each completion's environment for the reward functions."""
    G = num_generations
    if episodes is None:
        prompts = [r["prompt"] for r in rows for _ in range(G)]
    else:  # each completion's own prompt and tools (rows may have no prompt)
        prompts, turns = episodes.prompts, episodes.turns
    if turns is not None and isinstance(prompts[0], str):
        raise ValueError(
            "tools need conversational prompts (message lists); this dataset's are plain strings"
        )
    schemas = [None] * len(prompts) if turns is None else turns.schemas_of(len(prompts))
    prompt_ids, step = encode_prompts(tok, prompts, schemas, G, encode or {})
    with torch.no_grad(), dist.gathered(model), eval_mode(model):
        out = generate(model, prompt_ids, settings, num_samples=step, generator=generator)
        token_ids, texts = tok.decode_completions(out.completion_ids, out.completion_mask)
        completions, counts = texts, {}
        if turns is not None:  # rows of different lengths, tool-result tokens masked out
            prompt_of = [prompt_ids[r // step] for r in range(len(token_ids))]
            first = (out, token_ids, texts)  # the sampler's first turn
            more = dict(prompt_of=prompt_of, generator=generator, settings=settings)
            out, completions, counts = turns.play(model, tok, first, **more)
        elif not isinstance(prompts[0], str):
            completions = [[{"role": "assistant", "content": t}] for t in texts]
    mask = trained_mask(out.completion_mask, out.truncated, mask_truncated_completions)
    input_ids, attention_mask = join_prompt_completion(
        prompt_ids, out.completion_ids, tok.pad_token_id, step
    )
    return Rollout(
        rows=rows,
        num_generations=num_generations,
        prompt_ids=prompt_ids,
        input_ids=input_ids,
        attention_mask=attention_mask,
        completion_mask=mask,
        completion_lengths=out.completion_mask.sum(1),
        truncated=out.truncated,
        prompts=prompts,
        completions=completions,
        completion_token_ids=token_ids,
        sampling_logps=out.logprobs,  # [n,C], 0 off the completion and on tool results
        extra_fields=None if episodes is None else {"environments": episodes.instances},
        **counts,
    )
