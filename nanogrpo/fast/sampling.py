"""The sampler's speed tricks, each equal to its plain version in sampler.py.

- `sample_next_token_fast`: sampler.sample_next_token without sorting the vocabulary. Top-p's
  cutoff is found by radix select (histograms of the probability mass by the bits of each token's
  weight, then a sort of the few tokens of the bin where the mass reaches p) and the draw runs
  over the kept tokens alone, in vocabulary order, so it adds the same numbers in the same order:
  equal bit for bit on CPU (on GPU up to the parallel cumsum's rounding in the draw). It saves
  top-p's sort of the whole [B,V] logits, a cost that grows with the vocabulary
  (docs/results.md has the figures). Suppressed tokens (suppress_tokens, min_new_tokens) reach
  both draws as -inf logits: the decode loop sets them before either runs.
- `StaticDecoder`: the decode step as one torch.compile'd graph of fixed shapes: L + C cache
  slots rounded up to a multiple of 128 (a `StaticCache`, kept on the model between rounds),
  finished rows masked rather than compacted, stops checked every 8 steps. Rounds whose prompt
  lengths share a bucket never recompile; on CUDA the step replays as a CUDA graph.

Does not know about: tokenization, rewards, losses, or processes: only a decode step's tensors.
"""

import math
import weakref

import torch
import torch.nn.functional as F

from nanogrpo.model import KVCache, sdpa
from nanogrpo.sampler import (
    Decoder,
    apply_temperature,
    greedy,
    lm_logits,
    mass_above,
    sample_from,
    top_p_cutoff,
)


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
    [B,K]), each row's kept tokens in vocabulary order, then -inf padding (id 0); all other tokens
    are removed. Equal to apply_min_p(apply_top_p(apply_top_k(logits))) bit for bit: top-p's
    cutoff is sampler.top_p_cutoff's (`_nucleus_cutoff`), min-p's removes what it removes."""
    B, V = logits.shape
    if 0 < top_k < V:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # [B,1] the k-th largest logit
        logits = logits.masked_fill(logits < kth, float("-inf"))
    top = logits.amax(dim=-1, keepdim=True)  # [B,1]
    floor = top + math.log(min_p) if min_p > 0.0 else None  # [B,1] the smallest logit kept
    ids = None  # [B,K] the vocabulary ids of the columns of `logits`; None: 0..V-1
    if top_p < 1.0:
        cutoff, logits, ids = _nucleus_cutoff(logits, top, top_p)
        floor = cutoff if floor is None else torch.maximum(floor, cutoff)
    vals, cols = _compact(logits, logits > float("-inf") if floor is None else logits >= floor)
    return vals, cols if ids is None else ids.gather(1, cols)


def _compact(logits, keep, count=None):
    """logits [B,V], keep [B,V] bool (and its count [B] if known) -> (vals [B,K], cols [B,K]):
    each row's kept columns in order, then -inf padding (column 0); K = the most any row keeps.
    Over a quarter of V, all columns instead (cols 0..V-1, the others at -inf): an index of most
    of it would cost more than it saves."""
    B, V = logits.shape
    count = keep.sum(dim=-1) if count is None else count  # [B]
    K = int(count.max())  # a host sync
    if 4 * K > V:
        cols = torch.arange(V, device=logits.device).expand(B, V)
        return logits.masked_fill(~keep, float("-inf")), cols
    row, col = keep.nonzero(as_tuple=True)  # [n] each, row-major: a row's columns ascending
    # [n] column in the row
    slot = torch.arange(len(row), device=row.device) - (count.cumsum(0) - count)[row]
    vals = logits.new_full((B, K), float("-inf")).index_put_((row, slot), logits[row, col])
    return vals, torch.zeros(B, K, dtype=torch.long, device=row.device).index_put_((row, slot), col)


def _nucleus_cutoff(logits, top, p):
    """logits [B,V], their max top [B,1] -> (cutoff [B,1]: sampler.top_p_cutoff's value, the
    candidates' logits [B,K] and vocabulary ids [B,K]: every token the cutoff keeps is one of
    them; or logits itself and None, when the candidates are most of the vocabulary or a row
    had to be redone).

    Radix select instead of a sort. A token's weight w = exp(logit - top) is a float in [0, 1],
    whose bits order as its value. A histogram of the mass by w's exponent says in which exponent
    the mass from the top reaches p of the total; the tokens of that exponent and above are the
    candidates. A histogram of those by the next 8 bits of w narrows the goal to a bin of w's top
    17 bits: a handful of tokens on any real row. Those alone are sorted, their masses added to
    the mass of all tokens above the bin, as top_p_cutoff adds them. The masses are the same
    float64 numbers summed in another order, so they differ by at most ~V * 2^-52 of the total. A
    row is redone by top_p_cutoff itself where a deciding mass lies closer than 4x that to the
    goal (ties at the goal), or where the bin was not the goal's (none or all of it kept: the
    fp32 exponent histogram erred; p within ~1e-6 of 1)."""
    V = logits.shape[1]
    w = (logits - top).exp_()  # [B,V] fp32 in [0, 1], as top_p_cutoff computes them
    total = w.sum(dim=-1, keepdim=True).double()  # [B,1], top_p_cutoff's, bit for bit
    goal, tol = p * total, (V + 1024) * 2.0**-50 * total
    cutoff, vals, ids, redo = _by_rows(_radix_cutoff, logits, w, top, goal, tol)
    if not redo.any():  # a host sync
        return (cutoff, logits, None) if ids is None else (cutoff, vals, ids)
    cutoff[redo] = top_p_cutoff(logits[redo], p)
    return cutoff, logits, None


def _radix_cutoff(logits, w, top, goal, tol):
    """_nucleus_cutoff's search on a block of rows -> (cutoff [B,1], the candidates' logits
    [B,K] and ids [B,K] (None when they are most of the vocabulary), the rows to redo [B]
    bool)."""
    B = len(w)
    e = (w.view(torch.int32) >> 23).long()  # [B,V] w's exponent, in [0, 127]
    mass = w.new_zeros(B, 128).scatter_add_(1, e, w).flip(1).cumsum(1)  # [B,128] top first
    crossed = (mass < goal).sum(dim=-1, keepdim=True)  # [B,1] exponents wholly above the goal
    exponent = (127 - crossed).clamp(min=0)  # [B,1] the goal's (fp32 sums: checked below)
    cand = e >= exponent  # [B,V] the candidates
    count = cand.sum(dim=-1)  # [B]
    if 4 * int(count.max()) > w.shape[1]:  # most of the vocabulary: search it all
        vals, ids = logits, None  # (the others fall below the exponent's bins)
    else:
        vals, ids = _compact(logits, cand, count)  # [B,K]
        w = (vals - top).exp()  # [B,K] (padding: 0)
    key = (w.view(torch.int32) >> 15).long()  # [B,K] w's top 17 bits
    # [B,K] bins: 1 + the next 8 bits within the exponent, 257 above it (0 below: padding)
    digit = (key - (exponent << 8)).clamp_(-1, 256).add_(1)
    w = w.double()
    mass = w.new_zeros(B, 258).scatter_add_(1, digit, w).flip(1).cumsum(1)  # [B,258] top first
    crossed = (mass < goal).sum(dim=-1, keepdim=True)  # [B,1] bins wholly above the goal
    prefix = (exponent << 8) + (256 - crossed).clamp(0, 255)  # [B,1] the goal's bin
    above = mass.gather(1, (crossed - 1).clamp(min=0))  # [B,1] the mass above it
    ranked = _compact(vals, key == prefix)[0].sort(dim=-1, descending=True).values
    ranked = F.pad(ranked, (0, 1), value=float("-inf"))  # [B,n+1]: n+1's mass is the bin's
    masses = above + mass_above(ranked, top)  # [B,n+1]
    n_keep = (masses < goal).sum(dim=-1, keepdim=True)  # [B,1]
    last = masses.gather(1, (n_keep - 1).clamp(min=0))  # the last kept token's mass
    first_out = masses.gather(1, n_keep.clamp(max=ranked.shape[1] - 1))  # the first removed's
    redo = (crossed == 0) | (crossed > 256) | (n_keep == 0) | (n_keep == ranked.shape[1])
    redo = (redo | (goal - last < tol) | (first_out - goal < tol)).squeeze(1)  # [B]
    cutoff = ranked.gather(1, (n_keep - 1).clamp(min=0))  # [B,1]
    return cutoff, None if ids is None else vals, ids, redo


def _by_rows(fn, x, *rest):
    """fn(x [B,V], *rest) a block of rows at a time on CPU, where fresh [B,V] int64 and float64
    buffers cost more in page faults than the arithmetic: blocks of 2^18 elements, and at least 3
    rows (fewer pay the per-block overhead: a 152k vocabulary's peaked rows). Tensor
    arguments are cut with x; the outputs are joined, [B,K] ones padded to the widest block's K
    (-inf, or 0); an output None in any block is None."""
    rows = len(x) if x.is_cuda else max(3, 2**18 // x.shape[1])
    if len(x) <= rows:
        return fn(x, *rest)
    blocks = range(0, len(x), rows)
    parts = [fn(*(a[i : i + rows] for a in (x, *rest))) for i in blocks]
    joined = []
    for outs in zip(*parts):
        if any(o is None for o in outs):
            outs = None
        elif outs[0].dim() == 2:
            K = max(o.shape[1] for o in outs)
            fill = float("-inf") if outs[0].is_floating_point() else 0
            outs = [F.pad(o, (0, K - o.shape[1]), value=fill) for o in outs]
        joined.append(None if outs is None else torch.cat(outs))
    return joined


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


class StaticCache(KVCache):
    """The compiled step's KVCache: written at a tensor slot (index_copy_, nothing read on the
    host), attended over all max_len slots (the key mask hides the unwritten ones), so every
    step has the same shapes."""

    static = True  # (model._trunk: a tensor cache_start; GatedDeltaNet: its state copied in place)

    def attend(self, q, k, v, mask, scale, layer, start):
        """KVCache.attend with start a tensor and mask [B,1,T,max_len]."""
        slots = start + torch.arange(k.shape[2], device=q.device)
        self.k[layer].index_copy_(2, slots, k.to(self.k[layer].dtype))
        self.v[layer].index_copy_(2, slots, v.to(self.v[layer].dtype))
        return sdpa(q, self.k[layer], self.v[layer], mask, scale)  # over [B,Hkv,max_len,D]


_COMPILED = {}  # compile mode -> the compiled _decode_step
# model -> its compiled step's KV cache, reused across rounds
_DECODE_CACHES = weakref.WeakKeyDictionary()


def _decode_cache(model, prefill, src, S):
    """The [N, S]-slot StaticCache of the compiled step, holding prompt src[i]'s prefill in row
    i. Kept on the model between rounds of the same shape, so its buffers keep their addresses
    (what CUDA graphs need).
    """
    cache = _DECODE_CACHES.get(model)
    w = model.embed_tokens.weight
    if (
        cache is None
        or cache.k[0].shape[0] != len(src)
        or cache.max_len != S
        or cache.k[0].dtype != prefill.k[0].dtype  # the keys' dtype (autocast's, FSDP2's)
        or cache.k[0].device != w.device
    ):
        dtype = prefill.k[0].dtype  # model.new_cache's, as the prefill's
        cache = _DECODE_CACHES[model] = StaticCache(model.config, len(src), S, dtype, w.device)
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
