"""Synchronous against asynchronous rollouts (async_rollouts, nanogrpo/run/async_rollouts.py) on the
same machine and threads, one after the other in one run (alternating, --repeats times): the
embedded default (configs/tiny.py) with its reward behind a judge that waits --wait seconds a call
(an LLM judge's latency, no compute), and with no wait. Each case is `python train.py` in its own
output folder (no evaluation, no saves but the last).

    python bench/bench_async.py                        # 20 steps, waits 0.5 s and 0, max_staleness 4
    python bench/bench_async.py --steps 40 --staleness 0,1,4
    python bench/bench_async.py --config smollm.py --steps 12 --staleness 1,4 \
        --set=--model=.cache/real/smollm2-135m-instruct          # a config's own rewards

Reported per case: wall seconds of the steps (the first step's end to the last's: the process
start and the model's load left out), completions per second, and the reward gained per wall-clock
minute (the last 5 steps' mean reward less the first 5's, over the minutes between). The
asynchronous run's sampler process takes half the run's torch threads (at least 1), the trainer
the rest (at least 1); each case's threads are printed as the run reports them.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

JUDGE = '''
import time

from nanogrpo.extras.builtin_rewards import default_task_reward


def slow_default_task(completions, target, completion_ids=None, **kwargs):
    """The embedded default's reward, returned after WAIT seconds (a judge's latency)."""
    time.sleep(WAIT)
    return default_task_reward(completions, target, completion_ids, **kwargs)
'''


def run_case(out, steps, staleness, settings):
    args = [
        sys.executable,
        "train.py",
        *settings,
        f"--output_dir={out}",
        f"--max_steps={steps}",
        "--eval_strategy=no",
        f"--save_steps={steps}",
    ]
    if staleness is not None:
        args += ["--async_rollouts=true", f"--max_staleness={staleness}"]
    env = dict(os.environ, PYTHONPATH=ROOT)
    start = time.time()
    done = subprocess.run(
        args, cwd=ROOT, env=env, check=True, capture_output=True, text=True, timeout=3600
    )
    wall = time.time() - start
    with open(os.path.join(out, "metrics.jsonl")) as f:
        history = [json.loads(line) for line in f if line.strip()]
    # the run's own lines on its threads (announce's; async_rollouts' split)
    threads = [line.split("|")[-1].strip() for line in done.stdout.splitlines() if "thread" in line]
    return history, wall, "; ".join(threads)


def summary(history, completions_per_step):
    """(wall seconds from step 1's end to the last's, completions/s, reward gained a minute)."""
    ends, total = [], 0.0  # each step's end, from the steps' own times (step_time)
    for m in history:
        total += m["step_time"]
        ends.append(total)
    seconds = ends[-1] - ends[0]
    completions = completions_per_step * (len(history) - 1)
    rewards = [m["reward"] for m in history]
    gain = sum(rewards[-5:]) / 5 - sum(rewards[:5]) / 5
    return seconds, completions / seconds, gain / (seconds / 60)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--waits", default="0.5,0")
    p.add_argument("--staleness", default="4", help="max_staleness of the async cases")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument(
        "--config",
        default=None,
        help="a config (configs/) run with its own rewards in place of the embedded default "
        "behind the judge (--waits is then left out)",
    )
    p.add_argument(
        "--set", action="append", default=[], help="a train.py setting for every case, repeatable"
    )
    p.add_argument(
        "--plot",
        default=None,
        help="a PNG of the reward against the steps' wall-clock seconds, one line a case, at the "
        "first wait (needs matplotlib: the bench extra)",
    )
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench_async_")
    settings = (["--config", args.config] if args.config else []) + args.set
    per_step = completions_per_step(settings)
    rows, curves = [], {}  # curves: wait -> case -> history (the first repeat's last)
    for wait in [None] if args.config else [float(w) for w in args.waits.split(",")]:
        reward = []
        if wait is not None:
            judge = os.path.join(tmp, f"judge_{wait}.py")
            with open(judge, "w") as f:
                f.write(JUDGE.replace("WAIT", repr(wait)))
            reward = [f"--reward_funcs=['{judge}:slow_default_task']"]
        cases = [None] + [int(s) for s in args.staleness.split(",")]
        for r in range(args.repeats):
            for staleness in cases if r % 2 == 0 else cases[::-1]:
                name = "sync" if staleness is None else f"async s={staleness}"
                out = os.path.join(tmp, f"w{wait}-{name.replace(' ', '')}-{r}")
                history, wall, threads = run_case(out, args.steps, staleness, settings + reward)
                if r == 0:
                    print(f"{name}: {threads}", flush=True)
                rows.append((wait, name, *summary(history, per_step), wall))
                curves.setdefault(wait, {})[name] = history
                print(
                    f"{'own rewards' if wait is None else f'wait {wait}s'} {name:12} done",
                    flush=True,
                )
    print(
        f"\n{'reward wait':>11} {'case':12} {'seconds':>8} {'compl./s':>9} {'reward/min':>10} "
        f"{'speed':>6} {'process wall s':>14}"
    )
    for wait, name, seconds, cps, gain, wall in rows:
        base = next(x for x in rows if x[0] == wait and x[1] == "sync")
        speed = cps / base[3]
        print(
            f"{'own' if wait is None else f'{wait:.1f}s':>11} {name:12} {seconds:8.1f} {cps:9.1f} {gain:10.3f} {speed:5.2f}x "
            f"{wall:14.1f}"
        )
    if args.plot:
        plot(next(iter(curves.values())), args.plot)


def completions_per_step(settings) -> int:
    """Completions a step of train.py with these settings (one process, a round a step)."""
    sys.path.insert(0, ROOT)
    from nanogrpo.run.configurator import load_config

    cfg = load_config(list(settings))
    return cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps


def plot(cases: dict, path: str):
    """Each case's reward (the step's mean) against its steps' cumulative step_time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, history in cases.items():
        seconds, total = [], 0.0
        for m in history:
            total += m["step_time"]
            seconds.append(total)
        ax.plot(seconds, [m["reward"] for m in history], label=name)
    ax.set_xlabel("wall-clock seconds of the steps")
    ax.set_ylabel("mean reward")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
