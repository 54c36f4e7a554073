"""Sampler throughput: nanogrpo.sampler.generate (eager: the default decode step, SharedPrefixDecoder;
compiled: StaticDecoder) vs transformers' generate, same weights, same process, and the cost of the
sampling filters against a decode step.

    python bench/bench_sampler.py                                   # 47M model, batch 32, top_p 1.0 / 0.95
    python bench/bench_sampler.py --models 47m,135m --batches 1,8,32 --compile
    python bench/bench_sampler.py --model .cache/real/smollm2-135m-instruct   # real weights
    python bench/bench_sampler.py --filter_cost                     # filters + draw vs a decode step
    python bench/bench_sampler.py --train_compile                   # training fwd+bwd: Blocks compiled?
    python bench/bench_sampler.py --where --model .cache/real/smollm2-135m-instruct   # where a step goes
    python bench/bench_sampler.py --where --chat --model .cache/real/smollm2-135m-instruct  # on chat prompts
    python bench/bench_sampler.py --shared --model .cache/real/smollm2-135m-instruct  # shared prompts
    python bench/bench_sampler.py --fused --batches 1,8,32 --model .cache/real/smollm2-135m-instruct
    python bench/bench_sampler.py --large_vocab --runs 5             # 4 x 12 tokens, 128k-262k vocabularies
    /work/fixvenv/bin/python bench/bench_sampler.py ...             # with transformers as the baseline

Models (random weights; built with our Transformer, saved, loaded into transformers when installed):
  47m   Qwen2-shaped, hidden 512, 8 layers, 8 heads / 2 kv heads, ffn 2048, vocab 32000, tied.
  135m  SmolLM2-135M-shaped (llama), hidden 576, 30 layers, 9 heads / 3 kv heads, ffn 1536, vocab 49152, tied.
Random weights give an almost flat next-token distribution (top-p 0.95 then keeps ~90% of the vocabulary,
which no trained model does), so by default the final norm is scaled until the logits have standard
deviation 5 (`--logit_std`; 0 keeps the flat random model): the top-p 0.95 nucleus is printed. Both
samplers see the same weights.

A batch of b rows is b/8 prompts x 8 samples (batch 1: one prompt, one sample) of 128 prompt tokens,
64 new tokens, temperature 1. The stop id (the last id) never fires: we cut the vocabulary below it
(`vocab_size=V-1`) and transformers gets `min_new_tokens=64`, so both generate exactly 64 tokens per
row. Each sampler is warmed up once (for the compiled one that warm-up, reported separately, is the
compile), then all are timed in turns, `--runs` times (median), so background load hits all alike.

The matmul limit: 64 x the time of one decode step's matrix products at the same batch (every Linear
weight of every layer times a [b, in] activation, plus the LM head in 2048-row slices as our sampler
does on CPU), measured in the same run. It leaves out prefill, attention, norms and sampling, so 100% is
out of reach. transformers is an optional, benchmark-only import.
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
from nanogrpo.checkpoint import save_model  # noqa: E402
from nanogrpo.fast.sampling import (
    StaticDecoder,
    filter_candidates,  # noqa: E402
    sample_next_token_fast,
)
from nanogrpo.fast.shared_prefix import SharedPrefixCache, SharedPrefixDecoder  # noqa: E402
from nanogrpo.model import ModelConfig, Transformer, lm_head_linear  # noqa: E402
from nanogrpo.sampler import (  # noqa: E402
    Sampling,
    apply_top_p,
    generate,
    lm_logits,
    sample_from,
    uniforms,  # noqa: E402
)

PROMPT_LEN, NEW = 128, 64
SHAPES = {
    "47m": dict(
        model_type="qwen2",
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    ),
    "135m": dict(
        model_type="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
    ),
    "qwen0.5b": dict(
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
    ),
}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def clock(fn, device):
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def timed(fns, device, runs):
    """Warm each function up once (returns those times too), then time them in turns: medians of `runs` calls."""
    warm = [clock(fn, device) for fn in fns]
    times = [[] for _ in fns]
    for _ in range(runs):
        for fn, ts in zip(fns, times):
            ts.append(clock(fn, device))
    return [statistics.median(ts) for ts in times], warm


def generate_new(
    model, prompts, G, top_p, new=NEW, sample_token=sample_next_token_fast, seeds=None, **fields
):
    """nanogrpo's generate with the training draw, exactly `new` tokens a row at temperature 1: the
    stop id (the last id) is cut from the vocabulary, so it never fires. fields: more of
    Sampling's (decoder)."""
    V = model.config.vocab_size
    settings = Sampling(
        max_new_tokens=new,
        top_p=top_p,
        stop_ids=[V - 1],
        vocab_size=V - 1,
        sample_token=sample_token,
        **fields,
    )
    return generate(model, prompts, settings, num_samples=G, seeds=seeds)


def matmul_limit(model, batch, device, head_chunk=2048, reps=10):
    """Seconds for one decode step's matrix products at `batch` rows: every Linear weight of every
    layer times a [batch, in] activation, plus the LM head in `head_chunk`-row slices."""
    weights = [m.weight for m in model.layers.modules() if isinstance(m, torch.nn.Linear)]
    head = model.lm_head.weight
    weights += [head[i : i + head_chunk] for i in range(0, head.shape[0], head_chunk)]
    xs = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=w.dtype, device=device) for w in weights}

    def step():
        for w in weights:
            F.linear(xs[w.shape[1]], w)

    with torch.no_grad():
        return timed([lambda: [step() for _ in range(reps)]], device, 3)[0][0] / reps


def build(name, device, dtype, logit_std):
    """A random model of the named shape; its final norm scaled so the logits have std `logit_std` (0: as is)."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**SHAPES[name])).to(device=device, dtype=dtype)
    if logit_std:
        with torch.no_grad():
            ids = torch.randint(0, model.config.vocab_size, (4, 64), device=device)
            std = model(ids).float().std()
            model.norm.weight *= logit_std / std
            kept = (
                apply_top_p(model(ids).float()[:, -8:].reshape(-1, model.config.vocab_size), 0.95)
                > -1e30
            ).sum(-1)
            print(
                f"{name}: logit std {logit_std}, top-p 0.95 nucleus median {kept.median():.0f}, max {kept.max()}"
            )
    return model


def model_for(args, name, device, dtype, logit_std):
    """--model's checkpoint (its own weights) on device in dtype, else the named random shape."""
    if not args.model:
        return build(name, device, dtype, logit_std)
    from nanogrpo.checkpoint import load_model

    return load_model(args.model).to(device=device, dtype=dtype).eval()


def bench_generation(args, device, dtype):
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        AutoModelForCausalLM = None
        print("transformers not installed: no baseline column")
    print(
        "| model | batch | top_p | ours eager tok/s | ours compiled tok/s | transformers tok/s | eager / tf "
        "| compiled / tf | eager / limit | compiled / limit | compile s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in [args.model] if args.model else args.models.split(","):
        model = model_for(args, name, device, dtype, args.logit_std)  # random-token prompts
        V = model.config.vocab_size
        hf = None
        if AutoModelForCausalLM is not None and not args.no_hf:
            with tempfile.TemporaryDirectory() as tmp:
                save_model(model, tmp)
                hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).to(device).eval()
        for batch in map(int, args.batches.split(",")):
            G = min(batch, 8)
            prompts = torch.randint(0, V - 1, (batch // G, PROMPT_LEN)).tolist()
            t_limit = matmul_limit(model, batch, device) * NEW
            for top_p in map(float, args.top_p.split(",")):

                def ours(compiled):
                    def run():
                        decoder = StaticDecoder if compiled else SharedPrefixDecoder
                        out = generate_new(model, prompts, G, top_p, decoder=decoder)
                        assert out.completion_ids.shape == (batch, NEW) and out.truncated.all()

                    return run

                def theirs():
                    ids = torch.tensor(prompts, device=device)
                    with torch.inference_mode():
                        out = hf.generate(
                            ids,
                            attention_mask=torch.ones_like(ids),
                            do_sample=True,
                            temperature=1.0,
                            top_k=0,
                            top_p=top_p,
                            num_return_sequences=G,
                            max_new_tokens=NEW,
                            min_new_tokens=NEW,
                            eos_token_id=V - 1,
                            pad_token_id=0,
                        )
                    assert out.shape == (batch, PROMPT_LEN + NEW)

                fns = (
                    [ours(False)]
                    + ([ours(True)] if args.compile else [])
                    + ([theirs] if hf is not None else [])
                )
                times, warm = timed(fns, device, args.runs)
                t_eager = times[0]
                t_comp = times[1] if args.compile else None
                t_hf = times[-1] if hf is not None else None
                tok = batch * NEW

                def f(x, fmt):
                    return "-" if x is None else fmt.format(x)

                print(
                    f"| {name} | {batch} | {top_p} | {tok / t_eager:,.0f} | {f(t_comp and tok / t_comp, '{:,.0f}')} "
                    f"| {f(t_hf and tok / t_hf, '{:,.0f}')} | {f(t_hf and t_hf / t_eager, '{:.2f}x')} "
                    f"| {f(t_hf and t_comp and t_hf / t_comp, '{:.2f}x')} | {t_limit / t_eager:.0%} "
                    f"| {f(t_comp and t_limit / t_comp, '{:.0%}')} "
                    f"| {f(args.compile and warm[1] - t_comp, '{:.0f}')} |",
                    flush=True,
                )


def bench_filter_cost(args, device, dtype):
    """Filters + draw at batch 32 against one decode step (model forward + LM head at the same batch).
    Logits: "peaked" rows are Gaussian with a standard deviation drawn from [3.5, 7] per row: at V=32,000
    a top-p 0.95 nucleus of median 65, 90th percentile 641, 99th 1348 tokens (SmolLM2-135M-Instruct
    sampling its own answers at temperature 1 measured median 26, p90 448, p99 1393); "flat" rows,
    std 0.5, are a random-weight model's (the nucleus is ~90% of the vocabulary: the full-sort path)."""
    print(
        "\n| model (vocab) | logits | decode step ms | draw, top_p 1.0 ms | top_p 0.95 ms (sorting reference) "
        "| share of a step at 0.95 (reference) | mean nucleus |"
    )
    print("|---|---|---|---|---|---|---|")
    B, S = 32, PROMPT_LEN + NEW
    for name in ("47m", "qwen0.5b"):
        model = build(name, device, dtype, 0)
        V = model.config.vocab_size
        cache = model.new_cache(B, S)
        tok = torch.randint(0, V, (B, 1), device=device)
        key_valid = torch.ones(B, S, dtype=torch.bool, device=device)
        pos = torch.full((B, 1), PROMPT_LEN, device=device)

        def step():
            with torch.no_grad():
                h = model.hidden_states(
                    tok,
                    attention_mask=key_valid[:, : PROMPT_LEN + 1],
                    positions=pos,
                    cache=cache,
                    cache_start=PROMPT_LEN,
                )
                lm_logits(model, h[:, 0], V, 2048)

        u = uniforms(torch.arange(B, device=device), 0)
        for label, std in (
            ("peaked", torch.empty(B, 1).uniform_(3.5, 7.0)),
            ("flat", torch.tensor(0.5)),
        ):
            logits = torch.randn(B, V, device=device) * std.to(device)
            cands = []

            def fast():
                cands.append(sample_next_token_fast(logits, u, 1.0, 0, 0.95, 0.0))

            (t_step, t_full, t_fast, t_ref), _ = timed(
                [
                    step,
                    lambda: sample_from(logits, u),
                    fast,
                    lambda: sample_from(apply_top_p(logits, 0.95), u),
                ],
                device,
                args.runs * 3,
            )
            K = (filter_candidates(logits, 0, 0.95, 0.0)[0] > float("-inf")).sum(1).float().mean()
            print(
                f"| {name} ({V:,}) | {label} | {t_step * 1e3:.1f} | {t_full * 1e3:.2f} | {t_fast * 1e3:.2f} "
                f"({t_ref * 1e3:.1f}) | {t_fast / t_step:.1%} ({t_ref / t_step:.0%}) | {K:,.0f} |",
                flush=True,
            )


CHAT_QUESTIONS = [
    "Explain how a KV cache speeds up autoregressive decoding in a transformer.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main causes of the French Revolution? Answer in a few paragraphs.",
    "Describe the water cycle to a ten-year-old.",
]


def bench_where(args, device, dtype):
    """Where the default decode step's time goes (SharedPrefixDecoder), against the matmul limit,
    on a GRPO-shaped batch (4 prompts x 8 samples; --batches is ignored): every F.linear, every
    scaled_dot_product_attention call (the prefill's attention), every SharedPrefixCache.attend
    call (the decode step's) and every draw is timed (a perf_counter pair each, ~1 us) in four
    contexts taken in turns: the limit's bare matmuls, generate at top_p 1.0 and at 0.95, and
    generate of one token (the prefill and the first draw: what a whole run less it takes, over
    the other NEW - 1 tokens, is a decode step alone). Split by rows: a call on more than 32 rows
    is the prefill's. --model PATH: a real checkpoint (else the 135m shape, random). Its prompts
    are 128 random tokens (flat next-token distributions: the top-p filter's worst case), or with
    --chat four questions in the checkpoint's chat template (a trained model's peaked rows).
    Answers: do the decode step's projections run at the bare-matmul rate, and what else does a
    step spend?"""
    model = model_for(args, "135m", device, dtype, args.logit_std)
    V, P, G = model.config.vocab_size, 4, 8
    heads = model.config.num_attention_heads
    prompts = torch.randint(0, V - 1, (P, PROMPT_LEN), generator=torch.Generator().manual_seed(0))
    prompts = prompts.tolist()
    if args.chat:  # real questions in the checkpoint's chat template: a trained model's rows
        from nanogrpo.tokenizer import Tokenizer

        tok = Tokenizer.from_pretrained(args.model)
        prompts = [
            tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
            for q in CHAT_QUESTIONS
        ]
    acc = {}
    where = ["bare"]
    linear, sdpa = F.linear, F.scaled_dot_product_attention

    def timed_op(op, name, part=None):
        def run(x, *a, **k):
            sync(device)
            t0 = time.perf_counter()
            y = op(x, *a, **k)
            sync(device)
            # a decode step's calls have P*G rows (times the query heads for attention)
            rows = P * G * (heads if name == "sdpa" else 1)
            key = (
                where[0],
                name,
                part or ("prefill" if x.numel() // x.shape[-1] > rows else "decode"),
            )
            acc[key] = acc.get(key, 0.0) + time.perf_counter() - t0
            return y

        return run

    def gen(top_p, new=NEW):
        def run():
            generate_new(model, prompts, G, top_p, new, draw, decoder=SharedPrefixDecoder)

        return run

    head = model.lm_head.weight
    weights = [m.weight for m in model.layers.modules() if isinstance(m, torch.nn.Linear)]
    weights += [head[i : i + 2048] for i in range(0, head.shape[0], 2048)]
    xs = {w.shape[1]: torch.randn(P * G, w.shape[1], dtype=dtype, device=device) for w in weights}

    def bare():
        for w in weights:
            F.linear(xs[w.shape[1]], w)

    F.linear = timed_op(linear, "mm")
    F.scaled_dot_product_attention = timed_op(sdpa, "sdpa")
    attend = SharedPrefixCache.attend  # the decode step's attention (a method: x is the cache)
    SharedPrefixCache.attend = timed_op(attend, "attend", "decode")
    draw = timed_op(sample_next_token_fast, "draw", "decode")
    # "first": the prefill and the first token alone, so that the decode steps can be timed apart
    fns = {"bare": bare, "1.0": gen(1.0), "0.95": gen(0.95), "first": gen(1.0, 1)}
    try:
        with torch.no_grad():
            for fn in fns.values():
                fn()  # warm-up
            walls = {k: [] for k in fns}
            rounds = []
            for _ in range(args.runs):
                acc.clear()
                for k, fn in fns.items():
                    where[0] = k
                    walls[k].append(clock(fn, device))
                rounds.append(dict(acc))
    finally:
        F.linear, F.scaled_dot_product_attention = linear, sdpa
        SharedPrefixCache.attend = attend
    med = statistics.median
    bare_mm = med(r[("bare", "mm", "decode")] for r in rounds)  # one decode step's matmuls
    print(
        f"{args.model or '135m (random)'}: {P} prompts x {G} samples, "
        f"{'chat' if args.chat else PROMPT_LEN} prompt + {NEW} "
        f"new tokens; medians of {args.runs} rounds, ms per decode step (a whole run / {NEW})\n"
    )
    print(
        "| top_p | tok/s | limit tok/s | of limit | bare matmuls | decode matmuls (x bare) "
        "| prefill matmuls | attention: SDPA + shared | draw | the rest "
        "| a decode step (of limit; its matmuls' share) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    first = med(walls["first"])  # the prefill and the first draw
    for k in ("1.0", "0.95"):
        wall = med(walls[k])

        def part(name, p):
            return med(r.get((k, name, p), 0.0) for r in rounds) / NEW * 1e3

        dec, pre = part("mm", "decode"), part("mm", "prefill")
        att = part("sdpa", "decode") + part("sdpa", "prefill")
        shared, drawn = part("attend", "decode"), part("draw", "decode")
        rest = wall / NEW * 1e3 - dec - pre - att - shared - drawn
        limit = P * G / bare_mm
        step = (wall - first) / (NEW - 1)  # the other NEW - 1 tokens: decode steps alone
        # the decode matmuls' time over the decode steps', both timed in the same runs (the
        # limit, timed apart, moves with the host's speed from minute to minute; this does not)
        share = dec * NEW / 1e3 / (wall - first)
        print(
            f"| {k} | {P * G * NEW / wall:,.0f} | {limit:,.0f} | {P * G * NEW / wall / limit:.0%} "
            f"| {bare_mm * 1e3:.1f} | {dec:.1f} (x{dec / (bare_mm * 1e3):.3f}) | {pre:.1f} "
            f"| {att:.1f} + {shared:.1f} | {drawn:.1f} | {rest:.1f} "
            f"| {step * 1e3:.1f} ({bare_mm / step:.0%}; {share:.0%}) |",
            flush=True,
        )


def bench_shared(args, device, dtype):
    """The eager decoder vs SharedPrefixDecoder (each prompt's keys read once per group), same
    seeds, in turns: tok/s of each and the ratio, per prompt length, and how many rows come out
    identical (fp32 attention summed in another order can flip a near-tie, and the row then
    diverges)."""
    model = model_for(args, "135m", device, dtype, 0)
    V = model.config.vocab_size
    batch, G = int(args.batches.split(",")[0]), 8
    print(
        "| prompt tokens | top_p | eager tok/s | shared tok/s | shared / eager | identical rows |"
    )
    print("|---|---|---|---|---|---|")
    for prompt_len in map(int, args.prompt_lens.split(",")):
        gen = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, V - 1, (batch // G, prompt_len), generator=gen).tolist()
        for top_p in map(float, args.top_p.split(",")):
            outs = {}

            def run(decoder):
                def fn():
                    seeds = list(range(len(prompts)))
                    out = generate_new(model, prompts, G, top_p, decoder=decoder, seeds=seeds)
                    outs[decoder] = out.completion_ids

                return fn

            (t_eager, t_shared), _ = timed([run(None), run(SharedPrefixDecoder)], device, args.runs)
            same = (outs[None] == outs[SharedPrefixDecoder]).all(-1).sum().item()
            tok = batch * NEW
            print(
                f"| {prompt_len} | {top_p} | {tok / t_eager:,.0f} | {tok / t_shared:,.0f} "
                f"| {t_eager / t_shared:.2f}x | {same}/{batch} |",
                flush=True,
            )


# tiny fixture models of three families, their vocabulary widened to the real tokenizer's:
# (fixture, tokenizer folder in .cache/real, model vocabulary)
LARGE_VOCAB = [
    ("qwen3_5", "tokenizer-qwen3_5", 248320),
    ("gemma3", "tokenizer-gemma3", 262144),
    ("smollm3", "tokenizer-llama3_1", 128256),
]


def large_vocab_checkpoint(family, tokenizer_dir, vocab, out_dir):
    """tests/fixtures/<family>'s config (hidden 32) with `vocab` rows and tied embeddings, random
    weights, saved with the real tokenizer: a model whose every cost but the vocabulary is nil."""
    from nanogrpo.checkpoint import read_json
    from nanogrpo.checkpoint.hf_format import config_from_hf
    from nanogrpo.tokenizer import Tokenizer

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    hf = read_json(os.path.join(root, "tests", "fixtures", family, "config.json"))
    hf.update(vocab_size=vocab, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Transformer(config_from_hf(hf))
    tok = Tokenizer.from_pretrained(os.path.join(root, ".cache", "real", tokenizer_dir))
    save_model(model, out_dir, tokenizer=tok)


def loop_logits(model, h, vocab_size, chunk):
    """sampler.lm_logits as it was: one product per `chunk`-row slice of the LM head."""
    W = model.lm_head.weight[:vocab_size]
    fp32 = getattr(model, "cast_lm_head_to_fp32", False)
    parts = [lm_head_linear(h, W[i : i + chunk], fp32).float() for i in range(0, vocab_size, chunk)]
    return torch.cat(parts, dim=-1)


def bench_large_vocab(args, device, dtype):
    """4 completions x 12 tokens (1 prompt, train.py's draw and decoder, its sampling defaults) on
    tiny models with a real tokenizer's vocabulary: the one-off setup (model load, tokenizer load),
    then generate with sampler.lm_logits (the LM head's 2048-row slices in one batched product)
    against loop_logits (a product per slice, as before), in turns: wall seconds and the process's
    CPU seconds, medians; both must give the same ids and log-probs. train.py's own figure, on the
    checkpoints --keep DIR leaves: `python train.py --model DIR/<family> --max_steps 1
    --num_generations 4 --max_completion_length 12 --per_device_train_batch_size 4
    --gradient_accumulation_steps 1 --eval_strategy no --save_steps 0 --output_dir OUT
    --overwrite_output_dir true` (its "sample" seconds)."""
    from nanogrpo import sampler
    from nanogrpo.checkpoint import load_model
    from nanogrpo.tokenizer import Tokenizer

    print(
        "| family | vocab | params | model load s | tokenizer load s | generate s, a product "
        "per slice (CPU s) | generate s, one batched product (CPU s) | speed-up | identical |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    root = args.keep or tempfile.mkdtemp()
    for family, tokenizer_dir, vocab in LARGE_VOCAB:
        path = os.path.join(root, family)
        if not os.path.exists(path):
            large_vocab_checkpoint(family, tokenizer_dir, vocab, path)
        t0 = time.perf_counter()
        model = load_model(path).to(device=device, dtype=dtype).eval()
        t1 = time.perf_counter()
        tok = Tokenizer.from_pretrained(path)
        t2 = time.perf_counter()
        prompt = tok.encode("eecc=")  # an embedded-default prompt, as train.py encodes it
        outs = {}
        cpu = {loop_logits: [], lm_logits: []}

        def run(logits_fn):
            def fn():
                sampler.lm_logits = logits_fn  # what Decoder.step and prefill call
                c0 = time.process_time()
                try:
                    settings = Sampling(
                        max_new_tokens=12,
                        stop_ids=tok.eos_token_ids,
                        pad_id=tok.pad_token_id,
                        vocab_size=tok.vocab_size,
                        sample_token=sample_next_token_fast,
                        decoder=SharedPrefixDecoder,
                    )
                    outs[logits_fn] = generate(model, [prompt], settings, num_samples=4, seeds=[0])
                finally:
                    sampler.lm_logits = lm_logits
                cpu[logits_fn].append(time.process_time() - c0)

            return fn

        (before, after), _ = timed([run(loop_logits), run(lm_logits)], device, args.runs)
        a, b = outs[loop_logits], outs[lm_logits]
        same = torch.equal(a.completion_ids, b.completion_ids) and torch.equal(
            a.logprobs, b.logprobs
        )
        params = sum(p.numel() for p in model.parameters()) / 1e6
        cpu_before = statistics.median(cpu[loop_logits][1:])  # (after the warm-up)
        cpu_after = statistics.median(cpu[lm_logits][1:])
        print(
            f"| {family} | {vocab:,} | {params:.1f}M | {t1 - t0:.2f} | {t2 - t1:.2f} "
            f"| {before:.3f} ({cpu_before:.2f}) | {after:.3f} ({cpu_after:.2f}) "
            f"| {before / after:.1f}x | {same} |",
            flush=True,
        )


def bench_train_compile(args, device, dtype):
    """Training forward + backward of the 47M model (per-token log-probs of a [4, 192] batch, as GRPO's
    update scores a micro-batch), eager vs every Block compiled with `Block.compile()`: does it pay?"""
    model = build("47m", device, dtype, 0).train()
    compiled = build("47m", device, dtype, 0).train()
    for block in compiled.layers:
        block.compile()
    ids = torch.randint(0, 32000, (4, PROMPT_LEN + NEW), device=device)

    def step(m):
        def run():
            logps = m(ids).float().log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None])
            logps.mean().backward()
            m.zero_grad(set_to_none=True)

        return run

    (t_eager, t_comp), (_, warm) = timed([step(model), step(compiled)], device, args.runs)
    print(
        "| training step (47m, [4, 192] fwd+bwd) | eager s | Blocks compiled s | speed-up | compile s |"
    )
    print("|---|---|---|---|---|")
    print(f"| | {t_eager:.2f} | {t_comp:.2f} | {t_eager / t_comp:.2f}x | {warm - t_comp:.0f} |")


def bench_fused(args, device, dtype):
    """q/k/v as one matmul and gate/up as one (gpt-fast's layout: weights concatenated once, the
    outputs split) against the model's separate projections, at a decode step's shape (--batches
    rows of one token): every layer's projections, RoPE and SwiGLU product, no attention, the two
    versions in turns (medians of --runs rounds of 10 steps), and the matmuls alone. Answers: do
    fewer, larger matmuls make a decode step faster? --model PATH: a real checkpoint (else the
    135m shape)."""
    from nanogrpo.model import apply_rope, rope_cos_sin

    model = model_for(args, "135m", device, dtype, 0)
    H, Hkv, D = (
        model.config.num_attention_heads,
        model.config.num_key_value_heads,
        model.config.head_dim,
    )

    def joined(*linears):
        bias = None if linears[0].bias is None else torch.cat([m.bias for m in linears])
        return torch.cat([m.weight for m in linears]), bias

    layers = [(b.self_attn, b.mlp) for b in model.layers]
    fused = [
        (
            joined(a.q_proj, a.k_proj, a.v_proj),
            joined(m.gate_proj, m.up_proj),
            a.o_proj,
            m.down_proj,
        )
        for a, m in layers
    ]
    print(
        f"{args.model or '135m (random)'}: ms per decode step (every layer), medians of {args.runs}\n"
    )
    print("| batch | separate | fused | separate / fused | matmuls alone: separate | fused |")
    print("|---|---|---|---|---|---|")
    for n in map(int, args.batches.split(",")):
        x = torch.randn(n, 1, model.config.hidden_size, device=device, dtype=dtype)
        positions = torch.full((n, 1), PROMPT_LEN, device=device)
        cos, sin = rope_cos_sin(model.inv_freq.to(device), positions, dtype)
        h = torch.randn(n, 1, model.config.intermediate_size, device=device, dtype=dtype)

        def separate(full=True):  # full=False: the matmuls alone (no RoPE, no SwiGLU product)
            for a, m in layers:
                q = a.q_proj(x).view(n, 1, H, D).transpose(1, 2)  # [n,H,1,D]
                k = a.k_proj(x).view(n, 1, Hkv, D).transpose(1, 2)
                a.v_proj(x)
                if full:
                    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
                a.o_proj(q.transpose(1, 2).reshape(n, 1, H * D))  # (attention left out)
                g, u = m.gate_proj(x), m.up_proj(x)
                m.down_proj(F.silu(g) * u if full else h)
            return q

        def together(full=True):
            for (qkv, qkv_b), (gu, gu_b), o, down in fused:
                y = F.linear(x, qkv, qkv_b).view(n, 1, H + 2 * Hkv, D).transpose(1, 2)
                qk = apply_rope(y[:, : H + Hkv], cos, sin) if full else y[:, : H + Hkv]
                q = qk[:, :H]  # k = qk[:, H:], v = y[:, H + Hkv :]
                o(q.transpose(1, 2).reshape(n, 1, H * D))
                g, u = F.linear(x, gu, gu_b).chunk(2, dim=-1)
                down(F.silu(g) * u if full else h)
            return q

        with torch.no_grad():
            assert torch.allclose(separate(), together(), atol=1e-5), "fused != separate"
            fns = [
                lambda f=f, full=full: [f(full) for _ in range(10)]
                for full in (True, False)
                for f in (separate, together)
            ]
            (t_sep, t_fus, m_sep, m_fus), _ = timed(fns, device, args.runs)
        print(
            f"| {n} | {t_sep * 100:.1f} | {t_fus * 100:.1f} | {t_sep / t_fus:.2f}x "
            f"| {m_sep * 100:.1f} | {m_fus * 100:.1f} |",
            flush=True,
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="47m", help="comma-separated: 47m, 135m")
    ap.add_argument("--batches", default="32")
    ap.add_argument("--top_p", default="1.0,0.95")
    ap.add_argument("--logit_std", type=float, default=5.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--compile", action="store_true", help="also time generate(decoder=StaticDecoder)"
    )
    ap.add_argument("--no_hf", action="store_true", help="skip transformers")
    ap.add_argument(
        "--filter_cost", action="store_true", help="only the filters-vs-decode-step table"
    )
    ap.add_argument(
        "--train_compile",
        action="store_true",
        help="only: does compiling the Blocks pay for training",
    )
    ap.add_argument(
        "--where", action="store_true", help="only: matmuls / attention / rest of a decode step"
    )
    ap.add_argument(
        "--shared", action="store_true", help="only: the eager vs the shared-prefix decoder"
    )
    ap.add_argument(
        "--fused", action="store_true", help="only: q/k/v and gate/up fused vs separate"
    )
    ap.add_argument(
        "--large_vocab",
        action="store_true",
        help="only: 4 x 12 tokens on tiny models with real 128k-262k vocabularies",
    )
    ap.add_argument(
        "--keep", default="", help="--large_vocab: build its checkpoints here, reuse them"
    )
    ap.add_argument("--prompt_lens", default="128,512", help="--shared: prompt lengths")
    ap.add_argument("--chat", action="store_true", help="--where: chat questions, not random ids")
    ap.add_argument("--model", default="", help="a checkpoint dir instead of --models' random ones")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    print(
        f"{args.device} {args.dtype}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}; "
        f"{PROMPT_LEN} prompt tokens, {NEW} new tokens, logit std {args.logit_std or 'as initialized'}\n"
    )
    if args.filter_cost:
        bench_filter_cost(args, device, dtype)
    elif args.where:
        bench_where(args, device, dtype)
    elif args.shared:
        bench_shared(args, device, dtype)
    elif args.train_compile:
        bench_train_compile(args, device, dtype)
    elif args.fused:
        bench_fused(args, device, dtype)
    elif args.large_vocab:
        bench_large_vocab(args, device, dtype)
    else:
        bench_generation(args, device, dtype)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
