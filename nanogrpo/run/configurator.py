"""Reading a run's settings: a config file, then `--key=value` overrides.

Owns: `load_config(argv)`, which values run without `--config`
(`default_config`), `read_config_file` (Python, or YAML as TRL's CLI reads
it), which file a `--config` name means (`config_path`), converting text to
each field's type (`convert`), TRL's names that TrainConfig spells otherwise
or lacks (`ALIASES`, `TRANSLATED`, `NO_EFFECT`, `REFUSED`), the error that
names every unknown key at once (`check_known`), and `train.py --help`
(`help_text`, from each field's metadata["help"]).

Does not know about: what a setting does, the model, tokenization, or files
beyond the config file. The rules between fields are run/config.py's
(TrainConfig.validate, which load_config calls).

Choices:
- A config file is plain Python assigning names (`learning_rate = 1e-5`),
  as nanoGPT's configurator; command-line `--key=value` (or `--key value`)
  overrides it. Every value is converted to and checked against the field's
  annotated type, and unknown keys are errors with a spelling suggestion
  (all of them at once), so a typo never silently trains with a default
  (nanoGPT's configurator accepts anything).
- A built-in name (`--config tiny.py`) means configs/tiny.py; a path with a
  directory (`./tiny.py`) means that file, and a note says when a local file
  of a built-in's name is not the one that runs.
- Without `--config`, the values that run follow one rule, said in a note:
  no model named either -> the embedded default configs/tiny.py (so
  `python train.py` trains offline); a model named -> TrainConfig's
  defaults, which are TRL's. `--help` prints the values that would run.
- A TRL user's names work: ScriptArguments' and ModelConfig's spellings
  (`model_name_or_path`, `dataset_name`, `dtype`, ...) are translated, a
  TrainingArguments setting that changes nothing here is accepted with a
  note, and one nanogrpo cannot honour is refused with the reason, unless
  its value is off (False, None, empty: it asks for nothing).
"""

import ast
import difflib
import math
import os
import sys
import textwrap
import types
import typing
from dataclasses import fields

from nanogrpo.run.config import FALSE_WORDS, TRUE_WORDS, ConfigError, TrainConfig

FIELD_TYPES = typing.get_type_hints(TrainConfig)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS_DIR = os.path.join(ROOT, "configs")


def note(message: str, file=None):
    """A line on stderr (or `file`), from rank 0 only (torchrun's RANK: the
    process group does not exist yet while the config loads)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"note: {message}", file=file or sys.stderr)


def _unknown_key(key: str, where: str) -> str:
    why = refusal(key)
    if why:
        return f"{key!r} {where}: {why}"
    close = difflib.get_close_matches(key, FIELD_TYPES, n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    return f"{key!r} {where}{hint}"


def is_read(key: str, value, from_text: bool) -> bool:
    """Whether load_config reads `key` = `value`: a TrainConfig field, a TRL
    name it translates or accepts, or a refused TRL setting whose value is
    off (it asks for nothing)."""
    if key in FIELD_TYPES or key in ALIASES or key in TRANSLATED:
        return True
    if key in NO_EFFECT or key.startswith("vllm_"):
        return True
    return refusal(key) is not None and is_off(value, from_text)


def is_off(value, from_text: bool) -> bool:
    """False, None or empty (or their text): a setting that asks for nothing."""
    if from_text and isinstance(value, str):
        return value.strip().lower() in FALSE_WORDS + ("none", "null", "", "[]", "{}")
    return value is None or value is False or value in ("", [], {}, ())


def check_known(entries: list[tuple[str, object, str, bool]]):
    """One ConfigError naming every unknown key of (key, value, where,
    from_text) entries, each with its closest field, so nine typos need one
    run, not nine."""
    bad = [k for k, v, _, text in entries if not is_read(k, v, text)]
    unknown = [_unknown_key(k, where) for k, v, where, text in entries if not is_read(k, v, text)]
    if len(unknown) == 1:
        kind = "unsupported" if refusal(bad[0]) else "unknown"
        raise ConfigError(f"{kind} config key {unknown[0]}")
    if unknown:
        lines = "\n  ".join(unknown)
        raise ConfigError(f"{len(unknown)} unknown config keys:\n  {lines}")


def _literal(key: str, text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError) as e:
        raise ConfigError(f"{key}={text!r}: not a Python literal ({e})") from e


def _convert_union(key, value, tp, from_text):
    args = typing.get_args(tp)
    none_text = from_text and str(value).lower() in ("none", "null")
    if type(None) in args and (value is None or none_text):
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


def _convert_list(key, value, item_type, from_text):
    if from_text and isinstance(value, str):
        text = value.strip()
        if text[:1] in "[(":
            value = _literal(key, text)
        else:  # a,b,c
            value = [v.strip() for v in text.split(",") if v.strip()]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{key}={value!r}: expected a list")
    return [convert(key, v, item_type, from_text) for v in value]


def _convert_number(key, value, tp, from_text):
    if from_text and isinstance(value, str):
        try:
            value = tp(value)
        except ValueError:
            pass
    accepted = (int, float) if tp is float else int  # an int is a fine float
    if not isinstance(value, accepted) or isinstance(value, bool):
        raise ConfigError(f"{key}={value!r}: expected {tp.__name__}")
    if not math.isfinite(value):
        raise ConfigError(f"{key}={value!r}: must be a finite number")
    return tp(value)


def convert(key: str, value, tp=None, from_text: bool = False):
    """`value` as field `key`'s type; strings from the command line are
    parsed (from_text=True)."""
    tp = FIELD_TYPES[key] if tp is None else tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return _convert_union(key, value, tp, from_text)
    if typing.get_origin(tp) is list:
        return _convert_list(key, value, typing.get_args(tp)[0], from_text)
    if tp is list:  # reward_funcs, tools: names, or functions of the config file
        value = _convert_list(key, value, str | typing.Callable, from_text)
        return value
    if tp in (int, float):
        return _convert_number(key, value, tp, from_text)
    if tp is dict:
        text = from_text and isinstance(value, str)
        if text and value.strip().startswith("{"):
            value = _literal(key, value)
        if isinstance(value, dict):
            return dict(value)
        raise ConfigError(f"{key}={value!r}: expected a dict")
    if tp is bool:
        words = TRUE_WORDS + FALSE_WORDS
        if from_text and isinstance(value, str) and value.lower() in words:
            return value.lower() in TRUE_WORDS
        if isinstance(value, bool):
            return value
    if tp is str and isinstance(value, str):
        return value
    if tp is typing.Callable and callable(value) and not from_text:
        return value
    raise ConfigError(f"{key}={value!r}: expected {getattr(tp, '__name__', tp)}")


YAML = (".yaml", ".yml")


def config_path(name: str) -> str:
    """The file a --config value names. A config is a Python (.py) file,
    or a YAML one as TRL's CLI reads; any other name is refused.

    - A name with a '/' (`./tiny.py`, `runs/a.py`) is that file.
    - A bare name (`tiny`, `tiny.py`) is the built-in configs/<name>.py
      when there is one, so the default run never executes a tiny.py that
      happens to lie in the current directory; when one does, a note says
      that the built-in runs and how to run yours (`--config ./tiny.py`).
    - Any other bare `name.py` is the file in the current directory.
    """
    ext = os.path.splitext(name)[1]
    is_path = "/" in name or os.sep in name
    if ext not in (".py",) + YAML and (ext or is_path):
        raise ConfigError(
            f"config {name!r} is not a .py or .yaml file: a config "
            "is Python assigning settings (see configs/tiny.py), "
            "or a YAML mapping of them as `trl grpo --config` reads"
        )
    file = name if ext else name + ".py"
    if not is_path:
        builtin = os.path.join(CONFIGS_DIR, file)
        if os.path.isfile(builtin):
            if os.path.isfile(file):
                note(
                    f"--config {name} runs the built-in {builtin}, not "
                    f"./{file}; for yours, pass --config ./{file}"
                )
            return builtin
    if os.path.isfile(file):
        return file
    known = sorted(f[:-3] for f in os.listdir(CONFIGS_DIR) if f.endswith(".py"))
    raise ConfigError(
        f"config {name!r} not found: not a file, nor one of "
        f"the built-in configs {known} in {CONFIGS_DIR}"
    )


def read_config_file(name: str) -> dict:
    """Names a config file assigns. A Python file is executed as code, like
    a reward-function file: run only your own. Skipped: _private names, and
    modules, functions and classes under a name that is no setting (a
    helper, or a reward function that reward_funcs lists); under a setting's
    name, TRL's included (`rollout_func = f`), they are read, so checked."""
    path = config_path(name)
    if path.endswith(YAML):
        return read_yaml(path)
    namespace: dict = {}
    with open(path) as f:
        exec(compile(f.read(), path, "exec"), namespace)
    return {
        k: v
        for k, v in namespace.items()
        if not k.startswith("_") and (is_setting_name(k) or not is_code(v))
    }


def is_code(value) -> bool:
    """A module, function or class: what a config file defines to use."""
    return isinstance(value, types.ModuleType) or callable(value)


def is_setting_name(key: str) -> bool:
    """A TrainConfig field, or a TRL name (read, translated or refused)."""
    return is_read(key, True, False) or refusal(key) is not None


def read_yaml(path: str) -> dict:
    """A config as `trl grpo --config recipe.yaml` reads it: a flat YAML
    mapping of names to values; its `env` mapping sets environment
    variables, as TRL's TrlParser does. PyYAML is imported only here (a
    dependency of huggingface-hub, not of nanogrpo)."""
    try:
        import yaml
    except ImportError:
        raise ConfigError(
            f"config {path}: reading YAML needs PyYAML (pip install "
            "pyyaml), or write the config in Python"
        ) from None
    with open(path) as f:
        try:
            read = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ConfigError(f"config {path}: not valid YAML ({e})") from None
    if read is None:
        read = {}
    if not isinstance(read, dict):
        raise ConfigError(
            f"config {path}: expected a mapping of setting names "
            f"to values, got a {type(read).__name__}"
        )
    env = read.pop("env", None) or {}
    if not isinstance(env, dict):
        raise ConfigError(
            f"config {path}: env must be a mapping of environment variables to values"
        )
    for key, value in env.items():
        os.environ[str(key)] = str(value)
    # YAML 1.1 reads an unquoted `no` as False: a strategy's "no"
    for key in ("eval_strategy", "save_strategy", "logging_strategy"):
        if read.get(key) is False:
            read[key] = "no"
    return {str(k): v for k, v in read.items()}


def parse_args(argv: list[str]) -> list[tuple[str, str]]:
    """`--key=value`, `--key value` or `--bool_key` -> [(key, text)] in
    order; dashes in keys become underscores."""
    pairs = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; use --key=value")
        key, eq, value = arg[2:].partition("=")
        key = key.replace("-", "_")
        if not eq:
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                i += 1
                value = argv[i]
            elif is_flag(key):
                value = "true"
            else:
                raise ConfigError(f"--{key} needs a value")
        pairs.append((key, value))
        i += 1
    return pairs


def is_flag(key: str) -> bool:
    """Whether a bare `--key` means true: a bool field (`--bf16` too), or a
    TRL name (`--use_cpu`); not --config, nor an alias of a text field."""
    if key in FIELD_TYPES:
        tp = FIELD_TYPES[key]
        return tp is bool or set(typing.get_args(tp)) == {bool, type(None)}
    return key != "config" and key not in ALIASES


def load_config(argv: list[str] | None = None) -> TrainConfig:
    """`[--config FILE] [--key=value | --key value | --bool_key] ...` -> a
    validated TrainConfig (read_settings says which values run)."""
    settings, basis = read_settings(argv)
    if settings.get("model") is None:
        raise ConfigError(
            "no model: set model = ... (a checkpoint directory or "
            "hub id) in your config file, or pass --model"
        )
    # the batch rules count processes: torchrun's WORLD_SIZE (train.py validates again once the
    # process group exists)
    cfg = TrainConfig(**settings).validate(int(os.environ.get("WORLD_SIZE", "1")))
    if basis:  # the run's first line, on stdout with the rest of the run
        note(basis, file=sys.stdout)
    return cfg


def read_settings(argv: list[str] | None = None) -> tuple[dict, str | None]:
    """The settings `argv` asks for, unvalidated -> (settings, the sentence
    saying which values run when there is no --config, else None).

    Command-line values override the file's. Two file settings do not follow
    a command-line change they were not written for, unless the command line
    names them too: a new `--model` drops the file's `init_model` (a random
    model is built only where asked), and a new `--dataset` drops the file's
    `eval_dataset` and `eval_strategy` (an eval set of another task)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pairs = parse_args(argv)
    # the last of repeated keys wins
    typed = {key: value for key, value in pairs if key != "config"}
    files = [value for key, value in pairs if key == "config"]
    files, basis = default_config(files, typed)
    file_settings = [(name, read_config_file(name)) for name in files]
    entries = [
        (k, v, f"in config file {name}", is_yaml(name))
        for name, read in file_settings
        for k, v in read.items()
    ]
    entries += [(k, v, "on the command line", True) for k, v in typed.items()]
    check_known(entries)
    from_file = {}
    for name, read in file_settings:
        from_file.update(settings_of(read, from_text=is_yaml(name)))
    command_line = settings_of(typed, from_text=True)
    settings = from_file | command_line
    _drop_followers(settings, from_file, command_line)
    return settings, basis


def default_config(files: list[str], command_line: dict) -> tuple[list, str | None]:
    """Which values run without --config: with no model named either, the
    embedded default configs/tiny.py (`python train.py` trains offline);
    with a model, TrainConfig's defaults (TRL's) and nothing of tiny.py.
    -> (the config files to read, the sentence saying so; None with --config)."""
    if files:
        return files, None
    if not {"model", "model_name_or_path"} & set(command_line):
        return ["tiny"], (
            "no --config and no --model: the embedded default "
            "configs/tiny.py runs, your settings on top (name a "
            "model for TrainConfig's defaults, TRL's)"
        )
    return [], (
        "no --config: TrainConfig's defaults (TRL's) with your settings; nothing of configs/tiny.py"
    )


def is_yaml(name: str) -> bool:
    return name.endswith(YAML)


def settings_of(read: dict, from_text: bool) -> dict:
    """One place's names (a config file's, or the command line's) as
    TrainConfig fields, each converted to its type: TRL's aliases to their
    field (both names with two values is an error), TRANSLATED names to
    what they mean (winning over the field they set: save_strategy="no"
    over save_steps), a name that changes nothing to a note."""
    settings = {}
    translated = {}
    for key, value in read.items():
        if key in FIELD_TYPES or key in ALIASES:
            name = ALIASES.get(key, key)
            converted = convert(name, value, from_text=from_text)
            if name in settings and settings[name] != converted:
                raise ConfigError(
                    f"{name} is set twice in one place, to "
                    f"{settings[name]!r} and (as {key}) to "
                    f"{converted!r}: keep one"
                )
            settings[name] = converted
        elif key in TRANSLATED:
            translated |= TRANSLATED[key](key, value, from_text)
        elif key in NO_EFFECT:
            note(f"{key} changes nothing here: {NO_EFFECT[key]}")
        elif key.startswith("vllm_"):
            note(
                f"{key} changes nothing here: there is no vLLM (use_vllm is "
                "off; nanogrpo's own sampler generates)"
            )
    return settings | translated


def _drop_followers(settings: dict, from_file: dict, command_line: dict):
    """load_config's rule for settings that follow another (see there)."""
    model_changed = settings.get("model") != from_file.get("model")
    if (
        "model" in command_line
        and "init_model" not in command_line
        and from_file.get("init_model") is not None
        and model_changed
    ):
        settings["init_model"] = None
    dataset_changed = settings.get("dataset") != from_file.get("dataset")
    if (
        "dataset" in command_line
        and "eval_dataset" not in command_line
        and from_file.get("eval_dataset") is not None
        and dataset_changed
    ):
        settings["eval_dataset"] = None
        dropped = f"eval_dataset={from_file['eval_dataset']!r}"
        if "eval_strategy" not in command_line:
            settings["eval_strategy"] = "no"  # no evaluation, and no warning
        if "eval_on_start" not in command_line:
            settings.pop("eval_on_start", None)
        note(
            f"--dataset={settings['dataset']} replaces the config file's "
            f"dataset, so its {dropped} (another task) is not used; "
            "pass --eval_dataset=... to evaluate"
        )


# -----------------------------------------------------------------------------
# TRL's other names: its scripts' ScriptArguments and ModelConfig, and the
# TrainingArguments TrainConfig lacks. Each is translated, accepted with a
# note (it changes nothing here), or refused with why, never given a "did
# you mean" (a close spelling may mean something else).

# TRL's names for TrainConfig's fields
ALIASES = {
    "model_name_or_path": "model",  # ModelConfig
    "dataset_name": "dataset",  # ScriptArguments
    "dataset_train_split": "dataset_split",
    "dataset_test_split": "eval_split",
}


def _dtype(key, value, from_text) -> dict:
    """ModelConfig's dtype (torch_dtype before): the weights' dtype, which
    TrainConfig reads from model_init_kwargs as TRL's trainer does."""
    dtype = convert(key, value, str | None, from_text)
    return {} if dtype is None else {"model_init_kwargs": {"dtype": dtype}}


def _save_strategy(key, value, from_text) -> dict:
    """TrainingArguments' save_strategy: "steps" is what save_steps does;
    "no" saves no checkpoint on the way (the last step is saved all the same)."""
    strategy = convert(key, value, str, from_text)
    if strategy == "steps":
        return {}
    if strategy == "no":
        note(
            "save_strategy='no': save_steps=0, no checkpoint on the way; "
            "the last step is saved all the same"
        )
        return {"save_steps": 0}
    raise ConfigError(
        f"{key}={strategy!r}: checkpoints come every save_steps "
        "optimizer steps: use save_strategy='steps' or 'no'"
    )


def _logging_strategy(key, value, from_text) -> dict:
    """Console lines and metrics come every logging_steps, whatever it says."""
    strategy = convert(key, value, str, from_text)
    if strategy != "steps":
        note(
            f"{key}={strategy!r} changes nothing here: a line and a metrics "
            "record come every logging_steps"
        )
    return {}


def _use_cpu(key, value, from_text) -> dict:
    return {"device": "cpu"} if convert(key, value, bool, from_text) else {}


def _model_revision(key, value, from_text) -> dict:
    revision = convert(key, value, str | None, from_text)
    if revision in (None, "main"):
        return {}
    raise ConfigError(
        f"{key}={revision!r}: a hub id loads its main revision; "
        "download that revision (huggingface-cli download --revision) "
        "and pass its directory as model"
    )


def _dataset_config(key, value, from_text) -> dict:
    """datasets' configuration name: nanogrpo reads files, which are one
    configuration's already (gsm8k's are those of "main")."""
    name = convert(key, value, str | None, from_text)
    if name is None:
        return {}
    if name in ("main", "default"):
        note(
            f"{key}={name!r} changes nothing here: the dataset's file is "
            "that configuration's (gsm8k reads main's)"
        )
        return {}
    raise ConfigError(
        f"{key}={name!r}: nanogrpo reads one file, not a datasets "
        "configuration: set dataset to the configuration's file, "
        "hf://datasets/<owner>/<name>/<file>"
    )


def _lora_task_type(key, value, from_text) -> dict:
    task = convert(key, value, str, from_text)
    if task == "CAUSAL_LM":
        return {}
    raise ConfigError(f"{key}={task!r}: nanogrpo trains causal LMs (CAUSAL_LM)")


# TRL's names whose meaning depends on their value: name -> fn(key, value,
# from_text) -> the TrainConfig settings it means
TRANSLATED = {
    "dtype": _dtype,  # ModelConfig
    "torch_dtype": _dtype,
    "model_revision": _model_revision,
    "lora_task_type": _lora_task_type,
    "dataset_config": _dataset_config,  # ScriptArguments
    "save_strategy": _save_strategy,  # TrainingArguments
    "logging_strategy": _logging_strategy,
    "use_cpu": _use_cpu,
}
NO_DATALOADER = "prompts come from nanogrpo's own prompt sampler, not a DataLoader"
NO_DDP = "several processes train with FSDP2, not DistributedDataParallel"
ONE_PRINTER = "rank 0 prints nanogrpo's own lines"
# TRL's names that change nothing here, whatever their value: accepted, with a note
NO_EFFECT = {
    "remove_unused_columns": "every dataset column reaches the reward functions",
    "dataloader_num_workers": NO_DATALOADER,
    "dataloader_pin_memory": NO_DATALOADER,
    "dataloader_persistent_workers": NO_DATALOADER,
    "dataloader_prefetch_factor": NO_DATALOADER,
    "log_level": ONE_PRINTER,
    "log_level_replica": ONE_PRINTER,
    "log_on_each_node": ONE_PRINTER,
    "disable_tqdm": "there is no progress bar: a line every logging_steps",
    "skip_memory_metrics": "no memory metrics are logged",
    "bf16_full_eval": "evaluation computes as training does (the bf16 setting)",
    "per_device_eval_batch_size": "evaluation runs in per_device_train_batch_size batches",
    "ddp_find_unused_parameters": NO_DDP,
    "ddp_bucket_cap_mb": NO_DDP,
    "ddp_broadcast_buffers": NO_DDP,
    "ddp_static_graph": NO_DDP,
    "ddp_backend": "the backend is nccl on CUDA, gloo on CPU (nanogrpo/distributed/)",
    "ignore_bias_buffers": NO_DDP,
    "local_rank": "torchrun's LOCAL_RANK environment variable places each process",
    "do_train": "train.py trains",
    "do_eval": "evaluation follows eval_strategy and eval_dataset",
    "do_predict": "train.py does not predict",
    "torch_empty_cache_steps": "it frees cached memory only",
    "gradient_checkpointing_kwargs": "checkpointing is non-reentrant, TRL's default",
    "gradient_checkpointing_use_reentrant": "checkpointing is non-reentrant, TRL's default",
    "use_liger_kernel": "the LM head's log-probs are already chunked (fast/logprobs.py)",
    "attn_implementation": "nanogrpo's model attends with torch's scaled_dot_product_attention",
    "trust_remote_code": "nanogrpo's own model code loads the weights; no remote code runs",
    "dataset_streaming": "the dataset is read whole",
    "bnb_4bit_quant_type": "there is no 4-bit loading (load_in_4bit)",
    # TRL 1.16 pads its prompt and completion tensors to a multiple of it (128 on Neuron, whose
    # compiler wants few shapes); the padding is masked out of every sum
    "pad_to_multiple_of": "TRL pads its tensors to that multiple of positions, all masked: "
    "no loss, gradient or metric changes",
}

# trl 1.16 GRPOConfig's fields (with TrainingArguments') that TrainConfig
# lacks; tests/test_config.py keeps this list equal to the fixture's
TRL_ONLY = set(
    """
    accelerator_config activation_checkpointing
    activation_checkpointing_kwargs auto_find_batch_size
    average_tokens_across_devices batch_eval_metrics bf16_full_eval
    cache_implementation data_seed
    dataloader_drop_last dataloader_in_order
    dataloader_multiprocessing_context dataloader_num_workers
    dataloader_persistent_workers dataloader_pin_memory
    dataloader_prefetch_factor ddp_backend ddp_broadcast_buffers
    ddp_bucket_cap_mb ddp_find_unused_parameters ddp_static_graph
    debug deepspeed disable_tqdm do_eval do_predict do_train
    ds3_gather_for_generation enable_jit_checkpoint
    eval_accumulation_steps eval_delay eval_do_concat_batches
    eval_use_gather_object fp16 fp16_full_eval fsdp
    fsdp_config full_determinism
    gradient_checkpointing_kwargs greater_is_better hub_always_push
    hub_private_repo hub_revision hub_strategy hub_token
    ignore_data_skip include_for_metrics include_num_input_tokens_seen
    label_names label_smoothing_factor length_column_name
    liger_kernel_config load_best_model_at_end local_rank
    log_completions_hub_repo log_level log_level_replica log_multimodal
    log_on_each_node log_unique_prompts logging_nan_inf_filter
    logging_strategy metric_for_best_model neftune_noise_alpha
    optim_args optim_target_modules
    pad_to_multiple_of parallelism_config per_device_eval_batch_size
    prediction_loss_only project remove_unused_columns
    restore_callback_states_from_checkpoint router_aux_loss_coef
    save_on_each_node save_only_model save_strategy skip_memory_metrics
    tf32 torch_compile_backend torch_compile_mode
    torch_empty_cache_steps trackio_bucket_id trackio_space_id
    trackio_static_space_id train_sampling_strategy
    transformers_continuous_batching_config trust_remote_code
    use_cache use_cpu use_liger_kernel
    use_transformers_continuous_batching use_transformers_paged use_vllm
""".split()
)
FSDP2 = "several processes train with FSDP2 under torchrun: remove it"
NO_BITSANDBYTES = (
    "needs bitsandbytes, which nanogrpo does not use: train LoRA "
    'adapters on bf16 weights (model_init_kwargs={"dtype": "bfloat16"})'
)
# Refused, unless off (False, None, empty): each would change the result
REFUSED = {
    "use_vllm": "generation runs in nanogrpo's own KV-cached sampler: remove it",
    "fp16": "fp16 training is not supported: use bf16=True, or leave both out",
    "fp16_full_eval": "fp16 is not supported: evaluation computes as training does",
    "deepspeed": FSDP2,
    "fsdp": FSDP2,
    "fsdp_config": FSDP2,
    # ModelConfig
    "load_in_8bit": NO_BITSANDBYTES,
    "load_in_4bit": NO_BITSANDBYTES,
    "use_bnb_nested_quant": NO_BITSANDBYTES,
    "use_dora": "LoRA adapters are plain LoRA (extras/lora.py), not DoRA",
    "lora_target_parameters": "LoRA adapts modules (lora_target_modules), not parameters",
    # TRL's dataset mixtures (DatasetMixtureConfig)
    "datasets": "one dataset per run: set dataset",
    # GRPOTrainer's arguments, which a TRL script passes beside its config
    # (its tools, rollout_func and environment_factory are TrainConfig fields)
    "callbacks": "there are no trainer callbacks: a reward function may log "
    "(log_metric, log_extra)",
    "optimizers": "the optimizer is AdamW (optim, learning_rate, lr_scheduler_type)",
    "peft_config": "LoRA is set by ModelConfig's names: use_peft=True, lora_r, "
    "lora_alpha, lora_dropout, lora_target_modules",
    "processing_class": "the tokenizer is the model directory's",
    "train_dataset": "set dataset: a file, hf://datasets/..., or a built-in name",
}


def refusal(key: str) -> str | None:
    """Why a TRL setting is refused, or None for a name TRL does not have."""
    if key in REFUSED:
        return REFUSED[key]
    if key in TRL_ONLY:
        return "a TRL/transformers setting nanogrpo does not have: remove it"
    return None


# -----------------------------------------------------------------------------
# train.py --help


def help_text(argv: list[str] | None = None) -> str:
    """Every setting once, with the value that would run and its help,
    under its group's title (TrainConfig's field metadata). With --config,
    the file's values; without, those of load_config's rule."""
    settings, basis = read_settings(argv or [])
    values = TrainConfig(**settings)
    files = [v for k, v in parse_args(argv or []) if k == "config"]
    if files:
        basis = (
            f"--config {', '.join(files)}: the file's values over "
            "TrainConfig's defaults (TRL's), your settings on top"
        )
    lines = [
        "usage: train.py [--config FILE] [--key=value ...]",
        "  FILE: a config of configs/ by name, or a path: a .py of your own, or a",
        "  .yaml as `trl grpo --config` reads. Command-line values override the file's.",
    ]
    lines += textwrap.wrap(f"Values shown: {basis}.", width=96, subsequent_indent="    ")
    for f in fields(TrainConfig):
        if "group" in f.metadata:
            lines += ["", f"  {f.metadata['group']}:"]
        lines.append(f"  --{f.name}={shown(getattr(values, f.name))}")
        lines += textwrap.wrap(
            f.metadata["help"], width=96, initial_indent=" " * 6, subsequent_indent=" " * 6
        )
    lines += ["", "  TRL's other names:"] + textwrap.wrap(
        trl_names_text(), width=96, initial_indent=" " * 6, subsequent_indent=" " * 6
    )
    return "\n".join(lines)


def shown(value) -> str:
    """A value as --help shows it: a config file's function by its name."""
    if isinstance(value, list):
        return "[" + ", ".join(shown(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {shown(v)}" for k, v in value.items()) + "}"
    if callable(value):
        return getattr(value, "__name__", repr(value))
    return repr(value)


def trl_names_text() -> str:
    aliases = ", ".join(f"{k} for {v}" for k, v in ALIASES.items())
    return (
        f"{aliases}; {', '.join(TRANSLATED)}: read by their value. Settings "
        "that change nothing here (remove_unused_columns, dataloader_*, ddp_*, "
        "log_level, ...) are accepted with a note; one nanogrpo cannot honour "
        "is refused with why, unless its value is off (False, None, empty)."
    )
