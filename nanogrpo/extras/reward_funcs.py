"""Turning the config's reward entries into functions: what `reward_funcs` may name.

Owns: `resolve_reward_funcs` (a built-in's name, looked up in extras/builtin_rewards.py's
`BUILTINS`; "module:function"; "file.py:function"; a reward model's directory or hub id, loaded by
extras/reward_model.py), `import_function`, which the tools, environments and rollout_func
settings use too (`import_file`: config files too; `from_file` finds their code in another
process), and the checks at load time: `check_names` (one name a function, as TRL names
them) and `check_reward_columns` (the dataset has the columns the functions read, and none named
as the `TRAINER_ARGUMENTS`).

Does not know about: how a batch is scored (rewards.py), the policy, or other processes.
"""

import difflib
import functools
import importlib.util
import inspect
import os
import re
import sys
import zlib

import torch

from nanogrpo.data import NOT_PASSED
from nanogrpo.extras.builtin_rewards import BUILTINS, soft_overlong_punishment


def import_function(spec: str, kind: str = "reward function"):
    """'package.module:function' or 'path/to/file.py:function' -> the function (`kind` names it in
    errors)."""
    module_name, _, attr = spec.rpartition(":")
    try:
        if module_name.endswith(".py"):
            module = import_file(module_name, kind)
        else:
            module = importlib.import_module(module_name)
    except (ImportError, OSError) as e:
        raise ValueError(f"{kind} {spec!r}: cannot import {module_name!r} ({e})") from e
    except SyntaxError as e:  # one line naming the place, not a traceback
        raise ValueError(f"{kind} {spec!r}: {e.filename}, line {e.lineno}: {e.msg}") from None
    except Exception as e:  # the file ran and raised
        raise ValueError(
            f"{kind} {spec!r}: importing {module_name!r} raised {type(e).__name__}: {e}"
        ) from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{kind} {spec!r}: {module_name!r} has no function {attr!r}")
    return fn


FILES = {}  # module name -> the .py file import_file ran under it (what from_file runs again)


def import_file(path: str, kind: str):
    """Run a .py file as Python imports a module (importlib's recipe: the module is in sys.modules
    while it runs, so dataclasses and `from __future__ import annotations` find it), named for its
    kind and file: "reward_function_my_rewards". A file run again (another run in this process)
    is run anew under its name; another file with that name gets the name with a suffix."""
    stem = os.path.splitext(os.path.basename(path))[0]
    name = re.sub(r"\W", "_", f"{kind}_{stem}")
    held = sys.modules.get(name)
    if held is not None and getattr(held, "__file__", None) != os.path.abspath(path):
        name = f"{name}_{zlib.crc32(os.path.abspath(path).encode()):08x}"
    return run_file(os.path.abspath(path), name)


def run_file(path: str, name: str):
    """The module `name`: the file at path run as import_file runs it."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None:
        raise ImportError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    FILES[name] = path
    return module


def from_file(path: str, name: str, qualname: str):
    """The function or class `qualname` of the file import_file ran as module `name` (run here
    first if this process has not): how another process finds it (async_rollouts' pickles)."""
    module = sys.modules.get(name)
    if getattr(module, "__file__", None) != path:
        module = run_file(path, name)
    found = module
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def callable_name(fn) -> str:
    """A reward function's name, as TRL names it: a functools.partial is named after the function
    it wraps, a callable object after its class."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", type(fn).__name__)


def check_names(reward_funcs: list[tuple[str, object]]):
    """Two reward functions of one name would log as one `rewards/<name>/*` (TRL merges them):
    refused in one line naming both."""
    first = {}
    for i, (name, _) in enumerate(reward_funcs):
        if name in first:
            raise ValueError(
                f"reward functions {first[name]} and {i} (counted from 0, an environment's "
                f"get_reward last) are both named {name!r}, so their rewards/{name}/* metrics "
                "would merge: give one another name (a def of its own, or set its __name__)"
            )
        first[name] = i


# what the trainer passes besides the dataset's columns (TRL 1.16's names; `environments` with
# environment_factory)
TRAINER_ARGUMENTS = (
    "prompts",
    "completions",
    "completion_ids",
    "trainer_state",
    "log_metric",
    "log_extra",
    "environments",
)


def check_reward_columns(reward_funcs, rows: list[dict], source, environments: bool) -> None:
    """At load time, not as a crash at step 50: a column named as an argument the trainer passes
    (TRAINER_ARGUMENTS; `environments` only with environment_factory) is refused, for it would
    not reach the functions (TRL overwrites it, or the call fails); every column a reward
    function requires (a parameter without default, besides those arguments) must be a key of
    every row (a None value is passed on, as TRL passes it). reward_funcs=[]: the names only."""
    passed = [a for a in TRAINER_ARGUMENTS if environments or a != "environments"]
    for i, row in enumerate(rows):
        taken = [c for c in passed if c in row and c not in NOT_PASSED]
        if taken:
            raise ValueError(
                f"row {i} of dataset {source} has the column {taken[0]!r}, the name of an "
                "argument the trainer passes reward functions itself: rename the column"
            )
    for name, fn in reward_funcs:
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):  # a builtin or C callable: nothing to check
            continue
        needed = [
            p.name
            for p in params
            if p.default is p.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and p.name not in passed
        ]
        for i, row in enumerate(rows):
            missing = [c for c in needed if c not in row]
            if missing:
                raise ValueError(
                    f"reward function {name!r} needs the column(s) {missing}, which row {i} of "
                    f"dataset {source} lacks (its columns: {sorted(row)})"
                )


def resolve_reward_funcs(
    names_or_callables,
    *,
    max_completion_length: int | None = None,
    soft_punish_cache: int | None = None,
    reward_processing_classes=None,
    device="cpu",
    dtype=torch.float32,
    batch_size: int = 32,
) -> list[tuple[str, object]]:
    """Config entries -> [(name, fn)]: callables, built-in names, "module:function" or
    "file.py:function", and reward models: the directory or hub id ('org/name') of a
    *ForSequenceClassification checkpoint, loaded by `reward_model` with
    reward_processing_classes[i] (TRL's name: one entry per function; None = the model's own
    tokenizer; ignored for other functions, as in TRL). `soft_overlong` is built from
    max_completion_length and soft_punish_cache (default: a quarter of max_completion_length)."""
    if isinstance(names_or_callables, str) or callable(names_or_callables):
        names_or_callables = [names_or_callables]
    tokenizers = list(reward_processing_classes or [None] * len(names_or_callables))
    if len(tokenizers) != len(names_or_callables):
        raise ValueError(
            f"reward_processing_classes: {len(tokenizers)} entries, {len(names_or_callables)} "
            "functions"
        )
    resolved = []
    for item, tokenizer in zip(names_or_callables, tokenizers):
        if callable(item):
            resolved.append((callable_name(item), item))
        elif not isinstance(item, str):
            raise TypeError(f"a reward function is a name or a callable, got {item!r}")
        elif item == "soft_overlong":
            if max_completion_length is None:
                raise ValueError("soft_overlong needs max_completion_length")
            cache = soft_punish_cache
            if cache is None:
                cache = max(1, max_completion_length // 4)
            resolved.append((item, soft_overlong_punishment(max_completion_length, cache)))
        elif item in BUILTINS:
            resolved.append((item, BUILTINS[item]))
        elif os.path.isdir(item) or (
            ":" not in item and item.count("/") == 1 and not item.startswith((".", "~"))
        ):
            from nanogrpo.extras.reward_model import reward_model  # loads weights: only when used

            resolved.append(reward_model(item, tokenizer, device, dtype, batch_size))
        elif ":" in item:
            resolved.append((item.rpartition(":")[2], import_function(item)))
        else:
            close = difflib.get_close_matches(item, BUILTINS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"unknown reward function {item!r}{hint}; built-ins are {sorted(BUILTINS)}, or "
                "give 'module:function' or a reward model's directory or hub id"
            )
    return resolved
