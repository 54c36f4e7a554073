"""The learning rate at each optimizer step: transformers' `get_scheduler`, step for step.

Owns: the multiplier of the base learning rate at each optimizer step
(`lr_lambda`) for TRL's `lr_scheduler_type` values (linear, cosine,
constant, constant_with_warmup, cosine_with_min_lr) and the warmup length
(`warmup_length`).

Does not know about: optimizers (trainer.make_optimizer wraps `lr_lambda`
in a LambdaLR), batches, or checkpoints.

Choices (transformers' own): step s runs at base_lr x lr_lambda(s), so
the first warmup step runs at lr 0; warmup_steps wins over warmup_ratio,
and a ratio gives ceil(warmup_ratio x max_steps) steps.
"""

import math
from functools import partial

SCHEDULES = ("linear", "cosine", "constant", "constant_with_warmup", "cosine_with_min_lr")


def warmup_length(max_steps: int, warmup_steps=0, warmup_ratio=0.0) -> int:
    """transformers' TrainingArguments.get_warmup_steps. A warmup_steps
    below 1 is a ratio, as transformers >= 5 reads it."""
    if 0 < warmup_steps < 1:
        return math.ceil(max_steps * warmup_steps)
    if warmup_steps > 0:
        return int(warmup_steps)
    return math.ceil(max_steps * warmup_ratio)


def warmup(step: int, warmup_steps: int) -> float:
    return step / max(1, warmup_steps)


def progress(step: int, warmup_steps: int, max_steps: int) -> float:
    """The share of the decay done: 0 after warmup, 1 at max_steps."""
    return (step - warmup_steps) / max(1, max_steps - warmup_steps)


def constant(step, warmup_steps, max_steps) -> float:
    return 1.0


def constant_with_warmup(step, warmup_steps, max_steps) -> float:
    if step < warmup_steps:
        return warmup(step, warmup_steps)
    return 1.0


def linear(step, warmup_steps, max_steps) -> float:
    if step < warmup_steps:
        return warmup(step, warmup_steps)
    left = (max_steps - step) / max(1, max_steps - warmup_steps)
    return max(0.0, left)


def cosine(step, warmup_steps, max_steps, num_cycles=0.5) -> float:
    if step < warmup_steps:
        return warmup(step, warmup_steps)
    done = progress(step, warmup_steps, max_steps)
    return max(0.0, 0.5 * (1 + math.cos(math.pi * num_cycles * 2 * done)))


def cosine_with_min_lr(step, warmup_steps, max_steps, num_cycles=0.5, min_lr_rate=0.0) -> float:
    """cosine, ending at min_lr_rate x the base rate instead of 0."""
    if step < warmup_steps:
        return warmup(step, warmup_steps)
    done = progress(step, warmup_steps, max_steps)
    factor = 0.5 * (1 + math.cos(math.pi * num_cycles * 2 * done))
    factor = factor * (1 - min_lr_rate) + min_lr_rate
    return max(0.0, factor)


def lr_lambda(
    kind: str, warmup_steps: int, max_steps: int, learning_rate: float, kwargs: dict | None = None
):
    """step -> multiplier of the base learning rate. kwargs: transformers'
    lr_scheduler_kwargs (num_cycles; min_lr or min_lr_rate)."""
    kwargs = dict(kwargs or {})
    if kind not in SCHEDULES:
        raise ValueError(
            f"lr_scheduler_type={kind!r} is not supported; use one of {', '.join(SCHEDULES)}"
        )
    if kind == "cosine_with_min_lr":
        if ("min_lr" in kwargs) == ("min_lr_rate" in kwargs):
            raise ValueError(
                "lr_scheduler_type='cosine_with_min_lr' needs exactly one "
                "of min_lr or min_lr_rate in lr_scheduler_kwargs"
            )
        if "min_lr" in kwargs:
            kwargs["min_lr_rate"] = kwargs.pop("min_lr") / learning_rate
    allowed = {"cosine": {"num_cycles"}, "cosine_with_min_lr": {"num_cycles", "min_lr_rate"}}
    unknown = set(kwargs) - allowed.get(kind, set())
    if unknown:
        raise ValueError(
            f"lr_scheduler_kwargs {sorted(unknown)} do not apply to lr_scheduler_type={kind!r}"
        )
    fn = globals()[kind]
    return partial(fn, warmup_steps=warmup_steps, max_steps=max_steps, **kwargs)
