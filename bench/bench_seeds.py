"""Demos over seeds: held-out success per seed of any config, or the tiny default's final reward
(nanogrpo, nanogrpo with a plain sampler, TRL).

    python bench/bench_seeds.py --config vault.py --seeds 0,1,2,3 --before    # README's demo tables
    python bench/bench_seeds.py --config tools.py --seeds 0,1,2 --max_steps=8  # overrides go to both

With --config, each seed is one `train.py --config NAME --seed=S` into WORK/NAME-sS, then
`bench/eval_heldout.py --config NAME --model=WORK/NAME-sS/checkpoint`: the held-out split, its
sampling seed and settings are the config's own (the config's seed, not the run's), so every seed's
checkpoint is scored on the same rows alike. --before scores the config's model first (the row
"before"; the --model=... given, if any). Other --key=value arguments are passed to train.py and to the eval (so a sampling override
is evaluated as trained; --model and --init_model only to train.py and to "before"). Prints one JSON line per run and
a table: held-out success ± standard error, eval reward, the last step's training reward, the wall
time of the training run and of its eval, then mean ± std over the seeds and how many reach
--threshold. Each eval's completions are kept (WORK/NAME-sS/heldout.jsonl, WORK/NAME-before.jsonl:
eval_heldout.py --completions), and a tool config's JSON line gives the share that called a tool. The config's dataset must exist (vault.py: python examples/vault_game.py; tools.py:
python examples/tool_calculator.py).

Without --config: the embedded default's final reward over many seeds.

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
many seeds reached 0.9; --out appends the JSON lines to a file (in both modes).
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
DEFAULT_WORK = os.path.join(ROOT, "out", "bench_seeds")
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


def plain_generate(model, prompt_ids, settings, num_samples=1, generator=None, seeds=None):
    """Reference sampler: every row prefilled separately, one multinomial draw per row and step
    (of the settings it reads max_new_tokens, stop_ids and pad_id)."""
    import torch

    from nanogrpo.sampler import Generation

    max_new_tokens = settings.max_new_tokens
    stop_ids, pad_id = settings.stop_ids, settings.pad_id

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


def config_stem(name: str) -> str:
    """ "vault.py" or "configs/vault.py" -> "vault"."""
    return os.path.splitext(os.path.basename(name))[0]


def child(cmd: list[str]) -> tuple[float, str]:
    """Run one command from the repository root; its wall time in seconds. Its output is shown only
    when it fails. -> (seconds, stdout)"""
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        tail = p.stdout[-3000:] + p.stderr[-3000:]
        raise SystemExit(f"failed ({p.returncode}): {' '.join(cmd)}\n{tail}")
    return time.time() - t0, p.stdout


def evaluate(config: str, model: str | None, extra: list[str], completions: str) -> dict:
    """bench/eval_heldout.py's metrics of `model` (None = the config's) under the config's eval;
    its completions go to the file `completions` (eval_heldout.py --completions), and with tools
    the share of them that made a tool call is `tool_call_rate`."""
    flags = [a for a in extra if not a.startswith(("--model=", "--init_model="))]
    if model is not None:
        flags.append(f"--model={model}")
    flags.append(f"--completions={completions}")
    seconds, out = child(
        [sys.executable, os.path.join(ROOT, "bench", "eval_heldout.py"), "--config", config, *flags]
    )
    m = json.loads(out.strip().splitlines()[-1])
    row = {
        "heldout": m["eval/pass@1"],
        "heldout_se": m["eval/pass@1_se"],
        "eval_reward": m["eval/reward"],
        "eval_seconds": round(seconds, 1),
        "completions": completions,
    }
    with open(completions) as f:
        calls = [json.loads(line).get("tool_calls") for line in f]
    if calls and None not in calls:
        row["tool_call_rate"] = sum(c > 0 for c in calls) / len(calls)
    return row


def run_config_seed(config: str, seed: int, work: str, extra: list[str]) -> dict:
    """train.py on one seed into its own output dir, then the held-out eval of its checkpoint."""
    out = os.path.join(work, f"{config_stem(config)}-s{seed}")
    load = os.getloadavg()[0]
    seconds, _ = child(
        [
            sys.executable,
            os.path.join(ROOT, "train.py"),
            "--config",
            config,
            *extra,
            f"--seed={seed}",
            f"--output_dir={out}",
            "--overwrite_output_dir=true",
        ]
    )
    with open(os.path.join(out, "metrics.jsonl")) as f:
        steps = [m for m in map(json.loads, f) if "reward" in m]
    row = {
        "config": config_stem(config),
        "seed": seed,
        "steps": len(steps),
        "last_reward": steps[-1]["reward"],
        "seconds": round(seconds, 1),
        "load_avg_1min": round(load, 2),
    }
    row.update(evaluate(config, os.path.join(out, "checkpoint"), extra, f"{out}/heldout.jsonl"))
    return row


def table(rows: list[dict], threshold: float) -> str:
    """The per-seed table (markdown) and the summary line over the seeds (not the "before" row)."""
    lines = [
        "| run | held-out success | eval reward | last-step train reward | train wall | eval wall |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        name = "before" if r["seed"] is None else f"seed {r['seed']}"
        train = "-" if r["seed"] is None else f"{r['last_reward']:.3f}"
        wall = "-" if r["seed"] is None else f"{r['seconds']:.0f} s"
        lines.append(
            f"| {name} | {r['heldout']:.3f} ± {r['heldout_se']:.3f} | {r['eval_reward']:.3f} "
            f"| {train} | {wall} | {r['eval_seconds']:.0f} s |"
        )
    v = [r["heldout"] for r in rows if r["seed"] is not None]
    if v:
        sd = statistics.stdev(v) if len(v) > 1 else 0.0
        lines.append(
            f"held-out success over {len(v)} seeds: {statistics.mean(v):.3f} ± {sd:.3f} "
            f"(range {min(v):.3f}-{max(v):.3f}; >= {threshold} on "
            f"{sum(x >= threshold for x in v)} of {len(v)})"
        )
    return "\n".join(lines)


def main_config(args, extra: list[str]):
    """--config mode: every seed of one demo, then the table."""
    rows = []

    def keep(row):
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
        rows.append(row)

    if args.before:  # the config's model, or the --model=... that train.py starts from
        start = [a.split("=", 1)[1] for a in extra if a.startswith("--model=")]
        completions = os.path.join(args.work, f"{config_stem(args.config)}-before.jsonl")
        before = evaluate(args.config, start[-1] if start else None, extra, completions)
        keep({"config": config_stem(args.config), "seed": None, **before})
    for seed in [int(s) for s in args.seeds.split(",")]:
        keep(run_config_seed(args.config, seed, args.work, extra))
    print(table(rows, args.threshold))


def main():
    """Run every arm on every seed (each nanogrpo run in a fresh child of this script) and summarize."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--config", default=None, help="a demo's config: held-out success per seed")
    p.add_argument("--before", action="store_true", help="with --config: also the config's model")
    p.add_argument("--threshold", type=float, default=0.8, help="with --config: the bar to count")
    p.add_argument("--seeds", default=None, help="comma-separated (tiny: 11..26; --config: 0,1,2)")
    p.add_argument(
        "--arms", default="ours,plain,trl", help="comma-separated subset of ours,plain,trl"
    )
    p.add_argument(
        "--work", default=DEFAULT_WORK, help="tiny: out/bench_seeds; --config: out/seeds"
    )
    p.add_argument("--out", default=None, help="also append the per-run JSON lines to this file")
    p.add_argument("--no_trl", action="store_true")
    p.add_argument("--child", nargs=2, metavar=("ARM", "SEED"), help=argparse.SUPPRESS)
    args, extra = p.parse_known_args()
    if args.config:
        args.seeds = args.seeds or "0,1,2"
        if args.work == DEFAULT_WORK:
            args.work = os.path.join(ROOT, "out", "seeds")
        return main_config(args, extra)
    if extra:
        p.error(f"unrecognized arguments: {' '.join(extra)} (--key=value overrides need --config)")
    args.seeds = args.seeds or ",".join(str(s) for s in range(11, 27))
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
