"""End-to-end GRPO training: nanogrpo's train.py vs TRL's GRPOTrainer, same checkpoint, same settings.

    python bench/bench_train.py                          # everything, ~20 min on a 2-core CPU
    python bench/bench_train.py --parts speed            # one part (others kept from the JSON)
    python bench/bench_train.py --report_only            # rewrite the markdown from the JSON

Three parts, each trainer always in its own subprocess (peak RSS is that process's own, read with
os.wait4), the two trainers alternating (A B, then B A, ...) so background load hits both alike:

  speed   the embedded default (~70k-parameter Qwen2, char-level tokenizer, `configs/tiny.py`):
          16 prompts x 8 completions, 8 new tokens, micro-batch 64 (2 accumulation steps).
  big     a random ~47M-parameter Qwen2 (hidden 512, 8 layers, 8 heads, 2 kv heads, ffn 2048,
          vocab 32000, tied embeddings) with 4 prompts x 8 completions, 64 new tokens, one
          micro-batch of 32: enough arithmetic that the ratio is not only Python overhead. Reward
          `even_code_points` (below): every completion scores differently, so every row has an
          advantage and a gradient: the full forward + backward.
  big_flat  the same with the embedded default's reward, ~0 for every completion of this model, so
          every advantage is 0: nanogrpo scores such rows without gradient (fast.logprobs.policy_logprobs),
          TRL runs their forward and backward.
  curves  learning curves on the default task: both trainers, same number of steps, several seeds.

Per step: wall time (median over the steps after a warm-up), its split into sampling / scoring /
update, the logged mean reward. nanogrpo's numbers are its own metrics.jsonl (`step_time`,
`time/sample`, `time/score`, `time/update`); TRL's come from bench/trl_runner.py (a TrainerCallback
and a subclass timing its generation and scoring methods). The final checkpoint save and the
process start-up are outside the per-step times; they are in the process's wall time.

Settings shared by both sides (TRL's own defaults overridden where they differ from ours:
gradient_checkpointing, bf16, the linear schedule, adam_beta2, logging_steps):
num_generations 8, loss_type dapo, beta 0, lr 3e-3, AdamW betas (0.9, 0.99), weight decay 0,
constant lr without warmup, max_grad_norm 1, temperature 1 (no top-k/top-p), fp32 on CPU.

The 47M model's tokenizer: nanogrpo.tokenizer.char_level_tokenizer over "abcdefgh=" plus 31990
private-use characters (U+F0000...), so the tokenizer has exactly the model's 32000 ids. Neither
sampler then has padded rows to skip (ours computes logits only for the tokenizer's ids, HF's
generate for all of the model's rows), both compute the full 32000-way LM head, and both sample from
the same support. A random policy over 32000 ids almost never emits eos (1/32000 per token), so
both generate the full 64 tokens, which keeps the step cost comparable.

trl, transformers and datasets are benchmark-only imports (the `bench` extra), used only by the
child processes that run TRL.
"""

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from importlib import metadata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from nanogrpo.run.configurator import read_config_file  # noqa: E402

INIT = f"--init_model={read_config_file('tiny')['init_model']!r}"  # tiny.py's random model, built at --model

# Settings passed identically to both trainers (names are nanogrpo's train.py keys and trl_runner's flags).
TINY = dict(
    num_generations=8,
    per_device_train_batch_size=64,
    gradient_accumulation_steps=2,
    max_completion_length=8,
    temperature=1.0,
    loss_type="dapo",
    beta=0.0,
    learning_rate=3e-3,
    adam_beta2=0.99,
    max_grad_norm=1.0,
)
BIG_FLAT = dict(
    TINY, per_device_train_batch_size=32, gradient_accumulation_steps=1, max_completion_length=64
)
BIG = dict(BIG_FLAT, reward_funcs="bench/bench_train.py:even_code_points")
BIG_MODEL = dict(
    model_type="qwen2",
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
    rope_theta=10000.0,
)
TRAINERS = ("nanogrpo", "trl")


def even_code_points(completions, **kwargs) -> list[float]:
    """The big part's reward: the fraction of a completion's characters whose code point is even. A random
    policy over the 47M model's 32000 characters scores ~0.5 +- 0.06, so no two completions of a group tie."""
    from nanogrpo.extras.builtin_rewards import completion_text

    texts = [completion_text(c) for c in completions]
    return [sum(ord(ch) % 2 == 0 for ch in t) / max(len(t), 1) for t in texts]


# -----------------------------------------------------------------------------
# checkpoints


def make_tiny_checkpoint(path: str, seed: int):
    """The embedded default's random init, made by train.py's own code (random weights from `seed`)."""
    from nanogrpo.distributed import DistInfo
    from nanogrpo.run import ensure_tiny_checkpoint
    from nanogrpo.run.configurator import load_config

    ensure_tiny_checkpoint(
        load_config(["--config", "tiny.py", f"--model={path}", INIT, f"--seed={seed}"]), DistInfo()
    )


def make_big_checkpoint(path: str, seed: int = 0):
    """The ~47M random Qwen2 with a 32000-id char-level tokenizer (see the module docstring)."""
    if os.path.exists(os.path.join(path, "config.json")):
        return
    import torch

    from nanogrpo.checkpoint import save_model
    from nanogrpo.extras.tasks import DEFAULT_TASK_CHARS
    from nanogrpo.model import ModelConfig, Transformer
    from nanogrpo.tokenizer import char_level_tokenizer

    extra = 32000 - 1 - len(DEFAULT_TASK_CHARS)
    tok = char_level_tokenizer(DEFAULT_TASK_CHARS + "".join(chr(0xF0000 + i) for i in range(extra)))
    assert tok.vocab_size == BIG_MODEL["vocab_size"], tok.vocab_size
    torch.manual_seed(seed)
    cfg = ModelConfig(**BIG_MODEL)
    model = Transformer(cfg)
    gen = {"eos_token_id": sorted(tok.eos_token_ids), "pad_token_id": tok.pad_token_id}
    save_model(model, path, tokenizer=tok, generation_config=gen)
    del model


# -----------------------------------------------------------------------------
# running one trainer in its own process


def loadavg() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def run_child(cmd: list[str], log_path: str) -> dict:
    """Run cmd (cwd = repo root, PYTHONPATH = repo root); its wall time, peak RSS and CPU time."""
    env = dict(
        os.environ,
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_NO_ADVISORY_WARNINGS="1",
    )
    load0 = loadavg()
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"{shlex.join(cmd)} failed ({proc.returncode}); log {log_path}:\n{tail}")
    return {
        "wall_s": wall,
        "peak_rss_mb": usage.ru_maxrss / 1024,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "loadavg_before": load0,
        "loadavg_after": loadavg(),
    }


def trainer_cmd(
    trainer: str, model: str, out_dir: str, steps: int, seed: int, settings: dict
) -> list[str]:
    if trainer == "nanogrpo":
        return [
            sys.executable,
            "train.py",
            "--config",
            "tiny.py",
            f"--model={model}",
            f"--output_dir={out_dir}",
            f"--max_steps={steps}",
            f"--seed={seed}",
            "--eval_strategy=no",
            "--save_steps=0",
            "--overwrite_output_dir=true",
            *[f"--{k}={v}" for k, v in settings.items()],
        ]
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
        *[a for k, v in settings.items() for a in (f"--{k}", str(v))],
    ]


STEP_KEYS = (
    "step",
    "reward",
    "step_time",
    "time/sample",
    "time/score",
    "time/update",
    "completions/mean_length",
)


def run_trainer(trainer, model, work, tag, steps, seed, settings) -> dict:
    out_dir = os.path.join(work, tag)
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    if os.path.exists(metrics_path):
        os.remove(metrics_path)
    os.makedirs(out_dir, exist_ok=True)
    cmd = trainer_cmd(trainer, model, out_dir, steps, seed, settings)
    proc = run_child(cmd, os.path.join(out_dir, "log.txt"))
    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if len(rows) != steps:
        raise RuntimeError(f"{tag}: {len(rows)} steps in {metrics_path}, expected {steps}")
    steps_out = [{k: round(r[k], 5) for k in STEP_KEYS if k in r} for r in rows]
    print(
        f"  {tag:28s} {trainer:8s} median step {median_step(steps_out, 1):.3f}s  "
        f"peak RSS {proc['peak_rss_mb']:.0f} MB  wall {proc['wall_s']:.1f}s  load {proc['loadavg_before']:.1f}",
        flush=True,
    )
    return {
        "trainer": trainer,
        "tag": tag,
        "seed": seed,
        "cmd": shlex.join(cmd),
        **proc,
        "steps": steps_out,
    }


def median_step(steps, warmup, key="step_time"):
    vals = [s[key] for s in steps[warmup:]] or [s[key] for s in steps]
    return statistics.median(vals)


# -----------------------------------------------------------------------------
# the parts


def part_speed(args, name, model, settings, steps, reps, warmup) -> dict:
    print(f"[{name}] {steps} steps x {reps} alternations per trainer", flush=True)
    runs = []
    for rep in range(reps):
        order = TRAINERS if rep % 2 == 0 else TRAINERS[::-1]
        for trainer in order:
            runs.append(
                run_trainer(
                    trainer, model, args.work, f"{name}/{trainer}-{rep}", steps, args.seed, settings
                )
            )
    return {
        "model": model,
        "settings": settings,
        "steps": steps,
        "reps": reps,
        "warmup": warmup,
        "seed": args.seed,
        "runs": runs,
    }


def part_curves(args) -> dict:
    print(f"[curves] {args.curve_steps} steps x seeds {args.seeds} per trainer", flush=True)
    runs = []
    for i, seed in enumerate(args.seeds):
        model = os.path.join(args.work, f"tiny-init-{seed}")
        make_tiny_checkpoint(model, seed)
        order = TRAINERS if i % 2 == 0 else TRAINERS[::-1]
        for trainer in order:
            runs.append(
                run_trainer(
                    trainer,
                    model,
                    args.work,
                    f"curves/{trainer}-{seed}",
                    args.curve_steps,
                    seed,
                    TINY,
                )
            )
    return {"settings": TINY, "steps": args.curve_steps, "seeds": args.seeds, "runs": runs}


def import_baselines(args) -> dict:
    """Peak RSS of a process that only imports each trainer's stack (no model, no data)."""
    snippets = {
        "nanogrpo": "import train",
        "trl": "import torch, transformers, datasets, trl; from trl import GRPOTrainer, GRPOConfig; "
        "from transformers import AutoModelForCausalLM",
    }
    out = {}
    for trainer, code in snippets.items():
        os.makedirs(os.path.join(args.work, "imports"), exist_ok=True)
        out[trainer] = run_child(
            [sys.executable, "-c", code], os.path.join(args.work, "imports", f"{trainer}.txt")
        )
        out[trainer]["code"] = code
    return out


def machine_info() -> dict:
    def sh(cmd):
        try:
            return subprocess.run(
                cmd, shell=True, capture_output=True, text=True, timeout=30
            ).stdout.strip()
        except Exception as e:  # noqa: BLE001 - informational only
            return f"({e})"

    versions = {}
    for pkg in ("torch", "transformers", "trl", "accelerate", "datasets"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {
        "nproc": sh("nproc"),
        "lscpu_head": sh("lscpu | head"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "mem_total": sh("grep MemTotal /proc/meminfo"),
        "versions": versions,
    }


# -----------------------------------------------------------------------------
# summaries and the markdown report


def summarize_speed(part: dict) -> dict:
    """Per trainer: median step time (pooled over runs, steps after warm-up), median split, peak RSS."""
    warmup, out = part["warmup"], {}
    for trainer in TRAINERS:
        runs = [r for r in part["runs"] if r["trainer"] == trainer]
        steady = [s for r in runs for s in r["steps"][warmup:]]
        med = {
            k: statistics.median(s[k] for s in steady)
            for k in ("step_time", "time/sample", "time/score", "time/update")
        }
        out[trainer] = {
            "step_median": med["step_time"],
            "sample": med["time/sample"],
            "score": med["time/score"],
            "update": med["time/update"],
            "run_medians": [median_step(r["steps"], warmup) for r in runs],
            "steady_mean": statistics.fmean(s["step_time"] for s in steady),
            "warmup_s": statistics.median(
                sum(s["step_time"] for s in r["steps"][:warmup]) for r in runs
            ),
            "all_steps_s": statistics.median(sum(s["step_time"] for s in r["steps"]) for r in runs),
            "wall_s": statistics.median(r["wall_s"] for r in runs),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
            "cpu_s": statistics.median(r["cpu_s"] for r in runs),
            "mean_length": statistics.fmean(
                s.get("completions/mean_length", float("nan")) for s in steady
            ),
            "loadavg": statistics.median(r["loadavg_before"] for r in runs),
            "n_steps": len(steady),
        }
    return out


def curve_summary(part: dict, window: int = 10) -> dict:
    """Per trainer: per-seed mean reward over the first and last `window` steps, and per-step mean over seeds."""
    out = {}
    for trainer in TRAINERS:
        runs = [r for r in part["runs"] if r["trainer"] == trainer]
        rewards = [[s["reward"] for s in r["steps"]] for r in runs]
        first = [statistics.fmean(x[:window]) for x in rewards]
        last = [statistics.fmean(x[-window:]) for x in rewards]
        n = min(len(x) for x in rewards)
        mean_curve = [statistics.fmean(x[i] for x in rewards) for i in range(n)]
        times = [s["step_time"] for r in runs for s in r["steps"][3:]]
        out[trainer] = {
            "seeds": [r["seed"] for r in runs],
            "first": first,
            "last": last,
            "mean_curve": mean_curve,
            "step_median": statistics.median(times),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
        }
    return out


def windows_table(part: dict, width: int) -> list[tuple]:
    """(start, end, {trainer: (mean, min, max) over seeds of the window's mean reward})."""
    rows = []
    n = part["steps"]
    for start in range(0, n, width):
        end = min(n, start + width)
        cell = {}
        for trainer in TRAINERS:
            vals = [
                statistics.fmean(s["reward"] for s in r["steps"][start:end])
                for r in part["runs"]
                if r["trainer"] == trainer
            ]
            cell[trainer] = (statistics.fmean(vals), min(vals), max(vals))
        rows.append((start + 1, end, cell))
    return rows


def fmt_s(x):
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def speed_markdown(title: str, part: dict) -> list[str]:
    s = summarize_speed(part)
    a, b = s["nanogrpo"], s["trl"]
    st = part["settings"]
    lines = [
        f"#### {title}",
        "",
        f"{st['per_device_train_batch_size'] * st['gradient_accumulation_steps']} completions "
        f"({st['num_generations']} per prompt) per step, "
        f"{st['max_completion_length']} new tokens max, micro-batch "
        f"{st['per_device_train_batch_size']}, "
        f"{part['steps']} steps x {part['reps']} runs per trainer (alternating); per-step figures are the "
        f"median over the {a['n_steps']} steps after the first {part['warmup']} of each run.",
        "",
        "| | nanogrpo | TRL GRPOTrainer | nanogrpo / TRL |",
        "|---|---:|---:|---:|",
    ]

    def row(label, key, f=fmt_s):
        lines.append(f"| {label} | {f(a[key])} | {f(b[key])} | {a[key] / b[key]:.2f} |")

    row("**step time (median)**", "step_median")
    row("  sampling", "sample")
    row("  scoring (decode, rewards, advantages)", "score")
    row("  update (forward, backward, optimizer)", "update")
    row("step time (mean, after warm-up)", "steady_mean")
    row(f"first {part['warmup']} steps (warm-up, total)", "warmup_s")
    row("all steps (total, median run)", "all_steps_s")
    row("process wall time (start-up, steps, save)", "wall_s")
    row("process CPU time (user + sys)", "cpu_s")
    row("**peak RSS**", "peak_rss_mb", lambda x: f"{x:.0f} MB")
    lines.append(f"| mean completion length | {a['mean_length']:.1f} | {b['mean_length']:.1f} | |")
    lines.append(
        f"| per-run median step | {', '.join(fmt_s(x) for x in a['run_medians'])} | "
        f"{', '.join(fmt_s(x) for x in b['run_medians'])} | |"
    )
    lines.append(
        f"| 1-min load average at start (median) | {a['loadavg']:.1f} | {b['loadavg']:.1f} | |"
    )
    lines += [
        "",
        f"Speed-up (TRL / nanogrpo per-step median): **{b['step_median'] / a['step_median']:.2f}x**; "
        f"peak memory nanogrpo / TRL: **{a['peak_rss_mb'] / b['peak_rss_mb']:.2f}**.",
        "",
    ]
    return lines


def write_markdown(results: dict, path: str):
    m = results.get("machine", {})
    lines = [
        "## Results",
        "",
        "nanogrpo's `train.py` against TRL's `GRPOTrainer` (TRL "
        f"{m.get('versions', {}).get('trl')}, transformers {m.get('versions', {}).get('transformers')}, "
        f"torch {m.get('versions', {}).get('torch')}) on the same checkpoint, prompts, reward and GRPO "
        "settings (loss dapo, beta 0, lr 3e-3, AdamW betas (0.9, 0.99), constant lr, grad clip 1, "
        "temperature 1, fp32, no gradient checkpointing). Each trainer runs in its own process; the two "
        "alternate. Produced by `bench/bench_train.py` (TRL side: `bench/trl_runner.py`).",
        "",
    ]
    if "speed" in results:
        lines += speed_markdown(
            "Tiny model (the embedded default, ~70k parameters)", results["speed"]
        )
    if "big" in results:
        lines += speed_markdown(
            "Random Qwen2, ~47M parameters (hidden 512, 8 layers, vocab 32000); reward "
            "even_code_points: every row has an advantage",
            results["big"],
        )
    if "big_flat" in results:
        lines += speed_markdown(
            "The same model with the default task's reward, ~0 for every completion: every "
            "advantage is 0 (nanogrpo skips those rows' backward, TRL does not)",
            results["big_flat"],
        )
    if "imports" in results:
        imp = results["imports"]
        lines += [
            "Peak RSS of a process that only imports each stack (no model, no data): "
            f"nanogrpo (`{imp['nanogrpo']['code']}`) {imp['nanogrpo']['peak_rss_mb']:.0f} MB, "
            f"TRL (`import torch, transformers, datasets, trl` + `GRPOTrainer`) "
            f"{imp['trl']['peak_rss_mb']:.0f} MB.",
            "",
        ]
    if "curves" in results:
        part = results["curves"]
        cs = curve_summary(part)
        a, b = cs["nanogrpo"], cs["trl"]

        def spread(v):
            return f"{statistics.fmean(v):.3f} ({min(v):.3f} to {max(v):.3f})"

        lines += [
            "#### Learning curves on the default task",
            "",
            f"{part['steps']} steps, seeds {', '.join(map(str, part['seeds']))} (each seed: its own random "
            "init, shared by both trainers), 16 prompts x 8 completions per step. Mean reward per step as "
            "each trainer logs it (the mean over the step's 128 completions). Mean over seeds "
            "(min to max over seeds):",
            "",
            "| | nanogrpo | TRL GRPOTrainer |",
            "|---|---:|---:|",
            f"| mean reward, steps 1-10 | {spread(a['first'])} | {spread(b['first'])} |",
            f"| mean reward, last 10 steps | {spread(a['last'])} | {spread(b['last'])} |",
            f"| median step time in these runs | {fmt_s(a['step_median'])} | {fmt_s(b['step_median'])} |",
            f"| peak RSS | {a['peak_rss_mb']:.0f} MB | {b['peak_rss_mb']:.0f} MB |",
            "",
            "Window means (mean over seeds, min to max over seeds):",
            "",
            "| steps | nanogrpo | TRL | ranges overlap |",
            "|---|---:|---:|:---:|",
        ]
        for start, end, cell in windows_table(part, max(1, part["steps"] // 10)):
            (ma, la, ha), (mb, lb, hb) = cell["nanogrpo"], cell["trl"]
            overlap = "yes" if la <= hb and lb <= ha else "no"
            lines.append(
                f"| {start}-{end} | {ma:.3f} ({la:.3f}-{ha:.3f}) | {mb:.3f} ({lb:.3f}-{hb:.3f}) | {overlap} |"
            )
        lines += ["", "![reward curves](reward_curves.png)", ""]
    lines += ["#### Commands", "", "```"]
    for cmd in results.get("commands", []):
        lines.append(cmd)
    lines += [
        "python bench/plot.py bench/results/train_bench.json -o bench/results/reward_curves.png",
        "```",
        "",
        "One child process per run, e.g. (the exact command of every run is in `train_bench.json`):",
        "",
        "```",
    ]
    for key in ("speed", "big", "big_flat", "curves"):
        if key in results:
            for trainer in TRAINERS:
                run = next(r for r in results[key]["runs"] if r["trainer"] == trainer)
                lines.append(run["cmd"].replace(sys.executable, "python").replace(ROOT + "/", ""))
    lines += [
        "```",
        "",
        "#### Machine",
        "",
        f"`nproc`: {m.get('nproc')}; {m.get('mem_total')}; Python {m.get('python')}; {m.get('platform')}",
        "",
        "```",
        "$ lscpu | head",
        m.get("lscpu_head", ""),
        "```",
        "",
    ]
    with open(path, "w") as f:
        f.write("\n".join(lines))


# -----------------------------------------------------------------------------


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--parts",
        default="speed,big,big_flat,curves",
        help="comma list of speed, big, big_flat, curves",
    )
    p.add_argument(
        "--work", default=os.path.join(ROOT, "out", "bench"), help="scratch dir (checkpoints, runs)"
    )
    p.add_argument(
        "--results", default=os.path.join(ROOT, "bench", "results"), help="where JSON/markdown go"
    )
    p.add_argument(
        "--seed", type=int, default=1337, help="seed of the speed runs and the tiny checkpoint"
    )
    p.add_argument("--speed_steps", type=int, default=20)
    p.add_argument("--speed_reps", type=int, default=2, help="runs per trainer, alternating")
    p.add_argument("--big_steps", type=int, default=5)
    p.add_argument("--big_reps", type=int, default=2)
    p.add_argument(
        "--warmup", type=int, default=3, help="tiny: leading steps left out of the per-step medians"
    )
    p.add_argument("--big_warmup", type=int, default=1)
    p.add_argument("--curve_steps", type=int, default=100)
    p.add_argument(
        "--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[1337, 1338, 1339]
    )
    p.add_argument("--report_only", action="store_true")
    args = p.parse_args()

    os.makedirs(args.results, exist_ok=True)
    json_path = os.path.join(args.results, "train_bench.json")
    results = {}
    if os.path.exists(json_path):
        with open(json_path) as f:
            results = json.load(f)
    if not args.report_only:
        parts = [x for x in args.parts.split(",") if x]
        unknown = set(parts) - {"speed", "big", "big_flat", "curves", "imports"}
        if unknown:
            raise SystemExit(f"unknown parts {sorted(unknown)}")
        t0 = time.time()
        results["machine"] = machine_info()
        command = "python bench/bench_train.py " + shlex.join(sys.argv[1:])
        results["commands"] = [c for c in results.get("commands", []) if c != command.strip()] + [
            command.strip()
        ]
        os.makedirs(args.work, exist_ok=True)
        tiny = os.path.join(args.work, f"tiny-init-{args.seed}")
        if "speed" in parts:
            make_tiny_checkpoint(tiny, args.seed)
            results["speed"] = part_speed(
                args, "speed", tiny, TINY, args.speed_steps, args.speed_reps, args.warmup
            )
            results["imports"] = import_baselines(args)
        if "imports" in parts:
            results["imports"] = import_baselines(args)
        big = os.path.join(args.work, "qwen2-47m")
        for name, settings in (("big", BIG), ("big_flat", BIG_FLAT)):
            if name in parts:
                make_big_checkpoint(big)
                results[name] = part_speed(
                    args, name, big, settings, args.big_steps, args.big_reps, args.big_warmup
                )
        if "curves" in parts:
            results["curves"] = part_curves(args)
        print(f"benchmark time {time.time() - t0:.0f}s", flush=True)
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)
    write_markdown(results, os.path.join(args.results, "README_results.md"))
    print(f"wrote {json_path} and README_results.md", flush=True)


if __name__ == "__main__":
    main()
