"""Reward curves to a PNG: nanogrpo vs TRL from bench_train.py's JSON, and/or any metrics.jsonl.

    python bench/plot.py bench/results/train_bench.json -o bench/results/reward_curves.png
    python bench/plot.py out/tiny/metrics.jsonl out/other/metrics.jsonl -o curves.png --key reward
    python bench/plot.py a/metrics.jsonl b/metrics.jsonl --key reward,kl   # one panel per key

A train_bench.json draws each trainer's mean over seeds (thick) and every seed (thin); a
metrics.jsonl draws its `--key` per step. matplotlib is needed here only (`pip install matplotlib`).
"""

import argparse
import json
import os


def series_from(path: str, key: str) -> list[tuple[str, list[float], bool]]:
    """[(label, values per step, is_mean)] from a bench JSON or a metrics.jsonl."""
    if path.endswith(".jsonl"):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        label = os.path.basename(os.path.dirname(os.path.abspath(path))) or path
        return [
            (label, [float("nan") if r[key] is None else r[key] for r in rows if key in r], True)
        ]
    with open(path) as f:
        curves = json.load(f)["curves"]
    out = []
    for trainer in sorted({r["trainer"] for r in curves["runs"]}):
        runs = [[s[key] for s in r["steps"]] for r in curves["runs"] if r["trainer"] == trainer]
        n = min(map(len, runs))
        out += [
            (f"{trainer} seed {r['seed']}", v, False)
            for r, v in zip([r for r in curves["runs"] if r["trainer"] == trainer], runs)
        ]
        out.append(
            (
                f"{trainer} (mean of {len(runs)} seeds)",
                [sum(v[i] for v in runs) / len(runs) for i in range(n)],
                True,
            )
        )
    return out


def main(argv=None):
    """Parse arguments, draw, save."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("inputs", nargs="+", help="train_bench.json and/or metrics.jsonl files")
    p.add_argument("-o", "--output", default="reward_curves.png")
    p.add_argument(
        "--key", default="reward", help="metric to plot (default: reward); a,b: a panel each"
    )
    p.add_argument("--quiet", action="store_true", help="do not print the output path")
    args = p.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("bench/plot.py needs matplotlib: pip install matplotlib")
    keys = args.key.split(",")
    fig, axes = plt.subplots(len(keys), 1, figsize=(8, 4.5 + 2.5 * (len(keys) - 1)), squeeze=False)
    for key, ax in zip(keys, axes[:, 0]):
        colors = {}
        for path in args.inputs:
            for label, values, is_mean in series_from(path, key):
                group = label.split(" ")[0]
                color = colors.setdefault(group, f"C{len(colors)}")
                steps = range(1, len(values) + 1)
                ax.plot(
                    steps,
                    values,
                    color=color,
                    lw=2.0 if is_mean else 0.6,
                    alpha=1.0 if is_mean else 0.35,
                    label=label if is_mean else None,
                )
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(f"mean {key}" if key == "reward" else "/".join(key.split("/")[-2:]))
        if len(keys) > 1:
            ax.set_title(key, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    if not args.quiet:
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
