"""Batch-invariant forms of the operations whose rounding depends on the batch: with them the
sampler's log-prob of every drawn token equals, bit for bit, the trainer's recomputation of it
(TrainConfig.batch_invariant; docs/batch_invariance.md).

Why the two differ without them: the sampler computes a token from a decode step of a few rows
against a KV cache, the trainer from one forward of whole padded sequences. A matmul kernel picks
its path by the number of rows (on CPU, fewer than 8 to 12 rows take another kernel whose rows
round differently), a pointwise loop rounds the elements of its scalar tail differently, and
attention reduces over the t+1 cached keys in the decode step but over every padded key in the
trainer's forward, in another order; under autocast the KV cache rounds a key to bf16 where the
trainer's SDPA casts it. All of it is only rounding, but it makes the "same" policy give two
log-probs: sampling is off-policy by accident.

Owns:
- `linear`: F.linear with the rows padded to a multiple of ROWS, so every row lies in a full block
  of the kernel whatever the batch (a row's bits then never depend on its batch mates), and at
  least MIN_OUT outputs (a kernel for fewer rounds a row by the batch's size).
- `attention`: SDPA in float32, the keys in fixed chunks of CHUNK slots counted from slot 0; each
  chunk is one product of the same shape, and the chunks' partial sums are added left to right.
  Masked keys add exact zeros, so a decode step's t+1 keys and the trainer's padded sequence give
  a query the same sums, in the same order.
- `pointwise`: sigmoid, softplus, silu and exp computed in float64 and rounded back, so an
  element's bits do not depend on whether it falls in the vectorized loop or its scalar tail (on
  AVX2 the two round fp32 sigmoid, softplus and silu differently); `reduce_sum`: a sum over one
  dim taken over a contiguous copy with that dim last (a strided dim is summed in another order).
- Qwen3.5's linear attention: its recurrence at every length (`gated_deltanet.always_recurrent`),
  so prefill, decode and the trainer's forward carry each token's state alike; the chunked scan,
  the default's prefill and training form, sums in another order by construction.
- `BatchInvariant`: a torch function mode that routes these calls made inside it (the model's,
  LoRA's) to these forms, entered wherever the run's model computes (its autocast).
- `sample_next_token`: the course's draw, reporting the log-prob as the trainer computes it
  (log_softmax of the tempered logits), and `InvariantDecoder`: the eager decode step with the LM
  head as one product (no vocabulary slices).

Each is held equal to the plain operation within rounding, and the sampler equal to the trainer
bit for bit, by tests/test_batch_invariant.py. The layout is shared: the trainer scores each row
with the prompt left-padded as the sampler padded it (rollout.join_prompt_completion), so a token
sits at the same slot in both.

Does not know about: losses, rewards, optimizers, files, or processes (under FSDP2 the gathered
weights reach F.linear as any weight does).

Left out: the fast/ kernels (shared prompt forwards, the compiled decode step), and GPUs, whose
kernels split the reduction itself (split-K) by batch size: there this mode is unmeasured.
"""

import math
from contextlib import ExitStack

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from nanogrpo import sampler
from nanogrpo.models import gated_deltanet

ROWS = 16  # a multiple of every CPU kernel's row block seen (4 on AMD EPYC, 8 on Intel)
# fewer outputs than this take another bf16 kernel on an AMD EPYC with AVX512-BF16, whose rows
# round differently from about 128 rows on (N = 2, 4, 8 seen; 1, 12, 16 and more never)
MIN_OUT = 16
CHUNK = 64  # keys per attention chunk


def has_amx() -> bool:
    """Whether this CPU has AMX's bf16 tiles (Intel Xeon since Sapphire Rapids): there oneDNN's
    bf16 products round a row by the number of rows whatever the padding (real SmolLM2 under
    bf16 autocast: log-probs 0.25 apart), and under bf16 autocast torch's own kernels are used
    instead (not oneDNN; in float32, which its AMX tiles do not compute, oneDNN stays on)."""
    try:
        with open("/proc/cpuinfo") as f:
            return " amx_bf16" in f.read()
    except OSError:
        return False


AMX = has_amx()


def pad_to(x, dim, multiple, value=0):
    """x padded at the end of `dim` to a multiple of `multiple` (x itself when it is one)."""
    extra = -x.shape[dim] % multiple
    if extra == 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, extra]
    return F.pad(x, pad, value=value)


def linear(x, weight, bias=None):
    """F.linear(x [...,K], weight [N,K], bias) -> [...,N], its rows padded to a multiple of ROWS
    and, below MIN_OUT outputs (LoRA's A at rank 2 to 8), its weight to MIN_OUT zero rows."""
    rows = x.reshape(-1, x.shape[-1])  # [M,K]
    N = weight.shape[0]
    if N < MIN_OUT:
        weight = pad_to(weight, 0, MIN_OUT)  # [MIN_OUT,K]
        bias = None if bias is None else pad_to(bias, 0, MIN_OUT)
    y = F.linear(pad_to(rows, 0, ROWS), weight, bias)  # [M',N']
    return y[: rows.shape[0], :N].reshape(*x.shape[:-1], N)


def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
    """SDPA (q [B,H,T,D], k, v [B,H,S,D], mask [B|1,H|1,T,S] bool or additive 0/-inf) -> [B,H,T,D]
    in q's dtype, computed in float32 with the keys in fixed chunks (see the module's docstring)."""
    if dropout_p or kwargs.get("enable_gqa"):
        raise ValueError("batch-invariant attention: no dropout, no enable_gqa")
    if torch.is_autocast_enabled(q.device.type):  # SDPA's inputs under autocast, as it casts them
        low = torch.get_autocast_dtype(q.device.type)  # (a cached key is already in it)
        q, k, v = q.to(low), k.to(low), v.to(low)
    B, H, T, D = q.shape
    S, dtype = k.shape[2], q.dtype
    scale = 1 / math.sqrt(D) if scale is None else scale
    if is_causal:
        attn_mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril()
    if attn_mask is None:
        keep = torch.ones(B, H, T, S, dtype=torch.bool, device=q.device)
    elif attn_mask.dtype == torch.bool:
        keep = attn_mask.expand(B, H, T, S)
    else:  # additive: 0 seen, -inf not
        keep = (attn_mask > -math.inf).expand(B, H, T, S)
    with torch.autocast(q.device.type, enabled=False):
        q = pad_to(q.float(), 2, ROWS)  # [B,H,T',D]
        k, v = pad_to(k.float(), 2, CHUNK), pad_to(v.float(), 2, CHUNK)  # [B,H,S',D]
        # padded keys are never seen; padded queries see every key (finite, then dropped)
        keep = pad_to(pad_to(keep, 3, CHUNK, value=False), 2, ROWS, value=True)  # [B,H,T',S']
        n = k.shape[2] // CHUNK
        scores = (q @ k.transpose(2, 3)) * scale  # [B,H,T',S']
        scores = scores.masked_fill(~keep, -math.inf)
        p = torch.exp(scores - scores.amax(-1, keepdim=True))  # masked keys: exactly 0
        p = p.view(B, H, -1, n, CHUNK)  # [B,H,T',n,CHUNK]
        sums = p.sum(-1)  # [B,H,T',n]: each chunk's share of the denominator
        parts = p.transpose(2, 3) @ v.view(B, H, n, CHUNK, D)  # [B,H,n,T',D]
        den, out = sums[..., 0], parts[:, :, 0]
        for j in range(1, n):  # left to right: trailing masked chunks add exact zeros
            den, out = den + sums[..., j], out + parts[:, :, j]
        out = out / den[..., None]
    return out[:, :, :T].to(dtype)


# pointwise functions whose vectorized and scalar (loop tail) code round differently
TRANSCENDENTAL = {
    F.silu,
    F.softplus,
    torch.sigmoid,
    torch.Tensor.sigmoid,
    torch.exp,
    torch.Tensor.exp,
}


def pointwise(func, x, *args, **kwargs):
    """func(x) computed in float64 and rounded to x's dtype. An element's bits then do not depend
    on where it falls in the kernel's loop: the vectorized and the scalar float64 code differ by an
    ulp of float64, which the rounding to float32 or bf16 removes (but for a value within that ulp
    of a rounding boundary: a chance of about 2^-28 each)."""
    if not x.is_floating_point() or x.dtype == torch.float64 or "out" in kwargs:
        return func(x, *args, **kwargs)
    out = func(x.double(), *args, **kwargs).to(x.dtype)
    return x.copy_(out) if kwargs.get("inplace") else out


def reduce_sum(x, dim, keepdim=False, **kwargs):
    """x.sum(dim) with `dim` moved last and made contiguous: each row of that one layout is summed
    by the same code whatever the other dims (a strided dim is summed in another order)."""
    out = x.movedim(dim, -1).contiguous().sum(-1, **kwargs)
    return out.unsqueeze(dim % x.dim()) if keepdim else out


class BatchInvariant(TorchFunctionMode):
    """Inside it, F.linear is `linear`, SDPA is `attention`, the transcendental pointwise functions
    are `pointwise`, a sum over one dim is `reduce_sum`, and Qwen3.5's linear attention runs its
    recurrence at every length. `within` (the run's autocast) is entered with it; the mode can be
    entered again and again, as an autocast can."""

    def __init__(self, within=None):
        super().__init__()
        self.within = within
        self.stacks = []

    def __enter__(self):
        stack = ExitStack()
        if self.within is not None:
            stack.enter_context(self.within)
        recurrent = gated_deltanet.always_recurrent
        stack.callback(setattr, gated_deltanet, "always_recurrent", recurrent)
        gated_deltanet.always_recurrent = True
        if AMX and torch.is_autocast_enabled("cpu"):  # oneDNN's AMX bf16 kernels round a row by
            stack.enter_context(torch.backends.mkldnn.flags(enabled=False))  # the batch's size
        self.stacks.append(stack)
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        return self.stacks.pop().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return linear(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            return attention(*args, **kwargs)
        if func in TRANSCENDENTAL:
            return pointwise(func, *args, **kwargs)
        if func in (torch.sum, torch.Tensor.sum) and self.one_dim(args, kwargs):
            return reduce_sum(*args, **kwargs)
        return func(*args, **kwargs)

    @staticmethod
    def one_dim(args, kwargs) -> bool:
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        return isinstance(dim, int) and "dtype" not in kwargs and args[0].is_floating_point()


def sample_next_token(logits, u, temperature, top_k, top_p, min_p):
    """sampler.sample_next_token's draw, and the drawn token's log-prob as the trainer computes it:
    log_softmax of the logits divided by the temperature. Greedy, or with a filter on, the
    sampler's own (the filtered distribution is not the trainer's: no bit equality to keep)."""
    ids, logp = sampler.sample_next_token(logits, u, temperature, top_k, top_p, min_p)
    if temperature == 0 or top_k or top_p < 1 or min_p:
        return ids, logp
    tempered = logits / temperature  # [B,V]
    return ids, tempered.log_softmax(-1).gather(-1, ids[:, None]).squeeze(-1)


class InvariantDecoder(sampler.Decoder):
    """The eager decode step, with the LM head as one `linear` (the trainer's), not in slices
    (`chunk`, Decoder's slice size, is taken and unused)."""

    def __init__(self, model, vocab_size, chunk):
        super().__init__(model, vocab_size, vocab_size)


def kernels() -> dict:
    """trainer.Kernels' fields for the mode: the course's scoring, this draw and decode step."""
    return dict(sample_token=sample_next_token, decoder=InvariantDecoder, within=BatchInvariant)
