"""The built-in reward functions, by name: options a run picks in `reward_funcs`.

Owns: `accuracy` (math answers), `format` (`<think>...</think><answer>...</answer>`),
`soft_overlong` (DAPO's length penalty, built from max_completion_length), `countdown`
(`check_equation` on the `<answer>` equation) and `default_task` (`default_task_score`, the
dense score of the default copy task, extras/tasks.py), the `BUILTINS` table that names them, and
`completion_text` (a completion's text, whichever format it arrived in).

Does not know about: how names become functions (extras/reward_funcs.py, which looks names
up in `BUILTINS`) or how a batch is scored (rewards.py), where the columns they read come from
(extras/tasks.py, extras/datasets.py), tokenizers, torch, the trainer, or other processes.

Choices:
- TRL's calling convention, as every reward function: each names the arguments it reads
  (`completions`, its dataset columns, `completion_ids`) and takes the rest as `**kwargs`
  (`soft_overlong` builds such a function). Completions are strings for plain-text prompts and
  `[{"role": "assistant", "content": ...}]` for conversational ones; every built-in accepts both
  (`completion_text`).
- Math answers are compared as exact `fractions.Fraction`s (extras/math_answers.py, no sympy).
- Countdown equations are parsed with `ast` and evaluated by walking the tree with Fractions;
  nothing is ever passed to `eval`.
"""

import ast
import collections
import re
from fractions import Fraction

from nanogrpo.extras.math_answers import answers_match, extract_answer


def completion_text(completion) -> str:
    """The text of one completion: the string itself, or the last message's content."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (list, tuple)) and completion and isinstance(completion[-1], dict):
        return completion[-1].get("content") or ""
    raise TypeError(f"expected a string or a list of messages as a completion, got {completion!r}")


# -----------------------------------------------------------------------------
# accuracy: math answers (extras/math_answers.py parses them)


def accuracy_reward(completions, answer=None, solution=None, **kwargs) -> list[float | None]:
    """1.0 when the completion's final answer equals the `answer` (or `solution`) column, else 0.0.
    The gold value may itself be a full solution (its `\\boxed{}` or `####` part is used). Rows with
    no gold answer are not scored (None)."""
    golds = answer if answer is not None else solution
    if golds is None:
        raise ValueError("accuracy needs a dataset column named 'answer' or 'solution'")
    scores = []
    for completion, gold in zip(completions, golds):
        if gold is None or str(gold).strip() == "":
            scores.append(None)
            continue
        gold = str(gold)
        if "\\boxed" in gold or "####" in gold:
            gold = extract_answer(gold) or gold
        predicted = extract_answer(completion_text(completion))
        scores.append(float(predicted is not None and answers_match(predicted, gold)))
    return scores


# -----------------------------------------------------------------------------
# format, soft overlong punishment


_THINK_ANSWER = re.compile(
    r"<think>(?:(?!</?think>).)*</think>\s*<answer>(?:(?!</?answer>).)*</answer>", re.DOTALL
)


def format_reward(completions, **kwargs) -> list[float]:
    """1.0 when the whole completion is `<think>...</think>` then
    `<answer>...</answer>`, else 0.0."""
    texts = [completion_text(c).strip() for c in completions]
    return [float(_THINK_ANSWER.fullmatch(text) is not None) for text in texts]


def soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int):
    """DAPO's length penalty, as a reward function of `completion_ids`. With L = len(ids), M =
    max_completion_len, C = soft_punish_cache: 0 when L <= M - C, falling linearly to -1 across the
    last C tokens ((M - C - L) / C), and -1 beyond M."""
    if not 0 < soft_punish_cache <= max_completion_len:
        raise ValueError(
            f"soft_punish_cache={soft_punish_cache} must be in [1, {max_completion_len}]"
        )
    free = max_completion_len - soft_punish_cache

    def penalty(n: int) -> float:
        if n <= free:
            return 0.0
        if n > max_completion_len:
            return -1.0
        return (free - n) / soft_punish_cache

    def soft_overlong(completion_ids, **kwargs) -> list[float]:
        return [penalty(len(ids)) for ids in completion_ids]

    return soft_overlong


# -----------------------------------------------------------------------------
# countdown: safe arithmetic with ast


_OPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


def _evaluate(node, used: list) -> Fraction:
    """Value of an expression tree of integers, + - * /, parentheses and unary minus; anything else
    raises."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, used)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left, used), _evaluate(node.right, used))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand, used)
    raise ValueError(f"not allowed in an equation: {ast.dump(node)[:40]}")


def check_equation(equation: str, nums, target) -> bool:
    """True when `equation` uses each of `nums` exactly once, only + - * / ( ), and equals `target`.
    A trailing "= <number>" is allowed and ignored."""
    equation = equation.strip().split("=")[0].strip()
    if not equation or len(equation) > 200 or not re.fullmatch(r"[\d+\-*/()\s]+", equation):
        return False
    used: list[int] = []
    try:
        value = _evaluate(ast.parse(equation, mode="eval"), used)
    except (SyntaxError, ValueError, ZeroDivisionError):
        return False
    return sorted(used) == sorted(int(n) for n in nums) and value == Fraction(int(target))


def countdown_reward(completions, nums, target, **kwargs) -> list[float]:
    """1.0 when the `<answer>` equation (or, without tags, the last line) reaches `target` from
    `nums`."""
    scores = []
    for completion, row_nums, row_target in zip(completions, nums, target):
        text = completion_text(completion)
        # the last tagged equation, else the last line
        candidates = re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)
        if not candidates:
            candidates = [line for line in text.strip().split("\n") if line.strip()]
        equation = candidates[-1] if candidates else ""
        scores.append(float(check_equation(equation, row_nums, row_target)))
    return scores


# -----------------------------------------------------------------------------
# default task (tasks.make_default_task): copy a short string


def default_task_score(completion: str, target: str, num_tokens: int | None = None) -> float:
    """Dense score in [0, 1], 1.0 only for the exact target at the exact length: 0.7 * fraction of
    positions right + 0.15 * multiset overlap of characters (both over max(length, len target))
    + 0.15 * length closeness (1 - |length - len target| / len target, >= 0). length =
    len(completion), or num_tokens - 1 if larger: num_tokens counts the generated ids up to and
    including the stop token, so tokens that decode to nothing (special tokens) still count as
    length and the policy must learn to stop rather than pad with invisible tokens."""
    length = len(completion) if num_tokens is None else max(len(completion), num_tokens - 1)
    if completion == target and length == len(target):
        return 1.0
    longest = max(length, len(target), 1)
    positions = sum(a == b for a, b in zip(completion, target)) / longest
    shared = collections.Counter(completion) & collections.Counter(target)
    overlap = sum(shared.values()) / longest
    closeness = max(0.0, 1.0 - abs(length - len(target)) / max(len(target), 1))
    return 0.7 * positions + 0.15 * overlap + 0.15 * closeness


def default_task_reward(completions, target, completion_ids=None, **kwargs) -> list[float]:
    """`default_task_score` of each completion against the dataset column `target`."""
    counts = [None] * len(completions)
    if completion_ids is not None:
        counts = [len(ids) for ids in completion_ids]
    return [
        default_task_score(completion_text(c).strip(), str(t), n)
        for c, t, n in zip(completions, target, counts)
    ]


# -----------------------------------------------------------------------------
# names, as reward_funcs gives them


BUILTINS = {
    "accuracy": accuracy_reward,
    "format": format_reward,
    "countdown": countdown_reward,
    "default_task": default_task_reward,
    "soft_overlong": soft_overlong_punishment,
}
