"""Reading a run's settings: a config file, then `--key=value` overrides.

Owns: `load_config(argv)`, which values run without `--config`
(`default_config`), `read_config_file` (Python, or YAML as TRL's CLI reads
it), which file a `--config` name means (`config_path`), converting text to
each field's type (run/values.py's `convert`), how TRL's names that TrainConfig
spells otherwise or lacks are read (their tables: run/trl_names.py), the error that
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
  its value is off (False, None, empty: it asks for nothing) or TRL's
  default (it asks for what nanogrpo does).
"""

import difflib
import os
import sys
import textwrap
import types
import typing
from dataclasses import fields

from nanogrpo.extras.reward_funcs import import_file
from nanogrpo.run.config import FALSE_WORDS, ConfigError, TrainConfig
from nanogrpo.run.trl_names import (  # noqa: F401 (TRL_ONLY: tests)
    ALIASES,
    NO_EFFECT,
    TRANSLATED,
    TRL_ONLY,
    at_trl_default,
    refusal,
)
from nanogrpo.run.values import FIELD_TYPES, convert, note

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS_DIR = os.path.join(ROOT, "configs")


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
    off (it asks for nothing) or TRL's default."""
    if key in FIELD_TYPES or key in ALIASES or key in TRANSLATED:
        return True
    if key in NO_EFFECT or key.startswith("vllm_"):
        return True
    at_default = at_trl_default(key, value, from_text)
    return refusal(key) is not None and (is_off(value, from_text) or at_default)


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
    # run as a module (its functions and classes can be found again: run/async_rollouts.py)
    namespace = vars(import_file(path, "config"))
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
    name = ALIASES.get(key, key)  # --activation_checkpointing: a bool field's alias
    if name in FIELD_TYPES:
        tp = FIELD_TYPES[name]
        return tp is bool or set(typing.get_args(tp)) == {bool, type(None)}
    return key != "config"


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
    over save_steps), a name that changes nothing to a note (the vllm_* ones,
    and those at TRL's default, one note each kind). An alias set to None is
    unset (transformers' activation_checkpointing=None)."""
    settings = {}
    translated = {}
    no_vllm = []
    at_default = []
    for key, value in read.items():
        if key in ALIASES and value is None:
            continue
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
            no_vllm.append(key)
        elif at_trl_default(key, value, from_text) and not is_off(value, from_text):
            at_default.append(key)
    if no_vllm:
        note(
            f"{', '.join(no_vllm)} {changes(no_vllm)} nothing here: there is no vLLM "
            "(use_vllm is off; nanogrpo's own sampler generates)"
        )
    if at_default:
        note(f"{', '.join(at_default)} at TRL's default {changes(at_default)} nothing here")
    return settings | translated


def changes(keys: list) -> str:
    return "changes" if len(keys) == 1 else "change"


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
        "is refused with why, unless its value is off (False, None, empty) or TRL's default."
    )
