"""Hugging Face's formats <-> ours: config.json keys and tensor names.

Owns: `config_from_hf` / `config_to_hf` (config.json <-> ModelConfig, with
an error for each feature we do not implement) and `to_hf_names` /
`from_hf_names` (state dicts, the one place that knows about tied
embeddings: the tied lm_head is never written and on load it is the
embedding).

Does not know about: files (checkpoint/__init__.py reads and writes them), the forward pass
(model.py), or LoRA (extras/lora.py names adapter tensors as PEFT does).
"""

from dataclasses import fields

import nanogrpo.models  # noqa: F401 (registers Gemma 3's and Qwen3.5's layers in model.FAMILIES)
from nanogrpo.model import SUPPORTED_MODEL_TYPES, ModelConfig, Transformer

# config.json's architectures: the family's prefix + ForCausalLM etc.
ARCHITECTURES = {
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "smollm3": "SmolLM3",
    "gemma3_text": "Gemma3",  # (its classifier is Gemma3TextForSequenceClassification)
    "qwen3_5_text": "Qwen3_5",  # (its classifier is Qwen3_5TextForSequenceClassification)
}
# model_type -> the text family of a multimodal checkpoint whose language model we load: its
# config.json's text_config, its tensors under LANGUAGE_MODEL (the vision tower is left out)
MULTIMODAL = {"qwen3_5": "qwen3_5_text"}
LANGUAGE_MODEL = "model.language_model."
# tensors a family's checkpoints hold that its causal LM does not use (as transformers ignores
# them): the vision tower, Qwen3.5's multi-token-prediction layers
UNUSED = {"qwen3_5_text": ("model.visual.", "mtp.")}
# config.json's keys that ModelConfig holds under another layout
OWN_LAYOUT = ("extra", "rope_theta", "rope_scaling", "rope_local_base_freq", "num_labels")
# the defaults of the families whose transformers config classes differ from ModelConfig's, for the
# keys a config.json may leave out
FAMILY_DEFAULTS = {
    "smollm3": {"rope_theta": 2000000.0, "tie_word_embeddings": True},
    "qwen3_5_text": {"head_dim": 256, "partial_rotary_factor": 0.25},
    "gemma3_text": {
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "tie_word_embeddings": True,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
    },
}


# -----------------------------------------------------------------------------
# config.json <-> ModelConfig


def config_from_hf(hf: dict) -> ModelConfig:
    """ModelConfig from the dict of an HF config.json (of a multimodal checkpoint: its language
    model's); features we do not implement raise ValueError."""
    if hf.get("model_type") in MULTIMODAL:
        hf = language_model_config(hf)
    check_supported(hf)
    extra = dict(hf)
    # RoPE: transformers >= 5 writes `rope_parameters`; older checkpoints
    # `rope_theta` + `rope_scaling`
    # (Gemma 3's rope_parameters hold one such dict per layer type)
    defaults = {"rope_theta": 10000.0, **FAMILY_DEFAULTS.get(hf["model_type"], {})}
    hf = {**defaults, **{k: v for k, v in hf.items() if v is not None}}
    rope = dict(hf.get("rope_parameters") or {})
    # Qwen3.5: partial RoPE; its multimodal sections are plain RoPE on text (models/qwen3_5.py)
    partial = rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor"))
    rope.pop("mrope_section", None)
    rope.pop("mrope_interleaved", None)
    local = hf.get("rope_local_base_freq")
    if "full_attention" in rope:
        local = rope.get("sliding_attention", {}).get("rope_theta", local)
        rope = dict(rope["full_attention"])
    theta = rope.pop("rope_theta", hf["rope_theta"])
    scaling = rope or hf.get("rope_scaling")
    if scaling is not None:
        scaling = dict(scaling)
        kind = scaling.pop("type", "default")
        scaling["rope_type"] = scaling.get("rope_type", kind)
        if scaling["rope_type"] == "default":
            scaling = None
    known = {f.name for f in fields(ModelConfig)} - set(OWN_LAYOUT)
    kwargs = {k: hf[k] for k in known if hf.get(k) is not None}
    if hf["model_type"] == "gemma3_text" and "layer_types" not in kwargs:
        every = hf.get("sliding_window_pattern") or 6  # a global layer every 6th, the rest slide
        n = kwargs.get("num_hidden_layers", 26)
        kwargs["layer_types"] = [
            "sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)
        ]
    if hf["model_type"] == "smollm3":
        if "no_rope_layers" not in kwargs:  # a NoPE layer every no_rope_layer_interval layers
            every = hf.get("no_rope_layer_interval") or 4
            n = kwargs.get("num_hidden_layers", 36)
            kwargs["no_rope_layers"] = [int((i + 1) % every != 0) for i in range(n)]
    architectures = [str(a) for a in hf.get("architectures") or []]
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        # counted as transformers counts them
        if hf.get("id2label"):
            kwargs["num_labels"] = len(hf["id2label"])
        else:
            kwargs["num_labels"] = hf.get("num_labels") or 2
    if hf["model_type"] == "gemma3_text":
        kwargs["rope_local_base_freq"] = float(local)
    if partial is not None:
        kwargs["partial_rotary_factor"] = float(partial)
    return ModelConfig(**kwargs, rope_theta=float(theta), rope_scaling=scaling, extra=extra)


def language_model_config(hf: dict) -> dict:
    """A multimodal config.json's language model as a config.json of its own (text_config, with the
    top level's tie_word_embeddings), which is what save_model writes back."""
    text = dict(hf.get("text_config") or {})
    text["model_type"] = MULTIMODAL[hf["model_type"]]
    if hf.get("tie_word_embeddings") is not None:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    text.pop("architectures", None)
    return text


def check_supported(hf: dict):
    """ValueError naming the first feature of config.json we do not implement."""
    model_type = hf.get("model_type")
    families = ", ".join(SUPPORTED_MODEL_TYPES)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"config.json: model_type={model_type!r} is not supported; supported: {families}"
        )
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if hf.get(key):
            raise ValueError(
                f"config.json: {key}={hf[key]} (mixture of "
                f"experts) is not supported; only dense "
                f"{families} models are"
            )
    window = hf.get("sliding_window")
    if window and (model_type == "mistral" or hf.get("use_sliding_window")):
        raise ValueError(
            f"config.json: sliding_window={window} (sliding-"
            "window attention) is not supported; only full "
            "attention is (set sliding_window to null)"
        )
    layer_types = hf.get("layer_types") or []
    gemma = model_type == "gemma3_text"
    known_layers = {
        "gemma3_text": ("full_attention", "sliding_attention"),
        "qwen3_5_text": ("full_attention", "linear_attention"),
    }.get(model_type, ("full_attention",))
    bad_layers = [t for t in layer_types if t not in known_layers]
    if bad_layers:
        raise ValueError(
            f"config.json: layer_types contains {bad_layers[0]!r}; "
            f"only {' and '.join(map(repr, known_layers))} are supported"
        )
    if gemma:
        check_gemma3(hf)
        return
    if model_type in ("smollm3", "qwen3_5_text") and hf.get("attention_bias"):
        raise ValueError(
            f"config.json: attention_bias=true (biases on {model_type}'s q/k/v/o projections) is "
            "not supported; only attention_bias=false is"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(
            f"config.json: hidden_act={hf['hidden_act']!r} is not supported; only 'silu' (SwiGLU)"
        )


def check_gemma3(hf: dict):
    """check_supported's Gemma 3 part: what Gemma3TextConfig can hold but we do not implement."""
    act = hf.get("hidden_activation") or "gelu_pytorch_tanh"  # (Gemma3TextConfig has no hidden_act)
    if act != "gelu_pytorch_tanh":
        raise ValueError(
            f"config.json: hidden_activation={act!r} is not supported for gemma3_text; only "
            "'gelu_pytorch_tanh'"
        )
    for key in ("final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention"):
        if hf.get(key):
            raise ValueError(f"config.json: {key}={hf[key]} is not supported; only null")
    if hf.get("attention_bias"):
        raise ValueError("config.json: attention_bias=true is not supported for gemma3_text")
    sliding = (hf.get("rope_parameters") or {}).get("sliding_attention") or {}
    if sliding.get("rope_type", "default") != "default":
        raise ValueError(
            f"config.json: rope_parameters.sliding_attention.rope_type={sliding['rope_type']!r} "
            "is not supported; only 'default'"
        )


def config_to_hf(cfg: ModelConfig) -> dict:
    """The dict to write as config.json (keeps the unknown keys of the file
    it was loaded from)."""
    hf = dict(cfg.extra)
    for f in fields(cfg):
        if f.name not in OWN_LAYOUT:
            hf[f.name] = getattr(cfg, f.name)
    gemma = cfg.model_type == "gemma3_text"
    partial = hf.pop("partial_rotary_factor")
    if cfg.model_type == "qwen3_5_text":  # (a family of transformers >= 5 only)
        scaling = cfg.rope_scaling or {"rope_type": "default"}
        hf["rope_parameters"] = {
            **(cfg.extra.get("rope_parameters") or {}),  # its mrope_section, kept
            "rope_theta": cfg.rope_theta,
            **scaling,
            "partial_rotary_factor": partial,
        }
    elif "rope_parameters" in hf:  # transformers >= 5 layout
        scaling = cfg.rope_scaling or {"rope_type": "default"}
        hf["rope_parameters"] = {"rope_theta": cfg.rope_theta, **scaling}
        if gemma:  # one per layer type
            local = {"rope_type": "default", "rope_theta": cfg.rope_local_base_freq}
            full = hf["rope_parameters"]
            hf["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
    else:  # the classic layout, read by every transformers and vLLM version
        hf["rope_theta"] = cfg.rope_theta
        hf["rope_scaling"] = cfg.rope_scaling
        if gemma:
            hf["rope_local_base_freq"] = cfg.rope_local_base_freq
    head = "ForSequenceClassification" if cfg.num_labels else "ForCausalLM"
    family = "Gemma3Text" if gemma and cfg.num_labels else ARCHITECTURES[cfg.model_type]
    hf["architectures"] = [family + head]
    labels = len(hf.get("id2label") or {})
    if cfg.num_labels and labels != cfg.num_labels:
        # transformers counts id2label's labels
        hf["id2label"] = {str(i): f"LABEL_{i}" for i in range(cfg.num_labels)}
    if partial != 1.0 and cfg.model_type != "qwen3_5_text":  # (any family's RoPE reads it)
        hf["partial_rotary_factor"] = partial
    if cfg.model_type == "qwen2":
        hf.pop("attention_bias", None)  # implied by the family
    family_keys = ("no_rope_layers", "layer_types", "sliding_window", "query_pre_attn_scalar")
    linear = [f.name for f in fields(cfg) if f.name.startswith("linear_")]
    for key in (*family_keys, *linear):
        if hf[key] is None and key not in cfg.extra:  # another family's key
            hf.pop(key)
    return hf


# -----------------------------------------------------------------------------
# Tensors under HF's names (the one place that knows about tied embeddings)


def to_hf_names(state: dict, cfg: ModelConfig) -> dict:
    """Our state dict -> HF's names (`model.` prefix but on the head),
    contiguous; a tied lm_head is left out."""
    out = {}
    for name, t in state.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name not in ("lm_head.weight", "score.weight"):
            name = "model." + name
        out[name] = t.detach().contiguous()
    return out


def _first(names: list, n: int = 10) -> str:
    return f"{names[:n]}{' ...' if len(names) > n else ''}"


def check_tensors(ours: dict, expected: dict, implied: set, *, what: str, source: str):
    """ValueError unless `ours` has every tensor of `expected` (but the `implied` ones), no
    other, each of its shape: the error lists missing and unexpected tensors, or names the first
    shape mismatch. what: "checkpoint", "adapter"; source: what implies the expected shapes."""
    missing = sorted(set(expected) - set(ours) - implied)
    unexpected = sorted(set(ours) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{what} does not match {source}: missing tensors {_first(missing)}; "
            f"unexpected tensors {_first(unexpected)}"
        )
    for name, tensor in ours.items():
        shape, want = tuple(tensor.shape), tuple(expected[name].shape)
        if shape != want:
            raise ValueError(f"{what} tensor {name} has shape {shape}, {source} implies {want}")


def from_hf_names(state: dict, model: Transformer) -> dict:
    """HF-named tensors -> a complete state dict of `model` (a tied lm_head
    is the embedding), with an error listing missing or unexpected tensors
    and shape mismatches. Works on a meta-device model."""
    unused = UNUSED.get(model.config.model_type, ())
    ours = {
        k.removeprefix(LANGUAGE_MODEL).removeprefix("model."): v
        for k, v in state.items()
        if not k.startswith(unused)
    }
    tied = model.config.tie_word_embeddings
    if tied:
        ours.pop("lm_head.weight", None)  # some checkpoints store the tied copy too
    expected = model.state_dict()
    implied = {"lm_head.weight"} if tied else set()
    check_tensors(ours, expected, implied, what="checkpoint", source="config.json")
    if tied and "lm_head.weight" in expected:  # (a classifier has no LM head)
        ours["lm_head.weight"] = ours["embed_tokens.weight"]
    return ours
