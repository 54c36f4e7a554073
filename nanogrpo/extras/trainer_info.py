"""What TRL 1.16 hands reward functions beside the completions: the run's progress
(`trainer_state`) and two ways to log from inside a function (`log_metric`, `log_extra`).

Owns: `TrainerState` (transformers' TrainerState, field for field), `LiveTrainerState` and
`trainer_state_of`, the one trainer.py's setup builds for its Trainer (`t.state`: global_step
and epoch follow the run), and `epochs_done` (its `epoch`). Reward functions receive it from
train.py's `reward_rollout` (with rewards.py's RewardLogs' log_metric and log_extra), a
rollout_func as `trainer.state` (extras/custom_rollout.py).

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
from dataclasses import MISSING, dataclass, field, fields

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


class LiveTrainerState(TrainerState):
    """The TrainerState of trainer.py's Trainer `t` as it trains, as TRL hands its trainer's own
    `state`: global_step and epoch are read from t each time; the rest is fixed for the run.
    log_history stays empty: the run's logged metrics live in run.Run."""

    def __init__(self, t):
        self._t = t
        cfg, info = t.cfg, t.info
        updates = steps_per_epoch(cfg, len(t.prompts.rows), info.world_size)
        fixed = dict(
            max_steps=cfg.max_steps,
            logging_steps=cfg.logging_steps,
            eval_steps=cfg.eval_steps or cfg.logging_steps,
            save_steps=cfg.save_steps,
            train_batch_size=cfg.per_device_train_batch_size,
            num_train_epochs=math.ceil(cfg.max_steps / updates),
            is_local_process_zero=info.local_rank == 0,
            is_world_process_zero=info.rank == 0,
        )
        for f in fields(TrainerState):
            if f.name not in ("global_step", "epoch"):
                default = f.default_factory() if f.default is MISSING else f.default
                setattr(self, f.name, fixed.get(f.name, default))

    def _step(self) -> int:
        """The step global_step and epoch are read at."""
        return self._t.step

    @property
    def global_step(self) -> int:
        return self._step()

    @property
    def epoch(self) -> float:
        t = self._t
        return epochs_done(t.cfg, self._step(), len(t.prompts.rows), t.info.world_size)


class RoundState(LiveTrainerState):
    """The TrainerState of a sampler's trainer (run/async_rollouts.py), whose rounds are scored
    while others are drawn: global_step and epoch those of the step the calling thread's round
    trains at (`current.round`: one round a step), as the synchronous trainer's state reads
    while it samples that round."""

    def __init__(self, t, current):
        super().__init__(t)
        self._current = current

    def _step(self) -> int:
        return self._current.round


def trainer_state_of(t) -> TrainerState:
    """The TrainerState of trainer.py's Trainer `t`, live (LiveTrainerState): setup builds it once
    as `t.state`."""
    return LiveTrainerState(t)
