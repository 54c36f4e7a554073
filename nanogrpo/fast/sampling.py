"""The sampler's speed tricks, each equal to its plain version in sampler.py.

- `sample_next_token_fast`: sampler.sample_next_token without sorting the vocabulary. The filters
  are decided on a few candidates per row (the power-of-two probability bins that hold the
  nucleus) and the draw runs over them alone, in vocabulary order, so it adds the same numbers in
  the same order: equal bit for bit on CPU (on GPU up to the parallel cumsum's rounding). It
  saves top-p's sort of the whole [B,V] logits, a cost that grows with the vocabulary
  (docs/results.md has the figures). Suppressed tokens (suppress_tokens, min_new_tokens) reach
  both draws as -inf logits: the decode loop sets them before either runs.
- `StaticDecoder`: the decode step as one torch.compile'd graph of fixed shapes: L + C cache
  slots rounded up to a multiple of 128 (kept on the model between rounds), finished rows masked
  rather than compacted, stops checked every 8 steps. Rounds whose prompt lengths share a bucket
  never recompile; on CUDA the step replays as a CUDA graph.

Does not know about: tokenization, rewards, losses, or processes: only a decode step's tensors.
"""

import math
import weakref

import torch
import torch.nn.functional as F

from nanogrpo.sampler import Decoder, _mass_above, apply_temperature, greedy, lm_logits, sample_from


def sample_next_token_fast(logits, u, temperature, top_k, top_p, min_p):
    """sampler.sample_next_token's draw, bit for bit, without a sort."""
    if temperature == 0:
        return greedy(logits)
    logits = apply_temperature(logits, temperature)
    V = logits.shape[-1]
    if not (0 < top_k < V or top_p < 1.0 or min_p > 0.0):
        return sample_from(logits, u)
    vals, ids = filter_candidates(logits, top_k, top_p, min_p)
    return sample_from(vals, u, token_ids=ids)


def filter_candidates(logits, top_k, top_p, min_p):
    """top-k -> top-p -> min-p without sorting the vocabulary: logits [B,V] -> (values [B,K], ids
    [B,K]), each row's candidates in vocabulary order (removed ones -inf), then -inf padding (id
    0); all other tokens are removed. Equal to apply_min_p(apply_top_p(apply_top_k(logits))) bit
    for bit: the candidates are a row's largest logits, so top-p is decided on a prefix of the
    same cumsum. They are guessed (`_nucleus_bins`); a row whose guess holds less than p is
    redone with every token."""
    B, V = logits.shape
    if 0 < top_k < V:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # [B,1] the k-th largest logit
        logits = logits.masked_fill(logits < kth, float("-inf"))
    top = logits.amax(dim=-1, keepdim=True)  # [B,1]
    # [B,V] what min-p keeps; None: all top-k leaves
    keep = logits >= top + math.log(min_p) if min_p > 0.0 else None
    if top_p >= 1.0:
        return _compact(logits, logits > float("-inf") if keep is None else keep, keep)
    w = (logits - top).exp_()  # [B,V] unnormalized probabilities
    total = w.sum(dim=-1, keepdim=True)  # [B,1], summed in vocabulary order as apply_top_p does
    # [B,V] the tokens the filters may keep
    available = logits > float("-inf") if keep is None else keep
    cand = _nucleus_bins(w, top_p) & available
    for attempt in range(2):
        vals, ids = _compact(logits, cand, keep)
        ranked = vals.sort(dim=-1, descending=True).values
        ranked = F.pad(ranked, (0, 1), value=float("-inf"))  # [B,K+1]
        mass = _mass_above(ranked, top, total)
        n_keep = (mass < top_p).sum(dim=-1, keepdim=True)  # [B,1]
        cutoff = ranked.gather(-1, n_keep - 1)  # [B,1] the smallest kept
        # [B] the candidates hold less than p, and a token that may be kept
        # lies outside them (not so when min-p removed the rest)
        short = cutoff.squeeze(1) == float("-inf")
        short &= (available & ~cand).any(dim=-1)
        if attempt or vals.shape[1] == V or not short.any():  # a host sync
            return vals.masked_fill(vals < cutoff, float("-inf")), ids
        cand = cand | short[:, None] & available  # rare: redo with all


def _compact(logits, cand, keep):
    """logits [B,V], cand [B,V] bool -> (vals [B,K], ids [B,K]): each row's candidates in
    vocabulary order, then -inf padding (id 0); K = the most any row has. Over a quarter of V,
    the whole vocabulary instead (ids 0..V-1, the tokens outside `keep` at -inf): an index of
    most of it would cost more than it saves."""
    B, V = logits.shape
    row, col = cand.nonzero(as_tuple=True)  # [n] each, row-major: a row's ids ascending
    count = torch.bincount(row, minlength=B)  # [B]
    K = int(count.max())  # a host sync
    if 4 * K > V:
        ids = torch.arange(V, device=logits.device).expand(B, V)
        return (logits if keep is None else logits.masked_fill(~keep, float("-inf"))), ids
    # [n] column in the row
    slot = torch.arange(len(row), device=row.device) - (count.cumsum(0) - count)[row]
    vals = logits.new_full((B, K), float("-inf")).index_put_((row, slot), logits[row, col])
    return vals, torch.zeros(B, K, dtype=torch.long, device=row.device).index_put_((row, slot), col)


def _nucleus_bins(w, top_p):
    """w [B,V] unnormalized probabilities -> bool [B,V]: the tokens of the power-of-two probability
    bins from the top down to the one where their mass reaches top_p: the nucleus but for
    rounding (the caller checks), and the rest of its last bin. On CPU in blocks of rows: a
    fresh int64 [B,V] index costs more (page faults) than the histogram.
    """
    guess = torch.empty(w.shape, dtype=torch.bool, device=w.device)
    rows = len(w) if w.is_cuda else max(1, 2**20 // w.shape[1])
    for i in range(0, len(w), rows):
        block = w[i : i + rows]
        e = block.view(torch.int32).long()
        e >>= 23  # the float exponent: w in [2^(e-127), 2^(e-126))
        # mass of the top bins
        mass = block.new_zeros(len(block), 256).scatter_add_(1, e, block).flip(1).cumsum(1)
        # [rows,1] bins above the one reaching p
        crossing = (mass < top_p * mass[:, -1:]).sum(dim=-1, keepdim=True)
        # its smallest w
        torch.ge(block, ((255 - crossing).int() << 23).view(torch.float32), out=guess[i : i + rows])
    return guess


# -----------------------------------------------------------------------------
# The compiled static-shape decode step


def _decode_step(model, tok, positions, key_valid, slot, cache, vocab_size, chunk):
    """One static-shape decode step: tok, positions [N,1], key_valid
    [N,S], slot (a tensor) -> logits [N,V]. Every shape is fixed for the
    round and nothing reads a value on the host."""
    h = model.hidden_states(
        tok, attention_mask=key_valid, positions=positions, cache=cache, cache_start=slot
    )
    return lm_logits(model, h[:, 0], vocab_size, chunk)


_COMPILED = {}  # compile mode -> the compiled _decode_step
# model -> its compiled step's KV cache, reused across rounds
_DECODE_CACHES = weakref.WeakKeyDictionary()


def _decode_cache(model, prefill, src, S):
    """The [N, S]-slot cache of the compiled step, holding prompt src[i]'s prefill in row i. Kept
    on the model between rounds of the same shape, so its buffers keep their addresses (what
    CUDA graphs need).
    """
    cache = _DECODE_CACHES.get(model)
    w = model.embed_tokens.weight
    if (
        cache is None
        or cache.k[0].shape[0] != len(src)
        or cache.max_len != S
        or cache.k[0].dtype != w.dtype
        or cache.k[0].device != w.device
    ):
        cache = _DECODE_CACHES[model] = model.new_cache(len(src), S)
        if w.device.type == "cuda":
            for buf in cache.k + cache.v:
                torch._dynamo.mark_static_address(buf)
    L = prefill.max_len  # slots >= L hold an earlier round's keys; the key mask hides them
    for layer, linear in enumerate(cache.linear):
        for buf, pre in ((cache.k[layer], prefill.k[layer]), (cache.v[layer], prefill.v[layer])):
            if linear:  # a linear-attention layer's state (Qwen3.5), whole
                buf.copy_(pre.index_select(0, src))
            else:
                buf[:, :, :L] = pre.index_select(0, src)
    return cache


class StaticDecoder(Decoder):
    """sampler.Decoder's methods with fixed shapes, the step compiled once
    (mode "reduce-overhead" on CUDA: CUDA graphs)."""

    compacts = False  # finished rows run on, masked out of the output

    def __init__(self, model, vocab_size, chunk):
        super().__init__(model, vocab_size, chunk)
        self.sync_every = 8
        device = model.lm_head.weight.device
        self.mode = "reduce-overhead" if device.type == "cuda" else None
        if self.mode not in _COMPILED:
            _COMPILED[self.mode] = torch.compile(
                _decode_step, mode=self.mode, dynamic=False, fullgraph=True
            )

    def prefill_cache(self, P, L, C):
        return self.model.new_cache(P, L)

    def decode_cache(self, prefill, src, L, C):
        S = -(-(L + C) // 128) * 128  # a bucket: rounds share one graph
        return _decode_cache(self.model, prefill, src, S), S

    def step(self, tok, positions, key_valid, cache, slot):
        slot = torch.tensor(slot, device=tok.device)
        logits = _COMPILED[self.mode](
            self.model, tok, positions, key_valid, slot, cache, self.vocab_size, self.chunk
        )
        if self.mode:  # a CUDA graph's output is overwritten by its replay
            logits = logits.clone()
        return logits
