"""Every training setting in one dataclass, loaded from a Python config file plus command-line overrides.

Owns: `TrainConfig` (fields, defaults, checks), `Schedule` (batch arithmetic), `load_config(argv)`.

Does not know about: what the settings do; train.py and the modules it calls read them.

Choices:
- A config file is plain Python assigning names (`learning_rate = 1e-5`); command-line
  `--key=value` (or `--key value`) overrides it. Every value is converted to and checked against
  the field's annotated type, and unknown keys are errors with a spelling suggestion, so a typo never
  silently trains with a default (nanoGPT's configurator accepts anything).
- Loss fields use TRL's GRPOConfig names and defaults, so TRL recipes carry over.
- Batch sizes are counted in prompts and completions, not TRL's per-device batches: you choose
  `prompts_per_step` (all ranks together), `num_generations` and `micro_batch_size`; Schedule derives
  the rest (whole groups per rank, gradient accumulation), and every run prints it.
"""

import ast
import dataclasses
import difflib
import math
import os
import sys
import types
import typing
from dataclasses import dataclass, field

from nanogrpo.grpo import AGGREGATIONS, SCALE_REWARDS, LossConfig
from nanogrpo.sampler import check_sampling
from nanogrpo.tools import TOOL_CALL_PARSERS


class ConfigError(ValueError):
    """A config key is unknown, has the wrong type, or is inconsistent with the others."""


CHOICES = {"dtype": ("float32", "bfloat16", "auto"), "scale_rewards": SCALE_REWARDS,
           "multi_objective_aggregation": AGGREGATIONS, "lr_scheduler": ("constant", "cosine"),
           "tool_call_format": tuple(TOOL_CALL_PARSERS)}
RANGES = [  # (rule, message, fields): each range rule of TrainConfig once; the loss's own live in LossConfig
    (lambda v: v >= 1, "must be at least 1", "prompts_per_step micro_batch_size num_iterations max_completion_length "
     "max_steps log_every ref_model_sync_steps eval_size lora_r steps_per_generation max_tool_calling_iterations "
     "save_total_limit soft_punish_cache".split()),
    (lambda v: v >= 0, "must be >= 0 (0 = off)", "learning_rate weight_decay warmup_steps eval_every save_every".split()),
    (lambda v: v > 0, "must be > 0", ["lora_alpha", "max_grad_norm", "tool_timeout"]),
    (lambda v: 0 <= v < 1, "must be in [0, 1)", ["adam_beta1", "adam_beta2", "warmup_ratio", "lora_dropout"]),
    (lambda v: 0 <= v <= 1, "must be in [0, 1]", ["ref_model_mixup_alpha"])]
REPORTERS = ("none", "tensorboard", "wandb", "trackio")
LOSS_FIELDS = tuple(f.name for f in dataclasses.fields(LossConfig))  # TrainConfig has each, same name and default


@dataclass
class TrainConfig:
    """All settings of a run; see the comment on each field."""

    # model
    model: str = "tiny"  # checkpoint dir or hub id (the config file decides what the tiny default is)
    init_model: dict | None = None  # ModelConfig fields: create a random model at `model` if it does not exist
    init_tokenizer_chars: str = "abcdefgh="  # with init_model: the characters of its char-level tokenizer
    dtype: str = "float32"  # compute dtype: float32 | bfloat16 (autocast, fp32 weights) | auto (bf16 on CUDA)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    seed: int = 1337  # seeds init, prompt order and sampling
    gradient_checkpointing: bool = False  # recompute activations in backward to save memory
    # LoRA (TRL's ModelConfig names)
    use_peft: bool = False  # train LoRA adapters (nanogrpo/lora.py) instead of every weight; base frozen
    lora_r: int = 16  # adapter rank
    lora_alpha: int = 32  # adapter scaling = lora_alpha / lora_r
    lora_dropout: float = 0.05  # dropout on each adapter's input
    lora_target_modules: list[str] | str | None = None  # None = q_proj, v_proj (PEFT's default); "all-linear"
    lora_modules_to_save: list[str] | None = None  # trained in full and saved with the adapter: embed_tokens, lm_head
    use_rslora: bool = False  # rank-stabilized scaling lora_alpha / sqrt(lora_r)
    merge_adapter: bool = False  # at the end, also write the adapter merged into a full HF checkpoint (out_dir/merged)
    # data
    dataset: str = "default"  # see data.load_dataset: file, hf://datasets/..., gsm8k, default, countdown
    dataset_split: str | None = None  # split for gsm8k / procedural tasks (None = "train")
    eval_dataset: str | None = None  # same forms as dataset; None = no evaluation
    eval_split: str | None = "test"  # split of eval_dataset
    eval_size: int = 256  # evaluate on the first this-many eval prompts
    # rewards
    reward_funcs: list[str] = field(default_factory=lambda: ["default_task"])  # built-in, module:function, reward model
    reward_weights: list[float] | None = None  # one per reward function; None = all 1.0
    reward_processing_classes: list[str | None] | None = None  # per reward model: its tokenizer; None = its own
    soft_punish_cache: int | None = None  # soft_overlong reward's window (None = max_completion_length // 4)
    # batch
    num_generations: int = 8  # completions per prompt (G), at least 2
    prompts_per_step: int = 16  # prompts per optimizer step, all ranks together
    micro_batch_size: int = 32  # completions per forward/backward on one rank
    num_iterations: int = 1  # optimizer passes over each generated batch (mu)
    steps_per_generation: int | None = None  # TRL's: micro-batches per rank per generation round; None = 1 step's
    # generation
    max_completion_length: int = 512  # new tokens per completion, also dr_grpo's constant
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # nucleus sampling, in (0, 1]
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    torch_compile: bool = False  # compile the decode step (sampler.generate(torch_compile=)): CUDA graphs on GPU
    # tools (TRL's names): functions the policy may call mid-completion; see rollout.py
    tools: list[str] = field(default_factory=list)  # "module:function" or "path/to/file.py:function"
    max_tool_calling_iterations: int | None = None  # tool rounds per completion; None = until no row calls one
    tool_timeout: float = 30.0  # seconds an async tool may run before its result is {"error": ...}
    tool_call_format: str = "hermes"  # how calls are written in the text: a key of tools.TOOL_CALL_PARSERS
    # loss (TRL GRPOConfig names and defaults)
    loss_type: str = "dapo"  # grpo | dr_grpo | dapo | bnpo | cispo | sapo | luspo | vespo
    beta: float = 0.0  # KL coefficient; 0 = no reference model
    epsilon: float = 0.2  # lower clip range
    epsilon_high: float | None = None  # upper clip range (None = epsilon); cispo's weight cap
    delta: float | None = None  # INTELLECT-2 upper bound on the ratio, None = off
    importance_sampling_level: str = "token"  # token | sequence (GSPO)
    sapo_temperature_pos: float = 1.0  # sapo gate temperature, positive advantages
    sapo_temperature_neg: float = 1.05  # sapo gate temperature, non-positive advantages
    vespo_k_pos: float = 2.0  # vespo power, positive advantages
    vespo_lambda_pos: float = 3.0  # vespo decay, positive advantages
    vespo_k_neg: float = 3.0  # vespo power, negative advantages
    vespo_lambda_neg: float = 2.0  # vespo decay, negative advantages
    use_bias_correction_kl: bool = True  # multiply the KL term by the importance ratio
    top_entropy_quantile: float = 1.0  # keep the top-rho tokens by entropy in the loss, 1 = all
    scale_rewards: str = "group"  # group | batch | none: what the advantage is divided by
    multi_objective_aggregation: str = "sum_then_normalize"  # or normalize_then_sum (GDPO)
    mask_truncated_completions: bool = False  # drop completions that hit max_completion_length from the loss
    # optimizer (AdamW)
    learning_rate: float = 1e-6  # peak learning rate
    adam_beta1: float = 0.9  # AdamW beta1
    adam_beta2: float = 0.99  # AdamW beta2
    adam_epsilon: float = 1e-8  # AdamW epsilon
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    warmup_steps: int = 0  # linear warmup steps (overrides warmup_ratio when > 0)
    warmup_ratio: float = 0.0  # linear warmup as a fraction of max_steps
    lr_scheduler: str = "constant"  # constant | cosine (to 0 at max_steps), after warmup
    max_grad_norm: float | None = 1.0  # gradient clipping; None = off
    # reference model (beta > 0)
    sync_ref_model: bool = False  # TR-DPO: pull the reference model toward the policy
    ref_model_mixup_alpha: float = 0.6  # ref = alpha * policy + (1 - alpha) * ref
    ref_model_sync_steps: int = 512  # optimizer steps between syncs
    # run
    max_steps: int = 150  # optimizer steps
    eval_every: int = 0  # steps between evaluations, 0 = never
    log_every: int = 1  # steps between log lines
    save_every: int = 500  # steps between checkpoints (TRL's save_steps), 0 = only at the end; also on Ctrl-C
    save_total_limit: int | None = None  # keep the newest this-many checkpoints this run wrote; None = all (TRL)
    log_completions: bool = False  # print a sample of completions at each log step
    out_dir: str = "out"  # checkpoints, config.json and logs
    resume: bool | str = False  # True = latest checkpoint in out_dir, or a checkpoint path
    overwrite_output_dir: bool = False  # start over in an out_dir holding a run (deletes its checkpoints and logs)
    report_to: str = "none"  # none | tensorboard | wandb | trackio, or several comma-separated (TRL's name)

    def schedule(self, world_size: int = 1) -> "Schedule":
        """Every count derived from the batch settings on `world_size` ranks (call validate first)."""
        per_rank = self.prompts_per_step * self.num_generations // world_size
        micro_per_step = per_rank // self.micro_batch_size
        spg = self.steps_per_generation or micro_per_step
        steps = spg // micro_per_step
        return Schedule(world_size, self.num_generations, self.prompts_per_step, per_rank, self.micro_batch_size,
                        micro_per_step, spg, steps, self.num_iterations, self.prompts_per_step * steps,
                        per_rank * steps, steps * self.num_iterations, steps * self.num_iterations > 1)

    # --- checks and conversions ---------------------------------------------------------------

    def validate(self, world_size: int = 1) -> "TrainConfig":
        """Raise ConfigError naming the first inconsistent setting; returns self."""

        def need(ok, key, why):
            if not ok:
                raise ConfigError(f"{key}={getattr(self, key)!r}: {why}")

        for key, allowed in CHOICES.items():
            need(getattr(self, key) in allowed, key, f"must be one of {list(allowed)}")
        for ok, why, keys in RANGES:  # None passes where the field allows it (its comment says what None means)
            for key in keys:
                need(getattr(self, key) is None or ok(getattr(self, key)), key, why)
        d = self.device
        need(d in ("auto", "cpu", "cuda") or (d.startswith("cuda:") and d[5:].isdigit()), "device",
             "must be auto, cpu, cuda or cuda:N")
        need(self.num_generations >= 2, "num_generations", "GRPO needs at least 2 completions per prompt")
        need(self.prompts_per_step % world_size == 0, "prompts_per_step",
             f"must be divisible by world_size={world_size} so each rank holds whole groups")
        rows = self.prompts_per_step * self.num_generations // world_size
        need(rows % self.micro_batch_size == 0, "micro_batch_size",
             f"must divide the {rows} completions per rank (prompts_per_step * num_generations / world_size)")
        micro_per_step = rows // self.micro_batch_size
        need(self.steps_per_generation is None or self.steps_per_generation % micro_per_step == 0,
             "steps_per_generation", f"counts micro-batches per round, as in TRL: it must be a multiple of the "
             f"{micro_per_step} micro-batches of one optimizer step on each rank")
        try:  # the sampler's and the loss's own rules, not restated here
            check_sampling(self.temperature, self.top_k, self.top_p, self.min_p, self.repetition_penalty)
            LossConfig(**self.loss_config())
        except ValueError as e:
            raise ConfigError(str(e).removeprefix("LossConfig.")) from None
        need(len(self.reward_funcs) >= 1, "reward_funcs", "needs at least one reward function")
        for key in ("reward_weights", "reward_processing_classes"):
            need(getattr(self, key) is None or len(getattr(self, key)) == len(self.reward_funcs), key,
                 f"needs one entry per reward function ({len(self.reward_funcs)}); reward_processing_classes "
                 "holds None where a function is not a reward model")
        need(self.soft_punish_cache is None or self.soft_punish_cache <= self.max_completion_length,
             "soft_punish_cache", "must be in [1, max_completion_length]")
        need(not self.sync_ref_model or self.beta > 0, "sync_ref_model", "needs beta > 0 (a reference model)")
        need(not (self.sync_ref_model and self.use_peft), "sync_ref_model", "is refused with use_peft, as TRL does")
        need(not self.merge_adapter or self.use_peft, "merge_adapter", "needs use_peft=true (an adapter to merge)")
        need(all(r in REPORTERS for r in self.reporters()), "report_to", f"takes names from {list(REPORTERS)}")
        return self

    def reporters(self) -> list[str]:
        """The experiment trackers report_to names ("none" = only metrics.jsonl and the console)."""
        return [r.strip() for r in self.report_to.split(",") if r.strip() not in ("", "none")]

    def bf16(self, device) -> bool:
        """Whether to compute in bfloat16 on `device` (a torch.device or string)."""
        return self.dtype == "bfloat16" or (self.dtype == "auto" and str(device).startswith("cuda"))

    def lora_settings(self) -> dict | None:
        """Keyword arguments for nanogrpo.lora.apply_lora (PEFT's names), or None without use_peft."""
        targets = "all-linear" if self.lora_target_modules == ["all-linear"] else self.lora_target_modules
        return {"r": self.lora_r, "lora_alpha": self.lora_alpha, "lora_dropout": self.lora_dropout,
                "target_modules": targets, "modules_to_save": self.lora_modules_to_save,
                "use_rslora": self.use_rslora} if self.use_peft else None

    def loss_config(self) -> dict:
        """Keyword arguments for nanogrpo.grpo.LossConfig (TRL's names): `LossConfig(**cfg.loss_config())`."""
        return {key: getattr(self, key) for key in LOSS_FIELDS}


@dataclass(frozen=True)
class Schedule:
    """What one optimizer step and one generation round are, on every rank: the counts the loop,
    grpo_step's scaling, the replay order and the logs all read. TRL's names where TRL has them."""

    world_size: int
    num_generations: int  # G completions per prompt
    prompts_per_step: int  # prompts per optimizer step, all ranks together
    completions_per_step_per_rank: int
    micro_batch_size: int  # completions per forward/backward
    micro_batches_per_step: int  # gradient accumulation steps, on each rank
    steps_per_generation: int  # TRL's: micro-batches per generation round, on each rank
    optimizer_steps_per_generation: int  # optimizer steps one round's samples feed, in one pass
    num_iterations: int  # passes over each round's samples (TRL's mu)
    prompts_per_round: int  # prompts sampled per generation round, all ranks together
    completions_per_round_per_rank: int
    updates_per_round: int  # optimizer steps per round: optimizer_steps_per_generation x num_iterations
    off_policy: bool  # the policy changes between sampling and some update: old log-probs are needed

    def replay_order(self) -> list[int]:
        """The first micro-batch of each optimizer step of a round, in order: the round's micro-batches
        in step-sized slices, the whole sequence repeated num_iterations times."""
        one_pass = list(range(0, self.steps_per_generation, self.micro_batches_per_step))
        return one_pass * self.num_iterations

    def table(self) -> str:
        """A short table for the start of a run: what one step and one round are."""
        rows = [("ranks", self.world_size),
                ("prompts x completions per optimizer step (all ranks)", f"{self.prompts_per_step} x "
                 f"{self.num_generations}"), ("completions per step per rank", self.completions_per_step_per_rank),
                (f"micro-batches per step per rank (of {self.micro_batch_size} completions)", self.micro_batches_per_step),
                ("micro-batches per generation round per rank (steps_per_generation)", self.steps_per_generation),
                ("prompts sampled per round (all ranks)", self.prompts_per_round),
                ("passes over each round (num_iterations)", self.num_iterations),
                ("optimizer steps per round", self.updates_per_round),
                ("old log-probs (off-policy)", "yes" if self.off_policy else "no: ratio is exactly 1")]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


# -----------------------------------------------------------------------------
# loading: config file, then --key=value overrides


FIELD_TYPES = typing.get_type_hints(TrainConfig)
CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def _unknown_keys(keys: list[tuple[str, str]]) -> ConfigError:
    """One error naming every unknown key (key, where) at once."""
    lines = []
    for key, where in keys:
        close = difflib.get_close_matches(key, FIELD_TYPES, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        lines.append(f"{key!r} {where}{hint}")
    return ConfigError(f"{len(lines)} unknown config key(s): " + "; ".join(lines))


def _literal(key: str, text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError) as e:
        raise ConfigError(f"{key}={text!r}: not a Python literal ({e})") from e


def convert(key: str, value, tp=None, from_text: bool = False):
    """`value` as field `key`'s type; strings from the command line are parsed (from_text=True)."""
    tp = FIELD_TYPES[key] if tp is None else tp
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        if type(None) in args and (value is None or (from_text and str(value).lower() in ("none", "null"))):
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # Optional[X]: X's own, more specific, error
            return convert(key, value, options[0], from_text)
        for option in options:
            try:
                return convert(key, value, option, from_text)
            except ConfigError:
                pass
        raise ConfigError(f"{key}={value!r}: expected {tp}")
    if tp is dict:
        if from_text and isinstance(value, str) and value.strip().startswith("{"):
            value = _literal(key, value)
        if isinstance(value, dict):
            return dict(value)
        raise ConfigError(f"{key}={value!r}: expected a dict")
    if typing.get_origin(tp) is list:
        if from_text and isinstance(value, str):
            text = value.strip()
            value = _literal(key, text) if text[:1] in "[(" else [v.strip() for v in text.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r}: expected a list")
        return [convert(key, v, args[0], from_text) for v in value]
    if tp is bool:
        if from_text and isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        if isinstance(value, bool):
            return value
    elif tp in (int, float):
        if from_text and isinstance(value, str):
            try:
                value = tp(value)
            except ValueError:
                pass
        accepted = (int, float) if tp is float else int  # an int is a fine float, not vice versa
        if isinstance(value, accepted) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(f"{key}={value!r}: must be a finite number")
            return tp(value)
    elif tp is str and isinstance(value, str):
        return value
    raise ConfigError(f"{key}={value!r}: expected {getattr(tp, '__name__', tp)}")


def config_path(name: str) -> str:
    """The file a --config value names. A path (with a '/', e.g. ./tiny.py)
    is that file. A bare name ('tiny', 'small.py') is a built-in config of
    configs/ when one has that name (a file of the same name in the current
    directory does not replace it: a note says so), else the file of that
    name. A config is Python: anything but a .py file is refused."""
    builtin_name = name if name.endswith(".py") else name + ".py"
    builtin = os.path.join(CONFIGS_DIR, builtin_name)
    is_path = "/" in name or os.sep in name
    if not is_path and os.path.isfile(builtin):
        if os.path.isfile(builtin_name) and os.environ.get("RANK", "0") == "0":
            print(f"note: --config {name} is the built-in {builtin}; the "
                  f"{builtin_name} in this directory is not used (pass "
                  f"--config ./{builtin_name} for it)", file=sys.stderr)
        return builtin
    if os.path.splitext(name)[1] not in ("", ".py"):
        raise ConfigError(
            f"config {name!r} is not a .py file: a config is Python that "
            "sets TrainConfig's keys (see configs/); data goes in "
            "--dataset=...")
    if name.endswith(".py") and os.path.isfile(name):
        return name
    known = sorted(f[:-3] for f in os.listdir(CONFIGS_DIR) if f.endswith(".py"))
    raise ConfigError(f"config {name!r} not found: not a file, nor one of the "
                      f"built-in configs {known} in {CONFIGS_DIR}")


def read_config_file(name: str) -> dict:
    """Names a config file assigns (skipping _private names, modules, functions and classes).
    A config file is Python and is executed as code, like a reward-function file: run only your own."""
    path = config_path(name)
    namespace: dict = {}
    with open(path) as f:
        exec(compile(f.read(), path, "exec"), namespace)
    return {k: v for k, v in namespace.items() if not k.startswith("_")
            and not isinstance(v, (types.ModuleType, types.FunctionType, type))}


def load_config(argv: list[str] | None = None) -> TrainConfig:
    """`[--config FILE] [--key=value | --key value | --bool_key] ...` -> a validated TrainConfig.

    Command-line values override the file's; keys may use dashes for underscores. Two file settings
    do not follow a command-line change they were not written for, unless the command line names them
    too: a new `--model` drops the file's `init_model` (a random model is built only where asked), and
    a new `--dataset` drops the file's `eval_dataset` (an eval set of another task)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pairs, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; use --key=value")
        key, eq, value = arg[2:].partition("=")
        key = key.replace("-", "_")
        if not eq:
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value, i = argv[i + 1], i + 1
            elif FIELD_TYPES.get(key) is bool:
                value = "true"
            else:
                raise ConfigError(f"--{key} needs a value")
        pairs.append((key, value))
        i += 1
    settings, from_file = {}, {}
    command_line = {key: value for key, value in pairs if key != "config"}  # the last of repeated keys wins
    unknown = []
    files = {name: read_config_file(name) for name in [value for key, value in pairs if key == "config"]}
    for name, values in files.items():
        unknown += [(key, f"in config file {name}") for key in values if key not in FIELD_TYPES]
    unknown += [(key, "on the command line") for key in command_line if key not in FIELD_TYPES]
    if unknown:
        raise _unknown_keys(unknown)
    for name, values in files.items():
        for key, value in values.items():
            settings[key] = from_file[key] = convert(key, value)
    for key, value in command_line.items():
        settings[key] = convert(key, value, from_text=True)
    for key, follows in (("model", "init_model"), ("dataset", "eval_dataset")):
        if key in command_line and follows not in command_line and from_file.get(follows) is not None \
                and settings[key] != from_file.get(key):
            settings[follows] = None
            if follows == "eval_dataset" and os.environ.get("RANK", "0") == "0":
                print(f"note: --dataset={settings[key]} replaces the config file's dataset, so its eval_dataset="
                      f"{from_file[follows]!r} (another task) is not used; pass --eval_dataset=... to evaluate", file=sys.stderr)
    return TrainConfig(**settings).validate()
