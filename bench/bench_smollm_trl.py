"""A real model side by side: nanogrpo vs TRL's GRPOTrainer on configs/smollm.py (SmolLM2-135M-Instruct
learning two-number addition on CPU), same settings, runs alternating, several seeds.

    python tests/fetch_real.py                 # builds .cache/real/smollm2-135m-instruct
    python bench/bench_smollm_trl.py           # 2 seeds x 30 steps per trainer, ~45 min on 2 cores
    python bench/bench_smollm_trl.py --report_only

Each run is its own process (bench_train.run_child: wall time, peak RSS of that process); per seed the
two trainers alternate (nanogrpo first for even seeds, TRL first for odd ones), so background load hits
both alike. After each run its final model is scored by bench/eval_heldout.py with smollm.py's eval
settings (128 held-out problems, the same sampling and seed), and so is the untrained model: the
held-out gain of both trainers is measured by one function. Per step: wall time (median, first step
left out as warm-up) and its split into sampling / scoring / update, and the mean training reward.

The settings come from configs/smollm.py and are passed to TRL's runner flag by flag (bench/trl_runner.py
overrides every TRL default that differs). What cannot be identical: the prompts each trainer draws
(its own data order from the same seed) and the samplers' random streams.
Writes bench/results/smollm_vs_trl.json, .md and .png (reward curves: bench/plot.py).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
from bench_train import machine_info, median_step, run_child  # noqa: E402

from nanogrpo.run.configurator import read_config_file  # noqa: E402

SMOLLM = read_config_file("smollm")
SHARED = (
    "num_generations",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "max_completion_length",
    "temperature",
    "top_k",
    "soft_punish_cache",
    "loss_type",
    "beta",
    "learning_rate",
    "max_grad_norm",
)
KEYS = (
    "step",
    "reward",
    "step_time",
    "time/sample",
    "time/score",
    "time/update",
    "completions/mean_length",
)


def commands(
    trainer: str, model: str, out_dir: str, steps: int, seed: int
) -> tuple[list[str], str]:
    """The training command and where its final model lands."""
    if trainer == "nanogrpo":
        return [
            sys.executable,
            "train.py",
            "--config",
            "smollm.py",
            f"--model={model}",
            f"--output_dir={out_dir}",
            f"--max_steps={steps}",
            f"--seed={seed}",
            "--eval_strategy=no",
            "--save_steps=0",
            "--log_completions=false",
            "--overwrite_output_dir=true",
        ], os.path.join(out_dir, "checkpoint")
    flags = [a for k in SHARED for a in (f"--{k}", str(SMOLLM[k]))]
    return [
        sys.executable,
        "bench/trl_runner.py",
        "--model",
        model,
        "--output_dir",
        out_dir,
        "--max_steps",
        str(steps),
        "--seed",
        str(seed),
        "--dataset",
        SMOLLM["dataset"],
        "--reward_funcs",
        ",".join(SMOLLM["reward_funcs"]),
        "--reward_weights",
        ",".join(map(str, SMOLLM["reward_weights"])),
        "--adam_beta2",
        str(SMOLLM.get("adam_beta2", 0.99)),
        *flags,
        "--save_final",
        os.path.join(out_dir, "final"),
    ], os.path.join(out_dir, "final")


def heldout(model: str, log_path: str) -> dict:
    """bench/eval_heldout.py on `model` with smollm.py's eval settings: pass@1, its standard error, time."""
    run_child(
        [sys.executable, "bench/eval_heldout.py", "--config", "smollm.py", f"--model={model}"],
        log_path,
    )
    with open(log_path) as f:
        return json.loads([line for line in f if line.startswith("{")][-1])


def run(trainer, model, work, seed, steps) -> dict:
    out_dir = os.path.join(work, f"{trainer}-{seed}")
    os.makedirs(out_dir, exist_ok=True)
    cmd, final = commands(trainer, model, out_dir, steps, seed)
    proc = run_child(cmd, os.path.join(out_dir, "log.txt"))
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    steps_out = [{k: r[k] for k in KEYS if k in r} for r in rows]
    ev = heldout(final, os.path.join(out_dir, "eval.txt"))
    print(
        f"  {trainer:8s} seed {seed}: median step {median_step(steps_out, 1):.2f}s, peak RSS "
        f"{proc['peak_rss_mb']:.0f} MB, held-out pass@1 {ev['eval/pass@1']:.3f} +- {ev['eval/pass@1_se']:.3f}",
        flush=True,
    )
    return {"trainer": trainer, "seed": seed, **proc, "steps": steps_out, "heldout": ev}


def markdown(res: dict) -> str:
    before = res["before"]
    m = res["machine"]
    lines = [
        f"SmolLM2-135M-Instruct, configs/smollm.py, {res['steps']} steps, seeds {res['seeds']}; {m['nproc']} "
        f"CPU cores, torch {m['versions']['torch']}, trl {m['versions']['trl']}, transformers "
        f"{m['versions']['transformers']}.",
        f"Held-out pass@1 before training: {before['eval/pass@1']:.3f} +- {before['eval/pass@1_se']:.3f} "
        f"(n = {before['eval_size']}).",
        "",
        "| trainer | seed | median step s | sample / score / update s | peak RSS MB | reward first -> last 5 "
        "| held-out pass@1 after |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["runs"]:
        s = r["steps"]
        split = " / ".join(
            f"{median_step(s, 1, k):.2f}" for k in ("time/sample", "time/score", "time/update")
        )
        first, last = s[0]["reward"], statistics.mean(x["reward"] for x in s[-5:])
        lines.append(
            f"| {r['trainer']} | {r['seed']} | {median_step(s, 1):.2f} | {split} | {r['peak_rss_mb']:.0f} | "
            f"{first:+.3f} -> {last:+.3f} | {r['heldout']['eval/pass@1']:.3f} +- "
            f"{r['heldout']['eval/pass@1_se']:.3f} |"
        )
    med = {
        t: statistics.median(median_step(r["steps"], 1) for r in res["runs"] if r["trainer"] == t)
        for t in ("nanogrpo", "trl")
    }
    lines += [
        "",
        f"Step time, median over runs: nanogrpo {med['nanogrpo']:.2f} s, TRL {med['trl']:.2f} s: "
        f"nanogrpo {med['trl'] / med['nanogrpo']:.2f}x faster.",
    ]
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=os.path.join(ROOT, ".cache", "real", "smollm2-135m-instruct"))
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1])
    p.add_argument("--steps", type=int, default=SMOLLM["max_steps"])
    p.add_argument("--work", default=os.path.join(ROOT, "out", "bench", "smollm"))
    p.add_argument("--results", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--report_only", action="store_true")
    args = p.parse_args()
    path = os.path.join(args.results, "smollm_vs_trl.json")
    if not args.report_only:
        if not os.path.isdir(args.model):
            raise SystemExit(f"{args.model} is missing: run python tests/fetch_real.py first")
        os.makedirs(args.work, exist_ok=True)
        res = {
            "steps": args.steps,
            "seeds": args.seeds,
            "machine": machine_info(),
            "settings": {
                k: SMOLLM[k] for k in SHARED + ("reward_funcs", "reward_weights", "dataset")
            },
            "before": heldout(args.model, os.path.join(args.work, "eval_before.txt")),
            "runs": [],
        }
        for i, seed in enumerate(args.seeds):
            for trainer in ("nanogrpo", "trl") if i % 2 == 0 else ("trl", "nanogrpo"):
                res["runs"].append(run(trainer, args.model, args.work, seed, args.steps))
        res["curves"] = {"runs": res["runs"]}  # the layout bench/plot.py draws
        os.makedirs(args.results, exist_ok=True)
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
    with open(path) as f:
        res = json.load(f)
    md = markdown(res)
    with open(path.replace(".json", ".md"), "w") as f:
        f.write(md)
    print(md)
    subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "bench", "plot.py"),
            path,
            "-o",
            path.replace(".json", ".png"),
        ],
        check=False,
    )


if __name__ == "__main__":
    main()
