"""A run's checkpoint: out_dir/checkpoint-<step>/ holds the policy as a
Hugging Face checkpoint (or its PEFT adapter), the tokenizer,
train_config.json and trainer/ (the optimizer, trainer_state.json and, with
sync_ref_model, the synced reference model); out_dir/checkpoint links to the newest.

Owns: `save_checkpoint` (written under a temporary name, renamed when
complete, then the link swapped; a write that fails is `SaveFailed`, one line),
`prune_checkpoints` (save_total_limit), what a checkpoint needs to be resumed,
whole (`unresumable`), the optimizer's files (`save_optimizer`, `load_optimizer`),
the reference model's (`save_ref_model`, `load_ref_model`) and `load_trainer_state`.

Does not know about: the model's file format (checkpoint/__init__.py writes
it), what the trainer state holds (run/__init__.py's save decides), or the
GRPO math.

With several processes rank 0 writes the model and the JSON files (the
weights gathered by distributed/__init__.py) and every rank writes its own shard
of the optimizer, all into rank 0's temporary directory, which rank 0
renames once every rank is done: out_dir must be one filesystem every rank
sees.

Choices:
- No pickle: the trainer state and the optimizer's settings are JSON, its
  tensors safetensors, so a checkpoint cannot run code.
- The optimizer is saved per process (trainer/optimizer-rank<r>-of-<N>.safetensors,
  FSDP2's dim-0 shards as each rank holds them; no rank gathers more than
  its own) and keyed by parameter name, with optimizer.json saying which rows
  each file holds: a checkpoint written by N processes resumes on M, each
  rank reading only the rows of its new shards. The single
  trainer/optimizer.safetensors of older checkpoints (and the older
  trainer/optimizer.pt, on one process) still load.
- sync_ref_model's reference is saved the same way (trainer/ref_model-rank<r>-of-<N>.safetensors,
  trainer/ref_model.json): it is no function of the policy's weights (a mix of the policy at each
  sync), so without it a resume could not be exact. Without sync_ref_model the reference is the
  initial model and is not saved.
"""

import json
import os
import shutil
from contextlib import ExitStack, suppress

import torch

from nanogrpo import checkpoint, distributed as dist


class SaveFailed(OSError):
    """A checkpoint could not be written (a full disk, no permission): the
    message, one line, names the checkpoint and the cause. What was written
    of it is removed; the previous checkpoint and the link are untouched."""


def save_checkpoint(
    out_dir,
    step: int,
    model,
    optimizer,
    *,
    tokenizer,
    trainer_state: dict,
    train_config: dict,
    info: dist.DistInfo,
    ref=None,
    tensors=None,
) -> str:
    """Write out_dir/checkpoint-<step> (the policy or its LoRA adapter,
    tokenizer, train_config.json, trainer/: optimizer, `trainer_state`,
    `ref`, a reference model whose weights are saved: sync_ref_model's, and
    `tensors`, {file name: {key: tensor}} written by rank 0: async_rollouts' weights)
    under a temporary name, rename it, then swap the `checkpoint` link to it.
    A write that fails raises SaveFailed, the partial copy removed."""
    step_dir = os.path.join(out_dir, f"checkpoint-{step}")
    tmp = step_dir + ".tmp"
    from safetensors.torch import save_file

    state, adapter = checkpoint.state_to_write(model)
    try:
        if info.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # left over from a crash
            os.makedirs(os.path.join(tmp, "trainer"))
        # every rank writes its optimizer shard there: rank 0 sends it once made
        tmp = dist.broadcast_object(tmp)
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
            for name, part in (tensors or {}).items():
                save_file(part, os.path.join(tmp, "trainer", name))
        save_optimizer(os.path.join(tmp, "trainer"), model, optimizer, info)
        if ref is not None:
            save_ref_model(os.path.join(tmp, "trainer"), ref, info)
        dist.barrier()
        if info.is_main:
            shutil.rmtree(step_dir, ignore_errors=True)
            os.rename(tmp, step_dir)
            _point_link(os.path.join(out_dir, "checkpoint"), step_dir)
    except BaseException as e:
        if info.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        if is_write_error(e):
            raise SaveFailed(f"could not save {step_dir} ({write_error(e)})") from e
        raise
    dist.barrier()
    return step_dir


def is_write_error(e: BaseException) -> bool:
    """Whether e is the filesystem refusing a write: an OSError, or
    safetensors' error for one (its I/O error, as text)."""
    from safetensors import SafetensorError

    return isinstance(e, OSError) or (isinstance(e, SafetensorError) and "I/O error" in str(e))


def write_error(e: BaseException) -> str:
    """The cause of a failed write, short: "No space left on device",
    "Permission denied: 'out/checkpoint-2.tmp'", "File too large (os error 27)"."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}: {e.filename!r}" if e.filename else e.strerror
    text = str(e)
    return text[text.index("I/O error: ") + 11 :] if "I/O error: " in text else text


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


# What a checkpoint holds, beside the model's files and the optimizer's
# tensors (optimizer_files): all of it is needed to resume.
RUN_STATE_FILES = [
    "train_config.json",
    "trainer/trainer_state.json",
    "trainer/optimizer.json",
]
# sync_ref_model's reference, in a checkpoint's trainer/ (with its per-rank files)
REF_MODEL = "ref_model.json"
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
    named = []  # (file, the file that names it)
    if has("model.safetensors.index.json"):
        index = checkpoint.read_json(os.path.join(ckpt_dir, "model.safetensors.index.json"))
        for name in sorted(set(index.get("weight_map", {}).values())):
            named.append((name, "model.safetensors.index.json"))
    if not has(LEGACY_OPTIMIZER):
        for name in optimizer_files(os.path.join(ckpt_dir, "trainer")):
            named.append((f"trainer/{name}", "trainer/optimizer.json"))
    if has(f"trainer/{REF_MODEL}"):
        problem = damaged(ckpt_dir, f"trainer/{REF_MODEL}")
        if problem:
            return problem
        for name in ref_files(os.path.join(ckpt_dir, "trainer")):
            named.append((f"trainer/{name}", f"trainer/{REF_MODEL}"))
    for name, by in named:
        if not has(name):
            return f"no {name} ({by} names it)"
        problem = damaged(ckpt_dir, name)
        if problem:
            return problem
    return None


def optimizer_files(path) -> list[str]:
    """The optimizer's safetensors files in `path` (a checkpoint's trainer/),
    as its optimizer.json names them: one per saving rank, or the single
    optimizer.safetensors of older checkpoints."""
    layout = checkpoint.read_json(os.path.join(path, "optimizer.json"))
    world = layout.get("world_size")
    if world is None:
        return ["optimizer.safetensors"]
    return [rank_file(r, world) for r in range(world)]


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


def rank_file(rank: int, world_size: int) -> str:
    """The name of the file of optimizer tensors rank `rank` of
    `world_size` processes writes."""
    return f"optimizer-rank{rank:05d}-of-{world_size:05d}.safetensors"


def ref_file(rank: int, world_size: int) -> str:
    """The name of the file of reference-model weights rank `rank` of
    `world_size` processes writes."""
    return f"ref_model-rank{rank:05d}-of-{world_size:05d}.safetensors"


def ref_files(path) -> list[str]:
    """The reference model's safetensors files in `path` (a checkpoint's
    trainer/), as its ref_model.json names them, in saving rank order."""
    world = checkpoint.read_json(os.path.join(path, REF_MODEL))["world_size"]
    return [ref_file(r, world) for r in range(world)]


def shard_rows(num_rows: int, rank: int, world_size: int) -> list[int]:
    """[begin, end) of the dim-0 rows `rank` holds of a tensor FSDP2 shards
    over `world_size` ranks (torch.chunk's rule: blocks of
    ceil(num_rows / world_size), the last ones short or empty)."""
    size = -(-num_rows // world_size)
    begin = min(num_rows, rank * size)
    return [begin, min(num_rows, begin + size)]


def save_optimizer(path, model, optimizer, info: dist.DistInfo):
    """Write the optimizer state into `path`, each rank its own shard, keyed
    by parameter name (every rank calls it; nothing is gathered).
    rank_file(rank, world_size) holds that rank's tensors ("<param>.<field>",
    e.g. "layers.0.mlp.up_proj.weight.exp_avg"); rank 0's optimizer.json holds
    the param_groups, the fields that are not tensors, world_size, and for each
    tensor its global shape, dtype and rows: the [begin, end) of dim 0 each
    rank's file holds, or null for a tensor whole in rank 0's file (AdamW's
    step, every tensor of one process)."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    # under FSDP2 its tensors are this rank's DTensor shards, not copies
    state = get_optimizer_state_dict(model, optimizer)
    mine = {}  # what this rank's file holds
    tensors = {}  # name -> shape, dtype, rows
    others = {}  # {param: {field: value}} of fields that are not tensors
    for name, fields in state["state"].items():
        for key, value in fields.items():
            if not torch.is_tensor(value):
                others.setdefault(name, {})[key] = value
                continue
            entry, local = saved_part(value, info)
            tensors[f"{name}.{key}"] = entry
            if local is not None:
                mine[f"{name}.{key}"] = local
    save_file(mine, os.path.join(path, rank_file(info.rank, info.world_size)))
    if info.is_main:
        layout = {
            "param_groups": state["param_groups"],
            "state": others,
            "world_size": info.world_size,
            "tensors": tensors,
        }
        checkpoint.write_json(os.path.join(path, "optimizer.json"), layout)


def saved_part(value: torch.Tensor, info: dist.DistInfo) -> tuple[dict, torch.Tensor | None]:
    """What this rank's file holds of a tensor, and its entry in the layout
    (global shape, dtype, rows). -> ({"shape", "dtype", "rows"}, the tensor
    for this rank's file, or None): of an FSDP2 DTensor this rank's dim-0
    rows, the rows [begin, end) of every rank listed; a whole tensor only in
    rank 0's file (rows null)."""
    from torch.distributed.tensor import DTensor, Shard

    rows = None
    shape = list(value.shape)
    dtype = str(value.dtype).removeprefix("torch.")
    if isinstance(value, DTensor):
        assert value.placements == (Shard(0),), value.placements
        rows = [shard_rows(shape[0], r, info.world_size) for r in range(info.world_size)]
        value = value.to_local()  # [rows of this rank, ...]
        begin, end = rows[info.rank]
        assert value.shape[0] == end - begin, (value.shape, rows)
    entry = {"shape": shape, "dtype": dtype, "rows": rows}
    if rows is None and not info.is_main:
        return entry, None
    return entry, value.detach().cpu().contiguous()


def save_ref_model(path, ref, info: dist.DistInfo):
    """Write the reference model's parameters into `path` as save_optimizer
    writes the optimizer's tensors: each rank its own shard
    (ref_file(rank, world_size), keyed by parameter name), rank 0's
    ref_model.json the layout (world_size, each tensor's shape, dtype, rows).
    Every rank calls it; nothing is gathered."""
    from safetensors.torch import save_file

    mine = {}
    tensors = {}
    for name, param in ref.named_parameters():
        entry, local = saved_part(param.detach(), info)
        tensors[name] = entry
        if local is not None:
            mine[name] = local
    save_file(mine, os.path.join(path, ref_file(info.rank, info.world_size)))
    if info.is_main:
        layout = {"world_size": info.world_size, "tensors": tensors}
        checkpoint.write_json(os.path.join(path, REF_MODEL), layout)


@torch.no_grad()
def load_ref_model(path, ref) -> bool:
    """Fill `ref`'s parameters from save_ref_model's files in `path` (saved
    by any number of processes; each rank reads only the rows of its own
    shards). -> False when `path` holds none (a checkpoint of a run
    without sync_ref_model, or one older than these files)."""
    if not os.path.exists(os.path.join(path, REF_MODEL)):
        return False
    layout = checkpoint.read_json(os.path.join(path, REF_MODEL))
    layout["files"] = ref_files(path)
    params = dict(ref.named_parameters())
    missing = sorted(set(params) - set(layout["tensors"]))
    extra = sorted(set(layout["tensors"]) - set(params))
    if missing or extra:
        raise ValueError(
            f"{path}/{REF_MODEL} does not fit this reference model (missing: "
            f"{missing[:3]}, not in the model: {extra[:3]}): resume with the checkpoint's model"
        )
    with ShardReader(path, layout) as reader:
        for name, param in params.items():
            param.copy_(local_value(reader, name, param))
    return True


def read_layout(path) -> dict:
    """optimizer.json of `path`, with "files": the safetensors files in
    saving rank order. A checkpoint older than the per-rank files has one,
    optimizer.safetensors, with every tensor whole: its table of tensors
    comes from that file's header."""
    from safetensors import safe_open

    layout = checkpoint.read_json(os.path.join(path, "optimizer.json"))
    layout["files"] = optimizer_files(path)
    if "tensors" in layout:
        return layout
    with safe_open(os.path.join(path, "optimizer.safetensors"), framework="pt") as f:
        tensors = {k: {"shape": f.get_slice(k).get_shape(), "rows": None} for k in f.keys()}
    layout["tensors"] = tensors
    return layout


class ShardReader:
    """Reads saved optimizer tensors, or rows of them, from only the files
    that hold them (safetensors reads just those bytes); each file is opened
    once. Use as a context manager."""

    def __init__(self, path, layout: dict):
        self.path = path
        self.layout = layout
        self.stack = ExitStack()
        self.opened = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stack.close()

    def file(self, name: str):
        from safetensors import SafetensorError, safe_open

        if name not in self.opened:
            file = os.path.join(self.path, name)
            try:
                opened = safe_open(file, framework="pt", device="cpu")
            except (SafetensorError, OSError) as e:
                raise ValueError(f"{file} cannot be read (truncated or corrupt?): {e}") from None
            self.opened[name] = self.stack.enter_context(opened)
        return self.opened[name]

    def read(self, key: str, rows=None) -> torch.Tensor:
        """The tensor `key`, or only its dim-0 rows [begin, end) = rows."""
        entry = self.layout["tensors"][key]
        files = self.layout["files"]
        if entry["rows"] is None:  # whole, in the first file
            f = self.file(files[0])
            if rows is None:
                return f.get_tensor(key)
            return f.get_slice(key)[rows[0] : rows[1]]
        begin, end = rows or [0, entry["shape"][0]]
        parts = []
        for name, (lo, hi) in zip(files, entry["rows"]):
            a = max(begin, lo)
            b = min(end, hi)
            if a < b:
                parts.append(self.file(name).get_slice(key)[a - lo : b - lo])
        if not parts:  # an empty shard: rank 0's file holds rows of every one
            parts.append(self.file(files[0]).get_slice(key)[0:0])
        if len(parts) == 1:
            return parts[0]  # not copied again by a cat
        return torch.cat(parts)


def local_value(reader: ShardReader, key: str, param) -> torch.Tensor:
    """The saved state tensor `key` as this rank's optimizer holds it for
    `param`: under FSDP2 a tensor shaped like its parameter is this rank's
    rows of it, a DTensor placed as the parameter is; anything else (AdamW's
    step, every tensor of one process) whole."""
    from torch.distributed.tensor import DTensor, Shard

    shape = list(reader.layout["tensors"][key]["shape"])
    if not isinstance(param, DTensor) or shape != list(param.shape):
        return reader.read(key)
    assert param.placements == (Shard(0),), param.placements
    mesh = param.device_mesh
    rows = shard_rows(shape[0], mesh.get_local_rank(), mesh.size())
    local = reader.read(key, rows).to(param.device)  # [rows of this rank, ...]
    assert local.shape == param.to_local().shape, (key, local.shape)
    return DTensor.from_local(
        local, mesh, param.placements, shape=param.shape, stride=param.stride()
    )


def read_optimizer(path) -> dict:
    """save_optimizer's files (or an older optimizer.safetensors) -> the
    whole optimizer state dict keyed by parameter name
    (torch.distributed.checkpoint.state_dict's layout), on this process."""
    layout = read_layout(path)
    state = layout["state"]
    with ShardReader(path, layout) as reader:
        for key in layout["tensors"]:
            name, field = key.rsplit(".", 1)
            state.setdefault(name, {})[field] = reader.read(key)
    return {"state": state, "param_groups": layout["param_groups"]}


def load_optimizer(path, model, optimizer):
    """Fill `optimizer` from save_optimizer's files in `path`, saved by any
    number of processes, or from an older single optimizer.safetensors.
    Every rank calls it and reads only the rows of its own shards."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    layout = read_layout(path)
    params = dict(model.named_parameters())
    state = layout["state"]  # fields that are not tensors
    with ShardReader(path, layout) as reader:
        for key in layout["tensors"]:
            name, field = key.rsplit(".", 1)
            if name not in params:
                raise ValueError(f"{path}: the optimizer state of {name!r}, not in this model")
            state.setdefault(name, {})[field] = local_value(reader, key, params[name])
    groups = layout["param_groups"]
    for saved, group in zip(groups, optimizer.param_groups):
        saved.update({k: group[k] for k in IMPLEMENTATION if k in group})
    set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": groups})


def load_trainer_state(ckpt_dir, model, optimizer, info: dist.DistInfo) -> dict:
    """Restore the optimizer from ckpt_dir/trainer and return the trainer
    state. Never unpickles: a checkpoint cannot run code."""
    path = os.path.join(ckpt_dir, "trainer")
    legacy = os.path.join(ckpt_dir, LEGACY_OPTIMIZER)
    if os.path.exists(os.path.join(path, "optimizer.json")) or not os.path.exists(legacy):
        load_optimizer(path, model, optimizer)
    elif info.sharded:
        raise ValueError(
            f"{ckpt_dir} holds a one-process optimizer in the older format "
            f"({LEGACY_OPTIMIZER}): resume it on one process"
        )
    else:
        optimizer.load_state_dict(torch.load(legacy, weights_only=True))
    return checkpoint.read_json(os.path.join(path, "trainer_state.json"))
