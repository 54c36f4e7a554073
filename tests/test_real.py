"""Real material: SmolLM2-135M-Instruct and the SmolLM2, Qwen3 and Llama 3.1 tokenizers, against transformers.

The material is built by `python tests/fetch_real.py` (CI runs it first) into .cache/real/; where it
is missing these tests skip and say so. The expected values were computed once by transformers
(tests/fixtures/make_real_fixtures.py) and are read from tests/fixtures/real/*.json: transformers is
not imported here.
"""

import json
import os

import fetch_real
import pytest
import torch
from conftest import fixture_path, mismatches, real_folder

from nanogrpo.checkpoint import load_model, save_model
from nanogrpo.sampler import Sampling, generate
from nanogrpo.tokenizer import Tokenizer

SMOLLM2 = json.load(open(os.path.join(fixture_path("real"), "smollm2.json")))
TOKENIZERS = json.load(open(os.path.join(fixture_path("real"), "tokenizers.json")))
FOLDERS = {
    "smollm2": fetch_real.SMOLLM2["folder"],
    **{
        item["folder"].removeprefix("tokenizer-"): item["folder"]
        for item in fetch_real.NPM_TOKENIZERS
    },
}
ATOL = 1e-4  # fp32


def real_path(name: str) -> str:
    """The cached folder of `name`, or skip (with the reason) when fetch_real.py has not built it."""
    return real_folder(FOLDERS[name])


@pytest.fixture(scope="module")
def smollm2():
    path = real_path("smollm2")
    return load_model(path).eval(), Tokenizer.from_pretrained(path)


def check_logits(logits, expected, where=""):
    """Our logits [T,V] against transformers' summary of them: top-5 values, fixed probe ids,
    log-sum-exp and mean over the vocabulary, and the maximum at each position."""
    top_ids = torch.tensor(expected["top_ids"])
    checks = {
        "top-5 values": (logits.gather(1, top_ids), expected["top_values"]),
        "maximum": (logits.max(-1).values, [v[0] for v in expected["top_values"]]),
        "probe values": (logits[:, SMOLLM2["probe_ids"]], expected["probe_values"]),
        "logsumexp": (logits.logsumexp(-1), expected["logsumexp"]),
        "mean": (logits.mean(-1), expected["mean"]),
    }
    for name, (ours, theirs) in checks.items():
        err = (ours - torch.tensor(theirs)).abs().max().item()
        assert err <= ATOL, f"{where}{name}: max abs error {err:.2e} > {ATOL} vs transformers"


# -----------------------------------------------------------------------------
# SmolLM2-135M-Instruct


def test_unpermute_rope_rows():
    """llama.cpp stores each head's rotation pairs (i, i + head_dim/2) as adjacent rows (2i, 2i+1);
    the converter puts them back where HF's rotate-half RoPE expects them (no cache needed)."""
    n_heads, head_dim = 3, 8
    hf = torch.randn(n_heads * head_dim, 5).numpy()
    gguf = hf.copy()
    for h in range(n_heads):
        for i in range(head_dim // 2):
            gguf[h * head_dim + 2 * i] = hf[h * head_dim + i]
            gguf[h * head_dim + 2 * i + 1] = hf[h * head_dim + head_dim // 2 + i]
    assert (fetch_real.unpermute_rope_rows(gguf, n_heads) == hf).all()


@pytest.mark.parametrize("i", range(len(SMOLLM2["logits"])), ids=lambda i: f"prompt{i}")
def test_smollm2_logits_match_transformers(smollm2, i):
    model, tok = smollm2
    case = SMOLLM2["logits"][i]
    assert tok.encode(case["text"]) == case["ids"]
    with torch.no_grad():
        logits = model(torch.tensor([case["ids"]]))[0]
    check_logits(logits, case)


def test_smollm2_left_padded_batch_matches_transformers(smollm2):
    """The prompts of mixed lengths in one left-padded batch: each real position as computed alone."""
    model, tok = smollm2
    cases = SMOLLM2["logits"]
    T = max(len(c["ids"]) for c in cases)
    ids = torch.tensor([[tok.pad_token_id] * (T - len(c["ids"])) + c["ids"] for c in cases])
    mask = torch.tensor([[0] * (T - len(c["ids"])) + [1] * len(c["ids"]) for c in cases])
    with torch.no_grad():
        logits = model(ids, attention_mask=mask)
    for row, case in enumerate(cases):
        check_logits(logits[row, T - len(case["ids"]) :], case, where=f"row {row}: ")


def test_smollm2_greedy_chat_matches_transformers(smollm2):
    """Greedy answers to chat prompts, batched, are token for token transformers' `generate`."""
    model, tok = smollm2
    cases = SMOLLM2["greedy"]
    prompts = [tok.encode_prompt(c["messages"]) for c in cases]
    assert prompts == [c["prompt_ids"] for c in cases]
    torch.manual_seed(0)
    settings = Sampling(
        max_new_tokens=SMOLLM2["max_new_tokens"],
        temperature=0,
        stop_ids=tok.eos_token_ids,
        pad_id=tok.pad_token_id,
    )
    out = generate(model, prompts, settings)
    for row, case in enumerate(cases):
        ids = out.completion_ids[row][out.completion_mask[row]].tolist()
        assert ids == case["completion_ids"], f"{tok.decode(ids)!r} != {case['completion']!r}"
        assert tok.decode(ids) == case["completion"]


def test_smollm2_kv_cache_matches_uncached(smollm2):
    """Prefill, then one token at a time, then a chunk: the same logits as one uncached forward."""
    model, _ = smollm2
    ids = torch.tensor([SMOLLM2["logits"][-1]["ids"]])
    T = ids.shape[1]
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(1, T)
        steps = [model(ids[:, :16], cache=cache, cache_start=0)]
        steps += [model(ids[:, t : t + 1], cache=cache, cache_start=t) for t in range(16, 24)]
        steps.append(model(ids[:, 24:], cache=cache, cache_start=24))
    err = (torch.cat(steps, dim=1) - full).abs().max().item()
    assert err <= ATOL, f"cached vs uncached: max abs error {err:.2e}"


def test_smollm2_save_load_round_trip(smollm2, tmp_path):
    """save_model -> load_model gives back every tensor bit for bit, the config, and the tokenizer."""
    model, tok = smollm2
    out = tmp_path / "smollm2"
    save_model(model, out, tokenizer=tok)
    again = load_model(out).eval()
    assert again.config == model.config
    theirs = again.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name
    ids = torch.tensor([SMOLLM2["logits"][0]["ids"]])
    with torch.no_grad():
        assert torch.equal(model(ids), again(ids))
    tok2 = Tokenizer.from_pretrained(out)
    messages = SMOLLM2["greedy"][1]["messages"]
    assert tok2.encode_prompt(messages) == tok.encode_prompt(messages)
    assert (
        (tok2.eos_token_ids, tok2.pad_token_id) == (tok.eos_token_ids, tok.pad_token_id) == ({2}, 2)
    )


# -----------------------------------------------------------------------------
# Tokenizers: SmolLM2 (converted from the GGUF), Qwen3 and Llama 3.1 (npm)


@pytest.fixture(scope="module", params=["smollm2", "qwen3", "llama3_1"])
def real_tok(request):
    return request.param, Tokenizer.from_pretrained(real_path(request.param))


def test_real_tokenizer_encode(real_tok):
    name, tok = real_tok
    cases = TOKENIZERS[name]["encode"]
    msg = mismatches(
        cases,
        lambda c: tok.encode(c["text"], add_special_tokens=c["add_special_tokens"]),
        lambda c: c["ids"],
    )
    assert not msg, msg


def test_real_tokenizer_decode(real_tok):
    name, tok = real_tok
    cases = TOKENIZERS[name]["decode"]
    msg = mismatches(
        cases,
        lambda c: tok.decode(c["ids"], skip_special_tokens=c["skip_special_tokens"]),
        lambda c: c["text"],
    )
    assert not msg, msg


def render(tok, case):
    """Our rendering of a chat case, or the name of the error it raises (transformers raised one too)."""
    try:
        return tok.apply_chat_template(
            TOKENIZERS["conversations"][case["conversation"]],
            add_generation_prompt=case["add_generation_prompt"],
            tools=TOKENIZERS["tools"] if case["tools"] else None,
            **case["kwargs"],
        )
    except Exception as e:
        return type(e).__name__


def test_real_tokenizer_chat_template(real_tok):
    """Multi-turn, system prompts, add_generation_prompt True/False, tools=, enable_thinking (Qwen3),
    reasoning under `reasoning_content` or `thinking`, a tool call without content."""
    name, tok = real_tok
    cases = TOKENIZERS[name]["chat"]
    msg = mismatches(cases, lambda c: render(tok, c), lambda c: c.get("text", c.get("error")))
    assert not msg, msg
    rendered = [c for c in cases if "text" in c]
    msg = mismatches(
        rendered, lambda c: tok.encode(c["text"], add_special_tokens=False), lambda c: c["ids"]
    )
    assert not msg, msg


def test_real_tokenizer_special_ids(real_tok):
    name, tok = real_tok
    expected = TOKENIZERS[name]
    assert tok.bos_token_id == expected["bos_token_id"]
    assert (
        tok.eos_token_id == expected["eos_token_id"]
        and expected["eos_token_id"] in tok.eos_token_ids
    )
    assert tok.pad_token_id == (
        expected["pad_token_id"] if expected["pad_token_id"] is not None else tok.eos_token_id
    )
    assert tok.vocab_size == expected["vocab_size"]
