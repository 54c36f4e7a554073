"""The dry run's memory plan (nanogrpo/run/plan.py) against the measured peak of the tensors a run
holds: a TorchDispatchMode sees every tensor an aten op makes and keeps a weak reference to its
storage, so the bytes alive after each op, and their peak, are the run's own (the Python runtime
and the allocator's slack are not tensors, and not planned)."""

import json
import os
from types import SimpleNamespace

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


# -----------------------------------------------------------------------------
# What the dry run reads, evaluation's sampling, and what the totals are


# num_generations completions an eval prompt, TRL's default (tiny.py's held-out evaluation samples 1)
TRLS_EVAL = "--num_generations_eval=None"


def tiny_argv(tmp_path, *more):
    init = read_config_file("tiny")["init_model"]
    argv = ["--config", "tiny.py", f"--model={tmp_path}/init", f"--init_model={init!r}"]
    return argv + [f"--output_dir={tmp_path}/run", *more]


@pytest.fixture
def no_network(tmp_path, monkeypatch):
    """An empty huggingface_hub cache, every hf_hub_download call recorded, and any address
    lookup or connection recorded and refused."""
    import socket

    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # so a download would be tried
    calls = SimpleNamespace(downloads=[], network=[])
    download = huggingface_hub.hf_hub_download

    def recorded(*args, **kwargs):
        calls.downloads.append((args, kwargs))
        return download(*args, **kwargs)

    def refused(*args, **kwargs):
        calls.network.append(args)
        raise OSError("no network in this test")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", recorded)
    monkeypatch.setattr(socket, "getaddrinfo", refused)
    monkeypatch.setattr(socket.socket, "connect", refused)
    return calls


def test_a_dry_run_downloads_no_dataset(tmp_path, capsys, no_network):
    """gsm8k and an hf:// file that are not in huggingface_hub's cache: each is looked up in the
    cache alone, nothing goes to the network, and the plan says the prompt length is assumed
    and why (offline it was a download retried for ~23 s)."""
    eval_file = "hf://datasets/someone/prompts/test.jsonl"
    argv = ["--dataset=gsm8k", f"--eval_dataset={eval_file}", "--dry_run=true"]
    train.train(load_config(tiny_argv(tmp_path, *argv)))
    out = capsys.readouterr().out
    assert no_network.network == []
    assert no_network.downloads  # looked up, in the cache only
    assert all(kwargs.get("local_files_only") for _, kwargs in no_network.downloads)
    why = "is not downloaded, and a dry run downloads nothing; set max_prompt_length"
    assert f"  prompts 512 tokens (assumed: gsm8k {why}), " in out
    assert f"prompts 512 tokens (assumed: {eval_file} {why})" in out


def test_a_dry_run_reads_a_hub_dataset_from_the_cache(tmp_path, capsys, no_network):
    """An hf:// file huggingface_hub has cached is read from there: its prompts' lengths and
    its row count (eval_size 64 of its 3 rows)."""
    snapshot = tmp_path / "hub" / "datasets--someone--prompts" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("abc")
    rows = [{"prompt": p} for p in ("ab=", "abcdefgh=", "a=")]
    (snapshot / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["--eval_dataset=hf://datasets/someone/prompts/test.jsonl", "--eval_size=64"]
    p = plan.plan(load_config(tiny_argv(tmp_path, *argv, "--num_generations_eval=2")), 1)
    assert no_network.network == []
    assert p["eval_prompt_tokens"] == 9 and p["eval_completions_per_rank"] == 3 * 2
    assert p["eval_prompt_tokens_from"] == (
        "the longest of 3 hf://datasets/someone/prompts/test.jsonl prompts"
    )


def test_the_plan_grows_with_evaluations_sampling(tmp_path):
    """Evaluation samples its share of the eval prompts in one generate call: 2 -> 32 prompts
    of 8 completions is 16x its KV cache; 256 of them make sampling the peak; over 8 ranks each
    samples an eighth; eval_strategy=no plans none."""

    def plan_of(*more, world_size=1):
        return plan.plan(load_config(tiny_argv(tmp_path, TRLS_EVAL, *more)), world_size)

    two, many, most = (plan_of(f"--eval_size={n}") for n in (2, 32, 256))
    assert (two["eval_completions_per_rank"], many["eval_completions_per_rank"]) == (16, 256)
    assert many["bytes"]["eval_kv_cache"] == 16 * two["bytes"]["eval_kv_cache"] > 0
    assert most["sampling_peak"] > most["update_peak"] and most["total"] > two["total"]
    assert plan_of("--eval_size=256", world_size=8)["eval_completions_per_rank"] == 256
    assert plan_of("--eval_strategy=no")["bytes"]["eval_kv_cache"] == 0


def test_the_plan_of_an_evaluation_that_peaks_is_within_25_percent(tmp_path):
    """The default with 256 eval prompts of 8 completions: evaluation's sampling is the peak."""
    argv = tiny_argv(tmp_path, TRLS_EVAL, "--max_steps=1", "--eval_size=256", "--save_steps=0")
    cfg = load_config(argv)
    planned = plan.plan(cfg, 1)
    assert planned["sampling_peak"] > planned["update_peak"]
    with PeakTensorBytes() as mode:
        train.train(cfg)
    assert abs(planned["total"] - mode.peak) <= 0.25 * mode.peak, (planned["total"], mode.peak)


def test_the_plan_says_its_bytes_are_tensors(tmp_path):
    text = plan.report(plan.plan(load_config(tiny_argv(tmp_path, TRLS_EVAL)), 1))
    lines = text.splitlines()
    assert lines[0].endswith(", tensor bytes per process of 1")
    assert lines[2] == "  evaluation: 512 completions sampled at once, prompts 5 tokens " + (
        "(the longest of 256 default prompts)"
    )
    assert (
        "  tensors only: the CUDA context, the allocator's cached and fragmented blocks, and the "
        "Python process come on top"
    ) in lines
