"""Qwen3.5's text decoder layers (transformers' Qwen3_5ForCausalLM, model_type "qwen3_5_text").

Owns: `Qwen3_5Block` (a layer of either kind, by `layer_types`: "linear_attention" is a Gated
DeltaNet, models/gated_deltanet.py; "full_attention" is `GatedAttention`), `GatedAttention` (q/k
norms, RoPE on the first head_dim * partial_rotary_factor dims, the output times sigmoid of a gate
the query projection also makes) and `fill_defaults` (Qwen3_5TextConfig's defaults on a
ModelConfig). model.py reaches them through its one seam, `family_parts`; the norms are Gemma 3's
(x / rms(x) * (1 + weight), models/gemma3.py), and so is the default layer pattern's helper.

Does not know about: files (checkpoint/hf_format.py reads config.json, and a qwen3_5 checkpoint's
language model), sampling, losses, or more than one process.

Choices:
- Text positions only: Qwen3.5's multimodal RoPE (mrope_section) gives every section the same
  angle when all positions are a text's, which is plain RoPE; images and video are not supported.
"""

import torch
import torch.nn as nn

from nanogrpo.model import MLP, Attention, apply_rope
from nanogrpo.models.gated_deltanet import GatedDeltaNet, cache_shapes  # noqa: F401 (FAMILIES)
from nanogrpo.models.gemma3 import Gemma3RMSNorm, fill_layer_types


def fill_defaults(cfg):
    """Qwen3_5TextConfig's defaults for what a ModelConfig leaves None: a full-attention layer
    every 4th (the rest linear), 16 key and 32 value heads of 128 dims, a convolution of 4."""
    fill_layer_types(cfg, "linear_attention", every=4)
    defaults = dict(
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
    )
    for name, value in defaults.items():
        if getattr(cfg, name) is None:
            setattr(cfg, name, value)


class GatedAttention(Attention):
    """Qwen3.5's full attention: model.Attention with a query projection twice as wide (per head,
    the query then a gate), (1 + weight) q/k norms, partial RoPE, and the output gated."""

    def __init__(self, cfg):
        super().__init__(cfg)
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, 2 * self.n_heads * self.head_dim, bias=bias)
        self.q_norm = Gemma3RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = Gemma3RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache=None, layer=0, cache_start=0):
        # x: [B,T,C]; cos/sin: [B,1,T,R] for the first R dims of each head
        B, T, _ = x.shape
        q, gate = self.q_proj(x).view(B, T, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q).transpose(1, 2)  # [B,H,T,D]
        k = self.k_norm(self.k_proj(x).view(B, T, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = partial_rope(q, cos, sin), partial_rope(k, cos, sin)
        y = self.attend(q, k, v, mask, cache, layer, cache_start)  # [B,T,H*D]
        return self.o_proj(y * torch.sigmoid(gate.reshape(B, T, -1)))


def partial_rope(x, cos, sin):
    """RoPE on the first cos.shape[-1] dims of x [B,H,T,D]; the rest pass unrotated."""
    r = cos.shape[-1]
    return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)


class Qwen3_5Block(nn.Module):
    """Pre-norm residual block whose mixer is a Gated DeltaNet or a GatedAttention by layer type.
    `mask` is the attention mask for the latter, [B,T] padding for the former."""

    def __init__(self, cfg, layer=0):
        super().__init__()
        self.input_layernorm = Gemma3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.layer_types[layer] == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg)
        self.post_attention_layernorm = Gemma3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, cache=None, layer=0, cache_start=0):
        h = self.input_layernorm(x)
        if hasattr(self, "linear_attn"):
            x = x + self.linear_attn(h, mask, cache, layer)
        else:
            x = x + self.self_attn(h, cos, sin, mask, cache, layer, cache_start)
        return x + self.mlp(self.post_attention_layernorm(x))


# what model.family_parts and model.KVCache read (cache_shapes: the linear layers' states)
Block, RMSNorm, Embedding, window_mask = Qwen3_5Block, Gemma3RMSNorm, nn.Embedding, None
