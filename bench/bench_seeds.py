"""Final reward of the embedded default over many seeds: nanogrpo, nanogrpo with a plain sampler, TRL.

    python bench/bench_seeds.py --no_trl --arms ours --seeds 11,12,...,26     # the README's 16-seed table
    python bench/bench_seeds.py --seeds 11,12,13,14,15,16,17,18               # all three arms

The claim it checks: `python train.py` (configs/tiny.py) learns its task whatever the seed. For each
seed one random init (`configs/tiny.py`'s model, created by train.py) is shared by up to three arms,
each run with configs/tiny.py's own settings and step count (read from the config, so the script
always measures the current default):
  ours   train.py as is;
  plain  train.py with its sampler replaced by a plain KV-cache loop sampling with torch.multinomial
         (no prompt sharing, no compaction, no counter-based RNG): isolates the sampler;
  trl    TRL's GRPOTrainer through bench/trl_runner.py (skipped with --no_trl).
Final reward = mean training reward over the last 15 optimizer steps. Prints one JSON line per run
(with the run's wall time and the 1-minute load average) and, per arm, mean ± std, range and how
many seeds reached 0.9; --out appends the JSON lines to a file.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from nanogrpo.run.configurator import read_config_file  # noqa: E402

INIT = f"--init_model={read_config_file('tiny')['init_model']!r}"  # tiny.py's random model, built at --model
SHARED = (
    "num_generations",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "max_completion_length",
    "temperature",
    "loss_type",
    "beta",
    "learning_rate",
    "adam_beta2",
    "max_grad_norm",
)  # what trl_runner.py takes too


def tiny_settings() -> tuple[list[str], int]:
    """configs/tiny.py's shared settings as --key=value flags, and its max_steps."""
    from nanogrpo.run.configurator import load_config

    cfg = load_config(["--config", "tiny.py"])
    return [f"--{k}={getattr(cfg, k)}" for k in SHARED], cfg.max_steps


def plain_generate(model, prompt_ids, num_samples, max_new_tokens, stop_ids, pad_id, **unused):
    """Reference sampler: every row prefilled separately, one multinomial draw per row and step."""
    import torch

    from nanogrpo.sampler import Generation

    x = torch.tensor(
        [p for p in prompt_ids for _ in range(num_samples)]
    )  # equal-length prompts only
    N, L = x.shape
    cache = model.new_cache(N, L + max_new_tokens)
    h = model.hidden_states(x, cache=cache)
    out = []
    for t in range(max_new_tokens):
        nxt = torch.multinomial(torch.softmax(model.lm_head(h[:, -1]).float(), -1), 1)  # [N,1]
        out.append(nxt[:, 0])
        h = model.hidden_states(nxt, cache=cache, cache_start=L + t)
    ids = torch.stack(out, 1)
    is_stop = torch.isin(ids, torch.tensor(sorted(stop_ids)))
    length = torch.where(is_stop.any(1), is_stop.int().argmax(1) + 1, max_new_tokens)
    mask = torch.arange(max_new_tokens)[None] < length[:, None]
    return Generation(torch.where(mask, ids, pad_id), mask, torch.zeros(ids.shape), ~is_stop.any(1))


def run_nanogrpo(arm, seed, work):
    """One run of the default config in this process; returns the per-step rewards."""
    import torch

    import train
    from nanogrpo import rollout
    from nanogrpo.run.configurator import load_config

    if arm == "plain":
        rollout.generate = plain_generate
    torch.manual_seed(seed)
    cfg = load_config(
        [
            "--config",
            "tiny.py",
            f"--model={work}/init-{seed}",
            INIT,
            f"--seed={seed}",
            f"--output_dir={work}/{arm}-{seed}",
            "--overwrite_output_dir=true",
            "--eval_strategy=no",
            "--save_steps=0",
            "--logging_steps=100000",
        ]
    )
    return [m["reward"] for m in train.train(cfg)]


def run_trl(seed, work):
    """One TRL run with the default config's settings in a child process; returns the per-step rewards."""
    from bench.bench_train import make_tiny_checkpoint

    flags, max_steps = tiny_settings()
    make_tiny_checkpoint(f"{work}/init-{seed}", seed)  # the same init the nanogrpo arms use
    out = f"{work}/trl-{seed}"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "bench", "trl_runner.py"),
        "--model",
        f"{work}/init-{seed}",
        "--output_dir",
        out,
        "--max_steps",
        str(max_steps),
        "--seed",
        str(seed),
    ] + [part for a in flags for part in a.split("=", 1)]
    subprocess.run(
        cmd, check=True, capture_output=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT)
    )
    with open(f"{out}/metrics.jsonl") as f:
        return [json.loads(line)["reward"] for line in f]


def main():
    """Run every arm on every seed (each nanogrpo run in a fresh child of this script) and summarize."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", default=",".join(str(s) for s in range(11, 27)))
    p.add_argument(
        "--arms", default="ours,plain,trl", help="comma-separated subset of ours,plain,trl"
    )
    p.add_argument("--work", default=os.path.join(ROOT, "out", "bench_seeds"))
    p.add_argument("--out", default=None, help="also append the per-run JSON lines to this file")
    p.add_argument("--no_trl", action="store_true")
    p.add_argument("--child", nargs=2, metavar=("ARM", "SEED"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:  # a single nanogrpo run, isolated in its own process
        rewards = run_nanogrpo(args.child[0], int(args.child[1]), args.work)
        print(
            json.dumps(
                {
                    "arm": args.child[0],
                    "seed": int(args.child[1]),
                    "last15": sum(rewards[-15:]) / 15,
                    "steps": len(rewards),
                }
            )
        )
        return
    arms = [a for a in args.arms.split(",") if not (args.no_trl and a == "trl")]
    results = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for arm in arms:
            t0, load = time.time(), os.getloadavg()[0]
            if arm == "trl":
                rewards = run_trl(seed, args.work)
                row = {
                    "arm": arm,
                    "seed": seed,
                    "last15": sum(rewards[-15:]) / 15,
                    "steps": len(rewards),
                }
            else:
                child = subprocess.run(
                    [sys.executable, __file__, "--child", arm, str(seed), "--work", args.work],
                    check=True,
                    capture_output=True,
                    text=True,
                    cwd=ROOT,
                )
                row = json.loads(child.stdout.strip().splitlines()[-1])
            row.update({"seconds": round(time.time() - t0, 1), "load_avg_1min": round(load, 2)})
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
            results.append(row)
    for arm in arms:
        v = [r["last15"] for r in results if r["arm"] == arm]
        sd = statistics.stdev(v) if len(v) > 1 else 0.0
        print(
            f"{arm:6s} last-15-step reward over {len(v)} seeds: {statistics.mean(v):.3f} ± {sd:.3f} "
            f"(range {min(v):.2f}-{max(v):.2f}; >= 0.9 on {sum(x >= 0.9 for x in v)} of {len(v)})"
        )


if __name__ == "__main__":
    main()
