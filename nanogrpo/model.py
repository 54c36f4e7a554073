"""The decoder transformer and its KV cache: the network and nothing else.

Owns: `ModelConfig` (architecture hyper-parameters, named as in HF's config.json), the `Transformer`
(Llama 3.x, Mistral, Qwen2/2.5, Qwen3, SmolLM3, Gemma 3 and Qwen3.5: RMSNorm, RoPE (off in SmolLM3's
NoPE layers, a local base in Gemma 3's sliding ones), grouped-query attention through SDPA, SwiGLU
MLP) and its `KVCache`. With `num_labels`, the same decoder is a *ForSequenceClassification
model: a `score` head replaces the LM head.

Leaves out: Hugging Face checkpoints (checkpoint/: config.json, safetensors, tensor names), the
families' own layers (models/gemma3.py; models/qwen3_5.py and its linear attention,
models/gated_deltanet.py: registered in `FAMILIES` by nanogrpo/models/, which the checkpoint
loader imports), LoRA (extras/lora.py), FSDP2 (distributed/), and the LM head in chunks
(fast/logprobs.py, via `head`).

Does not know about: files, tokenization, sampling, losses, or more than one process (FSDP2
wraps its blocks from outside; `hidden_states` only leaves them a place to gather and reshard).

Choices:
- Parameter names mirror HF's (`layers.0.self_attn.q_proj.weight`, ...) so a checkpoint's names are
  ours with a `model.` prefix, and what we save is what transformers and vLLM expect.
- One attention path: without a cache (training) `sdpa` over the T tokens; with one, the cache's
  `attend`, which writes the new keys its way and attends its way (`KVCache`: a slice write, then
  `sdpa` over the filled slots; fast/ has a static-shape cache and a shared-prefix one). Positions
  (for RoPE) are explicit per row, and keys are masked with an explicit boolean mask
  `key_valid & causal`, so left-padded prompts of different lengths batch together and a query
  shorter than the keys (decode against a cache) is aligned correctly. SDPA's `is_causal` aligns the
  causal triangle upper-left, which is wrong as soon as q_len != k_len; we use it only for the
  plain unpadded, uncached forward where the two agree.
- Every query may always attend to its own slot, so a fully padded row never divides by zero (NaN).
"""

import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

SUPPORTED_MODEL_TYPES = tuple("llama mistral qwen2 qwen3 smollm3 gemma3_text qwen3_5_text".split())
# model_type -> the module of a family whose layers differ from Block's: its Block, RMSNorm,
# Embedding, window_mask, fill_defaults and optional cache_shapes. nanogrpo/models/ fills it
# (gemma3_text, qwen3_5_text) when imported, as the checkpoint loader does.
FAMILIES = {}
ROPE_TYPES = ("default", "linear", "llama3")

# -----------------------------------------------------------------------------
# Config


@dataclass
class ModelConfig:
    """Architecture hyper-parameters, named as in HF's config.json."""

    model_type: str = "qwen2"
    vocab_size: int = 32000
    hidden_size: int = 512
    intermediate_size: int = 2048
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int | None = None  # None -> num_attention_heads (plain multi-head)
    head_dim: int | None = None  # None -> hidden_size // num_attention_heads
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3" | "linear", "factor": ..., ...}
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (Qwen2 always has it)
    mlp_bias: bool = False
    # SmolLM3: no_rope_layers[i] == 1 when layer i uses RoPE, 0 for a NoPE layer (None: all RoPE)
    no_rope_layers: list | None = None
    # Gemma 3: "sliding_attention" | "full_attention" per layer, the window (in real tokens), the
    # sliding layers' RoPE base, and the attention scale 1/sqrt(query_pre_attn_scalar)
    layer_types: list | None = None
    sliding_window: int | None = None
    rope_local_base_freq: float | None = None
    query_pre_attn_scalar: float | None = None
    # Qwen3.5: RoPE on the first head_dim * partial_rotary_factor dims; its "linear_attention"
    # layers (models/gated_deltanet.py): key/value heads and their dims, the convolution's width
    partial_rotary_factor: float = 1.0
    linear_num_key_heads: int | None = None
    linear_num_value_heads: int | None = None
    linear_key_head_dim: int | None = None
    linear_value_head_dim: int | None = None
    linear_conv_kernel_dim: int | None = None
    initializer_range: float = 0.02
    # a sequence classifier (reward model): a `score` head of num_labels, no lm_head
    num_labels: int | None = None
    # other config.json keys, written back as-is
    extra: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"config.json: model_type={self.model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.model_type == "qwen2":
            self.attention_bias = True
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.model_type in ("gemma3_text", "qwen3_5_text") and self.model_type not in FAMILIES:
            raise ValueError(
                f"model_type={self.model_type!r}: its layers are in nanogrpo/models/, not imported "
                "yet; `import nanogrpo.models` (nanogrpo.checkpoint does)"
            )
        if self.model_type in FAMILIES:
            FAMILIES[self.model_type].fill_defaults(self)
        if self.no_rope_layers is not None and len(self.no_rope_layers) < self.num_hidden_layers:
            raise ValueError(
                f"config.json: no_rope_layers has {len(self.no_rope_layers)} entries for "
                f"{self.num_hidden_layers} layers"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"config.json: rope_scaling.rope_type={rope_type!r} is not supported; "
                f"supported: {', '.join(ROPE_TYPES)}"
            )

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalizes each query/key head with an RMSNorm before RoPE."""
        return self.model_type == "qwen3"


# -----------------------------------------------------------------------------
# Building blocks


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back (as HF does)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] of RoPE, with `linear` or `llama3` scaling applied (local:
    Gemma 3's sliding layers, base rope_local_base_freq and no scaling)."""
    d = int(cfg.head_dim * cfg.partial_rotary_factor)  # the rotated dims
    theta = cfg.rope_local_base_freq if local else cfg.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d))
    if cfg.rope_scaling and not local:  # long-context scaling (Llama 3.1's llama3, linear)
        inv_freq = scale_inv_freq(inv_freq, cfg.rope_scaling)
    return inv_freq


def scale_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """inv_freq [D/2] for contexts longer than the model was trained on: `linear` divides every
    frequency by `factor`; Llama 3.1's `llama3` keeps the high ones, divides the low ones and
    blends in between (config.json's rope_scaling names)."""
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind != "llama3":
        return inv_freq
    factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(inv_freq, positions, dtype):
    """positions [B,T] -> cos, sin [B,1,T,head_dim] (angles in fp32, then cast)."""
    angles = positions[..., None].float() * inv_freq.float()  # [B,T,D/2]
    angles = torch.cat([angles, angles], dim=-1)[:, None]  # [B,1,T,D]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x, cos, sin):
    """Rotate pairs (i, i + D/2) of x [B,H,T,D] by the position angles (HF's rotate_half layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def sdpa(q, k, v, mask, scale=None):
    """Grouped-query attention: q [B,H,T,D] over keys k, v [B,Hkv,S,D] -> [B,T,H*D]. mask
    [B,1,T,S] (bool or additive), or None: causal over T == S tokens."""
    B, H, T, D = q.shape
    n_kv = k.shape[1]
    if T == 1 and mask is not None and n_kv != H:
        # one-token decode step: fold each kv head's query heads into the query axis
        # ([B,H,1,D] -> [B,Hkv,H/Hkv,D]) instead of copying the whole cache H/Hkv times
        q = q.reshape(B, n_kv, -1, D)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        return y.reshape(B, T, -1)
    if n_kv != H:  # grouped-query: each kv head serves H/Hkv query heads
        k = k.repeat_interleave(H // n_kv, dim=1)
        v = v.repeat_interleave(H // n_kv, dim=1)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)
    return y.transpose(1, 2).reshape(B, T, -1)


class KVCache:
    """Preallocated key/value buffers for every layer: k[layer], v[layer] are [B, H_kv, max_len,
    head_dim] (a Qwen3.5 linear-attention layer's are its state instead, whole rather than per
    slot: models/gated_deltanet.py's cache_shapes).

    `attend` writes a layer's keys in place at their slots (a linear-attention layer writes its
    state itself); never reallocated while decoding. `select(rows)` builds a cache of only (or
    repeated) rows: the sampler copies a prompt's prefill into G samples, drops finished rows.
    """

    static = False  # fast/sampling.py's StaticCache: a tensor start, attends over all max_len slots

    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int, dtype, device):
        kv = (batch_size, cfg.num_key_value_heads, max_len, cfg.head_dim)
        shapes = [(kv, kv)] * cfg.num_hidden_layers
        self.linear = [False] * cfg.num_hidden_layers
        family = FAMILIES.get(cfg.model_type)
        if hasattr(family, "cache_shapes"):  # Qwen3.5: linear-attention layers keep a state
            shapes = family.cache_shapes(cfg, batch_size, kv)
            self.linear = [t == "linear_attention" for t in cfg.layer_types]
        if dtype == torch.float32 and torch.is_autocast_enabled(device.type):  # keys in bf16
            dtype = torch.get_autocast_dtype(device.type)
        self.k = [torch.zeros(k, dtype=dtype, device=device) for k, _ in shapes]
        wide = torch.promote_types(dtype, torch.float32)  # a recurrent state stays float32
        self.v = [
            torch.zeros(v, dtype=wide if lin else dtype, device=device)
            for (_, v), lin in zip(shapes, self.linear)
        ]
        self.max_len = max_len

    def select(self, rows: torch.Tensor) -> "KVCache":
        """A new cache whose row i is this cache's row rows[i] (rows may repeat)."""
        new = object.__new__(type(self))
        new.k = [k.index_select(0, rows) for k in self.k]
        new.v = [v.index_select(0, rows) for v in self.v]
        new.max_len, new.linear = self.max_len, self.linear
        return new

    def attend(self, q, k, v, mask, scale, layer, start):
        """Write layer's new keys k, v [B,Hkv,T,D] at slots start..start+T-1, then q [B,H,T,D]
        attends over every filled slot under mask [B,1,T,start+T] -> [B,T,H*D]."""
        end = start + k.shape[2]
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return sdpa(q, self.k[layer][:, :, :end], self.v[layer][:, :, :end], mask, scale)


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE (and Qwen3's per-head q/k RMSNorm)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.scale = None  # SDPA's default 1/sqrt(head_dim) (Gemma 3 sets its own)

    def forward(self, x, cos, sin, mask, cache=None, layer=0, cache_start=0):
        # x: [B,T,C]; cos/sin: [B,1,T,D]; mask: [B,1,T,S] bool or additive, None: plain causal
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # [B,H,T,D]
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)  # [B,Hkv,T,D]
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        if cos is not None:  # None: a NoPE layer (SmolLM3)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.o_proj(self.attend(q, k, v, mask, cache, layer, cache_start))

    def attend(self, q, k, v, mask, cache, layer, cache_start):
        """q [B,H,T,D], k, v [B,Hkv,T,D] -> [B,T,H*D]: attention over these T tokens, or the
        cache's own (it writes the new keys at slots cache_start.. and attends over its slots)."""
        if cache is None:
            return sdpa(q, k, v, mask, self.scale)
        return cache.attend(q, k, v, mask, self.scale, layer, cache_start)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, cache=None, layer=0, cache_start=0):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer, cache_start)
        return x + self.mlp(self.post_attention_layernorm(x))


# -----------------------------------------------------------------------------
# The model


def family_parts(cfg: ModelConfig):
    """The seam for families whose layers differ: (block class, called as block(cfg, layer index),
    norm class, embedding class, sliding-window mask or None), from the family's module."""
    family = FAMILIES.get(cfg.model_type)
    if family is None:
        return Block, RMSNorm, nn.Embedding, None
    return family.Block, family.RMSNorm, family.Embedding, family.window_mask


def attention_mask_for(key_valid, T, cache_start):
    """Boolean mask [B,1,T,S]: query t (at slot cache_start+t) sees key slot s if s <= its slot and
    the key is valid; a query always sees its own slot (keeps fully padded rows finite)."""
    S = key_valid.shape[1]
    # [T,1]; cache_start: int or tensor
    q_slot = (cache_start + torch.arange(T, device=key_valid.device))[:, None]
    k_slot = torch.arange(S, device=key_valid.device)[None, :]  # [1,S]
    causal = k_slot <= q_slot  # [T,S]
    mask = (key_valid.bool()[:, None, :] & causal) | (k_slot == q_slot)  # [B,T,S]
    return mask[:, None]


def additive_mask(mask, dtype):
    """A bool mask as SDPA's additive form: 0 where a key is seen, -inf where it is not."""
    return torch.where(mask, 0.0, -math.inf).to(dtype)


def lm_head_linear(h, weight, fp32=False):
    """h [...,D] @ weight [V,D].T -> logits [...,V]. fp32 (TRL's cast_lm_head_to_fp32, the ScaleRL
    recipe): in float32 whatever the autocast or the weights' dtype, so bf16 rounding does not
    reach the log-probs."""
    if not fp32:
        return F.linear(h, weight)
    with torch.autocast(device_type=h.device.type, enabled=False):
        return F.linear(h.float(), weight.float())


class Transformer(nn.Module):
    """Decoder-only language model. `model(input_ids)` -> logits [B,T,V]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.generation_config: dict | None = None  # generation_config.json, when loaded from one
        block, norm, embedding, self.window_mask = family_parts(cfg)
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.num_labels is None:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # per-token label scores [B,T,num_labels]; reward_model.pooled_scores reads the one
        # transformers pools
        else:
            self.score = nn.Linear(cfg.hidden_size, cfg.num_labels, bias=False)
        self.tie_weights()
        # fp32, kept out of state_dict and of .to(dtype); follows the input's device
        self.inv_freq = rope_inv_freq(cfg)
        n = cfg.num_hidden_layers
        self.rope_layers = [bool(r) for r in cfg.no_rope_layers or [1] * n]
        self.sliding = [t == "sliding_attention" for t in (cfg.layer_types or [""] * n)[:n]]
        # Qwen3.5's linear-attention layers take the [B,T] padding mask of their own tokens
        self.linear = [t == "linear_attention" for t in (cfg.layer_types or [""] * n)[:n]]
        self.local_inv_freq = rope_inv_freq(cfg, local=True) if any(self.sliding) else None
        self.gradient_checkpointing = False
        # the LM head in float32 under autocast (lm_head_linear)
        self.cast_lm_head_to_fp32 = False
        if self.embed_tokens.weight.device.type != "meta":
            self.apply(self._init_weights)

    def tie_weights(self):
        """With tie_word_embeddings, the LM head is the embedding matrix (one Parameter, not a
        copy)."""
        if self.config.tie_word_embeddings and self.config.num_labels is None:
            self.lm_head.weight = self.embed_tokens.weight

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.config.initializer_range)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def hidden_states(
        self, input_ids, attention_mask=None, positions=None, cache=None, cache_start=0
    ):
        """input_ids [B,T] -> final-norm hidden states [B,T,C] (all but the LM head).
        attention_mask: the real keys (0 = padding), [B,T], or [B, cache_start+T] with a cache.
        positions [B,T] for RoPE; by default the count of real tokens before each, or
        cache_start + arange(T). A cache takes this chunk's keys at slots cache_start.. and
        attends over all filled slots; a static one (a compiled decode step) takes a tensor
        cache_start, and a [B, max_len] mask."""
        return self._trunk(input_ids, attention_mask, positions, cache, cache_start)

    def _trunk(self, input_ids, attention_mask, positions, cache, cache_start):
        # (forward and hidden_states both call this, so FSDP hooks on either never nest)
        B, T = input_ids.shape
        if positions is None and attention_mask is not None and cache is None:
            positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        elif positions is None:
            slots = torch.arange(cache_start, cache_start + T, device=input_ids.device)  # [T]
            positions = slots.expand(B, T)
        static = cache is not None and cache.static  # cache_start is then a tensor
        packed = getattr(cache, "packed", False)  # fast/packing.py's row: attends per sequence
        if cache is not None and not static and cache_start + T > cache.max_len:
            raise ValueError(
                f"KV cache of {cache.max_len} slots is too small for {cache_start + T} tokens"
            )
        mask = window = valid = None
        if attention_mask is not None and not static and T > 1:
            # [B,T]: which of these T tokens are real (None: all, or unknown in a compiled step)
            valid = attention_mask[:, -T:].bool()
        if not packed and (attention_mask is not None or cache is not None or any(self.sliding)):
            if attention_mask is None:
                attention_mask = input_ids.new_ones(B, cache_start + T, dtype=torch.bool)
            mask = attention_mask_for(attention_mask, T, cache_start)
        if mask is not None and any(self.sliding):  # Gemma 3's last sliding_window real tokens
            window = self.window_mask(
                mask, attention_mask, T, cache_start, self.config.sliding_window
            )
        if mask is not None and not torch.is_autocast_enabled(input_ids.device.type):
            # SDPA's additive form (0 / -inf) of the bool masks, made once rather than by every
            # layer (the same numbers); under autocast the query's dtype is unknown here
            dtype = self.embed_tokens.weight.dtype
            mask = additive_mask(mask, dtype)
            window = None if window is None else additive_mask(window, dtype)
        x = self.embed_tokens(input_ids)
        if self.inv_freq.device != x.device:  # moved once, on the first forward on a new device
            self.inv_freq = self.inv_freq.to(x.device)
            if self.local_inv_freq is not None:
                self.local_inv_freq = self.local_inv_freq.to(x.device)
        cos_sin = rope_cos_sin(self.inv_freq, positions, x.dtype)
        if self.local_inv_freq is not None:
            local = rope_cos_sin(self.local_inv_freq, positions, x.dtype)
        checkpointing = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for i, block in enumerate(self.layers):
            rope = local if self.sliding[i] else cos_sin
            cos, sin = rope if self.rope_layers[i] else (None, None)  # None: a NoPE layer
            mask_i = valid if self.linear[i] else window if self.sliding[i] else mask
            if checkpointing and (cache is None or packed):
                x = checkpoint(block, x, cos, sin, mask_i, cache, i, use_reentrant=False)
            else:
                x = block(x, cos, sin, mask_i, cache, i, cache_start)
        return self.norm(x)

    def forward(
        self, input_ids, attention_mask=None, positions=None, cache=None, cache_start=0, head=None
    ):
        """Logits [B,T,V] (a classifier's label scores [B,T,num_labels]); arguments as in
        `hidden_states`. With `head`: head(hidden [B,T,C], self.lm_head or self.score), inside the
        forward so that FSDP keeps the head gathered (how fast/logprobs.py scores in chunks, and a
        reward model only its pooled position)."""
        h = self._trunk(input_ids, attention_mask, positions, cache, cache_start)
        out = self.lm_head if self.config.num_labels is None else self.score
        if head is not None:
            return head(h, out)
        if self.config.num_labels is None:
            return lm_head_linear(h, out.weight, self.cast_lm_head_to_fp32)
        return out(h)

    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        """A zeroed KV cache, `batch_size` rows of `max_len` slots, in the keys' compute dtype."""
        w = self.embed_tokens.weight
        dtype = getattr(self, "compute_dtype", w.dtype)  # dist.shard_model sets FSDP2's
        return KVCache(self.config, batch_size, max_len, dtype, w.device)


@contextmanager
def eval_mode(model: nn.Module):
    """Inside: model.eval() (no dropout). After, an error included: the training flag it had."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)
