"""Built-in rewards on tricky inputs, name resolution, and score_completions' batching and errors."""

import math
import sys

import pytest
import torch

from nanogrpo.extras.builtin_rewards import (
    accuracy_reward,
    check_equation,
    countdown_reward,
    default_task_reward,
    format_reward,
    soft_overlong_punishment,
)
from nanogrpo.extras.math_answers import extract_answer, last_boxed, parse_number
from nanogrpo.extras.reward_funcs import resolve_reward_funcs
from nanogrpo.rewards import RewardError, score_completions


def as_messages(texts):
    return [[{"role": "assistant", "content": t}] for t in texts]


# --- accuracy ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, value",
    [
        ("1,000", 1000),
        ("$1,234.50", 1234.5),
        ("2.50", 2.5),
        ("-7", -7),
        ("50%", 50),
        ("50\\%", 50),
        ("3/4", 0.75),
        ("\\frac{3}{4}", 0.75),
        ("\\dfrac34", 0.75),
        ("-\\frac{1}{2}", -0.5),
        ("\\frac{-3}{6}", -0.5),
        (".5", 0.5),
        ("x = 12", 12),
        ("5 \\text{ cm}", 5),
        ("\u221212", -12),
        ("+3", 3),
        ("4.", 4),
    ],
)
def test_parse_number(text, value):
    assert parse_number(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["abc", "1/0", "\\frac{1}{0}", "1,00", "", "1.2.3"])
def test_parse_number_rejects(text):
    assert parse_number(text) is None


def test_extraction_order_and_nested_braces():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{3}{\\sqrt{4}}} c") == "\\frac{3}{\\sqrt{4}}"
    assert last_boxed("\\boxed{2} then \\boxed{unclosed") == "2"
    assert last_boxed("no box") is None
    assert extract_answer("#### 9 but \\boxed{7}") == "7"  # boxed wins over ####
    assert extract_answer("work 3 + 4\n#### 1,000\nbye") == "1,000"
    assert extract_answer("first 12, then -3.5 apples") == "-3.5"
    assert extract_answer("no digits") is None


def test_accuracy_cases():
    completions = [
        "so \\boxed{0.75}",
        "it is 3/4",
        "#### 1,000",
        "no answer here",
        "\\boxed{\\frac{5}{2}}",
        "\\boxed{6}",
        "The answer is $-4$.",
        "\\boxed{50\\%}",
        "\\boxed{x+1}",
        "\\boxed{7}",
    ]
    answers = ["\\frac{3}{4}", "0.75", "1000", "5", "2.50", "7", "-4", "50", "x + 1", None]
    assert accuracy_reward(completions, answer=answers) == [1, 1, 1, 0, 1, 0, 1, 1, 1, None]


def test_accuracy_solution_column_and_conversational():
    solutions = ["We get \\boxed{\\frac{1}{2}}.", "Therefore\n#### 12"]
    got = accuracy_reward(as_messages(["\\boxed{0.5}", "12"]), solution=solutions)
    assert got == [1.0, 1.0]
    assert accuracy_reward(["\\boxed{3}"], answer=[3]) == [1.0]  # numeric column values from JSON
    with pytest.raises(ValueError, match="answer"):
        accuracy_reward(["1"])


# --- format, soft overlong, countdown, default task -------------------------------------------------


def test_format_reward():
    completions = [
        "<think>a\nb</think>\n<answer>5</answer>",
        "  <think></think><answer>x</answer>\n",
        "<think>a</think><answer>5</answer> trailing",
        "<answer>5</answer>",
        "<think>a<think>b</think><answer>5</answer>",
        "<think>a</think><answer>1</answer><answer>2</answer>",
    ]
    assert format_reward(completions) == [1, 1, 0, 0, 0, 0]
    assert format_reward(as_messages(completions[:1])) == [1.0]


def test_soft_overlong_punishment():
    fn = soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4)
    got = fn(completion_ids=[[0] * n for n in (0, 6, 7, 8, 10, 11)])
    assert got == pytest.approx([0, 0, -0.25, -0.5, -1, -1])
    with pytest.raises(ValueError):
        soft_overlong_punishment(10, 0)
    [(name, resolved)] = resolve_reward_funcs(["soft_overlong"], max_completion_length=8)
    assert name == "soft_overlong" and resolved(completion_ids=[[1] * 7]) == [
        -0.5
    ]  # cache = 8 // 4


def test_countdown_equations():
    assert check_equation("(100 - 4) / 2 + 1", [1, 2, 4, 100], 49)
    assert check_equation("(100 - 4) / 2 + 1 = 49", [100, 4, 2, 1], 49)
    assert check_equation("-3 + 10", [3, 10], 7)
    assert not check_equation("100 - 4", [100, 4, 2], 96)  # a number unused
    assert not check_equation("2 + 2 + 3", [2, 3], 7)  # a number used twice
    assert not check_equation("2 ** 3", [2, 3], 8)
    assert not check_equation("2.5 * 2", [2, 2], 5)
    assert not check_equation("__import__('os').system('x')", [1], 1)
    assert not check_equation("7 / (3 - 3)", [7, 3, 3], 1)
    assert not check_equation("", [1], 1)
    completions = [
        "<think>try</think>\n<answer>(5 - 1) * 3</answer>",
        "reasoning\n5 * 3 - 1 - 2",
        "<answer>5+3+1</answer>",
    ]
    assert countdown_reward(completions, nums=[[1, 3, 5]] * 3, target=[12, 12, 12]) == [
        1.0,
        0.0,
        0.0,
    ]


def test_default_task_reward():
    target = "bhad"
    completions = ["bhad", "bha", "bhadd", "dahb", "xxxx", "", "bhadbhad"]
    scores = default_task_reward(completions, target=[target] * len(completions))
    assert scores[0] == 1.0
    assert all(0 <= s < 1 for s in scores[1:])
    assert (
        scores[1] > scores[3] > scores[4] > scores[5] == 0.0
    )  # near misses beat permutations beat garbage
    assert scores[2] > scores[6]  # one extra char costs less than doubling
    assert default_task_reward(as_messages([" bhad\n"]), target=[target]) == [1.0]
    # with completion_ids, tokens that decode to nothing still count as length: stop, don't pad
    stopped, padded = default_task_reward(
        ["bhad", "bhad"], target=[target] * 2, completion_ids=[[0] * 5, [0] * 8]
    )
    assert stopped == 1.0 and padded < 0.8


# --- resolving and scoring ----------------------------------------------------------------------


def column_reward(completions, expected, **kwargs):
    """Used by the "path.py:function" test below."""
    return [float(c == e) for c, e in zip(completions, expected)]


def test_resolve_names_callables_and_modules(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length(completions, **kw):\n    return [len(c) for c in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    resolved = resolve_reward_funcs(
        ["accuracy", "my_rewards:length", f"{__file__}:column_reward", column_reward]
    )
    assert [name for name, _ in resolved] == [
        "accuracy",
        "length",
        "column_reward",
        "column_reward",
    ]
    assert resolved[1][1](completions=["ab", "c"]) == [2, 1]
    assert resolve_reward_funcs("format")[0][0] == "format"
    with pytest.raises(ValueError, match=r"did you mean 'accuracy'.*countdown"):
        resolve_reward_funcs(["acuracy"])
    with pytest.raises(ValueError, match="cannot import"):
        resolve_reward_funcs(["no_such_module_xyz:f"])
    with pytest.raises(ValueError, match="no function 'nope'"):
        resolve_reward_funcs(["my_rewards:nope"])
    with pytest.raises(ValueError, match="max_completion_length"):
        resolve_reward_funcs(["soft_overlong"])


DATACLASS_FILE = """
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class Score:
    value: float = 0.0
    seen: list[str] = field(default_factory=list)


def length(completions, **kwargs) -> list[float]:
    return [Score(float(len(c))).value for c in completions]


def double(x: int) -> int:
    \"\"\"Doubles a number.

    Args:
        x: the number
    \"\"\"
    return 2 * Score(x).value


@dataclass
class Counter:
    count: int = 0

    def reset(self, **kwargs) -> str | None:
        self.count = 0
        return None

    def step(self, by: int) -> str:
        \"\"\"Adds to the count.

        Args:
            by: how much
        \"\"\"
        self.count += by
        return str(dataclasses.asdict(self))
"""


def test_a_file_of_dataclasses_imports_as_python_imports_it(tmp_path):
    """A reward, tool or environment file written as TRL's often are (`from __future__ import
    annotations` and a @dataclass) imports, as a module in sys.modules named for its kind and
    file; two files with one name are two modules."""
    from nanogrpo.extras.environments import resolve_factory
    from nanogrpo.extras.tools import resolve_tools

    path = tmp_path / "things.py"
    path.write_text(DATACLASS_FILE)
    [(name, length)] = resolve_reward_funcs([f"{path}:length"])
    assert length(completions=["abc", ""]) == [3.0, 0.0]
    assert length.__module__ == "reward_function_things"
    tools = resolve_tools([f"{path}:double"])
    assert tools["double"](x=2) == 4 and tools["double"].__module__ == "tool_things"
    env = resolve_factory(f"{path}:Counter")()
    env.reset()
    assert env.step(by=3) == "{'count': 3}" and type(env).__module__ == "environment_factory_things"
    other = tmp_path / "other" / "things.py"
    other.parent.mkdir()
    other.write_text(DATACLASS_FILE.replace("len(c)", "len(c) + 1"))
    [(_, again)] = resolve_reward_funcs([f"{other}:length"])
    assert again.__module__.startswith("reward_function_things_")
    assert again(completions=[""]) == [1.0]
    assert sys.modules["reward_function_things"].__file__ == str(path)


def test_user_reward_file_importing_builtins(tmp_path):
    """A user's reward file that builds on the built-ins and on trainer_state imports them from their
    homes (extras/builtin_rewards.py, extras/trainer_info.py) and resolves as any "file.py:function"."""
    (tmp_path / "user_rewards.py").write_text(
        "from nanogrpo.extras.builtin_rewards import accuracy_reward, format_reward\n"
        "from nanogrpo.extras.trainer_info import TrainerState\n"
        "def both(completions, answer, trainer_state=None, **kw):\n"
        "    assert isinstance(trainer_state, TrainerState)\n"
        "    return [a + f for a, f in zip(accuracy_reward(completions, answer=answer), format_reward(completions))]\n"
    )
    [(name, fn)] = resolve_reward_funcs([f"{tmp_path / 'user_rewards.py'}:both"])
    from nanogrpo.extras.trainer_info import TrainerState

    assert fn(
        completions=["<think>x</think> <answer>\\boxed{3}</answer>", "2"],
        answer=["3", "3"],
        trainer_state=TrainerState(),
    ) == [2.0, 0.0]


def test_score_completions_matrix_columns_none_and_async():
    async def slow_half(completions, **kwargs):
        return [None if i % 2 else 0.5 for i in range(len(completions))]

    def uses_column(prompts, completions, completion_ids, expected, **kwargs):
        assert len(prompts) == len(completion_ids) == len(completions)
        return [c == e for c, e in zip(completions, expected)]  # bools count as numbers

    funcs = resolve_reward_funcs([uses_column, slow_half, "default_task"])
    completions = ["ab", "xy", "ba"]
    columns = {"expected": ["ab", "xx", "ba"], "target": ["ab", "ab", "ab"]}
    r = score_completions(funcs, ["p"] * 3, completions, [[1], [2], [3]], columns)
    assert r.shape == (3, 3) and r.dtype == torch.float32
    assert r[:, 0].tolist() == [1, 0, 1]
    assert r[0, 1] == 0.5 and math.isnan(r[1, 1]) and r[2, 1] == 0.5
    assert r[0, 2] == 1.0 and r[2, 2] < 1.0


@pytest.mark.parametrize(
    "returned, message",
    [
        ([1.0], r"'bad' returned 1 values for 2 completions"),
        ([1.0, "x"], r"'bad' returned 'x' \(str\) at index 1"),
        ([1.0, [2.0]], r"at index 1"),
        ([1.0, float("inf")], r"at index 1"),
        (0.5, r"'bad' returned float"),
    ],
)
def test_score_completions_bad_outputs(returned, message):
    def bad(completions, **kwargs):
        return returned

    with pytest.raises(RewardError, match=message):
        score_completions([bad], ["p", "q"], ["a", "b"], None, {})


def test_score_completions_errors_name_the_function():
    def boom(completions, **kwargs):
        raise KeyError("missing")

    async def async_boom(completions, **kwargs):
        raise ZeroDivisionError("nope")

    with pytest.raises(RewardError, match=r"'boom' raised KeyError") as err:
        score_completions([async_boom, ("boom", boom)], ["p"], ["a"], None, {})
    assert isinstance(err.value.__cause__, KeyError)
    with pytest.raises(RewardError, match=r"'async_boom' raised ZeroDivisionError"):
        score_completions([async_boom], ["p"], ["a"], None, {})
    with pytest.raises(ValueError, match="column 'answer' has 1 values for 2"):
        score_completions(
            resolve_reward_funcs(["accuracy"]), ["p", "q"], ["a", "b"], None, {"answer": ["1"]}
        )


def test_total_reward_is_the_weighted_nan_aware_sum():
    from nanogrpo.grpo import total_reward

    nan = float("nan")
    r = torch.tensor([[1.0, 2.0], [nan, 3.0], [nan, nan]])
    total = total_reward(r, [0.5, 2.0])
    assert total[:2].tolist() == [4.5, 6.0] and torch.isnan(total[2])  # unscored stays NaN, not 0
    assert total_reward(r)[:2].tolist() == [3.0, 3.0]


def test_eval_reward_excludes_unscored_rows_like_training(monkeypatch):
    """Regression: eval/reward counted a row no function scored as 0, training excluded it."""
    import train
    from nanogrpo import distributed as dist
    from nanogrpo.rollout import Rollout
    from nanogrpo.run.config import TrainConfig

    def fake_rollout(model, tok, rows, num_generations, **kwargs):
        n = len(rows) * num_generations
        return Rollout(
            rows=rows,
            num_generations=num_generations,
            prompt_ids=[[1]] * len(rows),
            input_ids=torch.ones(n, 2, dtype=torch.long),
            attention_mask=torch.ones(n, 2, dtype=torch.long),
            completion_mask=torch.ones(n, 1),
            completion_lengths=torch.ones(n, dtype=torch.long),
            truncated=torch.zeros(n, dtype=torch.bool),
            prompts=[r["prompt"] for r in rows],
            completions=["x"] * n,
            completion_token_ids=[[1]] * n,
        )

    monkeypatch.setattr(train, "rollout", fake_rollout)
    # no model here to score with: eval/loss is not what this test is about
    monkeypatch.setattr(train, "frozen", lambda *args, **kwargs: (None, None))
    monkeypatch.setattr(train, "eval_loss", lambda *args, **kwargs: 0.0)

    def half_scored(completions, **kw):
        return [1.0, None]

    import contextlib
    from types import SimpleNamespace

    from nanogrpo.extras.trainer_info import trainer_state_of

    t = SimpleNamespace(
        model=torch.nn.Linear(1, 1),
        tok=None,
        eval_rows=[{"prompt": "a"}, {"prompt": "b"}],
        cfg=TrainConfig(num_generations_eval=1),
        reward_funcs=[("half", half_scored)],
        reward_weights=None,
        info=dist.DistInfo(),
        autocast=contextlib.nullcontext(),
        turns=None,
        sampling={},
        environments=None,
        rollout_func=None,
        kernels=train.Kernels(),
        ref=None,
        prompts=SimpleNamespace(rows=[{"prompt": "a"}]),  # for trainer_state
        step=0,
    )
    t.state = trainer_state_of(t)
    m = train.evaluate(t)
    assert m["eval/reward"] == 1.0


def test_a_column_that_is_none_in_some_rows_reaches_the_reward_function():
    """TRL passes a column's None through to the reward function: only a row without the key
    is refused, and the message lists that row's columns, the missing one not among them."""
    from nanogrpo.extras.reward_funcs import check_reward_columns

    seen = []

    def by_difficulty(completions, difficulty, **kwargs):
        seen.extend(difficulty)
        return [0.0 if d is None else 1.0 for d in difficulty]

    funcs = [("by_difficulty", by_difficulty)]
    rows = [{"prompt": "a", "difficulty": "hard"}, {"prompt": "b", "difficulty": None}]
    check_reward_columns(funcs, rows, "data.jsonl", environments=False)
    columns = {"difficulty": [r["difficulty"] for r in rows]}
    scores = score_completions(funcs, ["a", "b"], ["x", "y"], [[1], [2]], columns)
    assert seen == ["hard", None] and scores[:, 0].tolist() == [1.0, 0.0]
    with pytest.raises(
        ValueError,
        match=r"needs the column\(s\) \['difficulty'\], which row 1 of dataset data.jsonl "
        r"lacks \(its columns: \['prompt'\]\)",
    ):
        check_reward_columns(funcs, [rows[0], {"prompt": "b"}], "data.jsonl", environments=False)


def test_the_columns_trl_drops_are_dropped_and_a_taken_name_is_refused():
    """As TRL: every column but prompt, completion and completion_ids reaches the reward
    functions (a completion_ids column made every call fail with "multiple values"); a column
    named as an argument the trainer passes is refused at load time in one line; `environments`
    is the trainer's only with environment_factory."""
    from nanogrpo.data import columns_of
    from nanogrpo.extras.reward_funcs import check_reward_columns

    seen = {}

    def reward(prompts, completions, completion_ids, **kwargs):
        seen.update(kwargs, completion_ids=completion_ids)
        return [1.0] * len(completions)

    rows = [
        {"prompt": "a", "completion": "ref", "completion_ids": [7], "answer": "1"},
        {"prompt": "b", "completion": "ref", "completion_ids": [8], "answer": "2"},
    ]
    funcs = [("reward", reward)]
    check_reward_columns(funcs, rows, "data.jsonl", environments=False)
    scores = score_completions(funcs, ["a", "b"], ["x", "y"], [[1], [2]], columns_of(rows))
    assert scores[:, 0].tolist() == [1.0, 1.0]
    assert seen == {"answer": ["1", "2"], "completion_ids": [[1], [2]]}
    for taken in ("prompts", "completions", "trainer_state", "log_metric", "log_extra"):
        with pytest.raises(
            ValueError, match=f"row 1 of dataset data.jsonl has the column '{taken}'"
        ):
            check_reward_columns(funcs, [rows[0], {**rows[1], taken: 1}], "data.jsonl", False)

    def by_env(completions, environments, **kwargs):
        return [1.0] * len(completions)

    with_envs = [{"prompt": "a", "environments": "mine"}]
    check_reward_columns([("by_env", by_env)], with_envs, "d", environments=False)
    with pytest.raises(ValueError, match="has the column 'environments'"):
        check_reward_columns([("by_env", by_env)], with_envs, "d", environments=True)
    check_reward_columns([("by_env", by_env)], [{"prompt": "a"}], "d", environments=True)
    with pytest.raises(ValueError, match=r"needs the column\(s\) \['environments'\]"):
        check_reward_columns([("by_env", by_env)], [{"prompt": "a"}], "d", environments=False)


def test_reward_names_are_trls_and_two_of_one_name_are_refused(tmp_path):
    """A functools.partial is named after the function it wraps (as TRL's get_callable_name), a
    callable object after its class; two reward functions of one name, whose rewards/<name>/*
    metrics TRL merges into one, are refused before training, in one line naming both."""
    import dataclasses
    import functools

    from test_train import tiny

    import train
    from nanogrpo.extras.reward_funcs import check_names

    def length(completions, scale=1.0, **kwargs):
        return [scale * len(c) for c in completions]

    class Judge:
        def __call__(self, completions, **kwargs):
            return [0.0] * len(completions)

    resolved = resolve_reward_funcs(
        [functools.partial(functools.partial(length, scale=2)), Judge()]
    )
    assert [name for name, _ in resolved] == ["length", "Judge"]
    check_names(resolved)
    twice = resolve_reward_funcs([length, functools.partial(length, scale=2.0)])
    with pytest.raises(ValueError, match=r"reward functions 0 and 1 .* named 'length'"):
        check_names(twice)
    cfg = dataclasses.replace(tiny(tmp_path), reward_funcs=["default_task", "default_task"])
    with pytest.raises(
        ValueError, match=r"0 and 1 \(counted from 0.*named 'default_task', .* would merge"
    ):
        train.train(cfg)
