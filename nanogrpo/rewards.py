"""Reward functions and reward models, and turning their outputs into one [N, K] reward matrix.

Owns: the built-in rewards (`accuracy`, `format`, `soft_overlong`, `countdown`, `default_task`),
resolving config entries (`resolve_reward_funcs`: a reward model's entry goes to
reward_model.py), calling every function on a batch of completions (`score_completions`),
checking that the dataset has the columns they read (`check_reward_columns`), and the
`TrainerState` they receive as `trainer_state`.

Does not know about: the policy, advantages (grpo.py), where dataset columns come from
(data.py), reward models' internals (reward_model.py), or other processes.

Choices:
- TRL's calling convention, so users bring their functions unchanged: `fn(prompts, completions,
  completion_ids=..., **columns) -> list[float | None]`. Completions are strings for plain-text
  prompts and `[{"role": "assistant", "content": ...}]` for conversational ones; every built-in
  accepts both. `None` means "not scored" and becomes NaN in the matrix.
- `async def` reward functions are awaited together in one `asyncio.run`: slow remote verifiers
  overlap.
- Math answers are compared as exact `fractions.Fraction`s (math_answers.py, no sympy).
- Countdown equations are parsed with `ast` and evaluated by walking the tree with Fractions;
  nothing is ever passed to `eval`.
"""

import ast
import asyncio
import collections
import difflib
import importlib.util
import inspect
import math
import numbers
import os
import re
from dataclasses import dataclass, field, replace
from fractions import Fraction

import torch

from nanogrpo.extras.math_answers import answers_match, extract_answer


class RewardError(RuntimeError):
    """A reward function failed or returned something that is not one score per completion."""


def completion_text(completion) -> str:
    """The text of one completion: the string itself, or the last message's content."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (list, tuple)) and completion and isinstance(completion[-1], dict):
        return completion[-1].get("content") or ""
    raise TypeError(f"expected a string or a list of messages as a completion, got {completion!r}")


# -----------------------------------------------------------------------------
# accuracy: math answers (math_answers.py parses them)


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
# default task (data.make_default_task): copy a short string


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
# resolving names, reward models, scoring a batch


BUILTINS = {
    "accuracy": accuracy_reward,
    "format": format_reward,
    "countdown": countdown_reward,
    "default_task": default_task_reward,
    "soft_overlong": soft_overlong_punishment,
}


def import_function(spec: str, kind: str = "reward function"):
    """'package.module:function' or 'path/to/file.py:function' -> the function (`kind` names it in
    errors)."""
    module_name, _, attr = spec.rpartition(":")
    try:
        if module_name.endswith(".py"):
            loader_spec = importlib.util.spec_from_file_location(
                f"_reward_{abs(hash(module_name))}", module_name
            )
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except (ImportError, OSError) as e:
        raise ValueError(f"{kind} {spec!r}: cannot import {module_name!r} ({e})") from e
    except SyntaxError as e:  # one line naming the place, not a traceback
        raise ValueError(f"{kind} {spec!r}: {e.filename}, line {e.lineno}: {e.msg}") from None
    except Exception as e:  # the file ran and raised
        raise ValueError(
            f"{kind} {spec!r}: importing {module_name!r} raised {type(e).__name__}: {e}"
        ) from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{kind} {spec!r}: {module_name!r} has no function {attr!r}")
    return fn


def resolve_reward_funcs(
    names_or_callables,
    *,
    max_completion_length: int | None = None,
    soft_punish_cache: int | None = None,
    reward_processing_classes=None,
    device="cpu",
    dtype=torch.float32,
    batch_size: int = 32,
) -> list[tuple[str, object]]:
    """Config entries -> [(name, fn)]: callables, built-in names, "module:function" or
    "file.py:function", and reward models: the directory or hub id ('org/name') of a
    *ForSequenceClassification checkpoint, loaded by `reward_model` with
    reward_processing_classes[i] (TRL's name: one entry per function; None = the model's own
    tokenizer; ignored for other functions, as in TRL). `soft_overlong` is built from
    max_completion_length and soft_punish_cache (default: a quarter of max_completion_length)."""
    if isinstance(names_or_callables, str) or callable(names_or_callables):
        names_or_callables = [names_or_callables]
    tokenizers = list(reward_processing_classes or [None] * len(names_or_callables))
    if len(tokenizers) != len(names_or_callables):
        raise ValueError(
            f"reward_processing_classes: {len(tokenizers)} entries, {len(names_or_callables)} "
            "functions"
        )
    resolved = []
    for item, tokenizer in zip(names_or_callables, tokenizers):
        if callable(item):
            resolved.append((getattr(item, "__name__", type(item).__name__), item))
        elif not isinstance(item, str):
            raise TypeError(f"a reward function is a name or a callable, got {item!r}")
        elif item == "soft_overlong":
            if max_completion_length is None:
                raise ValueError("soft_overlong needs max_completion_length")
            cache = soft_punish_cache
            if cache is None:
                cache = max(1, max_completion_length // 4)
            resolved.append((item, soft_overlong_punishment(max_completion_length, cache)))
        elif item in BUILTINS:
            resolved.append((item, BUILTINS[item]))
        elif os.path.isdir(item) or (
            ":" not in item and item.count("/") == 1 and not item.startswith((".", "~"))
        ):
            from nanogrpo.extras.reward_model import reward_model  # loads weights: only when used

            resolved.append(reward_model(item, tokenizer, device, dtype, batch_size))
        elif ":" in item:
            resolved.append((item.rpartition(":")[2], import_function(item)))
        else:
            close = difflib.get_close_matches(item, BUILTINS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"unknown reward function {item!r}{hint}; built-ins are {sorted(BUILTINS)}, or "
                "give 'module:function' or a reward model's directory or hub id"
            )
    return resolved


def _check_scores(name: str, scores, n: int) -> list[float]:
    """Validate one function's output: n numbers or None -> n floats with NaN for None."""
    if hasattr(scores, "tolist"):  # tensor, numpy array
        scores = scores.tolist()
    if not isinstance(scores, (list, tuple)):
        raise RewardError(
            f"reward function {name!r} returned {type(scores).__name__} {scores!r:.80}, "
            "expected a list with one float (or None) per completion"
        )
    if len(scores) != n:
        raise RewardError(
            f"reward function {name!r} returned {len(scores)} values for {n} completions"
        )
    out = [math.nan if s is None else s for s in scores]
    for i, s in enumerate(out):
        if not isinstance(s, numbers.Real) or math.isinf(s):
            raise RewardError(
                f"reward function {name!r} returned {s!r} ({type(s).__name__}) at index {i}; "
                "expected a finite float or None"
            )
    return [float(s) for s in out]


# what the trainer passes besides the dataset's columns (TRL 1.16's names; `environments` with
# environment_factory)
TRAINER_ARGUMENTS = (
    "prompts",
    "completions",
    "completion_ids",
    "trainer_state",
    "log_metric",
    "log_extra",
    "environments",
)


def check_reward_columns(reward_funcs, rows: list[dict], source: str) -> None:
    """Every column a reward function requires (a parameter without default, besides prompts,
    completions and completion_ids) must be in every row: found at load time, not as a crash at
    step 50.
    """
    for name, fn in reward_funcs:
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):  # a builtin or C callable: nothing to check
            continue
        needed = [
            p.name
            for p in params
            if p.default is p.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and p.name not in TRAINER_ARGUMENTS
        ]
        for i, row in enumerate(rows):
            missing = [c for c in needed if row.get(c) is None]
            if missing:
                raise ValueError(
                    f"reward function {name!r} needs the column(s) {missing}, which row {i} of "
                    f"dataset {source} lacks (its columns: {sorted(row)})"
                )


def score_completions(
    reward_funcs, prompts, completions, completion_ids, columns: dict, extras: dict | None = None
) -> torch.Tensor:
    """Call every reward function on the batch -> float32 [N, K], NaN where a function returned
    None. reward_funcs: [(name, fn)] from resolve_reward_funcs (bare callables also accepted).
    prompts, completions, completion_ids: N entries each (prompt i*G..i*G+G-1 repeated as the
    trainer lays them out); columns: dataset columns, each a list of N values, passed as keyword
    arguments. extras: more keyword arguments, as TRL passes them (trainer_state, log_metric,
    log_extra).
    """
    n = len(completions)
    for key, values in columns.items():
        if len(values) != n:
            raise ValueError(f"column {key!r} has {len(values)} values for {n} completions")
    funcs = [
        f if isinstance(f, tuple) else (getattr(f, "__name__", repr(f)), f) for f in reward_funcs
    ]
    kwargs = dict(columns, **(extras or {}))
    results = {}
    pending = {}  # async functions' coroutines, awaited together
    try:
        for k, (name, fn) in enumerate(funcs):
            try:
                out = fn(
                    prompts=prompts,
                    completions=completions,
                    completion_ids=completion_ids,
                    **kwargs,
                )
            except Exception as e:
                raise RewardError(f"reward function {name!r} raised {type(e).__name__}: {e}") from e
            if inspect.isawaitable(out):
                pending[k] = out
            else:
                results[k] = out
        if pending:
            results.update(await_all(pending, funcs))
            pending.clear()
    finally:
        for coroutine in pending.values():  # never awaited because an earlier function failed
            getattr(coroutine, "close", lambda: None)()
    rows = [_check_scores(funcs[k][0], results[k], n) for k in range(len(funcs))]
    return torch.tensor(rows, dtype=torch.float32).reshape(len(funcs), n).T.contiguous()


def await_all(pending: dict, funcs: list) -> dict:
    """Run the coroutines of async reward functions in one event loop, so
    slow remote verifiers overlap. -> {k: scores}"""

    async def gather():
        return await asyncio.gather(*pending.values(), return_exceptions=True)

    outs = asyncio.run(gather())
    results = {}
    for k, out in zip(pending, outs):
        if isinstance(out, BaseException):
            name = funcs[k][0]
            raise RewardError(
                f"reward function {name!r} raised {type(out).__name__}: {out}"
            ) from out
        results[k] = out
    return results


# -----------------------------------------------------------------------------
# trainer_state: the run's progress, as TRL passes it to reward functions


@dataclass
class TrainerState:
    """transformers' TrainerState, field for field: TRL 1.16 passes its trainer's `state` to reward
    functions as `trainer_state`, read by attribute (`trainer_state.global_step`). Fields nanogrpo
    has nothing for keep transformers' defaults."""

    epoch: float | None = None  # passes over the prompts done, fractional
    global_step: int = 0  # optimizer steps done
    max_steps: int = 0
    logging_steps: int = 500
    eval_steps: int = 500
    save_steps: int = 500
    train_batch_size: int | None = None  # per process, as transformers counts it
    num_train_epochs: int = 0  # epochs max_steps reaches into, rounded up
    num_input_tokens_seen: int = 0
    total_flos: float = 0
    log_history: list = field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    is_hyper_param_search: bool = False
    trial_name: str | None = None
    trial_params: dict | None = None
    stateful_callbacks: dict = field(default_factory=dict)


def trainer_state_of(t) -> TrainerState:
    """The TrainerState of train.py's Trainer `t` as it scores a round. log_history stays empty:
    the run's logged metrics live in run.Run, which the trainer does not hold."""
    cfg = t.cfg
    one_epoch = replace(cfg, max_steps=-1, num_train_epochs=1.0)
    steps_per_epoch = one_epoch.total_steps(len(t.prompts.rows), t.info.world_size)
    return TrainerState(
        # transformers counts epochs in optimizer steps: 1.5 = halfway
        # through the second pass over the prompts
        epoch=t.step / steps_per_epoch,
        global_step=t.step,
        max_steps=cfg.max_steps,
        logging_steps=cfg.logging_steps,
        eval_steps=cfg.eval_steps or cfg.logging_steps,
        save_steps=cfg.save_steps,
        train_batch_size=cfg.per_device_train_batch_size,
        num_train_epochs=math.ceil(cfg.max_steps / steps_per_epoch),
        is_local_process_zero=t.info.local_rank == 0,
        is_world_process_zero=t.info.rank == 0,
    )
