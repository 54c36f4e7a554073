"""The decoder transformer, its KV cache, and Hugging Face checkpoint loading/saving.

Owns: `ModelConfig` (read from / written to an HF `config.json`), the `Transformer` (Llama 3.x,
Mistral, Qwen2/Qwen2.5 and Qwen3 families: RMSNorm, RoPE, grouped-query attention through
`F.scaled_dot_product_attention`, SwiGLU MLP), a static `KVCache`, and safetensors I/O.

Does not know about: tokenization, sampling strategies, losses, or more than one process.

Choices:
- Parameter names mirror HF's (`layers.0.self_attn.q_proj.weight`, ...) so loading is a prefix strip,
  and what we save is what transformers and vLLM expect.
- One attention code path for everything: training (no cache), prefill and decode. Positions
  (for RoPE) are explicit per row, and keys are masked with an explicit boolean mask
  `key_valid & causal`, so left-padded prompts of different lengths batch together and a query
  shorter than the keys (decode against a cache) is aligned correctly. SDPA's `is_causal` aligns the
  causal triangle upper-left, which is wrong as soon as q_len != k_len; we use it only for the
  plain unpadded, uncached forward where the two agree.
- Every query may always attend to its own slot, so a fully padded row never divides by zero (NaN).
"""

import json
import math
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

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
    initializer_range: float = 0.02
    extra: dict = field(default_factory=dict, repr=False, compare=False)  # other config.json keys, written back as-is

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"config.json: model_type={self.model_type!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        if self.model_type == "qwen2":
            self.attention_bias = True
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"config.json: rope_scaling.rope_type={rope_type!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalizes each query/key head with an RMSNorm before RoPE."""
        return self.model_type == "qwen3"

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Build from the dict of an HF config.json; unsupported features raise ValueError."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"config.json: model_type={model_type!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        for key in ("num_local_experts", "num_experts", "n_routed_experts"):
            if hf.get(key):
                raise ValueError(f"config.json: {key}={hf[key]} (mixture of experts) is not supported; "
                                 f"only dense {', '.join(SUPPORTED_MODEL_TYPES)} models are")
        window = hf.get("sliding_window")
        if window and (model_type == "mistral" or hf.get("use_sliding_window")):
            raise ValueError(f"config.json: sliding_window={window} (sliding-window attention) is not "
                             "supported; only full attention is (set sliding_window to null)")
        bad_layers = [t for t in hf.get("layer_types") or [] if t != "full_attention"]
        if bad_layers:
            raise ValueError(f"config.json: layer_types contains {bad_layers[0]!r}; only 'full_attention' is supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json: hidden_act={hf['hidden_act']!r} is not supported; only 'silu' (SwiGLU)")
        # RoPE: transformers >= 5 writes `rope_parameters`; older checkpoints `rope_theta` + `rope_scaling`.
        rope = dict(hf.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        scaling = rope or hf.get("rope_scaling")
        if scaling is not None:
            scaling = dict(scaling)
            scaling["rope_type"] = scaling.get("rope_type", scaling.pop("type", "default"))
            if scaling["rope_type"] == "default":
                scaling = None
        known = {f.name for f in fields(cls)} - {"extra", "rope_theta", "rope_scaling"}
        kwargs = {k: hf[k] for k in known if hf.get(k) is not None}
        return cls(**kwargs, rope_theta=float(theta), rope_scaling=scaling, extra=dict(hf))

    def to_hf(self) -> dict:
        """The dict to write as config.json (keeps unknown keys of the loaded file)."""
        hf = dict(self.extra)
        for f in fields(self):
            if f.name not in ("extra", "rope_theta", "rope_scaling"):
                hf[f.name] = getattr(self, f.name)
        if "rope_parameters" in hf:  # transformers >= 5 layout
            hf["rope_parameters"] = {"rope_theta": self.rope_theta, **(self.rope_scaling or {"rope_type": "default"})}
        else:  # the classic layout, read by every transformers and vLLM version
            hf["rope_theta"] = self.rope_theta
            hf["rope_scaling"] = self.rope_scaling
        arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[self.model_type]
        hf["architectures"] = [arch]
        if self.model_type == "qwen2":
            hf.pop("attention_bias", None)  # implied by the family
        return hf


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


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] of RoPE, with `linear` or `llama3` scaling applied."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate in between.
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


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


class KVCache:
    """Static key/value buffers for every layer: k[layer], v[layer] are [B, H_kv, max_len, head_dim].

    Written in place at slot indices by `Transformer.forward(..., cache=, cache_start=)`; never
    reallocated while decoding. `select(rows)` builds a cache holding only (or repeating) some rows,
    which the sampler uses to copy a prompt's prefill into its G samples and to drop finished rows.
    """

    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int, dtype, device):
        shape = (batch_size, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.max_len = max_len

    def select(self, rows: torch.Tensor) -> "KVCache":
        """A new cache whose row i is this cache's row rows[i] (rows may repeat)."""
        new = object.__new__(KVCache)
        new.k = [k.index_select(0, rows) for k in self.k]
        new.v = [v.index_select(0, rows) for v in self.v]
        new.max_len = self.max_len
        return new


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE (and Qwen3's per-head q/k RMSNorm)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache=None, layer=0, cache_start=0):
        # x: [B,T,C]; cos/sin: [B,1,T,D]; mask: [B,1,T,S] bool or None (plain causal)
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # [B,H,T,D]
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)  # [B,Hkv,T,D]
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:  # write the new keys at their slots, attend over every filled slot
            end = cache_start + T
            cache.k[layer][:, :, cache_start:end] = k
            cache.v[layer][:, :, cache_start:end] = v
            k, v = cache.k[layer][:, :, :end], cache.v[layer][:, :, :end]  # [B,Hkv,S,D]
        if T == 1 and mask is not None and self.n_kv != self.n_heads:
            # one-token decode step: fold each kv head's query heads into the query axis
            # ([B,H,1,D] -> [B,Hkv,H/Hkv,D]) instead of copying the whole cache H/Hkv times
            y = F.scaled_dot_product_attention(q.reshape(B, self.n_kv, -1, self.head_dim), k, v, attn_mask=mask)
            return self.o_proj(y.reshape(B, T, -1))
        if self.n_kv != self.n_heads:  # grouped-query: each kv head serves n_heads/n_kv query heads
            k = k.repeat_interleave(self.n_heads // self.n_kv, dim=1)
            v = v.repeat_interleave(self.n_heads // self.n_kv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


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

    def __init__(self, cfg: ModelConfig):
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


def attention_mask_for(key_valid, T, cache_start):
    """Boolean mask [B,1,T,S]: query t (at slot cache_start+t) sees key slot s if s <= its slot and
    the key is valid; a query always sees its own slot (keeps fully padded rows finite)."""
    S = key_valid.shape[1]
    q_slot = torch.arange(cache_start, cache_start + T, device=key_valid.device)[:, None]  # [T,1]
    k_slot = torch.arange(S, device=key_valid.device)[None, :]  # [1,S]
    causal = k_slot <= q_slot  # [T,S]
    mask = (key_valid.bool()[:, None, :] & causal) | (k_slot == q_slot)  # [B,T,S]
    return mask[:, None]


class Transformer(nn.Module):
    """Decoder-only language model. `model(input_ids)` -> logits [B,T,V]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.generation_config: dict | None = None  # generation_config.json, when loaded from one
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.inv_freq = rope_inv_freq(cfg)  # on CPU, fp32, kept out of state_dict and of .to(dtype)
        self.gradient_checkpointing = False
        if self.embed_tokens.weight.device.type != "meta":
            self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.config.initializer_range)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def hidden_states(self, input_ids, attention_mask=None, positions=None, cache=None, cache_start=0):
        """Final-norm hidden states [B,T,C] (everything but the LM head).

        input_ids [B,T]. attention_mask: which keys are real tokens, [B,T] without a cache or
        [B, cache_start+T] with one (0 = padding). positions [B,T] for RoPE; by default the count
        of real tokens before each one (left-padding aware) or cache_start + arange(T).
        cache/cache_start: write this chunk's keys at slots cache_start.. and attend to all slots.
        """
        return self._trunk(input_ids, attention_mask, positions, cache, cache_start)

    def _trunk(self, input_ids, attention_mask, positions, cache, cache_start):
        # (forward and hidden_states both call this, so FSDP hooks on either never nest)
        B, T = input_ids.shape
        if positions is None:
            if attention_mask is not None and cache is None:
                positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
            else:
                positions = torch.arange(cache_start, cache_start + T, device=input_ids.device).expand(B, T)
        if cache is not None and cache_start + T > cache.max_len:
            raise ValueError(f"KV cache of {cache.max_len} slots is too small for {cache_start + T} tokens")
        mask = None
        if attention_mask is not None or cache is not None:
            if attention_mask is None:
                attention_mask = torch.ones(B, cache_start + T, dtype=torch.bool, device=input_ids.device)
            mask = attention_mask_for(attention_mask, T, cache_start)
        x = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(self.inv_freq.to(x.device), positions, x.dtype)
        for i, block in enumerate(self.layers):
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, cos, sin, mask, use_reentrant=False)
            else:
                x = block(x, cos, sin, mask, cache, i, cache_start)
        return self.norm(x)

    def forward(self, input_ids, attention_mask=None, positions=None, cache=None, cache_start=0, head=None):
        """Logits [B,T,V]; arguments as in `hidden_states`. With `head`, returns head(hidden [B,T,C],
        self.lm_head) instead: how token_logprobs scores in chunks without full logits, inside the
        forward call (so FSDP keeps the LM head gathered while it runs)."""
        h = self._trunk(input_ids, attention_mask, positions, cache, cache_start)
        return self.lm_head(h) if head is None else head(h, self.lm_head)

    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        """A zeroed KV cache for `batch_size` rows of up to `max_len` tokens, in the model's dtype/device."""
        w = self.embed_tokens.weight
        return KVCache(self.config, batch_size, max_len, w.dtype, w.device)

    # --- checkpoints ------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path_or_hub_id, dtype=torch.float32, device="cpu") -> "Transformer":
        """Load an HF checkpoint (local dir or hub id) straight into `dtype` on `device`.

        The model is built on the meta device and each tensor is read from safetensors, cast and
        moved once, so no second full copy ever exists in memory.
        """
        path = resolve_checkpoint(path_or_hub_id)
        cfg = ModelConfig.from_hf(read_json(os.path.join(path, "config.json")))
        dtype = parse_dtype(dtype)
        with torch.device("meta"):
            model = cls(cfg)
        state = load_safetensors(path, dtype=dtype, device=device)
        model.load_hf_state_dict(state)
        gen_path = os.path.join(path, "generation_config.json")
        if os.path.exists(gen_path):
            model.generation_config = read_json(gen_path)
        model.name_or_path = str(path_or_hub_id)
        return model

    def load_hf_state_dict(self, state: dict):
        """Assign tensors named as in HF checkpoints (`model.layers.0...`, `lm_head.weight`); strict."""
        self.load_state_dict(self.check_hf_state_dict(state), strict=False, assign=True)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def check_hf_state_dict(self, state: dict) -> dict:
        """HF-named tensors -> our names, with a clear error listing missing/unexpected tensors and
        shape mismatches (works on a meta-device model)."""
        ours = {k.removeprefix("model."): v for k, v in state.items()}
        tied = self.config.tie_word_embeddings
        if tied:
            ours.pop("lm_head.weight", None)  # some checkpoints store the tied copy too
        expected = {k: v for k, v in self.state_dict().items() if not (tied and k == "lm_head.weight")}
        missing = sorted(set(expected) - set(ours))
        unexpected = sorted(set(ours) - set(expected))
        if missing or unexpected:
            raise ValueError("checkpoint does not match the config: "
                             f"missing tensors {missing[:10]}{' ...' if len(missing) > 10 else ''}; "
                             f"unexpected tensors {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}")
        for name, tensor in ours.items():
            if tuple(tensor.shape) != tuple(expected[name].shape):
                raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                                 f"the config implies {tuple(expected[name].shape)}")
        return ours

    def hf_state_dict(self) -> dict:
        """Our weights under HF's names (tied lm_head omitted), contiguous, ready for safetensors."""
        return to_hf_names(self.state_dict(), self.config)

    def save_pretrained(self, out_dir, max_shard_bytes: int = 5 * 2**30):
        """Write config.json, safetensors (sharded with an index above `max_shard_bytes`) and
        generation_config.json (when known) into `out_dir`, atomically."""
        with atomic_dir(out_dir) as tmp:
            write_pretrained(tmp, self.config, self.hf_state_dict(), self.generation_config, max_shard_bytes)


# -----------------------------------------------------------------------------
# Files


def to_hf_names(state: dict, cfg: ModelConfig) -> dict:
    """A state dict under our names -> HF's names (`model.` prefix; tied lm_head omitted)."""
    out = {}
    for name, tensor in state.items():
        if name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                out[name] = tensor.detach().contiguous()
        else:
            out["model." + name] = tensor.detach().contiguous()
    return out


def parse_dtype(dtype) -> torch.dtype:
    """torch.dtype from a dtype or a name like "bfloat16"/"bf16"/"float32"."""
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
             "fp16": torch.float16, "float64": torch.float64}
    if dtype not in names:
        raise ValueError(f"dtype={dtype!r} is not known; use one of {sorted(names)}")
    return names[dtype]


def read_json(path) -> dict:
    """Parse a JSON file, with an error naming the file when it is missing."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: a checkpoint directory needs config.json and *.safetensors")
    with open(path) as f:
        return json.load(f)


HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt"]


def resolve_checkpoint(path_or_hub_id) -> str:
    """A local directory as is; otherwise download a hub repo's config, weights and tokenizer."""
    path = str(path_or_hub_id)
    if os.path.isdir(path):
        return path
    if os.path.exists(path) or path.startswith((".", "/")) or path.count("/") != 1:
        raise FileNotFoundError(f"{path!r} is neither a checkpoint directory nor a hub id like 'Qwen/Qwen2.5-0.5B'")
    from huggingface_hub import snapshot_download
    return snapshot_download(path, allow_patterns=HUB_FILES)


def load_safetensors(path, dtype, device) -> dict:
    """Every tensor of a single-file or sharded checkpoint, cast to `dtype` on `device`."""
    from safetensors import safe_open
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        files = sorted(set(read_json(index)["weight_map"].values()))
    elif os.path.exists(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")
    state = {}
    for name in files:
        with safe_open(os.path.join(path, name), framework="pt", device="cpu") as f:
            for key in f.keys():
                state[key] = f.get_tensor(key).to(device=device, dtype=dtype)
    return state


@contextmanager
def atomic_dir(out_dir):
    """Yield a temporary directory beside `out_dir`; on success it replaces `out_dir` in one rename.

    A crash (or Ctrl-C) inside the block leaves the old `out_dir` untouched and no half-written one.
    """
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(out_dir) + ".tmp-", dir=parent)
    try:
        yield tmp
        if os.path.exists(out_dir):
            old = tmp + ".old"
            os.rename(out_dir, old)
            os.rename(tmp, out_dir)
            shutil.rmtree(old)
        else:
            os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_pretrained(out_dir, cfg: ModelConfig, state: dict, generation_config=None, max_shard_bytes=5 * 2**30):
    """Write config.json + safetensors (+ index when sharded) + generation_config.json into out_dir."""
    from safetensors.torch import save_file
    hf = cfg.to_hf()
    dtypes = {v.dtype for v in state.values()}
    hf["torch_dtype"] = str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1 else "float32"
    if "dtype" in hf:  # transformers >= 5 spells it `dtype`
        hf["dtype"] = hf["torch_dtype"]
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    if generation_config:
        with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
            json.dump(generation_config, f, indent=2)
    shards, size = [{}], 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.cpu()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
