"""Text and file values to each TrainConfig field's annotated type (`convert`), checked, and the
notes reading them prints. run/configurator.py and run/trl_names.py use it.

Does not know about: what a setting does, the model, tokenization, or files.
"""

import ast
import math
import os
import sys
import types
import typing

from nanogrpo.run.config import FALSE_WORDS, TRUE_WORDS, ConfigError, TrainConfig

FIELD_TYPES = typing.get_type_hints(TrainConfig)


def note(message: str, file=None):
    """A line on stderr (or `file`), from rank 0 only (torchrun's RANK: the
    process group does not exist yet while the config loads)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"note: {message}", file=file or sys.stderr)


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
