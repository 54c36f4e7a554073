"""What re-prefilling costs in a tool round: the tool rounds (nanogrpo/extras/tool_rounds.py, called by
rollout.py) keep no KV cache across rounds, so each round's `generate` prefills prompt +
completion-so-far again before decoding the next turn.

    python bench/bench_tool_prefill.py [--model .cache/real/smollm2-135m-instruct] [--rows 8] [--new 32]

Measures, interleaved (median of --reps): a round as tool_rounds.py runs it (prefill of the context, then
--new decode steps; stop ids off so every row decodes exactly --new tokens), and the prefill alone
(max_new_tokens=1). The prefill share is what a cross-round KV cache could save at most.
"""

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

import tool_calculator as task  # noqa: E402

from nanogrpo.checkpoint import load_model  # noqa: E402
from nanogrpo.extras.tools import tool_suffix_ids  # noqa: E402
from nanogrpo.sampler import Sampling, generate  # noqa: E402
from nanogrpo.tokenizer import Tokenizer  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=".cache/real/smollm2-135m-instruct")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    model, tok = load_model(args.model).eval(), Tokenizer.from_pretrained(args.model)
    rows = task.rows(args.rows, 3)
    contexts = []
    for r in (
        rows
    ):  # prompt + a first turn that called the tool + the tool result, as a tool round sees it
        a, b = r["prompt"][1]["content"].removeprefix("What is ").removesuffix("?").split(" * ")
        call = f'<tool_call>{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'
        ids = (
            tok.encode_prompt(r["prompt"])
            + tok.encode(call, add_special_tokens=False)
            + [tok.eos_token_id]
        )
        contexts.append(
            ids
            + tool_suffix_ids(tok, [{"role": "tool", "name": "multiply", "content": r["answer"]}])
        )
    times = {"round": [], "prefill": []}
    for _ in range(args.reps):
        for name, new in (("round", args.new), ("prefill", 1)):
            t = time.perf_counter()
            generate(
                model, contexts, Sampling(max_new_tokens=new), seeds=list(range(len(contexts)))
            )
            times[name].append(time.perf_counter() - t)
    rnd, pre = statistics.median(times["round"]), statistics.median(times["prefill"])
    lens = [len(c) for c in contexts]
    print(
        f"{args.rows} rows, context {min(lens)}-{max(lens)} tokens, {args.new} new tokens, "
        f"{torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}: round {rnd:.2f} s, prefill {pre:.2f} s "
        f"= {pre / rnd:.0%} of the round"
    )


if __name__ == "__main__":
    main()
