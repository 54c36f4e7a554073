"""dist.py: FSDP2 on CPU/gloo with 2 processes gives what 1 process gives;
bf16 is one rule; torchrun end to end."""

import json
import math
import os
import socket
import subprocess
import sys
import warnings
from contextlib import nullcontext

import conftest
import pytest
import torch
import torch.multiprocessing as mp
from conftest import ROOT, fixture_path

from nanogrpo import fast
from nanogrpo.run.configurator import read_config_file
from nanogrpo.trainer import Kernels


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_group(rank, world_size, port):
    """torchrun's environment for this spawned process, one thread."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)


def one_step(
    rank, world_size, port, family, out_path, lora_settings=None, entropy=False, packed=False
):
    """Load the fixture (sharded when world_size > 1; with LoRA adapters
    when lora_settings; with entropy, the adaptive entropy bonus on), take
    one optimizer step on this rank's share of a fixed global batch (packed:
    with padding_free's kernels), save the full weights from rank 0."""
    join_group(rank, world_size, port)
    from nanogrpo import distributed as dist
    from nanogrpo.checkpoint import load_model

    # split off zero-advantage rows even for the fixture's small model
    from nanogrpo.fast import logprobs
    from nanogrpo.rollout import Rollout
    from nanogrpo.run.config import TrainConfig

    logprobs.SKIP_MIN_FLOPS["cpu"] = 0
    info = dist.setup("cpu")
    torch.manual_seed(0)  # a fresh adapter's A (rank 0's is broadcast)
    model = load_model(fixture_path(family), info=info, lora_settings=lora_settings)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    N, P, C = 8, 5, 6  # global rows, prompt and completion lengths
    ids = torch.randint(0, 300, (N, P + C), generator=g)
    attention_mask = torch.ones(N, P + C, dtype=torch.long)
    attention_mask[::3, :2] = 0  # some left-padded prompts
    # Rows 0-5 in pairs that share a prompt (a group); 6 and 7 alone, so
    # that rank 1's last micro-batch shares no prompt while rank 0's does:
    # every rank must still make the same collectives.
    ids[1:6:2, :P] = ids[0:6:2, :P]
    attention_mask[1:6:2, :P] = attention_mask[0:6:2, :P]
    lengths = torch.randint(1, C + 1, (N,), generator=g)
    mask = (torch.arange(C)[None] < lengths[:, None]).float()
    advantages = torch.randn(N, generator=g)
    old_logps = -torch.rand(N, C, generator=g) * 6
    # rows scored without gradient: all of rank 0's micro-batch 2, one row
    # of rank 1's 1
    advantages[2:5] = 0
    n = N // world_size
    mine = slice(rank * n, (rank + 1) * n)
    local = Rollout(
        rows=[],
        num_generations=2,
        prompt_ids=[],
        input_ids=ids[mine],
        attention_mask=attention_mask[mine],
        completion_mask=mask[mine],
        completion_lengths=mask[mine].sum(1).long(),
        truncated=torch.zeros(n, dtype=torch.bool),
        prompts=[],
        completions=[],
        completion_token_ids=[],
        advantages=advantages[mine],
        old_logps=old_logps[mine],
        num_items=mask.sum(),
    )  # active tokens of the step on all ranks
    micro = [torch.arange(i, i + 2) for i in range(0, n, 2)]  # micro-batches of 2 rows
    cfg = TrainConfig(temperature=0.9, max_grad_norm=0.5, per_device_train_batch_size=2)
    from nanogrpo.extras.loss_terms import loss_settings

    loss_cfg, terms = loss_settings(
        loss_type="dapo",
        epsilon_high=0.28,
        use_adaptive_entropy=entropy,
        entropy_coef=0.05,
        entropy_target=100.0,
        entropy_coef_delta=0.01,
    )
    from types import SimpleNamespace

    t = SimpleNamespace(  # the fields of train.Trainer an optimizer step reads
        model=model,
        optimizer=optimizer,
        cfg=cfg,
        loss_cfg=loss_cfg,
        loss_terms=terms,
        info=info,
        autocast=nullcontext(),
        tok=SimpleNamespace(vocab_size=None),
        sched=SimpleNamespace(steps_per_generation=len(micro)),
        kernels=Kernels(**fast.kernels() | fast.packing.packed_kernels(packed)),
        entropy_coef=terms.entropy_coef,
        last_entropy=0.0,
    )  # at or below the target: the bonus applies
    metrics = conftest.optimizer_step(t, [(local, idx) for idx in micro])
    state = dist.full_state_dict(model)
    if info.is_main:
        torch.save(
            {
                "state": state,
                "grad_norm": metrics["grad_norm"],
                "entropy": t.last_entropy,
                "entropy_coef": t.entropy_coef,
            },
            out_path,
        )
    dist.teardown()
    # Known, not ours to fix here: about 1 run in 10, a spawned gloo rank
    # aborts in C++ static destructors at interpreter exit ("terminate called
    # without an active exception") after all its work is done. Leave without
    # running them; the result is already on disk.
    os._exit(0)


LORA = {"r": 4, "target_modules": "all-linear", "lora_dropout": 0.0}


@pytest.mark.parametrize(
    "family,lora,entropy",
    [
        ("qwen2", None, False),
        ("llama3", None, False),  # tied and untied LM head
        ("llama3", LORA, False),
        ("qwen2", None, True),
        ("smollm3", None, False),  # NoPE layers
        ("smollm3", LORA, False),
        ("gemma3", None, False),  # sliding windows, Gemma's norms
        ("gemma3", LORA, False),
        ("qwen3_5", None, False),  # Gated DeltaNet layers, gated attention
        ("qwen3_5", LORA, False),
    ],
)  # the entropy's gradient and its all-process mean
def test_two_processes_match_one(tmp_path, family, lora, entropy):
    results = {}
    for world in (1, 2):
        out = tmp_path / f"w{world}.pt"
        mp.start_processes(
            one_step,
            args=(world, free_port(), family, str(out), lora, entropy),
            nprocs=world,
            start_method="spawn",
            join=True,
        )
        results[world] = torch.load(out)
    assert results[1]["grad_norm"] == pytest.approx(results[2]["grad_norm"], rel=1e-5)
    assert results[1]["entropy"] == pytest.approx(results[2]["entropy"], rel=1e-6)
    assert results[1]["entropy_coef"] == results[2]["entropy_coef"]
    if entropy:  # below the target: one delta up
        assert results[1]["entropy_coef"] == pytest.approx(0.06)
    one, two = results[1]["state"], results[2]["state"]
    assert one.keys() == two.keys()
    before = Transformer_state(family)
    for k in one:
        if ".lora_B" in k:
            assert one[k].abs().sum() > 0, k  # the adapter trained (B starts at zero)
        elif lora and ".lora_A" not in k:
            assert torch.equal(one[k], before[k]), k  # the frozen base did not move
        elif not lora:
            # the step changed the weights
            assert not torch.equal(one[k], before[k]) or k.endswith("bias"), k
        assert torch.allclose(one[k], two[k], atol=1e-5, rtol=1e-5), k


def forward_backward(rank, world_size, port, out_dir):
    """For each dtype setting: load the fixture as train.py does (sharded
    when world_size > 1, bf16 by the config's rule), take logits and token
    log-probs with grad under dist.autocast, backward; save the logits and
    every warning raised."""
    join_group(rank, world_size, port)
    from nanogrpo import distributed as dist
    from nanogrpo.checkpoint import load_model
    from nanogrpo.fast.logprobs import token_logprobs
    from nanogrpo.run.config import TrainConfig

    info = dist.setup("cpu")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 300, (4, 10), generator=g)
    out = {}
    for dtype in ("float32", "bfloat16"):
        bf16 = TrainConfig(bf16=dtype == "bfloat16").use_bf16(info.device)
        model = load_model(fixture_path("qwen2"), info=info, mixed_precision=bf16)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with dist.autocast(info, bf16):
                logits = model(ids)  # [4,10,V]
                logps, _ = token_logprobs(model, ids, torch.ones_like(ids), torch.ones(4, 4))
            (logps.sum() + logits.float().mean()).backward()
        out[dtype] = {
            "logits": logits.detach().float(),
            "logits_dtype": str(logits.dtype),
            "warnings": [str(w.message) for w in caught],
        }
    torch.save(out, os.path.join(out_dir, f"w{world_size}-rank{rank}.pt"))
    dist.teardown()
    os._exit(0)  # as one_step


def test_bf16_is_one_rule_and_fsdp_returns_no_views(tmp_path):
    """Regressions: bf16 on CPU computed in fp32 with one process
    (autocast was CUDA-only) and in bf16 with two (FSDP2's mixed precision);
    and every FSDP2 forward with grad warned "returned a view tensor"
    (token_logprobs' head returns h[:, -1], a view)."""
    results = {}
    for world in (1, 2):
        mp.start_processes(
            forward_backward,
            args=(world, free_port(), str(tmp_path)),
            nprocs=world,
            start_method="spawn",
            join=True,
        )
        results[world] = [torch.load(tmp_path / f"w{world}-rank{r}.pt") for r in range(world)]
    for dtype in ("float32", "bfloat16"):
        one = results[1][0][dtype]
        two = results[2][0][dtype]
        assert one["logits_dtype"] == f"torch.{dtype}"
        assert two["logits_dtype"] == f"torch.{dtype}"
        # bf16: autocast and FSDP2's mixed precision round at different
        # points (a few bf16 steps at |logit| ~4)
        tolerance = 1e-5 if dtype == "float32" else 0.1
        assert torch.allclose(one["logits"], two["logits"], atol=tolerance), dtype
        for rank in results[2]:
            caught = rank[dtype]["warnings"]
            assert not [w for w in caught if "view tensor" in w], caught


def spanning_step(rank, world_size, port, out_path):
    """One optimizer step of a fixed global batch of 24 completions in groups of 8, each rank
    holding a consecutive slice of 24 / world_size (on 2 or 8 ranks a group spans ranks): this
    rank's rewards gathered, advantages over whole groups (train.advantages_of), this rank's
    rows trained. Saves rank 0's view of the result."""
    join_group(rank, world_size, port)
    from types import SimpleNamespace

    import train
    from nanogrpo import distributed as dist
    from nanogrpo.checkpoint import load_model
    from nanogrpo.grpo import LossConfig
    from nanogrpo.rollout import Rollout
    from nanogrpo.run.config import TrainConfig

    info = dist.setup("cpu")
    model = load_model(fixture_path("qwen2"), info=info)
    # SGD: the update is the gradient itself (Adam's first step would blow up the rounding noise
    # of gradients that are 0 in exact arithmetic, such as the key bias's)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    N, G, P, C = 24, 8, 5, 6
    ids = torch.randint(0, 300, (N, P + C), generator=g)
    ids[:, :P] = ids[::G, :P].repeat_interleave(G, dim=0)  # a group shares its prompt
    mask = (torch.arange(C)[None] < torch.randint(1, C + 1, (N,), generator=g)[:, None]).float()
    rewards = torch.rand(N, 1, generator=g)
    n = N // world_size
    mine = slice(rank * n, (rank + 1) * n)
    cfg = TrainConfig(
        per_device_train_batch_size=n, num_generations=G, max_grad_norm=1.0, temperature=0.9
    ).validate(world_size)
    t = SimpleNamespace(  # the fields of train.Trainer that advantages and a step read
        model=model,
        optimizer=optimizer,
        cfg=cfg,
        loss_cfg=LossConfig(loss_type="dapo"),
        loss_terms=None,
        info=info,
        autocast=nullcontext(),
        tok=SimpleNamespace(vocab_size=None),
        kernels=Kernels(**fast.kernels()),
        sched=cfg.schedule(world_size),
        reward_weights=torch.ones(1),
        entropy_coef=0.0,
        last_entropy=float("inf"),
    )
    gathered = dist.all_gather_rows(rewards[mine], info)
    advantages = train.advantages_of(t, gathered, G)
    ro = Rollout(
        rows=[],
        num_generations=1,
        prompt_ids=[],
        input_ids=ids[mine],
        attention_mask=torch.ones_like(ids[mine]),
        completion_mask=mask[mine],
        completion_lengths=mask[mine].sum(1).long(),
        truncated=torch.zeros(n, dtype=torch.bool),
        prompts=[],
        completions=[],
        completion_token_ids=[],
        advantages=advantages,
        num_items=dist.all_reduce_sum(mask[mine].sum(), info),
    )
    metrics = conftest.optimizer_step(t, [(ro, torch.arange(n))])
    all_advantages = dist.all_gather_rows(advantages, info)
    state = dist.full_state_dict(model)
    if info.is_main:
        torch.save(
            {"state": state, "grad_norm": metrics["grad_norm"], "advantages": all_advantages},
            out_path,
        )
    dist.teardown()
    os._exit(0)  # see one_step


def test_groups_that_span_processes_train_as_one_process(tmp_path):
    """2 and 8 ranks, each with a slice that cuts groups (12 and 3 rows of groups of 8), give the
    advantages and the update of 1 process on the same global batch."""
    results = {}
    for world in (1, 2, 8):
        out = tmp_path / f"w{world}.pt"
        mp.start_processes(
            spanning_step,
            args=(world, free_port(), str(out)),
            nprocs=world,
            start_method="spawn",
            join=True,
        )
        results[world] = torch.load(out)
    one = results[1]
    assert one["advantages"].abs().sum() > 0
    for world in (2, 8):
        other = results[world]
        assert torch.allclose(one["advantages"], other["advantages"], atol=1e-6)
        assert one["grad_norm"] == pytest.approx(other["grad_norm"], rel=1e-5)
        for k in one["state"]:
            assert torch.allclose(one["state"][k], other["state"][k], atol=1e-5, rtol=1e-5), k


def Transformer_state(family):
    from nanogrpo.checkpoint import load_model

    return load_model(fixture_path(family)).state_dict()


def torchrun(*args, timeout=300, pythonpath=None, nproc=2, script=None):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        script or os.path.join(ROOT, "train.py"),
        *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if pythonpath:  # where the ranks import a test's reward function from
        env["PYTHONPATH"] = os.pathsep.join([pythonpath, env.get("PYTHONPATH", "")])
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def test_torchrun_tiny_train_save_resume(tmp_path):
    init = f"--init_model={read_config_file('tiny')['init_model']!r}"
    common = [
        "--config",
        "tiny.py",
        f"--model={tmp_path}/init",
        init,
        f"--output_dir={tmp_path}/run",
        "--gradient_accumulation_steps=2",
        "--num_generations=4",
        "--per_device_train_batch_size=4",
        "--max_completion_length=6",
        "--eval_strategy=no",
    ]
    first = torchrun(*common, "--max_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "2 process(es)" in first.stdout
    assert "done: 2 steps" in first.stdout
    resumed = torchrun(*common, "--max_steps=4", "--resume_from_checkpoint=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    assert "done: 4 steps" in resumed.stdout
    metrics = open(tmp_path / "run" / "metrics.jsonl")
    lines = [json.loads(line) for line in metrics]
    assert [m["step"] for m in lines] == [1, 2, 3, 4]

    from nanogrpo.checkpoint import load_model
    from nanogrpo.sampler import Sampling, generate
    from nanogrpo.tokenizer import Tokenizer

    ckpt = tmp_path / "run" / "checkpoint"
    model = load_model(ckpt)
    tok = Tokenizer.from_pretrained(ckpt)
    settings = Sampling(max_new_tokens=6, stop_ids=tok.eos_token_ids, pad_id=tok.pad_token_id)
    gen = torch.Generator().manual_seed(0)
    out = generate(model, [tok.encode("abcd=")], settings, num_samples=2, generator=gen)
    assert out.completion_ids.shape[0] == 2


def test_torchrun_dynamic_sampling_and_adaptive_entropy(tmp_path):
    """Two ranks draw extra batches in step (one may have its groups while the other still looks)
    and agree on the adaptive entropy coefficient."""
    init = f"--init_model={read_config_file('tiny')['init_model']!r}"
    # most groups of the untrained model score all 0: more batches are drawn
    (tmp_path / "starts_with_a.py").write_text(
        "def starts_with_a(completions, **kwargs):\n"
        "    return [float(c.startswith('a')) for c in completions]\n"
    )
    done = torchrun(
        "--config",
        "tiny.py",
        f"--model={tmp_path}/init",
        init,
        f"--output_dir={tmp_path}/run",
        "--gradient_accumulation_steps=2",
        "--num_generations=4",
        "--per_device_train_batch_size=4",
        "--max_completion_length=6",
        "--eval_strategy=no",
        "--max_steps=3",
        "--dynamic_sampling=true",
        "--reward_funcs=starts_with_a:starts_with_a",
        "--use_adaptive_entropy=true",
        "--entropy_target=5.0",
        pythonpath=str(tmp_path),
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    lines = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [m["step"] for m in lines] == [1, 2, 3]
    for m in lines:
        assert m["dynamic_sampling/groups_drawn"] >= m["dynamic_sampling/groups_kept"]
    assert sum(m["dynamic_sampling/gen_batches"] for m in lines) > 3  # extra batches were drawn
    # the first step applies no bonus; each moves the coefficient one delta (0.005) up
    assert [round(m["entropy_coef"], 6) for m in lines] == [0.005, 0.01, 0.015]


@pytest.mark.parametrize(
    "nproc,shape,prompts",
    [
        (
            2,
            [
                "--per_device_train_batch_size=4",
                "--gradient_accumulation_steps=1",
                "--num_generations=8",
            ],
            1,
        ),  # a group over both ranks
        (
            2,
            [
                "--per_device_train_batch_size=6",
                "--gradient_accumulation_steps=2",
                "--num_generations=8",
            ],
            3,
        ),  # rank 0: a group and a half
        (
            8,
            [
                "--per_device_train_batch_size=4",
                "--gradient_accumulation_steps=2",
                "--num_generations=16",
            ],
            4,
        ),  # the seeds' recipe shape on 8 GPUs
    ],
)
def test_torchrun_trains_shapes_whose_groups_span_processes(tmp_path, nproc, shape, prompts):
    """TRL-valid shapes nanogrpo refused (each process had to hold whole groups) train with TRL's
    prompts per round."""
    init = f"--init_model={read_config_file('tiny')['init_model']!r}"
    done = torchrun(
        "--config",
        "tiny.py",
        f"--model={tmp_path}/init",
        init,
        f"--output_dir={tmp_path}/run",
        *shape,
        "--max_completion_length=6",
        "--eval_strategy=no",
        "--max_steps=2",
        nproc=nproc,
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert f"{nproc} process(es)" in done.stdout
    assert "groups span processes" in done.stdout
    assert f"{prompts} x " in done.stdout  # prompts x G per round
    lines = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [m["step"] for m in lines] == [1, 2]
    assert all(math.isfinite(m["loss"]) and m["grad_norm"] > 0 for m in lines)


def nested_gather(rank, world_size, port, out_dir):
    """Whether the parameters are still whole after an inner `gathered` ends inside an outer one,
    and sharded again after the outer ends."""
    join_group(rank, world_size, port)
    from torch.distributed.tensor import DTensor

    from nanogrpo import distributed as dist
    from nanogrpo.checkpoint import load_model

    info = dist.setup("cpu")
    model = load_model(fixture_path("qwen2"), info=info)
    weight = model.layers[0].mlp.gate_proj  # a block's linear: its weight is a DTensor when sharded
    with dist.gathered(model):
        with dist.gathered(model):  # rollout's, inside train.py's
            pass
        whole_after_inner = not isinstance(weight.weight, DTensor)
    sharded_after_outer = isinstance(weight.weight, DTensor)
    torch.save((whole_after_inner, sharded_after_outer), f"{out_dir}/rank{rank}.pt")
    dist.teardown()


def test_a_gather_inside_a_gather_leaves_the_parameters_to_the_outer_one(tmp_path):
    """train.py gathers the parameters before a round's local_work window (nothing collective
    may run inside it) and rollout gathers them too: the inner one must not shard them again
    when it ends, or a forward later in the window would gather them inside it."""
    mp.start_processes(
        nested_gather, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn"
    )
    for rank in range(2):
        assert torch.load(tmp_path / f"rank{rank}.pt") == (True, True)
