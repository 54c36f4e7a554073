"""The update alone, padded against packed (padding_free, nanogrpo/fast/packing.py), side by side in
one run: each micro-batch's policy_logprobs forward and a backward of its sum, on a long-tailed and
a uniform completion-length distribution.

    python bench/bench_packing.py                              # CPU, small sizes (< 2 minutes)
    python bench/bench_packing.py --hidden 512 --layers 8 --micro_batches 4 --repeats 5

A micro-batch is `--rows` completions of one prompt (a GRPO group, as with
per_device_train_batch_size = num_generations), the prompt `--prompt` tokens, left-padded to the
longest of its round; completions right-padded to the micro-batch's longest. Lengths: geometric
(mean `--mean`, capped at `--cap`: most short, a few long), uniform (every completion `--mean`
tokens: nothing to unpad) or run (each micro-batch the lengths of a logged step of a real run,
`--run_metrics`, configs/tools.py's by default: its min, mean and max). Three kernels score the same micro-batches, every advantage nonzero (no
row skipped):
- plain: logprobs.policy_logprobs (full logits, the padded rows);
- fast: fast/logprobs.py's (the default: the LM head in chunks, the padding after the micro-batch's
  longest completion cut, each prompt's forward once for its rows);
- packed: fast/packing.py's (one row of the real tokens, attention per sequence).
Reported: the fastest of `--repeats` passes over the micro-batches (the three kernels' passes
interleaved, so a busy machine slows them alike), tokens per second (real tokens:
prompts and completions, the same count for all three), and the peak memory of one micro-batch:
on CUDA torch.cuda.max_memory_allocated; on CPU the peak of the bytes of live tensors that torch's
ops allocate during the call (tracemalloc does not see torch's allocator), measured in a separate,
untimed pass. Ratios are against fast, the default.
"""

import argparse
import json
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from nanogrpo import logprobs
from nanogrpo.fast import logprobs as fast_logprobs, packing
from nanogrpo.model import ModelConfig, Transformer

KERNELS = {
    "plain": logprobs.policy_logprobs,
    "fast": fast_logprobs.policy_logprobs,
    "packed": packing.policy_logprobs,
}


class LiveBytes(TorchDispatchMode):
    """Inside it, `peak`: the most bytes of tensor storage alive at once among those its ops
    allocated (each storage counted once, until it is freed)."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.seen = set()

    def _freed(self, key, nbytes):
        self.live -= nbytes
        self.seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self.seen or storage.nbytes() == 0:
                continue
            self.seen.add(key)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key, storage.nbytes())
        return out


def completion_lengths(args, n, g, k=0):
    """[n] lengths of micro-batch k: geometric with mean args.mean capped at args.cap, all
    args.mean, or ("run") the k-th logged step of args.run_metrics: one completion at its
    completions/min_length, one at its max_length, the others equal, at the length that gives its
    mean_length (a run's metrics give those three; the spread between them is assumed)."""
    if args.dist == "run":
        with open(args.run_metrics) as f:
            step = [json.loads(line) for line in f if line.strip()][k]
        low, mean, high = (step[f"completions/{s}_length"] for s in ("min", "mean", "max"))
        rest = (mean * n - low - high) / max(n - 2, 1)
        lengths = [low, high] + [min(max(rest, low), high)] * (n - 2)
        return torch.tensor(lengths[:n]).round().clamp(min=1).long()
    if args.dist == "uniform":
        return torch.full((n,), args.mean)
    p = 1.0 / args.mean  # P(stop) at each token: mean 1/p
    u = torch.rand(n, generator=g).clamp(min=1e-12)
    lengths = torch.ceil(torch.log(u) / torch.log(torch.tensor(1 - p)))
    return lengths.clamp(1, args.cap).long()


def micro_batches(args, device):
    """[(input_ids, attention_mask, completion_mask)] of args.micro_batches groups."""
    g = torch.Generator().manual_seed(args.seed)
    P = args.prompt
    out = []
    for k in range(args.micro_batches):
        lengths = completion_lengths(args, args.rows, g, k)
        prompt_len = int(torch.randint(P // 2, P + 1, (1,), generator=g))
        C = int(lengths.max())
        ids = torch.randint(1, args.vocab, (args.rows, P + C), generator=g)
        att = torch.ones_like(ids)
        att[:, : P - prompt_len] = 0  # left padding
        cmask = (torch.arange(C)[None] < lengths[:, None]).float()
        out.append((ids.to(device), att.to(device), cmask.to(device)))
    return out


def one_pass(model, kernel, batches, vocab):
    for ids, att, cmask in batches:
        advantages = torch.ones(len(ids), device=ids.device)
        logps, _ = kernel(
            model, ids, att, cmask, advantages, beta=0.0, entropy_bonus=False, vocab_size=vocab
        )
        logps.sum().backward()
    model.zero_grad(set_to_none=True)


def peak_bytes(model, kernel, batch, vocab):
    """Peak memory of one micro-batch's forward + backward (see the module docstring)."""
    if batch[0].is_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        one_pass(model, kernel, [batch], vocab)
        return torch.cuda.max_memory_allocated() - base
    with LiveBytes() as live:
        one_pass(model, kernel, [batch], vocab)
    return live.peak


def seconds(model, kernel, batches, vocab):
    if batches[0][0].is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    one_pass(model, kernel, batches, vocab)
    if batches[0][0].is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def run(args, model, device):
    batches = micro_batches(args, device)
    real = sum(int(a[:, : a.shape[1] - c.shape[1]].sum() + c.sum()) for _, a, c in batches)
    padded = sum(a.numel() for _, a, _ in batches)
    C = [c.shape[1] for _, _, c in batches]
    mean_len = sum(int(c.sum()) for _, _, c in batches) / (args.rows * len(batches))
    print(
        f"\n{args.dist}: {len(batches)} micro-batches of {args.rows} rows, prompts <= {args.prompt}, "
        f"completions mean {mean_len:.0f} (longest per micro-batch {C}); "
        f"real tokens {real} of {padded} padded ({real / padded:.0%})"
    )
    for kernel in KERNELS.values():  # warm-up
        one_pass(model, kernel, batches[:1], args.vocab)
    times = {name: [] for name in KERNELS}
    for r in range(args.repeats):
        order = list(KERNELS) if r % 2 == 0 else list(KERNELS)[::-1]
        for name in order:
            times[name].append(seconds(model, KERNELS[name], batches, args.vocab))
    longest = max(range(len(batches)), key=lambda i: batches[i][2].shape[1])
    rows = {}
    for name, kernel in KERNELS.items():
        s = min(times[name])
        mem = peak_bytes(model, kernel, batches[longest], args.vocab)
        rows[name] = (s, real / s, mem)
    base_s, _, base_mem = rows["fast"]
    print(
        f"  {'kernel':8} {'s/pass':>8} {'tokens/s':>10} {'peak MB':>9} {'speed':>7} {'memory':>7}"
    )
    for name, (s, tps, mem) in rows.items():
        speed, memory = base_s / s, mem / base_mem
        print(f"  {name:8} {s:8.3f} {tps:10.0f} {mem / 2**20:9.1f} {speed:6.2f}x {memory:6.2f}x")
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv_heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--rows", type=int, default=8, help="completions per micro-batch (a group)")
    p.add_argument("--micro_batches", type=int, default=3)
    p.add_argument("--prompt", type=int, default=64, help="longest prompt")
    p.add_argument("--mean", type=int, default=64, help="mean completion length")
    p.add_argument("--cap", type=int, default=512, help="max_completion_length")
    p.add_argument("--dists", default="geometric,uniform,run")
    p.add_argument(
        "--run_metrics",
        default="bench/results/tools_metrics.jsonl",
        help="dist 'run': a run's metrics.jsonl (configs/tools.py's by default)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--bf16", action="store_true", help="bf16 weights (CUDA: varlen attention)")
    args = p.parse_args()
    torch.manual_seed(args.seed)
    cfg = ModelConfig(
        model_type="qwen2",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.prompt + args.cap + 1,
        tie_word_embeddings=True,
    )
    device = torch.device(args.device)
    model = Transformer(cfg).to(device)
    if args.bf16:
        model = model.to(torch.bfloat16)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {params / 1e6:.1f}M parameters ({args.layers} layers, hidden {args.hidden}, "
        f"vocab {args.vocab}), {device}, {torch.get_num_threads()} thread(s); the update's "
        "forward + backward; speed and memory are against fast (the default padded kernel)"
    )
    for dist in args.dists.split(","):
        args.dist = dist
        run(args, model, device)


if __name__ == "__main__":
    main()
