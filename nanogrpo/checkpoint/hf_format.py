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

from nanogrpo.model import SUPPORTED_MODEL_TYPES, ModelConfig, Transformer

# config.json's architectures: the family's prefix + ForCausalLM etc.
ARCHITECTURES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
# config.json's keys that ModelConfig holds under another layout
OWN_LAYOUT = ("extra", "rope_theta", "rope_scaling", "num_labels")


# -----------------------------------------------------------------------------
# config.json <-> ModelConfig


def config_from_hf(hf: dict) -> ModelConfig:
    """ModelConfig from the dict of an HF config.json; features we do not
    implement raise ValueError."""
    check_supported(hf)
    # RoPE: transformers >= 5 writes `rope_parameters`; older checkpoints
    # `rope_theta` + `rope_scaling`
    rope = dict(hf.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = rope or hf.get("rope_scaling")
    if scaling is not None:
        scaling = dict(scaling)
        kind = scaling.pop("type", "default")
        scaling["rope_type"] = scaling.get("rope_type", kind)
        if scaling["rope_type"] == "default":
            scaling = None
    known = {f.name for f in fields(ModelConfig)} - set(OWN_LAYOUT)
    kwargs = {k: hf[k] for k in known if hf.get(k) is not None}
    architectures = [str(a) for a in hf.get("architectures") or []]
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        # counted as transformers counts them
        if hf.get("id2label"):
            kwargs["num_labels"] = len(hf["id2label"])
        else:
            kwargs["num_labels"] = hf.get("num_labels") or 2
    return ModelConfig(**kwargs, rope_theta=float(theta), rope_scaling=scaling, extra=dict(hf))


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
    bad_layers = [t for t in layer_types if t != "full_attention"]
    if bad_layers:
        raise ValueError(
            f"config.json: layer_types contains {bad_layers[0]!r}; "
            "only 'full_attention' is supported"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(
            f"config.json: hidden_act={hf['hidden_act']!r} is not supported; only 'silu' (SwiGLU)"
        )


def config_to_hf(cfg: ModelConfig) -> dict:
    """The dict to write as config.json (keeps the unknown keys of the file
    it was loaded from)."""
    hf = dict(cfg.extra)
    for f in fields(cfg):
        if f.name not in OWN_LAYOUT:
            hf[f.name] = getattr(cfg, f.name)
    if "rope_parameters" in hf:  # transformers >= 5 layout
        scaling = cfg.rope_scaling or {"rope_type": "default"}
        hf["rope_parameters"] = {"rope_theta": cfg.rope_theta, **scaling}
    else:  # the classic layout, read by every transformers and vLLM version
        hf["rope_theta"] = cfg.rope_theta
        hf["rope_scaling"] = cfg.rope_scaling
    head = "ForSequenceClassification" if cfg.num_labels else "ForCausalLM"
    hf["architectures"] = [ARCHITECTURES[cfg.model_type] + head]
    labels = len(hf.get("id2label") or {})
    if cfg.num_labels and labels != cfg.num_labels:
        # transformers counts id2label's labels
        hf["id2label"] = {str(i): f"LABEL_{i}" for i in range(cfg.num_labels)}
    if cfg.model_type == "qwen2":
        hf.pop("attention_bias", None)  # implied by the family
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


def from_hf_names(state: dict, model: Transformer) -> dict:
    """HF-named tensors -> a complete state dict of `model` (a tied lm_head
    is the embedding), with an error listing missing or unexpected tensors
    and shape mismatches. Works on a meta-device model."""
    ours = {k.removeprefix("model."): v for k, v in state.items()}
    tied = model.config.tie_word_embeddings
    if tied:
        ours.pop("lm_head.weight", None)  # some checkpoints store the tied copy too
    expected = model.state_dict()
    implied = {"lm_head.weight"} if tied else set()
    missing = sorted(set(expected) - set(ours) - implied)
    unexpected = sorted(set(ours) - set(expected))
    if missing or unexpected:
        raise ValueError(
            "checkpoint does not match its config.json: "
            f"missing tensors {_first(missing)}; "
            f"unexpected tensors {_first(unexpected)}"
        )
    for name, tensor in ours.items():
        shape = tuple(tensor.shape)
        want = tuple(expected[name].shape)
        if shape != want:
            raise ValueError(
                f"checkpoint tensor {name} has shape {shape}, config.json implies {want}"
            )
    if tied and "lm_head.weight" in expected:  # (a classifier has no LM head)
        ours["lm_head.weight"] = ours["embed_tokens.weight"]
    return ours
