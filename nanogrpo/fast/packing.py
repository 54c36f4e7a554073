"""padding_free (TRL's name): a micro-batch's sequences scored as one packed row, no padding.

Owns: `pack` (a micro-batch's [n,L] rows -> `PackedRow`: the real tokens of every sequence in one
row [1,T], each distinct prompt once, positions restarting at each sequence, and where each scored
token's hidden state lies), `PackedRow` (its `attend`, which model.Attention calls as it calls a
cache's: each completion attends to its prompt and itself only; `each_sequence`, which Qwen3.5's
Gated DeltaNet calls) and the kernels: `token_logprobs` and `policy_logprobs`, of logprobs.py's
signatures and numbers (tests/test_packing.py holds them equal, values and gradients), which
train.py's `kernels` picks with padding_free=true; and with token_budget `by_tokens`, the update's
forwards: each micro-batch cut into forwards of at most that many packed tokens, each with its
share of the micro-batch's loss.

Does not know about: sampling or files.

Of the loss it knows how each loss type counts a micro-batch (by_tokens' shares: rows, tokens or
the whole step); of torch.distributed, that every rank makes the same model calls, so by_tokens
takes the most forwards any rank needs (one all-reduce of their count).

Why: the update pads every micro-batch to its longest sequence, and GRPO's completions are
long-tailed (a few long, most short), so most of a padded micro-batch can be padding: run forward
and backward, then masked away. A packed row runs only the real tokens up to each row's last
scored one (T of them), a group's prompt once for its G completions; attention costs each
sequence's own length times its keys', not L^2 per row.

Choices:
- The row: for each distinct prompt (the same ids and mask: a group), its real tokens, then each
  of its completions' real tokens before the last scored one: the hidden states that predict
  scored tokens, and nothing after them (the completion's padding after its end is real to the
  padded forward's mask, and never read). A completion's first token is predicted by its prompt's
  last slot, shared by the group.
- Positions are the padded forward's (the count of real tokens before each), so RoPE, SmolLM3's
  NoPE layers and Gemma 3's local RoPE see what they see there; Gemma 3's sliding layers mask each
  sequence's keys to the last sliding_window real tokens, by those positions.
- Attention: on CPU (or in float32) a loop over the segments, model.sdpa over a prompt's slice
  (causal) or over a completion's queries against its prompt's keys and its own (a mask made
  from the positions): exact; on CUDA in bf16/fp16 (or under such an autocast), torch's
  varlen_attn (torch >= 2.10, flash attention, causal aligned to each segment's last key) over
  the keys gathered segment by segment, when it imports. The mask model.py would build for a
  packed row ([1,1,T,T]) is never built: the row masks itself.
- Qwen3.5's Gated DeltaNet keeps a recurrent state along its input: it runs on each sequence
  alone (a completion after its prompt's tokens, again), from a zero state, as each padded row
  does.
- The LM head is fast/logprobs.py's, in chunks, on the scored tokens only; the update's rows
  without advantage are scored without gradient as fast/logprobs.py's policy_logprobs does.
- batch_invariant is refused (run/rules.py): its kernels score padded rows.
- token_budget cuts within a micro-batch, never across two: each loss type's normaliser counts a
  micro-batch (grpo.aggregate), so a forward's loss is its share of its micro-batch's and the
  step's loss and gradient are the padded update's. A sequence longer than the budget is an error
  before the step's first forward (TRL's AsyncGRPOTrainer drops it with a warning: here nothing
  the sampler drew is lost silently). The loss metrics (entropy, clip ratios, KL) are then means
  over the forwards, not over the micro-batches.
"""

from functools import partial

import torch

from nanogrpo.distributed import max_over_ranks
from nanogrpo.fast import logprobs as fast_logprobs
from nanogrpo.logprobs import check_shapes
from nanogrpo.model import sdpa

try:  # torch >= 2.10: flash attention over packed sequences (forward and backward), CUDA only
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # older torch: the loop over sequences
    varlen_attn = None


# -----------------------------------------------------------------------------
# The packed row

HALF = (torch.bfloat16, torch.float16)


class PackedRow:
    """A micro-batch's sequences in one row [1,T], each distinct prompt once: `segments`
    [(start, end, prefix_start, prefix_end)] on the host, tiling the row: a prompt's (no prefix,
    prefix_start == prefix_end) and each completion's, whose queries see its prompt's segment (its
    prefix) and its own tokens; `positions` [T]; `sliding` [layers] and `window`: Gemma 3's sliding
    layers. Passed to the model as its `cache=`: model._trunk then builds no mask, and every layer's
    attention comes here."""

    static = False  # (model.KVCache.static)
    packed = True  # model._trunk: no [T,T] mask; checkpointed blocks as without a cache

    def __init__(self, segments, positions, sliding, window):
        self.segments = segments
        self.positions = positions
        self.max_len = segments[-1][1] if segments else 0  # T (model._trunk's check)
        self.sliding = sliding
        self.window = window
        self.masks = {}  # (segment, window) -> a completion's mask, made once per forward
        self.varlen = None  # (key slots, cu_seq_q, cu_seq_k, max_q, max_k), made on first use

    def attend(self, q, k, v, mask, scale, layer, start):
        """q [1,H,T,D], k, v [1,Hkv,T,D] -> [1,T,H*D]: each segment's queries over its prefix's
        keys and its own, causal (and windowed in a sliding layer). mask and start are unused."""
        window = self.window if self.sliding[layer] else None
        if varlen_attn is not None and q.is_cuda and compute_dtype(q) in HALF:
            return self.attend_varlen(q, k, v, scale, window)
        parts = []
        for i, (s, e, ps, pe) in enumerate(self.segments):
            if e == s:
                continue
            if ps == pe:  # a prompt: causal over itself
                seq_mask = window_mask(e - s, window, q.device)
                parts.append(sdpa(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], seq_mask, scale))
                continue
            seq_k = torch.cat([k[:, :, ps:pe], k[:, :, s:e]], dim=2)  # its prompt's, then its own
            seq_v = torch.cat([v[:, :, ps:pe], v[:, :, s:e]], dim=2)
            parts.append(sdpa(q[:, :, s:e], seq_k, seq_v, self.prefix_mask(i, window), scale))
        return torch.cat(parts, dim=1)

    def each_sequence(self, layer, x):
        """layer(x [1,n,C]) run on each sequence of the row x [1,T,C] alone, a completion after its
        prompt, as a new state (Qwen3.5's Gated DeltaNet: its recurrent state and convolution
        start from zero at each sequence, as in the padded forward's rows) -> [1,T,C]."""
        parts = []
        for s, e, ps, pe in self.segments:
            if e == s:
                continue
            if ps == pe:  # a prompt
                parts.append(layer(x[:, s:e]))
            else:  # its prompt's tokens first, run again: their outputs are its prompt's own
                parts.append(layer(torch.cat([x[:, ps:pe], x[:, s:e]], dim=1))[:, pe - ps :])
        return torch.cat(parts, dim=1)

    def prefix_mask(self, i, window):
        """Segment i's bool mask [1,1,n,P+n] over its prefix's P keys and its own n: key j seen by
        query t when position(j) <= position(t) (and, windowed, position(t) - position(j) <
        window): the padded forward's mask, by the positions it ran at."""
        if (i, window) not in self.masks:
            s, e, ps, pe = self.segments[i]
            at = self.positions[s:e, None]  # [n,1]
            keys = torch.cat([self.positions[ps:pe], self.positions[s:e]])[None]  # [1,P+n]
            seen = keys <= at
            if window is not None:
                seen &= at - keys < window
            self.masks[i, window] = seen[None, None]
        return self.masks[i, window]

    def attend_varlen(self, q, k, v, scale, window):
        """attend with torch's varlen_attn (CUDA, bf16/fp16; flash attention's causal mask is
        aligned to the end of each segment's keys, so a completion's queries follow its prefix);
        unmeasured here."""
        H, T, D = q.shape[1:]
        if self.varlen is None:
            self.varlen = varlen_layout(self.segments, q.device)
        slots, cu_q, cu_k, max_q, max_k = self.varlen
        dtype = compute_dtype(q)  # under autocast RoPE's fp32 cos/sin leave q and k in fp32
        # varlen's window (left, 0) sees keys q - left .. q: Gemma's q - k < window
        left = -1 if window is None else window - 1
        y = varlen_attn(
            q[0].transpose(0, 1).to(dtype),  # [T,H,D]
            k[0, :, slots]
            .transpose(0, 1)
            .to(dtype),  # [keys,Hkv,D]: each segment's prefix, then it
            v[0, :, slots].transpose(0, 1).to(dtype),
            cu_q,
            cu_k,
            max_q,
            max_k,
            scale=scale,
            window_size=(left, 0),
            enable_gqa=k.shape[1] != H,
        )
        return y.reshape(1, T, H * D)


def compute_dtype(x):
    """The dtype x's attention runs in: the autocast dtype where autocast is on, else x's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def varlen_layout(segments, device):
    """varlen_attn's arguments for the segments: the key slots [K] (each segment's prefix, then its
    own), cu_seq_q and cu_seq_k [m+1] int32 and the longest query and key runs."""
    slots, cu_q, cu_k = [], [0], [0]
    for s, e, ps, pe in segments:
        slots += [*range(ps, pe), *range(s, e)]
        cu_q.append(e)
        cu_k.append(len(slots))
    longest_q = max((e - s for s, e, _, _ in segments), default=0)
    longest_k = max((b - a for a, b in zip(cu_k, cu_k[1:])), default=0)
    as_tensor = partial(torch.tensor, dtype=torch.int32, device=device)
    return (
        torch.tensor(slots, device=device),
        as_tensor(cu_q),
        as_tensor(cu_k),
        longest_q,
        longest_k,
    )


def window_mask(length, window, device):
    """None (plain causal) or, for a sliding layer whose window is shorter than the sequence, the
    bool mask [1,1,length,length]: key j seen by query i when 0 <= i - j < window."""
    if window is None or length <= window:
        return None
    i = torch.arange(length, device=device)
    behind = i[:, None] - i[None, :]  # [length,length]
    return ((behind >= 0) & (behind < window))[None, None]


def pack(model, input_ids, attention_mask, completion_mask):
    """[n,L] rows (left-padded prompts, then the last C columns the completions) -> (ids [1,T],
    positions [1,T], PackedRow, where: the scored (row, column) pairs, at [M]: the packed slot
    whose hidden state predicts each scored token). Rows of one prompt (the same first L - C ids
    and mask: a group) share one copy of it; each row's completion follows, up to the token before
    its last scored one."""
    n, L = input_ids.shape
    C = completion_mask.shape[1]
    P = L - C
    scored = completion_mask.bool()
    # each row's end: the slot after the one predicting its last scored token (0: none)
    columns = torch.arange(1, C + 1, device=scored.device)
    last = (scored * columns).amax(1, keepdim=True)  # [n,1]: last scored column + 1
    slots = torch.arange(L, device=scored.device)
    real = attention_mask.bool()
    keep = real & (slots < P - 1 + last.clamp(min=1))  # [n,L]; nothing scored: the prompt
    prompt = torch.cat([input_ids[:, :P], attention_mask[:, :P].long()], dim=1)
    unique, group = prompt.unique(dim=0, return_inverse=True)  # [n]: each row's prompt
    rows = torch.arange(n, device=group.device)
    seen = rows.new_full((len(unique),), n).scatter_reduce(0, group, rows, "amin")
    group = seen.argsort().argsort()[group]  # numbered in the order the rows bring them
    order = group.argsort(stable=True)  # the rows, group by group
    first = torch.ones_like(group, dtype=torch.bool)
    first[order[1:]] = group[order[1:]] != group[order[:-1]]  # [n]: a group's first row
    keep[:, :P] &= first[:, None]  # the others' prompt is their group's first row's
    where = scored.nonzero(as_tuple=True)
    # the slot predicting each scored token: its completion's previous one, or for the first
    # token the prompt's last, in the group's first row
    owner = order[torch.searchsorted(group[order], group)]  # [n]: the first row of each's group
    before_row = torch.where(where[1] == 0, owner[where[0]], where[0])
    before = where[1] + P - 1
    if not bool(keep[before_row, before].all()):
        raise ValueError(
            "padding_free: a scored completion token follows a padding slot (attention_mask 0); "
            "only left-padded prompts and right-padded completions pack"
        )
    kept = keep[order]  # [n,L], group by group
    place = torch.empty_like(keep, dtype=torch.long)
    place[order] = kept.flatten().cumsum(0).view(n, L) - 1  # each kept slot's place in the row
    lengths = torch.stack([kept[:, :P].sum(1), kept[:, P:].sum(1)], 1).tolist()  # a host sync
    segments, offset, prefix = [], 0, None
    for (prompt_len, completion_len), is_first in zip(lengths, first[order].tolist()):
        if is_first:  # the group's prompt: its segment, the prefix of the group's completions
            prefix = (offset, offset + prompt_len)
            segments.append((*prefix, offset, offset))
            offset += prompt_len
        segments.append((offset, offset + completion_len, *prefix))
        offset += completion_len
    positions = (real.long().cumsum(-1) - 1).clamp(min=0)[order][kept]  # the padded forward's
    row = PackedRow(segments, positions, model.sliding, model.config.sliding_window)
    at = place[before_row, before]  # [M]
    return input_ids[order][kept][None], positions[None], row, where, at


# -----------------------------------------------------------------------------
# The kernels


def token_logprobs(
    model,
    input_ids,
    attention_mask,
    completion_mask,
    temperature=1.0,
    vocab_size=None,
    chunk_size=256,
    keep_bytes=fast_logprobs.KEEP_BYTES,
    entropy_grad=False,
):
    """nanogrpo.logprobs.token_logprobs' result (same arguments, same numbers), the micro-batch
    packed into one row: (logps, entropy) [n,C], 0 where completion_mask is 0. chunk_size,
    keep_bytes and entropy_grad as in fast/logprobs.py's token_logprobs."""
    check_shapes(input_ids, attention_mask, completion_mask, temperature)
    if model.gradient_checkpointing and torch.is_grad_enabled() or not torch.is_grad_enabled():
        keep_bytes = 0  # no backward, or a run that trades compute for memory
    ids, positions, row, where, at = pack(model, input_ids, attention_mask, completion_mask)
    targets = input_ids[:, -completion_mask.shape[1] :][where]  # [M]
    ones = targets.new_ones(len(targets), 1)

    def head(h, lm_head):  # h [1,T,D] -> the scored tokens' (logp, entropy) [M,1]
        return fast_logprobs.score_chunks(
            h[0, at][:, None],  # [M,1,D]
            lm_head,
            targets[:, None],
            ones,
            temperature=temperature,
            vocab_size=vocab_size,
            chunk_size=chunk_size,
            keep_bytes=keep_bytes,
            entropy_grad=entropy_grad,
            fp32=getattr(model, "cast_lm_head_to_fp32", False),
        )

    logp, entropy = model(ids, positions=positions, cache=row, head=head)
    zeros = logp.new_zeros(completion_mask.shape)
    # back into [n,C]; masked slots stay 0
    return zeros.index_put(where, logp[:, 0]), zeros.index_put(where, entropy[:, 0])


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
    """nanogrpo.logprobs.policy_logprobs' result (same arguments, same numbers, the same gradients
    for GRPO's losses): fast/logprobs.py's policy_logprobs with each call packed (rows without
    advantage scored under no_grad, their own packed row)."""
    return fast_logprobs.policy_logprobs(
        model,
        input_ids,
        attention_mask,
        completion_mask,
        advantages,
        beta=beta,
        entropy_bonus=entropy_bonus,
        world_size=world_size,
        temperature=temperature,
        vocab_size=vocab_size,
        score=token_logprobs,
    )


def packed_kernels(padding_free: bool, token_budget: int | None = None) -> dict:
    """trainer.Kernels' fields this module fills with padding_free (none without it), and with a
    token_budget the update's forwards (by_tokens)."""
    if not padding_free:
        return {}
    out = dict(token_logprobs=token_logprobs, policy_logprobs=policy_logprobs)
    if token_budget is not None:
        out["forwards"] = partial(by_tokens, budget=token_budget)
    return out


# -----------------------------------------------------------------------------
# token_budget: the update's forwards cut by tokens


def by_tokens(micro, loss_type, info, budget):
    """The optimizer step's micro-batches [(Rollout, rows)] cut into forwards of at most `budget`
    packed tokens (each distinct prompt once, each completion up to its last scored token, as
    `pack` lays them), a micro-batch's rows never mixed with another's: -> [(Rollout, rows, share)],
    share: the part of its micro-batch's loss the forward's rows make, by the loss type's count
    (grpo.aggregate): its rows' (grpo, sapo, luspo, dr_grpo: a mean over rows), its tokens'
    (bnpo: a mean over the micro-batch's tokens) or 1 (dapo, cispo, vespo: a step-wide
    normaliser). train.optimizer_step divides grad_accum by it, so the forwards' losses sum to the
    padded micro-batch's, gradient too. Every rank makes as many forwards (FSDP2's collectives):
    the ranks with fewer split their forwards of most rows. ValueError, before any forward, where
    one sequence alone is longer than the budget."""
    forwards = []  # (Rollout, its micro-batch's rows, the forward's)
    for ro, idx in micro:
        lengths, group = packed_lengths(ro, idx)  # [(prompt, completion)], [group] of each row
        forwards += [(ro, idx, idx[rows]) for rows in cut(lengths, group, budget)]
    target = max_over_ranks(len(forwards), info)
    while len(forwards) < target:  # a rank's rows are as many as any's: one has >= 2
        k = max(range(len(forwards)), key=lambda i: len(forwards[i][2]))
        ro, idx, rows = forwards[k]
        half = len(rows) // 2
        forwards[k : k + 1] = [(ro, idx, rows[:half]), (ro, idx, rows[half:])]
    return [(ro, rows, share(ro, idx, rows, loss_type)) for ro, idx, rows in forwards]


def share(ro, idx, rows, loss_type):
    """The part of micro-batch idx's loss its rows `rows` make (see by_tokens)."""
    if loss_type in ("dapo", "cispo", "vespo"):
        return 1.0
    if loss_type == "bnpo":
        tokens = int(ro.completion_mask[rows].sum())
        return tokens / int(ro.completion_mask[idx].sum()) if tokens else 1.0  # none: a zero loss
    return len(rows) / len(idx)


def packed_lengths(ro, idx):
    """The micro-batch rows idx of Rollout ro: each row's (prompt, completion) packed tokens (its
    prompt's real tokens; its completion's real tokens before its last scored one) and its
    prompt's number (rows of one prompt: one group), read to the host."""
    ids, att, mask = ro.input_ids[idx], ro.attention_mask[idx], ro.completion_mask[idx]
    C = mask.shape[1]
    P = ids.shape[1] - C
    columns = torch.arange(1, C + 1, device=mask.device)
    last = (mask.bool() * columns).amax(1)  # [n]: last scored column + 1
    completion = (att[:, P:].bool() & (columns[None] < last[:, None])).sum(1)
    prompt = att[:, :P].sum(1)
    _, group = torch.cat([ids[:, :P], att[:, :P]], 1).unique(dim=0, return_inverse=True)
    lengths = torch.stack([prompt, completion], 1).tolist()
    return lengths, group.tolist()


def cut(lengths, group, budget):
    """Rows in forwards of at most budget packed tokens, greedily, a group's rows together:
    -> [[row numbers]]."""
    forwards, rows, tokens, prompts = [], [], 0, set()
    for r in sorted(range(len(lengths)), key=lambda r: group[r]):
        prompt, completion = lengths[r]
        if prompt + completion > budget:
            raise ValueError(
                f"token_budget={budget}: one sequence is {prompt + completion} tokens (prompt "
                f"{prompt} + completion {completion}); raise token_budget to at least "
                f"{prompt + completion} or lower max_prompt_length/max_completion_length"
            )
        cost = completion + (0 if group[r] in prompts else prompt)
        if rows and tokens + cost > budget:
            forwards.append(rows)
            rows, tokens, prompts = [], 0, set()
            cost = prompt + completion
        rows.append(r)
        tokens += cost
        prompts.add(group[r])
    return forwards + [rows]
