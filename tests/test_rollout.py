"""The tool loop of rollout.py on a scripted policy: the sampler is replaced by a script (`generate`
monkeypatched) that answers every row from its context, so masks, budgets and failures can be checked token
by token."""

import json
import os
import string
import sys

import pytest
import torch
from conftest import fixture_path, tiny_config

from nanogrpo import rollout as rollout_module
from nanogrpo.extras import tool_rounds
from nanogrpo.extras.generation_kwargs import sampling_of
from nanogrpo.extras.tool_rounds import ToolTurns, tool_rules
from nanogrpo.extras.tools import resolve_tools, tool_schema, tool_suffix_ids
from nanogrpo.model import Transformer
from nanogrpo.rollout import rollout
from nanogrpo.run.config import TrainConfig
from nanogrpo.sampler import Generation
from nanogrpo.tokenizer import char_level_tokenizer

sys.path.insert(0, fixture_path("tools"))
import signatures  # noqa: E402
from test_tools import add, boom, sleepy, slow_add  # noqa: E402

EXPECTED = json.load(open(os.path.join(fixture_path("tools"), "expected.json")))
TEMPLATE = open(os.path.join(fixture_path("tools"), "hermes_chatml.jinja")).read()
QWEN3 = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "real", "tokenizer-qwen3"
)
SCHEMAS = [signatures.multiply, signatures.search]


# --- the loop, on a scripted policy ------------------------------------------------------------

CALL = '<tool_call>{{"name": "{}", "arguments": {}}}</tool_call>'
FIRST = {  # (question, sample) -> the first turn
    ("mul", 0): CALL.format("add", '{"a": 40, "b": 2}'),
    ("mul", 1): "I know: 42",
    ("bad", 0): "Hm" + CALL.format("boom", '{"a": 1}') + CALL.format("sleepy", '{"seconds": 30}'),
    ("bad", 1): CALL.format("nope", "{}"),
    # blocks that are not calls: the turn is plain text and the completion ends (TRL)
    ("oops", 0): 'Hm<tool_call>{"name": "add", "arguments": {"a": 6,</tool_call>',
    ("oops", 1): CALL.format("add", '{"a": 1, "b": 2}')
    + '<tool_call>{"arguments": {}}</tool_call>',
}
AFTER = {  # the last tool result -> the next turn
    "42": "Then" + CALL.format("slow_add", '{"a": 42, "b": 3}'),
    "45": "Answer 45",
    "{'error': 'timed out after 0.2 s'}": "Sorry",
    "{'error': 'Tool nope not found.'}": "ok",
}


def how(cfg, tok, G, seed):
    """rollout's keyword arguments: G completions each, the config's sampler settings, prompt
    encoding and truncation rule, a seeded generator."""
    return dict(
        num_generations=G,
        settings=sampling_of(cfg, tok),
        encode=dict(max_length=cfg.max_prompt_length, **(cfg.chat_template_kwargs or {})),
        mask_truncated_completions=cfg.mask_truncated_completions,
        generator=torch.Generator().manual_seed(seed),
    )


def chat_tokenizer():
    tok = char_level_tokenizer(string.printable)
    tok.chat_template = TEMPLATE
    return tok


def scripted_generate(tok, log):
    """A stand-in for sampler.generate that writes the scripted turns (then the eos) for every row."""
    eos = tok.eos_token_id

    def generate(model, prompt_ids, settings, num_samples=1, generator=None, seeds=None):
        max_new_tokens = settings.max_new_tokens
        log.append(
            {
                "rows": len(prompt_ids) * num_samples,
                "max_new_tokens": max_new_tokens,
                "seeds": seeds,
            }
        )
        rows = []
        for p in prompt_ids:
            context = tok.decode(p, skip_special_tokens=False)
            for j in range(num_samples):
                if "<|im_start|>tool" not in context:
                    question = context.split("<|im_start|>user\n")[1].split("<|endoftext|>")[0]
                    text = FIRST[(question, j)]
                else:
                    text = AFTER[context.split("<|im_start|>tool\n")[-1].split("<|endoftext|>")[0]]
                rows.append(tok.encode(text, add_special_tokens=False) + [eos])
        C = max_new_tokens if any(len(r) > max_new_tokens for r in rows) else max(map(len, rows))
        ids = torch.full((len(rows), C), settings.pad_id)
        mask = torch.zeros(len(rows), C, dtype=torch.bool)
        for i, r in enumerate(rows):
            ids[i, : min(len(r), C)] = torch.tensor(r[:C])
            mask[i, : min(len(r), C)] = True
        truncated = torch.tensor([len(r) > C for r in rows])
        return Generation(ids, mask, torch.zeros(len(rows), C), truncated)

    return generate


def run_script(
    monkeypatch, questions=("mul", "bad"), tools=(add, boom, slow_add, sleepy), **overrides
):
    tok, log = chat_tokenizer(), []
    fake = scripted_generate(tok, log)
    monkeypatch.setattr(rollout_module, "generate", fake)
    monkeypatch.setattr(tool_rounds, "generate", fake)  # the tool rounds' calls
    cfg = TrainConfig(**{"max_completion_length": 1000, "tool_timeout": 0.2, **overrides})
    model = Transformer(tiny_config(vocab_size=tok.vocab_size, max_position_embeddings=4096))
    rows = [{"prompt": [{"role": "user", "content": q}]} for q in questions]
    tools = resolve_tools(list(tools))
    return (
        tok,
        rollout(
            model, tok, rows, **how(cfg, tok, 2, 0), turns=ToolTurns(tools, rules=tool_rules(cfg))
        ),
        log,
    )


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]


def reply(name, content):
    return {"role": "tool", "name": name, "content": content}


def test_two_call_conversation(monkeypatch):
    tok, ro, log = run_script(monkeypatch)
    # row 0: add (sync) -> slow_add (async) -> answer; its ids are the turns and the tool results between them
    turn1, turn2, turn3 = enc(tok, FIRST[("mul", 0)]), enc(tok, AFTER["42"]), enc(tok, AFTER["45"])
    res1, res2 = (
        tool_suffix_ids(tok, [reply("add", "42")]),
        tool_suffix_ids(tok, [reply("slow_add", "45")]),
    )
    assert ro.completion_token_ids[0] == turn1 + res1 + turn2 + res2 + turn3
    C = ro.completion_mask.shape[1]
    expected_mask = (
        [1] * len(turn1) + [0] * len(res1) + [1] * len(turn2) + [0] * len(res2) + [1] * len(turn3)
    )
    assert ro.completion_mask[0].tolist() == expected_mask + [0] * (C - len(expected_mask))
    assert ro.completion_lengths[0] == len(turn1) + len(turn2) + len(turn3)  # model tokens only
    P = ro.input_ids.shape[1] - C  # the log-prob pass sees exactly the sampled sequence
    assert (
        ro.input_ids[0, P : P + len(ro.completion_token_ids[0])].tolist()
        == ro.completion_token_ids[0]
    )
    assert ro.attention_mask[0, P:].all()
    add_call = {"type": "function", "function": {"name": "add", "arguments": {"a": 40, "b": 2}}}
    slow_call = {
        "type": "function",
        "function": {"name": "slow_add", "arguments": {"a": 42, "b": 3}},
    }
    assert ro.completions[0] == [
        {"role": "assistant", "content": "", "tool_calls": [add_call]},
        reply("add", "42"),
        {"role": "assistant", "content": "Then", "tool_calls": [slow_call]},
        reply("slow_add", "45"),
        {"role": "assistant", "content": "Answer 45"},
    ]
    # the whole sequence is what the chat template makes of the conversation (TRL's prefix-preserving contract)
    prompt = [{"role": "user", "content": "mul"}]
    schemas = [tool_schema(f) for f in (add, boom, slow_add, sleepy)]
    full = tok.encode(
        tok.apply_chat_template(
            prompt + ro.completions[0], tools=schemas, add_generation_prompt=False
        ),
        add_special_tokens=False,
    )
    assert full[: len(ro.prompt_ids[0])] == ro.prompt_ids[0]
    assert full[len(ro.prompt_ids[0]) :] == ro.completion_token_ids[0] + tok.encode(
        "\n", add_special_tokens=False
    )
    # row 1: no call. Rows 2-3: an exception + a timeout, then an unknown tool
    assert ro.completions[1] == [{"role": "assistant", "content": "I know: 42"}]
    raised, timed_out = (m["content"] for m in ro.completions[2][1:3])
    assert (raised, timed_out) == ("{'error': 'boom 1'}", "{'error': 'timed out after 0.2 s'}")
    assert ro.completions[2][-1] == {"role": "assistant", "content": "Sorry"}
    assert ro.completions[3][-1] == {"role": "assistant", "content": "ok"}
    assert ro.tool_calls.tolist() == [2, 0, 2, 1] and ro.tool_failures.tolist() == [0, 0, 2, 1]
    assert ro.turns.tolist() == [3, 1, 2, 2] and not ro.truncated.any()
    # batched: round 1 continues rows 0, 2, 3 together, round 2 only row 0; each with its own seed
    assert [(x["rows"], x["seeds"] is None) for x in log] == [(4, True), (3, False), (1, False)]


def test_a_turn_with_a_block_that_is_not_a_call_ends_the_completion(monkeypatch):
    """TRL reads such a turn as plain text (its parse_response falls back to the decoded text):
    the text stays as the model wrote it, no tool runs (not even a well-formed call beside it),
    nothing counts as a call or a failure, so tools/failure_frequency is TRL's, and the
    completion ends after that turn."""
    from nanogrpo.distributed import DistInfo
    from nanogrpo.run.report import tool_metrics

    tok, ro, log = run_script(monkeypatch, questions=("oops", "mul"))
    for r in (0, 1):
        text = FIRST[("oops", r)]
        assert ro.completions[r] == [{"role": "assistant", "content": text}]
        assert ro.completion_token_ids[r] == enc(tok, text)
    assert ro.tool_calls.tolist() == [0, 0, 2, 0] and ro.tool_failures.tolist() == [0, 0, 0, 0]
    assert ro.turns.tolist() == [1, 1, 3, 1] and not ro.truncated.any()
    assert tool_metrics(ro, DistInfo())["tools/failure_frequency"] == 0.0
    assert [x["rows"] for x in log] == [4, 1, 1]  # only the "mul" row that called goes on


def test_a_tool_that_returns_an_image_is_refused(monkeypatch):
    """TRL passes a tool's multimodal content blocks to a vision model; nanogrpo's models read
    text only, and str() would show the model the list's repr: one error naming the tool."""

    def add(a: int, b: int) -> list:  # the scripted first turn calls "add"
        """Add, and show the sum as a picture.

        Args:
            a: First.
            b: Second.
        """
        return [{"type": "image", "image": "sum.png"}, {"type": "text", "text": str(a + b)}]

    with pytest.raises(ValueError, match="tool add returned an image.*text-only"):
        run_script(monkeypatch, questions=("mul",), tools=(add,))


def test_max_tool_calling_iterations(monkeypatch):
    tok, ro, log = run_script(monkeypatch, max_tool_calling_iterations=1)
    assert len(log) == 2  # one tool round: row 0's second call is left unanswered (TRL)
    assert ro.completions[0][-1]["tool_calls"][0]["function"]["name"] == "slow_add"
    assert ro.tool_calls.tolist() == [1, 0, 2, 1] and ro.turns.tolist() == [2, 1, 2, 2]


def test_budget_drops_a_round_of_results(monkeypatch):
    """The results of row 0's first call do not fit: dropped, the row ends with its first turn (not truncated)."""
    tok = chat_tokenizer()
    n1 = len(enc(tok, FIRST[("mul", 0)])) + len(tool_suffix_ids(tok, [reply("add", "42")]))
    _, ro, log = run_script(monkeypatch, max_completion_length=n1 - 1)
    assert ro.completion_token_ids[0] == enc(tok, FIRST[("mul", 0)]) and len(ro.completions[0]) == 1
    assert not ro.truncated[0] and ro.tool_calls[0] == 1  # the call was made and counted, as in TRL
    assert all(len(ids) <= n1 - 1 for ids in ro.completion_token_ids)


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_budget_cuts_the_continuation(monkeypatch, mask_truncated):
    tok = chat_tokenizer()
    n1 = len(enc(tok, FIRST[("mul", 0)])) + len(tool_suffix_ids(tok, [reply("add", "42")]))
    _, ro, log = run_script(
        monkeypatch, max_completion_length=n1 + 3, mask_truncated_completions=mask_truncated
    )
    assert (
        len(ro.completion_token_ids[0]) == n1 + 3 and ro.truncated[0]
    )  # 3 model tokens after the results
    assert ro.completion_token_ids[0][-3:] == enc(tok, AFTER["42"])[:3]
    assert ro.completion_lengths[0] == n1 + 3 - len(tool_suffix_ids(tok, [reply("add", "42")]))
    assert ro.completion_mask[0].sum() == (0 if mask_truncated else ro.completion_lengths[0])


def test_tools_need_conversational_prompts(monkeypatch):
    tok = chat_tokenizer()
    model = Transformer(tiny_config(vocab_size=tok.vocab_size))
    with pytest.raises(ValueError, match="conversational prompts"):
        rollout(
            model,
            tok,
            [{"prompt": "mul"}],
            **how(TrainConfig(), tok, 2, 0),
            turns=ToolTurns(resolve_tools([add])),
        )


def test_logprobs_and_update_run_on_a_tool_rollout(monkeypatch):
    """The trainer's log-prob pass and a GRPO step take the rollout as it is; tool tokens get no gradient."""
    from nanogrpo.fast.logprobs import token_logprobs
    from nanogrpo.grpo import LossConfig, LossInputs, LossScale, grpo_step

    tok, ro, _ = run_script(monkeypatch)
    model = Transformer(
        tiny_config(vocab_size=tok.vocab_size, max_position_embeddings=4096, num_hidden_layers=1)
    )
    rows = [0, 1]  # the first prompt's two rows: one with two tool rounds, one without
    mask = ro.completion_mask[rows]
    cols = slice(
        -mask.shape[1] - 8, None
    )  # the prompt's tail is context enough here (and keeps the test fast)
    logps, _ = token_logprobs(model, ro.input_ids[rows, cols], ro.attention_mask[rows, cols], mask)
    logps.retain_grad()
    inputs = LossInputs(logps=logps, advantages=torch.tensor([1.0, -1.0]), completion_mask=mask)
    loss, _ = grpo_step(inputs, LossConfig(loss_type="dapo"), LossScale(num_items=mask.sum()))
    loss.backward()
    assert (logps.grad[mask == 0] == 0).all() and (logps.grad[mask == 1] != 0).all()


# --- the sampler's log-probs reach the Rollout -------------------------------------------------


def test_sampling_logps_are_the_generations_logprobs():
    """Without tools, sampling_logps is generate's own `logprobs` for the same seeds."""
    from nanogrpo.sampler import generate

    tok = chat_tokenizer()
    model = Transformer(tiny_config(vocab_size=tok.vocab_size))
    cfg = TrainConfig(max_completion_length=16, temperature=0.7, top_k=5, top_p=0.9)
    rows = [{"prompt": "abc"}, {"prompt": "hello world"}]
    ro = rollout(model, tok, rows, **how(cfg, tok, 3, 0))
    gen = torch.Generator().manual_seed(0)
    out = generate(model, ro.prompt_ids, sampling_of(cfg, tok), num_samples=3, generator=gen)
    assert torch.equal(ro.input_ids[:, -out.completion_ids.shape[1] :], out.completion_ids)
    assert ro.sampling_logps.dtype == torch.float32
    assert torch.equal(ro.sampling_logps, out.logprobs)
    assert (ro.sampling_logps[ro.completion_mask == 0] == 0).all()
    assert (ro.sampling_logps[ro.completion_mask == 1] < 0).all()


def sampled_after_tools(tok, temperature):
    """A stand-in for sampler.generate: the first call writes the scripted first turns (so that rows
    call tools) with the model's log-probs of them; the tool rounds' calls (they pass seeds) are the
    real sampler's."""
    from nanogrpo import sampler
    from nanogrpo.fast.logprobs import token_logprobs
    from nanogrpo.rollout import join_prompt_completion

    script = scripted_generate(tok, [])

    def generate(model, prompt_ids, settings, num_samples=1, generator=None, seeds=None):
        if seeds is not None:
            return sampler.generate(model, prompt_ids, settings, num_samples, generator, seeds)
        out = script(model, prompt_ids, settings, num_samples)
        pad = settings.pad_id
        ids, attention = join_prompt_completion(prompt_ids, out.completion_ids, pad, num_samples)
        mask = out.completion_mask
        logps, _ = token_logprobs(model, ids, attention, mask, temperature=temperature)
        return Generation(out.completion_ids, out.completion_mask, logps, out.truncated)

    return generate


def test_sampling_logps_through_tool_rounds(monkeypatch):
    """With tools: model tokens carry their sampler log-prob (nonzero, finite), tool-result ids 0,
    and each row's list stays aligned with its ids through the rounds and the cut to
    max_completion_length: on fp32 CPU without filters every sampled token's log-prob is the
    trainer's (the first turns are scripted, their log-probs the model's by construction; what is
    tested is the later rounds, sampled for real after the tool results)."""
    from nanogrpo.fast.logprobs import token_logprobs

    tok, T = chat_tokenizer(), 0.7
    fake = sampled_after_tools(tok, T)
    monkeypatch.setattr(rollout_module, "generate", fake)
    monkeypatch.setattr(tool_rounds, "generate", fake)  # the tool rounds' calls
    nope = "{'error': 'Tool nope not found.'}"
    calls = [(0, ("mul", 0), "add", "42"), (3, ("bad", 1), "nope", nope)]
    lengths = {
        r: len(enc(tok, FIRST[key])) + len(tool_suffix_ids(tok, [reply(name, res)]))
        for r, key, name, res in calls
    }  # each calling row's first turn and results
    M = max(lengths.values()) + 10  # both rows' results fit; the longer row has room for 10 tokens
    cfg = TrainConfig(max_completion_length=M, tool_timeout=0.2, temperature=T, top_k=0, top_p=1.0)
    model = Transformer(tiny_config(vocab_size=tok.vocab_size, max_position_embeddings=4096))
    rows = [{"prompt": [{"role": "user", "content": q}]} for q in ("mul", "bad")]
    tools = resolve_tools([add, boom, slow_add, sleepy])
    turns = ToolTurns(tools, rules=tool_rules(cfg))
    ro = rollout(model, tok, rows, **how(cfg, tok, 2, 0), turns=turns)
    mask = ro.completion_mask  # [n,C] the model's tokens (mask_truncated_completions is off)
    assert ro.sampling_logps.shape == mask.shape and ro.sampling_logps.dtype == torch.float32
    for r, n in lengths.items():  # a round of tool results, then the sampler's continuation
        assert len(ro.completion_token_ids[r]) > n and mask[r, :n].min() == 0
    cut = max(lengths, key=lengths.get)
    assert len(ro.completion_token_ids[cut]) == M and ro.truncated[cut]  # cut at M
    assert torch.isfinite(ro.sampling_logps).all()
    assert (ro.sampling_logps[mask == 1] < 0).all() and (ro.sampling_logps[mask == 0] == 0).all()
    trainer, _ = token_logprobs(model, ro.input_ids, ro.attention_mask, mask, temperature=T)
    assert (trainer - ro.sampling_logps).abs().max() < 1e-4


# --- picking groups and joining rollouts (dynamic sampling) ----------------------------------


def tiny_rollout(prompts, max_completion_length, G=2, seed=0):
    """A real rollout of plain-text `prompts` by a tiny random model (seeded: the same model for
    every call), and that model."""
    tok = chat_tokenizer()
    torch.manual_seed(0)
    model = Transformer(tiny_config(vocab_size=tok.vocab_size))
    cfg = TrainConfig(max_completion_length=max_completion_length, temperature=0.7)
    rows = [{"prompt": p} for p in prompts]
    return tok, model, rollout(model, tok, rows, **how(cfg, tok, G, seed))


def assert_same_rollout(a, b):
    """Every field equal (tensors: same dtype, shape and values)."""
    import dataclasses

    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), f.name
        else:
            assert x == y, f.name


def unpadded(ro, r):
    """Row r of a rollout without its padding: (prompt ids, completion ids, completion_mask and
    sampling_logps up to the row's end)."""
    C = ro.completion_mask.shape[1]
    n = len(ro.completion_token_ids[r])
    prompt = ro.input_ids[r, :-C][ro.attention_mask[r, :-C] == 1].tolist()
    completion = ro.input_ids[r, -C:][:n].tolist()
    return prompt, completion, ro.completion_mask[r, :n], ro.sampling_logps[r, :n]


def test_concat_rollouts_repads_and_scores_the_same():
    from nanogrpo.extras.dynamic_sampling import concat_rollouts
    from nanogrpo.fast.logprobs import token_logprobs

    tok, model, short = tiny_rollout(["ab", "hello"], 8)
    _, _, long = tiny_rollout(["a much longer prompt, this one"], 20, seed=1)
    assert short.input_ids.shape[1] - 8 < long.input_ids.shape[1] - 20  # widths differ: prompts
    assert short.completion_mask.shape[1] == 8 and long.completion_mask.shape[1] == 20  # and C
    both = concat_rollouts([short, long], tok.pad_token_id)
    P, C = len(long.prompt_ids[0]), 20
    assert both.input_ids.shape == (6, P + C) and both.completion_mask.shape == (6, C)
    originals = [(short, r) for r in range(4)] + [(long, r) for r in range(2)]
    for k, (ro, r) in enumerate(originals):
        for x, y in zip(unpadded(both, k), unpadded(ro, r)):
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        n = len(ro.completion_token_ids[r])
        assert (both.input_ids[k, P + n :] == tok.pad_token_id).all()
        assert both.attention_mask[k, P:].all()  # every completion slot, as join_prompt_completion
        assert not both.completion_mask[k, n:].any() and not both.sampling_logps[k, n:].any()
        for name in ("prompts", "completions", "completion_token_ids"):
            assert getattr(both, name)[k] == getattr(ro, name)[r]
        assert both.completion_lengths[k] == ro.completion_lengths[r]
        assert both.truncated[k] == ro.truncated[r]
    assert both.rows == short.rows + long.rows
    assert both.prompt_ids == short.prompt_ids + long.prompt_ids
    assert both.num_tokens() == short.num_tokens() + long.num_tokens()
    # padding changes nothing that is scored
    joined, _ = token_logprobs(model, both.input_ids, both.attention_mask, both.completion_mask)
    for rows, ro in ((slice(0, 4), short), (slice(4, 6), long)):
        alone, _ = token_logprobs(model, ro.input_ids, ro.attention_mask, ro.completion_mask)
        W = alone.shape[1]
        assert torch.allclose(joined[rows, :W], alone, atol=1e-5, rtol=0)
        assert not joined[rows, W:].any()


def test_concat_of_one_rollout_is_that_rollout():
    from nanogrpo.extras.dynamic_sampling import concat_rollouts

    tok, _, ro = tiny_rollout(["ab", "hello"], 8)
    assert_same_rollout(concat_rollouts([ro], tok.pad_token_id), ro)


def test_select_groups_takes_the_groups_rows():
    from nanogrpo.extras.dynamic_sampling import select_groups

    _, _, ro = tiny_rollout(["ab", "hello", "xyz!"], 6, G=3)
    one = select_groups(ro, [1])
    rows = slice(3, 6)  # group 1: rows G .. 2G-1
    tensors = ["input_ids", "attention_mask", "completion_mask", "completion_lengths"]
    for name in tensors + ["truncated", "sampling_logps"]:
        assert torch.equal(getattr(one, name), getattr(ro, name)[rows]), name
    for name in ("prompts", "completions", "completion_token_ids"):
        assert getattr(one, name) == getattr(ro, name)[rows], name
    assert one.rows == [ro.rows[1]] and one.prompt_ids == [ro.prompt_ids[1]] and one.turns is None
    assert one.num_generations == 3 and one.num_tokens() == len(ro.prompt_ids[1]) * 3 + int(
        ro.completion_lengths[rows].sum()
    )
    # in the order given
    assert select_groups(ro, [2, 0]).prompts == ro.prompts[6:] + ro.prompts[:3]


def test_split_and_joined_tool_rollout_has_the_same_rows(monkeypatch):
    """A tool rollout's groups picked apart and joined again: the same rows (turns and tool counts
    included), the same widths. A picked group counts its own completions' calls only."""
    from nanogrpo.extras.dynamic_sampling import concat_rollouts, select_groups

    tok, ro, _ = run_script(monkeypatch)
    again = concat_rollouts([select_groups(ro, [0]), select_groups(ro, [1])], tok.pad_token_id)
    assert_same_rollout(again, ro)
    second = select_groups(ro, [1])
    assert second.tool_calls.tolist() == [2, 1] and second.tool_failures.tolist() == [2, 1]


def test_select_and_concat_refuse():
    from nanogrpo.extras.dynamic_sampling import concat_rollouts, select_groups

    tok, _, ro = tiny_rollout(["ab", "hello"], 6)
    _, _, three = tiny_rollout(["ab"], 6, G=3)
    with pytest.raises(ValueError, match="num_generations"):
        concat_rollouts([ro, three], tok.pad_token_id)
    with pytest.raises(ValueError, match="at least one"):
        concat_rollouts([], tok.pad_token_id)
    with pytest.raises(ValueError, match="group 2"):
        select_groups(ro, [2])
    ro.advantages = torch.zeros(4)
    with pytest.raises(ValueError, match="advantages is set"):
        select_groups(ro, [0])
    with pytest.raises(ValueError, match="advantages is set"):
        concat_rollouts([ro], tok.pad_token_id)


def test_a_rollout_without_tools_joins_with_no_calls_and_one_turn_a_row(monkeypatch):
    from nanogrpo.extras.dynamic_sampling import concat_rollouts

    _, _, plain = tiny_rollout(["ab", "hello"], 6)
    tok, tools, _ = run_script(monkeypatch)  # a scripted sampler from here on
    assert plain.tool_calls is None and plain.tool_failures is None and plain.turns is None
    both = concat_rollouts([tools, plain], tok.pad_token_id)
    assert both.tool_calls.tolist() == tools.tool_calls.tolist() + [0] * 4
    assert both.tool_failures.tolist() == tools.tool_failures.tolist() + [0] * 4
    assert both.turns.tolist() == tools.turns.tolist() + [1] * 4
    assert concat_rollouts([plain], tok.pad_token_id).tool_calls is None


def test_an_error_while_sampling_or_scoring_gives_the_model_its_training_mode_back(monkeypatch):
    """rollout, frozen_logprobs and a rollout_func run the model in eval mode; an error inside
    (a tool, a reward model, the user's rollout_func) leaves it training, as it was. And train.py's
    reward_rollout scores with TRL's reward arguments without a RewardLogs to log into."""
    from types import SimpleNamespace

    import train
    from nanogrpo.extras.custom_rollout import custom_rollout
    from nanogrpo.logprobs import frozen_logprobs
    from nanogrpo.rewards import score_rollout

    tok = chat_tokenizer()
    model = Transformer(tiny_config(vocab_size=tok.vocab_size)).train()

    def broken(*args, **kwargs):
        assert not model.training
        raise RuntimeError("broken")

    monkeypatch.setattr(rollout_module, "generate", broken)
    with pytest.raises(RuntimeError, match="broken"):
        rollout(model, tok, [{"prompt": "mul"}], **how(TrainConfig(), tok, 2, 0))
    assert model.training
    ones = torch.ones(2, 3, dtype=torch.long)
    ro = SimpleNamespace(input_ids=ones, attention_mask=ones, completion_mask=ones)
    with pytest.raises(RuntimeError, match="broken"):
        frozen_logprobs(model, ro, 1, score=broken)
    assert model.training
    t = SimpleNamespace(
        model=model,
        tok=tok,
        cfg=TrainConfig(),
        rollout_func=broken,
        autocast=torch.autocast("cpu", enabled=False),
    )
    with pytest.raises(RuntimeError, match="broken"):
        custom_rollout(t, [{"prompt": "mul"}], 2, None)
    assert model.training
    seen = []

    def logs_extra(completions, trainer_state, log_extra, log_metric, **kwargs):
        log_extra("length", [len(c) for c in completions])
        log_metric("calls", 1)
        seen.append(trainer_state.global_step)
        return [1.0] * len(completions)

    t.state = SimpleNamespace(global_step=7)
    monkeypatch.setattr(train, "score_rollout", score_rollout)
    ro = SimpleNamespace(
        num_generations=1,
        rows=[{"prompt": "a"}],
        extra_fields=None,
        prompts=["a"],
        completions=["xy"],
        completion_token_ids=[[1, 2]],
    )
    assert train.reward_rollout(ro, [("logs_extra", logs_extra)], t).tolist() == [[1.0]]
    assert seen == [7]
