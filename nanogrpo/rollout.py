"""Rollouts: prompts -> G finished completions each, laid out for scoring and for the update.

Owns: the `Rollout` record (one generation round of one rank, every field the rest of the round
reads, by name) and `rollout(...)`, which encodes the prompts, samples with `sampler.generate`,
decodes the completions and joins prompt and completion into the [n, P+C] rows the log-prob pass
scores.

Does not know about: rewards, advantages or losses (train.py fills the `advantages`, `old_logps`,
`ref_logps` and `num_items` fields), optimizers, or files.

Choices:
- Rows are grouped: prompt i's G completions are rows i*G .. i*G+G-1, as in the sampler and TRL.
- One completion mask: `completion_mask` [n,C] is 1 on exactly the tokens the loss trains on
  (generated tokens up to and including the first stop token; a truncated row is all 0 when
  mask_truncated_completions is on). Lengths for metrics come from `completion_lengths`.
- Completions reach reward functions as TRL passes them: strings for plain-text prompts, a one-message
  list `[{"role": "assistant", "content": text}]` for conversational prompts. Special tokens are
  skipped in the text; the ids up to each row's end go to `completion_ids` of reward functions.
- The sampling phase runs in eval mode, without gradient, with FSDP2 parameters gathered once for
  the whole phase (`dist.gathered`), never once per decode step.
"""

from dataclasses import dataclass

import torch

from nanogrpo import dist
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
    completions: list  # [n] decoded completion: str, or [{"role": "assistant", "content": str}]
    completion_token_ids: list[list[int]]  # [n] each row's generated ids, up to its end
    # Filled in by the trainer before the update:
    advantages: torch.Tensor | None = None  # [n] fp32, one per completion
    old_logps: torch.Tensor | None = None  # [n, C] under the policy that sampled (off-policy updates only)
    ref_logps: torch.Tensor | None = None  # [n, C] under the reference model (beta > 0 only)
    num_items: torch.Tensor | None = None  # scalar: trained tokens of the whole round's step on all ranks

    @property
    def completion_ids(self) -> torch.Tensor:
        """[n, C] the generated ids (right-padded): the last C columns of input_ids."""
        return self.input_ids[:, -self.completion_mask.shape[1]:]

    def num_tokens(self) -> int:
        """Real tokens processed in this round on this rank (prompts x G + generated), for throughput."""
        return sum(map(len, self.prompt_ids)) * self.num_generations + int(self.completion_lengths.sum())


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
    """The sampler settings of a TrainConfig, as `generate` takes them."""
    return dict(max_new_tokens=cfg.max_completion_length, temperature=cfg.temperature, top_k=cfg.top_k,
                top_p=cfg.top_p, min_p=cfg.min_p, repetition_penalty=cfg.repetition_penalty)


def rollout(model, tok, rows: list[dict], cfg, num_generations: int, generator=None, autocast=None) -> Rollout:
    """Sample `num_generations` completions for each row's prompt with the config's sampling settings
    and return them as a Rollout (advantages and log-probs not yet filled in)."""
    prompt_ids = [tok.encode_prompt(r["prompt"]) for r in rows]
    was_training = model.training
    model.eval()
    with torch.no_grad(), dist.gathered(model), autocast or torch.autocast("cpu", enabled=False):
        out = generate(model, prompt_ids, num_samples=num_generations, stop_ids=tok.eos_token_ids,
                       pad_id=tok.pad_token_id, generator=generator, vocab_size=tok.vocab_size,
                       **sampling_kwargs(cfg))
    model.train(was_training)
    token_ids, texts = tok.decode_completions(out.completion_ids, out.completion_mask)
    prompts = [r["prompt"] for r in rows for _ in range(num_generations)]
    completions = texts if isinstance(rows[0]["prompt"], str) else [[{"role": "assistant", "content": t}]
                                                                  for t in texts]
    mask = out.completion_mask.float()
    if cfg.mask_truncated_completions:
        mask = mask * (~out.truncated).float()[:, None]
    input_ids, attention_mask = join_prompt_completion(prompt_ids, out.completion_ids, tok.pad_token_id,
                                                       num_generations)
    return Rollout(rows, num_generations, prompt_ids, input_ids, attention_mask, mask,
                   out.completion_mask.sum(1), out.truncated, prompts, completions, token_ids)
