"""A run's checkpoint: out_dir/checkpoint-<step>/ holds the policy as a
Hugging Face checkpoint (or its PEFT adapter), the tokenizer,
train_config.json and trainer/ (the optimizer and trainer_state.json);
out_dir/checkpoint links to the newest.

Owns: `save_checkpoint` (written under a temporary name, renamed when
complete, then the link swapped), `prune_checkpoints` (save_total_limit),
what a checkpoint needs to be resumed, whole (`unresumable`), the optimizer's files
(`save_optimizer`) and `load_trainer_state`.

Does not know about: the model's file format (checkpoint/__init__.py writes
it), what the trainer state holds (run/__init__.py's save decides), or the
GRPO math.

With several processes rank 0 writes every file; the gathering and barriers
are dist/__init__.py's and torch.distributed's.

Choices:
- No pickle: the trainer state and the optimizer's settings are JSON, its
  tensors safetensors, so a checkpoint cannot run code.
- The optimizer is saved whole (gathered to rank 0's CPU under FSDP2, as
  the weights are) and keyed by parameter name, as one process holds it:
  a checkpoint written by N processes resumes on M.
"""

import json
import os
import shutil
from contextlib import suppress

import torch

from nanogrpo import checkpoint, dist


def save_checkpoint(
    out_dir,
    step: int,
    model,
    optimizer,
    tokenizer,
    trainer_state: dict,
    train_config: dict,
    info: dist.DistInfo,
) -> str:
    """Write out_dir/checkpoint-<step> (the policy or its LoRA adapter,
    tokenizer, train_config.json, trainer/: optimizer, `trainer_state`) under
    a temporary name, rename it, then swap the `checkpoint` link to it."""
    step_dir = os.path.join(out_dir, f"checkpoint-{step}")
    tmp = step_dir + ".tmp"
    state, adapter = checkpoint.state_to_write(model)
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # left over from a crash
        os.makedirs(os.path.join(tmp, "trainer"))
    try:
        if info.is_main:
            checkpoint.write_model(
                tmp,
                model.config,
                state,
                generation_config=model.generation_config,
                tokenizer=tokenizer,
                adapter=adapter,
            )
            checkpoint.write_json(os.path.join(tmp, "train_config.json"), train_config)
            state_file = os.path.join(tmp, "trainer", "trainer_state.json")
            checkpoint.write_json(state_file, trainer_state)
        save_optimizer(os.path.join(tmp, "trainer"), model, optimizer, info)
        dist.barrier()
    except BaseException as e:
        if info.is_main:
            checkpoint._remove_partial(tmp, step_dir, e)
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


def prune_checkpoints(
    out_dir, written: list[str], limit: int | None, keep: str | None = None
) -> list[str]:
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


# What a checkpoint holds, beside the model's files: all of it is needed
# to resume.
RUN_STATE_FILES = [
    "train_config.json",
    "trainer/trainer_state.json",
    "trainer/optimizer.json",
    "trainer/optimizer.safetensors",
]
# the one-process optimizer file of older checkpoints: tensors and plain
# numbers, read with torch.load(weights_only=True), which runs no code
LEGACY_OPTIMIZER = "trainer/optimizer.pt"
# torch.optim's flags for how a step is computed, not what it computes:
# the resuming run's own stay (fused AdamW on one process, not on FSDP2).
IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable")


def unresumable(ckpt_dir) -> str | None:
    """Why ckpt_dir cannot be resumed ("no trainer/optimizer.json",
    "model.safetensors is truncated ..."), or None when it holds, whole,
    everything load_trainer_state and the model loader read. Cheap: the
    JSON files are parsed, of a safetensors file only its header is read
    (damaged: what a save killed mid-write or a full disk leaves)."""
    if not os.path.isdir(ckpt_dir):
        return "no such directory"

    def has(name):
        return os.path.exists(os.path.join(ckpt_dir, name))

    if has("adapter_config.json"):
        model_files = ["adapter_config.json", "adapter_model.safetensors"]
    elif has("model.safetensors.index.json"):
        model_files = ["config.json", "model.safetensors.index.json"]
    else:
        model_files = ["config.json", "model.safetensors"]
    files = RUN_STATE_FILES
    if has(LEGACY_OPTIMIZER):  # an older one-process checkpoint
        files = [f for f in files if not f.startswith("trainer/optimizer.")]
    for name in model_files + files:
        if not has(name):
            return f"no {name}"
    for name in model_files + files:
        problem = damaged(ckpt_dir, name)
        if problem:
            return problem
    if has("model.safetensors.index.json"):
        index = checkpoint.read_json(os.path.join(ckpt_dir, "model.safetensors.index.json"))
        for name in sorted(set(index.get("weight_map", {}).values())):
            if not has(name):
                return f"no {name} (model.safetensors.index.json names it)"
            problem = damaged(ckpt_dir, name)
            if problem:
                return problem
    return None


def damaged(ckpt_dir, name: str) -> str | None:
    """Why the file `name` of ckpt_dir is not whole, or None: a JSON file
    must parse, a safetensors file must be as long as its header says."""
    path = os.path.join(ckpt_dir, name)
    if name.endswith(".json"):
        try:
            checkpoint.read_json(path)
        except ValueError:
            return f"{name} is not valid JSON (cut short?)"
        return None
    if name.endswith(".safetensors"):
        problem = safetensors_problem(path)
        return f"{name} is {problem}" if problem else None
    return None


def safetensors_problem(path) -> str | None:
    """What is wrong with a .safetensors file, from its header alone, or
    None. The format: 8 bytes (little-endian) N, N bytes of JSON mapping
    each tensor to its data_offsets [begin, end) in the data that follows:
    a whole file is 8 + N + the largest end bytes long."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"truncated ({size} bytes: not even its header's length)"
        n = int.from_bytes(head, "little")
        if 8 + n > size:
            return f"truncated ({size} bytes: its header alone needs {8 + n})"
        text = f.read(n)
    try:
        header = json.loads(text)
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return "corrupt (its header is not a safetensors header)"
    expected = 8 + n + max(ends, default=0)
    if size < expected:
        return f"truncated ({size} bytes, its header describes {expected})"
    if size > expected:
        return f"corrupt ({size} bytes, its header describes {expected})"
    return None


def save_optimizer(path, model, optimizer, info: dist.DistInfo):
    """The optimizer's whole state, keyed by parameter name (every rank
    calls it: under FSDP2 it gathers to rank 0, which writes):
    optimizer.safetensors holds its tensors ("<param>.<field>", e.g.
    "layers.0.mlp.up_proj.weight.exp_avg"), optimizer.json its
    param_groups and any field that is not a tensor."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_optimizer_state_dict(model, optimizer, options=options)
    if not info.is_main:
        return  # {} here: rank 0 holds the gathered state
    tensors = {}
    others = {}  # {param: {field: value}} of fields that are not tensors
    for name, fields in state["state"].items():
        for key, value in fields.items():
            if torch.is_tensor(value):
                tensors[f"{name}.{key}"] = value.detach().cpu().contiguous()
            else:
                others.setdefault(name, {})[key] = value
    save_file(tensors, os.path.join(path, "optimizer.safetensors"))
    layout = {"param_groups": state["param_groups"], "state": others}
    checkpoint.write_json(os.path.join(path, "optimizer.json"), layout)


def read_optimizer(path) -> dict:
    """save_optimizer's files -> the optimizer state dict keyed by
    parameter name (torch.distributed.checkpoint.state_dict's layout)."""
    layout = checkpoint.read_json(os.path.join(path, "optimizer.json"))
    tensors = checkpoint.read_safetensors(path, file="optimizer.safetensors")
    state = layout["state"]
    for key, value in tensors.items():
        name, field = key.rsplit(".", 1)
        state.setdefault(name, {})[field] = value
    return {"state": state, "param_groups": layout["param_groups"]}


def load_optimizer(path, model, optimizer, info: dist.DistInfo):
    """Fill `optimizer` from save_optimizer's files in `path`, saved by any
    number of processes. Under FSDP2 rank 0 reads them and each tensor is
    broadcast and cut into this run's shards (every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    state = {"state": {}, "param_groups": None}  # ranks > 0: rank 0 sends
    if info.is_main:
        state = read_optimizer(path)
    state["param_groups"] = dist.broadcast_object(state["param_groups"])
    for saved, group in zip(state["param_groups"], optimizer.param_groups):
        saved.update({k: group[k] for k in IMPLEMENTATION if k in group})
    options = None
    if info.sharded:
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_optimizer_state_dict(model, optimizer, state, options=options)


def load_trainer_state(ckpt_dir, model, optimizer, info: dist.DistInfo) -> dict:
    """Restore the optimizer from ckpt_dir/trainer and return the trainer
    state. Never unpickles: a checkpoint cannot run code."""
    path = os.path.join(ckpt_dir, "trainer")
    legacy = os.path.join(ckpt_dir, LEGACY_OPTIMIZER)
    if os.path.exists(os.path.join(path, "optimizer.json")) or not os.path.exists(legacy):
        load_optimizer(path, model, optimizer, info)
    elif info.sharded:
        raise ValueError(
            f"{ckpt_dir} holds a one-process optimizer in the older format "
            f"({LEGACY_OPTIMIZER}): resume it on one process"
        )
    else:
        optimizer.load_state_dict(torch.load(legacy, weights_only=True))
    return checkpoint.read_json(os.path.join(path, "trainer_state.json"))
