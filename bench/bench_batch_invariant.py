"""What the batch-invariant mode costs and what it removes: the sampler/trainer mismatch and the
tokens per second of sampling and of the update, the default kernels against
nanogrpo/fast/batch_invariant.py's, side by side on the same model, prompts and seeds.

    python bench/bench_batch_invariant.py                      # SmolLM2-135M-Instruct, fp32 and bf16
    python bench/bench_batch_invariant.py --model out/tiny-init --dtypes fp32

For each dtype (fp32; bf16 = autocast with fp32 weights, as train.py's bf16=true on one process)
and arm (default: train.py's kernels; plain: plain=true, the course's functions, which the mode
runs with; invariant: batch_invariant=true), --repeats times in
alternation: generate P prompts x G samples of up to --new tokens (temperature 1, no filter), then
the trainer's recomputation of their log-probs (the old policy's, as train.py scores it), then one
forward and backward of the update over the same rows. Prints one JSON line per dtype and arm (the
mismatch max and mean over the sampled tokens, the median tokens/s of each phase) and a table with
the invariant arm's speed as a ratio of the default's.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from nanogrpo import fast  # noqa: E402
from nanogrpo.checkpoint import load_model  # noqa: E402
from nanogrpo.rollout import join_prompt_completion  # noqa: E402
from nanogrpo.sampler import Sampling, generate  # noqa: E402
from nanogrpo.trainer import Kernels  # noqa: E402

PROMPT = [1, 504, 3756, 28, 1030, 1848, 3121, 314, 260, 3500, 2079, 30, 2]  # any ids


def prompts(P, V):
    """P prompts of different lengths (left padding in play), ids below V."""
    return [[t % V for t in PROMPT[: 6 + (i * 3) % len(PROMPT)] + [100 + i]] for i in range(P)]


def one_pass(model, kernels, autocast, P, G, new, seed):
    """-> (mismatch [n tokens] abs, sampled tokens, seconds of sampling, of scoring, of update)."""
    V = model.config.vocab_size
    with kernels.within(autocast):
        t0 = time.perf_counter()
        with torch.no_grad():
            how = Sampling(
                max_new_tokens=new, sample_token=kernels.sample_token, decoder=kernels.decoder
            )
            seeds = [seed + i for i in range(P)]
            out = generate(model, prompts(P, V), how, num_samples=G, seeds=seeds)
        t1 = time.perf_counter()
        ids, mask = join_prompt_completion(prompts(P, V), out.completion_ids, 0, G)
        cmask = out.completion_mask
        with torch.no_grad():
            model.eval()
            trainer, _ = kernels.token_logprobs(model, ids, mask, cmask, temperature=1.0)
            model.train()
        t2 = time.perf_counter()
        advantages = torch.randn(len(ids), generator=torch.Generator().manual_seed(seed))
        logps, _ = kernels.policy_logprobs(
            model, ids, mask, cmask, advantages, beta=0.0, entropy_bonus=False, temperature=1.0
        )
        (logps * advantages[:, None]).sum().backward()
        t3 = time.perf_counter()
    model.zero_grad(set_to_none=True)
    diff = (trainer - out.logprobs)[cmask].abs()
    return diff, int(cmask.sum()), t1 - t0, t2 - t1, t3 - t2


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, ".cache/real/smollm2-135m-instruct"))
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--new", type=int, default=64, help="new tokens per completion")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model = load_model(args.model)
    arms = {
        "default": Kernels(**fast.kernels()),
        "plain": Kernels(),  # the course's functions, which the mode wraps
        "invariant": Kernels(**fast.kernels(batch_invariant=True)),
    }
    rows = []
    for dtype in args.dtypes.split(","):
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")
        runs = {arm: [] for arm in arms}
        for r in range(args.repeats):  # alternating arms: drifts in the machine's speed cancel
            for arm, kernels in arms.items():
                shape = (args.prompts, args.generations, args.new)
                runs[arm].append(one_pass(model, kernels, autocast, *shape, seed=1000 * r))
        for arm, passes in runs.items():
            diffs = torch.cat([p[0] for p in passes])
            tokens = passes[0][1]
            row = dict(
                dtype=dtype,
                arm=arm,
                mismatch_max=float(diffs.max()),
                mismatch_mean=float(diffs.mean()),
                sampled_tokens=tokens,
                sample_tok_s=tokens / statistics.median(p[2] for p in passes),
                score_tok_s=tokens / statistics.median(p[3] for p in passes),
                update_tok_s=tokens / statistics.median(p[4] for p in passes),
                threads=torch.get_num_threads(),
            )
            print(json.dumps(row), flush=True)
            rows.append(row)
    print(f"\n{os.path.basename(args.model)}, {args.prompts} prompts x {args.generations}, "
          f"{args.new} new tokens, {torch.get_num_threads()} threads")  # fmt: skip
    print("| dtype | arm | mismatch max | mismatch mean | sampling tok/s | scoring tok/s | "
          "update tok/s |\n|---|---|---:|---:|---:|---:|---:|")  # fmt: skip
    base = {r["dtype"]: r for r in rows if r["arm"] == "default"}
    for r in rows:
        b = base[r["dtype"]]
        speeds = [
            f"{r[k]:.0f}" + ("" if r is b else f" ({r[k] / b[k]:.2f}x)")
            for k in ("sample_tok_s", "score_tok_s", "update_tok_s")
        ]
        print(f"| {r['dtype']} | {r['arm']} | {r['mismatch_max']:.2e} | "
              f"{r['mismatch_mean']:.2e} | " + " | ".join(speeds) + " |")  # fmt: skip


if __name__ == "__main__":
    main()
