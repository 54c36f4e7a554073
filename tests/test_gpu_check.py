"""bench/gpu_check.py's rehearsal: every part on the CPU with small shapes, so the command a lent
GPU runs cannot rot before one comes."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_check_rehearses_every_part_on_cpu(tmp_path):
    run = subprocess.run(
        [sys.executable, "bench/gpu_check.py", str(tmp_path), "--device", "cpu", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    failed = {k: v.get("error", v) for k, v in doc["parts"].items() if v.get("ok") is False}
    assert run.returncode == 0 and not failed, (failed, run.stdout[-3000:], run.stderr[-3000:])
    parts = doc["parts"]
    assert set(parts) == {
        "machine",
        "logits",
        "grpo_step",
        "fsdp",
        "sampling",
        "syncs",
        "update",
        "packing",
        "chunks",
        "skip",
        "decode",
        "step",
        "train",
        "async",
    }
    assert parts["syncs"]["aten_sync_ops_per_step"] <= 12
    assert parts["fsdp"]["fp32"]["grad_rel"] == 0  # one process sums as the plain model does
    assert all(isinstance(v, dict) for k, v in parts["step"].items() if k in ("eager", "compiled"))
    assert parts["chunks"]["keep_fastest"] in (8, 16, 256)  # the rehearsal's sizes
    assert all(row["speedup"] > 0 for k, row in parts["skip"].items() if k.startswith("free"))
    packed = parts["packing"]
    assert (
        packed["fp32_47m"]["max_abs"] <= 1e-4 and packed["fp32_47m"]["attention"]["path"] == "loop"
    )
    assert parts["async"]["wait0.5_async_s4"]["staleness_max"] <= 4
    assert all(packed[f"{s}_packed_speedup"] > 0 for s in ("bf16_autocast", "bf16_weights"))
