"""run/checkpoints.py's optimizer files: each process writes its own shard,
any number of processes reads them back (each only its rows), older
single-file checkpoints still load, and nothing is a pickle."""

import json
import os
import shutil

import pytest
import torch
import torch.multiprocessing as mp
from conftest import assert_no_pickle, forbid_unpickling, tiny_config
from safetensors.torch import load_file, save_file
from test_dist import free_port, join_group

from nanogrpo import distributed as dist
from nanogrpo.model import Transformer
from nanogrpo.run import checkpoints

LR = 1e-2  # the saving runs' learning rate; the loading ones start at 1.0


def tiny_model():
    """The same random model in every process; vocab 97 shards unevenly
    (49 + 48 rows on 2 ranks)."""
    torch.manual_seed(0)
    return Transformer(tiny_config())


def train_steps(model, optimizer, steps=2):
    """AdamW steps on one fixed batch, the same on every rank."""
    ids = torch.arange(12).reshape(2, 6)  # [B,T]
    for _ in range(steps):
        logits = model(ids)  # [B,T,V]
        logits.float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def named_state(model, optimizer) -> dict:
    """This process's optimizer tensors as "<param>.<field>" -> its local
    tensor (a DTensor's shard)."""
    names = {p: n for n, p in model.named_parameters()}
    out = {}
    for param, fields in optimizer.state.items():
        for field, value in fields.items():
            if hasattr(value, "to_local"):
                value = value.to_local()
            out[f"{names[param]}.{field}"] = value.detach().clone()
    return out


def save(model, optimizer, out_dir, info) -> str:
    return checkpoints.save_checkpoint(
        out_dir,
        2,
        model,
        optimizer,
        tokenizer=None,
        trainer_state={"step": 2},
        train_config={},
        info=info,
    )


def files_of(ckpt) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, f), ckpt) for d, _, names in os.walk(ckpt) for f in names
    )


# -----------------------------------------------------------------------------
# Spawned processes


def save_two(rank, world_size, port, out_dir):
    """Train the sharded model, save a checkpoint, and rank 0 writes the
    whole optimizer state it gathered (what every loader must give back)."""
    join_group(rank, world_size, port)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    info = dist.setup("cpu")
    model = dist.shard_model(tiny_model(), info, mixed_precision=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    train_steps(model, optimizer)
    save(model, optimizer, out_dir, info)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_optimizer_state_dict(model, optimizer, options=options)
    if info.is_main:
        flat = {f"{n}.{k}": v for n, fields in full["state"].items() for k, v in fields.items()}
        save_file(flat, os.path.join(out_dir, "expected.safetensors"))
    dist.teardown()
    os._exit(0)  # as tests/test_dist.py's one_step


def load_two(rank, world_size, port, ckpts, out_dir):
    """Load each checkpoint into a fresh optimizer of the sharded model,
    unpickling nothing; write this rank's local state and learning rate."""
    join_group(rank, world_size, port)
    info = dist.setup("cpu")
    model = dist.shard_model(tiny_model(), info, mixed_precision=False)
    for i, ckpt in enumerate(ckpts):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
        patch = pytest.MonkeyPatch()
        forbid_unpickling(patch)
        checkpoints.load_trainer_state(ckpt, model, optimizer, info)
        patch.undo()
        out = os.path.join(out_dir, f"{i}-rank{rank}")
        save_file(named_state(model, optimizer), out + ".safetensors")
        with open(out + ".json", "w") as f:
            json.dump([g["lr"] for g in optimizer.param_groups], f)
    dist.teardown()
    os._exit(0)


def spawn(fn, *args):
    mp.start_processes(fn, args=(2, free_port(), *args), nprocs=2, start_method="spawn")


# -----------------------------------------------------------------------------
# The tests


def assert_rows_equal(local: dict, expected: dict, rank: int, world_size: int):
    """Every tensor of one rank's state is its rows of the whole state
    (AdamW's step: whole)."""
    assert local.keys() == expected.keys()
    for key, whole in expected.items():
        want = whole
        if whole.dim() > 0 and world_size > 1:
            begin, end = checkpoints.shard_rows(whole.shape[0], rank, world_size)
            want = whole[begin:end]
        assert torch.equal(local[key], want), (key, rank, world_size)


def write_single_file(ckpt, state: dict):
    """Rewrite ckpt/trainer as checkpoints older than the per-rank files
    were: optimizer.safetensors with every tensor whole, optimizer.json with
    param_groups and the fields that are not tensors."""
    trainer = os.path.join(ckpt, "trainer")
    for name in os.listdir(trainer):
        if name.startswith("optimizer"):
            os.remove(os.path.join(trainer, name))
    tensors = {f"{n}.{k}": v for n, fields in state["state"].items() for k, v in fields.items()}
    save_file(tensors, os.path.join(trainer, "optimizer.safetensors"))
    layout = {"param_groups": state["param_groups"], "state": {}}
    with open(os.path.join(trainer, "optimizer.json"), "w") as f:
        json.dump(layout, f)


def test_one_process_save_then_load_is_identical_and_no_pickle(tmp_path, monkeypatch):
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    train_steps(model, optimizer)
    ckpt = save(model, optimizer, tmp_path, dist.DistInfo())
    assert [f for f in files_of(ckpt) if f.startswith("trainer/")] == [
        "trainer/optimizer-rank00000-of-00001.safetensors",
        "trainer/optimizer.json",
        "trainer/trainer_state.json",
    ]
    assert_no_pickle([os.path.join(ckpt, f) for f in files_of(ckpt)])
    assert checkpoints.unresumable(ckpt) is None
    forbid_unpickling(monkeypatch)
    fresh = torch.optim.AdamW(model.parameters(), lr=1.0)
    checkpoints.load_trainer_state(ckpt, model, fresh, dist.DistInfo())
    saved = optimizer.state_dict()
    loaded = fresh.state_dict()
    assert json.loads(json.dumps(saved["param_groups"])) == loaded["param_groups"]
    assert saved["state"].keys() == loaded["state"].keys()
    for i, fields in saved["state"].items():
        assert fields.keys() == loaded["state"][i].keys()
        for k, v in fields.items():
            assert torch.equal(v, loaded["state"][i][k]), (i, k)


def test_resumed_runs_of_either_format_equal_the_uninterrupted_one(tmp_path):
    """train.py stopped at step 2 and resumed to 4 gives the 4-step run's
    metrics, from a checkpoint of today's files and rewritten as an older
    single-file one."""
    from test_train import strip_timing, tiny

    import train

    full = train.train(tiny(tmp_path / "a", "--max_steps=4"))
    for name, older in (("b", False), ("c", True)):
        train.train(tiny(tmp_path / name, "--max_steps=2"))
        ckpt = tmp_path / name / "run" / "checkpoint-2"
        if older:
            write_single_file(ckpt, checkpoints.read_optimizer(str(ckpt / "trainer")))
            assert "optimizer.safetensors" in os.listdir(ckpt / "trainer")
        assert checkpoints.unresumable(ckpt) is None
        resume = tiny(tmp_path / name, "--resume_from_checkpoint=true", "--max_steps=4")
        resumed = train.train(resume)
        assert strip_timing(resumed) == strip_timing(full), name


def test_two_processes_save_one_loads_and_one_saves_two_load(tmp_path, monkeypatch):
    """2 -> 1, 2 -> 2, 1 -> 2, and an older single file -> 2 and -> 1:
    every rank holds its rows of the state that was saved, bit for bit."""
    two = tmp_path / "two"
    spawn(save_two, str(two))
    ckpt2 = str(two / "checkpoint-2")
    expected2 = load_file(two / "expected.safetensors")
    assert [f for f in files_of(ckpt2) if f.startswith("trainer/")] == [
        "trainer/optimizer-rank00000-of-00002.safetensors",
        "trainer/optimizer-rank00001-of-00002.safetensors",
        "trainer/optimizer.json",
        "trainer/trainer_state.json",
    ]
    assert_no_pickle([os.path.join(ckpt2, f) for f in files_of(ckpt2)])
    assert not [f for f in os.listdir(two) if f.endswith(".tmp")]
    layout = json.load(open(os.path.join(ckpt2, "trainer", "optimizer.json")))
    assert layout["world_size"] == 2
    assert layout["tensors"]["embed_tokens.weight.exp_avg"] == {
        "shape": [97, 32],
        "dtype": "float32",
        "rows": [[0, 49], [49, 97]],
    }
    rank1 = load_file(os.path.join(ckpt2, "trainer", "optimizer-rank00001-of-00002.safetensors"))
    assert rank1["embed_tokens.weight.exp_avg"].shape == (48, 32)  # its own rows only
    assert not [k for k in rank1 if k.endswith(".step")]  # rank 0 writes those

    # one process saves
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    train_steps(model, optimizer)
    ckpt1 = save(model, optimizer, tmp_path / "one", dist.DistInfo())
    expected1 = named_state(model, optimizer)
    older = str(tmp_path / "older")
    shutil.copytree(ckpt1, older)
    write_single_file(older, checkpoints.read_optimizer(os.path.join(ckpt1, "trainer")))

    # one process loads
    forbid_unpickling(monkeypatch)
    for ckpt, expected in ((ckpt2, expected2), (older, expected1)):
        fresh = torch.optim.AdamW(model.parameters(), lr=1.0)
        checkpoints.load_trainer_state(ckpt, model, fresh, dist.DistInfo())
        assert [g["lr"] for g in fresh.param_groups] == [LR]
        assert_rows_equal(named_state(model, fresh), expected, 0, 1)
    monkeypatch.undo()

    # two processes load
    loads = [(ckpt2, expected2), (ckpt1, expected1), (older, expected1)]
    spawn(load_two, [c for c, _ in loads], str(tmp_path))
    for i, (_, expected) in enumerate(loads):
        for rank in (0, 1):
            local = load_file(tmp_path / f"{i}-rank{rank}.safetensors")
            assert_rows_equal(local, expected, rank, 2)
            assert json.load(open(tmp_path / f"{i}-rank{rank}.json")) == [LR]

    # what unresumable says of the optimizer's files
    trainer = os.path.join(ckpt2, "trainer")
    rank1_file = os.path.join(trainer, "optimizer-rank00001-of-00002.safetensors")
    whole = open(rank1_file, "rb").read()
    open(rank1_file, "wb").write(whole[:-1])
    problem = checkpoints.unresumable(ckpt2)
    assert problem.startswith("trainer/optimizer-rank00001-of-00002.safetensors is truncated")
    os.remove(rank1_file)
    assert checkpoints.unresumable(ckpt2) == (
        "no trainer/optimizer-rank00001-of-00002.safetensors (trainer/optimizer.json names it)"
    )
    os.remove(os.path.join(older, "trainer", "optimizer.safetensors"))
    assert checkpoints.unresumable(older) == (
        "no trainer/optimizer.safetensors (trainer/optimizer.json names it)"
    )


@pytest.mark.parametrize("saved_by", [1, 2, 3, 4])
def test_any_rows_read_from_any_number_of_files(tmp_path, saved_by):
    """ShardReader cuts rows across file boundaries and empty shards
    (5 rows on 4 ranks: 2, 2, 1, 0) for every world size that reads."""
    whole = torch.arange(5 * 3, dtype=torch.float32).reshape(5, 3)  # [5,3]
    rows = [checkpoints.shard_rows(5, r, saved_by) for r in range(saved_by)]
    files = []
    for r, (begin, end) in enumerate(rows):
        files.append(checkpoints.rank_file(r, saved_by))
        save_file({"w.exp_avg": whole[begin:end].clone()}, tmp_path / files[-1])
    layout = {"files": files, "tensors": {"w.exp_avg": {"shape": [5, 3], "rows": rows}}}
    with checkpoints.ShardReader(str(tmp_path), layout) as reader:
        assert torch.equal(reader.read("w.exp_avg"), whole)
        for world in range(1, 7):
            for rank in range(world):
                begin, end = checkpoints.shard_rows(5, rank, world)
                got = reader.read("w.exp_avg", [begin, end])
                assert torch.equal(got, whole[begin:end]), (world, rank)
