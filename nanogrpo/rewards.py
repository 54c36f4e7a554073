"""Reward functions and reward models, and turning their outputs into one [N, K] reward matrix.

Owns: resolving config entries (`resolve_reward_funcs`: a built-in's name, looked up in
`BUILTINS`, "module:function", "file.py:function", or a reward model's entry), calling every
function on a batch of completions (`score_completions`), checking that the dataset has the
columns they read (`check_reward_columns`), and `import_function`, which the tools, environments
and rollout_func settings use too.

Leaves out: the built-in reward functions (`accuracy`, `format`, `soft_overlong`, `countdown`,
`default_task`) and their `BUILTINS` table live in extras/builtin_rewards.py; the
`TrainerState` that reward functions receive as `trainer_state` lives in extras/trainer_info.py
(both stay importable from here, for users' reward files); loading a reward model is
extras/reward_model.py's, imported only when an entry names one.

Does not know about: the policy, advantages (grpo.py), where dataset columns come from (data.py,
extras/datasets.py), or other processes.

Choices:
- TRL's calling convention, so users bring their functions unchanged: `fn(prompts, completions,
  completion_ids=..., **columns) -> list[float | None]`. Completions are strings for plain-text
  prompts and `[{"role": "assistant", "content": ...}]` for conversational ones. `None` means
  "not scored" and becomes NaN in the matrix.
- `async def` reward functions are awaited together in one `asyncio.run`: slow remote verifiers
  overlap.
"""

import asyncio
import difflib
import importlib.util
import inspect
import math
import numbers
import os

import torch

# importable here for users' reward files (`from nanogrpo.rewards import accuracy_reward`), where
# they lived before they moved to extras/
from nanogrpo.extras.builtin_rewards import (  # noqa: F401
    BUILTINS,
    accuracy_reward,
    check_equation,
    completion_text,
    countdown_reward,
    default_task_reward,
    default_task_score,
    format_reward,
    soft_overlong_punishment,
)
from nanogrpo.extras.trainer_info import TrainerState, trainer_state_of  # noqa: F401


class RewardError(RuntimeError):
    """A reward function failed or returned something that is not one score per completion."""


# -----------------------------------------------------------------------------
# resolving names, reward models, scoring a batch


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
    """Every column a reward function requires (a parameter without default, besides the
    TRAINER_ARGUMENTS the trainer passes) must be a key of every row (a None value is passed on,
    as TRL passes it): found at load time, not as a crash at step 50.
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
            missing = [c for c in needed if c not in row]
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
