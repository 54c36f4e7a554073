"""TRL's generation_kwargs in the sampler: stop strings end rows (a string spanning tokens too, on
either loop cadence), suppressed tokens are never sampled and the log-probs are those of the
distribution without them, min_new_tokens holds the stop ids back, the fast draw equals the plain
one with all of them, overrides win over the config's fields (not the loss's temperature),
unknown and refused keys fail at config load, and a tiny training run reads them."""

import pytest
import torch
from conftest import tiny_config
from test_sampler import (
    PROMPTS,
    TOKENIZER_VOCAB,
    filtered,
    generate_with,
    left_pad,
    load,
    sampling_args,
)

from nanogrpo import rollout as rollout_module
from nanogrpo.extras import tool_rounds
from nanogrpo.extras.generation_kwargs import generation_settings, processors, sampling_of
from nanogrpo.fast.sampling import sample_next_token_fast
from nanogrpo.model import Transformer
from nanogrpo.run.config import ConfigError, TrainConfig
from nanogrpo.sampler import Decoder, generate
from nanogrpo.tokenizer import char_level_tokenizer


def words(i):
    """A token's text for the tests' decode: its id in base 3 over "abc" (1 to 6 letters), so
    short stop strings often span two or three tokens."""
    out = ""
    while True:
        out = "abc"[i % 3] + out
        i //= 3
        if i == 0:
            return out


def decode(ids):
    return "".join(words(i) for i in ids)


class EveryEighthStep(Decoder):
    """The eager decoder on the GPU cadence of StaticDecoder: stops read every 8 steps, finished
    rows kept (not compacted)."""

    compacts = False

    def __init__(self, model, vocab_size, chunk):
        super().__init__(model, vocab_size, chunk)
        self.sync_every = 8


# -----------------------------------------------------------------------------
# Stop strings


def test_a_stop_string_spanning_two_tokens_ends_the_row():
    """The row ends with the token that completed the string, kept in the completion and the
    mask; it counts as truncated (no eos at its end, as TRL counts it); other rows run on."""
    model = load("qwen2")
    free = generate_with(model, PROMPTS, max_new_tokens=10, temperature=0)
    row = free.completion_ids[0].tolist()  # greedy: 309, 62, 62, 62, 309, ...
    stop = f"{row[3]}><{row[4]}"  # token 3's text but its "<", token 4's but its ">"
    assert stop not in "".join(f"<{i}>" for i in row[:4])
    out = generate_with(
        model,
        PROMPTS,
        max_new_tokens=10,
        temperature=0,
        processors=processors(stop_strings=stop, decode=lambda ids: "".join(f"<{i}>" for i in ids)),
    )
    assert out.completion_mask[0].tolist() == [True] * 5 + [False] * 5
    assert out.completion_ids[0, :5].tolist() == row[:5] and (out.completion_ids[0, 5:] == 0).all()
    assert out.truncated[0] and (out.logprobs[0, 5:] == 0).all()
    assert torch.equal(out.completion_ids[1:], free.completion_ids[1:])


@pytest.mark.parametrize("decoder", [None, EveryEighthStep])
def test_stop_strings_end_each_row_where_its_full_text_first_holds_one(decoder):
    """Against a naive reference: the same seeds without stop strings draw the same tokens, and a
    row must end at the first prefix whose whole decoded text holds a stop string, or at its
    first stop id, the earlier; on the every-8-steps cadence the string and the stop id may fall
    in one block in either order."""
    model = load("qwen2")
    stops = ["acab", "bbcc"]
    args = sampling_args(
        num_samples=6,
        max_new_tokens=24,
        temperature=1.3,
        top_k=0,
        top_p=1.0,
        min_p=0.0,
        repetition_penalty=1.0,
        stop_ids=[2, 0, *range(100, 130)],
        seeds=[3, 4, 5, 6],
        decoder=decoder,
    )
    free = generate_with(model, PROMPTS, **args)
    out = generate_with(
        model, PROMPTS, processors=processors(stop_strings=stops, decode=decode), **args
    )
    C = args["max_new_tokens"]
    ends = {"string": 0, "id": 0, "length": 0, "string, then an id in its 8 steps": 0}
    for r in range(len(out.completion_ids)):
        ids = free.completion_ids[r].tolist()
        n_free = int(free.completion_mask[r].sum())
        holds = [k for k in range(1, n_free + 1) if any(s in decode(ids[:k]) for s in stops)]
        n = holds[0] if holds else C + 1
        n_want = min(n, n_free)
        ended_by_id = not free.truncated[r]
        ends["string" if n < n_free else "id" if ended_by_id else "length"] += 1
        same_block = (n - 1) // 8 == (n_free - 1) // 8
        ends["string, then an id in its 8 steps"] += n < n_free and same_block
        assert int(out.completion_mask[r].sum()) == n_want, r
        assert out.completion_ids[r, :n_want].tolist() == ids[:n_want]
        # not bit for bit: compaction changes the batch a row is computed in
        assert torch.allclose(out.logprobs[r, :n_want], free.logprobs[r, :n_want], atol=1e-5)
        assert bool(out.truncated[r]) == (n < n_free or bool(free.truncated[r]))
    assert ends["string"] >= 4 and ends["id"] >= 4  # both kinds of end happen
    assert ends["string, then an id in its 8 steps"] >= 2


def test_stop_strings_in_a_rollout_read_the_tokenizer():
    """sampling_of(cfg, tok): generation_kwargs' stop strings ("stop", vLLM's name, too)
    matched on tok.decode; a char-level tokenizer makes every two-letter string span two tokens."""
    tok = char_level_tokenizer("abcdefgh=")
    torch.manual_seed(0)
    model = Transformer(tiny_config(vocab_size=tok.vocab_size))
    cfg = TrainConfig(
        max_completion_length=20, generation_kwargs={"stop": ["ab"], "stop_strings": "hh"}
    )
    out = generate(model, [tok.encode("abc=")], sampling_of(cfg, tok), num_samples=16, seeds=[0])
    ended = 0
    for ids, mask in zip(out.completion_ids, out.completion_mask):
        text = tok.decode(ids[mask])
        first = min((text.find(s) + 2 for s in ("ab", "hh") if s in text), default=None)
        assert first is None or first == len(text)  # a string, if any, only at the very end
        ended += first is not None
    assert ended >= 4


# -----------------------------------------------------------------------------
# suppress_tokens, min_new_tokens


def recomputed_logprobs(model, out, args, banned_at):
    """Each sampled token's log-prob recomputed by an uncached forward, then the repetition
    penalty, the banned tokens of its step (-inf) and the filters: [N,C], NaN off the mask."""
    N, C = out.completion_ids.shape
    prompts = [p for p in PROMPTS for _ in range(args["num_samples"])]
    ids, mask = left_pad([p + c.tolist() for p, c in zip(prompts, out.completion_ids)])
    mask[:, -C:] &= out.completion_mask
    with torch.no_grad():
        logits = model(ids, attention_mask=mask)[:, -C - 1 : -1, :TOKENIZER_VOCAB].float()
    want = torch.full((N, C), float("nan"))
    for t in range(C):
        L = ids.shape[1] - C + t
        seen = torch.where(mask[:, :L], ids[:, :L], -1)  # prompt + earlier tokens
        z = logits[:, t].clone()
        z[:, banned_at(t)] = float("-inf")
        z = filtered(
            z,
            seen,
            args["temperature"],
            args["top_k"],
            args["top_p"],
            args["min_p"],
            args["repetition_penalty"],
        )
        logp = z.log_softmax(-1).gather(-1, out.completion_ids[:, t : t + 1]).squeeze(-1)
        live = out.completion_mask[:, t]
        want[live, t] = logp[live]
    return want


def test_suppressed_tokens_are_never_sampled_and_the_logprobs_renormalise():
    """The tokens greedy decoding picks most are suppressed: never sampled, and each returned
    log-prob is log_softmax of the processed logits (the allowed tokens' probabilities sum to 1)."""
    model = load("qwen2")
    free = generate_with(
        model, PROMPTS, max_new_tokens=10, temperature=0, vocab_size=TOKENIZER_VOCAB
    )
    banned = sorted(set(free.completion_ids.flatten().tolist()))
    args = sampling_args(
        num_samples=3,
        max_new_tokens=12,
        temperature=0.8,
        top_k=40,
        top_p=0.9,
        min_p=0.02,
        repetition_penalty=1.3,
        seeds=[1, 2, 3, 4],
    )
    limits = processors(suppress_tokens=banned + [10_000])  # 10_000: ignored
    out = generate_with(model, PROMPTS, processors=limits, **args)
    assert not torch.isin(out.completion_ids[out.completion_mask], torch.tensor(banned)).any()
    want = recomputed_logprobs(model, out, args, lambda t: banned)
    live = out.completion_mask
    assert torch.allclose(out.logprobs[live], want[live], atol=2e-4)
    assert torch.isfinite(want[live]).all()
    limits = processors(suppress_tokens=banned)
    greedy = generate_with(model, PROMPTS, max_new_tokens=10, temperature=0, processors=limits)
    assert not torch.isin(greedy.completion_ids, torch.tensor(banned)).any()
    with pytest.raises(ValueError, match="leave no token to sample"):
        generate_with(
            model,
            PROMPTS,
            max_new_tokens=4,
            processors=processors(suppress_tokens=range(TOKENIZER_VOCAB)),
            vocab_size=TOKENIZER_VOCAB,
        )


def test_min_new_tokens_holds_the_stop_ids_back():
    """transformers' MinNewTokensLengthLogitsProcessor: no stop id while fewer than
    min_new_tokens tokens are out, so every row has at least that many before its stop id; the
    log-probs of those steps are those of the distribution without the stop ids."""
    model = load("qwen2")
    stops = [0, 2, *range(40, 120)]  # ~20% of the vocabulary stops a row
    args = sampling_args(
        num_samples=4,
        max_new_tokens=16,
        temperature=1.2,
        top_k=0,
        top_p=1.0,
        min_p=0.0,
        repetition_penalty=1.0,
        stop_ids=stops,
        seeds=[7, 8, 9, 10],
    )
    free = generate_with(model, PROMPTS, **args)
    assert (free.completion_mask.sum(1) <= 4).sum() >= 4  # without it, many rows end early
    out = generate_with(model, PROMPTS, processors=processors(min_new_tokens=4), **args)
    length = out.completion_mask.sum(1)
    assert (length >= 5).all() and (length == 5).any()  # the stop id may come as the 5th token
    assert not torch.isin(out.completion_ids[:, :4], torch.tensor(stops)).any()
    want = recomputed_logprobs(model, out, args, lambda t: stops if t < 4 else [])
    live = out.completion_mask
    assert torch.allclose(out.logprobs[live], want[live], atol=2e-4)


@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 1.0, 0.0), (5, 0.9, 0.0), (0, 0.95, 0.05)])
def test_the_fast_draw_equals_the_plain_one_with_suppression(top_k, top_p, min_p):
    """Suppression happens in the decode loop, before either draw: sample_next_token_fast (what
    training uses) stays equal to sample_next_token bit for bit, stop strings included."""
    model = load("qwen2")
    args = sampling_args(
        num_samples=3,
        max_new_tokens=12,
        temperature=1.2,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seeds=[11, 12, 13, 14],
        processors=processors(
            suppress_tokens=[252, 62, 14, 37], min_new_tokens=3, stop_strings=["cab"], decode=decode
        ),
    )
    plain = generate_with(model, PROMPTS, **args)
    fast = generate_with(model, PROMPTS, sample_token=sample_next_token_fast, **args)
    assert torch.equal(plain.completion_ids, fast.completion_ids)
    assert torch.equal(plain.logprobs, fast.logprobs)
    assert torch.equal(plain.completion_mask, fast.completion_mask)


# -----------------------------------------------------------------------------
# The config: overrides, refusals, a training run


def test_overrides_win_over_the_fields_but_not_the_loss_temperature():
    """As TRL: generation_kwargs' sampling keys replace the fields' values in the sampler (None =
    off); the temperature the loss scores with stays the field's (train.py reads
    cfg.temperature)."""
    cfg = TrainConfig(
        temperature=1.0,
        top_k=20,
        min_p=0.1,
        generation_kwargs={
            "temperature": 0.5,
            "top_k": 3,
            "top_p": 0.8,
            "min_p": None,
            "repetition_penalty": 1.2,
            "min_new_tokens": 2,
            "suppress_tokens": [5],
            "do_sample": True,
        },
    ).validate()
    tok = char_level_tokenizer("abc")
    got = sampling_of(cfg, tok)
    assert (got.temperature, got.top_k, got.top_p, got.min_p) == (0.5, 3, 0.8, 0.0)
    assert got.repetition_penalty == 1.2 and cfg.temperature == 1.0
    banned, strings = got.processors(1, 4, torch.tensor([0]), 10, "cpu")  # N, C, stops, V
    assert banned.at(0).nonzero().flatten().tolist() == [0, 5]  # the stop id, before 2 tokens
    assert banned.at(2).nonzero().flatten().tolist() == [5] and strings is None
    assert sampling_of(TrainConfig(), tok).processors is None  # none: generate runs without
    assert sampling_of(TrainConfig(top_k=20), tok).top_k == 20  # none given: the fields
    # the tokenizer's stop ids, pad id and vocabulary
    assert (got.stop_ids, got.pad_id, got.vocab_size) == (tok.eos_token_ids, tok.pad_token_id, 4)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            {"bad_words_ids": [[1]]},
            "not a key nanogrpo's sampler reads; it reads \\['do_sample', 'min_new_tokens', 'min_p', "
            "'num_beams', 'repetition_penalty', 'stop', 'stop_strings', 'suppress_tokens', "
            "'temperature', 'top_k', 'top_p'\\]",
        ),
        ({"num_beams": 4}, "runs beam sampling; nanogrpo's sampler draws each completion"),
        ({"num_beams": True}, "use 1 or leave it out"),
        ({"do_sample": False}, "training samples: only True"),
        ({"max_new_tokens": 64}, "set max_completion_length"),
        ({"min_tokens": 3}, "use min_new_tokens"),
        ({"temperature": 0}, "training samples, so it must be > 0"),
        ({"top_p": 1.5}, "top_p=1.5: must be in \\(0, 1\\]"),
        ({"top_k": 2.5}, "must be an int >= 0"),
        ({"suppress_tokens": [-1]}, "token ids must be >= 0"),
        ({"suppress_tokens": 7}, "must be a list of int"),
        ({"stop_strings": [""]}, "stop strings must be non-empty"),
        ({"min_new_tokens": -1}, "must be an int >= 0"),
    ],
)
def test_unknown_and_refused_keys_fail_at_config_load(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(generation_kwargs=kwargs).validate()


def test_a_tiny_training_run_samples_with_generation_kwargs(tmp_path, monkeypatch):
    """train.py with --generation_kwargs from the command line: every rollout draws with them
    (the letter h, id 9, never appears; at least 2 tokens before the eos; top_k 5)."""
    from test_train import tiny

    import train

    seen = []

    def recording(model, prompt_ids, settings, *args, **kwargs):
        out = generate(model, prompt_ids, settings, *args, **kwargs)
        seen.append((settings, out))
        return out

    fake = recording
    monkeypatch.setattr(rollout_module, "generate", fake)
    monkeypatch.setattr(tool_rounds, "generate", fake)  # the tool rounds' calls
    cfg = tiny(
        tmp_path, '--generation_kwargs={"suppress_tokens": [9], "min_new_tokens": 2, "top_k": 5}'
    )
    assert cfg.generation_kwargs == {"suppress_tokens": [9], "min_new_tokens": 2, "top_k": 5}
    history = train.train(cfg)
    assert [m["step"] for m in history] == [1, 2, 3] and len(seen) >= 3
    for settings, out in seen:
        assert settings.processors is not None and settings.top_k == 5
        assert not (out.completion_ids[out.completion_mask] == 9).any()
        assert (out.completion_mask.sum(1) >= 3).all()
    with pytest.raises(ConfigError, match="num_beams"):
        tiny(tmp_path, '--generation_kwargs={"num_beams": 2}')


def test_num_beams_1_is_plain_sampling_and_sets_nothing():
    """Regression: generation_kwargs={"num_beams": 1} was refused. It is transformers' default:
    GenerationConfig.get_generation_mode with num_beams 1 and do_sample=True (TRL's) is SAMPLE,
    what nanogrpo's sampler does; num_beams > 1 there is BEAM_SAMPLE, refused above."""
    assert generation_settings({"num_beams": 1, "do_sample": True}) == {}
    assert generation_settings({"num_beams": None, "top_k": 4}) == {"top_k": 4}
    TrainConfig(generation_kwargs={"num_beams": 1}).validate()


def test_generation_settings_reads_none_as_off_and_joins_both_stop_names():
    assert generation_settings(None) == {}
    got = generation_settings(
        {"stop": "x", "stop_strings": ["y", "z"], "top_k": None, "do_sample": None}
    )
    assert got == {"stop_strings": ["x", "y", "z"], "top_k": 0}


def test_a_training_run_stops_at_stop_strings(tmp_path):
    """stop_strings reach the sampler in a real run (the tokenizer decodes the tails): no trained
    completion runs past its first "a"."""
    from test_train import tiny

    import train
    from nanogrpo.rollout import Rollout

    kept = []
    original = train.rollout

    def recording(*args, **kwargs):
        ro = original(*args, **kwargs)
        kept.append(ro)
        return ro

    train.rollout, before = recording, train.rollout
    try:
        train.train(tiny(tmp_path, '--generation_kwargs={"stop_strings": ["a"]}', "--max_steps=2"))
    finally:
        train.rollout = before
    texts = [c for ro in kept for c in ro.completions]
    assert texts and all(isinstance(ro, Rollout) for ro in kept)
    assert all("a" not in t[:-1] for t in texts)  # ends at its first "a", if it has one
    assert any(t.endswith("a") for t in texts)
