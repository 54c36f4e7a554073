"""fast/logprobs.py: the chunked log-probs/entropy equal a naive full-logits computation and the
plain definition in logprobs.py, values and gradients, in float64 on a tiny random model
(left-padded prompts, masked completion tokens)."""

import os

import conftest
import pytest
import torch
from conftest import GEMMA3, QWEN3_5, RecordOps, fixture_path, tiny_config
from hypothesis import given, settings, strategies as st

from nanogrpo.checkpoint import load_model
from nanogrpo.fast.logprobs import token_logprobs
from nanogrpo.logprobs import token_logprobs as token_logprobs_plain
from nanogrpo.model import Transformer

PROMPT_LENS = [2, 5, 3]
P, C, V = 5, 4, 97


def tiny_model():
    torch.manual_seed(0)
    return Transformer(tiny_config(vocab_size=V)).double()


def batch(completion_attention=1, seed=0):
    """Left-padded prompts of different lengths + right-padded completions: ids, attention, mask [N,*]."""
    g = torch.Generator().manual_seed(seed)
    n = len(PROMPT_LENS)
    ids = torch.randint(1, V, (n, P + C), generator=g)
    prompt_mask = torch.arange(P)[None] >= P - torch.tensor(PROMPT_LENS)[:, None]  # left padding
    completion_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    completion_att = completion_mask | bool(completion_attention)
    attention = torch.cat([prompt_mask, completion_att], dim=1).long()
    ids = torch.where(
        attention.bool() | (torch.arange(P + C) >= P), ids, 0
    )  # pad id 0 in the prompt pads
    return ids, attention, completion_mask


def naive(model, ids, attention, completion_mask, temperature):
    """Full [N,L,V] logits, log_softmax, gather: the memory-hungry reference."""
    logits = model(ids, attention_mask=attention)[:, P - 1 : -1] / temperature  # [N,C,V]
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, ids[:, P:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return torch.where(completion_mask, logp, 0), torch.where(completion_mask, entropy, 0)


def param_grads(model, logp, entropy, seed=1):
    """Gradients w.r.t. every parameter of a random linear combination of logp (the entropy is not differentiated:
    it is only logged or masks tokens)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(logp.shape, generator=g, dtype=logp.dtype)
    return torch.autograd.grad((w * logp).sum(), list(model.parameters()))


MODEL = tiny_model()


@pytest.mark.parametrize("chunk_size", [1, 3, 512])
@pytest.mark.parametrize("completion_attention", [0, 1])
@pytest.mark.parametrize(
    "keep_bytes", [0, 4 * V * 8, 2**30]
)  # recompute all, keep the first 4 tokens', keep all
def test_matches_naive_values_and_gradients(chunk_size, completion_attention, keep_bytes):
    ids, att, cmask = batch(completion_attention)
    T = 0.7
    logp, ent = token_logprobs(
        MODEL, ids, att, cmask, temperature=T, chunk_size=chunk_size, keep_bytes=keep_bytes
    )
    ref_logp, ref_ent = naive(MODEL, ids, att, cmask, T)
    assert logp.dtype == torch.float64 and logp.shape == (3, C) and ent.shape == (3, C)
    assert torch.allclose(logp, ref_logp, atol=1e-12, rtol=0)
    assert torch.allclose(ent, ref_ent, atol=1e-12, rtol=0)
    assert torch.equal(logp[~cmask], torch.zeros_like(logp[~cmask]))
    assert torch.equal(ent[~cmask], torch.zeros_like(ent[~cmask]))
    for g, g_ref in zip(param_grads(MODEL, logp, ent), param_grads(MODEL, ref_logp, ref_ent)):
        assert torch.allclose(g, g_ref, atol=1e-12, rtol=1e-9)
    assert logp.requires_grad and not ent.requires_grad


@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    temperature=st.floats(0.3, 2.0),
    chunk_size=st.integers(1, 12),
    keep_tokens=st.integers(0, 12),
)
def test_matches_naive_random(seed, temperature, chunk_size, keep_tokens):
    ids, att, cmask = batch(seed % 2, seed)
    cmask = cmask & (
        torch.rand(cmask.shape, generator=torch.Generator().manual_seed(seed)) < 0.8
    )  # holes too
    logp, ent = token_logprobs(
        MODEL,
        ids,
        att,
        cmask,
        temperature=temperature,
        chunk_size=chunk_size,
        keep_bytes=keep_tokens * V * 8,
    )
    ref_logp, ref_ent = naive(MODEL, ids, att, cmask, temperature)
    assert torch.allclose(logp, ref_logp, atol=1e-12, rtol=0)
    assert torch.allclose(ent, ref_ent, atol=1e-12, rtol=0)
    for g, g_ref in zip(
        param_grads(MODEL, logp, ent, seed), param_grads(MODEL, ref_logp, ref_ent, seed)
    ):
        assert torch.allclose(g, g_ref, atol=1e-12, rtol=1e-9)


def test_no_grad_path_and_empty_mask():
    ids, att, cmask = batch()
    with torch.no_grad():
        logp, ent = token_logprobs(MODEL, ids, att, cmask, chunk_size=2)
    ref_logp, ref_ent = naive(MODEL, ids, att, cmask, 1.0)
    assert not logp.requires_grad and torch.allclose(logp, ref_logp, atol=1e-12)
    logp, ent = token_logprobs(MODEL, ids, att, torch.zeros_like(cmask))
    assert torch.equal(logp, torch.zeros(3, C, dtype=torch.float64)) and torch.equal(ent, logp)


def grouped_batch(completion_attention):
    """Rows that share prompts, as GRPO's groups do (prompt 0 x3, prompt 1 x1, prompt 2 x2), left-padded."""
    ids, att, cmask = batch(completion_attention)
    rows = torch.tensor([0, 1, 0, 2, 0, 2])
    ids, att, cmask = ids[rows].clone(), att[rows].clone(), cmask[rows].clone()
    g = torch.Generator().manual_seed(3)
    ids[:, P:] = torch.randint(1, V, (len(rows), C), generator=g)  # each row its own completion
    return ids, att, cmask


@pytest.mark.parametrize("completion_attention", [0, 1])
@pytest.mark.parametrize("kv_heads", [2, 4])
@pytest.mark.parametrize(
    "family", [{}, GEMMA3, QWEN3_5]
)  # (Gemma 3: a window of 3 < the prompts' 5)
def test_rows_sharing_a_prompt_share_its_forward_exactly(completion_attention, kv_heads, family):
    """A prompt shared by several rows runs once (its KV cache copied to its rows): the same log-probs, entropies
    and parameter gradients as the naive full forward, in float64; also with one completion token (the one-query
    attention path) and with gradient checkpointing (which takes the plain path). Values are bit-equal; gradients
    agree to fp32 rounding: RMSNorm computes in fp32 even in a float64 model (as HF's does), and a prompt's gradient
    is summed over its rows in another order here."""
    torch.manual_seed(0)
    model = Transformer(tiny_config(vocab_size=V, num_key_value_heads=kv_heads, **family))
    model = model.double()
    ids, att, cmask = grouped_batch(completion_attention)
    calls = []
    model.register_forward_pre_hook(lambda m, args: calls.append(args[0].shape))
    logp, ent = token_logprobs(model, ids, att, cmask)
    assert calls == [(3, P), (6, C)]  # the 3 distinct prompts, then the 6 completions alone
    want = naive(model, ids, att, cmask, 1.0)
    assert torch.allclose(logp, want[0], atol=1e-12) and torch.allclose(ent, want[1], atol=1e-12)
    for got, ref in zip(param_grads(model, logp, ent), param_grads(model, *want)):
        assert torch.allclose(got, ref, rtol=1e-6, atol=1e-6)
    one = token_logprobs(model, ids[:, : P + 1], att[:, : P + 1], cmask[:, :1])
    assert torch.allclose(one[0], want[0][:, :1], atol=1e-12)
    model.gradient_checkpointing = True
    logp_ckpt, ent_ckpt = token_logprobs(model.train(), ids, att, cmask)
    assert calls[-1] == (6, P + C) and torch.allclose(logp_ckpt, want[0], atol=1e-12)
    for got, ref in zip(
        param_grads(model, logp_ckpt, ent_ckpt),
        param_grads(model, *naive(model, ids, att, cmask, 1)),
    ):
        assert torch.allclose(got, ref, atol=1e-12)


def test_low_precision_model_gives_float32():
    model = Transformer(tiny_config(vocab_size=V)).to(torch.bfloat16)
    ids, att, cmask = batch()
    logp, ent = token_logprobs(model, ids, att, cmask)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    assert torch.isfinite(logp).all() and (logp <= 0).all() and (ent >= 0).all()


def test_rejects_bad_arguments():
    ids, att, cmask = batch()
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(MODEL, ids, att, cmask, temperature=0.0)
    with pytest.raises(ValueError, match="completion_mask"):
        token_logprobs(MODEL, ids, att, torch.ones(3, P + C, dtype=torch.bool))
    with pytest.raises(ValueError, match="attention_mask"):
        token_logprobs(MODEL, ids, att[:, 1:], cmask)
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(MODEL, ids, att, cmask, chunk_size=0)


@pytest.mark.parametrize(
    "keep_tokens,kept", [(0, []), (3, [2]), (4, [2, 2]), (5, [2, 2]), (100, [2, 2, 2, 2, 1])]
)
def test_probabilities_are_kept_for_backward_only_within_keep_bytes(keep_tokens, kept):
    """The first chunks that fit in keep_bytes save their [chunk,V] probabilities for backward; the rest save
    h and log Z only and recompute them (9 scored tokens in chunks of 2: 5 chunks, the last of 1 token)."""
    ids, att, cmask = batch()
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs(MODEL, ids, att, cmask, chunk_size=2, keep_bytes=keep_tokens * V * 8)
        n_chunked = len(saved)
        naive(MODEL, ids, att, cmask, 1.0)
    assert [s for s in saved[:n_chunked] if V in s[-1:]] == [(n, V) for n in kept]
    assert any(V in s[-1:] for s in saved[n_chunked:])  # the check can see them
    with torch.no_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        saved.clear()
        token_logprobs(MODEL, ids, att, cmask, chunk_size=2)
    assert saved == []
    MODEL.gradient_checkpointing = True  # trades compute for memory: nothing is kept
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            token_logprobs(
                MODEL.train(), ids, att, cmask, chunk_size=2, keep_bytes=keep_tokens * V * 8
            )
    finally:
        MODEL.gradient_checkpointing = False
    assert not any(V in s[-1:] for s in saved)


def test_scoring_matches_the_sampler_on_a_padded_vocabulary():
    # the qwen2 fixture has 400 embedding rows for a 384-token tokenizer, like Qwen2.5's padding
    from conftest import fixture_path

    from nanogrpo.rollout import join_prompt_completion
    from nanogrpo.sampler import Sampling, generate

    model = load_model(fixture_path("qwen2"))
    prompts = [[5, 17, 250, 3], [99, 100]]
    settings = Sampling(max_new_tokens=5, temperature=0.8, stop_ids={2}, pad_id=0, vocab_size=384)
    gen = torch.Generator().manual_seed(0)
    out = generate(model, prompts, settings, num_samples=3, generator=gen)
    ids, attention = join_prompt_completion(prompts, out.completion_ids, 0, 3)
    with torch.no_grad():
        same, _ = token_logprobs(
            model, ids, attention, out.completion_mask, temperature=0.8, vocab_size=384
        )
        full, _ = token_logprobs(model, ids, attention, out.completion_mask, temperature=0.8)
    assert torch.allclose(same, out.logprobs, atol=1e-5)
    assert (full - out.logprobs).abs().max() > 1e-3  # the padded rows carry mass in a random model


@pytest.mark.parametrize("temperature,vocab_size", [(1.0, None), (0.7, V - 5)])
def test_the_fast_path_equals_the_plain_definition(temperature, vocab_size):
    """fast.logprobs.token_logprobs (chunked LM head, kept probabilities, shared-prompt forward) =
    logprobs.token_logprobs (full logits, log_softmax, gather), values and gradients, in float64; the
    plain one = the test's naive."""
    ids, att, cmask = batch(1)
    plain = token_logprobs_plain(
        MODEL, ids, att, cmask, temperature=temperature, vocab_size=vocab_size
    )
    fast = token_logprobs(
        MODEL,
        ids,
        att,
        cmask,
        temperature=temperature,
        vocab_size=vocab_size,
        chunk_size=2,
        keep_bytes=2 * V * 8,
    )  # the first chunk kept, the others recomputed
    for got, want in zip(fast, plain):
        assert torch.allclose(got, want, atol=1e-12)
    for got, want in zip(param_grads(MODEL, *fast), param_grads(MODEL, *plain)):
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-9)
    if vocab_size is None:
        for got, want in zip(plain, naive(MODEL, ids, att, cmask, temperature)):
            assert torch.allclose(got, want, atol=1e-12)


# -----------------------------------------------------------------------------
# The entropy's gradient (TRL's entropy bonus) and the float32 LM head


def entropy_param_grads(model, logp, entropy, seed=3):
    """Gradients of a random combination of logp and entropy, masked slots included."""
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(logp.shape, generator=g, dtype=logp.dtype)
    w2 = torch.randn(entropy.shape, generator=g, dtype=entropy.dtype)
    loss = (w1 * logp).sum() + (w2 * entropy).sum()
    return torch.autograd.grad(loss, list(model.parameters()))


@pytest.mark.parametrize("keep_bytes", [0, 4 * V * 8, 2**30])  # recompute, some kept, all kept
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_entropy_gradient_equals_the_plain_definition(keep_bytes, temperature, checkpointing):
    """With entropy_grad, d(entropy)/d(parameters) is the plain version's (full autograd)."""
    ids, att, cmask = batch(1)
    MODEL.gradient_checkpointing = checkpointing
    try:
        logp, ent = token_logprobs(
            MODEL,
            ids,
            att,
            cmask,
            temperature=temperature,
            chunk_size=3,
            keep_bytes=keep_bytes,
            entropy_grad=True,
        )
    finally:
        MODEL.gradient_checkpointing = False
    ref_logp, ref_ent = token_logprobs_plain(MODEL, ids, att, cmask, temperature=temperature)
    assert ent.requires_grad
    for g, g_ref in zip(
        entropy_param_grads(MODEL, logp, ent), entropy_param_grads(MODEL, ref_logp, ref_ent)
    ):
        assert torch.allclose(g, g_ref, atol=1e-12, rtol=1e-9)


def test_the_entropy_has_no_gradient_unless_asked():
    ids, att, cmask = batch(1)
    logp, ent = token_logprobs(MODEL, ids, att, cmask, chunk_size=3)
    assert logp.requires_grad and not ent.requires_grad


def test_an_entropy_bonus_frees_no_row():
    from nanogrpo.fast.logprobs import rows_without_gradient

    big = Transformer(tiny_config(vocab_size=V, hidden_size=64, intermediate_size=128))
    adv = torch.tensor([0.0, 1.0, 0.0, 0.0])
    assert rows_without_gradient(adv, 0.0, big, 4000).tolist() == [True, False, True, True]
    assert rows_without_gradient(adv, 0.0, big, 4000, entropy_bonus=True) is None


def fp32_head_logprobs(model, h, ids, cmask, T):
    """The reference: float32 logits of hidden states h [N,C,D] -> (log-probs of the completion
    tokens [N,C], masked to 0; the logits [N,C,V])."""
    logits = h.float() @ model.lm_head.weight.float().T  # [N,C,V] in float32
    ref = torch.log_softmax(logits / T, -1).gather(-1, ids[:, P:, None]).squeeze(-1)
    return torch.where(cmask, ref, 0), logits


def test_cast_lm_head_to_fp32_under_bf16_autocast():
    """The LM head in float32 (TRL's cast_lm_head_to_fp32): under bf16 autocast the log-probs are
    those of float32 logits of the (bf16-computed) hidden states, in the chunked, the plain and the
    sampler's paths; without it they differ. Each path is compared with the float32 head applied to
    its own hidden states: the chunked path runs each prompt once into a KV cache, and bf16 matmuls
    of other shapes round its hidden states differently, by an amount that depends on the CPU's
    kernels. What is left is float32 rounding of log-probs of magnitude ~5 (a few ulps): 1e-5."""
    from nanogrpo.fast.logprobs import shared_prompt_forward
    from nanogrpo.sampler import lm_logits

    torch.manual_seed(0)
    model = Transformer(tiny_config(vocab_size=V))
    ids, att, cmask = batch(1)
    T = 0.7
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = model.hidden_states(ids, attention_mask=att.bool())[:, P - 1 : -1]  # [N,C,D]
        h_chunked = shared_prompt_forward(model, ids, att, C, lambda h, lm_head: h)  # [N,C,D]
        bf16_logp, _ = token_logprobs(model, ids, att, cmask, temperature=T)
        model.cast_lm_head_to_fp32 = True
        logp, _ = token_logprobs(model, ids, att, cmask, temperature=T)
        plain, _ = token_logprobs_plain(model, ids, att, cmask, temperature=T)
        sampled = lm_logits(model, h[:, 0], V, chunk=32)
        model.cast_lm_head_to_fp32 = False
    ref, logits = fp32_head_logprobs(model, h, ids, cmask, T)
    ref_chunked, _ = fp32_head_logprobs(model, h_chunked, ids, cmask, T)
    assert (logp - ref_chunked).abs().max() < 1e-5
    assert (plain - ref).abs().max() < 1e-5
    assert (sampled - logits[:, 0]).abs().max() < 1e-5
    assert (bf16_logp - ref_chunked).abs().max() > 1e-4  # the bf16 head rounds its logits


def relative_error(grads, ref):
    """||grads - ref|| / ||ref|| over a list of tensors."""
    num = sum(float(((g.double() - r.double()) ** 2).sum()) for g, r in zip(grads, ref))
    return (num / sum(float((r.double() ** 2).sum()) for r in ref)) ** 0.5


@pytest.mark.parametrize("keep_bytes", [0, 2**30])  # recompute the probabilities, keep them
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_chunked_gradient_under_cpu_bf16_autocast_is_autograds(keep_bytes, entropy_grad):
    """Under a CPU bf16 autocast the chunked LM head's backward (its recompute, its matmuls) runs
    under the forward's autocast, as autograd's backward of the same bf16 ops does: the gradients
    of h and of the LM head equal full autograd's (0 here; 2.6e-3 to 2.7e-3 relative when the
    backward ran outside the autocast). One chunk, so the LM head's gradient is one matmul in
    both."""
    from nanogrpo.fast.logprobs import score_chunks
    from nanogrpo.model import lm_head_linear

    torch.manual_seed(0)
    model = Transformer(tiny_config(vocab_size=V))
    ids, att, cmask = batch(1)
    targets, T = ids[:, P:], 0.7
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        h0 = model.hidden_states(ids, attention_mask=att.bool())[:, P - 1 : -1]  # [N,C,D]
    g = torch.Generator().manual_seed(1)
    u, v = torch.randn(cmask.shape, generator=g), torch.randn(cmask.shape, generator=g)

    def grads(chunked):
        h = h0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if chunked:
                logp, ent = score_chunks(
                    h, model.lm_head, targets, cmask, T, None, 512, keep_bytes, entropy_grad
                )
            else:  # the definition: full bf16 logits
                logits = lm_head_linear(h, model.lm_head.weight).float()  # [N,C,V]
                logp_all = torch.log_softmax(logits / T, -1)
                logp = torch.where(cmask, logp_all.gather(-1, targets[..., None])[..., 0], 0)
                ent = torch.where(cmask, -(logp_all.exp() * logp_all).sum(-1), 0)
        loss = (u * logp).sum() + ((v * ent).sum() if entropy_grad else 0)
        return torch.autograd.grad(loss, [h, model.lm_head.weight])

    assert relative_error(grads(True), grads(False)) < 1e-4


@pytest.mark.parametrize("keep_bytes", [0, 2**30])
def test_the_lm_head_is_cast_once_a_call_however_many_chunks(keep_bytes):
    """Under a bf16 autocast over fp32 weights the LM head's weight [V,D] is cast to bf16 once in
    forward and once in backward, whatever the number of chunks, and its gradient reaches autograd
    as one fp32 [V,D] tensor: no per-chunk cast of the weight or of its gradient (one Function per
    chunk made 2 to 4 such casts per chunk). Chunks of 1 and one chunk give the same gradients up to
    bf16's rounding of each chunk's share of the weight's gradient."""
    from nanogrpo.fast.logprobs import score_chunks

    torch.manual_seed(0)
    model = Transformer(tiny_config(vocab_size=V))
    ids, att, cmask = batch(1)
    with torch.no_grad():
        h0 = model.hidden_states(ids, attention_mask=att.bool())[:, P - 1 : -1]  # [N,C,D]
    D = h0.shape[-1]

    def run(chunk_size):
        h = h0.clone().requires_grad_()
        with RecordOps() as rec:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logp, _ = score_chunks(
                    h, model.lm_head, ids[:, P:], cmask, 0.7, None, chunk_size, keep_bytes
                )
            grads = torch.autograd.grad(logp.sum(), [h, model.lm_head.weight])
        casts = rec.ops.count((torch.ops.aten._to_copy.default, (V, D)))
        return casts, grads

    n_one, grads_one = run(chunk_size=int(cmask.sum()))
    n_many, grads_many = run(chunk_size=1)
    assert (n_one, n_many) == (2, 2)
    assert relative_error(grads_many, grads_one) < 1e-2  # 2.5e-3 here


def test_checkpointed_scoring_under_cpu_bf16_autocast_has_autograds_gradient():
    """The whole model under a CPU bf16 autocast, gradient checkpointing on (so the chunk
    recomputes its probabilities in backward): every parameter's gradient of the chunked
    log-probs equals autograd's of the plain definition (0 here; 3.7e-3 relative when the
    recompute ran in float32)."""
    torch.manual_seed(0)
    model = Transformer(tiny_config(vocab_size=V))
    model.gradient_checkpointing = True
    ids, att, cmask = batch(1)
    out = []
    for score in (token_logprobs, token_logprobs_plain):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            kwargs = dict(chunk_size=512) if score is token_logprobs else {}
            logp, _ = score(model, ids, att, cmask, temperature=0.7, **kwargs)
        out.append(param_grads(model, logp, None))
    assert relative_error(*out) < 1e-4


@pytest.mark.parametrize("beta, entropy_bonus", [(0.0, False), (0.04, False), (0.0, True)])
def test_no_throwaway_forward_when_the_configuration_frees_no_row(beta, entropy_bonus):
    """With several ranks policy_logprobs runs a no_grad call even when this rank frees no row (an
    FSDP rank that frees some makes that call's collectives). When the configuration frees no row
    on any rank (beta != 0, an entropy bonus) that call is wasted and does not run: each model
    forward then has gradient, as with one rank."""
    from nanogrpo.fast.logprobs import policy_logprobs

    model = tiny_model()
    grad_on = []  # torch.is_grad_enabled() at each model forward
    model.register_forward_hook(lambda *_: grad_on.append(torch.is_grad_enabled()))
    ids, att, cmask = batch(1)
    logps, ent = policy_logprobs(
        model,
        ids,
        att,
        cmask,
        torch.tensor([1.0, -1.0, 0.5]),
        beta=beta,
        entropy_bonus=entropy_bonus,
        world_size=2,
    )
    some_rank_may_free = beta == 0 and not entropy_bonus
    # two model calls a scoring (the shared prompt, then the completions)
    assert grad_on == [False] * 2 * some_rank_may_free + [True] * 2
    assert torch.equal(logps, token_logprobs(model, ids, att, cmask)[0])
    assert ent.requires_grad == entropy_bonus  # the bonus's entropy has a gradient


SMOLLM3 = {"model_type": "smollm3", "no_rope_layers": [0, 1]}  # a NoPE layer, then a RoPE one


@pytest.mark.parametrize(
    "entropy_bonus, world_size, family",
    [
        (False, 1, {}),
        (False, 2, {}),
        (True, 1, {}),
        (False, 2, SMOLLM3),
        (True, 1, SMOLLM3),
        (False, 2, GEMMA3),
        (True, 1, GEMMA3),
        (False, 2, QWEN3_5),
        (True, 1, QWEN3_5),
    ],
)
def test_fast_policy_logprobs_equal_the_plain_definition(
    entropy_bonus, world_size, family, monkeypatch
):
    """fast.logprobs.policy_logprobs (rows whose advantage is exactly 0 scored without gradient, beta = 0)
    = logprobs.policy_logprobs (every row with gradient): log-probs and entropies, and the parameter
    gradients of a loss whose per-token terms are the advantage times something (plus, with the entropy
    bonus, the entropy's own term), in float64, to the plain-vs-chunked tolerance. Each row has its own
    prompt (a shared prompt's gradient agrees only to fp32 rounding, see
    test_rows_sharing_a_prompt_share_its_forward_exactly); the floor is lowered so that the tiny model's
    zero-advantage rows are split off."""
    from nanogrpo import logprobs as plain
    from nanogrpo.fast import logprobs as fast

    monkeypatch.setitem(fast.SKIP_MIN_FLOPS, "cpu", 0)
    torch.manual_seed(0)
    model = Transformer(tiny_config(vocab_size=V, **family)).double()
    grad_on = []  # torch.is_grad_enabled() at each model forward
    model.register_forward_hook(lambda *_: grad_on.append(torch.is_grad_enabled()))
    ids, att, cmask = (
        torch.cat(parts) for parts in zip(batch(1, seed=0), batch(1, seed=1))
    )  # 6 rows
    adv = torch.tensor([0.0, 1.5, 0.0, -0.5, 0.0, 0.0], dtype=torch.float64)
    kwargs = {
        "beta": 0.0,
        "entropy_bonus": entropy_bonus,
        "world_size": world_size,
        "temperature": 0.7,
        "vocab_size": V - 5,
    }
    got = fast.policy_logprobs(model, ids, att, cmask, adv, **kwargs)
    assert (False in grad_on) == (
        not entropy_bonus
    )  # the split ran (no row is freed with the bonus)
    want = plain.policy_logprobs(model, ids, att, cmask, adv, **kwargs)
    for a, b in zip(got, want):
        assert a.shape == (6, C) and torch.allclose(a, b, atol=1e-12, rtol=0)
    assert got[0].requires_grad and got[1].requires_grad == entropy_bonus

    def grads(logp, entropy):
        g = torch.Generator().manual_seed(1)
        w1 = torch.randn(logp.shape, generator=g, dtype=logp.dtype)
        w2 = torch.randn(entropy.shape, generator=g, dtype=entropy.dtype)
        loss = (adv[:, None] * w1 * logp).sum() + ((w2 * entropy).sum() if entropy_bonus else 0)
        return torch.autograd.grad(loss, list(model.parameters()))

    for a, b in zip(grads(*got), grads(*want)):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_columns_after_the_last_scored_token_are_cut_and_change_nothing(entropy_grad, monkeypatch):
    """A batch whose scored tokens end before its width (rows padded to a longer round) runs only
    up to its last scored column: values, entropies and gradients equal the plain definition over
    the full width, and the model is called on the shorter rows."""
    from nanogrpo.fast import logprobs as fast_logprobs

    model = tiny_model()
    g = torch.Generator().manual_seed(3)
    N, P, C = 4, 5, 9
    ids = torch.randint(1, V, (N, P + C), generator=g)
    att = torch.ones_like(ids)
    cmask = torch.zeros(N, C)
    cmask[0, :3] = 1
    cmask[1, :5] = 1  # the last scored column is 4: columns 5..8 are padding for every row
    cmask[3, :2] = 1
    widths = []
    real = model.forward

    def recording(input_ids, **kwargs):
        widths.append(input_ids.shape[1])
        return real(input_ids, **kwargs)

    monkeypatch.setattr(model, "forward", recording)
    assert fast_logprobs.scored_width(cmask) == 5
    assert fast_logprobs.scored_width(torch.zeros(N, C)) == 1
    logps, ents = fast_logprobs.token_logprobs(model, ids, att, cmask, entropy_grad=entropy_grad)
    assert logps.shape == ents.shape == (N, C)
    assert max(widths) < P + C  # the forward never saw the cut columns
    monkeypatch.setattr(model, "forward", real)
    plain, plain_ents = token_logprobs_plain(model, ids, att, cmask)
    torch.testing.assert_close(logps, plain, rtol=0, atol=1e-12)
    torch.testing.assert_close(ents, plain_ents, rtol=0, atol=1e-12)
    loss = (logps * torch.arange(C)).sum() + (ents.sum() if entropy_grad else 0)
    ref = (plain * torch.arange(C)).sum() + (plain_ents.sum() if entropy_grad else 0)
    got = torch.autograd.grad(loss, list(model.parameters()))
    want = torch.autograd.grad(ref, list(model.parameters()))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


# -----------------------------------------------------------------------------
# Nothing to score: every completion masked (e.g. mask_truncated_completions with all truncated)


def test_nothing_to_score_still_gives_every_parameter_a_zero_gradient():
    """With every completion token masked the log-probs are 0 and still part of the graph, in
    the fast path as in the plain one: backward gives every parameter a zero gradient (AdamW then
    decays and counts the step, as TRL's does), and under FSDP2 every rank runs its backward."""
    model = tiny_model()
    ids, att, cmask = batch()
    for score in (token_logprobs, token_logprobs_plain):
        logp, _ = score(model, ids, att, torch.zeros_like(cmask))
        assert torch.equal(logp, torch.zeros(3, C, dtype=torch.float64))
        grads = torch.autograd.grad(logp.sum(), list(model.parameters()))  # none unused
        assert all(not g.any() for g in grads), score.__module__


def all_truncated_run(tmp_path, *overrides):
    """One optimizer step of the tiny default run in which no completion ends before
    max_completion_length (min_new_tokens = 6) and truncated ones are masked: nothing to score."""
    from test_train import tiny

    import train

    history = train.train(
        tiny(
            tmp_path,
            "--max_steps=1",
            "--mask_truncated_completions=true",
            '--generation_kwargs={"min_new_tokens": 6}',
            "--weight_decay=0.1",
            *overrides,
        )
    )
    return history[-1], load_model(tmp_path / "run" / "checkpoint").state_dict()


def test_a_step_with_every_completion_truncated_trains_as_the_plain_path(tmp_path):
    """TRL trains such a step with loss 0 and zero gradients; the optimizer step still runs
    (weight decay). The fast path equals the plain one, weights bit for bit."""
    fast, after = all_truncated_run(tmp_path / "fast")
    plain, plain_after = all_truncated_run(tmp_path / "plain", "--plain=true")
    before = load_model(tmp_path / "fast" / "init").state_dict()
    for m in (fast, plain):
        assert m["completions/clipped_ratio"] == 1.0 and m["loss"] == 0.0 and m["grad_norm"] == 0
    assert after.keys() == plain_after.keys()
    for k in after:
        assert torch.equal(after[k], plain_after[k]), k
        assert not torch.equal(after[k], before[k]) or k.endswith("bias"), k  # decayed


def masked_rank_step(rank, world_size, port, out_path):
    """One optimizer step of train.optimizer_step on the qwen2 fixture (sharded with FSDP2 when
    world_size > 1) over 8 rows in micro-batches of 2: with 2 ranks, rank 0's rows have nothing
    to score (its second micro-batch's scored row has advantage 0, so it is split off without
    gradient) while rank 1's have. Saves the full weights from rank 0."""
    from types import SimpleNamespace

    from test_dist import join_group

    from nanogrpo import distributed as dist, fast
    from nanogrpo.fast import logprobs
    from nanogrpo.grpo import LossConfig
    from nanogrpo.rollout import Rollout
    from nanogrpo.run.config import TrainConfig
    from nanogrpo.trainer import Kernels

    join_group(rank, world_size, port)
    logprobs.SKIP_MIN_FLOPS["cpu"] = 0  # split off zero-advantage rows of the small fixture
    info = dist.setup("cpu")
    model = load_model(fixture_path("qwen2"), info=info)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    N, P, C = 8, 5, 6  # rows, prompt and completion lengths
    ids = torch.randint(0, 300, (N, P + C), generator=g)
    attention_mask = torch.ones(N, P + C, dtype=torch.long)
    mask = torch.ones(N, C)
    mask[:3] = 0  # rows 0-2: nothing to score (truncated and masked)
    mask[5, 3:] = 0
    advantages = torch.tensor([1.0, -1.0, 0.5, 0.0, 0.7, -0.3, 0.0, 1.2])
    n = N // world_size
    mine = slice(rank * n, (rank + 1) * n)
    ro = Rollout(
        rows=[],
        num_generations=2,
        prompt_ids=[],
        input_ids=ids[mine],
        attention_mask=attention_mask[mine],
        completion_mask=mask[mine],
        completion_lengths=mask[mine].sum(1).long(),
        truncated=torch.zeros(n, dtype=torch.bool),
        prompts=[],
        completions=[],
        completion_token_ids=[],
        advantages=advantages[mine],
        num_items=mask.sum(),
    )
    micro = [torch.arange(i, i + 2) for i in range(0, n, 2)]
    t = SimpleNamespace(  # the fields of train.Trainer an optimizer step reads
        model=model,
        optimizer=optimizer,
        cfg=TrainConfig(per_device_train_batch_size=2),
        loss_cfg=LossConfig(loss_type="dapo"),
        loss_terms=None,
        info=info,
        autocast=torch.autocast("cpu", enabled=False),
        tok=SimpleNamespace(vocab_size=None),
        sched=SimpleNamespace(steps_per_generation=len(micro)),
        kernels=Kernels(**fast.kernels()),
        entropy_coef=0.0,
        last_entropy=0.0,
    )
    metrics = conftest.optimizer_step(t, [(ro, idx) for idx in micro])
    state = dist.full_state_dict(model)
    if info.is_main:
        torch.save({"state": state, "grad_norm": metrics["grad_norm"]}, out_path)
    dist.teardown()
    os._exit(0)  # as test_dist.one_step: skip gloo's static destructors


def test_a_rank_with_nothing_to_score_steps_with_the_others(tmp_path):
    """Under FSDP2 every rank runs the same collectives even when one rank's micro-batches have
    nothing to score: 2 processes give the update 1 process gives on the same rows."""
    import torch.multiprocessing as mp
    from test_dist import free_port

    results = {}
    for world in (1, 2):
        out = tmp_path / f"w{world}.pt"
        mp.start_processes(
            masked_rank_step,
            args=(world, free_port(), str(out)),
            nprocs=world,
            start_method="spawn",
            join=True,
        )
        results[world] = torch.load(out)
    assert results[1]["grad_norm"] > 0
    assert results[2]["grad_norm"] == pytest.approx(results[1]["grad_norm"], rel=1e-5)
    one, two = results[1]["state"], results[2]["state"]
    for k in one:
        assert torch.allclose(one[k], two[k], atol=1e-5, rtol=1e-5), k


def test_a_gradient_of_another_dtype_is_added_slice_by_slice_exactly():
    """_add_in_slices (the LM head's bf16 gradient into its fp32 sum, a slice of rows at a time on
    CPU) equals one add, slices that do not divide the rows included."""
    from nanogrpo.fast.logprobs import _add_in_slices

    g = torch.Generator().manual_seed(0)
    acc = torch.randn(10, 6, generator=g)
    part = torch.randn(10, 6, generator=g).bfloat16()
    want = acc + part
    _add_in_slices(acc, part, rows=3)
    assert torch.equal(acc, want)
