"""bench/bench_seeds.py --config: one demo over seeds, each seed trained into its own output dir and
its checkpoint scored on the config's held-out split; the table README's demo figures come from."""

import json
import os
import subprocess
import sys

from nanogrpo.run.configurator import read_config_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def test_the_table_counts_the_seeds_that_reach_the_bar_and_leaves_out_before():
    from bench.bench_seeds import table

    rows = [
        {
            "seed": None,
            "heldout": 0.05,
            "heldout_se": 0.03,
            "eval_reward": 0.07,
            "eval_seconds": 40,
        },
        *(
            {
                "seed": s,
                "heldout": h,
                "heldout_se": 0.02,
                "eval_reward": h,
                "eval_seconds": 40,
                "last_reward": 0.9,
                "seconds": 500.0,
            }
            for s, h in ((0, 0.9), (1, 0.7), (2, 1.0))
        ),
    ]
    out = table(rows, 0.8).splitlines()
    assert out[2].startswith("| before | 0.050 ± 0.030 |") and out[3].startswith("| seed 0 | 0.900")
    assert out[-1] == (
        "held-out success over 3 seeds: 0.867 ± 0.153 (range 0.700-1.000; >= 0.8 on 2 of 3)"
    )


def test_a_config_on_a_seed_trains_into_its_own_dir_and_scores_the_checkpoint(tmp_path):
    init = read_config_file("tiny")["init_model"]
    run = subprocess.run(
        [
            sys.executable,
            "bench/bench_seeds.py",
            "--config",
            "tiny.py",
            "--seeds",
            "3",
            f"--work={tmp_path}",
            f"--model={tmp_path}/init",
            f"--init_model={init!r}",
            "--max_steps=1",
            "--eval_size=8",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    rows = [json.loads(line) for line in lines if line.startswith("{")]
    assert [(r["seed"], r["steps"]) for r in rows] == [(3, 1)]  # --max_steps reached train.py
    assert os.path.isdir(tmp_path / "tiny-s3" / "checkpoint")
    assert 0 <= rows[0]["heldout"] <= 1 and rows[0]["seconds"] > 0
    # the eval's completions beside the checkpoint, as many as --eval_size; no tools: no call rate
    assert rows[0]["completions"] == f"{tmp_path}/tiny-s3/heldout.jsonl"
    assert len(open(rows[0]["completions"]).readlines()) == 8 and "tool_call_rate" not in rows[0]
    assert lines[-2].startswith("| seed 3 | ")
    assert lines[-1].startswith("held-out success over 1 seeds: ")
