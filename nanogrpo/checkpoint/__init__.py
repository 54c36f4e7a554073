"""Hugging Face model checkpoints on disk: read and write them.

Owns: hub-id/path resolution, safetensors (one file or shards + index), `load_model` /
`save_model` (one process or FSDP2; a model with adapters as PEFT's adapter files, through the
`AdapterFormat` registered here) and atomic directories. What config.json and the tensor names
mean is checkpoint/hf_format.py's; a run's checkpoint-<step>/ around these files is
run/checkpoints.py's.

Does not know about: the forward pass (model.py), tokenization (a tokenizer it is given saves
itself), GRPO, the run, or LoRA (extras/lora.py registers its adapter format when imported).

With several processes it decides which rank reads and writes (rank 0) and where all must wait;
the collectives themselves are distributed/__init__.py's (barrier, broadcast, sharding, gathering a
state dict).

Choices:
- Loading builds on the meta device and assigns each tensor once; under FSDP2 rank 0 reads and
  the shards are filled by broadcast.
- Directories are written under a temporary name and renamed when complete: a crash leaves the
  old one intact and no half-written one.
- An option plugs in here, never the other way round: the adapter format is registered by the
  module that defines the adapters, and an adapter directory loaded before it is an error naming
  the import, not the base model alone.
"""

import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch

from nanogrpo import distributed as dist
from nanogrpo.checkpoint.hf_format import (
    UNUSED,
    config_from_hf,
    config_to_hf,
    from_hf_names,
    to_hf_names,
)
from nanogrpo.model import ModelConfig, Transformer

HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt"]
SHARD_BYTES = 5 * 2**30  # transformers' default max_shard_size

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
        raise NotADirectoryError(
            f"{path!r} is a file; a checkpoint is a directory (config.json, *.safetensors)"
        )
    looks_local = path.startswith((".", "/", "~")) or path.count("/") != 1
    if looks_local or os.path.isdir(path.split("/")[0]):
        raise FileNotFoundError(
            f"no such directory: {path!r} (and it is not a hub id like 'Qwen/Qwen2.5-0.5B')"
        )
    from huggingface_hub import snapshot_download

    return snapshot_download(path, allow_patterns=HUB_FILES)


def read_json(path) -> dict:
    """A JSON file's contents, with errors that name the file and what is
    wrong with it."""
    try:
        with open(path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON (truncated or corrupt?): {e}") from None


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)


DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
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
# Tensor files


def read_safetensors(path, dtype=None, device="cpu", file=None, skip=()) -> dict:
    """Every tensor of a checkpoint directory (one file or shards), or of its
    `file`, as `dtype` on `device`; names starting with one of `skip` are not read."""
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
                    if key.startswith(tuple(skip)):
                        continue
                    state[key] = f.get_tensor(key).to(device=device, dtype=dtype)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{file} cannot be read (truncated or corrupt?): {e}") from None
    return state


def write_safetensors(
    out_dir, state: dict, max_shard_bytes: int = SHARD_BYTES, name="model.safetensors"
):
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
        weight_map = {key: fname for fname, shard in zip(names, shards) for key in shard}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        write_json(os.path.join(out_dir, "model.safetensors.index.json"), index)


# -----------------------------------------------------------------------------
# Adapters: the format the option that defines them registers


@dataclass(frozen=True)
class AdapterFormat:
    """What load_model and save_model call to put adapters on a model and to take their tensors
    off it, our tensor names throughout; the files (adapter_config.json,
    adapter_model.safetensors) are this module's. extras/lora.py registers PEFT's LoRA."""

    settings: Callable  # (adapter_config.json's dict, its directory) -> `apply`'s keywords
    apply: Callable  # (model on the meta device, **keywords): the adapters on, the rest frozen
    fresh: Callable  # (model, dtype, device) -> a newly initialised adapter's tensors
    from_file: Callable  # (the adapter file's tensors, model) -> ours, checked against the model
    finish: Callable  # (model, base state) once its tensors are in: what trains, frozen copies
    config_of: Callable  # model -> adapter_config.json's dict, or None without adapters
    is_key: Callable  # (state-dict key, modules_to_save) -> whether the adapter file holds it
    to_file: Callable  # (state dict, adapter_config.json's dict) -> the adapter file's tensors


_adapter_format = None  # the registered AdapterFormat; None until its module is imported


def register_adapter(adapter_format: AdapterFormat):
    """Let load_model and save_model read and write adapters of this format (one format: a
    second registration replaces the first)."""
    global _adapter_format
    _adapter_format = adapter_format


def registered_adapter(what: str) -> AdapterFormat:
    """The registered AdapterFormat. None registered is an error, one line, naming `what` needs
    it and the import that registers it."""
    if _adapter_format is None:
        raise RuntimeError(
            f"{what} needs the LoRA adapter format, which is not registered: import "
            "nanogrpo.extras.lora first (importing it registers the format with the loader)"
        )
    return _adapter_format


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
            raise FileExistsError(f"{out_dir} exists and is not a directory; not replacing it")
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
        raise OSError(
            errno.ENOSPC,
            f"no space left on device while writing "
            f"{target}; the partial copy was removed, the previous "
            "one is intact",
        ) from error


def load_model(
    path_or_hub_id,
    dtype=torch.float32,
    device="cpu",
    info: dist.DistInfo | None = None,
    mixed_precision: bool = False,
    lora_settings: dict | None = None,
) -> Transformer:
    """Load an HF checkpoint (local dir or hub id) straight into `dtype` on
    `device`; `lora_settings` (the registered AdapterFormat's keywords:
    extras/lora.py's apply_lora) put a fresh adapter on it. A directory with
    adapter_config.json is a PEFT adapter: its base_model_name_or_path is
    loaded with the adapter on it (as PEFT's AutoPeftModel); without a
    registered format that is an error. With `info` of more than one
    process, the model is sharded with FSDP2 (dist.shard_model) and filled
    from rank 0's copy; `mixed_precision` then makes its blocks compute in
    bf16."""
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
        lora_settings = registered_adapter(f"{path} (a PEFT adapter)").settings(peft, path)
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
        skip = UNUSED.get(config.model_type, ())  # e.g. a vision tower
        base = from_hf_names(read_safetensors(path, dtype, where, skip=skip), model)
    full = base
    if lora_settings:
        adapter_format = registered_adapter("load_model(lora_settings=...)")
        adapter_format.apply(model, **lora_settings)
        if sharded and adapter_format.config_of(model)["modules_to_save"]:
            raise ValueError(
                "lora_modules_to_save is not supported with FSDP2 (more than one process) yet"
            )
        if main:  # the adapter's tensors, or a fresh adapter (rank 0's, broadcast when sharded)
            tensors = _adapter_tensors(adapter_format, model, adapter, dtype, where)
            full = {**base, **tensors}
    if sharded:
        dist.shard_model(model, info, mixed_precision)
        model.to_empty(device=info.device)
        dist.fill_from_rank0(model, full)
    else:
        model.load_state_dict(full, strict=True, assign=True)
        model.tie_weights()
    if lora_settings:
        # frozen base copies of modules_to_save, for disable_adapters
        adapter_format.finish(model, base)
        model.base_model_name_or_path = base_name
    gen_path = os.path.join(path, "generation_config.json")
    model.generation_config = None
    if os.path.exists(gen_path):
        model.generation_config = read_json(gen_path)
    model.name_or_path = str(path_or_hub_id)
    return model


def _adapter_tensors(adapter_format, model, adapter, dtype, where) -> dict:
    """The adapter's tensors (our names) read from the PEFT directory
    `adapter`, or a freshly initialised adapter when it is None."""
    if adapter is None:
        return adapter_format.fresh(model, dtype, where)
    file = "adapter_model.safetensors"
    return adapter_format.from_file(read_safetensors(adapter, dtype, where, file), model)


def write_model(
    out_dir,
    cfg: ModelConfig,
    state: dict,
    generation_config=None,
    tokenizer=None,
    max_shard_bytes: int = SHARD_BYTES,
    adapter: dict | None = None,
):
    """Write config.json, safetensors, generation_config.json and the
    tokenizer into the directory out_dir; `state`: a full state dict, our
    names. With `adapter` (adapter_config.json's dict): only its tensors, as
    PEFT."""
    if adapter is not None:
        write_json(os.path.join(out_dir, "adapter_config.json"), adapter)
        tensors = registered_adapter("writing an adapter").to_file(state, adapter)
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


def save_model(
    model, out_dir, tokenizer=None, generation_config=None, max_shard_bytes: int = SHARD_BYTES
):
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
    """What a save writes: (the full state dict, or with adapters only the
    adapter's tensors; adapter_config's dict or None)."""
    adapter_format = _adapter_format
    adapter = None  # (no format registered: no model has adapters)
    if adapter_format is not None:
        adapter = adapter_format.config_of(model)
    keep = None  # every tensor
    if adapter is not None:
        saved = adapter["modules_to_save"]
        keep = partial(adapter_format.is_key, modules_to_save=saved)
    return dist.full_state_dict(model, keep), adapter
