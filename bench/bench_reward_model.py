"""What a reward model costs per GRPO step: a SmolLM2-135M-shaped LlamaForSequenceClassification (random
weights, the real SmolLM2 tokenizer and chat template from .cache/real) scoring N completions of C tokens
after a short conversational prompt, through the function train.py calls (`reward_model` of
nanogrpo/extras/reward_model.py).

Interleaved in one process, `--repeats` times: (a) the reward function's call (chat template, tokenization,
micro-batched forward, pooled score head) and (b) a baseline: one no-grad forward of the same decoder
(`hidden_states`, no head) over the same right-padded token ids, so a/b says how much the reward path adds
on top of the arithmetic it cannot avoid. Then, for scale, the median step time of the embedded default
run (configs/tiny.py, a few steps), measured in the same process.

    python bench/bench_reward_model.py                   # 64 completions x 128 tokens, fp32, CPU
    python bench/bench_reward_model.py --n 16 --repeats 3

Report `uptime` beside the numbers: the machine's cores may be shared.
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from nanogrpo.checkpoint import read_json, save_model  # noqa: E402
from nanogrpo.checkpoint.hf_format import config_from_hf  # noqa: E402
from nanogrpo.extras.reward_model import reward_model  # noqa: E402
from nanogrpo.model import Transformer  # noqa: E402
from nanogrpo.tokenizer import Tokenizer  # noqa: E402

REAL = os.path.join(ROOT, ".cache", "real", "smollm2-135m-instruct")
SENTENCE = (
    "To add the two numbers we first line up the digits, then carry the ones; the answer is 42. "
)


def make_classifier(out: str) -> Transformer:
    """A SmolLM2-135M-shaped classifier (random weights) saved at `out` with SmolLM2's tokenizer."""
    hf = dict(
        read_json(os.path.join(REAL, "config.json")),
        architectures=["LlamaForSequenceClassification"],
    )
    torch.manual_seed(0)
    model = Transformer(config_from_hf(dict(hf, id2label={"0": "LABEL_0"})))
    save_model(model, out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(REAL, name), out)
    return model


def tiny_step_time(steps: int) -> float:
    """Median step_time (s) of the embedded default run, after the first step."""
    import train
    from nanogrpo.run.configurator import load_config

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(
            [
                "--config",
                "tiny.py",
                f"--model={tmp}/init",
                f"--output_dir={tmp}/run",
                f"--max_steps={steps}",
                "--eval_strategy=no",
                "--save_steps=0",
            ]
        )
        history = train.train(cfg)
    return statistics.median(m["step_time"] for m in history[1:])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=64, help="completions scored per step")
    p.add_argument("--completion_tokens", type=int, default=128)
    p.add_argument("--batch_size", type=int, default=32, help="reward-model micro-batch")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--tiny_steps", type=int, default=6)
    args = p.parse_args()
    if not os.path.isdir(REAL):
        sys.exit(f"{REAL} is missing: run `python tests/fetch_real.py` first")
    torch.set_num_threads(torch.get_num_threads())
    tok = Tokenizer.from_pretrained(REAL)
    ids = tok.encode(SENTENCE * (args.completion_tokens // 8 + 8), add_special_tokens=False)
    prompts = [
        [{"role": "user", "content": f"What is {i} + {42 - i}? Explain."}] for i in range(args.n)
    ]
    completions = [
        [{"role": "assistant", "content": tok.decode(ids[i % 7 : i % 7 + args.completion_tokens])}]
        for i in range(args.n)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        model = make_classifier(os.path.join(tmp, "rm")).eval()
        name, fn = reward_model(os.path.join(tmp, "rm"), batch_size=args.batch_size)
    params = sum(p.numel() for p in model.parameters())
    texts = [
        tok.apply_chat_template(p + c, add_generation_prompt=False)
        for p, c in zip(prompts, completions)
    ]
    rows = [tok.encode(t, add_special_tokens=False) for t in texts]
    T = max(map(len, rows))
    padded = torch.tensor([r + [tok.pad_token_id] * (T - len(r)) for r in rows])
    real = torch.arange(T) < torch.tensor([len(r) for r in rows])[:, None]
    times = {"reward_model": [], "forward": []}
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        fn(prompts=prompts, completions=completions)
        times["reward_model"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with torch.no_grad():
            for start in range(0, args.n, args.batch_size):
                model.hidden_states(
                    padded[start : start + args.batch_size], real[start : start + args.batch_size]
                )
        times["forward"].append(time.perf_counter() - t0)
    rm_s, fwd_s = statistics.median(times["reward_model"]), statistics.median(times["forward"])
    tiny = tiny_step_time(args.tiny_steps)
    print(
        f"reward model {name!r}: {params / 1e6:.1f}M parameters ({params * 4 / 2**20:.0f} MiB fp32, "
        f"{params * 2 / 2**20:.0f} MiB bf16 per rank)"
    )
    print(
        f"{args.n} completions x {args.completion_tokens} tokens ({sum(map(len, rows))} tokens with prompts and "
        f"template, longest {T}), micro-batch {args.batch_size}, {torch.get_num_threads()} threads, "
        f"{args.repeats} interleaved repeats"
    )
    print(
        f"  reward model call (template + tokenize + forward + score): {rm_s:.2f} s "
        f"({rm_s / args.n * 1000:.0f} ms per completion)"
    )
    print(
        f"  baseline: same decoder, forward only, same ids:           {fwd_s:.2f} s  -> ratio {rm_s / fwd_s:.2f}"
    )
    print(
        f"  embedded default run (configs/tiny.py) step time:          {tiny:.3f} s  -> reward model = "
        f"{rm_s / tiny:.0f}x a tiny step"
    )
    print(f"  load: {open('/proc/loadavg').read().strip()}")


if __name__ == "__main__":
    main()
