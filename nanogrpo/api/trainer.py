"""TRL's `GRPOTrainer` for a Python script: TRL's signature, and `train()` runs train.py's own loop
(`train.train`), not a second one.

Owns: `GRPOTrainer`, the reading of its arguments into the run's config and a trainer.Given (the
rows, a tokenizer, the policy's loader), `TrainOutput`, and finding train.py (`train_module`).

Does not know about: the GRPO math, sampling, or log-probs: train.py's `train` and `evaluate` do
the work, nanogrpo/run/ the run around it.

Choices:
- Every argument is checked when the trainer is made, before anything loads, each bad one in one
  line: a model that is neither a path, a hub id nor a nanogrpo model; a row without a prompt; a
  peft_config setting nanogrpo's LoRA lacks; TRL's callbacks, optimizers, quantization_config, in
  the command line's words (run/trl_names.py's REFUSED).
- train.py sits beside the package, not in it, and nothing in the package imports it: it is
  loaded from its file, as `python train.py` runs it.
- The model loads inside train() (or evaluate()), where trainer.setup seeds and places it, so a
  path trains as `python train.py --model=path` does. trainer.model is the policy train()
  trained (None before, for a path); a second train() goes on from it, as TRL's does. A loaded
  nanogrpo model trains in place (a resumed run's policy is its checkpoint's).
- Under torchrun every process runs the script and loads its FSDP2 shard from the model's path;
  the process group ends with the run, so a trainer trains once there, and save_model copies the
  run's last checkpoint.
- A datasets.Dataset and peft's LoraConfig are read by duck typing: neither is imported.
"""

import dataclasses
import functools
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import torch

from nanogrpo import checkpoint, distributed as dist
from nanogrpo.api.config import GRPOConfig
from nanogrpo.data import check_rows
from nanogrpo.extras import lora
from nanogrpo.extras.datasets import check_text_only
from nanogrpo.extras.reward_funcs import run_file
from nanogrpo.extras.trainer_info import TrainerState
from nanogrpo.model import Transformer
from nanogrpo.run.config import ConfigError, TrainConfig
from nanogrpo.run.trl_names import NO_BITSANDBYTES, REFUSED, TRANSLATED
from nanogrpo.tokenizer import Tokenizer
from nanogrpo.trainer import Given, load_policy, setup

ROOT = Path(__file__).resolve().parents[2]


class TrainOutput(NamedTuple):
    """What TRL's train() returns (transformers' TrainOutput)."""

    global_step: int
    training_loss: float
    metrics: dict


@functools.cache
def train_module():
    """train.py, loaded from its file beside the package (the loop lives there)."""
    path = ROOT / "train.py"
    loaded = sys.modules.get("train")
    if loaded is not None and Path(getattr(loaded, "__file__", "")).resolve() == path:
        return loaded
    if not path.is_file():
        raise ConfigError(
            f"GRPOTrainer runs train.py's loop and {path} is missing: use nanogrpo from its "
            "repository (pip install -e .)"
        )
    # run as a module another process finds its functions in (run/async_rollouts.py's pickles)
    return run_file(str(path), "train")


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


# -----------------------------------------------------------------------------
# Reading GRPOTrainer's arguments


def model_source(model, builds: bool) -> tuple[str, Transformer | None]:
    """-> (the model's path or hub id, the loaded nanogrpo model or None). builds: init_model
    creates the path."""
    if isinstance(model, Transformer):
        path = getattr(model, "name_or_path", None)
        if not path:
            raise ConfigError(
                "model: this nanogrpo model has no name_or_path (load_model sets it): set it to "
                "its checkpoint's path, where its tokenizer and the reference model load from"
            )
        if world_size() > 1:
            raise ConfigError(
                "model: under torchrun pass the model's path or hub id, not a loaded model: "
                "each process loads its FSDP2 shard"
            )
        return path, model
    if not isinstance(model, (str, os.PathLike)):
        raise ConfigError(
            f"model: a {type(model).__name__} is neither a path, a hub id nor a nanogrpo model: "
            "pass its checkpoint's path, or nanogrpo.checkpoint.load_model(path)"
        )
    path = os.fspath(model)
    if os.path.isdir(path) or builds:
        return path, None
    # checkpoint.resolve_path's rule, without the download
    looks_local = path.startswith((".", "/", "~")) or path.count("/") != 1
    if looks_local or os.path.isdir(path.split("/")[0]):
        raise ConfigError(
            f"model={path!r}: no such directory, and not a hub id like 'Qwen/Qwen2.5-0.5B'"
        )
    return path, None


def rows_of(dataset, name: str, needs_prompt: bool) -> tuple[str | None, list | None]:
    """A train_dataset or eval_dataset -> (the config's dataset name, its rows, checked). A str
    is a nanogrpo dataset (a file, hf://..., a built-in) that the run loads."""
    if dataset is None or isinstance(dataset, str):
        return dataset, None
    if isinstance(dataset, Mapping):  # a DatasetDict, or TRL's {name: dataset}
        raise ConfigError(
            f"{name}: a mapping of {len(dataset)} datasets ({', '.join(map(str, dataset))}); "
            "pass one: its rows, or e.g. dataset['train']"
        )
    try:
        rows = [dict(row) if isinstance(row, Mapping) else row for row in dataset]
    except TypeError:
        raise ConfigError(
            f"{name}: a {type(dataset).__name__} is not rows: pass a list of dicts, any "
            "iterable of them, or a datasets.Dataset"
        ) from None
    check_rows(rows, name, needs_prompt)
    check_text_only(rows, name)
    return name, rows


def reward_funcs_of(reward_funcs) -> list:
    """TRL's reward_funcs (one or a list; None with environment_factory) -> the config's list."""
    if reward_funcs is None:
        return []
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    for f in funcs:
        if isinstance(f, torch.nn.Module):
            raise ConfigError(
                f"reward_funcs: a loaded {type(f).__name__} is no reward function: pass a "
                "reward model's path or hub id (a *ForSequenceClassification checkpoint)"
            )
        if not (isinstance(f, str) or callable(f)):
            raise ConfigError(
                f"reward_funcs: {f!r} is neither a function nor a name (a built-in, "
                "module:function, or a reward model's path)"
            )
    return funcs


def processing_paths(classes) -> list | None:
    """TRL's reward_processing_classes (one, or one per reward function) -> their paths."""
    if classes is None:
        return None
    items = classes if isinstance(classes, (list, tuple)) else [classes]
    return [tokenizer_path(c, "reward_processing_classes") for c in items]


def tokenizer_path(tokenizer, name: str):
    """A tokenizer argument by its path: a str, or a transformers tokenizer's name_or_path."""
    if tokenizer is None:
        return None
    if isinstance(tokenizer, (str, os.PathLike)):
        return os.fspath(tokenizer)
    path = getattr(tokenizer, "name_or_path", None)
    if isinstance(path, str) and path:
        return path
    raise ConfigError(
        f"{name}: a {type(tokenizer).__name__} without a name_or_path: pass its path, "
        "where tokenizer.json is"
    )


# peft's LoraConfig field -> TrainConfig's (TRL's ModelConfig names)
LORA_FIELDS = {
    "r": "lora_r",
    "lora_alpha": "lora_alpha",
    "lora_dropout": "lora_dropout",
    "target_modules": "lora_target_modules",
    "modules_to_save": "lora_modules_to_save",
    "use_rslora": "use_rslora",
}
# LoraConfig's fields that describe the config, not the adapter
PEFT_RECORDS = {"peft_type", "task_type", "auto_mapping", "peft_version", "revision"}
PEFT_RECORDS |= {"base_model_name_or_path", "inference_mode", "megatron_core"}
PEFT_RECORDS |= {"qalora_group_size", "ensure_weight_tying", "init_lora_weights"}
OFF = (None, False, "", (), [], {})  # a LoraConfig field that asks for nothing


def lora_fields(peft_config) -> dict:
    """A peft LoraConfig (or a dict of its fields) -> TrainConfig's LoRA fields. A setting
    nanogrpo's LoRA lacks (use_dora, rank_pattern, ...) is refused by name."""
    if peft_config is None:
        return {}
    if hasattr(peft_config, "to_dict"):
        peft_config = peft_config.to_dict()
    if not isinstance(peft_config, Mapping):
        raise ConfigError(
            f"peft_config: a {type(peft_config).__name__}: pass peft's LoraConfig or a dict "
            "of its fields (r, lora_alpha, target_modules, ...)"
        )
    kind = peft_config.get("peft_type", "LORA")
    if str(getattr(kind, "value", kind)) != "LORA":
        raise ConfigError(f"peft_config: peft_type={kind!r}: nanogrpo trains LoRA adapters")
    if peft_config.get("task_type") is not None:
        TRANSLATED["lora_task_type"]("peft_config's task_type", peft_config["task_type"], False)
    if peft_config.get("init_lora_weights", True) is not True:
        raise ConfigError(
            f"peft_config: init_lora_weights={peft_config['init_lora_weights']!r}: nanogrpo "
            "starts adapters as PEFT's default (True) does"
        )
    fields = {"use_peft": True}
    for key, value in peft_config.items():
        if key in LORA_FIELDS:
            if isinstance(value, (set, frozenset, tuple)):
                value = sorted(value)  # LoraConfig holds target_modules as a set
            fields[LORA_FIELDS[key]] = value
        elif key in PEFT_RECORDS:
            continue
        elif value not in OFF and value != lora.UNSUPPORTED.get(key):
            raise ConfigError(f"peft_config: {key}={value!r}: {lora_lacks(key)}")
    return fields


def lora_lacks(key: str) -> str:
    why = REFUSED.get(key) or REFUSED.get(f"lora_{key}")
    return why or "nanogrpo's LoRA (extras/lora.py) does not have it: remove it"


def refuse_trl_only(callbacks, optimizers, quantization_config):
    """TRL's trainer arguments nanogrpo has not, refused in the command line's words unless
    off."""
    if callbacks:
        raise ConfigError(f"unsupported argument 'callbacks': {REFUSED['callbacks']}")
    if any(o is not None for o in optimizers or ()):
        raise ConfigError(f"unsupported argument 'optimizers': {REFUSED['optimizers']}")
    if quantization_config is not None:
        raise ConfigError(f"unsupported argument 'quantization_config': {NO_BITSANDBYTES}")


# -----------------------------------------------------------------------------
# The trainer


class GRPOTrainer:
    """TRL's GRPOTrainer over train.py: GRPOTrainer(model, reward_funcs, args, train_dataset,
    ...).train(). model: a checkpoint path or hub id, or a nanogrpo model; train_dataset and
    eval_dataset: a list of dicts, any iterable of rows, a datasets.Dataset, or a nanogrpo dataset
    name ("gsm8k", a .jsonl path); reward_funcs: functions in TRL's convention, or names;
    processing_class: a path, a nanogrpo Tokenizer or a transformers tokenizer (read from its
    name_or_path); peft_config: peft's LoraConfig or a dict of its fields; args: a GRPOConfig
    (TRL's own too, read by its to_dict()), whose model, dataset, eval_dataset and reward_funcs
    (nanogrpo's own fields) these replace."""

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: TrainConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
    ):
        refuse_trl_only(callbacks, optimizers, quantization_config)
        builds = args is not None and getattr(args, "init_model", None) is not None
        path, self.model = model_source(model, builds)
        if args is None:  # TRL's default output_dir
            args = GRPOConfig(f"{os.path.basename(path.rstrip('/'))}-GRPO")
        if not isinstance(args, TrainConfig) and callable(getattr(args, "to_dict", None)):
            args = GRPOConfig(**args.to_dict())  # TRL's own GRPOConfig, by its fields
        if not isinstance(args, TrainConfig):
            raise ConfigError(f"args: a {type(args).__name__}: pass a nanogrpo GRPOConfig")
        factory = environment_factory or args.environment_factory
        dataset, self.train_dataset = rows_of(train_dataset, "train_dataset", factory is None)
        eval_name, self.eval_dataset = rows_of(eval_dataset, "eval_dataset", factory is None)
        passed = dict(tools=tools, rollout_func=rollout_func, environment_factory=factory)
        cfg = dataclasses.replace(
            args,
            model=path,
            dataset=dataset,
            eval_dataset=eval_name,
            reward_funcs=reward_funcs_of(reward_funcs),
            reward_processing_classes=processing_paths(reward_processing_classes),
            **{k: v for k, v in passed.items() if v is not None},
            **lora_fields(peft_config),
        )
        if self.eval_dataset is not None:  # TRL evaluates all of it
            cfg = dataclasses.replace(cfg, eval_size=len(self.eval_dataset))
        self.args = cfg.validate(world_size())
        self.processing_class = processing_class
        if processing_class is not None and not isinstance(processing_class, Tokenizer):
            self.processing_class = tokenizer_path(processing_class, "processing_class")
        self.state = TrainerState()
        self.trained = False  # under torchrun, the process group ends with the first train()

    # --- what setup is given --------------------------------------------------

    def tokenizer(self) -> Tokenizer:
        """processing_class as a Tokenizer (loaded once), else the model's."""
        if not isinstance(self.processing_class, Tokenizer):
            self.processing_class = Tokenizer.from_pretrained(
                self.processing_class or self.args.model
            )
        return self.processing_class

    def load_policy(self, path, cfg: TrainConfig, info, lora_settings=None):
        """trainer.setup's loader: the model held (given, or trained by an earlier train()) on
        the run's device, with LoRA adapters if asked and it has none; else trainer.load_policy's
        (a path, or the checkpoint a run resumes). trainer.model is the result."""
        if self.trained and info.sharded:
            raise ConfigError(
                "under torchrun a GRPOTrainer trains once (its process group ends with the "
                "run): make a new one, its model the run's last checkpoint"
            )
        if self.model is None or path != cfg.model:
            self.model = load_policy(path, cfg, info, lora_settings)
            return self.model
        self.model.to(info.device)
        if lora_settings and not hasattr(self.model, "lora_config"):
            lora.apply_lora(self.model, **lora_settings)
            # adapter_config.json's base, as checkpoint.load_model records it
            local = os.path.isdir(path)
            self.model.base_model_name_or_path = os.path.abspath(path) if local else path
        self.model.cast_lm_head_to_fp32 = cfg.cast_lm_head_to_fp32
        return self.model

    def given(self, eval_rows=None) -> Given:
        """What setup takes from this trainer; without a processing_class, setup loads the
        model's tokenizer (once run.start has built an init_model's)."""
        return Given(
            rows=self.train_dataset,
            eval_rows=eval_rows or self.eval_dataset,
            tokenizer=None if self.processing_class is None else self.tokenizer(),
            load_policy=self.load_policy,
        )

    # --- TRL's methods ----------------------------------------------------------

    def train(self, resume_from_checkpoint=None) -> TrainOutput:
        """Train as `python train.py` would with these settings (the same train.train). ->
        TrainOutput(global_step, training_loss: the mean step loss, metrics); self.state's
        log_history holds the logged records (metrics.jsonl's, eval keys as eval_*)."""
        cfg = self.args
        if resume_from_checkpoint is not None:
            cfg = dataclasses.replace(cfg, resume_from_checkpoint=resume_from_checkpoint)
        started = time.time()
        history = train_module().train(cfg, sys.argv[:1] or None, given=self.given())
        self.trained = True
        runtime = time.time() - started
        steps = [m for m in history if "loss" in m]
        step = steps[-1]["step"] if steps else 0
        loss = math.fsum(m["loss"] for m in steps) / len(steps) if steps else 0.0
        epoch = steps[-1].get("epoch", 0.0) if steps else 0.0
        metrics = {
            "train_runtime": runtime,
            "train_steps_per_second": len(steps) / runtime,
            "train_loss": loss,
            "epoch": epoch,
        }
        self.state = TrainerState(
            epoch=epoch,
            global_step=step,
            max_steps=step,
            log_history=self.logged() + [{**metrics, "step": step}],
        )
        return TrainOutput(global_step=step, training_loss=loss, metrics=metrics)

    def logged(self) -> list[dict]:
        """metrics.jsonl's records (rank 0 wrote them), eval/<name> as TRL's eval_<name>."""
        path = os.path.join(self.args.output_dir, "metrics.jsonl")
        if not os.path.exists(path):
            return []
        with open(path) as f:
            return [trl_names(json.loads(line)) for line in f if line.strip()]

    def evaluate(self, eval_dataset=None) -> dict:
        """eval_dataset (or the trainer's) scored as training's evaluation scores it: train.py's
        evaluate on the current model. -> its metrics as TRL names them (eval_reward,
        eval_loss, ...)."""
        cfg = self.args
        name, rows = cfg.eval_dataset, self.eval_dataset
        if eval_dataset is not None:
            needs_prompt = cfg.environment_factory is None
            name, rows = rows_of(eval_dataset, "eval_dataset", needs_prompt)
        if name is None:
            raise ConfigError("evaluate() needs an eval_dataset: pass one here or to GRPOTrainer")
        cfg = dataclasses.replace(cfg, eval_dataset=name, eval_on_start=True)
        if rows is not None:
            cfg = dataclasses.replace(cfg, eval_size=len(rows))
        train = train_module()
        info = dist.setup(cfg.device, cfg.ddp_timeout)
        cfg.validate(info.launched)
        t = setup(cfg, info, kernels=train.kernels(cfg), given=self.given(rows))
        return trl_names(train.evaluate(t))

    def save_model(self, output_dir: str | None = None):
        """The model and its tokenizer as a Hugging Face checkpoint (with LoRA: the adapter, in
        PEFT's files) in output_dir, else args.output_dir."""
        out = output_dir or self.args.output_dir
        if self.trained and dist.fsdp_modules(self.model):
            # the run's process group is gone: its last checkpoint is this model
            if int(os.environ.get("RANK", "0")) == 0:
                last = os.path.realpath(os.path.join(self.args.output_dir, "checkpoint"))
                ignore = shutil.ignore_patterns("trainer", "train_config.json")
                shutil.copytree(last, out, ignore=ignore, dirs_exist_ok=True)
            return
        if self.model is None:
            raise ConfigError("save_model: no model yet: train() or evaluate() loads it")
        checkpoint.save_model(self.model, out, tokenizer=self.tokenizer())


def trl_names(record: dict) -> dict:
    """nanogrpo's eval/<name> metrics under TRL's keys, eval_<name>."""
    return {trl_name(key): value for key, value in record.items()}


def trl_name(key: str) -> str:
    return "eval_" + key.removeprefix("eval/") if key.startswith("eval/") else key
