"""Sampler throughput: nanogrpo.sampler.generate vs transformers' generate, same weights, same process.

    python bench/bench_sampler.py [--runs 3] [--device cpu|cuda] [--dtype float32|bfloat16] [--compile]

A random Qwen2-shaped checkpoint (~47M parameters: hidden 512, 8 layers, 8 heads, 2 kv heads, ffn
2048, vocab 32000, tied embeddings) is built with our Transformer, saved, and loaded into
transformers. The batch is GRPO-shaped: 4 prompts of 128 tokens x 8 samples x 64 new tokens,
temperature 1, no other filter. The stop id (31999) never fires: we cut the vocabulary below it
(`vocab_size=31999`) and transformers gets `min_new_tokens=64`, so both generate exactly 64 tokens
per row. Each side is warmed up once, then both are timed in turns, `--runs` times (median).

Also printed: the matmul-only limit, i.e. 64 x the time of one decode step's matrix products at
batch 32 (every Linear weight of every layer times a [32, in] activation, plus the LM head), and each
row's speed as a fraction of it. On CPU our sampler computes the LM head in slices of 2048 vocab rows
(faster with MKL), so the limit is also shown with that slicing. The limit leaves out prefill,
attention, norms and sampling, so 100% is out of reach. transformers is an optional,
benchmark-only import.

Measured on the 2-core shared dev CPU (AMD EPYC, torch 2.13, MKL), idle machine, 2 threads:
ours 4.20 s (488 tokens/s), transformers 5.23 8.44 s (243 tokens/s): 2.01x; matmul-only limit
2.62 s (62% of it), 2.24 s with the sliced LM head (53%). With 1 thread: 1.80x, 67%. Background
load on the cores slows both sides several-fold, hence the interleaved runs.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanogrpo.checkpoint import load_model, save_model
from nanogrpo.model import ModelConfig, Transformer  # noqa: E402
from nanogrpo.sampler import generate  # noqa: E402

PROMPTS, PROMPT_LEN, G, NEW = 4, 128, 8, 64
STOP = 31999


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fns, device, runs):
    """Warm each function up once, then time them in turns (so background load hits both alike):
    the median wall time of `runs` calls of each."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(runs):
        for fn, ts in zip(fns, times):
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def matmul_limit(model, batch, device, head_chunk=None, reps=20):
    """Seconds for one decode step's matrix products at `batch` rows: every Linear weight of every
    layer times a [batch, in] activation, plus the LM head (in `head_chunk`-row slices if given)."""
    weights = [m.weight for m in model.layers.modules() if isinstance(m, torch.nn.Linear)]
    head = model.lm_head.weight
    chunk = head_chunk or head.shape[0]
    weights += [head[i:i + chunk] for i in range(0, head.shape[0], chunk)]
    xs = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=w.dtype, device=device) for w in weights}

    def step():
        for w in weights:
            F.linear(xs[w.shape[1]], w)

    with torch.no_grad():
        return timed([lambda: [step() for _ in range(reps)]], device, 5)[0] / reps


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", action="store_true", help="torch.compile our model's forward (GPU users)")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)

    cfg = ModelConfig(model_type="qwen2", vocab_size=32000, hidden_size=512, intermediate_size=2048,
                      num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                      max_position_embeddings=1024, tie_word_embeddings=True)
    model = Transformer(cfg).to(device=device, dtype=dtype)
    n_params = sum(p.numel() for p in model.parameters())
    prompts = torch.randint(0, STOP, (PROMPTS, PROMPT_LEN)).tolist()
    N = PROMPTS * G

    ours_model = model
    if args.compile:
        ours_model = Transformer(cfg).to(device=device, dtype=dtype)
        ours_model.load_state_dict(model.state_dict())
        ours_model.hidden_states = torch.compile(ours_model.hidden_states, dynamic=True)

    def ours():
        out = generate(ours_model, prompts, num_samples=G, max_new_tokens=NEW, temperature=1.0,
                       stop_ids=[STOP], pad_id=0, vocab_size=STOP)
        assert out.completion_ids.shape == (N, NEW) and out.truncated.all()

    fns, names = [ours], ["nanogrpo.sampler.generate"]
    if not args.no_hf:
        try:
            from transformers import AutoModelForCausalLM
        except ImportError:
            print("transformers not installed: skipping the baseline")
        else:
            with tempfile.TemporaryDirectory() as tmp:
                save_model(model, tmp)
                hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).to(device).eval()
            ids = torch.tensor(prompts, device=device)

            def theirs():
                with torch.inference_mode():
                    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                                      top_k=0, top_p=1.0, num_return_sequences=G, max_new_tokens=NEW,
                                      min_new_tokens=NEW, eos_token_id=STOP, pad_token_id=0)
                assert out.shape == (N, PROMPT_LEN + NEW)

            fns.append(theirs)
            names.append("transformers generate")
    rows = list(zip(names, timed(fns, device, args.runs)))

    t_mm = matmul_limit(model, N, device) * NEW
    t_mm_chunked = matmul_limit(model, N, device, head_chunk=2048) * NEW if device.type == "cpu" else None
    tokens = N * NEW
    print(f"\n{n_params / 1e6:.1f}M-parameter Qwen2-shaped model, {args.device} {args.dtype}, "
          f"{torch.get_num_threads()} threads; {PROMPTS} prompts x {PROMPT_LEN} tokens x {G} samples x "
          f"{NEW} new tokens\n")
    print("| sampler | seconds | tokens/s | vs transformers | matmul-only limit / time |")
    print("|---|---|---|---|---|")
    t_hf = dict(rows).get("transformers generate")
    limits = [("matmul-only limit: 64 decode steps' Linear products", t_mm)]
    if t_mm_chunked:
        limits.append(("same, LM head in 2048-row slices (as our sampler on CPU)", t_mm_chunked))
    for name, t in rows + limits:
        ratio = f"{t_hf / t:.2f}x" if t_hf else "-"
        print(f"| {name} | {t:.3f} | {tokens / t:,.0f} | {ratio} | {t_mm / t:.0%} |")
    if t_mm_chunked:
        print(f"\nours vs the sliced-head limit: {t_mm_chunked / dict(rows)['nanogrpo.sampler.generate']:.0%}")


if __name__ == "__main__":
    main()
