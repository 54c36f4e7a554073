"""GPU readiness in one command: CUDA against the CPU for correctness, random weights of real
shapes for speed, every figure written as JSON as soon as its part ends.

    python bench/gpu_check.py out/gpu                          # one H100/H200: about 8 minutes
    python bench/gpu_check.py out/gpu --only decode,update     # some parts (the JSON keeps the rest)
    python bench/gpu_check.py out/gpu --only chunks,skip,update,decode --profile   # the settings
    python bench/gpu_check.py out/gpu --device cpu --quick     # the rehearsal: every part, small shapes

Writes out/gpu/gpu_check.json (rewritten after each part, so a run cut short keeps what it
finished) and out/gpu/gpu_check.log. Each part records `ok` (true / false; null for a part that
only measures), its figures, and on an exception its traceback: one failing part never stops the
others. `--budget` seconds: a part that would start later is recorded as skipped.

Correctness (fp32 on the device against fp32 on the CPU unless said):
  logits     every family's fixture checkpoint: logits and left-padded logits against transformers'
             (stored by tests/fixtures) and our CPU ones, rel. err. < 1e-4; bf16 autocast against fp32
             within BF16_REL; a 47M model at 256 tokens (TF32 would show here).
  sampling   greedy and sampled completions of a 47M model, device = CPU token for token except after
             a near tie (top-2 logits within TIE on the CPU: rounding may pick either); the compiled
             decode step (CUDA graphs) = eager, fp32 and bf16.
  grpo_step  every loss type, KL, sampler correction: loss and gradient on the device in fp32 = CPU
             float64 within 1e-5 relative.
  fsdp       one-process FSDP2 (NCCL on CUDA): one AdamW step equals the plain model's; fp32 and bf16.
  train      the embedded default (configs/tiny.py) in bf16 on the device: its reward rises.
  async      async_rollouts on the device: the embedded default with a judge waiting 0 and 0.5 s a
             call, synchronous against max_staleness 1 and 4: completions/s, speed, staleness kept.
  syncs      host syncs per optimizer step of the default, steps 2-4: torch.cuda.set_sync_debug_mode
             on CUDA, and the aten ops that sync (tests/test_host_syncs.py's count) on any device.
Speed (random weights of real shapes, bf16):
  machine    copy bandwidth and a bf16 matmul's FLOP/s, measured: the floors below use them.
  decode     tokens/s at batch 1, 16, 64 for SmolLM2-135M's and Qwen2.5-0.5B's shapes: ours eager,
             ours compiled, transformers' generate (dynamic cache; static cache compiled for 0.5B),
             each against the HBM floor (weights + KV bytes read per step / measured bandwidth).
  update     forward + backward + AdamW of the 0.5B shape, 16 x (128 + 512) tokens, bf16 autocast over
             fp32 master weights, with and without gradient checkpointing: tokens/s, MFU, peak memory.
  packing    padding_free (fast/packing.py) against the padded update: 16 rows (2 groups of 8 sharing
             a 128-token prompt, geometric completion lengths, mean 128, cap 512) of the 0.5B shape;
             log-probs packed vs padded in bf16 (autocast over fp32 weights; bf16 weights) against
             fp32, and in fp32 on the 47M shape (max |diff| <= 1e-4); which attention ran (varlen_attn
             or the loop over sequences, the dtypes it saw); forward + backward: tokens/s, peak memory.
  chunks     the LM head's chunk size: forward + backward of 16 x 512 tokens' log-probs through the
             0.5B shape's head at chunk sizes 128-4096, probabilities kept and recomputed.
  skip       the zero-advantage skip's threshold: 16 rows of the 0.5B shape with 1, 4 or 8 rows of
             advantage 0 at 96-576 tokens, skipped against scored with gradient.
  step       one GRPO step of configs/small.py's per-GPU shape (64 completions of 512 tokens, micro-
             batch 16, the 0.5B shape, a 151,936-id char-level tokenizer): time per phase, peak memory;
             eager and with torch_compile.

Nothing is fetched: it runs with the torch (and, when installed, transformers) the machine has.
"""

import argparse
import contextlib
import json
import math
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import replace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import bench_sampler  # noqa: E402
from conftest import FAMILIES, fixture_path  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from nanogrpo.checkpoint import load_model, save_model  # noqa: E402
from nanogrpo.fast import sampling as fast_sampling  # noqa: E402
from nanogrpo.fast.shared_prefix import SharedPrefixDecoder  # noqa: E402
from nanogrpo.model import ModelConfig, Transformer  # noqa: E402
from nanogrpo.sampler import Sampling, generate  # noqa: E402

TIE = 1e-3  # top-2 logits closer than this may be picked either way by fp32 rounding
# fp32 packed vs padded: the log-probs' max |diff| (they are ~ -log V ~ -10: ~1e-5 relative, the
# logits part's bound) and the gradient's rel. err.; the CPU at the full sizes: 1.9e-6 and 7e-7
FP32_PACKED = 1e-4
BF16_REL = 0.1  # bf16 autocast logits against fp32, max |diff| / max |logit| (CPU: <= 6.2e-2)
PEAK_BF16 = {"H100": 989e12, "H200": 989e12}  # dense bf16 FLOP/s, the vendor's SXM figure
QUICK_SHAPE = dict(  # --quick's stand-in for the real shapes
    model_type="qwen2",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)


class Check:
    """The run's state: device, sizes, the results so far (written after every part)."""

    def __init__(self, args):
        self.args = args
        self.device = torch.device(args.device)
        self.quick = args.quick
        self.out = args.out_dir
        self.work = args.work_dir or os.path.join(args.out_dir, "work")  # checkpoints, runs
        self.t0 = time.perf_counter()
        self.path = os.path.join(self.out, "gpu_check.json")
        self.results = {}
        if os.path.exists(self.path):
            with open(self.path) as f:
                self.results = json.load(f).get("parts", {})
        self.log_file = open(os.path.join(self.out, "gpu_check.log"), "a")

    def log(self, *parts):
        line = " ".join(str(p) for p in parts)
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def shape(self, name):
        return QUICK_SHAPE if self.quick else bench_sampler.SHAPES[name]

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def timed(self, fn, runs=3):
        """(median seconds of `runs` calls after a warm-up, the warm-up's seconds)."""
        (median,), (warm,) = bench_sampler.timed([fn], self.device, runs)
        return median, warm

    def peak_reset(self):
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak_gib(self):
        if self.device.type != "cuda":
            return None
        return round(torch.cuda.max_memory_allocated() / 2**30, 2)

    def save(self):
        doc = {
            "command": " ".join(sys.argv),
            "device": device_name(self.device),
            "torch": torch.__version__,
            "transformers": transformers_version(),
            "quick": self.quick,
            "seconds": round(time.perf_counter() - self.t0, 1),
            "parts": self.results,
        }
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        os.replace(tmp, self.path)


def device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def transformers_version():
    try:
        import transformers

        return transformers.__version__
    except ImportError:
        return None


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


# -----------------------------------------------------------------------------
# correctness


def part_logits(c: Check) -> dict:
    """Every family's fixture: device fp32 = transformers' CPU fp32 (stored) = our CPU fp32; bf16."""
    out, ok = {}, True
    for family in FAMILIES:
        path = fixture_path(family)
        want = load_file(os.path.join(path, "expected.safetensors"))
        ids, mask = want["input_ids"], want["attention_mask"]
        real = mask.bool()
        cpu = load_model(path)
        dev = load_model(path, device=c.device)
        with torch.no_grad():
            ours_cpu = cpu(ids)
            logits = dev(ids.to(c.device)).cpu()
            padded = dev(ids.to(c.device), attention_mask=mask.to(c.device)).cpu()
            with torch.autocast(c.device.type, dtype=torch.bfloat16):
                bf16 = dev(ids.to(c.device)).float().cpu()
        row = {
            "vs_transformers": rel_err(logits, want["logits"]),
            "padded_vs_transformers": rel_err(padded[real], want["padded_logits"][real]),
            "vs_cpu": rel_err(logits, ours_cpu),
            "bf16_vs_fp32": rel_err(bf16, logits),
        }
        row["ok"] = (
            max(row["vs_transformers"], row["padded_vs_transformers"], row["vs_cpu"]) < 1e-4
            and row["bf16_vs_fp32"] < BF16_REL
        )
        ok &= row["ok"]
        out[family] = row
        c.log(f"  {family}: " + ", ".join(f"{k} {v:.2e}" for k, v in row.items() if k != "ok"))
    # a wider model and a longer sequence: the matmuls where TF32 would round
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**c.shape("47m")))
    ids = torch.randint(0, model.config.vocab_size, (2, 32 if c.quick else 256))
    with torch.no_grad():
        ref = model(ids)
        got = model.to(c.device)(ids.to(c.device)).cpu()
    out["47m_256_tokens"] = {"vs_cpu": rel_err(got, ref), "ok": rel_err(got, ref) < 1e-4}
    ok &= out["47m_256_tokens"]["ok"]
    c.log(f"  47m, {ids.shape[1]} tokens: vs_cpu {rel_err(got, ref):.2e}")
    out["ok"] = ok
    return out


def first_divergence(a, b):
    """Index of the first position where rows a and b differ, or None."""
    diff = (a != b).nonzero()
    return None if len(diff) == 0 else int(diff[0])


def agreement(a, b) -> dict:
    """Rows of generations a and b: how many are equal, the largest log-prob difference before a
    row's first differing token (after it the rows are different texts)."""
    ids, logps = b.completion_ids.cpu(), b.logprobs.cpu()
    equal, worst = 0, 0.0
    for i in range(len(a.completion_ids)):
        j = first_divergence(a.completion_ids[i], ids[i])
        equal += j is None
        upto = a.completion_ids.shape[1] if j is None else j
        both = a.completion_mask[i, :upto]
        if both.any():
            worst = max(worst, (a.logprobs[i, :upto] - logps[i, :upto])[both].abs().max().item())
    return {"rows": len(ids), "equal_rows": equal, "max_logp_diff_before_divergence": worst}


def part_sampling(c: Check) -> dict:
    """Greedy and sampled completions, device vs CPU; the compiled decode step vs eager."""
    torch.manual_seed(0)
    shape = dict(c.shape("47m"))
    cpu = (
        bench_sampler.build("47m", torch.device("cpu"), torch.float32, 5.0) if not c.quick else None
    )
    if c.quick:
        cpu = Transformer(ModelConfig(**shape))
        with torch.no_grad():
            cpu.norm.weight *= 20  # peaked logits, as a trained model's
    dev = Transformer(cpu.config).to(c.device)
    dev.load_state_dict(cpu.state_dict())
    V = cpu.config.vocab_size
    new = 8 if c.quick else 32
    prompts = torch.randint(0, V, (4, 16 if c.quick else 64)).tolist()
    call = dict(num_samples=4, seeds=[1, 2, 3, 4])
    base = Sampling(
        max_new_tokens=new, stop_ids=[V - 1], sample_token=fast_sampling.sample_next_token_fast
    )
    out, ok = {}, True
    for name, kw in (("greedy", dict(temperature=0.0)), ("sampled", dict(top_p=0.95))):
        a = generate(cpu, prompts, replace(base, **kw), **call)
        b = generate(dev, prompts, replace(base, **kw), **call)
        b_ids, b_logps = b.completion_ids.cpu(), b.logprobs.cpu()
        equal_rows, ties, breaks, worst = 0, 0, 0, 0.0
        for i in range(len(a.completion_ids)):
            j = first_divergence(a.completion_ids[i], b_ids[i])
            upto = new if j is None else j
            both = a.completion_mask[i, :upto]
            worst = max(worst, (a.logprobs[i, :upto] - b_logps[i, :upto])[both].abs().max().item())
            if j is None:
                equal_rows += 1
                continue
            # a near tie at the divergence: the CPU's logits there, after the common prefix
            prefix = prompts[i // 4] + a.completion_ids[i, :j].tolist()
            with torch.no_grad():
                top2 = cpu(torch.tensor([prefix]))[0, -1].float().topk(2).values
            gap = (top2[0] - top2[1]).item()
            if name == "sampled" or gap < TIE:
                ties += 1  # a sampled row may cross a CDF boundary by rounding: counted, not failed
            else:
                breaks += 1
        row = {
            "rows": len(a.completion_ids),
            "equal_rows": equal_rows,
            "diverged_at_a_tie": ties,
            "diverged_otherwise": breaks,
            "max_logp_diff_before_divergence": worst,
        }
        row["ok"] = breaks == 0 and worst < 1e-4 and equal_rows >= row["rows"] // 2
        ok &= row["ok"]
        out[name] = row
        c.log(f"  {name}: {row}")
    # each decoder on the device against the CPU's sampled rows, before a row's first divergence:
    # the plain step, the shared-prompt step (training's eager default), the compiled step
    sampled = replace(base, top_p=0.95)
    reference = generate(cpu, prompts, sampled, **call)
    for dtype in ("float32", "bfloat16"):
        ctx = (
            torch.autocast(c.device.type, dtype=torch.bfloat16)
            if dtype == "bfloat16"
            else contextlib.nullcontext()
        )
        for name, decoder in (
            ("plain", None),
            ("shared_prefix", SharedPrefixDecoder),
            ("compiled", fast_sampling.StaticDecoder),
        ):
            t = time.perf_counter()
            with ctx:
                got = generate(dev, prompts, replace(sampled, decoder=decoder), **call)
            row = agreement(reference, got)
            row["first_call_s"] = round(time.perf_counter() - t, 1)
            # fp32: rounding only (logits up to ~30); bf16: 8 bits, rows drift apart
            row["ok"] = row["max_logp_diff_before_divergence"] < (
                1e-3 if dtype == "float32" else 0.5
            )
            ok &= row["ok"]
            out[f"{name}_{dtype}_vs_cpu_fp32"] = row
            c.log(f"  {name} ({dtype}) vs CPU fp32: {row}")
    out["ok"] = ok
    return out


def loss_inputs(g, N, C, dtype, device):
    from nanogrpo.grpo import LossInputs

    def r(*s):
        return torch.rand(*s, generator=g, dtype=torch.float64)

    mask = r(N, C) > 0.2
    mask[:, 0] = True
    t = dict(
        logps=-2 * r(N, C),
        advantages=torch.randn(N, generator=g, dtype=torch.float64),
        completion_mask=mask,
        old_logps=-2 * r(N, C),
        ref_logps=-2 * r(N, C),
        entropies=3 * r(N, C),
    )
    sampling = -2 * r(N, C)
    t = {k: (v.to(device, dtype) if v.is_floating_point() else v.to(device)) for k, v in t.items()}
    t["logps"].requires_grad_(True)
    return LossInputs(**t), sampling.to(device, dtype)


def part_grpo_step(c: Check) -> dict:
    """Every loss type on the device in fp32 = the float64 CPU reference."""
    from nanogrpo.extras.loss_terms import grpo_step_with_terms, loss_settings
    from nanogrpo.grpo import LOSS_TYPES, LossScale, sampler_correction
    from nanogrpo.run.metrics import sampler_metrics

    out, ok = {}, True
    for loss_type in LOSS_TYPES:
        level = "sequence" if loss_type == "luspo" else "token"
        mode = "token_truncate" if loss_type == "vespo" else "sequence_mask"
        cfg, terms = loss_settings(
            loss_type=loss_type,
            beta=0.04,
            importance_sampling_level=level,
            vllm_importance_sampling_mode=mode,
            entropy_coef=0.01,
            max_completion_length=24,
        )
        scale = LossScale(num_items=300, grad_accum=2)
        res = []
        for device, dtype in ((torch.device("cpu"), torch.float64), (c.device, torch.float32)):
            inputs, sampling = loss_inputs(torch.Generator().manual_seed(0), 16, 24, dtype, device)
            inputs.weights, compared = sampler_correction(inputs, sampling, cfg)
            how = dict(sampling_logps=sampling, read_metrics=False)
            loss, more = grpo_step_with_terms(inputs, cfg, terms, scale, **how)
            mask = inputs.completion_mask.bool()
            metrics = sampler_metrics(*compared, inputs.weights, mask) | more
            metrics = {k: float(v) for k, v in metrics.items()}
            loss.backward()
            res.append((loss.detach().double().cpu(), inputs.logps.grad.double().cpu(), metrics))
        (l64, g64, m64), (l32, g32, m32) = res
        row = {
            "loss_rel": abs(l32 - l64).item() / max(abs(l64).item(), 1e-3),
            "grad_rel": rel_err(g32, g64),
            # relative: the raw sampler ratios' sequence-level max can be far from 1
            "metrics_max_rel": max(
                (
                    abs(m32[k] - m64[k]) / max(abs(m64[k]), 1.0)
                    for k in m64
                    if not math.isnan(m64[k])
                ),
                default=0.0,
            ),
        }
        row["ok"] = (
            row["loss_rel"] < 1e-5 and row["grad_rel"] < 1e-5 and row["metrics_max_rel"] < 1e-4
        )
        ok &= row["ok"]
        out[loss_type] = row
        c.log(f"  {loss_type}: " + ", ".join(f"{k} {v:.1e}" for k, v in row.items() if k != "ok"))
    out["ok"] = ok
    return out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def full(t):
    """A gradient as a plain CPU fp32 tensor (FSDP2's are DTensors)."""
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return t.detach().float().cpu()


def part_fsdp(c: Check) -> dict:
    """One process, FSDP2 (NCCL on CUDA): one AdamW step of the sharded model = the plain one."""
    import torch.distributed as tdist

    from nanogrpo import distributed as dist
    from nanogrpo.fast.logprobs import token_logprobs

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0")
    os.environ.update(WORLD_SIZE="1", LOCAL_RANK="0")
    backend = "nccl" if c.device.type == "cuda" else "gloo"
    tdist.init_process_group(
        backend,
        rank=0,
        world_size=1,
        device_id=torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None,
    )
    out, ok = {}, True
    try:
        info = dist.DistInfo(device=c.device)
        for mixed in (False, True):
            torch.manual_seed(0)
            shape = dict(c.shape("47m"), num_hidden_layers=2)
            plain = Transformer(ModelConfig(**shape)).to(c.device)
            sharded = Transformer(plain.config).to(c.device)
            sharded.load_state_dict(plain.state_dict())
            dist.shard_model(sharded, info, mixed_precision=mixed)
            V = plain.config.vocab_size
            ids = torch.randint(0, V, (4, 48), device=c.device)
            attn = torch.ones_like(ids)
            cmask = torch.ones(4, 16, device=c.device)
            adv = torch.tensor([1.0, -1.0, 0.5, -0.5], device=c.device)
            after = []
            for model, ctx in (
                (
                    plain,
                    torch.autocast(c.device.type, dtype=torch.bfloat16)
                    if mixed
                    else contextlib.nullcontext(),
                ),
                (sharded, contextlib.nullcontext()),
            ):
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
                with ctx:
                    logps, _ = token_logprobs(model, ids, attn, cmask)
                loss = -(logps * adv[:, None]).mean()
                loss.backward()
                grads = {n: full(p.grad) for n, p in model.named_parameters()}
                opt.step()
                state = dist.full_state_dict(model) if model is sharded else model.state_dict()
                after.append(
                    (loss.item(), grads, {k: v.detach().float().cpu() for k, v in state.items()})
                )
            (l0, g0, p0), (l1, g1, p1) = after
            row = {
                "loss_diff": abs(l0 - l1),
                "grad_rel": max(rel_err(g1[k], g0[k]) for k in g0),
                "param_diff": max((p0[k] - p1[k]).abs().max().item() for k in p0),
            }
            name = "bf16" if mixed else "fp32"
            if mixed:  # autocast and FSDP2's bf16 parameters round in other places
                row["ok"] = row["loss_diff"] < 1e-2 and row["grad_rel"] < 0.1
            else:  # the same sums
                row["ok"] = (
                    row["loss_diff"] < 1e-6 and row["grad_rel"] < 1e-5 and row["param_diff"] < 1e-6
                )
            out[name] = row
            ok &= row["ok"]
            c.log(f"  {name}: {row}")
    finally:
        tdist.destroy_process_group()
    out["ok"] = ok
    return out


def tiny_run_config(c: Check, steps: int, name: str, *extra):
    from nanogrpo.run.configurator import load_config, read_config_file

    init = read_config_file("tiny")["init_model"]
    return load_config(
        [
            "--config",
            "tiny.py",
            f"--model={c.work}/tiny-init",
            f"--init_model={init!r}",
            f"--output_dir={c.work}/{name}",
            f"--device={c.device.type}",
            "--eval_strategy=no",
            "--save_steps=0",
            f"--max_steps={steps}",
            "--overwrite_output_dir=true",
            *extra,
        ]
    )


def part_train(c: Check) -> dict:
    """The embedded default in bf16 on the device: its reward rises (fp32 on CPU --quick)."""
    import train

    steps = 40 if c.quick else 150
    bf16 = "--bf16=false" if c.device.type == "cpu" else "--bf16=true"
    out = {}
    for compiled in (False, True):
        n = steps if not compiled else 40
        t = time.perf_counter()
        recs = train.train(
            tiny_run_config(c, n, f"train{int(compiled)}", bf16, f"--torch_compile={compiled}")
        )
        wall = time.perf_counter() - t
        rewards = [r["reward"] for r in recs if "reward" in r]
        k = max(1, len(rewards) // 10)
        first, last = statistics.mean(rewards[:k]), statistics.mean(rewards[-k:])
        row = {
            "steps": n,
            "reward_first": first,
            "reward_last": last,
            "wall_s": round(wall, 1),
            "median_step_s": statistics.median(r["step_time"] for r in recs[1:]),
            "logp_diff_max": max(r.get("sampling/sampling_logp_difference/max", 0) for r in recs),
        }
        row["ok"] = last > first + (0.05 if (c.quick or compiled) else 0.2)
        out["compiled" if compiled else "eager"] = row
        c.log(f"  {'compiled' if compiled else 'eager'}: {row}")
    out["ok"] = all(v["ok"] for v in out.values())
    return out


class SyncWarnings:
    """torch.cuda.set_sync_debug_mode("warn"), each warning counted, apart from the decode loop's."""

    def __init__(self):
        self.count = self.in_decode = 0
        self.sites = {}

    def __enter__(self):
        self.old = warnings.showwarning
        self.filters = warnings.catch_warnings()
        self.filters.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self.show
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def show(self, message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message).lower():
            return self.old(message, category, filename, lineno, file, line)
        stack = traceback.extract_stack()
        if any(f.name == "decode_loop" for f in stack):
            self.in_decode += 1
            return
        self.count += 1
        ours = [f for f in stack if f.filename.startswith(ROOT) and "gpu_check" not in f.filename]
        site = f"{os.path.relpath(ours[-1].filename, ROOT)}:{ours[-1].lineno}" if ours else "?"
        self.sites[site] = self.sites.get(site, 0) + 1

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = self.old
        self.filters.__exit__(*exc)


def part_syncs(c: Check) -> dict:
    """Host syncs per optimizer step of the default, steps 2-4 (a 4-step run less a 1-step one)."""
    from test_host_syncs import CountSyncs

    import train

    bf16 = "--bf16=false" if c.device.type == "cpu" else "--bf16=true"
    train.train(tiny_run_config(c, 1, "syncs-warm", bf16))
    counts = {}
    for steps in (1, 4):
        with CountSyncs() as ops:
            if c.device.type == "cuda":
                with SyncWarnings() as w:
                    train.train(tiny_run_config(c, steps, f"syncs{steps}", bf16))
            else:
                w = None
                train.train(tiny_run_config(c, steps, f"syncs{steps}", bf16))
        counts[steps] = (ops.count, w)
    out = {"aten_sync_ops_per_step": (counts[4][0] - counts[1][0]) / 3}
    if c.device.type == "cuda":
        w1, w4 = counts[1][1], counts[4][1]
        out["cuda_syncs_per_step"] = (w4.count - w1.count) / 3
        out["cuda_syncs_in_decode_per_step"] = (w4.in_decode - w1.in_decode) / 3
        out["cuda_sync_sites_4_steps"] = dict(sorted(w4.sites.items(), key=lambda kv: -kv[1]))
    worst = max(v for k, v in out.items() if k.endswith("_per_step") and "decode" not in k)
    out["ok"] = worst <= 12
    c.log(f"  {out}")
    return out


# -----------------------------------------------------------------------------
# speed


def part_machine(c: Check) -> dict:
    """Measured ceilings: a device-to-device copy's bandwidth and a bf16 matmul's FLOP/s."""
    n = (2**24 if c.quick else 2**30) // 2  # bf16 elements: 32 MiB / 1 GiB
    x = torch.empty(n, dtype=torch.bfloat16, device=c.device).normal_()
    y = torch.empty_like(x)
    t, _ = c.timed(lambda: y.copy_(x), runs=5)
    bandwidth = 2 * x.numel() * 2 / t  # bytes read + written
    k = 512 if c.quick else 8192
    a = torch.randn(k, k, dtype=torch.bfloat16, device=c.device)
    b = torch.randn(k, k, dtype=torch.bfloat16, device=c.device)
    t, _ = c.timed(lambda: a @ b, runs=5)
    out = {
        "copy_GBps": round(bandwidth / 1e9),
        "bf16_matmul_TFLOPs": round(2 * k**3 / t / 1e12, 1),
        "ok": None,
    }
    if c.device.type == "cuda":
        p = torch.cuda.get_device_properties(c.device)
        out.update(sms=p.multi_processor_count, memory_GiB=round(p.total_memory / 2**30, 1))
    c.bandwidth = bandwidth
    c.log(f"  {out}")
    return out


def kv_bytes_per_step(cfg: ModelConfig, batch: int, ctx: float, itemsize: int) -> float:
    head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * ctx * batch * itemsize


def part_decode(c: Check) -> dict:
    """Decode tokens/s, ours eager and compiled vs transformers', against the HBM floor."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        AutoModelForCausalLM = None
    prompt_len, new = (16, 8) if c.quick else (128, 128)
    batches = (1, 16) if c.quick else (1, 16, 64)
    bandwidth = getattr(c, "bandwidth", None) or 4.0e12
    out = {}
    for name in ("135m", "qwen0.5b"):
        torch.manual_seed(0)
        model = Transformer(ModelConfig(**c.shape(name))).to(c.device, torch.bfloat16).eval()
        cfg = model.config
        V = cfg.vocab_size
        hf = None
        if AutoModelForCausalLM is not None:
            with tempfile.TemporaryDirectory() as tmp:
                save_model(model, tmp)
                hf = (
                    AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16)
                    .to(c.device)
                    .eval()
                )
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        weight_bytes -= model.embed_tokens.weight.numel() * 2 * (not cfg.tie_word_embeddings)
        for batch in batches:
            G = min(batch, 8)
            prompts = torch.randint(0, V - 1, (batch // G, prompt_len)).tolist()

            def ours(decoder):
                def run():
                    g = bench_sampler.generate_new(model, prompts, G, 1.0, new=new, decoder=decoder)
                    assert g.completion_ids.shape == (batch, new)

                return run

            def theirs(static):
                def run():
                    ids = torch.tensor(prompts, device=c.device)
                    kw = dict(cache_implementation="static") if static else {}
                    with torch.inference_mode():
                        hf.generate(
                            ids,
                            attention_mask=torch.ones_like(ids),
                            do_sample=True,
                            top_k=0,
                            num_return_sequences=G,
                            max_new_tokens=new,
                            min_new_tokens=new,
                            eos_token_id=V - 1,
                            pad_token_id=0,
                            **kw,
                        )

                return run

            def autocast_fp32(fn):  # how one unsharded bf16 training process samples
                def run():
                    model.float()
                    try:
                        with torch.autocast(c.device.type, dtype=torch.bfloat16):
                            fn()
                    finally:
                        model.to(torch.bfloat16)

                return run

            step_bytes = weight_bytes + kv_bytes_per_step(cfg, batch, prompt_len + new / 2, 2)
            floor = batch * new / (new * step_bytes / bandwidth)  # tokens/s if only bytes moved
            row = {"hbm_floor_tok_s": round(floor)}
            runs = {"eager": ours(SharedPrefixDecoder)}
            if (name == "qwen0.5b" and batch in (1, 64)) or c.quick:
                runs["compiled"] = ours(fast_sampling.StaticDecoder)
            if name == "qwen0.5b" and batch == 64:
                runs["eager_autocast_fp32_weights"] = autocast_fp32(ours(SharedPrefixDecoder))
            if hf is not None:
                runs["transformers"] = theirs(False)
                if name == "qwen0.5b" and batch in (1, 64) and c.device.type == "cuda":
                    runs["transformers_static_compiled"] = theirs(True)
            for key, fn in runs.items():
                if c.over_budget():
                    row[key] = "skipped: budget"
                    continue
                try:
                    t, warm = c.timed(fn, runs=1 if c.quick else 3)
                except Exception as e:  # one path failing leaves the others' figures
                    row[key] = f"{type(e).__name__}: {e}"[:2000]
                    c.log(traceback.format_exc())
                    continue
                if c.args.profile and key == "compiled" and name == "qwen0.5b":
                    row["compiled_profile"] = profile_table(c, fn)
                row[f"{key}_tok_s"] = round(batch * new / t)
                row[f"{key}_of_floor"] = round(batch * new / t / floor, 3)
                if "compiled" in key:
                    row[f"{key}_compile_s"] = round(warm - t, 1)
            if "transformers_tok_s" in row:
                for key in ("eager", "compiled"):
                    if f"{key}_tok_s" in row:
                        row[f"{key}_vs_transformers"] = round(
                            row[f"{key}_tok_s"] / row["transformers_tok_s"], 2
                        )
            out[f"{name}_b{batch}"] = row
            c.log(f"  {name} batch {batch}: {row}")
        model = hf = None  # freed before the next shape
    out["ok"] = None
    return out


def train_flops_per_token(cfg: ModelConfig, length: int, vocab: int) -> float:
    """Model FLOPs of forward + backward per token (6 per weight, attention's two products over
    the causal half), gradient checkpointing's recompute not counted (MFU's convention)."""
    D, L = cfg.hidden_size, cfg.num_hidden_layers
    head_dim = cfg.head_dim or D // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    per_layer = D * (q + 2 * kv) + q * D + 3 * D * cfg.intermediate_size
    weights = L * per_layer + D * vocab
    attention = L * 2 * 2 * q * length / 2
    return 6 * weights + 3 * attention


def part_update(c: Check) -> dict:
    """The update's forward + backward + AdamW, bf16 autocast over fp32 weights: tokens/s, MFU."""
    from nanogrpo.fast.logprobs import policy_logprobs
    from nanogrpo.grpo import LossConfig, LossInputs, grpo_step

    rows, prompt, comp = (2, 8, 16) if c.quick else (16, 128, 512)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**c.shape("qwen0.5b"))).to(c.device)
    V = model.config.vocab_size
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=c.device.type == "cuda")
    ids = torch.randint(0, V, (rows, prompt + comp), device=c.device)
    attn = torch.ones_like(ids)
    cmask = torch.ones(rows, comp, device=c.device)
    adv = torch.randn(rows, device=c.device)
    out = {}
    name = device_name(c.device)
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    for checkpointing in (False, True):
        model.gradient_checkpointing = checkpointing

        def step():
            with torch.autocast(c.device.type, dtype=torch.bfloat16):
                logps, ent = policy_logprobs(
                    model, ids, attn, cmask, adv, beta=0.0, entropy_bonus=False
                )
            loss, _ = grpo_step(LossInputs(logps, adv, cmask), LossConfig(), read_metrics=False)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        c.peak_reset()
        t, _ = c.timed(step, runs=1 if c.quick else 3)
        if c.args.profile and not checkpointing:
            out["profile"] = profile_table(c, step)
        tokens = rows * (prompt + comp)
        flops = train_flops_per_token(model.config, prompt + comp, V) * tokens
        row = {
            "tokens_per_s": round(tokens / t),
            "step_s": round(t, 3),
            "TFLOPs": round(flops / t / 1e12, 1),
            "mfu": None if peak is None else round(flops / t / peak, 3),
            "peak_GiB": c.peak_gib(),
        }
        key = "checkpointing" if checkpointing else "no_checkpointing"
        out[key] = row
        c.log(f"  {key}: {row}")
    out["shape"] = f"{rows} x ({prompt} + {comp}) tokens"
    out["ok"] = None
    return out


def packing_batch(c: Check, V: int, rows: int, prompt: int, mean: int, cap: int, seed=0):
    """One micro-batch of `rows` rows, 2 groups sharing a prompt of `prompt` tokens each,
    completions of geometric lengths (bench/bench_packing.py's: mean `mean`, capped at `cap`),
    right-padded to the longest; every advantage nonzero (no row skipped)."""
    import bench_packing

    g = torch.Generator().manual_seed(seed)
    how = argparse.Namespace(dist="geometric", mean=mean, cap=cap)
    lengths = bench_packing.completion_lengths(how, rows, g)
    C = int(lengths.max())
    prompts = torch.randint(0, V, (2, prompt), generator=g).repeat_interleave(rows // 2, 0)
    ids = torch.cat([prompts, torch.randint(0, V, (rows, C), generator=g)], 1)
    cmask = (torch.arange(C)[None] < lengths[:, None]).float()
    adv = torch.randn(rows, generator=g)
    adv = adv.sign() * adv.abs().clamp(min=0.1)
    real = rows * prompt + int(lengths.sum())
    batch = [t.to(c.device) for t in (ids, torch.ones_like(ids), cmask, adv)]
    return batch, real, lengths


class AttentionPath:
    """Inside it: how fast/packing.py's PackedRow attended (its `attend` calls, those that went
    to varlen_attn, the q/k/v dtypes it saw); `path` names it."""

    def __enter__(self):
        from nanogrpo.fast import packing

        self.cls, self.calls, self.varlen, self.dtypes = packing.PackedRow, 0, 0, set()
        self.attend, self.attend_varlen = self.cls.attend, self.cls.attend_varlen
        path = self

        def attend(row, q, k, v, *args):
            path.calls += 1
            path.dtypes.add(f"q {q.dtype}, k {k.dtype}, v {v.dtype}".replace("torch.", ""))
            return path.attend(row, q, k, v, *args)

        def attend_varlen(row, *args):
            path.varlen += 1
            return path.attend_varlen(row, *args)

        self.cls.attend, self.cls.attend_varlen = attend, attend_varlen
        return self

    def __exit__(self, *exc):
        self.cls.attend, self.cls.attend_varlen = self.attend, self.attend_varlen

    def record(self) -> dict:
        path = (
            "varlen_attn" if self.varlen == self.calls else "loop" if not self.varlen else "mixed"
        )
        return {
            "path": path,
            "attend_calls": self.calls,
            "varlen_calls": self.varlen,
            "attend_dtypes": sorted(self.dtypes),
        }


def part_packing(c: Check) -> dict:
    """padding_free (fast/packing.py) against the padded update (fast/logprobs.py): one micro-
    batch of 16 rows (2 groups of 8 sharing a 128-token prompt, geometric completion lengths,
    mean 128, cap 512) of the 0.5B shape, random weights. Correctness: the scored tokens'
    log-probs packed vs padded in bf16 (autocast over fp32 weights, the update's; and bf16
    weights), each against the padded fp32 ones, and in fp32 on the 47M shape (bound FP32_PACKED);
    which attention ran (varlen_attn or the loop over sequences, and why); speed: forward +
    backward of each, tokens/s on real tokens, peak memory."""
    import copy

    from nanogrpo.fast import logprobs as fast_logprobs, packing
    from nanogrpo.grpo import LossConfig, LossInputs, grpo_step

    kernels = {"padded": fast_logprobs.policy_logprobs, "packed": packing.policy_logprobs}
    rows, prompt, mean, cap = (4, 8, 8, 32) if c.quick else (16, 128, 128, 512)
    out = {
        "torch": torch.__version__,
        "varlen_attn_imported": packing.varlen_attn is not None,
        # packing.py's rule: varlen_attn when it imported, q is on CUDA and q is bf16/fp16
        "rule": "varlen_attn if imported and q.is_cuda and q.dtype in (bfloat16, float16), "
        "else the loop over sequences (model.sdpa)",
    }
    if packing.varlen_attn is None:
        try:
            from torch.nn.attention.varlen import varlen_attn  # noqa: F401
        except ImportError as e:
            out["varlen_import_error"] = f"{type(e).__name__}: {e}"

    def fwd_bwd(kernel, model, batch, ctx):
        ids, attn, cmask, adv = batch
        with ctx():
            logps, _ = kernel(model, ids, attn, cmask, adv, beta=0.0, entropy_bonus=False)
        loss, _ = grpo_step(LossInputs(logps, adv, cmask), LossConfig(), read_metrics=False)
        loss.backward()
        return logps.detach().float()

    def diff(a, b, scored):
        d = (a - b)[scored].abs()
        return {"max_abs": float(f"{d.max().item():.3g}"), "mean_abs": float(f"{d.mean():.3g}")}

    def grads(model):
        g = torch.cat([p.grad.flatten().float() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
        return g

    ok = True
    # (a) fp32, no autocast, the 47M shape: on CUDA the packed row takes the loop (q is fp32)
    torch.manual_seed(0)
    small = Transformer(ModelConfig(**c.shape("47m"))).to(c.device)
    batch, _, _ = packing_batch(c, small.config.vocab_size, rows, prompt, mean, cap)
    scored = batch[2].bool()
    logps, paths = {}, {}
    for name, kernel in kernels.items():
        with AttentionPath() as path:
            logps[name] = fwd_bwd(kernel, small, batch, contextlib.nullcontext)
        paths[name] = path.record()
        logps[name + "_grad"] = grads(small)
    row = diff(logps["packed"], logps["padded"], scored)
    row["grad_rel"] = float(f"{rel_err(logps['packed_grad'], logps['padded_grad']):.3g}")
    row["attention"] = paths["packed"]
    row["ok"] = row["max_abs"] <= FP32_PACKED and row["grad_rel"] <= FP32_PACKED
    ok &= row["ok"]
    out["fp32_47m"] = row
    c.log(f"  fp32, 47M shape, packed vs padded: {row}")
    del small, logps

    # (b) the 0.5B shape in bf16: autocast over fp32 weights (the update's), and bf16 weights
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**c.shape("qwen0.5b"))).to(c.device)
    batch, real, lengths = packing_batch(c, model.config.vocab_size, rows, prompt, mean, cap)
    scored = batch[2].bool()
    padded_tokens = batch[0].numel()
    out["batch"] = {
        "rows": rows,
        "prompt": prompt,
        "completion_lengths": lengths.tolist(),
        "real_tokens": real,
        "padded_tokens": padded_tokens,
        "real_fraction": round(real / padded_tokens, 3),
    }
    c.log(f"  batch: {out['batch']}")
    ref = fwd_bwd(kernels["padded"], model, batch, contextlib.nullcontext)  # fp32, padded
    model.zero_grad(set_to_none=True)
    bf16_weights = copy.deepcopy(model).to(torch.bfloat16)

    def autocast():
        return torch.autocast(c.device.type, dtype=torch.bfloat16)

    settings = {
        "bf16_autocast": (model, autocast),
        "bf16_weights": (bf16_weights, contextlib.nullcontext),
    }
    failed = set()  # a setting whose kernel raised (varlen_attn, say): no speed for it
    for setting, (m, ctx) in settings.items():
        got, row = {}, {}
        try:
            for name, kernel in kernels.items():
                with AttentionPath() as path:
                    got[name] = fwd_bwd(kernel, m, batch, ctx)
                m.zero_grad(set_to_none=True)
                if name == "packed":
                    row["attention"] = path.record()
        except Exception as e:
            failed.add(setting)
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
            c.log(traceback.format_exc())
        else:
            row["packed_vs_padded"] = diff(got["packed"], got["padded"], scored)
            row["padded_vs_fp32"] = diff(got["padded"], ref, scored)
            row["packed_vs_fp32"] = diff(got["packed"], ref, scored)
            # packing may not round worse than the padded path does in the same dtype
            bound = 2 * row["padded_vs_fp32"]["mean_abs"] + 1e-3
            row["ok"] = row["packed_vs_fp32"]["mean_abs"] <= bound
        ok &= row["ok"]
        out[setting] = row
        c.log(f"  {setting}: {row}")

    # (c) speed: forward + backward of each, tokens/s on the real tokens, peak memory
    for setting, (m, ctx) in settings.items():
        if setting in failed:
            continue
        times = {}
        for name, kernel in kernels.items():

            def step():
                fwd_bwd(kernel, m, batch, ctx)
                m.zero_grad(set_to_none=True)

            c.peak_reset()
            # held before the call (both models' weights, no gradients): the peak's floor
            base = torch.cuda.memory_allocated() / 2**30 if c.device.type == "cuda" else None
            t, warm = c.timed(step, runs=1 if c.quick else 5)
            times[name] = t
            row = {
                "ms": round(t * 1e3, 2),
                "tokens_per_s": round(real / t),
                "first_call_ms": round(warm * 1e3, 1),
                "peak_GiB": c.peak_gib(),
            }
            if base is not None:
                row["peak_above_weights_GiB"] = round(row["peak_GiB"] - base, 2)
            out[f"{setting}_{name}"] = row
            c.log(f"  {setting}, {name}: {row}")
        out[f"{setting}_packed_speedup"] = round(times["padded"] / times["packed"], 3)
        if c.device.type == "cuda":  # the call's own memory, packed / padded
            above = [out[f"{setting}_{k}"]["peak_above_weights_GiB"] for k in ("packed", "padded")]
            out[f"{setting}_packed_memory_ratio"] = round(above[0] / max(above[1], 1e-3), 3)
        c.log(f"  {setting}: packed {out[f'{setting}_packed_speedup']}x the padded tokens/s")
    out["ok"] = ok
    return out


def part_chunks(c: Check) -> dict:
    """The LM head's chunk size (token_logprobs' chunk_size): forward + backward of the scored
    tokens' log-probs through the 0.5B shape's LM head, 16 x 512 tokens, bf16 autocast over fp32
    weights, at each size, the probabilities kept for backward (keep_bytes' default) and
    recomputed (keep_bytes=0, gradient checkpointing's way): time, FLOP/s, peak memory."""
    import inspect

    from nanogrpo.fast.logprobs import KEEP_BYTES, score_chunks, token_logprobs

    default = inspect.signature(token_logprobs).parameters["chunk_size"].default
    rows, comp = (2, 32) if c.quick else (16, 512)
    sizes = sorted({8, 16, default} if c.quick else {128, 256, 512, 1024, 2048, 4096, default})
    torch.manual_seed(0)
    cfg = ModelConfig(**c.shape("qwen0.5b"))
    D, V = cfg.hidden_size, cfg.vocab_size
    head = torch.nn.Linear(D, V, bias=False, device=c.device)
    h = torch.randn(rows, comp, D, device=c.device, requires_grad=True)
    targets = torch.randint(0, V, (rows, comp), device=c.device)
    cmask = torch.ones(rows, comp, dtype=torch.bool, device=c.device)
    flops = 6 * rows * comp * D * V  # forward and backward's matmuls, no recompute
    out = {"shape": f"{rows * comp} tokens x D {D} x V {V}", "default": default}
    for keep in (KEEP_BYTES, 0):
        mode = "keep" if keep else "recompute"
        times = {}
        for size in sizes:

            def run():
                with torch.autocast(c.device.type, dtype=torch.bfloat16):
                    logp, _ = score_chunks(h, head, targets, cmask, 1.0, None, size, keep)
                logp.sum().backward()
                h.grad = head.weight.grad = None

            c.peak_reset()
            t, _ = c.timed(run, runs=1 if c.quick else 3)
            times[size] = t
            row = {"ms": round(t * 1e3, 2), "TFLOPs": round(flops / t / 1e12, 1)}
            row["peak_GiB"] = c.peak_gib()
            out[f"{mode}_{size}"] = row
            c.log(f"  {mode}, chunk {size}: {row}")
        best = min(times, key=times.get)
        out[f"{mode}_fastest"] = best
        out[f"{mode}_default_vs_fastest"] = round(times[default] / times[best], 3)
    out["ok"] = None
    return out


def part_skip(c: Check) -> dict:
    """The zero-advantage skip's threshold (fast/logprobs.py's SKIP_MIN_FLOPS, an estimate on
    CUDA): policy_logprobs' forward + backward of 16 rows of the 0.5B shape with the rows whose
    advantage is 0 scored without gradient (one more forward call, no backward for them) against
    every row with gradient, for several counts of such rows and lengths; the backward FLOPs
    the skip saves beside its speed-up, and the least saving above which it always paid."""
    from nanogrpo.fast import logprobs as fast_logprobs
    from nanogrpo.grpo import LossConfig, LossInputs, grpo_step

    rows, prompt = (4, 8) if c.quick else (16, 64)
    cases = (
        [(1, 8), (2, 16)]
        if c.quick
        else [(free, comp) for comp in (32, 128, 512) for free in (1, 4, 8)]
    )
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**c.shape("qwen0.5b"))).to(c.device)
    V = model.config.vocab_size
    rule = fast_logprobs.skip_min_flops  # the threshold policy_logprobs reads, by device
    out = {"current_threshold": rule(c.device)}
    wins = []
    for free, comp in cases:
        ids = torch.randint(0, V, (rows, prompt + comp), device=c.device)
        attn = torch.ones_like(ids)
        cmask = torch.ones(rows, comp, device=c.device)
        adv = torch.randn(rows, device=c.device)
        adv[:free] = 0

        def run(threshold):
            def step():
                fast_logprobs.skip_min_flops = lambda device: threshold
                try:
                    with torch.autocast(c.device.type, dtype=torch.bfloat16):
                        logps, _ = fast_logprobs.policy_logprobs(
                            model, ids, attn, cmask, adv, beta=0.0, entropy_bonus=False
                        )
                finally:
                    fast_logprobs.skip_min_flops = rule
                loss, _ = grpo_step(LossInputs(logps, adv, cmask), LossConfig(), read_metrics=False)
                loss.backward()
                model.zero_grad(set_to_none=True)

            return step

        (skip, every), _ = bench_sampler.timed(
            [run(0.0), run(math.inf)], c.device, 1 if c.quick else 3
        )
        saved = fast_logprobs.backward_flops(model, free, prompt + comp)
        row = {
            "saved_backward_flops": float(f"{saved:.3g}"),
            "skip_ms": round(skip * 1e3, 2),
            "every_row_ms": round(every * 1e3, 2),
            "speedup": round(every / skip, 3),
        }
        wins.append((saved, every > skip))
        out[f"free{free}_of{rows}_len{prompt + comp}"] = row
        c.log(f"  {free} of {rows} rows free, {prompt + comp} tokens: {row}")
    # the least saving from which on every case paid
    paid = [saved for saved, win in wins if all(w for s, w in wins if s >= saved)]
    out["threshold_measured"] = min(paid) if paid else None
    out["ok"] = None
    return out


def profile_table(c: Check, fn, rows: int = 25) -> str:
    """torch.profiler's kernels of one call of fn, by device time: what bounds it."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if c.device.type == "cuda" else []
    )
    with profile(activities=activities) as prof:
        fn()
        c.sync()
    key = "cuda_time_total" if c.device.type == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)
    c.log(table)
    return table


def small_checkpoint(c: Check) -> str:
    """The 0.5B shape (--quick: the small stand-in) with a char-level tokenizer of its vocabulary
    whose first characters are the default task's."""
    from nanogrpo.extras.tasks import DEFAULT_TASK_CHARS
    from nanogrpo.tokenizer import char_level_tokenizer

    path = os.path.join(c.work, "small-init")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    shape = c.shape("qwen0.5b")
    V = shape["vocab_size"]
    # planes 15 and 16 (private use), then CJK from U+4E00: none of them the task's characters
    codes = (
        list(range(0xF0000, 0xFFFFE))
        + list(range(0x100000, 0x10FFFE))
        + list(range(0x4E00, 0x9FFF))
    )
    extra = V - 1 - len(DEFAULT_TASK_CHARS)
    tok = char_level_tokenizer(DEFAULT_TASK_CHARS + "".join(map(chr, codes[:extra])))
    assert tok.vocab_size == V, (tok.vocab_size, V)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**shape))
    gen = {"eos_token_id": sorted(tok.eos_token_ids), "pad_token_id": tok.pad_token_id}
    save_model(model, path, tokenizer=tok, generation_config=gen)
    return path


def part_step(c: Check) -> dict:
    """One GRPO step of configs/small.py's per-GPU shape: time per phase, peak memory."""
    import train
    from nanogrpo.run.configurator import load_config

    path = small_checkpoint(c)
    new = 16 if c.quick else 512
    out = {}
    for compiled in (False, True):
        if c.over_budget():
            out["compiled" if compiled else "eager"] = "skipped: budget"
            continue
        cfg = load_config(
            [
                "--config",
                "small.py",
                f"--model={path}",
                f"--device={c.device.type}",
                f"--bf16={c.device.type == 'cuda'}",
                "--dataset=default",
                "--eval_strategy=no",
                "--reward_funcs=bench/bench_train.py:even_code_points",
                "--reward_weights=[1.0]",
                f"--max_completion_length={new}",
                "--max_steps=2",
                "--save_steps=0",
                "--warmup_steps=0",
                "--log_completions=false",
                f"--torch_compile={compiled}",
                f"--output_dir={c.work}/step{int(compiled)}",
                "--overwrite_output_dir=true",
            ]
            + (
                ["--per_device_train_batch_size=4", "--gradient_accumulation_steps=2"]
                if c.quick
                else []
            )
        )
        c.peak_reset()
        try:
            recs = train.train(cfg)
        except Exception as e:
            out["compiled" if compiled else "eager"] = f"{type(e).__name__}: {e}"[:2000]
            c.log(traceback.format_exc())
            continue
        last = recs[-1]
        row = {
            k: round(last[k], 3) for k in ("step_time", "time/sample", "time/score", "time/update")
        }
        row["completion_tokens"] = last["num_tokens"]
        row["mean_length"] = last["completions/mean_length"]
        row["first_step_s"] = round(recs[0]["step_time"], 1)
        row["peak_GiB"] = c.peak_gib()
        out["compiled" if compiled else "eager"] = row
        c.log(f"  {'compiled' if compiled else 'eager'}: {row}")
    out["ok"] = None if all(isinstance(v, dict) for v in out.values()) else False
    return out


def part_async(c: Check) -> dict:
    """async_rollouts on one device (the sampler process beside the trainer): the embedded default
    in bf16 with its reward behind a judge that waits 0 and 0.5 s a call, synchronous against
    max_staleness 1 and 4 for the same steps: completions/s over steps 2.., speed against the
    synchronous run, the reward's first and last tenth, the staleness seen."""
    import bench_async

    import train

    steps = 4 if c.quick else 30
    bf16 = "--bf16=false" if c.device.type == "cpu" else "--bf16=true"
    out = {}
    for wait in (0.0, 0.5):
        os.makedirs(c.work, exist_ok=True)
        judge = os.path.join(c.work, f"judge_{wait}.py")
        with open(judge, "w") as f:
            f.write(bench_async.JUDGE.replace("WAIT", repr(wait)))
        reward = f"--reward_funcs=['{judge}:slow_default_task']"
        base = None
        for staleness in (None, 1, 4):
            name = "sync" if staleness is None else f"async_s{staleness}"
            how = (
                []
                if staleness is None
                else ["--async_rollouts=true", f"--max_staleness={staleness}"]
            )
            cfg = tiny_run_config(c, steps, f"async_{wait}_{name}", bf16, reward, *how)
            recs = train.train(cfg)
            seconds = sum(r["step_time"] for r in recs[1:])
            per_step = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
            k = max(1, len(recs) // 10)
            row = {
                "steps": steps,
                "completions_per_s": round(per_step * (len(recs) - 1) / seconds, 1),
                "median_step_s": round(statistics.median(r["step_time"] for r in recs[1:]), 3),
                "reward_first": statistics.mean(r["reward"] for r in recs[:k]),
                "reward_last": statistics.mean(r["reward"] for r in recs[-k:]),
            }
            if staleness is not None:
                row["staleness_max"] = max(r["async/staleness/max"] for r in recs)
                row["wait_for_rollouts_s"] = round(
                    sum(r["time/wait_for_rollouts"] for r in recs), 2
                )
            base = base or row["completions_per_s"]
            row["speed"] = round(row["completions_per_s"] / base, 2)
            out[f"wait{wait}_{name}"] = row
            c.log(f"  wait {wait} s {name}: {row}")
    staleness_kept = all(
        v["staleness_max"] <= int(k.rsplit("s", 1)[1]) for k, v in out.items() if "async" in k
    )
    out["ok"] = staleness_kept
    return out


PARTS = {  # in the order they run: the correctness a fix needs first, the long ones last
    "machine": part_machine,
    "logits": part_logits,
    "grpo_step": part_grpo_step,
    "fsdp": part_fsdp,
    "sampling": part_sampling,
    "syncs": part_syncs,
    "update": part_update,
    "packing": part_packing,
    "chunks": part_chunks,
    "skip": part_skip,
    "decode": part_decode,
    "step": part_step,
    "train": part_train,
    "async": part_async,
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--quick", action="store_true", help="small shapes and few steps: the rehearsal"
    )
    ap.add_argument("--only", default="", help="comma-separated parts: " + ", ".join(PARTS))
    ap.add_argument(
        "--profile",
        action="store_true",
        help="torch.profiler's top kernels: the update's, the 0.5B shape's compiled decode",
    )
    ap.add_argument("--work_dir", default="", help="checkpoints and runs (default OUT_DIR/work)")
    ap.add_argument(
        "--budget", type=float, default=450.0, help="seconds after which parts are skipped"
    )
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: pass --device cpu (with --quick for the rehearsal)")
    c = Check(args)
    c.over_budget = lambda: time.perf_counter() - c.t0 > args.budget
    for name in ("recompile_limit", "cache_size_limit"):  # one compiled step per (model, batch)
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    if c.device.type == "cpu":
        torch.set_num_threads(min(4, os.cpu_count() or 1))
        # inductor's C++ build takes minutes on a cold CPU: trace what it would compile instead
        fast_sampling._COMPILED[None] = torch.compile(
            fast_sampling._decode_step, backend="aot_eager", dynamic=False, fullgraph=True
        )
    names = args.only.split(",") if args.only else list(PARTS)
    unknown = set(names) - set(PARTS)
    if unknown:
        sys.exit(f"--only: unknown parts {sorted(unknown)}; the parts: {', '.join(PARTS)}")
    c.log(
        f"# gpu_check on {device_name(c.device)}, torch {torch.__version__}, transformers {transformers_version()}"
    )
    for name in names:
        if c.over_budget():
            c.results[name] = {"ok": None, "skipped": f"over the {args.budget:.0f} s budget"}
            c.log(f"{name}: skipped (budget)")
            c.save()
            continue
        c.log(f"{name}:")
        t = time.perf_counter()
        try:
            result = PARTS[name](c)
        except Exception as e:
            result = {
                "ok": False,
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc(),
            }
            c.log(result["traceback"])
        result["seconds"] = round(time.perf_counter() - t, 1)
        c.results[name] = result
        c.log(f"{name}: ok={result['ok']} in {result['seconds']} s")
        c.save()
    failed = [k for k, v in c.results.items() if v.get("ok") is False]
    c.log(f"# done in {time.perf_counter() - c.t0:.0f} s; failed: {', '.join(failed) or 'none'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
