"""Reading a run's settings: a Python config file, then `--key=value` overrides.

Owns: `load_config(argv)`, `read_config_file`, which file a `--config` name
means (`config_path`), converting text to each field's type (`convert`),
the error that names every unknown key at once (`check_known`), and
`train.py --help` (`help_text`, read from TrainConfig's field comments).

Does not know about: what the settings mean or the rules between them
(config.py's TrainConfig.validate).

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
"""

import ast
import difflib
import inspect
import math
import os
import re
import sys
import types
import typing
from dataclasses import fields

from nanogrpo.config import FALSE_WORDS, TRUE_WORDS, ConfigError, TrainConfig


FIELD_TYPES = typing.get_type_hints(TrainConfig)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS_DIR = os.path.join(ROOT, "configs")


def note(message: str):
    """A line on stderr, from rank 0 only (torchrun's RANK: the process
    group does not exist yet while the config loads)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"note: {message}", file=sys.stderr)


def _unknown_key(key: str, where: str) -> str:
    why = refusal(key)
    if why:
        return f"{key!r} {where}: {why}"
    close = difflib.get_close_matches(key, FIELD_TYPES, n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    return f"{key!r} {where}{hint}"


def check_known(keys: list[tuple[str, str]]):
    """One ConfigError naming every unknown key of (key, where) pairs, each
    with its closest field, so nine typos need one run, not nine."""
    bad = [k for k, _ in keys if k not in FIELD_TYPES]
    unknown = [_unknown_key(k, where) for k, where in keys
               if k not in FIELD_TYPES]
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


def config_path(name: str) -> str:
    """The file a --config value names. A config is a Python (.py) file;
    any other name is refused.

    - A name with a '/' (`./tiny.py`, `runs/a.py`) is that file.
    - A bare name (`tiny`, `tiny.py`) is the built-in configs/<name>.py
      when there is one, so the default run never executes a tiny.py that
      happens to lie in the current directory; when one does, a note says
      that the built-in runs and how to run yours (`--config ./tiny.py`).
    - Any other bare `name.py` is the file in the current directory.
    """
    ext = os.path.splitext(name)[1]
    is_path = "/" in name or os.sep in name
    if ext != ".py" and (ext or is_path):
        raise ConfigError(f"config {name!r} is not a .py file: a config is "
                          "Python assigning settings (see configs/tiny.py)")
    file = name if ext else name + ".py"
    if not is_path:
        builtin = os.path.join(CONFIGS_DIR, file)
        if os.path.isfile(builtin):
            if os.path.isfile(file):
                note(f"--config {name} runs the built-in {builtin}, not "
                     f"./{file}; for yours, pass --config ./{file}")
            return builtin
    if os.path.isfile(file):
        return file
    known = sorted(f[:-3] for f in os.listdir(CONFIGS_DIR) if f.endswith(".py"))
    raise ConfigError(f"config {name!r} not found: not a file, nor one of "
                      f"the built-in configs {known} in {CONFIGS_DIR}")


def read_config_file(name: str) -> dict:
    """Names a config file assigns (skipping _private names, modules,
    functions and classes). A config file is Python and is executed as code,
    like a reward-function file: run only your own."""
    path = config_path(name)
    namespace: dict = {}
    with open(path) as f:
        exec(compile(f.read(), path, "exec"), namespace)
    skipped = (types.ModuleType, types.FunctionType, type)
    return {k: v for k, v in namespace.items()
            if not k.startswith("_") and not isinstance(v, skipped)}


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
            elif FIELD_TYPES.get(key) is bool:
                value = "true"
            else:
                raise ConfigError(f"--{key} needs a value")
        pairs.append((key, value))
        i += 1
    return pairs


def load_config(argv: list[str] | None = None) -> TrainConfig:
    """`[--config FILE] [--key=value | --key value | --bool_key] ...` -> a
    validated TrainConfig.

    Command-line values override the file's. Two file settings do not follow
    a command-line change they were not written for, unless the command line
    names them too: a new `--model` drops the file's `init_model` (a random
    model is built only where asked), and a new `--dataset` drops the file's
    `eval_dataset` and `eval_strategy` (an eval set of another task)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pairs = parse_args(argv)
    files = [value for key, value in pairs if key == "config"]
    file_settings = [(name, read_config_file(name)) for name in files]
    # the last of repeated keys wins
    command_line = {key: value for key, value in pairs if key != "config"}
    where = [(k, f"in config file {name}")
             for name, read in file_settings for k in read]
    where += [(k, "on the command line") for k in command_line]
    check_known(where)
    from_file = {}
    for _, read in file_settings:
        for key, value in read.items():
            from_file[key] = convert(key, value)
    settings = dict(from_file)
    for key, value in command_line.items():
        settings[key] = convert(key, value, from_text=True)
    _drop_followers(settings, from_file, command_line)
    return TrainConfig(**settings).validate()


def _drop_followers(settings: dict, from_file: dict, command_line: dict):
    """load_config's rule for settings that follow another (see there)."""
    model_changed = settings.get("model") != from_file.get("model")
    if "model" in command_line and "init_model" not in command_line \
            and from_file.get("init_model") is not None and model_changed:
        settings["init_model"] = None
    dataset_changed = settings.get("dataset") != from_file.get("dataset")
    if "dataset" in command_line and "eval_dataset" not in command_line \
            and from_file.get("eval_dataset") is not None and dataset_changed:
        settings["eval_dataset"] = None
        dropped = f"eval_dataset={from_file['eval_dataset']!r}"
        if "eval_strategy" not in command_line:
            settings["eval_strategy"] = "no"  # no evaluation, and no warning
        note(f"--dataset={settings['dataset']} replaces the config file's "
             f"dataset, so its {dropped} (another task) is not used; "
             "pass --eval_dataset=... to evaluate")

# -----------------------------------------------------------------------------
# TRL's names that nanogrpo does not have: refused with why, never a
# "did you mean" (a close spelling may mean something else)

# trl 1.16 GRPOConfig's fields (with TrainingArguments') that TrainConfig
# lacks; tests/test_config.py keeps this list equal to the fixture's
TRL_ONLY = set("""
    accelerator_config activation_checkpointing
    activation_checkpointing_kwargs auto_find_batch_size
    average_tokens_across_devices batch_eval_metrics bf16_full_eval
    cache_implementation data_seed
    dataloader_drop_last dataloader_in_order
    dataloader_multiprocessing_context dataloader_num_workers
    dataloader_persistent_workers dataloader_pin_memory
    dataloader_prefetch_factor ddp_backend ddp_broadcast_buffers
    ddp_bucket_cap_mb ddp_find_unused_parameters ddp_static_graph
    ddp_timeout debug deepspeed disable_tqdm do_eval do_predict do_train
    ds3_gather_for_generation enable_jit_checkpoint
    eval_accumulation_steps eval_delay eval_do_concat_batches
    eval_on_start eval_use_gather_object fp16 fp16_full_eval fsdp
    fsdp_config full_determinism generation_kwargs
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
""".split())
REFUSED = {
    "use_vllm": "generation runs in nanogrpo's own KV-cached sampler: remove it",
    "fp16": "fp16 training is not supported: use bf16=True, or leave both out",
    "deepspeed": "several processes train with FSDP2 under torchrun: remove it",
    "fsdp": "several processes train with FSDP2 under torchrun: remove it",
    "fsdp_config": "several processes train with FSDP2 under torchrun: remove it",
    "use_liger_kernel": "the LM head's log-probs are already chunked (logprobs.py): remove it",
    "save_strategy": "checkpoints come every save_steps (0 = only at the end): remove it",
    "logging_strategy": "lines come every logging_steps: remove it",
    "per_device_eval_batch_size": "evaluation runs in per_device_train_batch_size batches",
}


def refusal(key: str) -> str | None:
    """Why a TRL setting is refused, or None for a name TRL does not have."""
    if key.startswith("vllm_"):
        return ("there is no vLLM in nanogrpo (its own sampler generates; of "
                "TRL's vllm_* settings, vllm_importance_sampling_* apply to "
                "it): remove it")
    if key in REFUSED:
        return REFUSED[key]
    if key in TRL_ONLY:
        return "a TRL/transformers setting nanogrpo does not have: remove it"
    return None


# -----------------------------------------------------------------------------
# train.py --help


def help_text() -> str:
    """Every setting with its default and comment, grouped as in
    TrainConfig's source: a '# --- title' line starts a group; a field's
    comment is on the '#' lines just above it and after it on its line."""
    lines = [
        "usage: train.py [--config FILE] [--key=value ...]",
        "  FILE: a config of configs/ by name, or a .py path of your own.",
        "Command-line values override the file's. Keys and TrainConfig's "
        "defaults (a config file sets its own):",
    ]
    defaults = TrainConfig()
    comments, groups = field_comments()
    for f in fields(TrainConfig):
        if f.name in groups:
            lines.append(f"\n  {groups[f.name]}:")
        default = repr(getattr(defaults, f.name))
        lines.append(f"  --{f.name}={default}")
        for comment in comments.get(f.name, []):
            lines.append(f"      {comment}")
    return "\n".join(lines)


def field_comments() -> tuple[dict, dict]:
    """({field: [comment lines]}, {first field of a group: its title})
    read from TrainConfig's source, up to its first method."""
    names = {f.name for f in fields(TrainConfig)}
    comments = {}
    groups = {}
    title = None
    above = []
    for raw in inspect.getsource(TrainConfig).splitlines()[1:]:
        line = raw.strip()
        if line.startswith(("def ", "@")):
            break
        match = re.match(r"(\w+)\s*:", line)
        if line.startswith("# ---"):
            title = line.strip("#- ")
            above = []
        elif line.startswith("#"):
            above.append(line.lstrip("#").strip())
        elif match and match.group(1) in names:
            name = match.group(1)
            comments[name] = above + line.split("  # ", 1)[1:]
            if title:
                groups[name] = title
            title = None
            above = []
        else:
            above = []
    return comments, groups
