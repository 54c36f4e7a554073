"""A run's checkpoint: out_dir/checkpoint-<step>/ holds the policy as a
Hugging Face checkpoint (or its PEFT adapter), the tokenizer,
train_config.json and trainer/ (the optimizer and trainer_state.json);
out_dir/checkpoint links to the newest.

Owns: `save_checkpoint` (written under a temporary name, renamed when
complete, then the link swapped), `prune_checkpoints` (save_total_limit),
the optimizer's file (`save_optimizer`) and `load_trainer_state`.

Does not know about: the model's file format (checkpoint.py writes it) or
what the trainer state holds (run.py decides). With several processes rank
0 writes the model and JSON, every rank its optimizer shard (through
torch.distributed.checkpoint); the barriers are dist.py's.

Choices: no pickle. The trainer state is JSON and the optimizer loads with
weights_only=True, so a checkpoint cannot run code.
"""

import os
import shutil
from contextlib import suppress

import torch

from nanogrpo import checkpoint, dist


def save_checkpoint(out_dir, step: int, model, optimizer, tokenizer,
                    trainer_state: dict, train_config: dict,
                    info: dist.DistInfo) -> str:
    """Write out_dir/checkpoint-<step> (the policy or its LoRA adapter,
    tokenizer, train_config.json, trainer/: optimizer, `trainer_state`) under
    a temporary name, rename it, then swap the `checkpoint` link to it."""
    step_dir = os.path.join(out_dir, f"checkpoint-{step}")
    tmp = step_dir + ".tmp"
    state, adapter = checkpoint.state_to_write(model)
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # left over from a crash
        os.makedirs(os.path.join(tmp, "trainer"))
    dist.barrier()
    try:
        if info.is_main:
            checkpoint.write_model(tmp, model.config, state,
                        generation_config=model.generation_config,
                        tokenizer=tokenizer, adapter=adapter)
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
    return checkpoint.read_json(os.path.join(path, "trainer_state.json"))
