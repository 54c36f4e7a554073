"""Seconds from SIGTERM to exit: one process or torchrun, the signal sent while a round samples or
while the update runs (docs/results.md#stops).

    python bench/bench_stops.py                      # 1 and 2 processes, sampling and update
    python bench/bench_stops.py --nproc 1 --phase sampling

The embedded default's shape with 500-token completions (every completion runs to its end:
min_new_tokens), so a round samples for seconds. `score` below is the run's reward function: each
call (rank 0) appends its time to $MARK, which tells the bench where the run is. "sampling": the
signal goes 1 s after step 2 is logged (round 3 is sampling); "update": 0.3 s after round 2 is
scored (its log-probs and update run). Each run is its own process group, one thread a process.
"""

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INIT = (
    "{'model_type': 'qwen2', 'hidden_size': 64, 'intermediate_size': 256, 'num_hidden_layers': 2,"
    " 'num_attention_heads': 4, 'num_key_value_heads': 2, 'max_position_embeddings': 600,"
    " 'tie_word_embeddings': True, 'rope_theta': 10000.0}"
)


def score(completions, **kwargs):
    """The reward: a completion's length; each call (rank 0) leaves its time in $MARK."""
    if os.environ.get("RANK", "0") == "0":
        with open(os.environ["MARK"], "a") as f:
            f.write(f"{time.time()}\n")
    return [float(len(c)) for c in completions]


def command(out: str, nproc: int) -> list[str]:
    argv = [
        "train.py",
        "--config",
        "tiny.py",
        f"--model={out}/init",
        f"--init_model={INIT}",
        f"--output_dir={out}/run",
        "--max_completion_length=500",
        "--generation_kwargs={'min_new_tokens': 500}",
        "--eval_strategy=no",
        "--max_steps=20",
        f"--reward_funcs={os.path.abspath(__file__)}:score",
        "--logging_steps=1",
    ]
    if nproc == 1:
        return [sys.executable, *argv]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*launcher, "--nproc_per_node", str(nproc), *argv]


def wait_for(done, p):
    while not done() and p.poll() is None:
        time.sleep(0.05)


def measure(nproc: int, phase: str, out: str) -> tuple[int, float]:
    """-> (the exit status, seconds from SIGTERM to exit)."""
    os.makedirs(out, exist_ok=True)
    mark = os.path.join(out, "mark")
    log_path = os.path.join(out, "log")
    env = dict(os.environ, OMP_NUM_THREADS="1", MARK=mark)
    with open(log_path, "w") as log:
        p = subprocess.Popen(
            command(out, nproc),
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

        def marks():
            return open(mark).read().split() if os.path.exists(mark) else []

        wait_for(lambda: len(marks()) >= 2, p)  # round 2 scored
        if phase == "sampling":
            wait_for(lambda: "step    2/" in open(log_path).read(), p)
            time.sleep(1.0)  # round 3 is sampling
        else:
            time.sleep(0.3)  # round 2's log-probs and update
        sent = time.time()
        os.kill(p.pid, signal.SIGTERM)
        rc = p.wait(timeout=600)
    return rc, time.time() - sent


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--phase", nargs="+", default=["sampling", "update"])
    args = ap.parse_args()
    print("| processes | signal sent during | exit status | seconds to exit |")
    print("|---:|---|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for nproc in args.nproc:
            for phase in args.phase:
                rc, took = measure(nproc, phase, os.path.join(tmp, f"{nproc}-{phase}"))
                print(f"| {nproc} | {phase} | {rc} | {took:.1f} |", flush=True)


if __name__ == "__main__":
    main()
