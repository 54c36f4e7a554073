"""padding_free (TRL's name): a micro-batch's sequences scored as one packed row, no padding.

Owns: `pack` (a micro-batch's [n,L] rows -> `PackedRow`: the real tokens of every sequence in one
row [1,T], positions restarting at each sequence, and where each scored token's hidden state
lies), `PackedRow` (its `attend`, which model.Attention calls as it calls a cache's: each
sequence attends to itself only) and the kernels: `token_logprobs` and `policy_logprobs`, of
logprobs.py's signatures and numbers (tests/test_packing.py holds them equal, values and
gradients), which train.py's `kernels` picks with padding_free=true.

Does not know about: sampling, losses, files, or more than one process (every rank packs its own
micro-batch and makes the same model calls, so FSDP2's collectives stay in step).

Why: the update pads every micro-batch to its longest sequence, and GRPO's completions are
long-tailed (a few long, most short), so most of a padded micro-batch can be padding: run forward
and backward, then masked away. A packed row runs only the real tokens up to each row's last
scored one (T of them); attention costs each sequence's own length squared, not L^2 per row.

Choices:
- A row keeps its real tokens (attention_mask 1) before its last scored completion token: the
  hidden states that predict scored tokens, and nothing after them (the completion's padding
  after its end is real to the padded forward's mask, and never read).
- Positions are the padded forward's (the count of real tokens before each), so RoPE, SmolLM3's
  NoPE layers and Gemma 3's local RoPE see what they see there; Gemma 3's sliding layers mask each
  sequence's keys to the last sliding_window (all its tokens are real).
- Attention within each sequence: on CPU (or in float32) a loop over the sequences, model.sdpa
  over each one's slice (exact, causal); on CUDA in bf16/fp16, torch's varlen_attn (torch >= 2.10,
  flash attention over cu_seqlens) when it imports. The mask model.py would build for a packed row
  ([1,1,T,T]) is never built: the row masks itself.
- The LM head is fast/logprobs.py's, in chunks, on the scored tokens only; the update's rows
  without advantage are scored without gradient as fast/logprobs.py's policy_logprobs does.
- Qwen3.5's Gated DeltaNet keeps a recurrent state along the row, which would flow from one
  sequence into the next: refused (`check_model`), as is batch_invariant (run/rules.py).
"""

import torch

from nanogrpo.fast import logprobs as fast_logprobs
from nanogrpo.logprobs import check_shapes
from nanogrpo.model import sdpa

try:  # torch >= 2.10: flash attention over packed sequences (forward and backward), CUDA only
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # older torch: the loop over sequences
    varlen_attn = None


def check_model(config):
    """ValueError where a model cannot run packed (config: its ModelConfig)."""
    if "linear_attention" in (config.layer_types or []):
        raise ValueError(
            f"padding_free=true is not supported for model_type={config.model_type!r} yet: "
            "its Gated DeltaNet layers carry a state along the row; set padding_free=false"
        )


# -----------------------------------------------------------------------------
# The packed row


class PackedRow:
    """n sequences in one row [1,T]: `bounds` [(start, end)] of each on the host, `cu_seqlens`
    [n+1] int32 on the device; `sliding` [layers] and `window`: Gemma 3's sliding layers. Passed
    to the model as its `cache=`: model._trunk then builds no mask, and every layer's attention
    comes here."""

    static = False  # (model.KVCache.static)
    packed = True  # model._trunk: no [T,T] mask; checkpointed blocks as without a cache

    def __init__(self, bounds, cu_seqlens, sliding, window):
        self.bounds = bounds
        self.cu_seqlens = cu_seqlens
        self.max_len = bounds[-1][1] if bounds else 0  # T (model._trunk's check)
        self.longest = max((e - s for s, e in bounds), default=0)
        self.sliding = sliding
        self.window = window

    def attend(self, q, k, v, mask, scale, layer, start):
        """q [1,H,T,D], k, v [1,Hkv,T,D] -> [1,T,H*D]: each sequence's queries over its own keys,
        causal (and windowed in a sliding layer). mask and start are unused (None, 0)."""
        window = self.window if self.sliding[layer] else None
        if varlen_attn is not None and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
            return self.attend_varlen(q, k, v, scale, window)
        parts = []
        for s, e in self.bounds:
            if e > s:
                seq_mask = window_mask(e - s, window, q.device)
                parts.append(sdpa(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], seq_mask, scale))
        return torch.cat(parts, dim=1)

    def attend_varlen(self, q, k, v, scale, window):
        """attend with torch's varlen_attn (CUDA, bf16/fp16); unmeasured here."""
        H, T, D = q.shape[1:]
        # varlen's window (left, 0) sees keys q - left .. q: Gemma's q - k < window
        left = -1 if window is None else window - 1
        y = varlen_attn(
            q[0].transpose(0, 1),  # [T,H,D]
            k[0].transpose(0, 1),
            v[0].transpose(0, 1),
            self.cu_seqlens,
            self.cu_seqlens,
            self.longest,
            self.longest,
            scale=scale,
            window_size=(left, 0),
            enable_gqa=k.shape[1] != H,
        )
        return y.reshape(1, T, H * D)


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
    whose hidden state predicts each scored token)."""
    n, L = input_ids.shape
    C = completion_mask.shape[1]
    scored = completion_mask.bool()
    # each row's end: the slot after the one predicting its last scored token (0: none)
    columns = torch.arange(1, C + 1, device=scored.device)
    last = (scored * columns).amax(1, keepdim=True)  # [n,1]: last scored column + 1
    slots = torch.arange(L, device=scored.device)
    real = attention_mask.bool()
    keep = real & (slots < L - C - 1 + last.clamp(min=1))  # [n,L]; nothing scored: the prompt
    flat = keep.flatten().cumsum(0).view(n, L) - 1  # each kept slot's place in the row
    where = scored.nonzero(as_tuple=True)
    before = where[1] + L - C - 1  # the slot predicting each scored token
    lengths = keep.sum(1)
    if not bool(keep[where[0], before].all()):
        raise ValueError(
            "padding_free: a scored completion token follows a padding slot (attention_mask 0); "
            "only left-padded prompts and right-padded completions pack"
        )
    ends = lengths.cumsum(0)
    cu_seqlens = torch.cat([ends.new_zeros(1), ends]).to(torch.int32)
    edges = cu_seqlens.tolist()  # on the host (with the check above: a call's two syncs)
    bounds = list(zip(edges[:-1], edges[1:]))
    positions = (real.long().cumsum(-1) - 1).clamp(min=0)  # the padded forward's
    row = PackedRow(bounds, cu_seqlens, model.sliding, model.config.sliding_window)
    at = flat[where[0], before]  # [M]
    return input_ids[keep][None], positions[keep][None], row, where, at


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
    check_model(model.config)
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


def packed_kernels(padding_free: bool) -> dict:
    """trainer.Kernels' fields this module fills with padding_free (none without it)."""
    if not padding_free:
        return {}
    return dict(token_logprobs=token_logprobs, policy_logprobs=policy_logprobs, check=check_model)
