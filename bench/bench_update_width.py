"""The update's forward + backward when each micro-batch runs only up to its own longest
completion (nanogrpo/fast/logprobs.py's `scored_width`) against the same micro-batches run at the
round's width, side by side in one process.

    python bench/bench_update_width.py                    # 47M shape, round of 32 x 256, CPU
    python bench/bench_update_width.py --c 512 --repeats 5

A GRPO round's completions are right-padded to its longest one, and their lengths have a long
tail: most stop early, a few run to max_completion_length. The round here: `--n` completions
with lengths drawn from a log-normal (median `--median` tokens, clipped to [1, C]) and one of
length C, shuffled into micro-batches of `--micro` rows as train.py's micro_batches does. Each
repeat runs every micro-batch's policy_logprobs forward and a backward of its sum, once with the
cut and once with `scored_width` forced to the round's width (the two orders alternate), and
reports the median seconds of each and their ratio. The random weights do not change the cost.
"""

import argparse
import statistics
import time

import torch

from nanogrpo.fast import logprobs as fast_logprobs
from nanogrpo.model import ModelConfig, Transformer


def round_batch(args, g):
    """input_ids [n, P+C], attention [n, P+C], completion_mask [n, C] of one round."""
    lengths = torch.exp(torch.randn(args.n, generator=g) * 0.6) * args.median
    lengths = lengths.round().clamp(1, args.c).long()
    lengths[0] = args.c  # the round's longest
    ids = torch.randint(1, args.vocab, (args.n, args.prompt + args.c), generator=g)
    cmask = (torch.arange(args.c)[None] < lengths[:, None]).float()
    att = torch.ones_like(ids)
    return ids, att, cmask, lengths


def update_seconds(model, micro, full_width: bool, vocab):
    """Forward + backward of every micro-batch; full_width: scored_width returns the round's."""
    real = fast_logprobs.scored_width
    if full_width:
        fast_logprobs.scored_width = lambda mask: mask.shape[1]
    try:
        start = time.perf_counter()
        for ids, att, cmask in micro:
            advantages = torch.ones(len(ids))
            logps, _ = fast_logprobs.policy_logprobs(
                model, ids, att, cmask, advantages, beta=0.0, entropy_bonus=False, vocab_size=vocab
            )
            logps.sum().backward()
        return time.perf_counter() - start
    finally:
        fast_logprobs.scored_width = real


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=32, help="completions in the round")
    p.add_argument("--micro", type=int, default=8, help="rows per micro-batch")
    p.add_argument("--c", type=int, default=256, help="max_completion_length")
    p.add_argument("--median", type=float, default=80, help="median completion length")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = Transformer(cfg)
    g = torch.Generator().manual_seed(0)
    ids, att, cmask, lengths = round_batch(args, g)
    order = torch.randperm(args.n, generator=g)
    micro = []
    for i in range(0, args.n, args.micro):
        rows = order[i : i + args.micro]
        micro.append((ids[rows], att[rows], cmask[rows]))
    widths = [fast_logprobs.scored_width(m[2]) for m in micro]
    print(
        f"torch {torch.__version__}, {args.threads} threads; {args.layers} layers x {args.hidden}, "
        f"V={args.vocab}; round of {args.n} completions, width {args.c}, median length "
        f"{int(lengths.median())}; micro-batches of {args.micro}: widths {widths}"
    )
    update_seconds(model, micro[:1], False, args.vocab)  # warm-up
    cut, full = [], []
    for r in range(args.repeats):
        for full_width in (False, True) if r % 2 == 0 else (True, False):
            seconds = update_seconds(model, micro, full_width, args.vocab)
            (full if full_width else cut).append(seconds)
    cut_s, full_s = statistics.median(cut), statistics.median(full)
    print(f"round's width: {full_s:.2f} s | own width: {cut_s:.2f} s | ratio {full_s / cut_s:.2f}x")


if __name__ == "__main__":
    main()
