"""Per-token log-probs and entropies of completion tokens, and the KL estimators k1/k2/k3.

Owns: `token_logprobs` (what the policy, the old policy and the reference model are scored with)
and `kl_divergence`. Does not know about: losses, advantages, sampling, or how the model is built
beyond one call: `model(input_ids, attention_mask=..., head=fn)` runs the trunk and returns
fn(hidden [N,L,D] after the final norm, model.lm_head) instead of the logits, inside forward, so
FSDP2 keeps the LM head gathered while the chunks are scored.

Choices:
- Memory. Qwen2.5 has V = 151,936: fp32 logits for 8 x 512 completion tokens are 2.5 GB, and a
  naive log_softmax keeps several such tensors alive for backward. We run the trunk once, keep only
  the hidden states of positions that predict an active completion token ([M,D]), and push them
  through `lm_head -> fp32 -> /T -> log_softmax` in chunks of `chunk_size` tokens. Each chunk runs
  under `torch.utils.checkpoint`, so its [chunk,V] logits are recomputed in backward instead of
  being stored: peak memory is a few (about 6, measured) [chunk,V] fp32 blocks whatever N x C is;
  lower chunk_size if that is still too much (bench/bench_logprobs.py measures it).
- Temperature divides the logits before the softmax, exactly as TRL scores (`_get_per_token_logps_and_entropies`), and the
  entropy is the tempered distribution's, in nats.
- Positions with completion_mask == 0 are never scored: they come out as exactly 0 (no NaN).
- Positions come from the attention mask (left-pad aware) inside the model; for RoPE models this
  equals TRL's arange positions up to rounding.
"""

import torch
from torch.utils.checkpoint import checkpoint


def _logps_entropy(h, targets, lm_head, temperature, vocab_size=None):
    """h [n,D], targets [n] -> (logp [n], entropy [n]) in fp32 (fp64 for an fp64 model)."""
    logits = lm_head(h)[:, :vocab_size]  # [n,V] in the model dtype (real vocabulary only, if given)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    logz = logits.logsumexp(dim=-1)  # [n]
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - logz
    probs = torch.softmax(logits, dim=-1)  # [n,V]
    entropy = logz - (probs * logits).sum(dim=-1)  # H = log Z - E_p[z]
    return logp, entropy


def token_logprobs(model, input_ids, attention_mask, completion_mask, temperature=1.0, chunk_size=256,
                   vocab_size=None):
    """Log-prob and entropy of each completion token under `model` at `temperature`.

    input_ids, attention_mask: [N,L], a left-padded prompt followed by a right-padded completion that
    fills the last C = completion_mask.shape[1] positions (attention_mask: 1 = real token; completion
    pads may be 1 or 0). completion_mask: [N,C], 1 = score this token.
    Returns (logps, entropy), each [N,C] float32 (float64 for a float64 model), exactly 0 where
    completion_mask == 0. Differentiable w.r.t. the model's parameters; peak memory is a few
    [chunk_size, V] blocks of logits, independent of N and C (see the module docstring).
    vocab_size: normalize over the first vocab_size logits only, the support the sampler draws from
    when the embedding has padded rows (Qwen2.5: 151,936 rows, 151,665 tokens). None = all rows, as
    TRL does; the two agree whenever the padded rows carry no probability, as in trained checkpoints.
    """
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(f"input_ids and attention_mask must both be [N,L]; got {tuple(input_ids.shape)} "
                         f"and {tuple(attention_mask.shape)}")
    N, L = input_ids.shape
    if completion_mask.dim() != 2 or completion_mask.shape[0] != N or not 0 < completion_mask.shape[1] < L:
        raise ValueError(f"completion_mask must be [N,C] with N={N} and 0 < C < L={L} (at least one prompt "
                         f"token); got {tuple(completion_mask.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0 (scoring divides the logits by it)")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    C = completion_mask.shape[1]

    def score(h, lm_head):  # h [N,C,D]: h[:, j] is the hidden state that predicts completion token j
        targets = input_ids[:, L - C:].reshape(N * C)  # [N*C]
        active = completion_mask.reshape(N * C).bool().nonzero().squeeze(-1)  # [M] indices of scored tokens
        h, targets = h.reshape(N * C, -1)[active], targets[active]  # [M,D], [M]
        logp_parts, ent_parts = [], []
        for start in range(0, len(active), chunk_size):
            h_c, t_c = h[start:start + chunk_size], targets[start:start + chunk_size]
            if torch.is_grad_enabled() and h_c.requires_grad:
                # Recompute this chunk's [chunk,V] logits in backward rather than saving them.
                lp, ent = checkpoint(_logps_entropy, h_c, t_c, lm_head, temperature, vocab_size, use_reentrant=False)
            else:
                lp, ent = _logps_entropy(h_c, t_c, lm_head, temperature, vocab_size)
            logp_parts.append(lp)
            ent_parts.append(ent)
        zeros = torch.zeros(N, C, dtype=torch.promote_types(h.dtype, torch.float32), device=h.device)
        if not logp_parts:  # nothing to score
            return zeros, zeros.clone()
        where = completion_mask.bool().nonzero(as_tuple=True)  # (rows, cols) of `active`, same order
        logps = zeros.index_put(where, torch.cat(logp_parts))  # scatter back; masked slots stay 0
        entropy = zeros.index_put(where, torch.cat(ent_parts))
        return logps, entropy

    prompt = torch.cat([input_ids[:, :L - C], attention_mask[:, :L - C].long()], dim=1)  # [N,2(L-C)]
    unique, src = prompt.unique(dim=0, return_inverse=True)  # [U,2(L-C)], [N]: row n's prompt is unique[src[n]]
    if len(unique) == N or (model.gradient_checkpointing and torch.is_grad_enabled()):
        # The hidden state at position i predicts token i+1: positions L-C-1 .. L-2 score the completion.
        return model(input_ids, attention_mask=attention_mask, head=lambda h, out: score(h[:, L - C - 1:L - 1], out))
    # Rows that share a prompt (a group's G completions) share its forward: each distinct prompt runs once into
    # a KV cache, copied to its rows, then only the completions run, attending to it (exact; fewer FLOPs).
    ids, valid = unique[:, :L - C], unique[:, L - C:].bool()  # [U,L-C]
    cache = model.new_cache(len(unique), L)
    last = model(ids, attention_mask=valid, positions=(valid.cumsum(-1) - 1).clamp(min=0), cache=cache,
                 head=lambda h, out: h[:, -1])  # [U,D]: predicts each prompt's first completion token
    positions = valid.sum(-1)[src, None] + torch.arange(C, device=ids.device)  # [N,C]
    key_valid = torch.cat([valid[src], attention_mask[:, L - C:].bool()], dim=1)  # [N,L]
    return model(input_ids[:, L - C:], attention_mask=key_valid, positions=positions, cache=cache.select(src),
                 cache_start=L - C, head=lambda h, out: score(torch.cat([last[src, None], h[:, :-1]], dim=1), out))


# -----------------------------------------------------------------------------
# KL estimators (J. Schulman, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html)
# Each estimates KL(pi_theta || pi_ref) from a token sampled from pi_theta, with
# log r = ref_logps - logps (r = pi_ref / pi_theta):
#   k1 = -log r              unbiased, high variance, can be negative
#   k2 = (log r)^2 / 2       biased, low variance, >= 0
#   k3 = (r - 1) - log r     unbiased, low variance, >= 0 (what GRPO and TRL use)


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
