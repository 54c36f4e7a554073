"""Dataset loading (local files in both prompt formats), row checks, procedural tasks, PromptSampler resume."""

import json

import pytest

from nanogrpo.data import PromptSampler, check_rows, columns_of, is_conversational
from nanogrpo.extras.builtin_rewards import check_equation
from nanogrpo.extras.datasets import load_dataset, read_rows
from nanogrpo.extras.reward_funcs import resolve_reward_funcs
from nanogrpo.extras.tasks import (
    DEFAULT_TASK_CHARS,
    addition,
    countdown,
    gsm8k_rows,
    make_default_task,
)
from nanogrpo.rewards import score_completions

STANDARD = [
    {"prompt": "2+2=", "answer": "4", "level": 1},
    {"prompt": "3*3=", "answer": "9", "level": 2},
]
CONVERSATIONAL = [
    {
        "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}],
        "answer": "4",
    }
]


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    return str(path)


def test_jsonl_and_json_files(tmp_path):
    rows = load_dataset(write_jsonl(tmp_path / "d.jsonl", STANDARD))
    assert rows == STANDARD and not is_conversational(rows[0])
    (tmp_path / "rows.json").write_text(json.dumps(CONVERSATIONAL))
    assert is_conversational(load_dataset(str(tmp_path / "rows.json"))[0])
    columns = {"prompt": ["a", "b"], "answer": ["1", "2"]}
    (tmp_path / "cols.json").write_text(json.dumps(columns))
    assert load_dataset(str(tmp_path / "cols.json")) == [
        {"prompt": "a", "answer": "1"},
        {"prompt": "b", "answer": "2"},
    ]
    assert len(load_dataset(write_jsonl(tmp_path / "d.jsonl", STANDARD), num_rows=1)) == 1


def test_parquet(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(STANDARD), str(tmp_path / "d.parquet"))
    assert load_dataset(str(tmp_path / "d.parquet")) == STANDARD


def test_extra_columns_reach_reward_functions(tmp_path):
    rows = load_dataset(write_jsonl(tmp_path / "d.jsonl", STANDARD))
    seen = {}

    def spy(prompts, completions, answer, level, **kwargs):
        seen.update(prompts=prompts, level=level)
        return [1.0] * len(completions)

    G = 2
    columns = {k: [v for v in vals for _ in range(G)] for k, vals in columns_of(rows).items()}
    assert list(columns) == ["answer", "level"]
    prompts = [r["prompt"] for r in rows for _ in range(G)]
    r = score_completions(
        resolve_reward_funcs(["accuracy", spy]),
        prompts,
        ["4", "5", "9", "\\boxed{9}"],
        None,
        columns,
    )
    assert r[:, 0].tolist() == [1, 0, 1, 1]
    assert seen == {"prompts": ["2+2=", "2+2=", "3*3=", "3*3="], "level": [1, 1, 2, 2]}


def test_columns_of_fills_missing_keys():
    assert columns_of([{"prompt": "a", "x": 1}, {"prompt": "b", "y": 2}]) == {
        "x": [1, None],
        "y": [None, 2],
    }


def test_row_errors(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok"}, {"question": "q", "answer": "a"}])
    with pytest.raises(
        ValueError,
        match=r"bad\.jsonl, row 1: no 'prompt' column \(found \['answer', 'question'\]\)",
    ):
        load_dataset(path)
    with pytest.raises(ValueError, match="mixes standard"):
        check_rows([STANDARD[0], CONVERSATIONAL[0]], "x")
    with pytest.raises(ValueError, match="row 0: 'prompt' must be"):
        check_rows([{"prompt": [{"text": "hi"}]}], "x")
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(ValueError, match="line 2"):
        read_rows(str(tmp_path / "broken.jsonl"))
    with pytest.raises(ValueError, match="not a file"):
        load_dataset(str(tmp_path / "missing.jsonl"))


def test_gsm8k_rows():
    [row] = gsm8k_rows([{"question": "How many?", "answer": "3 + 4 = 7\n#### 1,007"}])
    assert row["answer"] == "1007"
    assert [m["role"] for m in row["prompt"]] == ["system", "user"] and row["prompt"][1][
        "content"
    ] == "How many?"
    assert "\\boxed" in row["prompt"][0]["content"]


def test_default_task():
    rows = load_dataset("default", num_rows=50, seed=3)
    assert rows == make_default_task(50, 3) and rows != load_dataset(
        "default", split="test", num_rows=50, seed=3
    )
    for row in rows:
        assert row["prompt"] == row["target"] + "=" and set(row["prompt"]) <= set(
            DEFAULT_TASK_CHARS
        )
    assert (
        make_default_task(1, 0, reverse=True)[0]["target"]
        == make_default_task(1, 0)[0]["target"][::-1]
    )


def test_countdown_rows_are_solvable():
    rows = countdown(40, seed=0)
    assert rows == countdown(40, seed=0) and is_conversational(rows[0])
    for row in rows:
        assert (
            3 <= len(row["nums"]) <= 4
            and all(1 <= n <= 100 for n in row["nums"])
            and row["target"] > 0
        )
        assert check_equation(row["equation"], row["nums"], row["target"])
        assert (
            str(row["target"]) in row["prompt"][0]["content"]
            and "<answer>" in row["prompt"][0]["content"]
        )
    assert isinstance(countdown(1, 0, conversational=False)[0]["prompt"], str)


def addition_pair(row):
    a, b = row["prompt"][-1]["content"].removeprefix("What is ").removesuffix("?").split(" + ")
    return int(a), int(b)


def test_addition_answers_and_held_out_split():
    train_rows = load_dataset("addition", seed=5)
    test_rows = load_dataset("addition", split="test", seed=5)
    assert train_rows == addition(10_000, 5) and train_rows != addition(
        10_000, 6
    )  # deterministic, seeded
    assert len(test_rows) == 128 and test_rows == addition(128, 5, split="test")
    for row in train_rows[:500] + test_rows:
        a, b = addition_pair(row)
        assert 1 <= a <= 25 and 1 <= b <= 25 and row["answer"] == str(a + b)
        assert row["prompt"][0]["role"] == "system" and is_conversational(row)
    seen = {frozenset(addition_pair(r)) for r in train_rows}
    held_out = {frozenset(addition_pair(r)) for r in addition(1000, 0, split="test")}
    assert (
        not seen & held_out and len(seen) + len(held_out) == 25 * 26 // 2
    )  # disjoint, and every pair somewhere
    assert (
        len({addition_pair(r) for r in test_rows}) == 128
    )  # the eval prompts are distinct problems
    assert held_out == {
        frozenset(addition_pair(r)) for r in addition(1000, 9, split="test")
    }  # seed-independent
    scores = score_completions(
        resolve_reward_funcs(["accuracy"]),
        [r["prompt"] for r in test_rows[:2]],
        [[{"role": "assistant", "content": f"{sum(addition_pair(r))}"}] for r in test_rows[:2]],
        None,
        columns_of(test_rows[:2]),
    )
    assert scores[:, 0].tolist() == [1.0, 1.0]


def test_prompt_sampler_epochs_and_resume():
    rows = [{"prompt": str(i)} for i in range(10)]
    uninterrupted = PromptSampler(rows, 3, seed=7)
    batches = [[r["prompt"] for r in uninterrupted.next_batch()] for _ in range(8)]
    first_epoch = [p for b in batches[:3] for p in b]
    assert len(set(first_epoch)) == 9  # 3 batches of 3, one row left over
    assert batches[:3] != batches[3:6]  # reshuffled per epoch

    sampler = PromptSampler(rows, 3, seed=7)
    for _ in range(4):  # stop mid-epoch 1
        sampler.next_batch()
    state = sampler.state_dict()
    resumed = PromptSampler(rows, 3, seed=7)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert [[r["prompt"] for r in resumed.next_batch()] for _ in range(4)] == batches[4:]
    with pytest.raises(ValueError, match="the dataset has 11 rows, the checkpoint's run had 10"):
        PromptSampler(rows + [{"prompt": "x"}], 3).load_state_dict(state)
    with pytest.raises(ValueError, match="prompts per generation round"):
        PromptSampler(rows, 11)


def test_prompts_are_checked_at_load():
    from nanogrpo.data import check_prompts
    from nanogrpo.tokenizer import char_level_tokenizer

    tok = char_level_tokenizer("abcdefgh=")
    check_prompts(
        [{"prompt": "abc="}, {"prompt": [{"role": "user", "content": "ab="}]}][:1], "x", tok, 8
    )
    with pytest.raises(
        ValueError, match=r"dataset x, row 1: the tokenizer has no token for \['z'\]"
    ):
        check_prompts(
            [{"prompt": "abc="}, {"prompt": "abz="}], "x", tok, 8
        )  # z used to become eos silently
    with pytest.raises(ValueError, match="row 0: the prompt is 9 tokens, more than the 8"):
        check_prompts([{"prompt": "abcdefgh="}], "x", tok, 8)
    for empty in ("", "  ", [{"role": "user", "content": ""}]):
        with pytest.raises(ValueError, match="row 1: the prompt is empty"):
            check_rows(
                [
                    {"prompt": "a"}
                    if isinstance(empty, str)
                    else {"prompt": [{"role": "user", "content": "a"}]},
                    {"prompt": empty},
                ],
                "x",
            )


def test_a_tool_prompt_is_measured_with_its_tool_schemas():
    """The rollout renders tool schemas into the chat template: a prompt that fits without them but not with
    them must stop the run at load, not mid-run."""
    import os
    import string

    from conftest import fixture_path

    from nanogrpo.data import check_prompts
    from nanogrpo.extras.tools import tool_schema
    from nanogrpo.tokenizer import char_level_tokenizer

    def multiply(a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: the first factor
            b: the second factor
        """
        return a * b

    tok = char_level_tokenizer(string.printable)
    tok.chat_template = open(os.path.join(fixture_path("tools"), "hermes_chatml.jinja")).read()
    rows = [{"prompt": [{"role": "user", "content": "What is 12 * 34?"}]}]
    schemas = [tool_schema(multiply)]
    plain = len(tok.encode_prompt(rows[0]["prompt"]))
    with_tools = len(tok.encode_prompt(rows[0]["prompt"], tools=schemas))
    assert with_tools > plain
    check_prompts(rows, "x", tok, plain)  # fits without the schemas
    with pytest.raises(
        ValueError, match=f"row 0: the prompt is {with_tools} tokens, more than the {plain}"
    ):
        check_prompts(rows, "x", tok, plain, tools=schemas)


def test_shuffle_dataset_false_keeps_the_file_order():
    """TRL's shuffle_dataset=False: every epoch visits the rows in file order."""
    rows = [{"prompt": str(i)} for i in range(7)]
    sampler = PromptSampler(rows, 3, seed=7, shuffle=False)
    batches = [[r["prompt"] for r in sampler.next_batch()] for _ in range(3)]
    assert batches == [["0", "1", "2"], ["3", "4", "5"], ["0", "1", "2"]]
    shuffled = PromptSampler(rows, 3, seed=7)
    assert [r["prompt"] for r in shuffled.next_batch()] != ["0", "1", "2"]


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_file_that_is_not_utf8_names_its_file_and_line(tmp_path, suffix):
    lines = ['{"prompt": "a"}', '{"prompt": "b"}', '{"prompt": "caf\xe9"}']
    text = "\n".join(lines) if suffix == ".jsonl" else "[\n" + ",\n".join(lines[1:]) + "\n]"
    path = tmp_path / f"latin1{suffix}"
    path.write_bytes(text.encode("latin-1"))  # é is the byte 0xe9: not UTF-8
    with pytest.raises(ValueError, match=rf"latin1\{suffix}, line 3: byte 0xe9 is not UTF-8"):
        load_dataset(str(path))


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_broken_json_names_its_file_and_line(tmp_path, suffix):
    text = '{"prompt": "a"}\n{"prompt": oops}\n' if suffix == ".jsonl" else '[\n{"prompt": oops}\n]'
    path = tmp_path / f"broken{suffix}"
    path.write_text(text)
    said = rf"broken\{suffix}, line 2: not valid JSON \(Expecting value, column 12\)"
    with pytest.raises(ValueError, match=said):
        load_dataset(str(path))


def starts_with_a(completions, **kwargs):
    return [float(c.startswith("a")) for c in completions]


def test_resuming_with_another_dataset_says_so_before_rendering_its_prompts(tmp_path):
    """A conversational dataset given to resume a run of plain prompts, on a tokenizer without a
    chat template, failed on rendering its prompts: the changed dataset is named first."""
    from test_train import tiny

    import train

    plain = tmp_path / "plain.jsonl"
    chat = tmp_path / "chat.jsonl"
    write_jsonl(plain, [{"prompt": "abc" + c + "="} for c in "abcdefgh"])
    write_jsonl(chat, [{"prompt": [{"role": "user", "content": "ab" + c}]} for c in "abcd"])
    common = [f"--reward_funcs={__name__}:starts_with_a", "--max_steps=1"]
    train.train(tiny(tmp_path, f"--dataset={plain}", *common))
    resumed = [f"--dataset={chat}", *common, "--max_steps=2", "--resume_from_checkpoint=true"]
    named = (
        f"dataset='{chat}': the dataset has 4 rows, the checkpoint's run had 8: resume with "
        "the same dataset, or start a new run in another --output_dir"
    )
    with pytest.raises(ValueError) as error:
        train.train(tiny(tmp_path, *resumed))
    assert str(error.value) == named
