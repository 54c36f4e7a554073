"""Two runs on one machine: the embedded default alone and two at once, on the threads the run
chooses (torch_num_threads=None) and on torch's default (one per core), side by side in one run;
and, with --sweep, where more threads pay: a step's time by model size at 1 thread and at every
core, alone.

    python bench/bench_threads.py                 # 100 steps, 4 cases: alone / two at once x chosen / cores
    python bench/bench_threads.py --steps 30 --sweep

Each case is `python train.py` (the embedded default, no evaluation, no saves) in its own output
folder; two at once start together and the case's time is the later one's end. Wall time includes
each process's start (importing torch: ~2 s). The sweep builds Qwen2-shaped models from scratch
(the embedded default's shape, wider and deeper) and reports the median step_time of steps 2..N
(metrics.jsonl), 16 prompts x 8 completions of 8 tokens a step as the embedded default.
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (hidden, intermediate, layers, heads, kv heads): the embedded default's shape and larger ones
SHAPES = [(64, 256, 2, 4, 2), (256, 1024, 4, 4, 2), (512, 2048, 6, 8, 2), (1024, 4096, 8, 16, 4)]


def command(out: str, steps: int, threads: int | None, init: dict | None = None) -> list[str]:
    argv = [sys.executable, "train.py", "--config=tiny.py", f"--output_dir={out}"]
    argv.append(f"--max_steps={steps}")
    argv += ["--eval_strategy=no", "--save_steps=0", "--overwrite_output_dir=true"]
    if threads:
        argv.append(f"--torch_num_threads={threads}")
    if init:
        argv += [f"--model={out}-init", f"--init_model={init!r}"]
    return argv


def run_together(commands: list[list[str]]) -> float:
    """Start every command at once; -> seconds until the last one ends."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    start = time.perf_counter()
    procs = [
        subprocess.Popen(c, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for c in commands
    ]
    for p, c in zip(procs, commands):
        _, err = p.communicate()
        if p.returncode:
            raise SystemExit(f"{' '.join(c)} failed:\n{err.decode()[-2000:]}")
    return time.perf_counter() - start


def step_times(out: str) -> list[float]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line)["step_time"] for line in f][1:]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--sweep", action="store_true", help="step time by model size, 1 vs all cores")
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    work = tempfile.mkdtemp(prefix="bench_threads-")
    print(f"{cores} cores, load average {os.getloadavg()[0]:.1f}, {args.steps} steps a run")
    times = {}
    for threads, name in ((None, "chosen (1)"), (cores, f"torch default ({cores})")):
        alone = run_together([command(f"{work}/alone", args.steps, threads)])
        pair = run_together([command(f"{work}/pair{i}", args.steps, threads) for i in range(2)])
        times[name] = (alone, pair)
    print("| threads | one run s | two at once s | two at once / one |")
    print("|---|---:|---:|---:|")
    for name, (alone, pair) in times.items():
        print(f"| {name} | {alone:.1f} | {pair:.1f} | {pair / alone:.2f}x |")
    (a1, p1), (a2, p2) = times.values()
    print(f"two at once: chosen {p2 / p1:.2f}x faster than torch's default; alone {a2 / a1:.2f}x")
    if not args.sweep:
        return
    print("\n| model | params | step s at 1 thread | at %d | %d / 1 |" % (cores, cores))
    print("|---|---:|---:|---:|---:|")
    for hidden, inter, layers, heads, kv in SHAPES:
        init = dict(
            model_type="qwen2",
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            max_position_embeddings=64,
            tie_word_embeddings=True,
            rope_theta=10000.0,
        )
        medians = []
        for threads in (1, cores):
            out = f"{work}/sweep{hidden}-{threads}"
            run_together([command(out, args.steps, threads, init)])
            medians.append(statistics.median(step_times(out)))
        params = sum_params(f"{work}/sweep{hidden}-1-init")
        print(
            f"| hidden {hidden}, {layers} layers | {params / 1e6:.2f}M | {medians[0]:.4f} | "
            f"{medians[1]:.4f} | {medians[1] / medians[0]:.2f} |"
        )


def sum_params(folder: str) -> int:
    from safetensors import safe_open

    total = 0
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), "pt") as f:
                total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return total


if __name__ == "__main__":
    main()
