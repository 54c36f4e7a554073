"""Per-token log-probs and entropies of completion tokens, and the KL estimators k1/k2/k3.

Owns: `token_logprobs` (what the policy, the old policy and the reference model are scored with)
and `kl_divergence`. Does not know about: losses, advantages, sampling, or how the model is built
beyond its call `model(input_ids, attention_mask=, positions=, cache=, cache_start=, head=fn)`, which runs
the trunk and returns fn(hidden [N,L,D] after the final norm, model.lm_head) instead of the logits, inside
forward, so FSDP2 keeps the LM head gathered while the chunks are scored, plus `new_cache` and
`gradient_checkpointing`.

Choices:
- Memory. Qwen2.5 has V = 151,936: fp32 logits for 8 x 512 completion tokens are 2.5 GB, and a
  naive log_softmax keeps several such tensors alive for backward. We run the trunk once, keep only
  the hidden states of positions that predict an active completion token ([M,D]), and push them
  through `lm_head -> fp32 -> /T -> softmax` in chunks of `chunk_size` tokens (`ChunkLogProbs`).
  Backward needs each chunk's [chunk,V] probabilities: the first chunks keep them, up to `keep_bytes`
  (1 GiB by default) per call; later chunks recompute them from h (one more LM-head matmul). Peak
  memory is thus at most keep_bytes plus a few [chunk,V] fp32 blocks, whatever N x C is; keep_bytes=0
  bounds it to the blocks (bench/bench_logprobs.py measures both). On the 47M bench model the kept
  probabilities make the LM head's forward + backward ~1.5x faster.
- Rows that share a prompt (a group) share its forward: the prompt runs once into a KV cache.
- Temperature divides the logits before the softmax, exactly as TRL scores (`_get_per_token_logps_and_entropies`), and the
  entropy is the tempered distribution's, in nats.
- Positions with completion_mask == 0 are never scored: they come out as exactly 0 (no NaN).
- Positions come from the attention mask (left-pad aware) inside the model; for RoPE models this
  equals TRL's arange positions up to rounding.
"""

import torch
import torch.nn.functional as F


KEEP_BYTES = 2**30  # token_logprobs' default: probabilities kept for backward per call (see the module docstring)


def _tempered_logits(h, weight, temperature):
    """h [n,D] @ weight [V,D].T -> logits [n,V] / temperature, in fp32 (fp64 for an fp64 model)."""
    logits = F.linear(h, weight)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return logits if temperature == 1.0 else logits.div_(temperature)  # logits is a new tensor: divided in place


class ChunkLogProbs(torch.autograd.Function):
    """(h [n,D], weight [V,D], targets [n], temperature, keep) -> (logp [n], entropy [n]) of the targets under
    softmax(h @ weight.T / temperature). Backward forms d logp / d logits = onehot - softmax directly instead of
    replaying each op's backward. With keep, the forward saves the [n,V] probabilities for it; without, it saves
    h and log Z only and recomputes them (one more [n,D] x [D,V] matmul), so no vocabulary-sized tensor outlives
    the chunk. The entropy gets no gradient: it is logged or masks tokens, never a loss."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")  # backward recomputes under the forward's autocast state
    def forward(ctx, h, weight, targets, temperature, keep):
        shifted = _tempered_logits(h, weight, temperature)  # [n,V], a fresh tensor: changed in place below
        top = shifted.amax(dim=-1, keepdim=True)  # [n,1]
        shifted = shifted.sub_(top)  # z - max z: every exp below is <= 1
        probs = shifted.exp()  # [n,V], unnormalized until the division
        lse = probs.sum(dim=-1, keepdim=True)  # [n,1]
        probs.div_(lse)
        lse = lse.log_()  # log Z - max z
        logp = (shifted.gather(-1, targets[:, None]) - lse).squeeze(-1)
        entropy = (lse - shifted.mul_(probs).sum(dim=-1, keepdim=True)).squeeze(-1)  # H = log Z - E_p[z]
        ctx.save_for_backward(h, weight, targets, probs if keep else (top + lse).squeeze(-1))
        ctx.temperature, ctx.keep = temperature, keep
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_logp, _):
        h, weight, targets, saved = ctx.saved_tensors
        if ctx.keep:  # the saved probabilities [n,V]; a new tensor, so a retained graph can run backward again
            grad = saved.mul(-grad_logp[:, None])
        else:  # recomputed from log Z [n]
            grad = _tempered_logits(h, weight, ctx.temperature).sub_(saved[:, None]).exp_().mul_(-grad_logp[:, None])
        grad = grad.scatter_add_(1, targets[:, None], grad_logp[:, None])  # d/d logits [n,V]
        grad = (grad if ctx.temperature == 1.0 else grad.div_(ctx.temperature)).to(h.dtype)
        return grad @ weight, grad.T @ h, None, None, None


def token_logprobs(model, input_ids, attention_mask, completion_mask, temperature=1.0, chunk_size=256,
                   vocab_size=None, keep_bytes=KEEP_BYTES):
    """Log-prob and entropy of each completion token under `model` at `temperature`.

    input_ids, attention_mask: [N,L], a left-padded prompt followed by a right-padded completion that
    fills the last C = completion_mask.shape[1] positions (attention_mask: 1 = real token; completion
    pads may be 1 or 0). completion_mask: [N,C], 1 = score this token.
    Returns (logps, entropy), each [N,C] float32 (float64 for a float64 model), exactly 0 where
    completion_mask == 0. logps are differentiable w.r.t. the model's parameters (the entropy is not);
    peak memory is keep_bytes of probabilities kept for backward (only with grad, and none with the model's
    gradient_checkpointing) plus a few [chunk_size, V] blocks of logits, independent of N and C (see the module
    docstring).
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
    checkpointed = model.gradient_checkpointing and torch.is_grad_enabled()
    if checkpointed or not torch.is_grad_enabled():
        keep_bytes = 0  # nothing to keep for without grad; a checkpointed run trades compute for memory here too

    def score(h, lm_head):  # h [N,C,D]: h[:, j] is the hidden state that predicts completion token j
        where = completion_mask.bool().nonzero(as_tuple=True)  # (rows, cols) of the M scored tokens
        h, targets = h[where], input_ids[:, L - C:][where]  # [M,D], [M]
        weight = lm_head.weight[:vocab_size]  # [V,D]: the real vocabulary's rows, if given
        out_dtype = torch.promote_types(h.dtype, torch.float32)  # of the logits, probabilities and results
        keep_rows = keep_bytes // (weight.shape[0] * out_dtype.itemsize)  # tokens whose probabilities are kept
        parts = [ChunkLogProbs.apply(h[i:i + chunk_size], weight, targets[i:i + chunk_size], temperature,
                                     min(i + chunk_size, len(targets)) <= keep_rows)
                 for i in range(0, len(targets), chunk_size)]  # [(logp, entropy)] of each chunk
        zeros = torch.zeros(N, C, dtype=out_dtype, device=h.device)
        if not parts:  # nothing to score
            return zeros, zeros.clone()
        logps = zeros.index_put(where, torch.cat([lp for lp, _ in parts]))  # scatter back; masked slots stay 0
        entropy = zeros.index_put(where, torch.cat([ent for _, ent in parts]))
        return logps, entropy

    if checkpointed:
        # The cached path below runs without checkpointing (a recomputed block would write the cache again), so
        # this one keeps checkpointing's memory savings. Hidden state i predicts token i+1: positions L-C-1 .. L-2.
        return model(input_ids, attention_mask=attention_mask, head=lambda h, out: score(h[:, L - C - 1:L - 1], out))
    # Rows that share a prompt (a group's G completions) share its forward: each distinct prompt runs once into
    # a KV cache, copied to its rows, then only the completions run, attending to it (exact; fewer FLOPs).
    # Taken even when no prompt repeats, so that every call makes two model calls whatever the data: with
    # FSDP, each call gathers the parameters, and every rank must make the same collectives.
    prompt = torch.cat([input_ids[:, :L - C], attention_mask[:, :L - C].long()], dim=1)  # [N,2(L-C)]
    unique, src = prompt.unique(dim=0, return_inverse=True)  # [U,2(L-C)], [N]: row n's prompt is unique[src[n]]
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
