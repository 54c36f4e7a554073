"""environments.py (TRL's environment_factory) and custom_rollout.py (TRL's rollout_func): a
scripted policy (sampler.generate monkeypatched, as in test_rollout.py) calls the environments'
tools, so tool rounds, masks and rewards can be checked exactly; a config file runs a TRL-docs-style
environment unchanged, on 1 and 2 processes."""

import asyncio
import json
import math
import os
import string
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, fixture_path, tiny_config
from test_dist import torchrun

import train
from nanogrpo import checkpoint, rollout as rollout_module
from nanogrpo.extras import tool_rounds
from nanogrpo.extras.custom_rollout import checked_output, generate_rollout_completions, rollout_of
from nanogrpo.extras.environments import Environments
from nanogrpo.extras.generation_kwargs import sampling_of
from nanogrpo.extras.tools import tool_suffix_ids
from nanogrpo.model import Transformer
from nanogrpo.rollout import rollout
from nanogrpo.run import config_record
from nanogrpo.run.config import ConfigError, TrainConfig
from nanogrpo.run.configurator import load_config, read_config_file
from nanogrpo.sampler import Generation
from nanogrpo.tokenizer import char_level_tokenizer

TEMPLATE = open(os.path.join(fixture_path("tools"), "hermes_chatml.jinja")).read()
CALL = '<tool_call>{{"name": "{}", "arguments": {}}}</tool_call>'
TIMING = ("step_time", "tokens_per_sec", "time/")


def chat_tokenizer():
    tok = char_level_tokenizer(string.printable)
    tok.chat_template = TEMPLATE
    return tok


# --- environments, as TRL's docs write them ------------------------------------------------------


class Counter:
    """A counter that starts at the row's `start`."""

    def __init__(self):
        self.value = 0
        self.resets = []  # the keyword arguments of each reset

    def reset(self, start=0, **kwargs) -> str:
        self.resets.append({"start": start, **kwargs})
        self.value = int(start)
        return f" Start at {self.value}."

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: How much to add.

        Returns:
            The new value.
        """
        self.value += by
        return self.value

    async def read(self) -> int:
        """Read the counter (an async tool)."""
        await asyncio.sleep(0)
        return self.value

    def explode(self) -> str:
        """A tool that always fails."""
        raise RuntimeError("kaboom")

    def get_reward(self) -> float:
        return float(self.value)

    def _private(self):
        return "not a tool"


class WordGame:
    """Guess the row's word."""

    def reset(self, **kwargs) -> str | None:
        self.word = kwargs["word"]
        self.solved = False
        return None

    def guess(self, word: str) -> str:
        """
        Guess the secret word.

        Args:
            word: The guessed word.

        Returns:
            Whether it is right.
        """
        self.solved = word == self.word
        return "Correct!" if self.solved else "Wrong."

    async def get_reward(self) -> float:
        return 1.0 if self.solved else 0.0


class NoReward:
    def reset(self, **kwargs):
        return None


# --- a scripted policy: sampler.generate replaced by turns written from each row's context -------


def counter_policy(context: str, j: int, k: int) -> str:
    """Even samples: increment by k (a draw of the round's random stream), read (async), answer;
    odd samples: a tool that raises, then an answer. Words rows: guess once."""
    parts = context.split("<|im_start|>tool\n")[1:]
    results = [part.split("<|endoftext|>")[0] for part in parts]  # the tool results so far
    if "Guess" in context:
        return CALL.format("guess", '{"word": "cat"}') if not results else "ok"
    if not results:
        return (
            CALL.format("increment", f'{{"by": {k}}}')
            if j % 2 == 0
            else CALL.format("explode", "{}")
        )
    if len(results) == 1 and results[0].isdigit():
        return CALL.format("read", "{}")
    return "done " + results[-1]


def scripted(tok, policy, log=None):
    """A stand-in for sampler.generate: row i of prompt p writes policy(context, sample, k), k in
    1..5 drawn from the call's generator (or its seeds), then the eos."""
    eos = tok.eos_token_id

    def generate(model, prompt_ids, settings, num_samples=1, generator=None, seeds=None):
        n = len(prompt_ids) * num_samples
        if seeds is not None:
            draws = [s % 5 + 1 for s in seeds]
        else:
            draws = torch.randint(1, 6, (n,), generator=generator).tolist()
        if log is not None:
            log.append({"prompts": len(prompt_ids), "num_samples": num_samples})
        rows = []
        for i, p in enumerate(prompt_ids):
            context = tok.decode(p, skip_special_tokens=False)
            for j in range(num_samples):
                text = policy(context, j, draws[i * num_samples + j])
                rows.append(tok.encode(text, add_special_tokens=False) + [eos])
        C = min(settings.max_new_tokens, max(map(len, rows)))
        ids = torch.full((n, C), settings.pad_id)
        mask = torch.zeros(n, C, dtype=torch.bool)
        for i, r in enumerate(rows):
            ids[i, : min(len(r), C)] = torch.tensor(r[:C])
            mask[i, : min(len(r), C)] = True
        truncated = torch.tensor([len(r) > C for r in rows])
        return Generation(ids, mask, torch.zeros(n, C), truncated)

    return generate


def counter_rows(*starts):
    return [{"prompt": [{"role": "user", "content": "count"}], "start": s} for s in starts]


def run_rollout(monkeypatch, envs, rows, G=2, log=None, seed=0):
    tok = chat_tokenizer()
    fake = scripted(tok, counter_policy, log)
    monkeypatch.setattr(rollout_module, "generate", fake)
    monkeypatch.setattr(tool_rounds, "generate", fake)  # the tool rounds' calls
    cfg = TrainConfig(max_completion_length=1000)
    model = Transformer(tiny_config(vocab_size=tok.vocab_size, max_position_embeddings=4096))
    episodes = envs.start(rows, G)
    gen = torch.Generator().manual_seed(seed)
    settings = sampling_of(cfg, tok)
    ro = rollout(
        model,
        tok,
        rows,
        num_generations=G,
        settings=settings,
        generator=gen,
        episodes=episodes,
    )
    return tok, ro


# --- one rollout in environments ------------------------------------------------------------------


def test_each_completion_plays_its_own_environment_with_sync_async_and_failing_tools(monkeypatch):
    envs = Environments(Counter)
    tok, ro = run_rollout(monkeypatch, envs, counter_rows(3, 10))
    instances = ro.extra_fields["environments"]
    assert len({id(e) for e in instances}) == 4 and all(type(e) is Counter for e in instances)
    # reset(**row) before generation; its string appended to the last message, no separator
    assert instances[2].resets == [{"start": 10, "prompt": [{"role": "user", "content": "count"}]}]
    assert ro.prompts[0] == [{"role": "user", "content": "count Start at 3."}]
    assert ro.prompts[3] == [{"role": "user", "content": "count Start at 10."}]
    # even rows: increment (sync) then read (async) on their own instance; odd rows: a failure
    by = [
        json.loads(m["content"]) - s
        for m, s in ((ro.completions[0][1], 3), (ro.completions[2][1], 10))
    ]
    assert [e.value for e in instances] == [3 + by[0], 3, 10 + by[1], 10]
    assert ro.completions[0][3] == {"role": "tool", "name": "read", "content": str(3 + by[0])}
    assert ro.completions[1][1] == {
        "role": "tool",
        "name": "explode",
        "content": "{'error': 'kaboom'}",
    }
    assert ro.completions[1][2]["content"] == "done {'error': 'kaboom'}"  # the run went on
    assert ro.tool_calls.tolist() == [2, 1, 2, 1] and ro.tool_failures.tolist() == [0, 1, 0, 1]
    # the environment's reward, and a reward function of TRL's that reads `environments`
    name, get_reward = envs.reward_funcs()[0]
    assert name == "Counter"

    def increments(environments, start, **kwargs):
        return [e.value - s for e, s in zip(environments, start)]

    rewards = train.reward_rollout(ro, [envs.reward_funcs()[0], ("increments", increments)])
    expected = [[3.0 + by[0], by[0]], [3.0, 0.0], [10.0 + by[1], by[1]], [10.0, 0.0]]
    assert rewards.tolist() == expected


def test_tool_results_are_never_trained_on_nor_counted_as_length(monkeypatch):
    envs = Environments(Counter)
    tok, ro = run_rollout(monkeypatch, envs, counter_rows(3))
    turns = [m for m in ro.completions[0] if m["role"] == "assistant"]
    by = ro.extra_fields["environments"][0].value - 3
    texts = [
        CALL.format("increment", '{"by": %d}' % by),
        CALL.format("read", "{}"),
        turns[2]["content"],
    ]
    model_ids = [tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in texts]
    results = [tool_suffix_ids(tok, [m]) for m in ro.completions[0] if m["role"] == "tool"]
    expected = (
        [1] * len(model_ids[0])
        + [0] * len(results[0])
        + [1] * len(model_ids[1])
        + [0] * len(results[1])
        + [1] * len(model_ids[2])
    )
    C = ro.completion_mask.shape[1]
    assert ro.completion_mask[0].tolist() == expected + [0] * (C - len(expected))
    assert ro.completion_lengths[0] == sum(map(len, model_ids))  # the model's tokens only


def test_the_pool_reuses_instances_and_grows_only_as_a_batch_needs(monkeypatch):
    envs = Environments(Counter)
    first = envs.start(counter_rows(1), 2).instances
    second = envs.start(counter_rows(2, 3), 2).instances
    assert second[:2] == first and len(envs.pool[None]) == 4
    assert [e.value for e in second] == [2, 2, 3, 3]  # reset for the new batch
    assert envs.start(counter_rows(5), 2).instances == first


def test_different_observations_give_each_completion_its_prompt(monkeypatch):
    class Seat(Counter):
        count = 0

        def __init__(self):
            super().__init__()
            Seat.count += 1
            self.seat = Seat.count

        def reset(self, **kwargs):
            super().reset(**kwargs)
            return f" Seat {self.seat}."

    log = []
    tok, ro = run_rollout(monkeypatch, Environments(Seat), counter_rows(0, 0), log=log)
    assert len(ro.prompt_ids) == 4  # one per completion: the observations differ
    seats = [e.seat for e in ro.extra_fields["environments"]]
    for r, ids in enumerate(ro.prompt_ids):
        assert f"count Seat {seats[r]}." in tok.decode(ids, skip_special_tokens=False)
    assert log[0] == {"prompts": 4, "num_samples": 1}
    P = ro.input_ids.shape[1] - ro.completion_mask.shape[1]
    for r in range(4):  # the log-prob pass sees each completion after its own prompt
        row = ro.input_ids[r][:P][ro.attention_mask[r][:P] == 1].tolist()
        assert row == ro.prompt_ids[r]
    log.clear()
    tok, ro = run_rollout(monkeypatch, Environments(Counter), counter_rows(1, 2), log=log)
    assert len(ro.prompt_ids) == 2 and log[0] == {"prompts": 2, "num_samples": 2}  # shared


def test_a_dict_of_environments_routes_rows_and_shows_each_prompt_its_tools(monkeypatch):
    envs = Environments({"counter": Counter, "words": WordGame})
    rows = [
        {
            "prompt": [{"role": "user", "content": "count"}],
            "environment": "counter",
            "start": 1,
            "word": "-",
        },
        {
            "prompt": [{"role": "user", "content": "Guess"}],
            "environment": "words",
            "start": 0,
            "word": "cat",
        },
    ]
    tok, ro = run_rollout(monkeypatch, envs, rows)
    kinds = [type(e) for e in ro.extra_fields["environments"]]
    assert kinds == [Counter, Counter, WordGame, WordGame]
    counter_prompt = tok.decode(ro.prompt_ids[0], skip_special_tokens=False)
    words_prompt = tok.decode(ro.prompt_ids[1], skip_special_tokens=False)
    assert '"name": "increment"' in counter_prompt and '"name": "guess"' not in counter_prompt
    assert '"name": "guess"' in words_prompt and '"name": "increment"' not in words_prompt
    assert "environment" not in ro.extra_fields["environments"][0].resets[0]  # a control column
    assert ro.completions[2][1]["content"] == "Correct!" and ro.tool_failures[2] == 0
    # each class's get_reward scores its own rows only (async for WordGame)
    rewards = train.reward_rollout(ro, envs.reward_funcs())
    assert [name for name, _ in envs.reward_funcs()] == ["Counter", "WordGame"]
    assert rewards[2:, 1].tolist() == [1.0, 1.0] and rewards[2:, 0].isnan().all()
    assert rewards[:2, 1].isnan().all() and not rewards[:2, 0].isnan().any()
    with pytest.raises(
        ValueError,
        match=r"Example has `environment='chess'`, which is not among "
        r"the environments passed to `environment_factory`. Expected one of: "
        r"\['counter', 'words'\]",
    ):
        envs.start([{**rows[0], "environment": "chess"}], 2)
    with pytest.raises(ValueError, match="needs an `environment` column"):
        envs.start(counter_rows(1), 2)


def test_rows_without_a_prompt_get_trls_empty_one(tmp_path):
    """An environment may own the data: a row without `prompt` is TRL's empty user message, which
    reset's observation fills; the placeholder is not passed to reset."""
    from nanogrpo.extras.datasets import load_dataset

    path = write_rows(tmp_path / "rows.jsonl", [{"start": 3}, {"start": 4}])
    with pytest.raises(ValueError, match="row 0: no 'prompt' column"):
        load_dataset(path)
    rows = load_dataset(path, needs_prompt=False)
    envs = Environments(Counter)
    envs.check_rows(rows, path)
    episodes = envs.start(rows, 2)
    assert episodes.prompts[2] == [{"role": "user", "content": " Start at 4."}]
    assert episodes.instances[2].resets == [{"start": 4}]
    with pytest.raises(ValueError, match="row 0: environment_factory needs conversational"):
        envs.check_rows([{"prompt": "a string"}], path)


def test_environment_classes_are_checked_before_step_1():
    class NoReset:
        def act(self) -> str:
            """Act."""
            return "x"

    class Undocumented:
        def reset(self, **kwargs):
            return None

        def act(self, x: int) -> str:
            return "x"

    with pytest.raises(ValueError, match="must define a callable `reset`"):
        Environments(NoReset)
    with pytest.raises(ValueError, match="environment Undocumented: tool act: has no docstring"):
        Environments(Undocumented)
    with pytest.raises(ValueError, match=r"methods \['guess'\] have the names of tools"):
        Environments(WordGame, {"guess": len})
    envs = Environments(Counter)
    assert [s["function"]["name"] for s in envs.schemas[None]] == ["explode", "increment", "read"]
    assert envs.reward_funcs()[0][0] == "Counter" and Environments(NoReward).reward_funcs() == []


# --- training runs with a scripted policy --------------------------------------------------------


def write_chat_model(path, max_positions=2048):
    """A random tiny model whose tokenizer is printable characters with a tool-calling template."""
    tok = chat_tokenizer()
    torch.manual_seed(0)
    model = Transformer(
        tiny_config(vocab_size=tok.vocab_size, max_position_embeddings=max_positions)
    )
    gen = {"eos_token_id": [tok.eos_token_id], "pad_token_id": tok.pad_token_id}
    with checkpoint.atomic_dir(str(path)) as tmp:
        checkpoint.write_model(
            tmp, model.config, model.state_dict(), tokenizer=tok, generation_config=gen
        )
    return str(path)


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def scripted_run(tmp_path, monkeypatch, out="run", **settings):
    fake = scripted(chat_tokenizer(), counter_policy)
    monkeypatch.setattr(rollout_module, "generate", fake)
    monkeypatch.setattr(tool_rounds, "generate", fake)  # the tool rounds' calls
    model = tmp_path / "model"
    if not model.exists():
        write_chat_model(model)
    base = dict(
        model=str(model),
        device="cpu",
        bf16=False,
        dataset=None,
        environment_factory=Counter,
        reward_funcs=[],
        num_generations=2,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        max_completion_length=400,
        max_steps=2,
        logging_steps=1,
        save_steps=0,
        learning_rate=1e-3,
        gradient_checkpointing=False,
        vllm_importance_sampling_correction=False,
        output_dir=str(tmp_path / out),
    )
    return train.train(TrainConfig(**{**base, **settings}))


def untimed(history):
    return [{k: v for k, v in m.items() if not k.startswith(TIMING)} for m in history]


def calls(environments, **kwargs):
    return [float(len(e.resets)) for e in environments]


def test_get_reward_alone_or_beside_reward_funcs_is_logged_under_the_class(tmp_path, monkeypatch):
    # no dataset: the environment owns the data (TRL's empty prompts; reset writes them)
    alone = scripted_run(tmp_path, monkeypatch, out="alone")
    assert [m["step"] for m in alone] == [1, 2]
    for m in alone:
        assert m["reward"] == pytest.approx(m["rewards/Counter/mean"])
        assert m["tools/call_frequency"] == 1.5  # a group: 2 + 1 calls
        assert m["tools/failure_frequency"] == pytest.approx(1 / 3)  # the failing tool's
        # model tokens only: "explode" rows are shorter than "increment, read" rows
        assert 0 < m["completions/min_length"] < m["completions/max_length"]
    beside = scripted_run(tmp_path, monkeypatch, out="beside", reward_funcs=[calls])
    for m in beside:
        assert "rewards/Counter/mean" in m and m["rewards/calls/mean"] >= 1
        assert m["reward"] == pytest.approx(m["rewards/Counter/mean"] + m["rewards/calls/mean"])
    with pytest.raises(
        ConfigError,
        match="No reward source provided. Pass `reward_funcs`, or an "
        "`environment_factory` whose environment defines a `get_reward` method.",
    ):
        scripted_run(tmp_path, monkeypatch, out="none", environment_factory=NoReward)


def test_resume_is_exact_with_environments(tmp_path, monkeypatch):
    """The environments' state lives for one rollout: nothing to checkpoint, the run resumes
    exactly (the scripted increments come from each round's seeded stream)."""
    rows = write_rows(tmp_path / "rows.jsonl", counter_rows(*range(8)))
    same = dict(dataset=rows, lr_scheduler_type="constant")
    full = scripted_run(tmp_path, monkeypatch, out="a", max_steps=4, **same)
    first = scripted_run(tmp_path, monkeypatch, out="b", max_steps=2, **same)
    resumed = scripted_run(
        tmp_path, monkeypatch, out="b", max_steps=4, resume_from_checkpoint=True, **same
    )
    assert untimed(first) == untimed(full[:2]) and untimed(resumed) == untimed(full)
    assert len({m["reward"] for m in full}) > 1  # the rounds differ
    a = checkpoint.load_model(tmp_path / "a" / "checkpoint").state_dict()
    b = checkpoint.load_model(tmp_path / "b" / "checkpoint").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


# --- a TRL-docs-style environment, unchanged, from a config file ---------------------------------

GAME = '''
class WordGame:
    def __init__(self):
        self.word = ""
        self.guesses = 0
        self.solved = False

    def reset(self, **kwargs) -> str | None:
        self.word = kwargs["word"]
        self.guesses = 0
        self.solved = False
        return f" It has {len(self.word)} letters."

    def guess(self, word: str) -> str:
        """
        Guess the secret word.

        Args:
            word: The guessed word.

        Returns:
            Whether the guess is right.
        """
        self.guesses += 1
        self.solved = word == self.word
        return "Correct!" if self.solved else "Wrong."

    def get_reward(self) -> float:
        return len(self.word) / 10 + (1.0 if self.solved else 0.0)


def own_word(environments, word, **kwargs):
    return [float(e.word == w) for e, w in zip(environments, word)]


environment_factory = WordGame
reward_funcs = [own_word]
'''


def word_game(tmp_path, code=GAME, **overrides) -> str:
    """A config file: a tiny chat model, rows {"prompt": "Guess the word.", "word": ...} and
    `code` (TRL's docs' WordGame), overrides on top."""
    words = ["cat", "horse", "ox", "tiger", "emu", "yak", "lion", "goat"]
    rows = [{"prompt": [{"role": "user", "content": "Guess the word."}], "word": w} for w in words]
    settings = dict(
        model=write_chat_model(tmp_path / "model", max_positions=1024),
        dataset=write_rows(tmp_path / "rows.jsonl", rows),
        device="cpu",
        bf16=False,
        num_generations=4,
        per_device_train_batch_size=4,
        max_completion_length=16,
        max_steps=2,
        logging_steps=1,
        save_steps=0,
        gradient_checkpointing=False,
    )
    settings.update(overrides)
    config = tmp_path / "game.py"
    config.write_text("".join(f"{k} = {v!r}\n" for k, v in settings.items()) + code)
    return str(config)


def test_a_trl_docs_environment_runs_from_a_config_file_on_one_and_two_processes(tmp_path):
    config = word_game(tmp_path)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    one = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--config",
            str(config),
            "--per_device_train_batch_size=8",
            f"--output_dir={tmp_path}/one",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert one.returncode == 0, (one.stdout + one.stderr)[-3000:]
    two = torchrun("--config", str(config), f"--output_dir={tmp_path}/two")
    assert two.returncode == 0, (two.stdout + two.stderr)[-3000:]
    assert "2 process(es)" in two.stdout
    runs = [
        [json.loads(line) for line in open(tmp_path / d / "metrics.jsonl")] for d in ("one", "two")
    ]
    for a, b in zip(*runs):  # the same prompts a step: the same environment rewards
        assert (
            a["step"] == b["step"]
            and a["rewards/own_word/mean"] == 1.0 == b["rewards/own_word/mean"]
        )  # each completion's environment was reset with its row
        assert a["rewards/WordGame/mean"] == pytest.approx(b["rewards/WordGame/mean"])
    assert [m["step"] for m in runs[1]] == [1, 2]
    record = json.load(open(tmp_path / "one" / "checkpoint" / "train_config.json"))
    assert record["environment_factory"] == "WordGame (config file)"


# --- the settings ---------------------------------------------------------------------------------


def test_environment_factory_and_rollout_func_are_read_as_trl_passes_them(tmp_path):
    envs_file = tmp_path / "envs.py"
    envs_file.write_text("class Echo:\n    def reset(self, **kwargs):\n        return None\n")
    config = tmp_path / "c.py"
    config.write_text(
        "class MyEnv:\n    def reset(self, **kwargs):\n        return None\n"
        "def f(prompts, trainer):\n    return {}\n"
        "model = 'm'\nenvironment_factory = MyEnv\nrollout_func = None\n"
        "reward_funcs = []\n"
    )
    cfg = load_config(["--config", str(config)])
    assert cfg.environment_factory.__name__ == "MyEnv" and cfg.reward_funcs == []
    assert config_record(cfg)["environment_factory"] == "MyEnv (config file)"
    spec = f"{envs_file}:Echo"
    cfg = load_config(["--config", str(config), f"--environment_factory={spec}"])
    assert Environments(cfg.environment_factory).factories[None].__name__ == "Echo"
    both = load_config(
        ["--config", str(config), f"--environment_factory={{'a': '{spec}', 'b': '{spec}'}}"]
    )
    assert list(Environments(both.environment_factory).factories) == ["a", "b"]
    assert config_record(both)["environment_factory"] == {"a": spec, "b": spec}
    with pytest.raises(ConfigError, match="rollout_func=.*leave tools and environment_factory"):
        TrainConfig(rollout_func=print, environment_factory=Counter).validate()
    with pytest.raises(
        ConfigError,
        match="dataset=None: a dataset is required unless an environment_factory is provided",
    ):
        TrainConfig(dataset=None).validate()
    with pytest.raises(ConfigError, match="max_steps=-1: must be > 0 without a dataset"):
        TrainConfig(dataset=None, environment_factory=Counter, reward_funcs=[]).validate()
    with pytest.raises(ConfigError, match="a dict environment_factory"):
        TrainConfig(dataset=None, environment_factory={"a": Counter}, max_steps=2).validate()
    with pytest.raises(ConfigError, match="reward_funcs=\\[\\]: needs at least one"):
        TrainConfig(reward_funcs=[]).validate()


# --- rollout_func -------------------------------------------------------------------------------

ROLLOUTS = []  # what each call of rollout_with_an_environment saw and returned


def rollout_with_an_environment(prompts, trainer):
    """TRL's openenv pattern: generate, let an environment answer (its tokens masked with env_mask),
    return the environment's reward as an extra field."""
    tok = trainer.processing_class
    outputs = generate_rollout_completions(trainer, prompts)
    reply = tok.encode("=ab", add_special_tokens=False)  # the environment's tokens
    out = {
        "prompt_ids": [],
        "completion_ids": [],
        "logprobs": [],
        "env_mask": [],
        "env_reward": [],
        "task": "copy",
    }
    for o in outputs:
        out["prompt_ids"].append(o["prompt_ids"])
        out["completion_ids"].append(o["completion_ids"] + reply)
        out["logprobs"].append(o["logprobs"] + [0.0] * len(reply))
        out["env_mask"].append([1] * len(o["completion_ids"]) + [0] * len(reply))
        out["env_reward"].append(float(o["text"].startswith("a")))
    ROLLOUTS.append({"prompts": prompts, "step": trainer.state.global_step, "out": out})
    return out


def from_env(completions, env_reward, task, **kwargs):
    assert task == ["copy"] * len(completions)  # a shared extra field reaches every completion
    return env_reward


def test_a_rollout_func_trains_and_its_fields_reach_the_rewards(tmp_path):
    ROLLOUTS.clear()
    init = f"--init_model={read_config_file('tiny')['init_model']!r}"
    cfg = load_config(
        [
            "--config",
            "tiny.py",
            f"--model={tmp_path}/init",
            init,
            f"--output_dir={tmp_path}/run",
            "--gradient_accumulation_steps=2",
            "--num_generations=4",
            "--per_device_train_batch_size=8",
            "--max_completion_length=6",
            "--eval_strategy=no",
            "--max_steps=2",
            f"--rollout_func={__name__}:rollout_with_an_environment",
            f"--reward_funcs={__name__}:from_env,default_task",
        ]
    )
    history = train.train(cfg)
    assert [m["step"] for m in history] == [1, 2] and [r["step"] for r in ROLLOUTS] == [0, 1]
    for m, call in zip(history, ROLLOUTS):
        prompts, out = call["prompts"], call["out"]
        assert len(prompts) == 16 and all(p == prompts[0] for p in prompts[:4])  # G copies
        assert m["rewards/from_env/mean"] == pytest.approx(sum(out["env_reward"]) / 16)
        # lengths count the model's tokens (env_mask 1) only
        model_tokens = [sum(mask) for mask in out["env_mask"]]
        assert m["completions/mean_length"] == pytest.approx(sum(model_tokens) / 16)
        assert m["completions/max_length"] == max(model_tokens)
        assert math.isfinite(m["loss"]) and m["grad_norm"] > 0


def test_env_mask_keeps_environment_tokens_out_of_the_loss():
    tok = char_level_tokenizer("abcdefgh=")
    cfg = TrainConfig(mask_truncated_completions=True)
    rows = [{"prompt": "ab="}]
    eos = tok.eos_token_id
    output = {
        "prompt_ids": [[1, 2, 9], [1, 2, 9]],
        "completion_ids": [[3, 4, 5, eos], [3, 4]],
        "logprobs": [[-1.0] * 4, [-1.0] * 2],
        "env_mask": [[1, 0, 0, 1], [1, 0]],
        "score": [0.5, 1.5],
    }
    truncation = dict(mask_truncated_completions=cfg.mask_truncated_completions)
    ro = rollout_of(
        output, rows, 2, ["ab=", "ab="], tok=tok, **truncation, context=64, device="cpu"
    )
    assert ro.completion_mask.tolist() == [[1, 0, 0, 1], [0, 0, 0, 0]]  # row 1 ends without eos
    assert ro.truncated.tolist() == [False, True]
    assert ro.completion_lengths.tolist() == [2, 1]
    assert ro.input_ids[0].tolist() == [1, 2, 9, 3, 4, 5, eos]
    assert ro.extra_fields == {"score": [0.5, 1.5]} and ro.completions[1] == tok.decode([3, 4])
    assert ro.sampling_logps.tolist() == [[-1.0] * 4, [-1.0, -1.0, 0.0, 0.0]]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"logprobs": "drop"}, r"rollout_func must return keys \['logprobs'\] in its output dict."),
        (
            {"completion_ids": [[3]]},
            r"returned 1 entries as 'completion_ids'; expected a list of 2",
        ),
        ({"logprobs": [[0.0], [0.0, 0.0]]}, r"logprobs\[0\] has 1 entries, completion_ids\[0\] 2"),
        ({"env_mask": [[1, 1], [1]]}, r"env_mask\[1\] has 1 entries, completion_ids\[1\] 2"),
        ({"env_mask": [[1, 2], [1, 1]]}, r"env_mask\[0\] must hold 0 and 1 only"),
        (
            {"extra": [1.0, 2.0, 3.0]},
            r"returned 3 values as 'extra'; a list field holds one per "
            r"completion \(2\)",
        ),
        ({"completion_ids": [[3, 99], [3, 4]]}, r"token ids in \[0, 10\)"),
        (
            {"prompt_ids": [[1] * 60, [1]]},
            r"completion 0 is 60 prompt \+ 2 completion tokens, more "
            r"than the model's 61 positions",
        ),
        ({"completions": [1, 2]}, r"'completions', a name the trainer passes"),
        # None log-probs per completion, or one float per completion: the entry is named
        (
            {"logprobs": [None, None]},
            r"returned None as logprobs\[0\]: expected a list, one log-prob per token of its "
            r"completion_ids \(or return 'logprobs': None when the function has none\)",
        ),
        ({"logprobs": [-0.5, -0.5]}, r"returned -0.5 as logprobs\[0\]: expected a list"),
        ({"logprobs": [[0.0, 0.0], None]}, r"returned None as logprobs\[1\]"),
        ({"logprobs": [[0.0, None], [0.0, 0.0]]}, r"logprobs\[0\]\[1\] is None: each entry is"),
        ({"prompt_ids": [7, [1]]}, r"returned 7 as prompt_ids\[0\]: expected a list"),
        (
            {"prompt_ids": [{"input_ids": [1], "attention_mask": [1]}, [1]]},
            r"as prompt_ids\[0\]: expected a list, its prompt's token ids: take its 'input_ids'",
        ),
    ],
)
def test_a_wrong_rollout_func_output_names_the_field(change, message):
    output = {
        "prompt_ids": [[1], [1]],
        "completion_ids": [[3, 4], [3, 4]],
        "logprobs": [[0.0, 0.0], [0.0, 0.0]],
    }
    output.update({k: v for k, v in change.items() if v != "drop"})
    for k in [k for k, v in change.items() if v == "drop"]:
        del output[k]
    with pytest.raises(ValueError, match=message):
        checked_output(output, 2, 10, 61)


def test_the_vault_demo_room_and_its_config():
    """examples/vault_game.py's VaultRoom scores what configs/vault.py trains on: success only for
    the code read from the note within two tries, partial credit only for reading the note and then
    trying a code; reading it and stopping earns what doing nothing earns (0), so that the policy is
    never rewarded for ending its turn after the note (where training settled on 2 seeds of 3)."""
    import importlib.util

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location(
        "vault_game", os.path.join(ROOT, "examples", "vault_game.py")
    )
    game = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(game)
    room = game.VaultRoom()
    assert room.reset(code="0427") == " The vault is locked." and room.get_reward() == 0.0
    assert room.open_vault("1111").startswith("Wrong") and room.get_reward() == 0.0  # a guess
    room.reset(code="0427")
    assert room.read_note() == "The vault code is 0427." and room.get_reward() == 0.0  # and stop
    assert room.open_vault("1111").startswith("Wrong") and room.get_reward() == pytest.approx(0.4)
    assert room.open_vault(" 0427") == "The vault opens." and room.get_reward() == 1.0
    room.reset(code="0427")
    room.read_note(), room.read_note()
    assert room.get_reward() == 0.0
    room.open_vault("1")
    assert room.get_reward() == pytest.approx(0.3)  # reading again and again, then a try
    room.open_vault("2")
    assert room.open_vault("0427").startswith("Wrong")  # a third try is too late
    # the rooms' codes are 4 digits without a leading zero: a code is written as a JSON number
    rows = game.rows(500, 0)
    codes = [r["code"] for r in rows]
    assert all(len(c) == 4 and c[0] != "0" for c in codes) and len(set(codes)) > 400
    room.reset(code=codes[0])
    room.read_note()
    assert room.open_vault(int(codes[0])) == "The vault opens."  # as the model writes it
    # and so does the worked room: a string there ("3201") taught trained models broken calls
    example = rows[0]["prompt"][4]["content"]  # the worked room's open_vault call
    call = json.loads(example.removeprefix("<tool_call>").removesuffix("</tool_call>"))
    assert call["name"] == "open_vault" and type(call["arguments"]["code"]) is int
    from nanogrpo.run.configurator import load_config

    cfg = load_config(["--config", "vault.py"])
    assert cfg.environment_factory == "examples/vault_game.py:VaultRoom" and cfg.reward_funcs == []


def test_a_run_on_rows_without_a_prompt_reports_and_summarizes(tmp_path, monkeypatch, capsys):
    """An environment that owns the data trains on rows without `prompt`; the summary's sample
    command takes the prompt as reset() wrote it."""
    rows = write_rows(tmp_path / "rows.jsonl", [{"start": s} for s in range(4)])
    history = scripted_run(tmp_path, monkeypatch, dataset=rows, max_steps=1)
    assert [m["step"] for m in history] == [1] and "rewards/Counter/mean" in history[0]
    out = capsys.readouterr().out
    assert "python sample.py --model" in out and "--chat ' Start at" in out


def test_one_environment_file_under_two_names_is_one_reward_column(tmp_path):
    """TRL gives a class one reward column however many names map to it: the same
    "file.py:Class" (however its path is written) is imported once."""
    path = tmp_path / "rooms.py"
    path.write_text(
        "class Room:\n"
        "    def reset(self, **kwargs):\n"
        "        return None\n"
        "    def get_reward(self):\n"
        "        return 1.0\n"
    )
    spec = f"{path}:Room"
    other = f"{tmp_path}/./rooms.py:Room"
    envs = Environments({"a": spec, "b": spec, "c": other})
    assert [name for name, _ in envs.reward_funcs()] == ["Room"]
    assert envs.factories["a"] is envs.factories["b"] is envs.factories["c"]
