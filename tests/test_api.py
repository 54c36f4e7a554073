"""TRL's Python API (nanogrpo/api/): a TRL script runs with its import changed. GRPOConfig takes
TRL's dump, refuses what the command line refuses in its words; GRPOTrainer trains as train.py
does, twice in one process, under torchrun; bad arguments are one line before anything loads."""

import json
import os
import re
import runpy
import subprocess
import sys

import pytest
import torch

import train
from nanogrpo import GRPOConfig, GRPOTrainer
from nanogrpo.api import trainer as api_trainer
from nanogrpo.checkpoint import load_model
from nanogrpo.extras.builtin_rewards import default_task_reward
from nanogrpo.extras.datasets import load_dataset
from nanogrpo.run import trl_names
from nanogrpo.run.config import ConfigError
from nanogrpo.run.configurator import load_config, read_config_file
from nanogrpo.run.outdir import write_tiny_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "trl", "grpo_config_defaults.json")
TINY = read_config_file("tiny")
RECIPE = {
    "init_model": TINY["init_model"],
    "init_tokenizer_chars": TINY["init_tokenizer_chars"],
    "seed": TINY["seed"],
}
TIMING = ("step_time", "tokens_per_sec", "time/sample", "time/score", "time/logprobs")
TIMING += ("time/update",)
ROWS = load_dataset("default")[:64]


@pytest.fixture(scope="module")
def init(tmp_path_factory):
    """The embedded default's tiny model (configs/tiny.py's out/tiny-init)."""
    path = str(tmp_path_factory.mktemp("api") / "tiny-init")
    write_tiny_checkpoint(path, RECIPE)
    return path


def small(out, **overrides) -> GRPOConfig:
    """TRL-named settings of a 3-step run of the tiny model."""
    settings = dict(
        output_dir=str(out),
        learning_rate=1e-3,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=6,
        max_steps=3,
        logging_steps=1,
        gradient_checkpointing=False,
        bf16=False,
        use_cpu=True,
    )
    return GRPOConfig(**{**settings, **overrides})


def untimed(records):
    return [{k: v for k, v in m.items() if k not in TIMING} for m in records]


def test_importing_nanogrpo_loads_no_submodule_until_the_api_is_named():
    code = (
        "import sys, nanogrpo\n"
        "assert [m for m in sys.modules if m.startswith('nanogrpo.')] == [], 'loaded'\n"
        "from nanogrpo import GRPOConfig, GRPOTrainer, distributed\n"
        "assert GRPOConfig.__module__ == 'nanogrpo.api.config'\n"
        "try:\n    nanogrpo.GRPOConfigs\nexcept AttributeError as e:\n    print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "module 'nanogrpo' has no attribute 'GRPOConfigs'" in done.stdout


def test_the_trl_quickstart_example_runs(init, tmp_path, monkeypatch):
    """examples/trl_quickstart.py as a user runs it, from a folder holding out/tiny-init, for 3 of
    its 400 steps."""
    source = open(os.path.join(ROOT, "examples", "trl_quickstart.py")).read()
    assert "from nanogrpo import GRPOConfig, GRPOTrainer" in source
    assert source.count("max_steps=400,") == 1
    script = tmp_path / "quickstart.py"
    script.write_text(source.replace("max_steps=400,", "max_steps=3,"))
    monkeypatch.chdir(tmp_path)
    os.makedirs("out")
    os.symlink(init, "out/tiny-init")
    runpy.run_path(str(script), run_name="__main__")
    logged = [json.loads(line) for line in open("out/tiny-GRPO/metrics.jsonl")]
    assert [m["step"] for m in logged] == [3]  # logging_steps=10: the last step
    assert "rewards/reward_copy/mean" in logged[0]
    assert os.path.isfile("out/tiny-GRPO/checkpoint/model.safetensors")


def test_trls_config_dump_is_taken_and_runs(init, tmp_path, capsys):
    """GRPOConfig(**TRL's GRPOConfig(use_cpu=True).to_dict()) (191 keys, each at TRL's default;
    TRL's own GRPOConfig refuses it: generation_batch_size and steps_per_generation both) is read,
    and trains the tiny model with what a 2-step run on it needs changed."""
    dump = json.load(open(FIXTURE))["to_dict"]
    assert (dump["generation_batch_size"], dump["steps_per_generation"]) == (8, 1)
    cfg = GRPOConfig(**dump)
    assert (cfg.generation_batch_size, cfg.steps_per_generation) == (None, 1)
    assert cfg.device == "cpu" and cfg.bf16 is True and cfg.gradient_checkpointing is True
    assert cfg.logging_steps == 10 and cfg.report_to == "none" and cfg.loss_type == "dapo"
    err = capsys.readouterr().err
    at_default = [line for line in err.splitlines() if "at TRL's default change" in line]
    assert len(at_default) == 1 and "ds3_gather_for_generation, eval_delay" in at_default[0]
    assert "note: dataloader_num_workers changes nothing here" in err
    run = {"output_dir": str(tmp_path / "run"), "max_steps": 2, "max_completion_length": 6}
    trainer = GRPOTrainer(init, "default_task", GRPOConfig(**{**dump, **run}), ROWS)
    out = trainer.train()
    assert out.global_step == 2 and out.metrics["train_loss"] == out.training_loss
    assert [m["step"] for m in trainer.state.log_history] == [2, 2]  # the last step, the summary

    class TRLsOwn:  # trl.GRPOConfig, given to nanogrpo's GRPOTrainer: read by its to_dict()
        def to_dict(self):
            return dump

    trainer = GRPOTrainer(init, "default_task", TRLsOwn(), ROWS)
    assert isinstance(trainer.args, GRPOConfig) and trainer.args.bf16 is True


def cli_refusal(key, value) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(["--model=m", f"--{key}={value}"])
    return str(e.value)


REFUSED_VALUES = [(key, "true") for key in trl_names.REFUSED] + [
    ("label_smoothing_factor", "0.1"),
    ("project", "mine"),
    ("save_strategy", "epoch"),
    ("model_revision", "v2"),
    ("dataset_config", "socratic"),
    ("lora_task_type", "SEQ_CLS"),
]


@pytest.mark.parametrize("key, text", REFUSED_VALUES)
def test_grpo_config_refuses_what_the_command_line_refuses_in_its_words(key, text):
    said = cli_refusal(key, text)
    value = {"true": True, "0.1": 0.1}.get(text, text)
    with pytest.raises(ConfigError) as e:
        GRPOConfig(**{key: value})
    assert str(e.value) == said.replace("on the command line", "in GRPOConfig")


def test_trainer_arguments_are_refused_in_the_command_lines_words(init):
    """GRPOTrainer's arguments nanogrpo has not (TRL's callbacks, optimizers,
    quantization_config; peft_config's DoRA and target_parameters) and the rules between
    settings say what the command line says."""
    reason = cli_refusal("callbacks", "true").split(": ", 1)[1]
    with pytest.raises(ConfigError, match=re.escape(f"'callbacks': {reason}")):
        GRPOTrainer(init, "default_task", train_dataset=ROWS, callbacks=[object()])
    reason = cli_refusal("optimizers", "true").split(": ", 1)[1]
    with pytest.raises(ConfigError, match=re.escape(f"'optimizers': {reason}")):
        GRPOTrainer(init, "default_task", train_dataset=ROWS, optimizers=(object(), None))
    reason = cli_refusal("load_in_4bit", "true").split(": ", 1)[1]
    with pytest.raises(ConfigError, match=re.escape(f"'quantization_config': {reason}")):
        GRPOTrainer(init, "default_task", train_dataset=ROWS, quantization_config={"bits": 4})
    for key, peft_key in (
        ("use_dora", "use_dora"),
        ("lora_target_parameters", "target_parameters"),
    ):
        reason = cli_refusal(key, "true").split(": ", 1)[1]
        with pytest.raises(ConfigError, match=re.escape(f"peft_config: {peft_key}=True: {reason}")):
            GRPOTrainer(init, "default_task", train_dataset=ROWS, peft_config={peft_key: True})
    for arg, field in (("--optim=adamw_8bit", "optim"), ("--temperature=0", "temperature")):
        with pytest.raises(ConfigError) as said:
            load_config(["--model=m", arg])
        value = arg.split("=")[1]
        value = float(value) if field == "temperature" else value
        with pytest.raises(ConfigError) as e:
            GRPOTrainer(init, "default_task", GRPOConfig(**{field: value}), ROWS)
        assert str(e.value) == str(said.value)


@pytest.fixture
def nothing_loads(monkeypatch):
    """Loading a model or a tokenizer fails the test: bad input must be refused first."""

    def loads(*args, **kwargs):
        raise AssertionError("something loaded")

    monkeypatch.setattr(api_trainer, "load_policy", loads)
    monkeypatch.setattr(api_trainer.Tokenizer, "from_pretrained", loads)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(model=42), "model: a int is neither a path, a hub id nor a nanogrpo model"),
        (dict(model=torch.nn.Linear(2, 2)), "model: a Linear is neither a path, a hub id"),
        (dict(model="./no/such"), "model='./no/such': no such directory, and not a hub id"),
        (
            dict(train_dataset=[{"prompt": "ab="}, {"question": "cd="}]),
            "dataset train_dataset, row 1: no 'prompt' column (found ['question'])",
        ),
        (dict(train_dataset={"train": ROWS}), "train_dataset: a mapping of 1 datasets (train)"),
        (dict(train_dataset=3), "train_dataset: a int is not rows"),
        (
            dict(peft_config={"r": 8, "use_dora": True}),
            "peft_config: use_dora=True: LoRA adapters are plain LoRA (extras/lora.py), not DoRA",
        ),
        (
            dict(peft_config={"rank_pattern": {"q_proj": 4}}),
            "peft_config: rank_pattern={'q_proj': 4}: nanogrpo's LoRA (extras/lora.py) does not",
        ),
        (
            dict(peft_config={"init_lora_weights": "gaussian"}),
            "peft_config: init_lora_weights='gaussian': nanogrpo starts adapters as PEFT's",
        ),
        (
            dict(peft_config={"task_type": "SEQ_CLS"}),
            "peft_config's task_type='SEQ_CLS': nanogrpo trains causal LMs",
        ),
        (dict(reward_funcs=[torch.nn.Linear(2, 1)]), "reward_funcs: a loaded Linear is no reward"),
        (dict(args={"learning_rate": 1.0}), "args: a dict: pass a nanogrpo GRPOConfig"),
    ],
)
def test_bad_arguments_are_one_line_before_anything_loads(init, nothing_loads, arguments, message):
    given = {"model": init, "reward_funcs": "default_task", "train_dataset": ROWS, **arguments}
    with pytest.raises(ValueError) as e:
        GRPOTrainer(**given)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_a_nanogrpo_model_without_its_path_is_refused(init, nothing_loads):
    model = load_model(init)
    model.name_or_path = None
    with pytest.raises(ConfigError, match="model: this nanogrpo model has no name_or_path"):
        GRPOTrainer(model, "default_task", train_dataset=ROWS)


def test_the_trainer_trains_as_train_py_does_twice_in_one_process(init, tmp_path):
    """Two trainers in one process, given the default task's rows as a list, and train.py's
    train on the same settings with dataset="default" (those rows, by name): the same steps,
    no state carried from one run to the next. logging_steps=0.5 is half the run's steps,
    rounded up, as transformers counts it."""
    rows = load_dataset("default", seed=42)  # what dataset="default" loads at seed 42
    first = GRPOTrainer(init, "default_task", small(tmp_path / "a", logging_steps=0.5), rows)
    second = GRPOTrainer(init, "default_task", small(tmp_path / "b", logging_steps=0.5), rows)
    one = first.train()
    two = second.train()
    assert one.global_step == two.global_step == 3
    assert one.training_loss == two.training_loss
    logged = [m for m in first.state.log_history if "loss" in m]
    assert [m["step"] for m in logged] == [2, 3]
    assert untimed(logged) == untimed(m for m in second.state.log_history if "loss" in m)
    cfg = load_config(
        [
            f"--model={init}",
            f"--output_dir={tmp_path / 'cli'}",
            "--dataset=default",
            "--learning_rate=1e-3",
            "--per_device_train_batch_size=8",
            "--num_generations=4",
            "--max_completion_length=6",
            "--max_steps=3",
            "--logging_steps=2",
            "--gradient_checkpointing=false",
            "--bf16=false",
            "--device=cpu",
        ]
    )
    train.train(cfg)
    cli = [json.loads(line) for line in open(tmp_path / "cli" / "metrics.jsonl")]
    assert untimed(cli) == untimed(logged)
    assert api_trainer.train_module() is train  # the same loop: train.py's own module


def test_one_trainer_trains_twice_evaluates_and_saves(init, tmp_path):
    """A loaded nanogrpo model trains in place; a second train() goes on from the trained
    weights (overwrite_output_dir: its run replaces the first's); evaluate() and save_model()
    as TRL's, with LoRA adapters from a peft_config dict."""
    model = load_model(init)
    before = model.lm_head.weight.detach().clone()
    args = small(tmp_path / "run", overwrite_output_dir=True, max_steps=2)
    peft = {"r": 4, "lora_alpha": 8, "target_modules": {"q_proj", "v_proj"}}
    modules = {"modules_to_save": ["embed_tokens", "lm_head"]}
    trainer = GRPOTrainer(
        model,
        default_task_reward,
        args,
        train_dataset=iter(ROWS),
        eval_dataset=ROWS[:8],
        peft_config={**peft, **modules},
    )
    assert trainer.args.use_peft and trainer.args.lora_target_modules == ["q_proj", "v_proj"]
    held_out = load_dataset("default", split="test", num_rows=300)
    assert (
        GRPOTrainer(init, "default_task", train_dataset=ROWS, eval_dataset=held_out).args.eval_size
        == 300
    )  # TRL evaluates all of it
    trainer.train()
    assert trainer.model is model and hasattr(model, "lora_config")
    trained = model.lm_head.weight.detach().clone()
    assert not torch.equal(before, trained)
    trainer.train()
    assert trainer.model is model and not torch.equal(trained, model.lm_head.weight)
    metrics = trainer.evaluate()
    assert {"eval_reward", "eval_loss", "eval_rewards/default_task_reward/mean"} <= set(metrics)
    trainer.save_model(str(tmp_path / "saved"))
    assert os.path.isfile(tmp_path / "saved" / "adapter_config.json")
    saved = load_model(tmp_path / "saved")
    assert torch.equal(saved.lm_head.weight, model.lm_head.weight)


def test_train_resumes_a_run_as_trls_train_resume_from_checkpoint(init, tmp_path):
    GRPOTrainer(init, "default_task", small(tmp_path / "run", max_steps=2), ROWS).train()
    more = GRPOTrainer(init, "default_task", small(tmp_path / "run", max_steps=4), ROWS)
    assert more.train(resume_from_checkpoint=True).global_step == 4
    assert [m["step"] for m in more.state.log_history] == [1, 2, 3, 4, 4]
    assert more.model.name_or_path.endswith("checkpoint-2")  # the policy resumed from there


def test_torchrun_runs_a_script_that_uses_it(init, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(
        "from nanogrpo import GRPOConfig, GRPOTrainer\n"
        "from nanogrpo.extras.datasets import load_dataset\n"
        "def reward_len(completions, **kwargs):\n"
        "    return [-abs(4 - len(c)) for c in completions]\n"
        f"args = GRPOConfig(output_dir={str(tmp_path / 'run')!r}, per_device_train_batch_size=4,\n"
        "    num_generations=4, max_completion_length=6, max_steps=2, logging_steps=1,\n"
        "    gradient_checkpointing=False, bf16=False, use_cpu=True)\n"
        f"trainer = GRPOTrainer({init!r}, reward_len, args, load_dataset('default')[:64])\n"
        "out = trainer.train()\n"
        f"trainer.save_model({str(tmp_path / 'saved')!r})\n"
        "print('global_step', out.global_step, len(trainer.state.log_history))\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    done = subprocess.run(
        cmd + [str(script)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 process(es)" in done.stdout
    assert done.stdout.count("global_step 2 3") == 2  # each rank: steps 1, 2 and the summary
    assert os.path.isfile(tmp_path / "saved" / "model.safetensors")
    assert not os.path.exists(tmp_path / "saved" / "trainer")


ASYNC_SCRIPT = """from nanogrpo import GRPOConfig, GRPOTrainer
from nanogrpo.extras.datasets import load_dataset
from nanogrpo.run import async_rollouts


def reward_len(completions, **kwargs):
    return [-abs(4 - len(c)) for c in completions]


def run(out):
    args = GRPOConfig(output_dir=out, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=6, max_steps=3, logging_steps=1, gradient_checkpointing=False,
        bf16=False, use_cpu=True, async_rollouts=True, max_staleness=1, beta=0.04)
    trainer = GRPOTrainer({init!r}, reward_len, args, load_dataset("default")[:64])
    trainer.train()
    return [{{k: v for k, v in m.items() if not k.startswith(("time", "async", "step_time",
        "tokens_per"))}} for m in trainer.state.log_history if "loss" in m]


{body}
"""
GUARDED = """if __name__ == "__main__":
    drawn = run("async")
    async_rollouts.start = async_rollouts.Replay
    print("replayed", len(drawn), drawn == run("replay"))
"""


@pytest.mark.parametrize("guarded", [True, False])
def test_a_script_trains_with_async_rollouts_as_its_replay(init, tmp_path, guarded):
    """GRPOTrainer(..., GRPOConfig(async_rollouts=True)) from a script, its reward function and
    rows its own: the sampler process gets them (it imports the script, as spawn does), and the
    run is its synchronous replay; a script that trains on import is told to guard it."""
    body = GUARDED if guarded else 'run("async")\n'
    script = tmp_path / "script.py"
    script.write_text(ASYNC_SCRIPT.format(init=init, body=body))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    if guarded:
        assert done.returncode == 0, done.stderr[-3000:]
        assert "replayed 3 True" in done.stdout
    else:
        assert done.returncode != 0
        assert 'put the training under `if __name__ == "__main__":`' in done.stderr
        assert "SamplerFailed: the sampler process died" in done.stderr
