"""Peak memory and time of forward + backward for completion log-probs + entropy at Qwen2.5's
vocabulary (V = 151,936): nanogrpo's chunked `token_logprobs` (nanogrpo/fast/logprobs.py) vs the
naive way (fp32 logits for every completion position, log_softmax, gather). Two chunked paths:
`chunked` keeps the probabilities of up to `keep_bytes` (1 GiB, the default) for backward,
`recompute` keeps none (keep_bytes=0) and recomputes every chunk's logits in backward.

Each path runs in a fresh subprocess so that its peak is its own: on CUDA the peak of
torch.cuda.max_memory_allocated, on CPU the peak resident set size (getrusage ru_maxrss); both
reported above the baseline taken after the model and inputs exist (parameter gradients
included). The trunk is tiny on purpose (the LM head dominates), so the numbers isolate the logits.

    python bench/bench_logprobs.py                       # 8 x 512 completion tokens, CPU or CUDA
    python bench/bench_logprobs.py --n 2 --device cpu
    python bench/bench_logprobs.py --hidden 896 --layers 1 --n 4 --autocast   # the 0.5B's LM head
"""

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from nanogrpo.fast.logprobs import KEEP_BYTES, token_logprobs
from nanogrpo.model import ModelConfig, Transformer


def peak_rss_mb():
    """Peak resident set size of this process so far, MB (Linux reports KB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mb():
    """Resident set size now, MB (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def naive_logprobs(model, ids, att, cmask, temperature):
    """The memory-hungry reference: [N,C,V] fp32 logits kept for backward."""
    C = cmask.shape[1]
    h = model.hidden_states(ids, attention_mask=att)[:, -C - 1 : -1]  # [N,C,D]
    logits = model.lm_head(h).float() / temperature  # [N,C,V]
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, ids[:, -C:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return torch.where(cmask, logp, 0), torch.where(cmask, entropy, 0)


def worker(args):
    """Build the model and batch, run one path `args.repeats` times; print a JSON line."""
    torch.manual_seed(0)
    dev = torch.device(args.device)
    cfg = ModelConfig(
        model_type="qwen2",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    model = Transformer(cfg).to(dev)
    L = args.prompt + args.c
    ids = torch.randint(0, args.vocab, (args.n, L), device=dev)
    att = torch.ones(args.n, L, dtype=torch.long, device=dev)
    cmask = torch.ones(args.n, args.c, dtype=torch.bool, device=dev)
    cmask[:, -args.c // 8 :] = False  # some right padding
    keep = {"chunked": KEEP_BYTES, "recompute": 0}.get(args.worker)
    fn = (
        naive_logprobs
        if args.worker == "naive"
        else (lambda *a: token_logprobs(*a, chunk_size=args.chunk, keep_bytes=keep))
    )

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=args.autocast):
            logp, ent = fn(model, ids, att, cmask, 0.9)
        loss = -(logp.sum() + 0.01 * ent.sum()) / cmask.sum()
        loss.backward()
        return loss.item()

    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:  # ru_maxrss never goes down: measure the first run against the resident size now
        base = current_rss_mb()
    loss = step()  # the memory run (parameter gradients are allocated in it, and counted)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    peak = (
        (torch.cuda.max_memory_allocated() - base) / 2**20
        if dev.type == "cuda"
        else peak_rss_mb() - base
    )
    times = []
    for _ in range(args.repeats):  # the timed runs
        model.zero_grad(set_to_none=False)
        t0 = time.perf_counter()
        step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    print(json.dumps({"path": args.worker, "peak_mb": peak, "time_s": min(times), "loss": loss}))


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--n", type=int, default=8, help="sequences")
    p.add_argument("--c", type=int, default=512, help="completion positions per sequence")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens per sequence")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--chunk", type=int, default=256, help="token_logprobs chunk_size")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--autocast",
        action="store_true",
        help="bf16 autocast over fp32 weights, as training on a GPU",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--worker", choices=["naive", "chunked", "recompute"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)

    print(
        f"device={args.device} N={args.n} C={args.c} prompt={args.prompt} V={args.vocab} hidden={args.hidden} "
        f"layers={args.layers} chunk={args.chunk} autocast={args.autocast}; fp32 logits of all completion tokens would be "
        f"{args.n * args.c * args.vocab * 4 / 2**20:.0f} MB"
    )
    rows = []
    for path in ("naive", "chunked", "recompute"):
        argv = [sys.executable, __file__, "--worker", path] + sys.argv[1:]
        out = subprocess.run(argv, capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"{path} failed:\n{out.stderr}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = rows[0]
    print(
        f"{'path':10s} {'peak MB':>9s} {'time s':>8s} {'peak ratio':>11s} {'time ratio':>11s} {'loss':>12s}"
    )
    for r in rows:
        print(
            f"{r['path']:10s} {r['peak_mb']:9.0f} {r['time_s']:8.2f} {r['peak_mb'] / base['peak_mb']:11.3f} "
            f"{r['time_s'] / base['time_s']:11.2f} {r['loss']:12.6f}"
        )


if __name__ == "__main__":
    main()
