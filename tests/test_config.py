"""Config files plus command-line overrides: types, unknown keys, consistency checks, derived sizes."""

import dataclasses
import json
import re

import pytest

from nanogrpo import config as config_module
from nanogrpo.config import LOSS_FIELDS, ConfigError, TrainConfig, convert, load_config

CONFIG_FILE = """
import math
_helper = 3
learning_rate = 1e-5 * _helper
reward_funcs = ("accuracy", "format")
reward_weights = [1, 0.5]
prompts_per_step = 4
micro_batch_size = 16
init_model = dict(hidden_size=64, num_hidden_layers=2)
def not_a_setting():
    pass
"""


def test_file_then_overrides(tmp_path):
    path = tmp_path / "run.py"
    path.write_text(CONFIG_FILE)
    cfg = load_config(["--config", str(path), "--learning_rate=2e-6", "--top-p", "0.9", "--gradient_checkpointing",
                       "--eval_dataset=None", "--resume=runs/a", "--reward_weights=2,3", "--epsilon_high", "0.28"])
    assert cfg.learning_rate == 2e-6 and cfg.top_p == 0.9 and cfg.gradient_checkpointing is True
    assert cfg.reward_funcs == ["accuracy", "format"] and cfg.reward_weights == [2.0, 3.0]
    assert cfg.eval_dataset is None and cfg.resume == "runs/a" and cfg.epsilon_high == 0.28
    assert cfg.init_model == {"hidden_size": 64, "num_hidden_layers": 2}
    assert load_config(["--config", str(path)]).learning_rate == pytest.approx(3e-5)
    assert load_config(["--resume=true"]).resume is True and load_config(["--gradient_checkpointing=0"]).gradient_checkpointing is False


def test_bare_names_are_found_in_configs_dirs(tmp_path, monkeypatch):
    (tmp_path / "mine.py").write_text("max_steps = 7\n")
    monkeypatch.setattr(config_module, "CONFIGS_DIR", str(tmp_path))
    assert load_config(["--config=mine"]).max_steps == 7
    assert load_config(["--config=mine.py"]).max_steps == 7
    with pytest.raises(ConfigError, match="not found"):
        load_config(["--config=absent"])


def test_a_stray_config_in_the_current_directory_never_replaces_a_builtin(tmp_path, monkeypatch):
    """Security regression: `python train.py` (= --config tiny.py) run from a directory holding any
    tiny.py used to execute that file instead of the built-in default."""
    marker = tmp_path / "ran"
    (tmp_path / "tiny.py").write_text(f"open({str(marker)!r}, 'w').write('pwned')\nmax_steps = 3\n")
    monkeypatch.chdir(tmp_path)
    for name in ("tiny", "tiny.py"):
        assert load_config(["--config", name]).max_steps == 400  # the built-in configs/tiny.py
    assert not marker.exists()
    (tmp_path / "mine.py").write_text("max_steps = 9\n")  # a .py of your own (no built-in of that name)
    assert load_config(["--config", "mine.py"]).max_steps == 9
    assert load_config(["--config", "./tiny.py"]).max_steps == 3  # an explicit path is yours


def test_unknown_keys_suggest_the_closest(tmp_path):
    with pytest.raises(ConfigError, match=r"'learnng_rate' on the command line \(did you mean learning_rate\?\)"):
        load_config(["--learnng_rate=1e-6"])
    (tmp_path / "c.py").write_text("num_generation = 4\n")
    with pytest.raises(ConfigError, match=r"'num_generation' in config file .*c\.py \(did you mean num_generations"):
        load_config([f"--config={tmp_path / 'c.py'}"])


def test_every_unknown_key_is_reported_at_once(tmp_path):
    """Porting a config with nine unknown keys must not take nine runs."""
    (tmp_path / "c.py").write_text("".join(f"unknown_{i} = {i}\n" for i in range(7)) + "learnng_rate = 1.0\n")
    with pytest.raises(ConfigError) as e:
        load_config([f"--config={tmp_path / 'c.py'}", "--num_generation=4", "--also_unknown=1"])
    message = str(e.value)
    assert message.startswith("10 unknown config key(s)")
    assert all(f"'unknown_{i}' in config file" in message for i in range(7))
    assert "(did you mean learning_rate?)" in message and "(did you mean num_generations?)" in message
    assert "'also_unknown' on the command line" in message


def test_a_config_must_be_python_and_a_local_namesake_is_named(tmp_path, monkeypatch, capsys):
    (tmp_path / "data.jsonl").write_text('{"prompt": "a"}\n')
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="config 'data.jsonl' is not a .py file"):
        load_config(["--config", "data.jsonl"])
    (tmp_path / "tiny.py").write_text("max_steps = 3\n")
    assert load_config(["--config", "tiny"]).max_steps == 400
    assert "the tiny.py in this directory is not used (pass --config ./tiny.py" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--learning_rate=fast"], "learning_rate='fast': expected float"),
    (["--seed=1.5"], "seed='1.5': expected int"),
    (["--gradient_checkpointing=maybe"], "gradient_checkpointing='maybe': expected bool"),
    (["--reward_weights=[1, 'a']"], "reward_weights"),
    (["--reward_weights=[1,"], "not a Python literal"),
    (["--max_steps"], "--max_steps needs a value"),
    (["small.py"], "unexpected argument"),
])
def test_wrong_types(argv, message):
    with pytest.raises(ConfigError, match=message):
        load_config(argv)


def test_file_values_are_type_checked():
    assert convert("learning_rate", 1) == 1.0
    for key, value in [("max_steps", True), ("max_steps", 2.0), ("gradient_checkpointing", 1), ("model", 3), ("init_model", [1])]:
        with pytest.raises(ConfigError, match=key):
            convert(key, value)


@pytest.mark.parametrize("overrides, key", [
    ({"prompts_per_step": 3, "micro_batch_size": 16}, "micro_batch_size"),
    ({"num_generations": 1}, "num_generations"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"dtype": "fp16"}, "dtype"),
    ({"device": "tpu"}, "device"),
    ({"max_steps": 0}, "max_steps"),
    ({"loss_type": "ppo"}, "loss_type"),
    ({"loss_type": "luspo"}, "loss_type"),
    ({"reward_weights": [1.0, 2.0]}, "reward_weights"),
    ({"delta": 0.5}, "delta"),
    ({"sync_ref_model": True}, "sync_ref_model"),
    ({"scale_rewards": "true"}, "scale_rewards"),
])
def test_inconsistent_settings(overrides, key):
    with pytest.raises(ConfigError, match=key):
        TrainConfig(**overrides).validate()


def test_every_range_rule_names_real_fields_and_rejects_just_outside():
    """Each RANGES rule: its fields exist, the default passes, and a value just outside is refused by name."""
    outside = {"must be at least 1": 0, "must be >= 0 (0 = off)": -1, "must be > 0": 0,
               "must be in [0, 1)": 1, "must be in [0, 1]": 1.5}
    for _, why, keys in config_module.RANGES:
        for key in keys:
            assert key in config_module.FIELD_TYPES
            with pytest.raises(ConfigError, match=rf"^{key}=.*{re.escape(why)}"):
                TrainConfig(**{key: outside[why]}).validate()
    TrainConfig(soft_punish_cache=None, max_grad_norm=None, save_total_limit=None).validate()  # None = off


def test_batch_arithmetic_and_world_size():
    cfg = TrainConfig(prompts_per_step=16, num_generations=8, micro_batch_size=16, steps_per_generation=16).validate()
    s = cfg.schedule()
    assert (s.completions_per_step_per_rank, s.micro_batches_per_step, s.steps_per_generation) == (128, 8, 16)
    assert (s.optimizer_steps_per_generation, s.prompts_per_round, s.completions_per_round_per_rank) == (2, 32, 256)
    s4 = cfg.validate(world_size=4).schedule(4)
    assert (s4.micro_batches_per_step, s4.steps_per_generation, s4.optimizer_steps_per_generation) == (2, 16, 8)
    assert TrainConfig().schedule().steps_per_generation == TrainConfig().schedule().micro_batches_per_step  # TRL's default
    with pytest.raises(ConfigError, match="steps_per_generation.*multiple of the 8 micro-batches"):
        TrainConfig(prompts_per_step=16, num_generations=8, micro_batch_size=16, steps_per_generation=12).validate()
    with pytest.raises(ConfigError, match="world_size=3"):
        cfg.validate(world_size=3)
    with pytest.raises(ConfigError, match="micro_batch_size"):
        cfg.validate(world_size=16)  # 8 completions per rank, micro-batch 16


def test_defaults_follow_trl_and_loss_config():
    cfg = TrainConfig().validate()
    assert (cfg.loss_type, cfg.beta, cfg.epsilon, cfg.epsilon_high, cfg.num_generations) == ("dapo", 0.0, 0.2, None, 8)
    assert (cfg.learning_rate, cfg.adam_beta2, cfg.scale_rewards, cfg.use_bias_correction_kl) == (1e-6, 0.99, "group", True)
    kwargs = cfg.loss_config()
    assert set(kwargs) == set(LOSS_FIELDS) and kwargs["max_completion_length"] == cfg.max_completion_length
    import dataclasses

    from nanogrpo.grpo import LossConfig
    for f in dataclasses.fields(LossConfig):  # one default for each loss setting
        assert getattr(TrainConfig(), f.name) == f.default, f.name
    assert LossConfig(**kwargs).loss_type == "dapo"


def test_min_p_has_one_rule():
    """Regression: min_p=1 was rejected by the config (< 1) but accepted by the sampler (<= 1)."""
    assert TrainConfig(min_p=1.0).validate().min_p == 1.0
    with pytest.raises(ConfigError, match="min_p"):
        TrainConfig(min_p=1.5).validate()


def test_to_dict_round_trips():
    cfg = TrainConfig(reward_funcs=["accuracy"], init_model={"hidden_size": 8}, resume="x")
    saved = json.loads(json.dumps(dataclasses.asdict(cfg)))
    assert TrainConfig(**saved) == cfg
    assert cfg.bf16("cuda:0") is False and TrainConfig(dtype="auto").bf16("cuda") and not TrainConfig(dtype="auto").bf16("cpu")


def test_replay_order_and_the_schedule_table():
    """Each round: step-sized slices of the round's micro-batches, all of them, num_iterations times."""
    s = TrainConfig(prompts_per_step=4, num_generations=4, micro_batch_size=4, steps_per_generation=12,
                    num_iterations=2).validate().schedule()
    assert s.micro_batches_per_step == 4 and s.replay_order() == [0, 4, 8, 0, 4, 8]
    assert s.updates_per_round == 6 and s.off_policy
    on_policy = TrainConfig().validate().schedule()
    assert on_policy.replay_order() == [0] and not on_policy.off_policy
    table = s.table()
    assert "4 x 4" in table and "steps_per_generation)  12" in table and "optimizer steps per round" in table


def test_non_finite_numbers_are_rejected():
    """Regression: --epsilon=inf was accepted."""
    for arg in ("--epsilon=inf", "--learning_rate=nan", "--beta=-inf"):
        with pytest.raises(ConfigError, match="finite"):
            load_config(["--config", "tiny.py", arg])


def test_a_new_dataset_does_not_inherit_the_files_eval_set(capsys):
    """Regression: --dataset=mine.jsonl kept tiny.py's eval_dataset='default' and crashed at the first eval."""
    cfg = load_config(["--config", "tiny.py", "--dataset=countdown"])
    assert cfg.eval_dataset is None and "eval_dataset='default' (another task) is not used" in capsys.readouterr().err
    cfg = load_config(["--config", "tiny.py", "--dataset=countdown", "--eval_dataset=countdown"])
    assert cfg.eval_dataset == "countdown"
    assert load_config(["--config", "tiny.py"]).eval_dataset == "default"
