"""Final reward of the embedded default over many seeds: nanogrpo, nanogrpo with a plain sampler, TRL.

    python bench/bench_seeds.py --seeds 11,12,13,14,15,16,17,18       # ~6 minutes on 2 idle cores

The default task's learning curve depends strongly on the seed, so comparing trainers needs many
seeds. For each seed one random init (`configs/tiny.py`'s model, created by train.py) is shared by
three arms, each run for 150 steps with the tiny config:
  ours   train.py as is;
  plain  train.py with its sampler replaced by a plain KV-cache loop sampling with torch.multinomial
         (no prompt sharing, no compaction, no counter-based RNG): isolates the sampler;
  trl    TRL's GRPOTrainer through bench/trl_runner.py (skipped with --no_trl).
Prints one JSON line per run and mean ± std of the last 15 steps' reward per arm.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from nanogrpo.config import read_config_file  # noqa: E402

INIT = f"--init_model={read_config_file('tiny')['init_model']!r}"  # tiny.py's random model, built at --model
TINY = ["--num_generations=8", "--prompts_per_step=16", "--micro_batch_size=64", "--max_completion_length=8",
        "--temperature=1.0", "--loss_type=dapo", "--beta=0.0", "--learning_rate=0.003", "--adam_beta2=0.99",
        "--max_grad_norm=1.0"]


def plain_generate(model, prompt_ids, num_samples, max_new_tokens, stop_ids, pad_id, **unused):
    """Reference sampler: every row prefilled separately, one multinomial draw per row and step."""
    import torch
    from nanogrpo.sampler import Generation
    x = torch.tensor([p for p in prompt_ids for _ in range(num_samples)])  # equal-length prompts only
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
    """One 150-step run in this process; returns the per-step rewards."""
    import torch
    import train
    from nanogrpo import rollout
    from nanogrpo.config import load_config
    if arm == "plain":
        rollout.generate = plain_generate
    torch.manual_seed(seed)
    cfg = load_config(["--config", "tiny.py", f"--model={work}/init-{seed}", INIT, f"--seed={seed}",
                       f"--out_dir={work}/{arm}-{seed}", "--overwrite_output_dir=true", "--eval_every=0",
                       "--save_every=0", "--log_every=1000", *TINY])
    return [m["reward"] for m in train.train(cfg)]


def run_trl(seed, work):
    """One 150-step TRL run in a child process; returns the per-step rewards."""
    out = f"{work}/trl-{seed}"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "trl_runner.py"), "--model", f"{work}/init-{seed}",
           "--out_dir", out, "--max_steps", "150", "--seed", str(seed)] + [part for a in TINY for part in a.split("=", 1)]
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    with open(f"{out}/metrics.jsonl") as f:
        return [json.loads(line)["reward"] for line in f]


def main():
    """Run every arm on every seed (each nanogrpo run in a fresh child of this script) and summarize."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", default="11,12,13,14,15,16,17,18")
    p.add_argument("--work", default=os.path.join(ROOT, "out", "bench_seeds"))
    p.add_argument("--no_trl", action="store_true")
    p.add_argument("--child", nargs=2, metavar=("ARM", "SEED"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:  # a single nanogrpo run, isolated in its own process
        rewards = run_nanogrpo(args.child[0], int(args.child[1]), args.work)
        print(json.dumps({"arm": args.child[0], "seed": int(args.child[1]), "last15": sum(rewards[-15:]) / 15}))
        return
    results = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for arm in ("ours", "plain") + (() if args.no_trl else ("trl",)):
            if arm == "trl":
                rewards = run_trl(seed, args.work)
                row = {"arm": arm, "seed": seed, "last15": sum(rewards[-15:]) / 15}
            else:
                child = subprocess.run([sys.executable, __file__, "--child", arm, str(seed), "--work", args.work],
                                       check=True, capture_output=True, text=True, cwd=ROOT)
                row = json.loads(child.stdout.strip().splitlines()[-1])
            print(json.dumps(row), flush=True)
            results.append(row)
    for arm in sorted({r["arm"] for r in results}):
        v = [r["last15"] for r in results if r["arm"] == arm]
        sd = statistics.stdev(v) if len(v) > 1 else 0.0
        print(f"{arm:6s} last-15-step reward over {len(v)} seeds: {statistics.mean(v):.3f} ± {sd:.3f} "
              f"(range {min(v):.2f}-{max(v):.2f})")


if __name__ == "__main__":
    main()
