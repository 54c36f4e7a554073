"""What each optimizer step is: the batch `Schedule` (TRL's arithmetic)
and the learning rate (transformers' `get_scheduler`, step for step).

Owns: `batch_schedule` (per_device_train_batch_size, gradient
accumulation, steps_per_generation, processes -> every derived count),
`total_steps` (num_train_epochs as TRL counts it), the multiplier of
the base learning rate at each optimizer step for TRL's
`lr_scheduler_type` values (linear, cosine, constant,
constant_with_warmup, cosine_with_min_lr) and the warmup length.

Does not know about: optimizers (train.py wraps `lr_lambda` in a
LambdaLR) or checkpoints; it reads a TrainConfig's batch fields.

Choices (transformers' own): step s runs at base_lr x lr_lambda(s), so
the first warmup step runs at lr 0; warmup_steps wins over warmup_ratio,
and a ratio gives ceil(warmup_ratio x max_steps) steps.
"""

import math
from dataclasses import dataclass
from functools import partial

SCHEDULES = ("linear", "cosine", "constant", "constant_with_warmup",
             "cosine_with_min_lr")


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


def cosine_with_min_lr(step, warmup_steps, max_steps, num_cycles=0.5,
                       min_lr_rate=0.0) -> float:
    """cosine, ending at min_lr_rate x the base rate instead of 0."""
    if step < warmup_steps:
        return warmup(step, warmup_steps)
    done = progress(step, warmup_steps, max_steps)
    factor = 0.5 * (1 + math.cos(math.pi * num_cycles * 2 * done))
    factor = factor * (1 - min_lr_rate) + min_lr_rate
    return max(0.0, factor)


def lr_lambda(kind: str, warmup_steps: int, max_steps: int,
              learning_rate: float, kwargs: dict | None = None):
    """step -> multiplier of the base learning rate. kwargs: transformers'
    lr_scheduler_kwargs (num_cycles; min_lr or min_lr_rate)."""
    kwargs = dict(kwargs or {})
    if kind not in SCHEDULES:
        raise ValueError(f"lr_scheduler_type={kind!r} is not supported; "
                         f"use one of {', '.join(SCHEDULES)}")
    if kind == "cosine_with_min_lr":
        if ("min_lr" in kwargs) == ("min_lr_rate" in kwargs):
            raise ValueError(
                "lr_scheduler_type='cosine_with_min_lr' needs exactly one "
                "of min_lr or min_lr_rate in lr_scheduler_kwargs")
        if "min_lr" in kwargs:
            kwargs["min_lr_rate"] = kwargs.pop("min_lr") / learning_rate
    allowed = {"cosine": {"num_cycles"},
               "cosine_with_min_lr": {"num_cycles", "min_lr_rate"}}
    unknown = set(kwargs) - allowed.get(kind, set())
    if unknown:
        raise ValueError(f"lr_scheduler_kwargs {sorted(unknown)} do not "
                         f"apply to lr_scheduler_type={kind!r}")
    fn = globals()[kind]
    return partial(fn, warmup_steps=warmup_steps, max_steps=max_steps,
                   **kwargs)


# -----------------------------------------------------------------------------
# The batch schedule


def completions_per_rank(cfg) -> int:
    """Completions each process trains on in one optimizer step."""
    return cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps


def micro_batches_per_round(cfg, world_size: int = 1) -> int:
    """TRL's steps_per_generation: micro-batches each process samples
    at once, from generation_batch_size when that is given."""
    if cfg.generation_batch_size is not None:
        per_round = cfg.per_device_train_batch_size * world_size
        return cfg.generation_batch_size // per_round
    return cfg.steps_per_generation or cfg.gradient_accumulation_steps


def batch_schedule(cfg, world_size: int = 1) -> "Schedule":
    """Every count derived from the batch settings on `world_size`
    processes (call validate first)."""
    per_rank = completions_per_rank(cfg)
    micro_per_step = cfg.gradient_accumulation_steps
    spg = micro_batches_per_round(cfg, world_size)
    steps = spg // micro_per_step  # optimizer steps one round feeds
    updates = steps * cfg.num_iterations
    prompts_per_step = per_rank * world_size // cfg.num_generations
    return Schedule(
        world_size=world_size,
        num_generations=cfg.num_generations,
        prompts_per_step=prompts_per_step,
        completions_per_step_per_rank=per_rank,
        micro_batch_size=cfg.per_device_train_batch_size,
        micro_batches_per_step=micro_per_step,
        steps_per_generation=spg,
        optimizer_steps_per_generation=steps,
        num_iterations=cfg.num_iterations,
        prompts_per_round=prompts_per_step * steps,
        completions_per_round_per_rank=per_rank * steps,
        updates_per_round=updates,
        off_policy=updates > 1,
    )


def total_steps(cfg, num_prompts: int, world_size: int = 1) -> int:
    """max_steps, or TRL's count for num_train_epochs passes over
    `num_prompts`: each round of whole generation batches feeds
    num_iterations x its optimizer steps."""
    if cfg.max_steps > 0:
        return cfg.max_steps
    sched = batch_schedule(cfg, world_size)
    rounds = num_prompts // sched.prompts_per_round
    per_epoch = max(rounds * sched.updates_per_round, 1)
    return math.ceil(cfg.num_train_epochs * per_epoch)


@dataclass(frozen=True)
class Schedule:
    """What one optimizer step and one generation round are, on every rank:
    the counts the loop, grpo_step's scaling, the replay order and the logs
    all read. TRL's names where TRL has them."""

    world_size: int
    num_generations: int  # G completions per prompt
    prompts_per_step: int  # prompts per optimizer step, all ranks together
    completions_per_step_per_rank: int
    micro_batch_size: int  # completions per forward/backward
    micro_batches_per_step: int  # gradient accumulation steps, on each rank
    # TRL's: micro-batches per generation round, on each rank
    steps_per_generation: int
    # optimizer steps one round's samples feed, in one pass
    optimizer_steps_per_generation: int
    num_iterations: int  # passes over each round's samples (TRL's mu)
    # prompts sampled per generation round, all ranks together
    prompts_per_round: int
    completions_per_round_per_rank: int
    # optimizer steps per round: optimizer_steps_per_generation x num_iterations
    updates_per_round: int
    # the policy changes between sampling and some update: old log-probs
    # are needed
    off_policy: bool

    def replay_order(self) -> list[int]:
        """The first micro-batch of each optimizer step of a round, in
        order: the round's micro-batches in step-sized slices, the whole
        sequence repeated num_iterations times."""
        step = self.micro_batches_per_step
        one_pass = list(range(0, self.steps_per_generation, step))
        return one_pass * self.num_iterations

    def table(self) -> str:
        """A short table for the start of a run: what one step and one
        round are."""
        micro = f"of {self.micro_batch_size} completions"
        old_logps = "yes" if self.off_policy else "no: ratio is exactly 1"
        rows = [
            ("ranks", self.world_size),
            ("prompts x completions per optimizer step (all ranks)",
             f"{self.prompts_per_step} x {self.num_generations}"),
            ("completions per step per rank",
             self.completions_per_step_per_rank),
            (f"micro-batches per step per rank ({micro})",
             self.micro_batches_per_step),
            ("micro-batches per generation round per rank "
             "(steps_per_generation)", self.steps_per_generation),
            ("prompts sampled per round (all ranks)", self.prompts_per_round),
            ("passes over each round (num_iterations)", self.num_iterations),
            ("optimizer steps per round", self.updates_per_round),
            ("old log-probs (off-policy)", old_logps),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
