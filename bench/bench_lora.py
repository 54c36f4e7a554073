"""LoRA: sampling with adapters active vs merged for the round; full fine-tuning vs LoRA (memory, time).

    python bench/bench_lora.py [--parts sample,train] [--shapes bench47m,smollm2] [--runs 2] [--threads 1]

Two random-weight shapes (the weights do not change the cost):
  bench47m  the benchmarks' ~47M Qwen2 (hidden 512, 8 layers, 8 heads, 2 kv heads, ffn 2048, vocab 32000, tied)
  smollm2   SmolLM2-135M (llama; hidden 576, 30 layers, 9 heads, 3 kv heads, ffn 1536, vocab 49152, tied)
LoRA is r = 16, lora_alpha = 32, all-linear (q, k, v, o, gate, up, down of every block), B nonzero.

sample  generate() for a GRPO-shaped batch (2 prompts of 64 tokens x 8 samples x 32 new tokens,
        temperature 1) three ways, timed in turns (median of --runs): `plain` (no adapters: the floor),
        `active` (adapters on: 2 extra small matmuls per linear per step), `merged` (W += s B A before
        the round, W -= s B A after it, then generation at plain cost). Merging costs r-rank
        matmuls over every targeted weight twice per round, and leaves the fp32 base weights rounded
        by one add and one subtract per round.
train   one micro-batch forward + backward + AdamW step (4 sequences of 64 tokens, fp32): full
        fine-tuning vs LoRA, timed in turns. Trainable parameters, and the bytes of weights +
        gradients + AdamW state (exp_avg, exp_avg_sq) counted from the tensors after the step
        (activations are not included: they are the same for both, and gradient checkpointing
        is what shrinks them).
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanogrpo.extras import lora  # noqa: E402
from nanogrpo.model import ModelConfig, Transformer  # noqa: E402
from nanogrpo.sampler import Sampling, generate  # noqa: E402

SHAPES = {
    "bench47m": dict(
        model_type="qwen2",
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "smollm2": dict(
        model_type="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        tie_word_embeddings=True,
        rope_theta=100000.0,
    ),
}
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fns, device, runs):
    """Warm each function up once, then time them in turns: median seconds of `runs` calls each."""
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


def build(shape, device, with_lora):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(max_position_embeddings=1024, **SHAPES[shape])).to(device)
    if with_lora:
        lora.apply_lora(model, **LORA)
        with torch.no_grad():
            for m in lora.lora_layers(model).values():
                m.lora_B.weight.normal_(std=0.01)
    return model


@torch.no_grad()
def merge_(model, sign):
    """W += sign * s B A on every adapter layer, adapters off while merged (sign=+1), on again after (-1)."""
    for m in lora.lora_layers(model).values():
        m.weight.add_(sign * m.scaling * (m.lora_B.weight @ m.lora_A.weight))
        m.adapter_enabled = sign < 0


def bench_sample(shape, device, runs):
    model = build(shape, device, with_lora=True).eval()
    plain = build(shape, device, with_lora=False).eval()
    V = model.config.vocab_size
    prompts = torch.randint(0, V - 1, (2, 64), generator=torch.Generator().manual_seed(0)).tolist()

    def gen(m):
        settings = Sampling(max_new_tokens=32, stop_ids={V - 1}, vocab_size=V - 1)
        gen = torch.Generator(device).manual_seed(0)
        generate(m, prompts, settings, num_samples=8, generator=gen)

    def merged():
        merge_(model, +1)
        gen(model)
        merge_(model, -1)

    t_plain, t_active, t_merged = timed(
        [lambda: gen(plain), lambda: gen(model), merged], device, runs
    )
    t0 = time.perf_counter()
    merge_(model, +1), merge_(model, -1)
    sync(device)
    t_merge = time.perf_counter() - t0
    print(
        f"{shape} sample: plain {t_plain:.2f}s | adapters active {t_active:.2f}s ({t_active / t_plain:.2f}x plain)"
        f" | merged for the round {t_merged:.2f}s ({t_merged / t_plain:.2f}x; merge+unmerge {t_merge:.3f}s)"
        f" | active/merged {t_active / t_merged:.2f}",
        flush=True,
    )


def state_bytes(model, optimizer):
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(
        p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None
    )
    opt = sum(
        t.numel() * t.element_size()
        for s in optimizer.state.values()
        for t in s.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    return params, grads, opt


def bench_train(shape, device, runs):
    setups = {}
    for name in ("full", "lora"):
        model = build(shape, device, with_lora=name == "lora").train()
        opt = torch.optim.AdamW(lora.trainable_parameters(model), lr=1e-5)
        setups[name] = (model, opt)
    ids = torch.randint(0, 32000, (4, 64), generator=torch.Generator().manual_seed(0)).to(device)

    def step(name):
        model, opt = setups[name]
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # keep the grads allocated: they count toward the peak

    t_full, t_lora = timed([lambda: step("full"), lambda: step("lora")], device, runs)
    for name, t in (("full", t_full), ("lora", t_lora)):
        model, opt = setups[name]
        total = sum(p.numel() for p in model.parameters())
        trainable = sum(p.numel() for p in lora.trainable_parameters(model))
        w, g, o = (b / 2**20 for b in state_bytes(model, opt))
        print(
            f"{shape} train {name:4s}: trainable {trainable / 1e6:.2f}M of {total / 1e6:.2f}M "
            f"({100 * trainable / total:.2f}%) | weights {w:.0f} + grads {g:.0f} + AdamW {o:.0f} = "
            f"{w + g + o:.0f} MiB | step {t:.2f}s",
            flush=True,
        )
    print(f"{shape} train: LoRA step time / full = {t_lora / t_full:.2f}", flush=True)


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--parts", default="sample,train")
    p.add_argument("--shapes", default="bench47m,smollm2")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads (1 is steadiest on a shared, loaded CPU)",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {device}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}"
    )
    for shape in args.shapes.split(","):
        if "sample" in args.parts:
            bench_sample(shape, device, args.runs)
        if "train" in args.parts:
            bench_train(shape, device, args.runs)
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
