"""Reward functions' scores: calling every function on a batch of completions and turning their
outputs into one [N, K] reward matrix.

Owns: `score_rollout` and `score_completions` (TRL's calling convention, async functions
awaited together, outputs checked), `RewardLogs` (what the functions log with TRL's log_metric
and log_extra, and the keyword arguments TRL adds) and `RewardError`.

Left out, and where it lives: turning config entries into functions (a built-in's name,
"module:function", "file.py:function", a reward model) and checking the dataset's columns
against them at load time: extras/reward_funcs.py, called by trainer.py's setup; the built-in
functions (extras/builtin_rewards.py); the `trainer_state` they receive (extras/trainer_info.py).

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
import inspect
import math
import numbers
from dataclasses import dataclass, field

import torch

from nanogrpo.data import columns_of


@dataclass
class RewardLogs:
    """What reward functions logged in one round: `metrics` (log_metric: name -> every value
    logged, over every call; the step's record takes each name's mean, as TRL logs it) and
    `columns` (log_extra: column -> values per completion, of the latest call)."""

    metrics: dict = field(default_factory=dict)
    columns: dict = field(default_factory=dict)

    def reward_kwargs(self, trainer_state) -> dict:
        """The keyword arguments TRL 1.16 adds for reward functions: trainer_state (the run's
        extras/trainer_info.py TrainerState), log_metric and log_extra, logging here. With dynamic
        sampling log_metric's values include every draw's call (TRL logs what reward functions
        report each time they are called); log_extra's columns are of this call's completions:
        this call empties `columns`. log_extra(column, values): TRL appends, but its table keeps
        one batch of rows: a second call's values are the ones shown, as here."""
        self.columns = {}
        log_extra = self.columns.__setitem__
        return dict(trainer_state=trainer_state, log_metric=self.log_metric, log_extra=log_extra)

    def log_metric(self, name, value):
        self.metrics.setdefault(name, []).append(float(value))


class RewardError(RuntimeError):
    """A reward function failed or returned something that is not one score per completion."""


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


def score_rollout(ro, reward_funcs, extras: dict | None = None) -> torch.Tensor:
    """Every reward function on a rollout's completions (rollout.Rollout), called with TRL's
    convention: the dataset's columns repeated per completion, the rollout's extra fields
    (`environments`, a rollout_func's) and `extras` (trainer_state, log_metric, log_extra).
    -> [n, K] fp32, NaN = unscored."""
    G = ro.num_generations
    columns = {k: [v for v in vs for _ in range(G)] for k, vs in columns_of(ro.rows).items()}
    columns.update(ro.extra_fields or {})
    return score_completions(
        reward_funcs, ro.prompts, ro.completions, ro.completion_token_ids, columns, extras
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
