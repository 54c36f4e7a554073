"""Batched, KV-cached sampling of G completions per prompt: the rollout half of GRPO.

Owns: `generate` and the logit filters it applies (repetition penalty, temperature, top-k, top-p, min-p),
each a small pure function [B,V] -> [B,V] with -inf for removed tokens. Does not know about: tokenization
(prompts, stop ids and the pad id arrive as ints), rewards, losses, or more than one process. From the
model it needs `hidden_states(..., cache=, cache_start=)`, `new_cache`, `lm_head` and `config`.

Choices:
- Prefill once, copy to G rows: the P distinct prompts, left-padded to the longest, run through the
  model once into a KV cache with room for prompt + max_new_tokens slots; `cache.select` copies prompt
  i's rows into its G samples (rows i*G .. i*G+G-1).
- Left padding + per-row positions. A token's RoPE position is the number of real tokens before it
  in its row and a key mask hides the pad slots, so a short prompt in a mixed batch is computed as if
  it were alone. One decode step is one batched forward of [n,1] tokens: no Python loop over rows.
- Finished rows are dropped: when a quarter of the live rows have stopped, the batch is compacted with
  `cache.select`; the loop ends when all have stopped (a host sync: every step on CPU, every 8 on GPU).
- torch_compile=True runs each decode step as one compiled graph of fixed shapes instead: L + C cache slots
  rounded up to a multiple of 128 (kept on the model between rounds), all attended through the key mask,
  the write slot a tensor, finished rows masked, not compacted, stops checked every 8 steps. So rounds
  whose prompt lengths share a bucket never recompile, and on CUDA the step replays as a CUDA graph
  (mode="reduce-overhead"). The prefill, the filters and the draw stay eager.
- Output width C is the longest completion (<= max_new_tokens): a batch that all stops early comes
  back narrower. The mask is built from the step of each row's first stop id (inclusive), never from
  token values, so pad_id may equal an eos id; stop ids inside the prompt play no part.
- Logits are computed for the real vocabulary only (the first `vocab_size` rows of lm_head), so
  padded embedding rows (Qwen2.5: 151,936 rows for 151,665 tokens) can never be sampled. Sampling
  math is fp32 whatever the model dtype. Filters run in transformers' order: repetition penalty,
  temperature, top-k, top-p, min-p.
- No vocabulary sort: the filters are decided on a few candidates per row (the probability bins, powers of
  two, that hold the nucleus) and the draw runs over them alone. The `apply_*` functions are the definitions;
  the fast path equals them bit for bit on CPU (on GPU up to the parallel cumsum's rounding).
- RNG: counter-based, per row. Row (prompt i, sample j) has the key hash(seed_i, j); at step t it
  draws u = hash(key, t) and takes the first token whose cumulative probability exceeds u (inverse-CDF
  sampling). So a row's samples depend only on its prompt, the model and (seed_i, j), not on batch-mates,
  position, compaction or device: batched generation equals generating each prompt alone (up to float
  rounding of the logits). Without `seeds`, one seed per prompt is drawn from `generator` (or torch's RNG).
"""

import math
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Generation:
    """What `generate` returns. N = len(prompt_ids) * num_samples, C = longest completion."""

    completion_ids: torch.Tensor  # [N,C] long, right-padded with pad_id
    completion_mask: torch.Tensor  # [N,C] bool, True up to and including the row's first stop id
    logprobs: torch.Tensor  # [N,C] fp32, log-prob of each sampled token; 0 where the mask is False
    truncated: torch.Tensor  # [N] bool, True for rows that never sampled a stop id


# -----------------------------------------------------------------------------
# Logit filters: [B,V] -> [B,V], removed tokens set to -inf. Shared by the sampler and the tests.


def apply_repetition_penalty(logits, seen, penalty):
    """Penalize tokens already in the row (CTRL rule, as transformers): a seen token's positive logit
    is divided by `penalty`, a negative one multiplied. seen: bool [B,V], or token ids [B,L] (ids < 0
    or >= V are ignored, e.g. padding)."""
    if penalty == 1.0:
        return logits
    if seen.dtype != torch.bool:
        seen = token_mask(seen, logits.shape[-1])
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def token_mask(ids, V):
    """Token ids [B,L] -> bool [B,V], True where the id occurs in the row (ids < 0 or >= V ignored)."""
    ids = torch.where((ids >= 0) & (ids < V), ids, V).long()  # ignored ids go to an extra column
    return torch.zeros(ids.shape[0], V + 1, dtype=torch.bool, device=ids.device).scatter_(1, ids, True)[:, :V]


def apply_temperature(logits, temperature):
    """logits / temperature (temperature > 0; 0 = greedy is handled by the caller)."""
    return logits if temperature == 1.0 else logits / temperature


def apply_top_k(logits, k):
    """Keep the k largest logits of each row. Ties with the k-th largest are all kept, so a row may
    keep more than k (as transformers). k = 0 or k >= V: nothing is removed."""
    if k == 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[:, -1:]  # [B,1]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits, p):
    """Nucleus filter: keep the most likely tokens until their probability reaches p, i.e. a token is
    kept if the tokens ranked above it hold less than p (the top token always stays). Tokens tied with
    the last kept one are kept too. p = 1: nothing is removed. (`filter_candidates` finds the same set unsorted.)"""
    if p >= 1.0:
        return logits
    top = logits.amax(dim=-1, keepdim=True)  # [B,1]
    total = (logits - top).exp().sum(dim=-1, keepdim=True)  # [B,1], summed in vocabulary order
    ranked = logits.sort(dim=-1, descending=True).values  # [B,V]
    n_keep = (_mass_above(ranked, top, total) < p).sum(dim=-1, keepdim=True)  # [B,1], >= 1
    cutoff = ranked.gather(-1, n_keep - 1)  # smallest kept logit
    return logits.masked_fill(logits < cutoff, float("-inf"))


def _mass_above(ranked, top, total):
    """Descending logits [B,K] -> [B,K]: probability of the strictly higher-ranked tokens. An exclusive
    cumsum, so it never decreases (on CPU the cumsum is sequential: a prefix is computed alike for any K)."""
    return F.pad(((ranked - top).exp() / total).cumsum(dim=-1)[:, :-1], (1, 0))


def apply_min_p(logits, min_p):
    """Remove tokens whose probability is below min_p times the top token's probability, i.e. whose
    logit is below max + log(min_p) (the top token always stays). min_p = 0: nothing is removed."""
    if min_p == 0.0:
        return logits
    return logits.masked_fill(logits < logits.amax(dim=-1, keepdim=True) + math.log(min_p), float("-inf"))


def sample_from(logits, u, token_ids=None):
    """Inverse-CDF draw. logits [B,V] fp32 (-inf = removed), u [B] float64 in [0,1) ->
    (ids [B], their log-probs [B]): id is the first token whose cumulative probability exceeds u.
    With token_ids [B,K] (ascending, then any -inf padding), logits [B,K] are those tokens' logits, all
    others removed: the same draw, as zero weights leave a cumulative sum unchanged."""
    top = logits.amax(dim=-1, keepdim=True)  # [B,1]
    # unnormalized probabilities (the largest exactly 1), summed in fp64 so tail tokens keep their exact share;
    # in place: on CPU, fresh [B,V] buffers cost more than the arithmetic
    cdf = (logits - top).exp_().double().cumsum_(dim=-1)  # [B,V]
    total = cdf[:, -1:]  # [B,1], in [1, V]
    # u * total < total, so the first cdf entry above it belongs to a token of nonzero probability
    ids = torch.searchsorted(cdf, u[:, None] * total, right=True).clamp_(max=logits.shape[-1] - 1)
    logp = (logits.gather(-1, ids) - top - total.log().float()).squeeze(-1)
    return (ids if token_ids is None else token_ids.gather(-1, ids)).squeeze(-1), logp


def filter_candidates(logits, top_k, top_p, min_p):
    """top-k -> top-p -> min-p without sorting the vocabulary: logits [B,V] -> (values [B,K], ids [B,K]), each row's
    candidates in vocabulary order (removed ones -inf), then -inf padding (id 0); all other tokens are removed. Equal
    to apply_min_p(apply_top_p(apply_top_k(logits))) bit for bit: the candidates are a row's largest logits, so top-p
    is decided on a prefix of the same cumsum. They are guessed (`_nucleus_bins`); a row whose guess holds less than
    p is redone with every token."""
    B, V = logits.shape
    if 0 < top_k < V:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # [B,1] the k-th largest logit
        logits = logits.masked_fill(logits < kth, float("-inf"))
    top = logits.amax(dim=-1, keepdim=True)  # [B,1]
    keep = logits >= top + math.log(min_p) if min_p > 0.0 else None  # [B,V] what min-p keeps; None: all top-k leaves
    if top_p >= 1.0:
        return _compact(logits, logits > float("-inf") if keep is None else keep, keep)
    w = (logits - top).exp_()  # [B,V] unnormalized probabilities
    total = w.sum(dim=-1, keepdim=True)  # [B,1], summed in vocabulary order as apply_top_p does
    cand = _nucleus_bins(w, top_p) if keep is None else _nucleus_bins(w, top_p) & keep
    for attempt in range(2):
        vals, ids = _compact(logits, cand, keep)
        ranked = F.pad(vals.sort(dim=-1, descending=True).values, (0, 1), value=float("-inf"))  # [B,K+1]
        n_keep = (_mass_above(ranked, top, total) < top_p).sum(dim=-1, keepdim=True)  # [B,1]
        cutoff = ranked.gather(-1, n_keep - 1)  # [B,1] the smallest kept logit
        short = cutoff.squeeze(1) == float("-inf")  # [B] the candidates hold less than p: the next one is kept too
        if attempt or vals.shape[1] == V or not short.any():  # (a host sync)
            return vals.masked_fill(vals < cutoff, float("-inf")), ids
        cand = cand | short[:, None] & (logits > float("-inf") if keep is None else keep)  # rare: redo with all


def _compact(logits, cand, keep):
    """logits [B,V], cand [B,V] bool -> (vals [B,K], ids [B,K]): each row's candidates in vocabulary order, then -inf
    padding (id 0); K = the most any row has. Over a quarter of V, the whole vocabulary instead (ids 0..V-1, the
    tokens outside `keep` at -inf): an index of most of it would cost more than it saves."""
    B, V = logits.shape
    row, col = cand.nonzero(as_tuple=True)  # [n] each, row-major: a row's ids ascending
    count = torch.bincount(row, minlength=B)  # [B]
    K = int(count.max())  # a host sync
    if 4 * K > V:
        ids = torch.arange(V, device=logits.device).expand(B, V)
        return (logits if keep is None else logits.masked_fill(~keep, float("-inf"))), ids
    slot = torch.arange(len(row), device=row.device) - (count.cumsum(0) - count)[row]  # [n] column in the row
    vals = logits.new_full((B, K), float("-inf")).index_put_((row, slot), logits[row, col])
    return vals, torch.zeros(B, K, dtype=torch.long, device=row.device).index_put_((row, slot), col)


def _nucleus_bins(w, top_p):
    """w [B,V] unnormalized probabilities -> bool [B,V]: the tokens of the power-of-two probability bins from the top
    down to the one where their mass reaches top_p: the nucleus but for rounding (the caller checks), and the rest of
    its last bin. On CPU in blocks of rows: a fresh int64 [B,V] index costs more (page faults) than the histogram."""
    guess = torch.empty(w.shape, dtype=torch.bool, device=w.device)
    rows = len(w) if w.is_cuda else max(1, 2**20 // w.shape[1])
    for i in range(0, len(w), rows):
        block = w[i:i + rows]
        e = block.view(torch.int32).long()
        e >>= 23  # the float exponent: w in [2^(e-127), 2^(e-126))
        mass = block.new_zeros(len(block), 256).scatter_add_(1, e, block).flip(1).cumsum(1)  # mass of the top bins
        crossing = (mass < top_p * mass[:, -1:]).sum(dim=-1, keepdim=True)  # [rows,1] bins above the one reaching p
        torch.ge(block, ((255 - crossing).int() << 23).view(torch.float32), out=guess[i:i + rows])  # its smallest w
    return guess


def sample_filtered(logits, u, top_k, top_p, min_p):
    """sample_from(apply_min_p(apply_top_p(apply_top_k(logits)))) drawing over the candidates only (in vocabulary
    order: the cumulative sum adds the same numbers in the same order)."""
    vals, ids = filter_candidates(logits, top_k, top_p, min_p)
    return sample_from(vals, u, token_ids=ids)


# -----------------------------------------------------------------------------
# Counter-based random numbers: pure functions of (key, step), computed with integer tensor ops.

_M32 = 0xFFFFFFFF


def _mix(x):
    """A bijective 32-bit integer hash, on python ints or int64 tensors holding 32-bit values."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def row_keys(seeds, num_samples):
    """seeds [P] int64 -> keys [P*G] int64: one random stream per (prompt, sample)."""
    sample = torch.arange(num_samples, device=seeds.device).repeat(len(seeds))  # [P*G]
    return _mix((_mix((seeds.repeat_interleave(num_samples) & _M32) ^ 0x9E3779B9) + sample) & _M32)


def uniforms(keys, step):
    """keys [n] int64, step int -> [n] float64 in [0,1) (52 random bits), the same on every device."""
    h = _mix(keys ^ _mix(step ^ 0x3C6EF372))
    hi, lo = _mix(h ^ 0x68E31DA4) >> 6, _mix(h ^ 0x1B56C4E9) >> 6  # 26 bits each
    return (hi * 2**26 + lo).double() / 2**52


# -----------------------------------------------------------------------------
# Generation


def _need(ok, name, value, rule):
    if not ok:
        raise ValueError(f"{name}={value!r}: {rule}")


def check_sampling(temperature, top_k, top_p, min_p, repetition_penalty):
    """The one rule for the sampling settings (generate and TrainConfig both call it); ValueError if off."""
    _need(temperature >= 0, "temperature", temperature, "must be >= 0 (0 means greedy)")
    _need(top_k >= 0, "top_k", top_k, "must be >= 0 (0 means off)")
    _need(0 < top_p <= 1, "top_p", top_p, "must be in (0, 1] (1 means off)")
    _need(0 <= min_p <= 1, "min_p", min_p, "must be in [0, 1] (0 means off)")
    _need(repetition_penalty > 0, "repetition_penalty", repetition_penalty, "must be > 0 (1 means off)")


def _check_args(model, prompt_ids, num_samples, max_new_tokens, temperature, top_k, top_p, min_p,
                repetition_penalty, vocab_size, seeds):
    _need(num_samples >= 1, "num_samples", num_samples, "must be >= 1")
    _need(max_new_tokens >= 1, "max_new_tokens", max_new_tokens, "must be >= 1")
    check_sampling(temperature, top_k, top_p, min_p, repetition_penalty)
    V = model.config.vocab_size
    _need(0 < vocab_size <= V, "vocab_size", vocab_size, f"must be in [1, model.config.vocab_size={V}]")
    _need(len(prompt_ids) > 0, "prompt_ids", prompt_ids, "needs at least one prompt")
    for i, p in enumerate(prompt_ids):
        _need(len(p) > 0, "prompt_ids", f"[..., {i}: []]", f"prompt {i} is empty")
        _need(min(p) >= 0 and max(p) < V, "prompt_ids", f"[..., {i}: [{min(p)}..{max(p)}]]",
              f"prompt {i} has ids outside [0, {V})")
    longest, limit = max(map(len, prompt_ids)), model.config.max_position_embeddings
    _need(longest + max_new_tokens <= limit, "max_new_tokens", max_new_tokens,
          f"the longest prompt ({longest}) + max_new_tokens exceeds max_position_embeddings={limit}")
    _need(seeds is None or len(seeds) == len(prompt_ids), "seeds", seeds, "needs one seed per prompt")


def _logits(model, h, vocab_size, chunk):
    """h [n,D] -> fp32 logits [n,vocab_size]: the LM head's real-vocabulary rows, in slices of `chunk`."""
    W = model.lm_head.weight[:vocab_size]  # [V,D], a view: padded-vocab rows are never scored
    return torch.cat([F.linear(h, W[i:i + chunk]).float() for i in range(0, vocab_size, chunk)], dim=-1)


def _decode_step(model, tok, positions, key_valid, slot, cache, vocab_size, chunk):
    """One static-shape decode step: tok [N,1], positions [N,1], key_valid [N,S], slot (a tensor) ->
    logits [N,V]. Every shape is fixed for the round and nothing reads a value on the host."""
    h = model.hidden_states(tok, attention_mask=key_valid, positions=positions, cache=cache, cache_start=slot)
    return _logits(model, h[:, 0], vocab_size, chunk)


_COMPILED = {}  # compile mode -> the compiled _decode_step
_DECODE_CACHES = weakref.WeakKeyDictionary()  # model -> its compiled step's KV cache, reused across rounds


def _decode_cache(model, prefill, src, S):
    """The [N, S]-slot cache of the compiled step, holding prompt src[i]'s prefill in row i. Kept on the
    model between rounds of the same shape, so its buffers keep their addresses (what CUDA graphs need)."""
    cache = _DECODE_CACHES.get(model)
    w = model.embed_tokens.weight
    if cache is None or cache.k[0].shape[0] != len(src) or cache.max_len != S or cache.k[0].dtype != w.dtype \
            or cache.k[0].device != w.device:
        cache = _DECODE_CACHES[model] = model.new_cache(len(src), S)
        if w.device.type == "cuda":
            for buf in cache.k + cache.v:
                torch._dynamo.mark_static_address(buf)
    L = prefill.max_len  # slots >= L hold an earlier round's keys; the key mask hides them
    for buf, pre in zip(cache.k + cache.v, prefill.k + prefill.v):
        buf[:, :, :L] = pre.index_select(0, src)
    return cache


@torch.no_grad()  # not inference_mode: the outputs feed the trainer's autograd graph (masks, old logps)
def generate(model, prompt_ids, num_samples=1, max_new_tokens=256, temperature=1.0, top_k=0, top_p=1.0,
             min_p=0.0, repetition_penalty=1.0, stop_ids=(), pad_id=0, generator=None, vocab_size=None,
             seeds=None, torch_compile=False) -> Generation:
    """Sample `num_samples` completions of up to `max_new_tokens` tokens for each prompt.

    prompt_ids: list of P non-empty lists of token ids (any lengths). Returns a `Generation` with
    N = P * num_samples rows, prompt i's samples at rows i*G .. i*G+G-1, and C = the longest
    completion's length (max_new_tokens if any row is truncated). A row stops at the first id of
    `stop_ids` it samples (included in its mask); pad_id only fills the padding.
    temperature 0 is greedy (argmax after the repetition penalty; logprobs of the temperature-1, unfiltered
    distribution). top_k 0, top_p 1, min_p 0 and repetition_penalty 1 are off. vocab_size: the tokenizer's
    real vocabulary (default model.config.vocab_size); ids >= vocab_size are never sampled.
    seeds: optional list of P ints, one per prompt (see the module docstring); otherwise they are
    drawn from `generator` (a torch.Generator) or from torch's global RNG.
    torch_compile: run each decode step as one torch.compile'd static-shape graph (CUDA graphs on GPU).
    """
    vocab_size = model.config.vocab_size if vocab_size is None else vocab_size
    prompt_ids = [[int(t) for t in p] for p in prompt_ids]
    _check_args(model, prompt_ids, num_samples, max_new_tokens, temperature, top_k, top_p, min_p,
                repetition_penalty, vocab_size, seeds)
    dev = model.lm_head.weight.device
    P, G, C, N = len(prompt_ids), num_samples, max_new_tokens, len(prompt_ids) * num_samples
    stops = torch.tensor(sorted({int(s) for s in stop_ids or ()}), dtype=torch.long, device=dev)
    if seeds is None:
        seeds = torch.randint(0, 2**31 - 1, (P,), generator=generator, device=getattr(generator, "device", "cpu"))
    keys = row_keys(torch.as_tensor(seeds, dtype=torch.long).to(dev), G)  # [N]
    # CPU BLAS multiplies [n,D] by slices of 2048 vocab rows ~1.6x faster than by the whole [V,D]
    chunk = 2048 if dev.type == "cpu" else vocab_size
    filters = 0 < top_k < vocab_size or top_p < 1.0 or min_p > 0.0

    # Prefill the P distinct prompts once, left-padded to the longest L.
    lens = torch.tensor([len(p) for p in prompt_ids], device=dev)  # [P]
    L = int(lens.max())
    ids = torch.tensor([[pad_id] * (L - len(p)) + p for p in prompt_ids], device=dev)  # [P,L]
    valid = torch.arange(L, device=dev)[None, :] >= (L - lens)[:, None]  # [P,L], False = left padding
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
    cache = model.new_cache(P, L if torch_compile else L + C)
    h = model.hidden_states(ids, attention_mask=valid, positions=positions, cache=cache)  # [P,L,D]
    src = torch.arange(P, device=dev).repeat_interleave(G)  # [N]: the prompt of each row
    logits = _logits(model, h[:, -1], vocab_size, chunk)[src]  # [N,V]
    S = L + C  # cache slots: the prompt's, then the completion's
    if torch_compile:  # a static round: S rounded up to a bucket of 128 slots, so rounds share one graph
        S = -(-S // 128) * 128
        cache = _decode_cache(model, cache, src, S)
        mode = "reduce-overhead" if dev.type == "cuda" else None  # CUDA graphs replay the whole step
        step = _COMPILED.get(mode) or _COMPILED.setdefault(mode, torch.compile(_decode_step, mode=mode,
                                                                               dynamic=False, fullgraph=True))
    else:
        cache = cache.select(src)  # [N, ...]: each prompt's prefill copied to its G rows
    key_valid = torch.cat([valid[src], valid.new_ones(N, C), valid.new_zeros(N, S - L - C)], dim=1)  # [N,S]
    next_pos = lens[src]  # [N]: RoPE position of each row's first completion token
    # [N,V] the tokens present in each row (prompt, then generated), for the repetition penalty
    seen = token_mask(torch.where(valid, ids, -1), vocab_size)[src] if repetition_penalty != 1.0 else None

    out_ids = torch.full((N, C), pad_id, dtype=torch.long, device=dev)
    out_logps = torch.zeros(N, C, device=dev)
    rows = torch.arange(N, device=dev)  # [n]: output row of each live batch row
    stopped = torch.zeros(N, dtype=torch.bool, device=dev)  # [n]
    sync_every = 1 if dev.type == "cpu" and not torch_compile else 8
    for t in range(C):
        if seen is not None:
            logits = apply_repetition_penalty(logits, seen, repetition_penalty)
        if temperature == 0:
            tok = logits.argmax(-1)  # [n]
            logp = logits.log_softmax(-1).gather(-1, tok[:, None]).squeeze(-1)
        else:
            logits, u = apply_temperature(logits, temperature), uniforms(keys, t)
            tok, logp = sample_filtered(logits, u, top_k, top_p, min_p) if filters else sample_from(logits, u)
        out_ids[rows, t], out_logps[rows, t] = tok, logp
        stopped |= torch.isin(tok, stops)
        if seen is not None:
            seen.scatter_(1, tok[:, None], True)
        if t == C - 1:
            break
        if (t + 1) % sync_every == 0:
            live = (~stopped).nonzero().squeeze(1)  # device->host sync
            if len(live) == 0:
                break
            if len(live) <= 0.75 * len(rows) and not torch_compile:  # compact: finished rows stop costing compute
                cache = cache.select(live)
                rows, tok, keys, key_valid, next_pos, stopped = (x[live] for x in (rows, tok, keys, key_valid,
                                                                                   next_pos, stopped))
                seen = None if seen is None else seen[live]
        if torch_compile:  # finished rows run on, masked out of the output
            logits = step(model, tok[:, None], (next_pos + t)[:, None], key_valid, torch.tensor(L + t, device=dev),
                          cache, vocab_size, chunk)
            logits = logits.clone() if mode else logits  # a CUDA graph's output is overwritten by its next replay
        else:
            h = model.hidden_states(tok[:, None], attention_mask=key_valid[:, :L + t + 1],
                                    positions=(next_pos + t)[:, None], cache=cache, cache_start=L + t)  # [n,1,D]
            logits = _logits(model, h[:, 0], vocab_size, chunk)

    # Masks from positions: a row ends at the first step that sampled a stop id (later slots are never read).
    is_stop = torch.isin(out_ids, stops)  # [N,C]
    has_stop = is_stop.any(-1)
    length = torch.where(has_stop, is_stop.int().argmax(-1) + 1, C)  # [N]
    C = int(length.max())
    mask = torch.arange(C, device=dev)[None, :] < length[:, None]  # [N,C]
    return Generation(completion_ids=torch.where(mask, out_ids[:, :C], pad_id), completion_mask=mask,
                      logprobs=torch.where(mask, out_logps[:, :C], 0.0), truncated=~has_stop)
