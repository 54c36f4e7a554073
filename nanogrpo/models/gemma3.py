"""Gemma 3's text decoder layers (transformers' Gemma3ForCausalLM, model_type "gemma3_text").

Owns: `Gemma3RMSNorm` (x / rms(x) * (1 + weight), in float32), `Gemma3Embedding` (the embedding
times sqrt(hidden_size), in the embedding's dtype), `Gemma3Block` (q/k RMSNorms, a norm after the
attention and around the MLP, the `gelu_pytorch_tanh` MLP, the attention scale
1/sqrt(query_pre_attn_scalar)), `sliding_window_mask` (what a sliding layer sees) and
`fill_defaults` (Gemma3TextConfig's defaults on a ModelConfig, the layer pattern by
`fill_layer_types`, which Qwen3.5's uses too). model.py reaches them through its
one seam, `family_parts`; the global and local RoPE tables are model.py's (`rope_inv_freq`).

Does not know about: files (checkpoint/hf_format.py reads config.json's Gemma keys), sampling,
losses, or more than one process.

Choices:
- Sliding windows are a per-layer attention mask over the one KV cache, not a ring buffer: a key is
  visible to a query when fewer than `sliding_window` real tokens separate them (transformers'
  `kv_idx > q_idx - sliding_window`, counted in real tokens), so a left-padded row equals its
  unpadded self and the sampler's cache, compaction and shared-prompt paths are unchanged.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanogrpo.model import MLP, Attention


def fill_defaults(cfg):
    """Gemma3TextConfig's defaults for what a ModelConfig leaves None: a global layer every 6th
    (the rest slide), a 4096-token window, a local RoPE base of 10,000, query_pre_attn_scalar
    256."""
    fill_layer_types(cfg, "sliding_attention", every=6)
    if cfg.sliding_window is None:
        cfg.sliding_window = 4096
    if cfg.rope_local_base_freq is None:
        cfg.rope_local_base_freq = 10000.0
    if cfg.query_pre_attn_scalar is None:
        cfg.query_pre_attn_scalar = 256


def fill_layer_types(cfg, other: str, every: int):
    """cfg.layer_types, when None: "full_attention" every `every`-th layer, `other` the rest (also
    Qwen3.5's default); ValueError when the config's list is shorter than the layers."""
    if cfg.layer_types is None:
        n = cfg.num_hidden_layers
        cfg.layer_types = [other if (i + 1) % every else "full_attention" for i in range(n)]
    if len(cfg.layer_types) < cfg.num_hidden_layers:
        raise ValueError(
            f"config.json: layer_types has {len(cfg.layer_types)} entries for "
            f"{cfg.num_hidden_layers} layers"
        )


class Gemma3RMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), computed in float32 (or wider) and cast back (weight starts at
    zero)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        wide = torch.promote_types(x.dtype, torch.float32)  # (a float64 model stays float64)
        x32 = x.to(wide)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.to(wide))).to(x.dtype)


class Gemma3Embedding(nn.Embedding):
    """The embedding times sqrt(hidden_size); the scale is rounded to the embedding's dtype first,
    as transformers' Gemma3TextScaledWordEmbedding does (sqrt(3072) = 55.43 is 55.5 in bf16)."""

    def forward(self, input_ids):
        x = super().forward(input_ids)
        return x * float(torch.tensor(self.embedding_dim**0.5).to(x.dtype))


class Gemma3MLP(MLP):
    """down(gelu_tanh(gate(x)) * up(x))."""

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Gemma3Block(nn.Module):
    """x + post_attn_norm(attn(input_norm(x))), then x + post_ff_norm(mlp(pre_ff_norm(x)))."""

    def __init__(self, cfg, layer=0):
        super().__init__()
        dim, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = Gemma3RMSNorm(dim, eps)
        self.self_attn = Attention(cfg)
        self.self_attn.q_norm = Gemma3RMSNorm(cfg.head_dim, eps)
        self.self_attn.k_norm = Gemma3RMSNorm(cfg.head_dim, eps)
        self.self_attn.scale = cfg.query_pre_attn_scalar**-0.5
        self.post_attention_layernorm = Gemma3RMSNorm(dim, eps)
        self.pre_feedforward_layernorm = Gemma3RMSNorm(dim, eps)
        self.mlp = Gemma3MLP(cfg)
        self.post_feedforward_layernorm = Gemma3RMSNorm(dim, eps)

    def forward(self, x, cos, sin, mask, cache=None, layer=0, cache_start=0):
        h = self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer, cache_start)
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


def sliding_window_mask(mask, key_valid, T, cache_start, window):
    """`mask` [B,1,T,S] (model.attention_mask_for) narrowed to the keys fewer than `window` real
    tokens behind each query: real tokens are counted in key_valid [B,S] between the key's slot and
    the query's (cache_start + t); a query still sees its own slot."""
    count = key_valid.long().cumsum(-1)  # [B,S]: real tokens up to and including each slot
    q_slot = cache_start + torch.arange(T, device=key_valid.device)  # cache_start: int or tensor
    near = count.index_select(1, q_slot)[:, :, None] - count[:, None, :] < window  # [B,T,S]
    return mask & near[:, None]


# what model.family_parts reads
Block, RMSNorm, Embedding, window_mask = (
    Gemma3Block,
    Gemma3RMSNorm,
    Gemma3Embedding,
    sliding_window_mask,
)
