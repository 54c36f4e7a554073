"""Everything that lives on disk: Hugging Face model checkpoints and trainer checkpoints.

Owns: hub-id/path resolution, config.json <-> ModelConfig, safetensors (one
file or shards + index), `load_model` / `save_model` (one process or FSDP2; a
LoRA model as PEFT's adapter files, names from lora.py), atomic directories,
the trainer checkpoint (`checkpoint-<step>/`, the `checkpoint` link, pruning).

Does not know about: the network's arithmetic (model.py) or GRPO. With several
processes it decides which rank reads and writes (rank 0, or every rank its
optimizer shard) and where all must wait; the collectives themselves are
dist.py's (barrier, broadcast, sharding, gathering a state dict), and the
sharded optimizer goes through torch.distributed.checkpoint.

Choices:
- Our tensor names are HF's without `model.`. Tied embeddings are ONE rule
  (`to_hf_names` / `from_hf_names`): the tied lm_head is never written and on
  load it is the embedding.
- Loading builds on the meta device and assigns each tensor once; under FSDP2
  rank 0 reads and the shards are filled by broadcast. Directories are written
  under a temporary name and renamed when complete. No pickle: trainer state
  is JSON, the optimizer loads weights_only.
"""

import errno
import json
import os
import shutil
import tempfile
from contextlib import contextmanager, suppress
from dataclasses import fields
from functools import partial

import torch

from nanogrpo import dist, lora
from nanogrpo.model import SUPPORTED_MODEL_TYPES, ModelConfig, Transformer

HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt"]
# config.json's architectures: the family's prefix + ForCausalLM etc.
ARCHITECTURES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2",
                 "qwen3": "Qwen3"}
SHARD_BYTES = 5 * 2**30  # transformers' default max_shard_size
# config.json's keys that ModelConfig holds under another layout
OWN_LAYOUT = ("extra", "rope_theta", "rope_scaling", "num_labels")

# -----------------------------------------------------------------------------
# Paths, JSON, dtypes


def resolve_path(path_or_hub_id) -> str:
    """A local directory as is; a hub id ('Qwen/Qwen2.5-0.5B') is downloaded
    (config, weights, tokenizer) and its local snapshot returned. A path that
    looks local but does not exist is an error."""
    path = str(path_or_hub_id)
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise NotADirectoryError(f"{path!r} is a file; a checkpoint is a "
                                 "directory (config.json, *.safetensors)")
    looks_local = path.startswith((".", "/", "~")) or path.count("/") != 1
    if looks_local or os.path.isdir(path.split("/")[0]):
        raise FileNotFoundError(f"no such directory: {path!r} (and it is not "
                                "a hub id like 'Qwen/Qwen2.5-0.5B')")
    from huggingface_hub import snapshot_download
    return snapshot_download(path, allow_patterns=HUB_FILES)


def read_json(path) -> dict:
    """A JSON file's contents, with errors that name the file and what is
    wrong with it."""
    try:
        with open(path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON (truncated or corrupt?): "
                         f"{e}") from None


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)


DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
    "float64": torch.float64,
}


def parse_dtype(dtype) -> torch.dtype:
    """torch.dtype from a dtype or a name like "bfloat16"/"bf16"/"float32"."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype={dtype!r} is not known; use one of {sorted(DTYPES)}")


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
    return ModelConfig(**kwargs, rope_theta=float(theta),
                       rope_scaling=scaling, extra=dict(hf))


def check_supported(hf: dict):
    """ValueError naming the first feature of config.json we do not implement."""
    model_type = hf.get("model_type")
    families = ", ".join(SUPPORTED_MODEL_TYPES)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"config.json: model_type={model_type!r} is not "
                         f"supported; supported: {families}")
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if hf.get(key):
            raise ValueError(f"config.json: {key}={hf[key]} (mixture of "
                             f"experts) is not supported; only dense "
                             f"{families} models are")
    window = hf.get("sliding_window")
    if window and (model_type == "mistral" or hf.get("use_sliding_window")):
        raise ValueError(f"config.json: sliding_window={window} (sliding-"
                         "window attention) is not supported; only full "
                         "attention is (set sliding_window to null)")
    layer_types = hf.get("layer_types") or []
    bad_layers = [t for t in layer_types if t != "full_attention"]
    if bad_layers:
        raise ValueError(f"config.json: layer_types contains {bad_layers[0]!r}; "
                         "only 'full_attention' is supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act={hf['hidden_act']!r} is not "
                         "supported; only 'silu' (SwiGLU)")


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
        raise ValueError("checkpoint does not match its config.json: "
                         f"missing tensors {_first(missing)}; "
                         f"unexpected tensors {_first(unexpected)}")
    for name, tensor in ours.items():
        shape = tuple(tensor.shape)
        want = tuple(expected[name].shape)
        if shape != want:
            raise ValueError(f"checkpoint tensor {name} has shape {shape}, "
                             f"config.json implies {want}")
    if tied and "lm_head.weight" in expected:  # (a classifier has no LM head)
        ours["lm_head.weight"] = ours["embed_tokens.weight"]
    return ours


def read_safetensors(path, dtype=None, device="cpu", file=None) -> dict:
    """Every tensor of a checkpoint directory (one file or shards), or of its
    `file`, as `dtype` on `device`."""
    from safetensors import SafetensorError, safe_open
    index = os.path.join(path, "model.safetensors.index.json")
    if file is None and os.path.exists(index):
        files = sorted(set(read_json(index)["weight_map"].values()))
    elif os.path.exists(os.path.join(path, file or "model.safetensors")):
        files = [file or "model.safetensors"]
    else:
        wanted = file or "model.safetensors or model.safetensors.index.json"
        raise FileNotFoundError(f"no {wanted} in {path}")
    state = {}
    for name in files:
        file = os.path.join(path, name)
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for key in f.keys():
                    state[key] = f.get_tensor(key).to(device=device, dtype=dtype)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{file} cannot be read (truncated or corrupt?): "
                             f"{e}") from None
    return state


def write_safetensors(out_dir, state: dict, max_shard_bytes: int = SHARD_BYTES,
                      name="model.safetensors"):
    """`name` (model.safetensors), or shards of at most max_shard_bytes +
    model.safetensors.index.json."""
    from safetensors.torch import save_file
    shards = [{}]
    size = 0  # bytes in the last shard
    for key, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor.cpu()
        size += nbytes
    n = len(shards)
    if n == 1:
        names = [name]
    else:
        names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for fname, shard in zip(names, shards):
        save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
    if n > 1:
        total = sum(t.numel() * t.element_size() for t in state.values())
        weight_map = {key: fname for fname, shard in zip(names, shards)
                      for key in shard}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        write_json(os.path.join(out_dir, "model.safetensors.index.json"), index)


# -----------------------------------------------------------------------------
# Models, in directories written atomically


@contextmanager
def atomic_dir(out_dir):
    """Yield a temporary directory beside `out_dir`; on success it replaces
    `out_dir` in one rename. A crash or Ctrl-C inside leaves the old `out_dir`
    untouched and no half-written one; a full disk says so."""
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    prefix = os.path.basename(out_dir) + ".tmp-"
    tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        yield tmp
        if os.path.isdir(out_dir) and not os.path.islink(out_dir):
            os.rename(out_dir, tmp + ".old")
            os.rename(tmp, out_dir)
            shutil.rmtree(tmp + ".old")
        elif os.path.lexists(out_dir):
            raise FileExistsError(f"{out_dir} exists and is not a directory; "
                                  "not replacing it")
        else:
            os.rename(tmp, out_dir)
    except BaseException as e:
        _remove_partial(tmp, out_dir, e)
        raise


def _remove_partial(tmp, target, error):
    """Delete a half-written `tmp`; a full disk is re-raised as a message
    that says so."""
    shutil.rmtree(tmp, ignore_errors=True)
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        raise OSError(errno.ENOSPC, f"no space left on device while writing "
                      f"{target}; the partial copy was removed, the previous "
                      "one is intact") from error


def load_model(path_or_hub_id, dtype=torch.float32, device="cpu",
               info: dist.DistInfo | None = None, mixed_precision: bool = False,
               lora_settings: dict | None = None) -> Transformer:
    """Load an HF checkpoint (local dir or hub id) straight into `dtype` on
    `device`; `lora_settings` (lora.apply_lora's keywords) put a fresh LoRA
    adapter on it. A directory with adapter_config.json is a PEFT adapter:
    its base_model_name_or_path is loaded with the adapter on it (as PEFT's
    AutoPeftModel). With `info` of more than one process, the model is
    sharded with FSDP2 (dist.shard_model) and filled from rank 0's copy;
    `mixed_precision` then makes its blocks compute in bf16."""
    sharded = info is not None and info.sharded
    main = not sharded or info.is_main  # this rank reads the files
    path = dist.broadcast_object(resolve_path(path_or_hub_id) if main else None)
    adapter = None  # the PEFT adapter directory, if path is one
    if os.path.isdir(str(path_or_hub_id)):
        base_name = os.path.abspath(path)
    else:
        base_name = str(path_or_hub_id)
    if os.path.exists(os.path.join(path, "adapter_config.json")):
        adapter = path
        peft = read_json(os.path.join(path, "adapter_config.json"))
        lora_settings = lora.settings_from_peft_config(peft, path)
        base_name = peft["base_model_name_or_path"]
        path = dist.broadcast_object(resolve_path(base_name) if main else None)
    with torch.device("meta"):
        config = config_from_hf(read_json(os.path.join(path, "config.json")))
        model = Transformer(config)
    if sharded:  # rank 0 reads fp32 on its CPU, FSDP2 shards onto the devices
        dtype = torch.float32
        where = "cpu"
    else:
        dtype = parse_dtype(dtype)
        where = device
    base = {}
    if main:
        base = from_hf_names(read_safetensors(path, dtype, where), model)
    full = base
    if lora_settings:
        lora.apply_lora(model, **lora_settings)
        if sharded and model.lora_config["modules_to_save"]:
            raise ValueError("lora_modules_to_save is not supported with FSDP2 "
                             "(more than one process) yet")
        if main:  # the adapter's tensors, or a fresh adapter (rank 0's, broadcast when sharded)
            full = {**base, **_adapter_tensors(model, adapter, dtype, where)}
    if sharded:
        dist.shard_model(model, info, mixed_precision)
        model.to_empty(device=info.device)
        dist.fill_from_rank0(model, full)
    else:
        model.load_state_dict(full, strict=True, assign=True)
        model.tie_weights()
    if lora_settings:
        # frozen base copies of modules_to_save, for disable_adapters
        lora.mark_trainable(model, base)
        model.base_model_name_or_path = base_name
    gen_path = os.path.join(path, "generation_config.json")
    model.generation_config = None
    if os.path.exists(gen_path):
        model.generation_config = read_json(gen_path)
    model.name_or_path = str(path_or_hub_id)
    return model


def _adapter_tensors(model, adapter, dtype, where) -> dict:
    """The adapter's tensors (our names) read from the PEFT directory
    `adapter`, or a freshly initialised adapter when it is None."""
    if adapter is None:
        return lora.fresh_adapter_state(model, dtype, where)
    file = "adapter_model.safetensors"
    return lora.from_peft_state(read_safetensors(adapter, dtype, where, file), model)


def write_model(out_dir, cfg: ModelConfig, state: dict, generation_config=None,
                tokenizer=None, max_shard_bytes: int = SHARD_BYTES,
                adapter: dict | None = None):
    """Write config.json, safetensors, generation_config.json and the
    tokenizer into the directory out_dir; `state`: a full state dict, our
    names. With `adapter` (adapter_config.json's dict): only its tensors, as
    PEFT."""
    if adapter is not None:
        write_json(os.path.join(out_dir, "adapter_config.json"), adapter)
        tensors = lora.adapter_state(state, adapter)
        write_safetensors(out_dir, tensors, name="adapter_model.safetensors")
    else:
        hf_state = to_hf_names(state, cfg)
        hf = config_to_hf(cfg)
        dtypes = {v.dtype for v in hf_state.values()}
        hf["torch_dtype"] = "float32"  # of a mixed-dtype state
        if len(dtypes) == 1:
            hf["torch_dtype"] = str(dtypes.pop()).removeprefix("torch.")
        if "dtype" in hf:  # transformers >= 5 spells it `dtype`
            hf["dtype"] = hf["torch_dtype"]
        write_json(os.path.join(out_dir, "config.json"), hf)
        write_safetensors(out_dir, hf_state, max_shard_bytes)
    if generation_config:
        path = os.path.join(out_dir, "generation_config.json")
        write_json(path, generation_config)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)


def save_model(model, out_dir, tokenizer=None, generation_config=None,
               max_shard_bytes: int = SHARD_BYTES):
    """Save `model` (plain or FSDP2-sharded: every rank calls it, rank 0
    writes) as an HF checkpoint directory, atomically. With LoRA adapters:
    the adapter, in PEFT's files (merge_lora first for a full checkpoint)."""
    sharded = bool(dist.fsdp_modules(model))
    state, adapter = state_to_write(model)
    if not sharded or dist.rank() == 0:
        with atomic_dir(out_dir) as tmp:
            write_model(
                tmp,
                model.config,
                state,
                generation_config=generation_config or model.generation_config,
                tokenizer=tokenizer,
                max_shard_bytes=max_shard_bytes,
                adapter=adapter,
            )
    if sharded:  # (a plain model may be saved by one rank alone)
        dist.barrier()


def state_to_write(model) -> tuple[dict, dict | None]:
    """What a save writes: (the full state dict, or with LoRA only the
    adapter's tensors; adapter_config's dict or None)."""
    adapter = lora.peft_config_of(model)
    keep = None  # every tensor
    if adapter is not None:
        saved = adapter["modules_to_save"]
        keep = partial(lora.is_adapter_key, modules_to_save=saved)
    return dist.full_state_dict(model, keep), adapter


# -----------------------------------------------------------------------------
# Trainer checkpoints: out_dir/checkpoint-<step>/
#   {HF model or adapter files, train_config.json, trainer/}


def save_checkpoint(out_dir, step: int, model, optimizer, tokenizer,
                    trainer_state: dict, train_config: dict,
                    info: dist.DistInfo) -> str:
    """Write out_dir/checkpoint-<step> (the policy or its LoRA adapter,
    tokenizer, train_config.json, trainer/: optimizer, `trainer_state`) under
    a temporary name, rename it, then swap the `checkpoint` link to it."""
    step_dir = os.path.join(out_dir, f"checkpoint-{step}")
    tmp = step_dir + ".tmp"
    state, adapter = state_to_write(model)
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # left over from a crash
        os.makedirs(os.path.join(tmp, "trainer"))
    dist.barrier()
    try:
        if info.is_main:
            write_model(tmp, model.config, state,
                        generation_config=model.generation_config,
                        tokenizer=tokenizer, adapter=adapter)
            write_json(os.path.join(tmp, "train_config.json"), train_config)
            state_file = os.path.join(tmp, "trainer", "trainer_state.json")
            write_json(state_file, trainer_state)
        save_optimizer(os.path.join(tmp, "trainer"), model, optimizer, info)
        dist.barrier()
    except BaseException as e:
        if info.is_main:
            _remove_partial(tmp, step_dir, e)
        raise
    if info.is_main:
        shutil.rmtree(step_dir, ignore_errors=True)
        os.rename(tmp, step_dir)
        _point_link(os.path.join(out_dir, "checkpoint"), step_dir)
    dist.barrier()
    return step_dir


def _point_link(link, target):
    """Make the symlink `link` point at `target` (a sibling), atomically:
    readers see the old or the new checkpoint."""
    with suppress(FileNotFoundError):
        os.remove(link + ".tmp")  # left over from a crash
    os.symlink(os.path.basename(target), link + ".tmp")
    os.replace(link + ".tmp", link)


def prune_checkpoints(out_dir, written: list[str], limit: int | None,
                      keep: str | None = None) -> list[str]:
    """Delete the oldest checkpoints of `written` (names this run wrote,
    oldest first) beyond the newest `limit` (None = keep all); `keep` (the
    resume source) is never deleted. Returns what remains."""
    if limit is None or len(written) <= limit:
        return written
    keep_real = os.path.realpath(keep) if keep else None
    remaining = list(written[-limit:])
    for name in reversed(written[:-limit]):
        path = os.path.join(out_dir, name)
        if os.path.realpath(path) == keep_real:
            remaining.insert(0, name)
        else:
            shutil.rmtree(path, ignore_errors=True)
    return remaining


def save_optimizer(path, model, optimizer, info: dist.DistInfo):
    """Optimizer state: sharded with torch.distributed.checkpoint (every rank
    writes its shard), or one optimizer.pt (tensors and plain numbers only,
    so it loads with weights_only=True)."""
    if info.sharded:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
        dcp.save(state, checkpoint_id=os.path.join(path, "optimizer"))
    else:
        torch.save(optimizer.state_dict(), os.path.join(path, "optimizer.pt"))


def load_trainer_state(ckpt_dir, model, optimizer, info: dist.DistInfo) -> dict:
    """Restore the optimizer from ckpt_dir/trainer and return the trainer
    state (same world size). Never unpickles: a checkpoint cannot run code."""
    path = os.path.join(ckpt_dir, "trainer")
    if info.sharded:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_optimizer_state_dict, set_optimizer_state_dict)
        state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=os.path.join(path, "optimizer"))
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
    else:
        file = os.path.join(path, "optimizer.pt")
        try:
            optimizer.load_state_dict(torch.load(file, weights_only=True))
        except Exception as e:
            raise ValueError(f"{file} cannot be loaded as plain tensors "
                             "(corrupt, or it holds pickled code, which is "
                             f"refused): {e}") from None
    return read_json(os.path.join(path, "trainer_state.json"))
