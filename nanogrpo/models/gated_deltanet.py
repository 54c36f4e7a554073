"""Gated DeltaNet: the linear-attention layer of Qwen3.5 (transformers' Qwen3_5GatedDeltaNet).

Owns: `GatedDeltaNet` (the layer: projections, causal depthwise convolution, the gated delta rule,
the gated RMSNorm), the rule itself twice — `recurrent_delta_rule` (one token at a time: what it
means, and the decode step) and `chunked_delta_rule` (the same numbers from a few matmuls per chunk
of tokens: prefill and training) — and `cache_shapes` (the state a layer keeps in the KV cache).

Does not know about: files (checkpoint/hf_format.py reads config.json's linear_* keys), sampling,
losses, or more than one process.

The rule. Each value head keeps a memory S, a [Dk, Dv] matrix that maps keys to values. At token t,
with a key k_t (unit length), a value v_t, a query q_t, a decay g_t <= 0 and a write strength
beta_t in (0, 1):
    S <- exp(g_t) * S                      forget a little of everything
    S <- S + beta_t * k_t (v_t - S^T k_t)^T  write the error of what S recalls for k_t
    o_t = S^T q_t                          read with the query
Attention's cost grows with the context; this layer's state stays [Dk, Dv] however long the
sequence, so the KV cache holds one state per layer (and the convolution's last K-1 inputs).

Choices:
- Padding: a padded position's input is zeroed (as transformers does), so its key and value are
  zero and it writes nothing; a left-padded row equals its unpadded self. The decay still applies,
  to a state that is zero before the first real token.
- The rule runs in float32 (float64 stays float64) whatever the model's dtype, as transformers does;
  the recurrent state in the cache is float32 too.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

CHUNK = 64  # tokens per chunk of chunked_delta_rule (transformers' chunk_size)
# True: every length runs the recurrence, as the decode step does (fast/batch_invariant.py's mode
# sets it, so that prefill, decode and the trainer's forward sum each token's state alike)
always_recurrent = False


def cache_shapes(cfg, batch_size, kv_shape):
    """Per layer, the shapes of what the KV cache holds as (k, v): a full-attention layer's keys
    and values (kv_shape), a linear-attention layer's convolution inputs [B, conv_dim, K-1] and
    recurrent state [B, Hv, Dk, Dv]."""
    conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
    conv_dim += cfg.linear_num_value_heads * cfg.linear_value_head_dim
    conv = (batch_size, conv_dim, cfg.linear_conv_kernel_dim - 1)
    state = (
        batch_size,
        cfg.linear_num_value_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
    )
    return [
        (conv, state) if t == "linear_attention" else (kv_shape, kv_shape)
        for t in cfg.layer_types[: cfg.num_hidden_layers]
    ]


# -----------------------------------------------------------------------------
# The gated delta rule, twice


def recurrent_delta_rule(q, k, v, g, beta, state):
    """The rule one token at a time. q, k [B,T,H,Dk] (k unit length, q scaled), v [B,T,H,Dv],
    g, beta [B,T,H]; state [B,H,Dk,Dv] at the start. -> (out [B,T,H,Dv], state at the end)."""
    outs = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None, None]  # forget
        recalled = (state * k[:, t, ..., None]).sum(-2)  # S^T k: [B,H,Dv]
        error = (v[:, t] - recalled) * beta[:, t, ..., None]  # [B,H,Dv]
        state = state + k[:, t, ..., None] * error[..., None, :]  # write: S += k error^T
        outs.append((state * q[:, t, ..., None]).sum(-2))  # read: S^T q
    return torch.stack(outs, dim=1), state


def chunked_delta_rule(q, k, v, g, beta, state, chunk=CHUNK):
    """recurrent_delta_rule's numbers, a chunk of tokens at a time. Arguments and result as there.

    Within a chunk whose first state is S0, let G_i be the summed decay of its tokens up to i. The
    corrections W (row j: what token j writes, beta_j (v_j - exp(g_j) S_{j-1}^T k_j)) solve a
    unit lower-triangular system
        (I + A) W = beta V - (beta exp(G) K) S0,   A[j,l] = beta_j exp(G_j - G_l) k_j.k_l  (l < j)
    and then, with D[i,j] = exp(G_i - G_j) for j <= i (0 above the diagonal),
        out = (exp(G) Q) S0 + ((Q K^T) * D) W,     S_end = exp(G_last) S0 + (exp(G_last - G) K)^T W.
    One loop step per chunk carries the state; everything else is batched matmuls."""
    B, T, H, Dv = v.shape
    pad = -T % chunk
    n = (T + pad) // chunk

    def chunks(x):  # [B,T,H,...] -> [B,H,n,chunk,...], zero-padded at the end
        x = x.transpose(1, 2)
        x = F.pad(x, (0, 0, 0, pad)) if x.dim() == 4 else F.pad(x, (0, pad))
        return x.reshape(B, H, n, chunk, *x.shape[3:])

    q, k, v, g, beta = map(chunks, (q, k, v, g, beta))
    G = g.cumsum(-1)  # [B,H,n,chunk]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, -torch.inf).exp()  # D
    k_beta = k * beta[..., None]
    A = (k_beta @ k.transpose(-1, -2) * decay).tril(-1)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    solve = torch.linalg.solve_triangular  # (I + A)^-1 rhs, by substitution
    u = solve(eye + A, v * beta[..., None], upper=False, unitriangular=True)  # W at S0 = 0
    # W = u - ku S0
    ku = solve(eye + A, k_beta * G.exp()[..., None], upper=False, unitriangular=True)
    qk = q @ k.transpose(-1, -2) * decay  # [B,H,n,chunk,chunk]
    q_decayed = q * G.exp()[..., None]
    k_to_end = k * (G[..., -1:] - G).exp()[..., None]
    out = torch.empty_like(v)
    for c in range(n):
        w = u[:, :, c] - ku[:, :, c] @ state  # [B,H,chunk,Dv]
        out[:, :, c] = q_decayed[:, :, c] @ state + qk[:, :, c] @ w
        state = state * G[:, :, c, -1, None, None].exp() + k_to_end[:, :, c].transpose(-1, -2) @ w
    out = out.reshape(B, H, n * chunk, Dv)[:, :, :T].transpose(1, 2)
    return out, state


# -----------------------------------------------------------------------------
# The layer


class GatedRMSNorm(nn.Module):
    """weight * x / rms(x) (x in float32), times silu(gate): the output norm of each value head."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x, gate):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32.to(x.dtype) * F.silu(gate.float())).to(x.dtype)


def l2_normalize(x, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear attention: x [B,T,C] -> [B,T,C]; tensor names as transformers'."""

    def __init__(self, cfg):
        super().__init__()
        C = cfg.hidden_size
        self.n_k, self.n_v = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.d_k, self.d_v = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        if self.n_v % self.n_k:
            raise ValueError(
                f"config.json: linear_num_value_heads={self.n_v} must be a multiple of "
                f"linear_num_key_heads={self.n_k}"
            )
        key_dim, value_dim = self.n_k * self.d_k, self.n_v * self.d_v
        self.conv_dim = 2 * key_dim + value_dim
        self.in_proj_qkv = nn.Linear(C, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(C, value_dim, bias=False)  # the output gate
        self.in_proj_b = nn.Linear(C, self.n_v, bias=False)  # the write strength, beta
        self.in_proj_a = nn.Linear(C, self.n_v, bias=False)  # the decay's input
        K = cfg.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, K, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.n_v))
        self.A_log = nn.Parameter(torch.empty(self.n_v).uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(self.d_v, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(value_dim, C, bias=False)

    def forward(self, x, valid=None, cache=None, layer=0):
        # x [B,T,C]; valid [B,T] (False on padding) or None. With a cache, start from layer's
        # state there and leave the new one (in place in a static cache: a compiled step's
        # buffers keep their addresses).
        if getattr(cache, "packed", False):  # fast/packing.py's row: each sequence from state 0
            return cache.each_sequence(self, x)
        B, T, _ = x.shape
        if valid is not None:
            x = x * valid[..., None].to(x.dtype)
        qkv = self.in_proj_qkv(x).transpose(1, 2)  # [B,conv_dim,T]
        K = self.conv1d.weight.shape[-1]
        if cache is None:
            seen = qkv.new_zeros(B, self.conv_dim, K - 1)
            state = x.new_zeros(B, self.n_v, self.d_k, self.d_v, dtype=torch.float32)
        else:
            seen, state = cache.k[layer], cache.v[layer]
        window = torch.cat([seen.to(qkv.dtype), qkv], dim=-1)  # [B,conv_dim,K-1+T]
        w = self.conv1d.weight
        qkv = F.silu(F.conv1d(window.to(w.dtype), w, groups=self.conv_dim)).to(x.dtype)
        q, k, v = qkv.transpose(1, 2).split([self.n_k * self.d_k] * 2 + [self.n_v * self.d_v], -1)
        wide = torch.promote_types(x.dtype, torch.float32)
        q = q.reshape(B, T, self.n_k, self.d_k).to(wide)
        k = k.reshape(B, T, self.n_k, self.d_k).to(wide)
        v = v.reshape(B, T, self.n_v, self.d_v).to(wide)
        q = l2_normalize(q) * self.d_k**-0.5
        k = l2_normalize(k)
        if self.n_v != self.n_k:  # each key head serves n_v / n_k consecutive value heads
            q = q.repeat_interleave(self.n_v // self.n_k, dim=2)
            k = k.repeat_interleave(self.n_v // self.n_k, dim=2)
        beta = self.in_proj_b(x).sigmoid().to(wide)  # [B,T,Hv]
        g = -self.A_log.to(wide).exp() * F.softplus(self.in_proj_a(x).to(wide) + self.dt_bias)
        rule = recurrent_delta_rule if T == 1 or always_recurrent else chunked_delta_rule
        out, state = rule(q, k, v, g, beta, state.to(wide))
        if cache is not None:
            seen = window[:, :, window.shape[-1] - (K - 1) :]
            if cache.static:
                cache.k[layer].copy_(seen)
                cache.v[layer].copy_(state)
            else:  # (not in place: the old state may be saved for backward)
                cache.k[layer], cache.v[layer] = seen.to(cache.k[layer].dtype), state
        z = self.in_proj_z(x).reshape(B, T, self.n_v, self.d_v)
        out = self.norm(out.to(x.dtype), z)  # [B,T,Hv,Dv]
        return self.out_proj(out.reshape(B, T, -1))
