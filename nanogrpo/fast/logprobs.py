"""The log-probs' speed tricks, each equal to its plain version in logprobs.py.

`token_logprobs` computes nanogrpo.logprobs.token_logprobs' numbers and
`policy_logprobs` nanogrpo.logprobs.policy_logprobs' (same arguments;
tests/test_logprobs.py holds them equal, values and gradients) with
four tricks:
- a batch runs only up to its last scored completion column
  (`scored_width`): a micro-batch's rows are padded to the round's
  longest completion, and the padding after every row's end is neither
  run forward nor backward;
- the LM head in chunks (`ChunkedLogProbs`, `score_chunks`): never the full
  [N,C,V] fp32 logits, only the hidden states of the scored tokens
  through the LM head, chunk_size tokens at a time, each chunk's gradient
  formed directly (one-hot minus softmax). A chunk's probabilities are
  kept for backward up to keep_bytes a call; later chunks recompute
  them, so peak memory is keep_bytes plus a few [chunk_size, V] blocks
  whatever N x C is;
- rows that share a prompt (a group) share its forward
  (`shared_prompt_forward`): each distinct prompt runs once into a KV
  cache, copied to its rows, then only the completions run;
- in the update (`policy_logprobs`), rows whose advantage is 0 (with
  beta = 0 and no entropy bonus) are scored without gradient
  (`rows_without_gradient`): no backward and no stored activations for
  rows that add nothing to the gradient.
The entropy carries a gradient only when asked (entropy_grad=True: TRL's
entropy bonus); the plain version's always has one.

Does not know about: sampling, or torch.distributed (world_size is a
number it is given: with several ranks every rank makes the same calls,
so FSDP2's collectives stay in step). Of the loss it knows one thing,
rows_without_gradient's rule: which rows' loss has no gradient, given the
loss settings it is passed (advantages, beta, the entropy bonus).

Of the model it uses its call `model(input_ids, attention_mask=,
positions=, cache=, cache_start=, head=fn)` (fn(hidden after the final
norm, lm_head) replaces the logits, inside forward, so FSDP2 keeps the LM
head gathered while it runs), `new_cache`, `gradient_checkpointing` and
`cast_lm_head_to_fp32` (the LM head's matmul in float32, with model.py's
`lm_head_linear`).
"""

import contextlib

import torch
import torch.nn.functional as F

from nanogrpo.logprobs import check_shapes
from nanogrpo.model import lm_head_linear

KEEP_BYTES = 2**30  # probabilities kept for backward per call, by default


# -----------------------------------------------------------------------------
# The LM head in chunks, a shared prompt's forward once


def _tempered_logits(h, weight, temperature, fp32=False):
    """h [n,D] @ weight [V,D].T -> logits [n,V] / temperature, in fp32 (fp64 for an fp64 model);
    fp32: the matmul too (cast_lm_head_to_fp32)."""
    logits = lm_head_linear(h, weight, fp32)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    # logits is a new tensor: divided in place
    return logits if temperature == 1.0 else logits.div_(temperature)


def _head_weight(weight, fp32):
    """The LM head's weight [V,D] as its matmuls use it, cast once: float32 with fp32
    (cast_lm_head_to_fp32), else autocast's dtype under an autocast (what F.linear would cast
    it to at every call), else as it is."""
    device = weight.device.type
    if fp32:
        return weight.float()
    if torch.is_autocast_enabled(device) and weight.dtype in (torch.float32, torch.float16):
        return weight.to(torch.get_autocast_dtype(device))
    return weight


def _add_in_slices(acc, part, rows=8192):
    """acc += part (another dtype) a slice of rows at a time: on CPU an add across dtypes first
    casts its whole input ([V,D] fp32 here, 0.5 GB at Qwen2.5-0.5B's head); a GPU casts in the
    kernel, so one slice holds it all there."""
    step = len(part) if acc.device.type != "cpu" else rows
    for i in range(0, len(part), step):
        acc[i : i + step].add_(part[i : i + step])


class ChunkedLogProbs(torch.autograd.Function):
    """(h [M,D], weight [V,D], targets [M], temperature, chunk_size, keep_rows, entropy_grad, fp32)
    -> (logp [M], entropy [M]) of the targets under p = softmax(z), z = h @ weight.T / temperature,
    chunk_size tokens at a time: no tensor larger than [chunk_size, V] but the kept probabilities.
    Backward forms each chunk's logits' gradient directly instead of replaying each op's backward:
    d logp / dz = onehot - p, and, with entropy_grad, dH / dz = -p (log p + H). The chunks that end
    within the first keep_rows tokens save their [chunk,V] probabilities for it; the others save
    log Z only and recompute them (one more [chunk,D] x [D,V] matmul), so no vocabulary-sized
    tensor outlives its chunk. Without entropy_grad the entropy gets no gradient (it is logged, or
    masks tokens).
    One Function for all the chunks, so the weight is cast (under autocast) once a call in forward
    and once in backward, and its gradient is summed in one [V,D] buffer in place; one Function
    per chunk would cast it in each chunk's forward, recompute and backward and hand back a new
    [V,D] gradient per chunk for autograd to cast and add (the H200's profile of the update:
    `copy_` 26% of GPU time). Backward runs under the forward's autocast state on the tensors'
    device (torch.amp.custom_bwd's rule, which that decorator applies to one fixed device type
    only): under a bf16 autocast, on CPU too, its recompute and matmuls round as autograd's
    backward of the same ops does."""

    @staticmethod
    def forward(ctx, h, weight, targets, temperature, chunk_size, keep_rows, entropy_grad, fp32):
        device = h.device.type
        # for backward
        ctx.autocast = dict(
            device_type=device,
            enabled=torch.is_autocast_enabled(device),
            dtype=torch.get_autocast_dtype(device),
        )
        w = _head_weight(weight, fp32)  # [V,D]
        M = len(targets)
        out_dtype = torch.promote_types(h.dtype, torch.float32)
        logp = h.new_empty(M, dtype=out_dtype)
        entropy = h.new_empty(M, dtype=out_dtype)
        log_z = h.new_empty(M, dtype=out_dtype)
        kept = []
        for i in range(0, M, chunk_size):
            end = min(i + chunk_size, M)
            # [n,V], a fresh tensor: changed in place below
            shifted = _tempered_logits(h[i:end], w, temperature, fp32)
            top = shifted.amax(dim=-1, keepdim=True)  # [n,1]
            shifted = shifted.sub_(top)  # z - max z: every exp below is <= 1
            probs = shifted.exp()  # [n,V], unnormalized until the division
            lse = probs.sum(dim=-1, keepdim=True)  # [n,1]
            probs.div_(lse)
            lse = lse.log_()  # log Z - max z
            logp[i:end] = (shifted.gather(-1, targets[i:end, None]) - lse).squeeze(-1)
            # H = log Z - E_p[z]
            entropy[i:end] = (lse - shifted.mul_(probs).sum(dim=-1, keepdim=True)).squeeze(-1)
            log_z[i:end] = (top + lse).squeeze(-1)
            if end <= keep_rows:
                kept.append(probs)
            # freed now, not when the next chunk's are already made
            del shifted, probs
        ctx.save_for_backward(h, weight, targets, log_z, entropy if entropy_grad else None, *kept)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.fp32 = fp32
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        with torch.autocast(**ctx.autocast):  # as the forward ran
            return ChunkedLogProbs.backward_body(ctx, grad_logp, grad_entropy)

    @staticmethod
    def backward_body(ctx, grad_logp, grad_entropy):
        h, weight, targets, log_z, entropy, *kept = ctx.saved_tensors
        w = _head_weight(weight, ctx.fp32)  # [V,D]
        # autograd casts a gradient to its input's dtype; these are written in it
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None  # [M,D]
        grad_w = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None  # [V,D]
        no_autocast = torch.autocast(device_type=h.device.type, enabled=False)
        for k, i in enumerate(range(0, len(targets), ctx.chunk_size)):
            end = min(i + ctx.chunk_size, len(targets))
            if k < len(kept):  # the saved probabilities [n,V]
                probs = kept[k]
            else:  # recomputed from log Z [n]
                probs = _tempered_logits(h[i:end], w, ctx.temperature, ctx.fp32)
                probs = probs.sub_(log_z[i:end, None]).exp_()
            g_logp = grad_logp[i:end, None]  # [n,1]
            # a new tensor, so a retained graph can run backward again
            grad = probs.mul(-g_logp)  # [n,V]
            if entropy is not None and grad_entropy is not None:
                # dH/dz = -(p log p + p H); xlogy gives 0 where p = 0
                minus_dH = torch.xlogy(probs, probs).add_(probs * entropy[i:end, None])
                grad = grad.sub_(minus_dH.mul_(grad_entropy[i:end, None]))
            grad = grad.scatter_add_(1, targets[i:end, None], g_logp)  # d/d logits [n,V]
            grad = (grad if ctx.temperature == 1.0 else grad.div_(ctx.temperature)).to(h.dtype)
            h_i = h[i:end]
            if ctx.fp32:  # the matmuls ran in float32: their gradients too
                grad, h_i = grad.float(), h_i.float()
            with no_autocast if ctx.fp32 else contextlib.nullcontext():
                if grad_h is not None:
                    grad_h[i:end] = grad @ w
                mixed = torch.is_autocast_enabled(h.device.type) or grad.dtype != weight.dtype
                if grad_w is not None and mixed:
                    _add_in_slices(grad_w, grad.T @ h_i)  # [V,D] in autocast's dtype
                elif grad_w is not None:  # summed in the matmul: no [V,D] temporary
                    grad_w.addmm_(grad.T, h_i)
            # freed now, not when the next chunk's are already made
            del probs, grad
        return grad_h, grad_w, None, None, None, None, None, None


def token_logprobs(
    model,
    input_ids,
    attention_mask,
    completion_mask,
    temperature=1.0,
    vocab_size=None,
    chunk_size=256,
    keep_bytes=KEEP_BYTES,
    entropy_grad=False,
):
    """nanogrpo.logprobs.token_logprobs' result (same arguments, same
    numbers) with peak memory of keep_bytes of kept probabilities (only
    with grad, none under the model's gradient_checkpointing) plus a few
    [chunk_size, V] blocks, whatever N x C is. The entropy gets a gradient
    only with entropy_grad (the plain version's always has one)."""
    check_shapes(input_ids, attention_mask, completion_mask, temperature)
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    C = completion_mask.shape[1]
    width = scored_width(completion_mask)  # the columns after it change nothing
    L = input_ids.shape[1] - (C - width)
    logps, entropies = _run_scored_width(
        model,
        input_ids[:, :L],
        attention_mask[:, :L],
        completion_mask[:, :width],
        temperature,
        vocab_size,
        chunk_size,
        keep_bytes,
        entropy_grad,
    )
    if width == C:
        return logps, entropies
    return F.pad(logps, (0, C - width)), F.pad(entropies, (0, C - width))  # [N,C]


def _run_scored_width(
    model,
    input_ids,
    attention_mask,
    completion_mask,
    temperature,
    vocab_size,
    chunk_size,
    keep_bytes,
    entropy_grad,
):
    """token_logprobs on rows already cut to their scored width."""
    C = completion_mask.shape[1]
    checkpointed = model.gradient_checkpointing and torch.is_grad_enabled()
    if checkpointed or not torch.is_grad_enabled():
        keep_bytes = 0  # no backward, or a run that trades compute for memory
    targets = input_ids[:, -C:]  # [N,C]

    def head(h, lm_head):  # h [N,C,D]: h[:, j] predicts completion token j
        return score_chunks(
            h,
            lm_head,
            targets,
            completion_mask,
            temperature=temperature,
            vocab_size=vocab_size,
            chunk_size=chunk_size,
            keep_bytes=keep_bytes,
            entropy_grad=entropy_grad,
            fp32=getattr(model, "cast_lm_head_to_fp32", False),
        )

    if checkpointed:  # the cached path would write its cache twice
        L = input_ids.shape[1]
        return model(
            input_ids,
            attention_mask=attention_mask,
            head=lambda h, out: head(h[:, L - C - 1 : L - 1], out),
        )
    return shared_prompt_forward(model, input_ids, attention_mask, C, head)


def scored_width(completion_mask) -> int:
    """Completion columns up to and including the last one any row scores (at least 1): a
    micro-batch's rows are padded to the round's longest completion, and a causal model's
    outputs before a column never depend on it, so the rest need no forward or backward."""
    C = completion_mask.shape[1]
    if C == 0:
        return 1
    scored = completion_mask.bool().any(0)  # [C]
    # column j's number j + 1 where scored, else 0: the largest is the width
    numbers = torch.arange(1, C + 1, device=completion_mask.device)
    return max(int((scored * numbers).max()), 1)  # one host sync


def score_chunks(
    h,
    lm_head,
    targets,
    completion_mask,
    temperature,
    vocab_size,
    chunk_size,
    keep_bytes,
    entropy_grad=False,
    fp32=False,
):
    """The scored tokens' log-probs and entropies, chunk by chunk.
    h: [N,C,D] hidden states; targets, completion_mask: [N,C]."""
    N, C = completion_mask.shape
    where = completion_mask.bool().nonzero(as_tuple=True)  # the M scored
    h = h[where]  # [M,D]
    targets = targets[where]  # [M]
    weight = lm_head.weight[:vocab_size]  # [V,D]: the real vocabulary
    out_dtype = torch.promote_types(h.dtype, torch.float32)
    keep_rows = keep_bytes // (weight.shape[0] * out_dtype.itemsize)
    # with nothing to score (every row masked, e.g. all truncated) the empty
    # call still ties the zeros to the graph, so backward gives every
    # parameter a zero gradient as the plain version does (AdamW still decays
    # and counts the step) and under FSDP2 makes the same collectives as the
    # other ranks
    logp, entropy = ChunkedLogProbs.apply(
        h, weight, targets, temperature, chunk_size, keep_rows, entropy_grad, fp32
    )
    zeros = torch.zeros(N, C, dtype=out_dtype, device=h.device)
    # scatter back into [N,C]; masked slots stay 0
    return zeros.index_put(where, logp), zeros.index_put(where, entropy)


def shared_prompt_forward(model, input_ids, attention_mask, C, head):
    """model's forward over [N,L] rows, each distinct prompt (the first
    L-C tokens) run once into a KV cache copied to its rows, then only the
    completions run: exact, fewer FLOPs. head(h [N,C,D], lm_head) gets the
    hidden states that predict the C completion tokens. Taken even when no
    prompt repeats, so every call makes two model calls: with FSDP every
    rank must make the same collectives."""
    L = input_ids.shape[1]
    P = L - C
    prompt = torch.cat([input_ids[:, :P], attention_mask[:, :P].long()], dim=1)
    # [U,2P]; row n's prompt is unique[src[n]]
    unique, src = prompt.unique(dim=0, return_inverse=True)
    ids = unique[:, :P]  # [U,P]
    valid = unique[:, P:].bool()  # [U,P]
    cache = model.new_cache(len(unique), L)
    positions = (valid.cumsum(-1) - 1).clamp(min=0)
    # [U,D]: predicts each prompt's first completion token
    last = model(
        ids, attention_mask=valid, positions=positions, cache=cache, head=lambda h, out: h[:, -1]
    )
    positions = valid.sum(-1)[src, None] + torch.arange(C, device=ids.device)
    key_valid = torch.cat([valid[src], attention_mask[:, P:].bool()], dim=1)

    def completion_head(h, lm_head):  # h [N,C,D]
        return head(torch.cat([last[src, None], h[:, :-1]], dim=1), lm_head)

    return model(
        input_ids[:, P:],
        attention_mask=key_valid,
        positions=positions,
        cache=cache.select(src),
        cache_start=P,
        head=completion_head,
    )


# -----------------------------------------------------------------------------
# The update's scoring: rows without advantage skip their backward

# A backward costs ~4 FLOPs per parameter and token; skipping it pays once
# that outweighs the extra forward call's fixed cost (per-op overhead on a
# CPU, kernel launches on a GPU; 1e12 there is an estimate, unmeasured).
# docs/internals.md ("Rows without advantage") explains the thresholds.
SKIP_MIN_FLOPS = {"cpu": 1e9, "cuda": 1e12}


def rows_without_gradient(advantages, beta, model, length, entropy_bonus=False):
    """[n] bool: rows that may be scored without gradient. With beta = 0
    every loss type's per-token loss is the advantage times something, so
    a row whose advantage is exactly 0 adds nothing to the gradient. Only
    when the backward saved is worth the extra forward call; one row
    always keeps its gradient (every parameter gets one; AdamW steps as
    TRL's does). advantages: [n]; length: tokens per row.
    None when the configuration frees no row on any rank: beta != 0 (the
    KL term has a gradient everywhere) or entropy_bonus (so has every
    row's entropy). It depends on no data, so every rank gets None
    together, and policy_logprobs then needs no no_grad call to keep the
    ranks' collectives in step."""
    if beta != 0 or entropy_bonus:
        return None
    free = advantages == 0
    saved = backward_flops(model, int(free.sum()), length)
    if saved < skip_min_flops(advantages.device):
        free[:] = False
    if free.all():
        free[0] = False
    return free


def backward_flops(model, rows: int, length: int) -> int:
    """The FLOPs a backward over `rows` rows of `length` tokens costs."""
    params = sum(p.numel() for p in model.parameters())
    return 4 * params * rows * length


def skip_min_flops(device: torch.device) -> float:
    """The backward FLOPs a skipped backward must save to pay on device."""
    return SKIP_MIN_FLOPS.get(device.type, SKIP_MIN_FLOPS["cuda"])


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
    score=None,
):
    """nanogrpo.logprobs.policy_logprobs' result (same arguments, same
    numbers and, for a loss whose per-token terms are the advantage times
    something, the same parameter gradients): token_logprobs above, with
    the rows rows_without_gradient frees scored under no_grad (no
    backward, no stored activations). Their log-probs and entropies still
    count in the loss and the metrics. The entropy carries a gradient
    only with entropy_bonus. score: token_logprobs' stand-in (None: it;
    fast/packing.py passes its packed one)."""
    n, length = input_ids.shape
    free = None
    # on one rank, a batch whose every row freed would not pay is decided
    # from its shape alone: no read of the advantages (a host sync)
    alone = world_size == 1
    if not alone or backward_flops(model, n, length) >= skip_min_flops(advantages.device):
        free = rows_without_gradient(advantages, beta, model, length, entropy_bonus=entropy_bonus)
    return _split_scoring(
        model,
        input_ids,
        attention_mask,
        completion_mask,
        free,
        world_size,
        temperature=temperature,
        vocab_size=vocab_size,
        entropy_grad=entropy_bonus,
        scorer=score or token_logprobs,
    )


def _split_scoring(
    model,
    input_ids,
    attention_mask,
    completion_mask,
    no_grad_rows,
    world_size=1,
    scorer=token_logprobs,
    **kwargs,
):
    """token_logprobs, with rows no_grad_rows [n] bool scored under
    no_grad. With several ranks the no_grad call always runs (on a
    throwaway row if need be), so every rank makes the same FSDP
    collectives, unless no_grad_rows is None (rows_without_gradient's
    answer when no rank may skip rows): one call with gradient, on every
    rank alike. scorer: token_logprobs or its stand-in, called with kwargs."""

    def score(rows):
        return scorer(model, input_ids[rows], attention_mask[rows], completion_mask[rows], **kwargs)

    free = no_grad_rows
    if free is None or (world_size == 1 and not free.any()):
        return score(slice(None))
    with torch.no_grad():
        rows = free if free.any() else torch.arange(1, device=free.device)
        free_logps, free_entropies = score(rows)
    logps, entropies = score(~free)
    if not free.any():
        return logps, entropies
    # back to the rows' order: the trained rows, then the free ones
    order = torch.cat([(~free).nonzero()[:, 0], free.nonzero()[:, 0]])
    order = order.argsort()
    logps = torch.cat([logps, free_logps])[order]
    entropies = torch.cat([entropies, free_entropies])[order]
    return logps, entropies
