"""The dry run's memory plan (nanogrpo/run/plan.py) against the measured peak of the tensors a run
holds: a TorchDispatchMode sees every tensor an aten op makes and keeps a weak reference to its
storage, so the bytes alive after each op, and their peak, are the run's own (the Python runtime
and the allocator's slack are not tensors, and not planned)."""

import json
import os

import pytest
import torch
from conftest import fixture_path, real_folder
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import train
from nanogrpo.run import plan
from nanogrpo.run.configurator import load_config, read_config_file


class PeakTensorBytes(TorchDispatchMode):
    """Bytes of the tensor storages made while active and still alive, after each op; their peak."""

    def __init__(self):
        super().__init__()
        self.alive = {}  # storage address -> (weak reference, bytes)
        self.bytes = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key, (ref, n) in list(self.alive.items()):
            if ref.expired():
                del self.alive[key]
                self.bytes -= n
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.alive:
                    self.alive[key] = (StorageWeakRef(storage), storage.nbytes())
                    self.bytes += storage.nbytes()
        self.peak = max(self.peak, self.bytes)
        return out


def _measured_and_planned(argv):
    cfg = load_config(argv + ["--max_steps=1", "--eval_strategy=no", "--save_steps=0"])
    planned = plan.plan(cfg, 1)
    with PeakTensorBytes() as mode:
        train.train(cfg)
    return mode.peak, planned


def test_the_plan_of_the_default_is_within_25_percent_of_its_peak(tmp_path):
    init = read_config_file("tiny")["init_model"]
    argv = ["--config", "tiny.py", f"--model={tmp_path}/init", f"--init_model={init!r}"]
    peak, planned = _measured_and_planned(argv + [f"--output_dir={tmp_path}/run"])
    assert abs(planned["total"] - peak) <= 0.25 * peak, (planned["total"], peak, planned)


def test_the_plan_of_smollm2_is_within_25_percent_of_its_peak(tmp_path):
    model = real_folder("smollm2-135m-instruct")
    argv = ["--config", "smollm.py", f"--model={model}", "--max_completion_length=8"]
    peak, planned = _measured_and_planned(argv + [f"--output_dir={tmp_path}/run"])
    assert abs(planned["total"] - peak) <= 0.25 * peak, (planned["total"], peak, planned)


def test_a_dry_run_reads_only_the_config_and_writes_only_the_plan(tmp_path, capsys):
    """small.py on 8 processes planned from one: the model's config.json alone (a tiny Qwen2
    fixture's), every sharded line an eighth of one process's, plan.json and nothing else."""
    out = tmp_path / "out"
    argv = ["--config", "small.py", f"--model={fixture_path('qwen2')}", f"--output_dir={out}"]
    argv += ["--dry_run=true", "--max_prompt_length=256"]
    assert train.train(load_config(argv + ["--dry_run_world_size=8"])) == []
    assert os.listdir(out) == ["plan.json"]
    eight = json.loads((out / "plan.json").read_text())
    assert "memory plan:" in capsys.readouterr().out
    one = plan.plan(load_config(argv), 1)
    assert eight["world_size"] == 8 and eight["prompt_tokens"] == 256
    for name in ("parameters", "gradients", "optimizer"):
        assert eight["bytes"][name] == one["bytes"][name] // 8, name
    assert eight["bytes"]["gathered_parameters"] == one["parameters"] * 2  # bf16, whole
    assert eight["micro_batch"] == 16 and eight["completions_per_rank_per_round"] == 64


def test_an_offline_hub_id_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = load_config(["--config", "small.py", f"--output_dir={tmp_path}", "--dry_run=true"])
    with pytest.raises(OSError, match="config.json.*local checkpoint directory"):
        plan.plan(cfg, 8)
