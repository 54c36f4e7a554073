"""Per-token log-probs and entropies of completion tokens; KL estimators.

Owns: scoring sampled tokens under a model (the policy, the old policy, the reference model:
`frozen_logprobs`), TR-DPO's reference update (`sync_ref_model`) and `kl_divergence`.
`token_logprobs` is the definition: full logits, log_softmax, gather. `policy_logprobs` is the
update's scoring: token_logprobs with gradient.

Does not know about: losses, sampling, or processes (under FSDP2 a model's forward gathers
what it needs; `policy_logprobs` takes the loss's advantages, beta and entropy_bonus only to
share its signature with fast/logprobs.py's twin, which skips rows without gradient).

Of the model it calls `model(input_ids, attention_mask=)` -> logits [N,L,V], and model.py's
`eval_mode`.

Choices: temperature divides the logits before the softmax, as TRL scores, and the entropy is the
tempered distribution's, in nats. Positions with completion_mask == 0 come out as exactly 0 (no
NaN). With the model's cast_lm_head_to_fp32 the LM head runs in float32 (the model's forward
does it).

Left out, in nanogrpo/fast/logprobs.py (tests hold it equal to this file, values and
gradients): the LM head in chunks, never the full [N,C,V] logits; rows that share a prompt
sharing its forward; rows whose advantage is 0 scored without gradient; the entropy's gradient
only when asked.
"""

import contextlib

import torch

from nanogrpo.model import eval_mode


def check_shapes(input_ids, attention_mask, completion_mask, temperature):
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            "input_ids and attention_mask must both be [N,L]; got "
            f"{tuple(input_ids.shape)} and {tuple(attention_mask.shape)}"
        )
    N, L = input_ids.shape
    C = completion_mask.shape[-1]
    if completion_mask.dim() != 2 or completion_mask.shape[0] != N or not 0 < C < L:
        raise ValueError(
            f"completion_mask must be [N,C] with N={N} and 0 < C < L={L} "
            f"(at least one prompt token); got {tuple(completion_mask.shape)}"
        )
    if not temperature > 0:
        raise ValueError(
            f"temperature={temperature} must be > 0 (scoring divides the logits by it)"
        )


# -----------------------------------------------------------------------------
# The definition


def token_logprobs(
    model, input_ids, attention_mask, completion_mask, temperature=1.0, vocab_size=None
):
    """(logps, entropy) [N,C] of each completion token under `model`, fp32 (fp64 for an fp64
    model), 0 where completion_mask [N,C] is 0. input_ids, attention_mask [N,L]: a left-padded
    prompt, then the right-padded completion in the last C positions. vocab_size: normalize over
    the first vocab_size logits only (the sampler's support when the embedding has padded rows);
    None = all, as TRL does."""
    check_shapes(input_ids, attention_mask, completion_mask, temperature)
    C = completion_mask.shape[1]
    logits = model(input_ids, attention_mask=attention_mask)  # [N,L,V]
    # position i predicts token i+1: the last C tokens come from L-C-1..L-2
    logits = logits[:, -C - 1 : -1, :vocab_size]  # [N,C,V]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    targets = input_ids[:, -C:, None]  # [N,C,1]
    logps = logp_all.gather(-1, targets).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    keep = completion_mask.bool()
    zero = torch.zeros_like(logps)
    return torch.where(keep, logps, zero), torch.where(keep, entropy, zero)


def policy_logprobs(
    model,
    input_ids,
    attention_mask,
    completion_mask,
    advantages,
    *,
    beta,
    entropy_bonus,
    world_size=1,
    temperature=1.0,
    vocab_size=None,
):
    """The update's scoring: token_logprobs of every row, with gradient (advantages [N], beta,
    entropy_bonus and world_size are for fast/logprobs.py's twin, which skips rows without it)."""
    return token_logprobs(
        model, input_ids, attention_mask, completion_mask, temperature, vocab_size
    )


# -----------------------------------------------------------------------------
# KL estimators (J. Schulman, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html)
# Each estimates KL(pi_theta || pi_ref) from a token sampled from pi_theta, with
# log r = ref_logps - logps (r = pi_ref / pi_theta):
#   k1 = -log r              unbiased, high variance, can be negative
#   k2 = (log r)^2 / 2       biased, low variance, >= 0
#   k3 = (r - 1) - log r     unbiased, low variance, >= 0 (what GRPO and TRL use)


@torch.no_grad()
def frozen_logprobs(model, ro, batch_size, *, score=token_logprobs, autocast=None, **kwargs):
    """The tokens of a rollout (rollout.Rollout) under a model that is not trained on them (the
    old policy, the reference model), batch_size rows at a time, in eval mode. score:
    token_logprobs or fast/logprobs.py's equal kernel, called with kwargs (temperature,
    vocab_size). -> (log-probs, entropies), both [n, C]."""
    parts = []  # [(log-probs, entropies)] of each batch
    with eval_mode(model), autocast or contextlib.nullcontext():
        for i in range(0, len(ro.input_ids), batch_size):
            rows = slice(i, i + batch_size)
            ids, mask = ro.input_ids[rows], ro.attention_mask[rows]
            parts.append(score(model, ids, mask, ro.completion_mask[rows], **kwargs))
    logps, entropies = zip(*parts)
    return torch.cat(logps), torch.cat(entropies)


@torch.no_grad()
def sync_ref_model(ref, policy, alpha: float):
    """TR-DPO's reference update: ref <- alpha * policy + (1 - alpha) * ref."""
    for r, p in zip(ref.parameters(), policy.parameters()):
        r.mul_(1 - alpha).add_(p.detach(), alpha=alpha)


def kl_divergence(logps, ref_logps, kind="k3"):
    """Per-token KL estimate, elementwise over same-shape tensors; kind is "k1", "k2" or "k3"."""
    log_r = ref_logps - logps
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r**2
    if kind == "k3":
        return torch.exp(log_r) - log_r - 1
    raise ValueError(f"kind={kind!r} is not a KL estimator; allowed: 'k1', 'k2', 'k3'")
