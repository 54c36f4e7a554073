"""bench/eval_heldout.py, the "before" number of README's held-out tables: it evaluates a checkpoint
with a config's eval settings through train.evaluate, whose trainer fields it builds by hand."""

import json
import os
import subprocess
import sys

from nanogrpo.run.configurator import read_config_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_eval_heldout_scores_a_checkpoint_with_the_configs_eval_settings(tmp_path):
    init = read_config_file("tiny")["init_model"]
    args = ["--config", "tiny.py", f"--model={tmp_path}/init", f"--init_model={init!r}"]
    build = [sys.executable, "train.py", *args, "--max_steps=1", f"--output_dir={tmp_path}/run"]
    subprocess.run(build, cwd=ROOT, check=True, capture_output=True, timeout=300)
    run = subprocess.run(
        [
            sys.executable,
            "bench/eval_heldout.py",
            "--config",
            "tiny.py",
            f"--model={tmp_path}/init",
            f"--completions={tmp_path}/eval.jsonl",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    m = json.loads(run.stdout.strip().splitlines()[-1])
    assert m["eval_size"] == 64 and 0 <= m["eval/pass@1"] <= 1 and "eval/loss" in m
    # --completions: the 64 completions scored, one line each, whose rewards make the metrics
    lines = [json.loads(line) for line in open(tmp_path / "eval.jsonl")]
    assert [line["row"] for line in lines] == list(range(64))
    assert all(isinstance(line["text"], str) and "prompt" not in line["columns"] for line in lines)
    passed = sum(line["rewards"][0] >= 1 for line in lines)
    assert passed / 64 == m["eval/pass@1"]
