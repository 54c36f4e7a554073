"""TRL's `GRPOConfig` for a Python script: TrainConfig under TRL's class name, taking every TRL 1.16
GRPOConfig and TrainingArguments field by keyword.

Owns: `GRPOConfig` and `trl_settings`, which reads its keywords as run/configurator.py reads a
config file's names (`check_known`, `settings_of`; the tables are run/trl_names.py's): TRL's other
names translated, accepted with a note where they change nothing here, refused in the command
line's words where they would.

Does not know about: the model, tokenization, files, or processes.

Choices:
- A subclass of TrainConfig, not a copy of its fields: whatever takes a TrainConfig takes it
  (train.py's train, dataclasses.replace, validate), and nanogrpo's own fields are keywords too.
- The keywords are checked by name and type when it is made; the rules between settings
  (`validate`) wait for GRPOTrainer, which brings the model, the data and the reward functions.
- TRL's to_dict() writes generation_batch_size and steps_per_generation both, one derived from
  the other (TRL's own GRPOConfig then refuses the pair): a generation_batch_size that is the one
  steps_per_generation makes on WORLD_SIZE processes is dropped.
"""

import dataclasses
import os

from nanogrpo.run.config import TrainConfig
from nanogrpo.run.configurator import check_known, settings_of


def trl_settings(kwargs: dict) -> dict:
    """GRPOConfig's keywords -> TrainConfig's fields. Every unknown or refused name in one
    ConfigError, each named as the command line names it."""
    check_known([(key, value, "in GRPOConfig", False) for key, value in kwargs.items()])
    settings = settings_of(kwargs, from_text=False)
    batch = settings.get("generation_batch_size")
    steps = settings.get("steps_per_generation")
    if batch and steps:
        per_device = settings.get(
            "per_device_train_batch_size", TrainConfig.per_device_train_batch_size
        )
        if batch == per_device * int(os.environ.get("WORLD_SIZE", "1")) * steps:
            del settings["generation_batch_size"]  # to_dict()'s derived one
    return settings


class GRPOConfig(TrainConfig):
    """TrainConfig from TRL's keywords: GRPOConfig(output_dir, **TRL's GRPOConfig fields), or
    GRPOConfig(**trl_args.to_dict()). Model, dataset and reward functions are GRPOTrainer's
    arguments, as in TRL."""

    def __init__(self, output_dir: str | None = None, **kwargs):
        if output_dir is not None:
            kwargs["output_dir"] = output_dir
        super().__init__(**trl_settings(kwargs))

    def to_dict(self) -> dict:
        """Every setting by name (TrainingArguments.to_dict's place)."""
        return dataclasses.asdict(self)
