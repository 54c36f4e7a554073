"""What TRL 1.16 hands reward functions beside the completions: the run's progress
(`trainer_state`) and two ways to log from inside a function (`log_metric`, `log_extra`).

Owns: `TrainerState` (transformers' TrainerState, field for field), `trainer_state_of`, which
fills one from trainer.py's Trainer as it scores a round, `epochs_done` (its `epoch`),
`RewardLogs` (what the functions logged in one round) and `reward_kwargs` (the three keyword
arguments). Reward functions receive them
from train.py's `reward_rollout`, a rollout_func the state as `trainer.state`
(extras/custom_rollout.py).

Does not know about: reward functions or how they are called (rewards.py), the model, the
optimizer, the run's logged metrics (run.Run holds them: `log_history` stays empty), or
checkpoints.

Choices:
- A plain dataclass, not transformers' class: user code reads it by attribute
  (`trainer_state.global_step`), as it reads TRL's, and nanogrpo never imports transformers
  for it. Fields nanogrpo has nothing for keep transformers' defaults.
- Epochs are counted as transformers' Trainer counts them over TRL's dataloader (`epochs_done`,
  on schedules.py's epoch arithmetic): micro-batches trained on over an epoch's micro-batches,
  the last optimizer step of an epoch taking what is left of it. run/report.py logs the same
  number as each step's `epoch`.
"""

import math
from dataclasses import dataclass, field

from nanogrpo.schedules import micro_batches_per_epoch, steps_per_epoch


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


def epochs_done(cfg, step: int, num_prompts: int, world_size: int = 1) -> float:
    """transformers' state.epoch after `step` optimizer steps (TRL logs it as `epoch`): the
    epochs done plus the share of this epoch's micro-batches trained on, so 1.5 is halfway
    through the second pass over the prompts."""
    if step == 0:
        return 0.0
    per_epoch = micro_batches_per_epoch(cfg, num_prompts, world_size)  # its dataloader's length
    updates = steps_per_epoch(cfg, num_prompts, world_size)
    whole = (step - 1) // updates  # epochs before the one this step ends in
    into = min((step - whole * updates) * cfg.gradient_accumulation_steps, per_epoch)
    return whole + into / per_epoch


def trainer_state_of(t) -> TrainerState:
    """The TrainerState of trainer.py's Trainer `t` as it scores a round. log_history stays empty:
    the run's logged metrics live in run.Run, which the trainer does not hold."""
    cfg = t.cfg
    num_prompts = len(t.prompts.rows)
    world_size = t.info.world_size
    return TrainerState(
        epoch=epochs_done(cfg, t.step, num_prompts, world_size),
        global_step=t.step,
        max_steps=cfg.max_steps,
        logging_steps=cfg.logging_steps,
        eval_steps=cfg.eval_steps or cfg.logging_steps,
        save_steps=cfg.save_steps,
        train_batch_size=cfg.per_device_train_batch_size,
        num_train_epochs=math.ceil(cfg.max_steps / steps_per_epoch(cfg, num_prompts, world_size)),
        is_local_process_zero=t.info.local_rank == 0,
        is_world_process_zero=t.info.rank == 0,
    )


@dataclass
class RewardLogs:
    """What reward functions logged in one round: `metrics` (log_metric: name -> every value
    logged, over every call; the step's record takes each name's mean, as TRL logs it) and
    `columns` (log_extra: column -> values per completion, of the latest call)."""

    metrics: dict = field(default_factory=dict)
    columns: dict = field(default_factory=dict)


def reward_kwargs(state: TrainerState, logs: RewardLogs) -> dict:
    """The keyword arguments TRL 1.16 adds for reward functions. With dynamic sampling
    log_metric's values include every draw's call, the dropped groups' too (TRL logs what reward
    functions report each time they are called); log_extra's columns are of this call's
    completions (train.py then keeps the kept ones'): this call empties `logs.columns`."""
    logs.columns = {}

    def log_metric(name, value):
        logs.metrics.setdefault(name, []).append(float(value))

    return {
        "trainer_state": state,
        "log_metric": log_metric,
        # log_extra(column, values): TRL appends, but its table keeps one batch of rows: a
        # second call's values are the ones shown, as here
        "log_extra": logs.columns.__setitem__,
    }
