"""run.py and trainer_state.py around resume: one run per output_dir, the newest checkpoint that
can be resumed, settings a resume cannot change, any process count, no pickle, push_to_hub checked
before step 1."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, assert_no_pickle, forbid_unpickling
from test_dist import torchrun

import train
from nanogrpo.checkpoint import load_model
from nanogrpo.run import checkpoints as trainer_state
from nanogrpo.run.config import ConfigError
from nanogrpo.run.configurator import load_config, read_config_file

INIT = f"--init_model={read_config_file('tiny')['init_model']!r}"
TIMING = ("step_time", "tokens_per_sec", "time/")
# TRL's TR-DPO reference: mixed toward the policy after every step
SYNC = ["--beta=0.04", "--sync_ref_model=true", "--ref_model_sync_steps=1"]


def tiny_args(tmp_path, *overrides):
    """test_train.tiny's command line: the embedded default, made small, under tmp_path."""
    return [
        "--config",
        "tiny.py",
        f"--model={tmp_path}/init",
        INIT,
        f"--output_dir={tmp_path}/run",
        "--gradient_accumulation_steps=2",
        "--num_generations=4",
        "--per_device_train_batch_size=8",
        "--max_completion_length=6",
        "--eval_strategy=no",
        "--max_steps=3",
        *overrides,
    ]


def tiny(tmp_path, *overrides):
    return load_config(tiny_args(tmp_path, *overrides))


def untimed(history):
    return [{k: v for k, v in m.items() if not k.startswith(TIMING)} for m in history]


def train_py(*args, env=None, **kwargs):
    """`python train.py ARGS` in a process of its own, one thread."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "train.py"), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


GATE = """import os, time

def gate(completions, **kwargs):
    '''Waits until the file $GATE exists (at most a minute): holds a run at its first round.'''
    deadline = time.time() + 60
    while not os.path.exists(os.environ["GATE"]) and time.time() < deadline:
        time.sleep(0.05)
    return [float(c.startswith("a")) for c in completions]
"""


def gated_run(tmp_path, *args):
    """A run that stops at its first reward until tmp_path/go exists; returned once it holds its
    output_dir's lock."""
    (tmp_path / "gate.py").write_text(GATE)
    env = {"GATE": str(tmp_path / "go"), "PYTHONPATH": str(tmp_path)}
    proc = train_py(*tiny_args(tmp_path, "--reward_funcs=gate:gate", *args), env=env)
    lock = tmp_path / "run" / "run.lock"
    deadline = time.time() + 60
    while not (lock.exists() and lock.read_text()) and proc.poll() is None:
        assert time.time() < deadline, "the run never took its lock"
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()
    return proc


# -----------------------------------------------------------------------------
# One run at a time in an output_dir


def test_a_second_run_into_a_busy_output_dir_is_refused_and_the_first_finishes(tmp_path):
    """Two runs into one output_dir both exited 0, metrics.jsonl interleaved their rows and the
    first run's checkpoints were overwritten."""
    first = gated_run(tmp_path, "--max_steps=2")
    second = train_py(*tiny_args(tmp_path, "--max_steps=2"))
    out, err = second.communicate(timeout=60)
    assert second.returncode == 2, out + err
    line = err.splitlines()[0]
    assert f"is in use by another run (pid {first.pid} on " in line
    assert "wait for it to end, or choose another --output_dir" in line
    (tmp_path / "go").touch()
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [m["step"] for m in rows] == [1, 2]
    assert trainer_state.unresumable(tmp_path / "run" / "checkpoint-2") is None


def test_a_killed_run_leaves_no_stale_lock(tmp_path, capsys):
    """kill -9 during a run (here: a save that never finished) blocks nothing: the OS released the
    lock, resume_from_checkpoint=true finds nothing saved and starts fresh (it said so, then
    refused the folder as holding a run)."""
    killed = gated_run(tmp_path, "--max_steps=2")
    os.kill(killed.pid, signal.SIGKILL)
    killed.communicate(timeout=60)
    os.makedirs(tmp_path / "run" / "checkpoint-1.tmp" / "trainer")  # a save killed mid-way
    history = train.train(tiny(tmp_path, "--max_steps=1", "--resume_from_checkpoint=true"))
    assert [m["step"] for m in history] == [1]
    out = capsys.readouterr().out
    assert "checkpoint-1.tmp, a save that did not finish" in out
    assert "no checkpoint in" in out and "starts fresh" in out
    assert "holds a run" not in out
    assert (tmp_path / "run" / "run.lock").read_text().startswith(f"pid {os.getpid()} ")
    assert sorted(p for p in os.listdir(tmp_path / "run") if p.startswith("checkpoint")) == [
        "checkpoint",
        "checkpoint-1",
    ]


# -----------------------------------------------------------------------------
# Which checkpoint a resume takes


def test_resume_takes_the_newest_checkpoint_that_can_be_resumed(tmp_path, capsys):
    """A dangling `checkpoint` link beside intact checkpoint-N folders said "no checkpoint, starts
    fresh" and then "holds a run: continue it with --resume_from_checkpoint=true"."""
    run = tmp_path / "run"
    train.train(tiny(tmp_path, "--max_steps=3", "--save_steps=1"))
    os.remove(run / "checkpoint-3" / "trainer" / "trainer_state.json")
    os.makedirs(run / "checkpoint-4.tmp")
    os.remove(run / "checkpoint")
    os.symlink("checkpoint-9", run / "checkpoint")
    capsys.readouterr()
    resume = ["--save_steps=1", "--resume_from_checkpoint=true"]
    history = train.train(tiny(tmp_path, "--max_steps=4", *resume))
    out = capsys.readouterr().out
    passed = "cannot be resumed (no trainer/trainer_state.json): passed over"
    assert f"{run}/checkpoint-3 {passed}" in out
    assert f"removed {run}/checkpoint-4.tmp, a save that did not finish" in out
    assert "points at checkpoint-9, which is gone" in out
    assert f"resumed from {run}/checkpoint-2 at step 2" in out
    assert [m["step"] for m in history] == [1, 2, 3, 4]
    assert os.path.realpath(run / "checkpoint") == str(run / "checkpoint-4")
    assert not [p for p in os.listdir(run) if ".tmp" in p]
    for name in ("checkpoint-1", "checkpoint-2", "checkpoint-3", "checkpoint-4"):
        os.remove(run / name / "train_config.json")
    none = (
        r"no checkpoint in .* can be resumed \(checkpoint-4, checkpoint-3, checkpoint-2, "
        r"checkpoint-1 lack files or hold damaged ones\): start over with --overwrite_output_dir"
    )
    with pytest.raises(ConfigError, match=none):
        train.train(tiny(tmp_path, "--max_steps=5", "--resume_from_checkpoint=true"))


def cut(path, keep: int):
    """Keep the first `keep` bytes of the file (negative: all but the last -keep)."""
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[:keep])


def test_a_damaged_newest_checkpoint_is_passed_over_by_name(tmp_path, capsys):
    """A truncated model.safetensors in the newest checkpoint stopped the resume with safetensors'
    own error ("incomplete metadata, file not fully covered"), where a dangling `checkpoint` link
    fell back to the newest intact checkpoint with a note."""
    run = tmp_path / "run"
    train.train(tiny(tmp_path, "--max_steps=2", "--save_steps=1"))
    cut(run / "checkpoint-2" / "model.safetensors", -100)  # a save cut short by a full disk
    capsys.readouterr()
    history = train.train(tiny(tmp_path, "--max_steps=3", "--resume_from_checkpoint=true"))
    out = capsys.readouterr().out
    assert f"{run}/checkpoint-2 cannot be resumed (model.safetensors is truncated (" in out
    assert "points at checkpoint-2: resuming from" in out
    assert f"resumed from {run}/checkpoint-1 at step 1" in out
    assert [m["step"] for m in history] == [1, 2, 3]
    cut(run / "checkpoint-3" / "trainer" / "optimizer-rank00000-of-00001.safetensors", -1)
    resume = f"--resume_from_checkpoint={run}/checkpoint-3"
    damaged = "trainer/optimizer-rank00000-of-00001.safetensors is truncated"
    with pytest.raises(ValueError, match=damaged) as named:
        train.train(tiny(tmp_path, "--max_steps=4", resume))  # a path to a damaged one: one line
    assert "\n" not in str(named.value)


def test_unresumable_reads_only_headers_and_names_each_damage(tmp_path):
    """Each file a resume reads, whole or not: a safetensors file is as long as its header says
    (8 bytes of length, the JSON header, the data its offsets end at); JSON files parse."""
    train.train(tiny(tmp_path, "--max_steps=1"))
    ckpt = tmp_path / "run" / "checkpoint-1"
    assert trainer_state.unresumable(ckpt) is None
    model = ckpt / "model.safetensors"
    whole = open(model, "rb").read()
    damages = [
        (whole[:5], "model.safetensors is truncated (5 bytes: not even its header's length)"),
        (whole[:40], "model.safetensors is truncated (40 bytes: its header alone needs "),
        (whole[:-1], f"model.safetensors is truncated ({len(whole) - 1} bytes, its header "),
        (whole + b"x", f"model.safetensors is corrupt ({len(whole) + 1} bytes, its header "),
        (whole[:8] + b"{" * (len(whole) - 8), "model.safetensors is corrupt (its header is not"),
    ]
    for data, problem in damages:
        model.write_bytes(data)
        assert trainer_state.unresumable(ckpt).startswith(problem)
    model.write_bytes(whole)
    cut(ckpt / "trainer" / "trainer_state.json", 10)
    assert trainer_state.unresumable(ckpt).startswith(
        "trainer/trainer_state.json is not valid JSON"
    )


def test_resume_refuses_settings_that_change_what_trains(tmp_path, capsys):
    """Resuming a LoRA run with --use_peft=false or --lora_r=4 printed a note, trained the rank-16
    adapters anyway and recorded the new values in train_config.json."""
    lora = ["--use_peft=true", "--learning_rate=1e-2"]
    train.train(tiny(tmp_path, "--max_steps=1", *lora))
    resume = ["--max_steps=2", "--resume_from_checkpoint=true"]
    refused = (
        r"use_peft=False, but the checkpoint's run trained with use_peft=True.*drop "
        r"--use_peft to resume it, or start a new run in another --output_dir"
    )
    with pytest.raises(ConfigError, match=refused):
        train.train(tiny(tmp_path, *resume, "--learning_rate=1e-2"))
    refused = r"lora_r=4, lora_alpha=8, but .* lora_r=16, lora_alpha=32.*drop --lora_r --lora_alpha"
    with pytest.raises(ConfigError, match=refused):
        train.train(tiny(tmp_path, *resume, *lora, "--lora_r=4", "--lora_alpha=8"))
    capsys.readouterr()
    train.train(tiny(tmp_path, *resume, *lora, "--lora_dropout=0.3"))
    note = "note: lora_dropout was 0.05 in the checkpoint's run; 0.3 is ignored"
    assert note in capsys.readouterr().out
    saved = json.load(open(tmp_path / "run" / "checkpoint-2" / "train_config.json"))
    assert (saved["use_peft"], saved["lora_r"], saved["lora_dropout"]) == (True, 16, 0.05)
    full = tmp_path / "full"
    train.train(tiny(full, "--max_steps=1"))
    refused = "use_peft=True, but the checkpoint's run trained with use_peft=False"
    with pytest.raises(ConfigError, match=refused):
        train.train(tiny(full, *resume, "--use_peft=true"))


def starts_with_a(completions, **kwargs):
    return [float(c.startswith("a")) for c in completions]


def test_resume_with_another_dataset_names_it(tmp_path):
    """It said "sampler state is for 8 rows, this dataset has 4"."""
    for n in (8, 4):
        with open(tmp_path / f"data{n}.jsonl", "w") as f:
            for i in range(n):
                f.write(json.dumps({"prompt": "abc" + "abcdefgh"[i] + "="}) + "\n")
    common = [f"--reward_funcs={__name__}:starts_with_a", "--max_steps=1"]
    train.train(tiny(tmp_path, f"--dataset={tmp_path}/data8.jsonl", *common))
    named = (
        "the dataset has 4 rows, the checkpoint's run had 8: resume with the same dataset, "
        "or start a new run in another --output_dir"
    )
    with pytest.raises(ValueError, match=named):
        train.train(
            tiny(
                tmp_path,
                f"--dataset={tmp_path}/data4.jsonl",
                *common,
                "--max_steps=2",
                "--resume_from_checkpoint=true",
            )
        )


# -----------------------------------------------------------------------------
# Any number of processes, and no pickle


def optimizer_steps(ckpt) -> set:
    state = trainer_state.read_optimizer(ckpt / "trainer")
    return {fields["step"].item() for fields in state["state"].values()}


def saved_reference(ckpt) -> dict:
    """sync_ref_model's reference as ckpt saved it, every tensor whole, whatever the processes."""
    path = ckpt / "trainer"
    layout = json.load(open(path / trainer_state.REF_MODEL))
    layout["files"] = trainer_state.ref_files(path)
    with trainer_state.ShardReader(path, layout) as reader:
        return {name: reader.read(name) for name in layout["tensors"]}


def assert_synced(run, step: int, alpha=0.6):
    """checkpoint-<step>'s reference is the previous one mixed toward its policy once (TRL's
    ref_model_mixup_alpha, ref_model_sync_steps=1), bit for bit."""
    before = saved_reference(run / f"checkpoint-{step - 1}")
    after = saved_reference(run / f"checkpoint-{step}")
    policy = dict(load_model(run / f"checkpoint-{step}").named_parameters())
    for name, ref in before.items():
        mixed = ref.clone().mul_(1 - alpha).add_(policy[name].detach(), alpha=alpha)
        assert torch.equal(after[name], mixed), name


def test_a_checkpoint_of_two_processes_resumes_on_one_and_back_without_pickle(
    tmp_path, monkeypatch, capsys
):
    """Resuming a 2-process checkpoint on 1 process said "optimizer.pt ... corrupt" (it held
    torch.distributed.checkpoint's folder, whose .metadata is a pickle: loading it unpickled).
    With sync_ref_model the reference goes with it: each process saves its shard; 2 -> 2 resumes
    exactly, 2 -> 1 and 1 -> 2 read the shards of the new layout; another process count says, in
    one line, that it continues the run, not replays it (it said only that the batch differs)."""
    args = tiny_args(tmp_path, "--per_device_train_batch_size=4", "--save_steps=1", *SYNC)
    two = torchrun(*args, "--max_steps=2")
    assert two.returncode == 0, two.stderr[-3000:]
    run = tmp_path / "run"
    before = [json.loads(line) for line in open(run / "metrics.jsonl")]
    shards = sorted(p.name for p in (run / "checkpoint-1" / "trainer").glob("ref_model-*"))
    assert shards == [f"ref_model-rank0000{r}-of-00002.safetensors" for r in (0, 1)]
    again = torchrun(*args, "--max_steps=2", f"--resume_from_checkpoint={run}/checkpoint-1")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "process(es), this run has" not in again.stdout
    assert untimed(json.loads(line) for line in open(run / "metrics.jsonl")) == untimed(before)
    files = [os.path.join(d, f) for d, _, names in os.walk(run / "checkpoint-2") for f in names]
    assert not [f for f in files if f.endswith((".pt", ".bin", ".metadata", ".distcp", ".pkl"))]
    assert_no_pickle(files)
    import torch._dynamo  # noqa: F401  (the first model imports it, and it subclasses pickle's Unpickler)

    forbid_unpickling(monkeypatch)
    history = train.train(load_config([*args, "--max_steps=3", "--resume_from_checkpoint=true"]))
    monkeypatch.undo()
    out = capsys.readouterr().out
    note = [line for line in out.splitlines() if "process(es), this run has" in line]
    assert note == [
        f"note: {run}/checkpoint-2 was saved by 2 process(es), this run has 1: it continues the "
        "run but does not replay it (sampling is seeded per process, and a step takes "
        "per_device_train_batch_size completions from each, as in TRL), so its draws are not "
        "those of an uninterrupted run; the optimizer state is the same"
    ]
    assert "holds no synced reference" not in out
    assert untimed(history[:2]) == untimed(before) and [m["step"] for m in history] == [1, 2, 3]
    assert optimizer_steps(run / "checkpoint-3") == {3.0}  # AdamW's state went on: not a fresh one
    assert_synced(run, 3)  # from the reference of 2 processes
    back = torchrun(*args, "--max_steps=4", "--resume_from_checkpoint=true")
    assert back.returncode == 0, back.stderr[-3000:]
    assert "checkpoint-3 was saved by 1 process(es), this run has 2: it continues" in back.stdout
    assert optimizer_steps(run / "checkpoint-4") == {4.0}
    assert_synced(run, 4)  # from the reference of 1 process


# -----------------------------------------------------------------------------
# push_to_hub: what fails the first save fails before step 1


def test_push_to_hub_without_a_token_or_the_hub_fails_before_step_1(tmp_path):
    """push_to_hub=true offline trained to the first save (hours with save_steps=500), then a
    26-frame traceback."""
    hub = ["--push_to_hub=true", "--max_steps=1"]
    no_token = {"HF_TOKEN": "", "HF_HOME": str(tmp_path / "hf")}
    offline = {"HF_TOKEN": "hf_test", "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    no_token_line = "no Hugging Face token is set: log in with `hf auth login` or set HF_TOKEN"
    for env, why in (
        (no_token, no_token_line),
        (offline, "the hub repo 'run' cannot be created ("),
    ):
        start = time.time()
        done = train_py(*tiny_args(tmp_path, *hub), env=env)
        out, err = done.communicate(timeout=60)
        assert done.returncode == 2, out + err
        assert why in err.splitlines()[0] and "or set --push_to_hub=false" in err.splitlines()[0]
        assert "step" not in out and not os.path.exists(tmp_path / "run" / "metrics.jsonl")
        assert time.time() - start < 30


def test_a_one_process_checkpoint_of_the_older_format_still_resumes(tmp_path):
    """Checkpoints written before the optimizer moved to safetensors hold trainer/optimizer.pt
    (tensors and numbers, read with weights_only=True): one process resumes them exactly."""
    from test_train import strip_timing, tiny

    import train

    full = train.train(tiny(tmp_path / "a", "--max_steps=4"))
    train.train(tiny(tmp_path / "b", "--max_steps=2"))
    ckpt = tmp_path / "b" / "run" / "checkpoint-2" / "trainer"
    from nanogrpo.run.checkpoints import read_optimizer

    state = read_optimizer(str(ckpt))  # rewritten as the older code wrote it: ids, not names
    names = [n for group in state["param_groups"] for n in group["params"]]
    index = {n: i for i, n in enumerate(names)}
    state["state"] = {index[n]: v for n, v in state["state"].items()}
    for group in state["param_groups"]:
        group["params"] = [index[n] for n in group["params"]]
    torch.save(state, ckpt / "optimizer.pt")
    (ckpt / "optimizer.json").unlink()
    for f in ckpt.glob("optimizer-rank*.safetensors"):
        f.unlink()
    resumed = train.train(tiny(tmp_path / "b", "--resume_from_checkpoint=true", "--max_steps=4"))
    assert strip_timing(resumed) == strip_timing(full)


# -----------------------------------------------------------------------------
# sync_ref_model's reference is part of the run's state


def test_a_synced_reference_resumes_exactly(tmp_path, capsys):
    """A run with sync_ref_model resumed with the initial reference: its KL after the resume was
    not the uninterrupted run's (the synced weights were not saved). A checkpoint without them
    says so and continues from the initial reference."""
    full = train.train(tiny(tmp_path / "a", "--max_steps=4", *SYNC))
    train.train(tiny(tmp_path / "b", "--max_steps=2", *SYNC))
    resume = ["--resume_from_checkpoint=true", *SYNC]
    resumed = train.train(tiny(tmp_path / "b", "--max_steps=4", *resume))
    assert untimed(resumed) == untimed(full)
    ckpt = tmp_path / "b" / "run" / "checkpoint-2"
    shard = ckpt / "trainer" / "ref_model-rank00000-of-00001.safetensors"
    data = shard.read_bytes()
    shard.unlink()
    named = "no trainer/ref_model-rank00000-of-00001.safetensors (trainer/ref_model.json names it)"
    assert trainer_state.unresumable(ckpt) == named
    shard.write_bytes(data[:-1])
    assert trainer_state.unresumable(ckpt).startswith("trainer/ref_model-rank00000-of-00001")
    shard.unlink()
    (ckpt / "trainer" / "ref_model.json").unlink()  # as a checkpoint saved before them
    capsys.readouterr()
    older = train.train(
        tiny(tmp_path / "b", "--max_steps=3", *SYNC, f"--resume_from_checkpoint={ckpt}")
    )
    out = capsys.readouterr().out
    note = [line for line in out.splitlines() if "holds no synced reference model" in line]
    assert len(note) == 1, out
    assert f"the reference restarts from {tmp_path}/b/init, the initial weights" in note[0]
    assert untimed(older[:2]) == untimed(full[:2])
    assert older[2]["kl"] != full[2]["kl"]  # what the note warns of
