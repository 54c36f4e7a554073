"""Batched, KV-cached sampling of G completions per prompt: the rollout half of GRPO.

Owns: `generate` and `Sampling`, its settings (what it draws and how), the logit filters
(repetition penalty, temperature, top-k, top-p, min-p: pure functions [B,V] -> [B,V], -inf =
removed; `suppress` sets banned tokens to -inf), the draw of one token (`sample_next_token`), its
per-row random numbers (`row_keys`, `uniforms`), and the checks of generate's arguments
(`check_sampling`, which Sampling and TrainConfig apply; `check_prompts`). Read
`sample_next_token` first: temperature, then the filters in transformers' order, then an
inverse-CDF draw.

Left out, and where it lives: the same draw without sorting the vocabulary and a compiled
static-shape decode step (nanogrpo/fast/sampling.py; Sampling takes them as `sample_token` and
`decoder`, the loop is the same); TRL's generation_kwargs, the tokens suppress_tokens and
min_new_tokens ban, and stop strings (nanogrpo/extras/generation_kwargs.py, handed in as
Sampling's `processors`); the decode step that reads each prompt's keys once per group
(nanogrpo/fast/shared_prefix.py).

Does not know about: tokenization (prompts, stop ids and the pad id come as ints), rewards,
losses, or more than one process.

Of the model it uses `hidden_states(..., cache=, cache_start=)`, `new_cache`, `lm_head` and
`config`, and model.py's `lm_head_linear`.

Choices:
- Prefill once, copy to G rows: the P distinct prompts, left-padded to the longest, run once into
  a KV cache; `cache.select` copies prompt i's rows into its G samples (rows i*G .. i*G+G-1).
- Left padding + per-row positions: a token's RoPE position counts the real tokens before it and
  a key mask hides the pads, so a short prompt in a mixed batch is computed as if alone. A decode
  step is one batched forward of [n,1] tokens: no Python loop over rows.
- Finished rows are dropped (the eager `Decoder`): once a quarter of the live rows have stopped,
  the batch is compacted; the loop ends when all have stopped (a host sync: every step on CPU,
  every 8 on GPU).
- Output width C is the longest completion: a batch that stops early comes back narrower. The
  mask comes from the step of each row's first stop id (inclusive), never from token values, so
  pad_id may equal an eos id; stop ids inside the prompt play no part.
- Suppressed tokens (suppress_tokens, and the stop ids before min_new_tokens) are set to -inf in
  the decode loop, after the repetition penalty and before the draw, as transformers orders its
  processors: both draws see the same logits, and the log-probs are those of the distribution
  without them.
- Logits cover the real vocabulary only (the first `vocab_size` rows of lm_head): padded
  embedding rows can never be sampled. Sampling math is fp32 whatever the model dtype.
- RNG: counter-based, per row (`row_keys`, `uniforms`): a row's samples depend only on its
  prompt, the model and (seed_i, j), not on its batch mates or the device. Without `seeds`, one
  seed per prompt is drawn from `generator` (or torch's RNG).
"""

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanogrpo.model import lm_head_linear


@dataclass
class Generation:
    """What `generate` returns. N = prompts x num_samples, C = longest."""

    completion_ids: torch.Tensor  # [N,C] long, right-padded with pad_id
    # [N,C] bool, True up to the first stop id or stop string (inclusive)
    completion_mask: torch.Tensor
    # [N,C] fp32: log-prob of each sampled token under the distribution it
    # was drawn from (after suppression, temperature and the filters); 0
    # off the mask
    logprobs: torch.Tensor
    # [N] bool: rows that do not end with a stop id; a row a stop string
    # ended too, as TRL counts it (its last token is no eos)
    truncated: torch.Tensor


# -----------------------------------------------------------------------------
# Per-row random numbers: pure functions of (key, step). Row (prompt i,
# sample j) has the key hash(seed_i, j); at step t it draws u = hash(key, t).
# Unlike torch's generator, a row's samples then depend only on its prompt,
# the model and (seed_i, j): not on its batch mates, on which rows have
# stopped, or on the device.

_M32 = 0xFFFFFFFF


def _mix(x):
    """A bijective 32-bit integer hash, on python ints or int64 tensors holding 32-bit values."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def row_keys(seeds, num_samples):
    """seeds [P] int64 -> keys [P*G] int64: one random stream per (prompt, sample)."""
    sample = torch.arange(num_samples, device=seeds.device).repeat(len(seeds))  # [P*G]
    seed = seeds.repeat_interleave(num_samples) & _M32  # [P*G]
    return _mix((_mix(seed ^ 0x9E3779B9) + sample) & _M32)


def uniforms(keys, step):
    """keys [n] int64, step int -> [n] float64 in [0,1) (52 random bits), on every device alike."""
    h = _mix(keys ^ _mix(step ^ 0x3C6EF372))
    hi = _mix(h ^ 0x68E31DA4) >> 6  # 26 bits
    lo = _mix(h ^ 0x1B56C4E9) >> 6  # 26 more
    return (hi * 2**26 + lo).double() / 2**52


# -----------------------------------------------------------------------------
# Logit filters: [B,V] -> [B,V], removed tokens set to -inf


def apply_repetition_penalty(logits, seen, penalty):
    """Penalize tokens already in the row (CTRL rule, as transformers): a seen token's positive
    logit is divided by `penalty`, a negative one multiplied. seen: bool [B,V], or token ids
    [B,L] (ids < 0 or >= V are ignored, e.g. padding)."""
    if penalty == 1.0:
        return logits
    if seen.dtype != torch.bool:
        seen = token_mask(seen, logits.shape[-1])
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def token_mask(ids, V):
    """Token ids [B,L] -> bool [B,V], True where the id occurs in the row (ids < 0 or >= V
    ignored)."""
    ids = torch.where((ids >= 0) & (ids < V), ids, V).long()  # ignored ids go to an extra column
    return torch.zeros(ids.shape[0], V + 1, dtype=torch.bool, device=ids.device).scatter_(
        1, ids, True
    )[:, :V]


def suppress(logits, banned):
    """Banned tokens (bool [V]) -> -inf: transformers'
    SuppressTokensLogitsProcessor, and its MinNewTokensLengthLogitsProcessor
    when the stop ids are among them."""
    return logits.masked_fill(banned, float("-inf"))


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
    """Nucleus filter: keep the most likely tokens until their probability reaches p, i.e. a token
    is kept if the tokens ranked above it hold less than p (the top token always stays). Tokens
    tied with the last kept one are kept too. p = 1: nothing is removed."""
    if p >= 1.0:
        return logits
    return logits.masked_fill(logits < top_p_cutoff(logits, p), float("-inf"))


def top_p_cutoff(logits, p):
    """[B,V] -> [B,1]: the smallest logit the nucleus keeps. Masses are unnormalized (the top
    token's weight is 1) and accumulated in float64, so any order of adding them up gives the
    same decision unless a mass lies within ~V * 2^-52 of the goal (nanogrpo/fast/sampling.py
    finds the same cutoff unsorted, and sorts only when that happens)."""
    top = logits.amax(dim=-1, keepdim=True)  # [B,1]
    total = (logits - top).exp().sum(dim=-1, keepdim=True)  # [B,1] fp32, in vocabulary order
    goal = p * total.double()
    ranked = logits.sort(dim=-1, descending=True).values  # [B,V]
    n_keep = (mass_above(ranked, top) < goal).sum(dim=-1, keepdim=True)  # [B,1], >= 1
    return ranked.gather(-1, n_keep - 1)


def mass_above(ranked, top):
    """Descending logits [B,K] -> [B,K] float64: the unnormalized mass of the tokens ranked above
    each (an exclusive cumsum; it never decreases)."""
    return F.pad((ranked - top).exp().double().cumsum(dim=-1)[:, :-1], (1, 0))


def apply_min_p(logits, min_p):
    """Remove tokens whose probability is below min_p times the top token's probability, i.e. whose
    logit is below max + log(min_p) (the top token always stays). min_p = 0: nothing is removed."""
    if min_p == 0.0:
        return logits
    floor = logits.amax(dim=-1, keepdim=True) + math.log(min_p)  # [B,1]
    return logits.masked_fill(logits < floor, float("-inf"))


# -----------------------------------------------------------------------------
# Drawing the next token


def sample_from(logits, u, token_ids=None):
    """Inverse-CDF draw. logits [B,V] fp32 (-inf = removed), u [B] float64 in [0,1) -> (ids [B],
    their log-probs [B]): id is the first token whose cumulative probability exceeds u. With
    token_ids [B,K] (ascending, then any -inf padding), logits [B,K] are those tokens' logits,
    all others removed: the same draw, as zero weights leave a cumulative sum unchanged."""
    top = logits.amax(dim=-1, keepdim=True)  # [B,1]
    # unnormalized probabilities (the largest exactly 1), summed in fp64 so tail tokens keep their
    # exact share; in place, as on CPU fresh [B,V] buffers cost more than the arithmetic
    cdf = (logits - top).exp_().double().cumsum_(dim=-1)  # [B,V]
    total = cdf[:, -1:]  # [B,1], in [1, V]
    # u * total < total, so the first cdf entry above it belongs to a token of nonzero probability
    ids = torch.searchsorted(cdf, u[:, None] * total, right=True)  # [B,1]
    ids = ids.clamp_(max=logits.shape[-1] - 1)
    logp = (logits.gather(-1, ids) - top - total.log().float()).squeeze(-1)  # [B]
    if token_ids is not None:
        ids = token_ids.gather(-1, ids)  # positions among the candidates -> token ids
    return ids.squeeze(-1), logp


def greedy(logits):
    """argmax [B], with its log-prob under the unfiltered distribution."""
    tok = logits.argmax(-1)
    logp = logits.log_softmax(-1).gather(-1, tok[:, None]).squeeze(-1)
    return tok, logp


def sample_next_token(logits, u, temperature, top_k, top_p, min_p):
    """logits [B,V] fp32, u [B] float64 in [0,1) -> (ids [B], log-probs
    [B]). temperature 0 is greedy; top_k 0, top_p 1, min_p 0 are off."""
    if temperature == 0:
        return greedy(logits)
    logits = apply_temperature(logits, temperature)
    logits = apply_top_k(logits, top_k)
    logits = apply_top_p(logits, top_p)
    logits = apply_min_p(logits, min_p)
    return sample_from(logits, u)


# -----------------------------------------------------------------------------
# Decoding


def lm_logits(model, h, vocab_size, chunk):
    """h [n,D] -> fp32 logits [n,vocab_size] from the real vocabulary's rows of the LM head, in
    slices of `chunk` rows: one batched product, the numbers a loop over the slices gives."""
    W = model.lm_head.weight[:vocab_size]  # [V,D]: padded rows never scored
    fp32 = getattr(model, "cast_lm_head_to_fp32", False)
    if chunk >= vocab_size:  # one slice (the GPU's whole head)
        return lm_head_linear(h, W, fp32).float()
    n, D = h.shape
    full = vocab_size - vocab_size % chunk  # rows in whole slices
    logits = h.new_empty(n, vocab_size, dtype=torch.float32)
    # one call, not a thread fork and join per slice (128 for 262k tokens)
    slices = W[:full].view(-1, chunk, D)  # [k,chunk,D]
    products = head_slices(h, slices, fp32)  # [k,n,chunk]
    logits[:, :full].view(n, -1, chunk).copy_(products.transpose(0, 1))
    logits[:, full:] = lm_head_linear(h, W[full:], fp32)  # the last, shorter slice
    return logits


def head_slices(h, slices, fp32):
    """h [n,D], slices [k,c,D] -> [k,n,c]: model.py's lm_head_linear of
    each slice, as one batched product."""
    if not fp32:
        return torch.matmul(h, slices.transpose(1, 2))
    with torch.autocast(device_type=h.device.type, enabled=False):
        return torch.matmul(h.float(), slices.float().transpose(1, 2))


class Decoder:
    """The eager decode step: a cache of L + C slots, filled one slot per
    step; finished rows are compacted away. nanogrpo/fast/sampling.py's
    StaticDecoder offers the same methods with fixed shapes, for torch.compile."""

    compacts = True  # drop finished rows from the batch

    def __init__(self, model, vocab_size, chunk):
        self.model = model
        self.vocab_size = vocab_size
        self.chunk = chunk
        self.sync_every = 1 if model.lm_head.weight.device.type == "cpu" else 8

    def prefill_cache(self, P, L, C):
        return self.model.new_cache(P, L + C)

    def decode_cache(self, prefill, src, L, C):
        """[N] rows, prompt src[i]'s prefill in row i. -> (cache, slots)"""
        return prefill.select(src), L + C

    def step(self, tok, positions, key_valid, cache, slot):
        """tok, positions [n,1]; key_valid [n,S] -> logits [n,V]."""
        mask = key_valid[:, : slot + 1]
        kwargs = dict(attention_mask=mask, positions=positions, cache=cache, cache_start=slot)
        h = self.model.hidden_states(tok, **kwargs)  # [n,1,D]
        return lm_logits(self.model, h[:, 0], self.vocab_size, self.chunk)


@dataclass
class Rows:
    """The live rows of a decode: what compaction selects from."""

    index: torch.Tensor  # [n] output row of each live row
    tok: torch.Tensor  # [n] the last sampled token
    keys: torch.Tensor  # [n] RNG keys
    key_valid: torch.Tensor  # [n,S] slots each row attends to
    next_pos: torch.Tensor  # [n] RoPE position of the first new token
    stopped: torch.Tensor  # [n] bool
    seen: torch.Tensor | None  # [n,V] tokens present, for the penalty

    def select(self, live):
        return Rows(**{k: None if v is None else v[live] for k, v in vars(self).items()})


# After every decode step generate calls on_decode_step(done, total, rows), when it is set: `done`
# of `total` positions sampled, `rows` rows decoding (no host sync: the row count is a shape).
# nanogrpo/run/report.py's open_progress sets it (a status line on rank 0 when stdout is a
# terminal, else None), and sample.py while it samples.
on_decode_step = None


# -----------------------------------------------------------------------------
# What generate draws and how (`Sampling`), and the checks of its arguments: one early ValueError
# naming the argument, its value and the rule


def need(ok, name, value, rule):
    if not ok:
        raise ValueError(f"{name}={value!r}: {rule}")


def check_sampling(temperature, top_k, top_p, min_p, repetition_penalty):
    """The one rule for the sampling settings (Sampling, TrainConfig and
    generation_kwargs' checks call it); ValueError if off."""
    need(temperature >= 0, "temperature", temperature, "must be >= 0 (0 means greedy)")
    need(top_k >= 0, "top_k", top_k, "must be >= 0 (0 means off)")
    need(0 < top_p <= 1, "top_p", top_p, "must be in (0, 1] (1 means off)")
    need(0 <= min_p <= 1, "min_p", min_p, "must be in [0, 1] (0 means off)")
    penalty = repetition_penalty
    need(penalty > 0, "repetition_penalty", penalty, "must be > 0 (1 means off)")


@dataclass(frozen=True)
class Sampling:
    """What `generate` draws and how, checked when made (check_sampling). The defaults draw
    plainly from the model's whole distribution."""

    max_new_tokens: int = 256  # C: tokens sampled at most per row
    # temperature 0 is greedy (log-probs of the unfiltered temperature-1 distribution); top_k 0,
    # top_p 1, min_p 0 and repetition_penalty 1 are off
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    # a row stops at the first of these ids it samples (in its mask); pad_id only fills the padding
    stop_ids: Collection[int] = ()
    pad_id: int = 0
    vocab_size: int | None = None  # the tokenizer's real vocabulary; None: the model's
    # sample_next_token, or nanogrpo/fast/sampling.py's equal and faster sample_next_token_fast
    sample_token: Callable = sample_next_token
    # the decode step's class: None = the eager `Decoder`; fast/sampling.py's StaticDecoder compiles
    decoder: type | None = None
    # None, or processors(N, C, stop ids [k], V, device) -> (banned, stop_strings), a call's limits
    # beyond these fields (extras/generation_kwargs.py's: suppress_tokens, min_new_tokens, stop
    # strings), each None or: banned.at(t), the bool [V] mask of the tokens step t may not draw (or
    # None); stop_strings.check(out_ids, rows, t) ends rows, stop_strings.ends [N] where it did
    processors: Callable | None = None

    def __post_init__(self):
        check_sampling(
            self.temperature, self.top_k, self.top_p, self.min_p, self.repetition_penalty
        )


def check_prompts(model, prompt_ids, num_samples, max_new_tokens, vocab_size, seeds):
    """ValueError naming the first argument of generate that cannot run."""
    need(num_samples >= 1, "num_samples", num_samples, "must be >= 1")
    need(max_new_tokens >= 1, "max_new_tokens", max_new_tokens, "must be >= 1")
    V = model.config.vocab_size
    need(vocab_size > 0, "vocab_size", vocab_size, "must be >= 1")
    need(len(prompt_ids) > 0, "prompt_ids", prompt_ids, "needs at least one prompt")
    for i, p in enumerate(prompt_ids):
        need(len(p) > 0, "prompt_ids", f"[..., {i}: []]", f"prompt {i} is empty")
        ids = f"[..., {i}: [{min(p)}..{max(p)}]]"
        ok = min(p) >= 0 and max(p) < V
        need(ok, "prompt_ids", ids, f"prompt {i} has ids outside [0, {V})")
    longest = max(map(len, prompt_ids))
    cap = model.config.max_position_embeddings
    rule = f"the longest prompt ({longest}) + max_new_tokens exceeds max_position_embeddings={cap}"
    need(longest + max_new_tokens <= cap, "max_new_tokens", max_new_tokens, rule)
    ok = seeds is None or len(seeds) == len(prompt_ids)
    need(ok, "seeds", seeds, "needs one seed per prompt")


# -----------------------------------------------------------------------------
# Generation


@torch.no_grad()  # not inference_mode: the outputs feed autograd (masks)
def generate(
    model, prompt_ids, settings=Sampling(), num_samples=1, generator=None, seeds=None
) -> Generation:
    """G = `num_samples` completions of each of the P prompts (non-empty lists of token ids), drawn
    as `settings` say -> a Generation of P x G rows. seeds: P ints (see RNG above)."""
    # ids past the model's rows are never drawn (Gemma 3's tokenizer has one: <image_soft_token>)
    vocab_size = min(settings.vocab_size or model.config.vocab_size, model.config.vocab_size)
    C = settings.max_new_tokens
    prompt_ids = [[int(t) for t in p] for p in prompt_ids]
    check_prompts(model, prompt_ids, num_samples, C, vocab_size, seeds)
    dev = model.lm_head.weight.device
    # CPU BLAS multiplies [n,D] by slices of 2048 vocab rows faster than by the whole [V,D]
    chunk = 2048 if dev.type == "cpu" else vocab_size
    decoder = (settings.decoder or Decoder)(model, vocab_size, chunk)
    P = len(prompt_ids)
    if seeds is None:
        where = getattr(generator, "device", "cpu")
        seeds = torch.randint(0, 2**31 - 1, (P,), generator=generator, device=where)
    keys = row_keys(torch.as_tensor(seeds, dtype=torch.long).to(dev), num_samples)
    stops = sorted({int(s) for s in settings.stop_ids or ()})
    stops = torch.tensor(stops, dtype=torch.long, device=dev)
    banned = strings = None  # the limits beyond the sampling fields
    if settings.processors is not None:
        banned, strings = settings.processors(P * num_samples, C, stops, vocab_size, dev)
    out_ids, out_logps = decode_loop(decoder, prompt_ids, keys, stops, settings, (banned, strings))
    ends = None if strings is None else strings.ends
    return assemble(out_ids, out_logps, stops, settings.pad_id, ends)


def prefill(decoder, prompt_ids, G, C, pad_id):
    """The P prompts, left-padded to the longest L, run once -> (the first logits [N,V], the
    decode cache, key_valid [N,S], each row's next position [N], its prompt [N,L] (-1: pad), L)."""
    model = decoder.model
    dev = model.lm_head.weight.device
    P = len(prompt_ids)
    N = P * G
    lens = torch.tensor([len(p) for p in prompt_ids], device=dev)  # [P]
    L = int(lens.max())
    padded = [[pad_id] * (L - len(p)) + p for p in prompt_ids]
    ids = torch.tensor(padded, device=dev)  # [P,L]
    valid = torch.arange(L, device=dev)[None, :] >= (L - lens)[:, None]
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
    cache = decoder.prefill_cache(P, L, C)
    h = model.hidden_states(ids, attention_mask=valid, positions=positions, cache=cache)  # [P,L,D]
    src = torch.arange(P, device=dev).repeat_interleave(G)  # [N] prompts
    logits = lm_logits(model, h[:, -1], decoder.vocab_size, decoder.chunk)
    cache, S = decoder.decode_cache(cache, src, L, C)
    # [N,S]: the prompt's keys, the completion's slots, the cache's slack
    key_valid = torch.cat([valid[src], valid.new_ones(N, C), valid.new_zeros(N, S - L - C)], 1)
    row_prompts = torch.where(valid, ids, -1)[src]  # [N,L]
    return logits[src], cache, key_valid, lens[src], row_prompts, L


def decode_loop(decoder, prompt_ids, keys, stops, settings, limits):
    """keys [N] (N = P x G rows), stops [k] ids, limits = (a Banned or None, a StopStrings or
    None) -> (ids [N,C], log-probs [N,C]) of every step."""
    G = len(keys) // len(prompt_ids)
    C = settings.max_new_tokens
    pad_id = settings.pad_id
    penalty = settings.repetition_penalty
    banned, strings = limits
    draw = {k: getattr(settings, k) for k in ("temperature", "top_k", "top_p", "min_p")}
    dev = keys.device
    logits, cache, key_valid, next_pos, row_prompts, L = prefill(decoder, prompt_ids, G, C, pad_id)
    N = len(keys)
    # [N,V] tokens present in each row, for the repetition penalty
    seen = token_mask(row_prompts, decoder.vocab_size) if penalty != 1.0 else None
    rows = Rows(
        index=torch.arange(N, device=dev),
        tok=None,
        keys=keys,
        key_valid=key_valid,
        next_pos=next_pos,
        stopped=torch.zeros(N, dtype=torch.bool, device=dev),
        seen=seen,
    )
    out_ids = torch.full((N, C), pad_id, dtype=torch.long, device=dev)
    out_logps = torch.zeros(N, C, device=dev)
    for t in range(C):
        if rows.seen is not None:
            logits = apply_repetition_penalty(logits, rows.seen, penalty)
        ban = None if banned is None else banned.at(t)  # [V] or None
        if ban is not None:
            logits = suppress(logits, ban)
        tok, logp = settings.sample_token(logits, uniforms(rows.keys, t), **draw)
        out_ids[rows.index, t] = tok
        out_logps[rows.index, t] = logp
        rows.tok = tok
        rows.stopped |= torch.isin(tok, stops)
        if strings is not None and ((t + 1) % decoder.sync_every == 0 or t == C - 1):
            strings.check(out_ids, rows, t)
        if rows.seen is not None:
            rows.seen.scatter_(1, tok[:, None], True)
        if on_decode_step is not None:  # no host sync: the row count is a shape
            on_decode_step(t + 1, C, len(rows.index))
        if t == C - 1:
            break
        if (t + 1) % decoder.sync_every == 0:
            live = (~rows.stopped).nonzero().squeeze(1)  # a host sync
            if len(live) == 0:
                break
            if decoder.compacts and len(live) <= 0.75 * len(rows.index):  # a quarter have stopped
                cache = cache.select(live)
                rows = rows.select(live)
        positions = (rows.next_pos + t)[:, None]  # [n,1]
        logits = decoder.step(rows.tok[:, None], positions, rows.key_valid, cache, L + t)
    return out_ids, out_logps


def assemble(out_ids, out_logps, stops, pad_id, ends=None) -> Generation:
    """Masks from positions: a row ends at the first step that sampled a
    stop id, or at `ends` ([N] lengths where a stop string ended it), the
    earlier (later slots are never read); C = the longest row."""
    is_stop = torch.isin(out_ids, stops)  # [N,C]
    has_stop = is_stop.any(-1)
    length = torch.where(has_stop, is_stop.int().argmax(-1) + 1, out_ids.shape[1])  # [N]
    if ends is not None:
        has_stop &= length <= ends  # the stop id came first: the row ends with it
        length = torch.minimum(length, ends)
    C = int(length.max())
    mask = torch.arange(C, device=out_ids.device)[None, :] < length[:, None]  # [N,C]
    return Generation(
        completion_ids=torch.where(mask, out_ids[:, :C], pad_id),
        completion_mask=mask,
        logprobs=torch.where(mask, out_logps[:, :C], 0.0),
        truncated=~has_stop,
    )
