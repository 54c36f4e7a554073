"""LoRA adapters in plain PyTorch, exactly as PEFT defines them (peft itself is never imported).

Owns: `LoRALinear` (an nn.Linear plus a trainable low-rank update),
`apply_lora` (put adapters on a Transformer and freeze everything else),
`disable_adapters` (the base model back for a moment: the reference model of
GRPO, no second copy), `merge_lora` (fold the adapters into the weights: a
plain Transformer again), and the translation to PEFT's tensor names and
adapter_config.json fields. The files are checkpoint/__init__.py's: importing
this module registers LoRA's adapter format there (`register_adapter`, at the
end), and the loader and save_model read and write adapter_config.json and
adapter_model.safetensors through it without importing this module.

Does not know about: training, or more than one process.

Choices:
- y = x W^T + b + scaling * B(A(dropout(x))), scaling = lora_alpha / r
  (use_rslora: lora_alpha / sqrt(r)). A starts kaiming-uniform (a = sqrt(5))
  and B at zero, as PEFT does, so a fresh adapter changes nothing.
- `LoRALinear` *is* the nn.Linear it replaces (same `weight` and `bias`
  Parameters, not copies) with `lora_A`/`lora_B` children, so base tensors
  keep their names and an adapter tensor's name is PEFT's without a prefix:
  `layers.0.self_attn.q_proj.lora_A.weight` <->
  `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`.
- `lora_modules_to_save` (embed_tokens, lm_head) are trained in full. A frozen
  copy of their original weight is kept so that disable_adapters gives the
  base model exactly, as PEFT's ModulesToSaveWrapper does. With tied
  embeddings the two names are one matrix, so both must be named (PEFT's
  `ensure_weight_tying=True`); naming one is ambiguous and refused.
- Sampling runs with the adapters active, not merged for the round
  (bench/bench_lora.py compares the two speeds): an exact unmerge needs a
  copy of every targeted weight (the memory LoRA saves), and `W -= s B A`
  rounds the frozen base each round (the reference model drifts, resume is
  not bitwise).
"""

import math
import re
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanogrpo import checkpoint
from nanogrpo.checkpoint.hf_format import check_tensors

# PEFT's default for llama, mistral, qwen2, qwen3 and gemma3_text; PEFT (0.21) has none for these
DEFAULT_TARGETS = ["q_proj", "v_proj"]
NO_PEFT_DEFAULT = ("smollm3", "qwen3_5_text")
SAVABLE = ("embed_tokens", "lm_head")
PEFT_PREFIX = "base_model.model."

# -----------------------------------------------------------------------------
# The layer


class LoRALinear(nn.Linear):
    """nn.Linear with frozen `weight`/`bias` plus scaling * lora_B(lora_A(lora_dropout(x))).
    x [..., in] -> [..., out]; lora_A.weight [r, in], lora_B.weight [out, r]."""

    def __init__(self, base: nn.Linear, r: int, scaling: float, dropout: float):
        super().__init__(base.in_features, base.out_features, bias=False, device="meta")
        # the same Parameters: nothing is copied
        self.weight = base.weight
        self.bias = base.bias
        kw = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Linear(base.in_features, r, bias=False, **kw)
        self.lora_B = nn.Linear(r, base.out_features, bias=False, **kw)
        if dropout > 0:
            self.lora_dropout = nn.Dropout(dropout)
        else:
            self.lora_dropout = nn.Identity()
        self.scaling = scaling
        self.adapter_enabled = True
        if base.weight.device.type != "meta":
            init_adapter_(self.lora_A.weight, self.lora_B.weight)

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        if not self.adapter_enabled:
            return y
        x = self.lora_dropout(x.to(self.lora_A.weight.dtype))
        return y + self.lora_B(self.lora_A(x)) * self.scaling  # [..., r] between


@torch.no_grad()
def init_adapter_(A: torch.Tensor, B: torch.Tensor):
    """PEFT's init: A kaiming-uniform with a = sqrt(5) (nn.Linear's default), B zeros."""
    nn.init.kaiming_uniform_(A, a=math.sqrt(5))
    nn.init.zeros_(B)


def scaling_of(settings: dict) -> float:
    """lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora."""
    r = settings["r"]
    return settings["lora_alpha"] / (math.sqrt(r) if settings.get("use_rslora") else r)


def lora_layers(model) -> dict[str, LoRALinear]:
    """{module name: LoRALinear} of a model (empty without adapters)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


# -----------------------------------------------------------------------------
# Putting adapters on a model


def _targets(model, target_modules) -> list[str]:
    """Names (ours, e.g. `layers.0.self_attn.q_proj`) of the block linears
    that PEFT's rules match: a list entry matches a module named exactly so
    (HF name) or ending in `.entry`; "all-linear" is every linear of the
    blocks (never lm_head); another string is a regular expression for the
    full HF name."""
    names = [
        n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith("layers.")
    ]
    valid = ", ".join(dict.fromkeys(n.split(".")[-1] for n in names))  # (in the model's order)
    family = model.config.model_type
    if target_modules is None and family in NO_PEFT_DEFAULT:
        raise ValueError(
            f"lora_target_modules must be named for a {family} model (PEFT has no default for "
            f"it): a list of {valid}, or 'all-linear'"
        )
    if target_modules is None:
        target_modules = DEFAULT_TARGETS
    if isinstance(target_modules, str):
        if target_modules.lower() == "all-linear":
            return names
        chosen = [n for n in names if re.fullmatch(target_modules, "model." + n)]
        if not chosen:
            raise ValueError(
                f"lora_target_modules={target_modules!r} (a regular "
                f"expression) matches no layer; valid names: {valid} or "
                "'all-linear'"
            )
        return chosen
    chosen = set()
    for t in target_modules:
        hit = [n for n in names if "model." + n == t or ("model." + n).endswith("." + t)]
        if not hit:
            raise ValueError(
                f"lora_target_modules: {t!r} names no linear layer of the "
                f"blocks; valid names: {valid} (or 'all-linear'; lm_head goes "
                "in lora_modules_to_save)"
            )
        chosen.update(hit)
    return [n for n in names if n in chosen]


def _modules_to_save(model, modules_to_save) -> list[str]:
    """Validated modules_to_save as our names (`embed_tokens`, `lm_head`)."""
    out = []
    for name in modules_to_save or []:
        short = name.split(".")[-1]
        if short not in SAVABLE:
            raise ValueError(
                f"lora_modules_to_save: {name!r} is not "
                f"supported; valid names: {', '.join(SAVABLE)}"
            )
        out.append(short)
    if model.config.tie_word_embeddings and len(set(out)) == 1:
        raise ValueError(
            f"lora_modules_to_save={list(modules_to_save)}: this model ties "
            "embed_tokens and lm_head (tie_word_embeddings=True), so they are "
            "one matrix; name both to train it (['embed_tokens', 'lm_head']), "
            "or neither"
        )
    return sorted(set(out))


def apply_lora(
    model,
    r: int = 16,
    lora_alpha: float = 32,
    lora_dropout: float = 0.05,
    target_modules=None,
    modules_to_save=None,
    use_rslora: bool = False,
):
    """Replace the targeted linears of `model`'s blocks by LoRALinear (in
    place, weights shared) and freeze everything but the adapters and
    `modules_to_save`. On a meta-device model (checkpoint/__init__.py's loader)
    nothing is initialised; otherwise A and B start as PEFT's. Records the
    settings as `model.lora_config` (PEFT's field names). Returns the model."""
    if lora_layers(model):
        raise ValueError(
            "this model already has LoRA adapters; merge_lora it first to add new ones"
        )
    if not isinstance(r, int) or r < 1:
        raise ValueError(f"lora_r={r!r}: the adapter rank must be an integer >= 1")
    if not lora_alpha > 0:
        raise ValueError(f"lora_alpha={lora_alpha!r}: must be > 0")
    if not 0 <= lora_dropout < 1:
        raise ValueError(f"lora_dropout={lora_dropout!r}: must be in [0, 1)")
    targets = _targets(model, target_modules)
    saved = _modules_to_save(model, modules_to_save)
    short = sorted({n.split(".")[-1] for n in targets})
    # short names say it all, else PEFT-style full names
    exact = _targets(model, short) == targets
    settings = {
        "r": r,
        "lora_alpha": lora_alpha,
        "lora_dropout": lora_dropout,
        "use_rslora": bool(use_rslora),
        "target_modules": short if exact else ["model." + n for n in targets],
        "modules_to_save": saved,
    }
    scaling = scaling_of(settings)
    for name in targets:
        linear = model.get_submodule(name)
        _replace(model, name, LoRALinear(linear, r, scaling, lora_dropout))
    model.lora_config = settings
    real = model.embed_tokens.weight.device.type != "meta"
    return mark_trainable(model, model.state_dict() if real else None)


def _replace(model, name: str, module: nn.Module):
    """Put `module` where the submodule `name` (dotted) of model stands."""
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, module)


def mark_trainable(model, base_state: dict | None = None):
    """requires_grad on the adapters and modules_to_save only. With
    `base_state` (our names), keep a frozen copy of each modules_to_save
    weight as it is there, for disable_adapters (tied embeddings share one
    copy). Called again by the loader after it assigned the real tensors.
    Returns the model."""
    saved = model.lora_config["modules_to_save"]
    model.requires_grad_(False)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_key(name, saved))
    copies = {}
    for name in saved if base_state is not None else []:
        key = "embed_tokens" if model.config.tie_word_embeddings else name
        if key not in copies:  # tied embeddings: one frozen copy for both names
            copies[key] = base_state[name + ".weight"].detach().clone()
        module = getattr(model, name)
        module.register_buffer("lora_original_weight", copies[key], persistent=False)
    return model


def is_adapter_key(name: str, modules_to_save=()) -> bool:
    """Whether a state-dict key (our names) belongs to the adapter: a
    lora_A/lora_B weight, or a weight of a modules_to_save module
    (embed_tokens, lm_head)."""
    if ".lora_A." in name or ".lora_B." in name:
        return True
    return name.split(".")[0] in (modules_to_save or ())


def has_dropout(model) -> bool:
    """Whether a forward in train mode drops adapter inputs (lora_dropout > 0)."""
    return any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())


def trainable_parameters(model) -> list[nn.Parameter]:
    """The parameters the optimizer holds (all of them without adapters)."""
    return [p for p in model.parameters() if p.requires_grad]


def fresh_adapter_state(model, dtype=torch.float32, device="cpu") -> dict:
    """A newly initialised adapter for every LoRALinear of a meta-device
    `model`, our names: what checkpoint/__init__.py's loader assigns (and, when
    sharded, broadcasts from rank 0)."""
    state = {}
    for name, m in lora_layers(model).items():
        A = torch.empty(m.lora_A.weight.shape)  # [r, in]
        B = torch.empty(m.lora_B.weight.shape)  # [out, r]
        init_adapter_(A, B)
        state[f"{name}.lora_A.weight"] = A.to(device, dtype)
        state[f"{name}.lora_B.weight"] = B.to(device, dtype)
    return state


# -----------------------------------------------------------------------------
# Adapters off, adapters merged


@contextmanager
def disable_adapters(model):
    """Inside the block `model` is its base model: adapters off and
    modules_to_save back at their original weights (TRL's reference model
    with PEFT). No copy of the weights is made."""
    layers = list(lora_layers(model).values())
    # (module, its trained weight) of each modules_to_save
    swapped = [
        (m, m._parameters["weight"])
        for m in (model.embed_tokens, model.lm_head)
        if hasattr(m, "lora_original_weight")
    ]
    for m in layers:
        m.adapter_enabled = False
    for m, _ in swapped:
        original = nn.Parameter(m.lora_original_weight, requires_grad=False)
        m._parameters["weight"] = original
    try:
        yield model
    finally:
        for m in layers:
            m.adapter_enabled = True
        for m, weight in swapped:
            m._parameters["weight"] = weight


def merged_weight(weight, lora_A, lora_B, scaling) -> torch.Tensor:
    """W + scaling * B @ A, computed in fp32 and returned in W's dtype.
    [out,in] + [out,r] @ [r,in]."""
    delta = lora_B.float() @ lora_A.float()
    return (weight.float() + scaling * delta).to(weight.dtype)


@torch.no_grad()
def merge_lora(model):
    """Fold every adapter into its layer's weight and put a plain nn.Linear
    back (in place): a plain Transformer whose state dict is an ordinary
    checkpoint (save_model writes it; transformers loads it). modules_to_save
    keep their trained weights. Every parameter is trainable again. Returns
    the model."""
    for name, m in lora_layers(model).items():
        linear = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
        weight = merged_weight(m.weight, m.lora_A.weight, m.lora_B.weight, m.scaling)
        linear.weight = nn.Parameter(weight)
        linear.bias = m.bias
        _replace(model, name, linear)
    for m in (model.embed_tokens, model.lm_head):
        m._buffers.pop("lora_original_weight", None)
    model.__dict__.pop("lora_config", None)
    model.tie_weights()
    return model.requires_grad_(True)


def merged_state_dict(state: dict, settings: dict) -> dict:
    """merge_lora on a full state dict (our names) instead of a model: how a
    sharded run writes its merged checkpoint from rank 0's gathered copy.
    -> the plain model's state dict."""
    out = {k: v for k, v in state.items() if not is_adapter_key(k)}
    scaling = scaling_of(settings)
    for key in state:
        if key.endswith(".lora_A.weight"):
            layer = key.removesuffix(".lora_A.weight")
            B = state[layer + ".lora_B.weight"]
            W = state[layer + ".weight"]
            out[layer + ".weight"] = merged_weight(W, state[key], B, scaling)
    return out


# -----------------------------------------------------------------------------
# PEFT's names and adapter_config.json


def to_peft_name(name: str) -> str:
    """`layers.0.self_attn.q_proj.lora_A.weight` ->
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`;
    `lm_head.weight` -> `base_model.model.lm_head.weight` (lm_head sits
    outside HF's inner `model`)."""
    if name.startswith("lm_head."):
        return PEFT_PREFIX + name
    return PEFT_PREFIX + "model." + name


def from_peft_name(key: str) -> str:
    return key.removeprefix(PEFT_PREFIX).removeprefix("model.")


def adapter_state(state: dict, settings: dict) -> dict:
    """The tensors of an adapter file under PEFT's names, from a full state
    dict (our names): every lora_A/lora_B, and the weight of each
    modules_to_save module. Contiguous, no shared storage."""
    saved = settings["modules_to_save"]
    return {
        to_peft_name(k): v.detach().clone().contiguous()
        for k, v in state.items()
        if is_adapter_key(k, saved)
    }


def from_peft_state(tensors: dict, model) -> dict:
    """An adapter file's tensors -> our names, checked against `model`
    (adapters applied, meta is fine): an error lists missing and unexpected
    tensors, and names a shape mismatch."""
    ours = {from_peft_name(k): v for k, v in tensors.items()}
    saved = model.lora_config["modules_to_save"]
    expected = {k: v for k, v in model.state_dict().items() if is_adapter_key(k, saved)}
    source = "its adapter_config.json and the base model (r)"
    check_tensors(ours, expected, set(), what="adapter", source=source)
    return ours


# PEFT's LoraConfig fields we do not implement, at the value that means "off"
UNSUPPORTED = {
    "use_dora": False,
    "lora_bias": False,
    "bias": "none",
    "fan_in_fan_out": False,
    "layers_to_transform": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "layer_replication": None,
    "target_parameters": None,
    "trainable_token_indices": None,
    "exclude_modules": None,
}


def peft_config(settings: dict, base_model_name_or_path: str, tied: bool) -> dict:
    """adapter_config.json for an adapter with these settings (PEFT's
    LoraConfig fields)."""
    saved = settings["modules_to_save"]
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        **settings,
        "modules_to_save": saved or None,
        "init_lora_weights": True,
        "inference_mode": True,
        "ensure_weight_tying": bool(tied and saved),
        **UNSUPPORTED,
    }


def peft_config_of(model) -> dict | None:
    """adapter_config.json's contents for a model with adapters (None for a
    plain model)."""
    if not hasattr(model, "lora_config"):
        return None
    base = getattr(model, "base_model_name_or_path", None)
    return peft_config(model.lora_config, base, model.config.tie_word_embeddings)


def settings_from_peft_config(cfg: dict, where: str = ".") -> dict:
    """apply_lora keyword arguments from the adapter_config.json in directory
    `where`; features we do not implement (DoRA, per-layer ranks, ...) are
    errors naming the field."""
    file = f"{where}/adapter_config.json"
    if cfg.get("peft_type") != "LORA":
        raise ValueError(f"{file}: peft_type={cfg.get('peft_type')!r}; only LORA is supported")
    if not cfg.get("base_model_name_or_path"):
        raise ValueError(
            f"{file}: base_model_name_or_path is empty, so the "
            "base model is unknown; write the base checkpoint's "
            "path or hub id there"
        )
    for key, default in UNSUPPORTED.items():
        if cfg.get(key, default) not in (default, None, [], {}, False):
            raise ValueError(f"{file}: {key}={cfg[key]!r} is not supported by nanogrpo's LoRA")
    return {
        "r": cfg["r"],
        "lora_alpha": cfg["lora_alpha"],
        "lora_dropout": cfg.get("lora_dropout", 0.0),
        "target_modules": cfg.get("target_modules"),
        "modules_to_save": cfg.get("modules_to_save"),
        "use_rslora": cfg.get("use_rslora", False),
    }


# -----------------------------------------------------------------------------
# The loader's adapter format: LoRA, read and written by checkpoint/__init__.py

checkpoint.register_adapter(
    checkpoint.AdapterFormat(
        settings=settings_from_peft_config,
        apply=apply_lora,
        fresh=fresh_adapter_state,
        from_file=from_peft_state,
        finish=mark_trainable,
        config_of=peft_config_of,
        is_key=is_adapter_key,
        to_file=adapter_state,
    )
)
