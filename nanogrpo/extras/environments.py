"""Environments: TRL's `environment_factory`, tools that keep state through one completion.

Owns: `Environments` (the factories, a pool of instances per environment, each
environment's tools and schemas, its `get_reward` as a reward function, which
environment a row is routed to), `Episodes` (one batch's instances, prompts and
tools: what rollout.rollout takes as `episodes`), `resolve_factory` and
`placeholder_rows` (the prompts of a run whose environment owns the data).

Does not know about: sampling, advantages or the loss (each get_reward is one
more reward function, scored as any other), checkpoints, files, or other
processes.

Tool calls are parsed and run by extras/tool_rounds.py and extras/tools.py
with the functions given here; of extras/reward_funcs.py it uses `import_function`, to
resolve "module:Class".

Choices (TRL 1.16's GRPOTrainer, name for name):
- An environment is a class (or any callable) making an instance with no
  arguments; `environment_factory` is one, or {name: one} routed by each row's
  `environment` column, so a run can mix tasks. An unknown name is TRL's error.
- One instance per completion, drawn from a pool per environment that grows
  only when a batch needs more instances than it has (TRL's pool: made once,
  reset often). Before generation each completion's instance gets
  `reset(**row)` (its dataset row; without `environment` with a dict of
  factories); a string it returns is appended to the content of the prompt's
  last message with no separator (TRL's `content + observation`), None leaves
  the prompt as it is. The G completions of a prompt have G instances: when
  their observations differ, each completion has its own prompt.
- Every public method but `reset` and `get_reward` (a function of the class
  whose name does not start with "_") is a tool of that completion, bound to
  its instance, after the config's `tools`; its schema comes from its type
  hints and docstring (tools.tool_schema). Sync or async, as any tool; an
  exception in a method is a failed call whose result the model reads.
- `get_reward()` (sync or async), where a class defines it, is one more reward
  function, named after the class, weight 1, scoring the completions of that
  very class (None for the others, so they go unscored); `reward_funcs` may
  then be empty. Reward functions receive the instances as `environments`.
- Nothing is checkpointed: an instance's state belongs to one completion, from
  its reset to the rewards scored right after the rollout, so a resumed run
  continues exactly (an environment whose results depend on earlier episodes,
  not on reset's row, would make resume inexact: keep that state out of it).
"""

import inspect
import os
from dataclasses import dataclass

from nanogrpo.extras.reward_funcs import import_function
from nanogrpo.extras.tool_rounds import ToolRules, ToolTurns
from nanogrpo.extras.tools import run_tools, tool_schema

# TRL's prompt of a row without one: the environment's reset() writes it
EMPTY_PROMPT = [{"role": "user", "content": ""}]
NOT_TOOLS = ("reset", "get_reward")


@dataclass
class Episodes:
    """One batch of completions in their environments: n = rows x copies entries, completion r of
    row r // copies, as rollout.Rollout lays out its rows."""

    instances: list  # [n] each completion's environment, reset for it
    prompts: list  # [n] each completion's prompt: its row's, reset's observation appended
    # the tool rounds (extras/tool_rounds.py): [n] {name: function} each may call (the config's
    # tools, its environment's bound methods) and their JSON schemas; None: no tools
    turns: ToolTurns | None


def resolve_factory(spec, imported: dict | None = None):
    """A config's environment_factory -> a callable, or {name: callable}: a class or function is
    itself, "module:Class" or "path/file.py:Class" is imported (as tools are). In a dict, one
    string given under several names (the same file however its path is written) is imported
    once: the names share one class, so its get_reward is one reward column, as TRL's
    factories sharing a class give one. `imported`: {spec_key: callable} already imported."""
    if isinstance(spec, dict):
        imported = {}
        return {name: resolve_factory(one, imported) for name, one in spec.items()}
    if callable(spec):
        return spec
    if isinstance(spec, str) and ":" in spec:
        if imported is None:
            imported = {}
        key = spec_key(spec)
        if key not in imported:
            imported[key] = import_function(spec, kind="environment_factory")
        return imported[key]
    raise ValueError(
        f"environment_factory={spec!r}: give a class, 'module:Class', "
        "'path/to/file.py:Class', or a dict of those by environment name"
    )


def spec_key(spec: str) -> str:
    """The key of a "path/file.py:Class" spec: with the file's real path (two spellings of one
    file are one key); a "module:Class" spec is its own."""
    path, _, attr = spec.rpartition(":")
    if path.endswith(".py"):
        return f"{os.path.realpath(path)}:{attr}"
    return spec


def placeholder_rows(num_rows: int) -> list[dict]:
    """TRL's dataset when the environment owns the data: `num_rows` empty user prompts (one
    round's), cycled; each completion's reset() returns its prompt."""
    return [{"prompt": [dict(m) for m in EMPTY_PROMPT]} for _ in range(num_rows)]


def methods_of(instance) -> list:
    """The instance's tools: its class's public functions but reset and get_reward, bound to it,
    in name order (TRL lists them with inspect.getmembers on the class)."""
    names = [name for name, _ in inspect.getmembers(type(instance), inspect.isfunction)]
    return [
        getattr(instance, name)
        for name in names
        if name not in NOT_TOOLS and not name.startswith("_")
    ]


def env_reward(env_type):
    """get_reward of the completions whose environment is exactly `env_type` (None for the others,
    unscored), as a reward function; async when get_reward is. -> (the class's name, function)."""
    if inspect.iscoroutinefunction(env_type.get_reward):

        async def get_reward(environments, **kwargs):
            return [await e.get_reward() if type(e) is env_type else None for e in environments]
    else:

        def get_reward(environments, **kwargs):
            return [e.get_reward() if type(e) is env_type else None for e in environments]

    return env_type.__name__, get_reward


def with_observation(prompt: list, observation) -> list:
    """The prompt with reset's observation appended to its last message's content (TRL's
    `content + observation`, no separator), as a new list: the row's own is left as it is. None
    leaves the prompt as it is."""
    if observation is None:
        return prompt
    if not isinstance(observation, str):
        raise TypeError(
            f"reset() returned {type(observation).__name__} {observation!r:.60}: "
            "it returns a string (appended to the last message) or None"
        )
    last = prompt[-1]
    return prompt[:-1] + [{**last, "content": (last["content"] or "") + observation}]


# -----------------------------------------------------------------------------


class Environments:
    """The environments of a run: made from its environment_factory and its `tools` (the
    config's, {name: function}), which every environment offers before its own methods, called
    in the tool rounds as `rules` (tool_rounds.ToolRules) say."""

    def __init__(self, factory, tools: dict | None = None, rules: ToolRules = ToolRules()):
        factory = resolve_factory(factory)
        self.multi = isinstance(factory, dict)
        self.factories = factory if self.multi else {None: factory}
        self.tools = dict(tools or {})
        self.rules = rules
        self.run_tools = run_tools  # how a tool round's calls run (tool_rounds.ToolTurns)
        self.pool = {}  # {name: [instances]}, grown as batches need
        self.schemas = {}  # {name: the JSON schemas of its tools, or None}
        self.reward_types = []  # classes that own a reward, in order
        for name, make in self.factories.items():
            self.pool[name] = [self.probe(name, make)]

    def probe(self, name, make):
        """A first instance of environment `name`: its reset, tools and reward, checked before
        step 1. -> the instance (the pool's first)."""
        instance = make()
        cls = type(instance)
        if not callable(getattr(instance, "reset", None)):
            raise ValueError(
                "Each environment instance returned by `environment_factory` must "
                f"define a callable `reset` ({cls.__name__} does not)."
            )
        methods = methods_of(instance)
        clash = sorted({m.__name__ for m in methods} & set(self.tools))
        if clash:
            raise ValueError(
                f"environment {cls.__name__}: its methods {clash} have the names "
                "of tools the config lists: rename one"
            )
        try:
            schemas = [tool_schema(f) for f in self.tools.values()]
            schemas += [tool_schema(m) for m in methods]
        except ValueError as e:
            raise ValueError(f"environment {cls.__name__}: {e}") from None
        self.schemas[name] = schemas or None
        owns_reward = inspect.isfunction(getattr(cls, "get_reward", None))  # TRL's test
        if owns_reward and cls not in self.reward_types:
            self.reward_types.append(cls)
        return instance

    def reward_funcs(self) -> list:
        """[(class name, function)]: one reward function per class that defines get_reward."""
        return [env_reward(cls) for cls in self.reward_types]

    def name_of(self, row: dict):
        """The environment `row` is routed to (None with a single factory). ValueError for a
        name the factories lack (TRL's message) or a row without the column."""
        if not self.multi:
            return None
        if "environment" not in row:
            raise ValueError(
                "A `dict` `environment_factory` (multiple environments) needs an "
                "`environment` column in every row to route it to its "
                f"environment; this row has {sorted(row)}"
            )
        name = row["environment"]
        if name not in self.factories:
            raise ValueError(
                f"Example has `environment={name!r}`, which is not among the environments "
                f"passed to `environment_factory`. Expected one of: {list(self.factories)}."
            )
        return name

    def prompt_of(self, row: dict):
        """The row's prompt; TRL's empty user message when it has none (reset writes it)."""
        return row.get("prompt", EMPTY_PROMPT)

    def schemas_of(self, row: dict) -> list[dict] | None:
        """The tool schemas a row's prompt is rendered with: its environment's."""
        return self.schemas[self.name_of(row)]

    def check_rows(self, rows: list[dict], source: str):
        """Every row routes to a known environment, and its prompt is a message list (an
        observation is appended to a message; tools need a chat template)."""
        for i, row in enumerate(rows):
            self.name_of(row)
            if isinstance(self.prompt_of(row), str):
                raise ValueError(
                    f"dataset {source}, row {i}: environment_factory needs "
                    "conversational prompts (message lists), not strings"
                )

    def start(self, rows: list[dict], copies: int) -> Episodes:
        """An instance for each of the `copies` completions of each row, reset with its row, and
        its prompt and tools. Instances are reused from the last batch (the pool), so those of
        the last batch are reset here: its rewards must be scored before."""
        names = [self.name_of(row) for row in rows for _ in range(copies)]
        instances = []
        handed = {}  # instances of each environment handed out in this batch
        for name in names:
            k = handed.get(name, 0)
            pool = self.pool[name]
            if k == len(pool):
                pool.append(self.factories[name]())
            handed[name] = k + 1
            instances.append(pool[k])
        prompts = []
        for r, env in enumerate(instances):
            row = rows[r // copies]
            kwargs = {k: v for k, v in row.items() if k != "environment"} if self.multi else row
            observation = env.reset(**kwargs)
            if inspect.isawaitable(observation):
                observation.close()
                raise TypeError(
                    f"{type(env).__name__}.reset is async: TRL calls reset without "
                    "awaiting it, so it must be a plain method"
                )
            prompts.append(with_observation(self.prompt_of(row), observation))
        tools = [{**self.tools, **{m.__name__: m for m in methods_of(env)}} for env in instances]
        schemas = [self.schemas[name] for name in names]
        turns = ToolTurns(tools, schemas, self.rules, self.run_tools) if any(tools) else None
        return Episodes(instances=instances, prompts=prompts, turns=turns)
