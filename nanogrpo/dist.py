"""Everything that knows about more than one process: torch.distributed setup and FSDP2.

Owns: process-group setup from torchrun's environment (nccl on CUDA, gloo on CPU), sharding the
model with PyTorch's own FSDP2 (`fully_shard` on each block, then the root), loading a checkpoint
into a sharded model without any rank holding a full copy on the GPU, gathering parameters once
for a whole sampling phase, the collectives the trainer needs, and sharded checkpoints of the
trainer state with `torch.distributed.checkpoint`.

With one process (no torchrun) every function here degrades to a plain no-op or identity: the
trainer calls the same functions either way, and the model is a plain `nn.Module` (no FSDP wrapper,
bf16 through autocast on CUDA).

Does not know about: GRPO, rewards, or the model's internals beyond `model.layers`.
"""

import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    """Where this process sits: rank among world_size processes, and its device."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.world_size > 1


def setup(device: str = "auto") -> DistInfo:
    """Read torchrun's RANK/WORLD_SIZE/LOCAL_RANK (absent: one process) and pick the device;
    initialise the process group (nccl on CUDA, gloo on CPU) when there is more than one process."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA device is visible; use device='cpu'")
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device(device)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo",
                                rank=rank, world_size=world_size, device_id=dev if dev.type == "cuda" else None)
    return DistInfo(rank, world_size, local_rank, dev)


def teardown():
    """Destroy the process group, if any."""
    if dist.is_initialized():
        dist.destroy_process_group()


def print0(*args, info: DistInfo | None = None, **kwargs):
    """print on rank 0 only."""
    if (info.rank if info else int(os.environ.get("RANK", "0"))) == 0:
        print(*args, **kwargs, flush=True)


# -----------------------------------------------------------------------------
# Collectives (identity with one process)


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


def broadcast_object(obj, info: DistInfo):
    """Rank 0's Python object on every rank."""
    if not info.sharded:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(info: DistInfo):
    """Wait for every rank."""
    if info.sharded:
        dist.barrier()


# -----------------------------------------------------------------------------
# FSDP2


def shard_model(model, info: DistInfo, mixed_precision: bool):
    """Apply `fully_shard` to each transformer block, then to the root (embeddings, final norm and
    LM head, tied or not). With mixed_precision (CUDA), blocks compute in bf16 and gradients are
    reduced in fp32 while the sharded master weights stay fp32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
    mesh = init_device_mesh(info.device.type, (info.world_size,))
    kwargs = {"mesh": mesh}
    if mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    # the sampler and token_logprobs call model.hidden_states, not forward: hook it the same way
    register_fsdp_forward_method(model, "hidden_states")
    return model


def load_sharded(path: str, info: DistInfo, mixed_precision: bool):
    """Build the model on the meta device, shard it, then fill the shards from the checkpoint:
    rank 0 reads the safetensors on CPU and the tensors are broadcast shard by shard, so no GPU
    ever holds a full copy (torch.distributed.checkpoint's broadcast_from_rank0)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from nanogrpo.model import ModelConfig, Transformer, load_safetensors, read_json
    from nanogrpo.model import resolve_checkpoint
    path = resolve_checkpoint(path) if info.is_main else None
    path = broadcast_object(path, info)
    cfg = ModelConfig.from_hf(read_json(os.path.join(path, "config.json")))
    with torch.device("meta"):
        model = Transformer(cfg)
    full = {}
    if info.is_main:
        full = model.check_hf_state_dict(load_safetensors(path, dtype=torch.float32, device="cpu"))
        if cfg.tie_word_embeddings:
            full["lm_head.weight"] = full["embed_tokens.weight"]
    shard_model(model, info, mixed_precision)
    model.to_empty(device=info.device)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    gen_path = os.path.join(path, "generation_config.json")
    model.generation_config = read_json(gen_path) if os.path.exists(gen_path) else None
    model.name_or_path = path
    return model


def fsdp_modules(model):
    """The FSDP-wrapped modules of model (empty for a plain module)."""
    from torch.distributed.fsdp import FSDPModule
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextmanager
def gathered(model):
    """Gather every sharded parameter once for a whole sampling phase (not once per decode step),
    and shard them again afterwards. A no-op for an unsharded model."""
    modules = fsdp_modules(model)
    for m in modules:
        m.unshard()
        m.set_reshard_after_forward(False)
    try:
        yield model
    finally:
        for m in modules:
            m.set_reshard_after_forward(True)
            m.reshard()


def gradient_sync(model, enabled: bool):
    """Turn FSDP's gradient reduce-scatter on (last micro-step) or off (earlier micro-steps)."""
    from torch.distributed.fsdp import FSDPModule
    if isinstance(model, FSDPModule):  # the root; recurse=True reaches every block
        model.set_requires_gradient_sync(enabled, recurse=True)


def clip_grad_norm(model, max_norm: float) -> float:
    """Clip gradients to max_norm in total L2 norm (over all ranks for sharded DTensor grads);
    returns the norm before clipping."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm.item()


def autocast(info: DistInfo, bf16: bool):
    """bf16 autocast for an unsharded model on CUDA (FSDP's mixed-precision policy does it when sharded)."""
    if bf16 and info.device.type == "cuda" and not info.sharded:
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


def full_state_dict(model, info: DistInfo) -> dict:
    """The full (unsharded) model state dict on rank 0's CPU, our names; {} on other ranks."""
    if not info.sharded:
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return state if info.is_main else {}


def save_trainer_state(path: str, model, optimizer, extra: dict, info: DistInfo):
    """Optimizer state (sharded, written by every rank with torch.distributed.checkpoint when
    sharded; torch.save otherwise) plus `extra` (step, scheduler, data position) from rank 0."""
    os.makedirs(path, exist_ok=True)
    if info.sharded:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=os.path.join(path, "optimizer"))
    else:
        torch.save(optimizer.state_dict(), os.path.join(path, "optimizer.pt"))
    if info.is_main:
        torch.save(extra, os.path.join(path, "trainer_state.pt"))


def load_trainer_state(path: str, model, optimizer, info: DistInfo) -> dict:
    """Restore what save_trainer_state wrote (same world size); returns `extra`."""
    if info.sharded:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
        state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=os.path.join(path, "optimizer"))
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
    else:
        optimizer.load_state_dict(torch.load(os.path.join(path, "optimizer.pt"), weights_only=False))
    return torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
