"""torch.distributed setup, FSDP2 and the collectives every multi-process path calls.

Owns: process-group setup from torchrun's environment (nccl on CUDA, gloo on
CPU), sharding the model with PyTorch's own FSDP2 (`fully_shard` on each
block, then the root), filling a sharded model from rank 0's full state dict
and gathering one back, gathering parameters once for a whole sampling phase,
the collectives the trainer needs, what a failed collective means (a rank
that stopped answering or is gone: collective_failure, tell_peers), and
`local_work`, which all ranks leave together when a stop signal asks them to.

With one process (no torchrun) every function here degrades to a plain no-op
or identity: the trainer calls the same functions either way, and the model is
a plain `nn.Module` (no FSDP wrapper). bf16 compute is one flag from the
caller (trainer.py passes TrainConfig.use_bf16(device) to `autocast` and, through
checkpoint.load_model, to `shard_model`): autocast for one process, FSDP2's
mixed-precision policy for several, on CPU and CUDA alike.

Does not know about: files (checkpoint/__init__.py decides what is read and
written), GRPO, rewards, or the model's internals beyond `model.layers` and
`hidden_states`; it imports nothing of the package.
"""

import os
import re
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    """Where this process sits: rank among world_size processes, and its device."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    # the processes torchrun launched: world_size, or with async_rollouts world_size trainers
    # and the rollout processes after them
    launched: int = 1
    sampler: bool = False  # one of the rollout processes: a world of its own (rank 0 of 1)

    @property
    def is_main(self) -> bool:
        return self.rank == 0 and not self.sampler

    @property
    def sharded(self) -> bool:
        return self.world_size > 1


def setup(device: str = "auto", timeout: float = 1800, samplers: int = 0) -> DistInfo:
    """Read torchrun's RANK/WORLD_SIZE/LOCAL_RANK (absent: one process) and
    pick the device (each rank its LOCAL_RANK's GPU); initialise the process
    group (nccl on CUDA, gloo on CPU) when there is more than one process.
    `cuda:N` names one GPU, so it is for one process only. timeout: the
    seconds a collective waits for the other ranks before it fails
    (transformers' ddp_timeout): a hung or dead rank ends the run.
    samplers: under torchrun, the last this many processes sample
    (async_rollouts): the group is the others', each sampler a world of its
    own; launch_store() is every process's."""
    global _launch_store, _sampler_rank
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = _pick_device(device, world_size, local_rank)
    if world_size > 1 and samplers and not dist.is_initialized():
        store, _, _ = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout)))
        _launch_store, trainers = store, world_size - samplers
        if rank >= trainers:  # a rollout process: no group, rank 0 of its own world
            _sampler_rank = rank
            return DistInfo(0, 1, local_rank, dev, launched=world_size, sampler=True)
        cuda = dev.type == "cuda"
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
        dist.init_process_group(
            backend="nccl" if cuda else "gloo",
            store=dist.PrefixStore("nanogrpo/trainers/", store),
            rank=rank,
            world_size=trainers,
            device_id=dev if cuda else None,
            timeout=timedelta(seconds=timeout),
        )
        return DistInfo(rank, trainers, local_rank, dev, launched=world_size)
    if world_size > 1 and not dist.is_initialized():
        if timeout <= 0:
            raise ValueError(f"ddp_timeout={timeout}: must be > 0 seconds")
        cuda = dev.type == "cuda"
        # gloo raises in the waiting rank when a collective times out; for
        # NCCL, torch's watchdog ends the process (mode 3, torch's default,
        # made explicit: 0 would leave the rank waiting forever)
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
        dist.init_process_group(
            backend="nccl" if cuda else "gloo",
            rank=rank,
            world_size=world_size,
            device_id=dev if cuda else None,
            timeout=timedelta(seconds=timeout),
        )
    return DistInfo(rank, world_size, local_rank, dev, launched=world_size)


_launch_store = None  # setup's with samplers: the store every launched process shares
_sampler_rank = None  # setup's in a rollout process: its rank among those launched


def launch_store():
    """The store of every process torchrun launched (setup with samplers)."""
    return _launch_store


def _pick_device(device: str, world_size: int, local_rank: int):
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not device.startswith("cuda"):
        return torch.device(device)
    if not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but no CUDA device is visible; use device='cpu'")
    if device != "cuda" and world_size > 1:
        raise ValueError(
            f"device={device!r} puts every one of the {world_size} processes "
            "on one GPU; use device='cuda' (each rank takes its LOCAL_RANK's "
            "GPU) or CUDA_VISIBLE_DEVICES"
        )
    index = local_rank if device == "cuda" else int(device.split(":")[1])
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def teardown():
    """Destroy the process group, if any, once every rank got here (a rank
    that tears down while another is still in a collective can abort the
    process)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def rank() -> int:
    """This process's rank (0 without a process group; a rollout process's among those
    launched: it prints and writes nothing of the run)."""
    if _sampler_rank is not None:
        return _sampler_rank
    return dist.get_rank() if dist.is_initialized() else 0


def print0(*args, **kwargs):
    """print on rank 0 only."""
    if rank() == 0:
        print(*args, **kwargs, flush=True)


# -----------------------------------------------------------------------------
# Collectives (identity with one process)


def to_device(x: torch.Tensor, device) -> torch.Tensor:
    """A CPU tensor on `device` without the host waiting for the GPU: a copy
    from pageable memory would drain the stream first; from pinned memory it
    is queued (the caching host allocator keeps the buffer until it is done)."""
    device = torch.device(device)
    if device.type != "cuda" or x.device.type != "cpu":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


def all_reduce_sum(x: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum of x over ranks (a new tensor)."""
    x = x.clone()
    if info.sharded:
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def all_gather_rows(x: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Concatenate equal-shaped tensors of every rank along dim 0, in rank order."""
    if not info.sharded:
        return x
    parts = [torch.empty_like(x) for _ in range(info.world_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, 0)


def broadcast_object(obj):
    """Rank 0's Python object on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier():
    """Wait for every rank."""
    if dist.is_initialized():
        dist.barrier()


# A stop asked for by a signal (its number; 0 = none), whether local_work is running, and what
# tells whether the work in flight may then be dropped (None: no one handles stops: nanogrpo/run/
# sets all three while a run runs)
stop_request = {"signum": 0, "inside": False, "droppable": None}


class Dropped(KeyboardInterrupt):
    """A stop inside `local_work`: the work in flight is dropped, on every rank together. A
    KeyboardInterrupt, so that what passes Ctrl-C through (asyncio's tasks, `except Exception`)
    passes it through too."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextmanager
def local_work(info: DistInfo):
    """Around work each rank does alone (sampling and scoring a round; no collective inside: a
    rank may leave it at any point). A stop signal's handler may raise Dropped inside it, at once;
    at its exit every rank learns whether any was asked to stop (one small all-reduce), and if
    one was and the work may be dropped (stop_request["droppable"]()), all raise Dropped
    together. Where no one handles stops it does nothing."""
    if stop_request["droppable"] is None:
        yield
        return
    try:
        stop_request["inside"] = True
        try:
            yield
        finally:
            stop_request["inside"] = False
    except Dropped:
        pass  # the ranks agree below
    signum = max_over_ranks(stop_request["signum"], info)
    if signum and stop_request["droppable"]():
        raise Dropped(signum)


def max_over_ranks(value: int, info: DistInfo) -> int:
    """The largest of every rank's value (one small all-reduce)."""
    if not info.sharded:
        return value
    x = torch.tensor([value], device=info.device)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return int(x.item())


# -----------------------------------------------------------------------------
# When another rank fails

FAILED_KEY = "nanogrpo/failed"  # in torchrun's store: a rank's last words


def collective_failure(e: BaseException, info: DistInfo, timeout: float) -> str | None:
    """What a failed collective says about the other ranks, in words
    ("rank 1 stopped answering (ddp_timeout=10 s): Timed out ..."), or None
    when e is no collective's failure. gloo raises a RuntimeError naming its
    own source file; NCCL and the store raise torch.distributed's DistError.
    A rank that is gone is said in peer_gone's words alone: which of gloo's
    messages comes first is a race ("Connection closed by peer", "Read
    error"), and so is whether torchrun's SIGTERM comes before it."""
    text = str(e)
    if not (isinstance(e, dist.DistError) or "/gloo/" in text):
        return None
    if re.search("timed out|timeout", text, re.IGNORECASE):
        return f"{_other(info)} {STOPPED} (ddp_timeout={timeout:g} s): {first_sentence(text)}"
    return peer_gone(info)


def first_sentence(text: str) -> str:
    """The first sentence of a torch.distributed error, without the
    [source file:line] gloo puts first."""
    text = re.sub(r"^\[[^\]]*\] *", "", text.strip())
    return re.split(r"(?<=\.) |\n", text)[0]


STOPPED = "stopped answering"  # a collective waited ddp_timeout on another rank


def _other(info: DistInfo) -> str:
    return f"rank {1 - info.rank}" if info.world_size == 2 else "another rank"


def peer_gone(info: DistInfo) -> str:
    """Another rank ended (it failed or was killed), in words."""
    return f"{_other(info)} is gone (it failed or was killed)"


def _store():
    """The process group's key-value store (torchrun's agent holds it)."""
    return dist.distributed_c10d._get_default_store()


def tell_peers(line: str):
    """Leave this rank's failure in the store, where the other ranks look
    when torchrun stops them (peer_failure). Best effort: the store may
    have gone with the run."""
    if not dist.is_initialized():
        return
    try:
        _store().set(FAILED_KEY, line)
    except Exception:  # nothing more to tell anyone
        pass


def peer_failure() -> str | None:
    """The line another rank left of its failure (tell_peers), or None."""
    if not dist.is_initialized():
        return None
    try:
        store = _store()
        return store.get(FAILED_KEY).decode() if store.check([FAILED_KEY]) else None
    except Exception:  # an unreachable store tells nothing
        return None


# -----------------------------------------------------------------------------
# bf16 compute: one flag, two mechanisms


def autocast(info: DistInfo, bf16: bool):
    """bf16 autocast for an unsharded model, on its device (a sharded one
    computes in bf16 through shard_model's mixed-precision policy)."""
    if bf16 and not info.sharded:
        return torch.autocast(info.device.type, dtype=torch.bfloat16)
    return nullcontext()


# -----------------------------------------------------------------------------
# FSDP2


def shard_model(model, info: DistInfo, mixed_precision: bool):
    """Apply `fully_shard` to each transformer block, then to the root
    (embeddings, final norm and LM head, tied or not). With mixed_precision,
    blocks compute in bf16 and gradients are reduced in fp32 while the
    sharded master weights stay fp32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        MixedPrecisionPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    mesh = init_device_mesh(info.device.type, (info.world_size,))
    kwargs = {"mesh": mesh}
    if mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
        # outside a forward the parameters are the fp32 shards: a KV cache made then
        # (fast/logprobs.py's prompt pass) must still hold the bf16 keys the blocks compute
        model.compute_dtype = torch.bfloat16
    for block in model.layers:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    # the sampler calls model.hidden_states, not forward: hook it the same way
    register_fsdp_forward_method(model, "hidden_states")
    # runs before FSDP2's own post-forward hook, which hooks backward on
    # the outputs and warns on (and can lose to in-place ops) views
    model.register_forward_hook(_no_view_outputs, prepend=True)
    return model


def _no_view_outputs(module, args, output):
    """The root's outputs as tensors of their own: a `head` may return a view
    of the hidden states (fast/logprobs.py's h[:, -1], [N,D]); copying it costs only
    its own elements. Nothing is copied without grad (sampling)."""
    if isinstance(output, tuple):
        return tuple(_own(t) for t in output)
    return _own(output)


def _own(t):
    if torch.is_tensor(t) and t.requires_grad and t._base is not None:
        return t.clone()
    return t


def fill_from_rank0(model, full: dict):
    """Fill a sharded model (allocated, values undefined) from rank 0's full
    state dict, broadcast shard by shard (other ranks pass {}), so no GPU
    ever holds a full copy."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)


def fsdp_modules(model):
    """The FSDP-wrapped modules of model (empty for a plain module)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


# ids of the models a `gathered` holds unsharded now
_held = set()


@contextmanager
def gathered(model):
    """Gather every sharded parameter once for a whole sampling phase (not
    once per decode step), and shard them again afterwards. A no-op for an
    unsharded model, and inside another `gathered` of the same model: the
    outer one shards them again when it ends."""
    modules = fsdp_modules(model)
    if not modules or id(model) in _held:
        yield model
        return
    _held.add(id(model))
    for m in modules:
        m.unshard()
        m.set_reshard_after_forward(False)
    try:
        yield model
    finally:
        _held.discard(id(model))
        for m in modules:
            m.set_reshard_after_forward(True)
            m.reshard()


def reshard(model):
    """Shard again what a forward left gathered: FSDP2 keeps the root's
    parameters (embeddings, final norm, LM head) gathered after a forward,
    for the backward that a frozen model (the reference) never runs. A no-op
    for an unsharded model."""
    for m in fsdp_modules(model):
        m.reshard()


def gradient_sync(model, enabled: bool):
    """Turn FSDP's gradient reduce-scatter on (last micro-step) or off
    (earlier micro-steps)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):  # the root; recurse=True reaches every block
        model.set_requires_gradient_sync(enabled, recurse=True)


def clip_grad_norm(model, max_norm: float) -> float:
    """Clip gradients to max_norm in total L2 norm (over all ranks for
    sharded DTensor grads); returns the norm before clipping."""
    params = [p for p in model.parameters() if p.grad is not None]
    limit = max_norm if max_norm > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(params, limit)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm.item()


def full_state_dict(model, keep=None) -> dict:
    """The full (unsharded) model state dict on rank 0's CPU, our names; {}
    on other ranks of a sharded model (every rank must call it: it gathers).
    keep(name) -> bool: only those tensors (a plain model copies nothing else
    to the CPU)."""
    if not fsdp_modules(model):
        state = model.state_dict()
        return {k: v.detach().cpu() for k, v in state.items() if keep is None or keep(k)}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    if rank() != 0:
        return {}
    return {k: v for k, v in state.items() if keep is None or keep(k)}


def equal_shard(num_rows: int, rank: int, world_size: int) -> list[int]:
    """The rows one rank takes: a block of ceil(num_rows / world) so every
    rank has the same count (all_gather needs equal shapes); indices past
    the end wrap around, to be cut off after the gather."""
    n = -(-num_rows // world_size)
    return [(rank * n + i) % num_rows for i in range(n)]
