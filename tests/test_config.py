"""Config files plus command-line overrides: types, unknown keys, consistency checks, derived
sizes, which file a --config name means."""

import dataclasses
import json
import os
import re

import pytest

from nanogrpo import config as config_module
from nanogrpo import configurator
from nanogrpo.config import LOSS_FIELDS, ConfigError, TrainConfig
from nanogrpo.configurator import convert, load_config

CONFIG_FILE = """
import math
_helper = 3
learning_rate = 1e-5 * _helper
reward_funcs = ("accuracy", "format")
reward_weights = [1, 0.5]
gradient_accumulation_steps = 2
per_device_train_batch_size = 16
init_model = dict(hidden_size=64, num_hidden_layers=2)
def not_a_setting():
    pass
"""


def test_file_then_overrides(tmp_path):
    path = tmp_path / "run.py"
    path.write_text(CONFIG_FILE)
    cfg = load_config([
        "--config", str(path), "--learning_rate=2e-6", "--top-p", "0.9",
        "--gradient_checkpointing", "--eval_dataset=None", "--resume_from_checkpoint=runs/a",
        "--reward_weights=2,3", "--epsilon_high", "0.28"])
    assert cfg.learning_rate == 2e-6
    assert cfg.top_p == 0.9
    assert cfg.gradient_checkpointing is True
    assert cfg.reward_funcs == ["accuracy", "format"]
    assert cfg.reward_weights == [2.0, 3.0]
    assert cfg.eval_dataset is None
    assert cfg.resume_from_checkpoint == "runs/a"
    assert cfg.epsilon_high == 0.28
    assert cfg.init_model == {"hidden_size": 64, "num_hidden_layers": 2}
    from_file = load_config(["--config", str(path)])
    assert from_file.learning_rate == pytest.approx(3e-5)
    assert load_config(["--resume_from_checkpoint=true"]).resume_from_checkpoint is True
    off = load_config(["--gradient_checkpointing=0"])
    assert off.gradient_checkpointing is False


def test_bare_names_are_found_in_configs_dirs(tmp_path, monkeypatch):
    (tmp_path / "mine.py").write_text("max_steps = 7\n")
    monkeypatch.setattr(configurator, "CONFIGS_DIR", str(tmp_path))
    assert load_config(["--config=mine"]).max_steps == 7
    assert load_config(["--config=mine.py"]).max_steps == 7
    with pytest.raises(ConfigError, match="not found"):
        load_config(["--config=absent"])


def test_a_stray_config_in_the_current_directory_never_replaces_a_builtin(
        tmp_path, monkeypatch):
    """Security regression: `python train.py` (= --config tiny.py) run from
    a directory holding any tiny.py used to execute that file instead of the
    built-in default."""
    marker = tmp_path / "ran"
    (tmp_path / "tiny.py").write_text(
        f"open({str(marker)!r}, 'w').write('pwned')\nmax_steps = 3\n")
    monkeypatch.chdir(tmp_path)
    for name in ("tiny", "tiny.py"):
        # the built-in configs/tiny.py
        assert load_config(["--config", name]).max_steps == 400
    assert not marker.exists()
    # a .py of your own (no built-in of that name)
    (tmp_path / "mine.py").write_text("max_steps = 9\n")
    assert load_config(["--config", "mine.py"]).max_steps == 9
    # an explicit path is yours
    assert load_config(["--config", "./tiny.py"]).max_steps == 3


def test_unknown_keys_suggest_the_closest(tmp_path):
    with pytest.raises(ConfigError, match="'learnng_rate' on the command "
                       "line; did you mean learning_rate"):
        load_config(["--learnng_rate=1e-6"])
    (tmp_path / "c.py").write_text("num_generation = 4\n")
    with pytest.raises(ConfigError, match=r"'num_generation' in config file "
                       r".*c\.py; did you mean num_generations"):
        load_config([f"--config={tmp_path / 'c.py'}"])


@pytest.mark.parametrize("argv, message", [
    (["--learning_rate=fast"], "learning_rate='fast': expected float"),
    (["--seed=1.5"], "seed='1.5': expected int"),
    (["--gradient_checkpointing=maybe"],
     "gradient_checkpointing='maybe': expected bool"),
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
    wrong = [("max_steps", True), ("max_steps", 2.0),
             ("gradient_checkpointing", 1), ("model", 3), ("init_model", [1])]
    for key, value in wrong:
        with pytest.raises(ConfigError, match=key):
            convert(key, value)


@pytest.mark.parametrize("overrides, key", [
    ({"per_device_train_batch_size": 3}, "per_device_train_batch_size"),
    ({"num_generations": 1}, "num_generations"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"model_init_kwargs": {"dtype": "fp8"}}, "model_init_kwargs"),
    ({"model_init_kwargs": {"attn_implementation": "sdpa"}}, "model_init_kwargs"),
    ({"optim": "adamw_8bit"}, "optim"),
    ({"steps_per_generation": 2, "generation_batch_size": 16}, "generation_batch_size"),
    ({"device": "tpu"}, "device"),
    ({"max_steps": 0}, "max_steps"),
    ({"lr_scheduler_type": "polynomial"}, "lr_scheduler_type"),
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
    """Each RANGES rule: its fields exist, the default passes, and a value
    just outside is refused by name."""
    outside = {"must be at least 1": 0, "must be >= 0 (0 = off)": -1,
               "must be > 0": 0, "must be in [0, 1)": 1,
               "must be in [0, 1]": 1.5}
    for _, why, keys in config_module.RANGES:
        for key in keys:
            assert key in configurator.FIELD_TYPES
            with pytest.raises(ConfigError, match=rf"^{key}=.*{re.escape(why)}"):
                TrainConfig(**{key: outside[why]}).validate()
    # None = off
    TrainConfig(soft_punish_cache=None, max_grad_norm=None,
                save_total_limit=None).validate()


def test_batch_arithmetic_and_world_size():
    """TRL's arithmetic: a step trains on per_device x accumulation x
    processes completions; steps_per_generation micro-batches are sampled
    at once (generation_batch_size, all processes, is the other spelling)."""
    cfg = TrainConfig(per_device_train_batch_size=16, num_generations=8,
                      gradient_accumulation_steps=8, steps_per_generation=16).validate()
    s = cfg.schedule()
    assert s.completions_per_step_per_rank == 128
    assert s.prompts_per_step == 16
    assert s.micro_batches_per_step == 8
    assert s.steps_per_generation == 16
    assert s.optimizer_steps_per_generation == 2
    assert s.prompts_per_round == 32
    assert s.completions_per_round_per_rank == 256
    s4 = cfg.validate(world_size=4).schedule(4)
    assert s4.prompts_per_step == 64
    assert s4.micro_batches_per_step == 8
    assert s4.optimizer_steps_per_generation == 2
    same = TrainConfig(per_device_train_batch_size=16, num_generations=8,
                       gradient_accumulation_steps=8, generation_batch_size=1024)
    assert same.validate(world_size=4).schedule(4) == s4
    default = TrainConfig().validate().schedule()
    assert default.steps_per_generation == default.micro_batches_per_step == 1
    with pytest.raises(ConfigError, match="steps_per_generation.*multiple of "
                       "gradient_accumulation_steps=8"):
        TrainConfig(per_device_train_batch_size=16, gradient_accumulation_steps=8,
                    steps_per_generation=12).validate()
    with pytest.raises(ConfigError, match="generation_batch_size.*multiple of"):
        TrainConfig(per_device_train_batch_size=16, generation_batch_size=40).validate()
    with pytest.raises(ConfigError, match="per_device_train_batch_size.*whole groups"):
        TrainConfig(per_device_train_batch_size=4, num_generations=8).validate()


def test_num_train_epochs_counts_steps_as_trl():
    """max_steps=-1: ceil(epochs x the optimizer steps one pass over the
    prompts feeds); max_steps > 0 wins."""
    cfg = TrainConfig(per_device_train_batch_size=8, num_generations=8,
                      gradient_accumulation_steps=2, num_train_epochs=1.5).validate()
    # 2 prompts a step; 100 prompts = 50 rounds of 1 step
    assert cfg.total_steps(100) == 75
    assert TrainConfig(num_iterations=2, num_train_epochs=1).total_steps(10) == 20
    assert TrainConfig(max_steps=7).total_steps(100) == 7


def test_defaults_follow_trl_and_loss_config():
    cfg = TrainConfig().validate()
    assert cfg.loss_type == "dapo"
    assert cfg.adam_beta2 == 0.999
    assert cfg.output_dir == "trainer_output"
    kwargs = cfg.loss_config()
    assert set(kwargs) == set(LOSS_FIELDS)
    assert kwargs["max_completion_length"] == cfg.max_completion_length

    from nanogrpo.grpo import LossConfig
    for f in dataclasses.fields(LossConfig):  # one default for each loss setting
        assert getattr(TrainConfig(), f.name) == f.default, f.name
    assert LossConfig(**kwargs).loss_type == "dapo"


def test_every_shared_default_is_trl_1_16s():
    """Field by field against GRPOConfig() of trl 1.16 (the fixture script
    writes it); the few that differ say why."""
    path = os.path.join(os.path.dirname(__file__), "fixtures", "trl", "grpo_config_defaults.json")
    trl = json.load(open(path))["defaults"]
    ours = dataclasses.asdict(TrainConfig())
    # None means "TRL's value where it pays": bf16 on CUDA only (TRL: on);
    # output_dir None is "trainer_output" in transformers too
    differ = {"bf16": (None, None), "output_dir": (None, "trainer_output")}
    shared = sorted(set(trl) & set(ours))
    assert len(shared) >= 60
    for key in shared:
        if key in differ:
            assert (trl[key], ours[key]) == differ[key], key
        else:
            assert ours[key] == trl[key], key


def test_min_p_has_one_rule():
    """Regression: min_p=1 was rejected by the config (< 1) but accepted by
    the sampler (<= 1)."""
    assert TrainConfig(min_p=1.0).validate().min_p == 1.0
    with pytest.raises(ConfigError, match="min_p"):
        TrainConfig(min_p=1.5).validate()


def test_to_dict_round_trips():
    cfg = TrainConfig(reward_funcs=["accuracy"], init_model={"hidden_size": 8},
                      resume_from_checkpoint="x", bf16=False)
    saved = json.loads(json.dumps(dataclasses.asdict(cfg)))
    assert TrainConfig(**saved) == cfg
    assert cfg.use_bf16("cuda:0") is False
    assert TrainConfig().use_bf16("cuda")
    assert not TrainConfig().use_bf16("cpu")
    assert TrainConfig(bf16=True).use_bf16("cpu")


def test_replay_order_and_the_schedule_table():
    """Each round: step-sized slices of the round's micro-batches, all of
    them, num_iterations times."""
    s = TrainConfig(per_device_train_batch_size=4, num_generations=4,
                    gradient_accumulation_steps=4, steps_per_generation=12,
                    num_iterations=2).validate().schedule()
    assert s.micro_batches_per_step == 4
    assert s.replay_order() == [0, 4, 8, 0, 4, 8]
    assert s.updates_per_round == 6 and s.off_policy
    on_policy = TrainConfig().validate().schedule()
    assert on_policy.replay_order() == [0] and not on_policy.off_policy
    table = s.table()
    assert "4 x 4" in table
    assert "steps_per_generation)  12" in table
    assert "optimizer steps per round" in table


def test_non_finite_numbers_are_rejected():
    """Regression: --epsilon=inf was accepted."""
    for arg in ("--epsilon=inf", "--learning_rate=nan", "--beta=-inf"):
        with pytest.raises(ConfigError, match="finite"):
            load_config(["--config", "tiny.py", arg])


def test_a_new_dataset_does_not_inherit_the_files_eval_set(capsys):
    """Regression: --dataset=mine.jsonl kept tiny.py's eval_dataset='default'
    and crashed at the first eval."""
    cfg = load_config(["--config", "tiny.py", "--dataset=countdown"])
    assert cfg.eval_dataset is None
    err = capsys.readouterr().err
    assert "eval_dataset='default' (another task) is not used" in err
    cfg = load_config(["--config", "tiny.py", "--dataset=countdown",
                       "--eval_dataset=countdown"])
    assert cfg.eval_dataset == "countdown"
    assert load_config(["--config", "tiny.py"]).eval_dataset == "default"


def test_temperature_zero_is_refused_for_training():
    """One rule (was in train.py's setup): training samples, so temperature
    must be > 0."""
    with pytest.raises(ConfigError, match=r"temperature=0\.0: training "
                       "samples, so it must be > 0"):
        TrainConfig(temperature=0.0).validate()
    assert TrainConfig(temperature=0.1).validate().temperature == 0.1


def test_lora_rules_in_one_place():
    """sync_ref_model with LoRA is one rule: validate applies it to use_peft,
    and check_lora applies it again to a loaded model (a PEFT adapter
    directory as `model` brings adapters without use_peft)."""
    refused = "sync_ref_model=True: refused with LoRA adapters"
    synced = TrainConfig(beta=0.1, sync_ref_model=True)
    synced.validate().check_lora(False)
    with pytest.raises(ConfigError, match=refused):
        synced.check_lora(True)
    with pytest.raises(ConfigError, match=refused):
        TrainConfig(beta=0.1, sync_ref_model=True, use_peft=True).validate()


@pytest.mark.parametrize("text, resume", [
    ("False", False), ("false", False), ("TRUE", True), ("runs/a", "runs/a")])
def test_resume_text_in_a_config_file_is_a_bool(tmp_path, text, resume):
    """Regression: resume = "False" in a config file was a checkpoint path
    named False, which train.py read as "resume"."""
    path = tmp_path / "c.py"
    path.write_text(f"resume_from_checkpoint = {text!r}\n")
    key = "resume_from_checkpoint"
    assert getattr(load_config(["--config", str(path)]), key) == resume
    assert getattr(load_config([f"--{key}={text}"]), key) == resume
    assert TrainConfig(resume_from_checkpoint=text).resume_from_checkpoint == resume


def test_eval_every_zero_with_an_eval_set_is_silent():
    """Regression: tiny.py's eval_dataset with --eval_strategy=no (asked for: no
    evaluation) warned on every run."""
    cfg = load_config(["--config", "tiny.py", "--eval_strategy=no"])
    assert cfg.warnings() == []
    assert TrainConfig(eval_dataset="default").warnings() == []
    assert TrainConfig(eval_dataset="default", eval_strategy="steps").warnings() == []
    (warning,) = TrainConfig(eval_strategy="steps").warnings()
    assert warning == "eval_strategy='steps' without an eval_dataset: no evaluation"
    # a new --dataset drops the file's eval set and its eval_every with it:
    # load_config's note, and no warning too
    cfg = load_config(["--config", "tiny.py", "--dataset=countdown"])
    assert cfg.warnings() == []


@pytest.mark.parametrize("filters", [{"top_k": 50}, {"top_p": 0.9}, {"min_p": 0.05}])
def test_sampling_filters_with_the_sampler_correction_warn(filters):
    """With top-k/p or min-p the correction's weights carry the mass the filters kept: said once
    at the start, and silent once the correction is off (configs/smollm.py)."""
    (warning,) = TrainConfig(**filters).warnings()
    assert "vllm_importance_sampling_correction=False matches it" in warning
    assert TrainConfig(**filters, vllm_importance_sampling_correction=False).warnings() == []
    assert load_config(["--config", "smollm.py"]).warnings() == []


def test_vespo_needs_a_token_level_sampler_correction():
    """The sampler always returns its log-probs, so the rule TRL applies per step is checked at
    load: a sequence-level mode with loss_type='vespo' is one clear error."""
    with pytest.raises(ConfigError, match="vllm_importance_sampling_mode='sequence_mask': "
                                          "loss_type='vespo' folds token-level"):
        TrainConfig(loss_type="vespo").validate()
    TrainConfig(loss_type="vespo", vllm_importance_sampling_mode="token_mask").validate()
    TrainConfig(loss_type="vespo", vllm_importance_sampling_correction=False).validate()


def test_every_unknown_key_is_reported_at_once(tmp_path):
    """Regression: a file or command line with several unknown keys needed
    one run per key."""
    path = tmp_path / "c.py"
    path.write_text("num_generation = 4\nlearnig_rate = 1e-5\nzzqx = 1\n")
    with pytest.raises(ConfigError) as e:
        load_config([f"--config={path}", "--max_step=3", "--beta=0.1"])
    message = str(e.value)
    assert message.startswith("4 unknown config keys:")
    expected = [
        f"'num_generation' in config file {path}; did you mean num_generations?",
        f"'learnig_rate' in config file {path}; did you mean learning_rate?",
        f"'zzqx' in config file {path}\n",  # nothing close: no suggestion
        "'max_step' on the command line; did you mean max_steps?",
    ]
    for line in expected:
        assert line in message


def test_a_config_must_be_a_python_file(tmp_path, monkeypatch):
    """Regression: --config data.jsonl was executed as Python and failed
    with an unrelated error."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.jsonl").write_text('{"prompt": "x"}\n')
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "cfg").write_text("max_steps = 3\n")
    for name in ("data.jsonl", "./data.jsonl", "runs/cfg"):
        refused = rf"^config '{re.escape(name)}' is not a \.py file"
        with pytest.raises(ConfigError, match=refused):
            load_config(["--config", name])


def test_which_file_a_config_name_means(tmp_path, monkeypatch, capsys):
    """A bare built-in name runs the built-in, and says so when the current
    directory holds a file of that name; a path runs that file; another bare
    name.py is the file here."""
    monkeypatch.chdir(tmp_path)
    assert load_config(["--config", "tiny"]).max_steps == 400
    assert capsys.readouterr().err == ""  # nothing to say: no ./tiny.py
    (tmp_path / "tiny.py").write_text("max_steps = 3\n")
    builtin = f"{configurator.CONFIGS_DIR}/tiny.py"
    for name in ("tiny", "tiny.py"):
        assert load_config(["--config", name]).max_steps == 400
        err = capsys.readouterr().err
        assert f"--config {name} runs the built-in {builtin}, not ./tiny.py" in err
        assert "pass --config ./tiny.py" in err
    assert load_config(["--config", "./tiny.py"]).max_steps == 3
    assert load_config(["--config", str(tmp_path / "tiny.py")]).max_steps == 3
    assert capsys.readouterr().err == ""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "small.py").write_text("max_steps = 5\n")
    assert load_config(["--config", "sub/small.py"]).max_steps == 5


def test_trl_names_nanogrpo_lacks_are_refused_with_the_reason():
    """Every TRL 1.16 name TrainConfig lacks is known (the list matches the
    fixture), refused in one line saying why, never with a "did you mean"."""
    path = os.path.join(os.path.dirname(__file__), "fixtures", "trl", "grpo_config_defaults.json")
    trl = set(json.load(open(path))["defaults"])
    lacking = {k for k in trl - set(configurator.FIELD_TYPES) if not k.startswith("vllm_")}
    assert configurator.TRL_ONLY == lacking
    cases = {
        "use_vllm": "nanogrpo's own KV-cached sampler: remove it",
        "vllm_mode": "there is no vLLM",
        "fp16": "use bf16=True",
        "save_strategy": "every save_steps",
        "ddp_timeout": "a TRL/transformers setting nanogrpo does not have",
    }
    for key, why in cases.items():
        with pytest.raises(ConfigError) as e:
            load_config([f"--{key}=1"])
        assert str(e.value).startswith(f"unsupported config key '{key}'")
        assert why in str(e.value)
        assert "did you mean" not in str(e.value)
    with pytest.raises(ConfigError, match="optim='adamw_8bit': needs bitsandbytes.*adamw_torch"):
        TrainConfig(optim="adamw_8bit").validate()
    with pytest.raises(ConfigError, match="did you mean max_prompt_length"):
        load_config(["--max_prompt_len=3"])  # a typo still gets its suggestion


def test_a_config_file_may_define_reward_functions_and_tools(tmp_path):
    """TRL scripts define their functions inline: a config file may too."""
    path = tmp_path / "recipe.py"
    path.write_text(
        "def correctness_reward(prompts, completions, answer, **kwargs):\n"
        "    return [1.0 for _ in completions]\n"
        "def add(a: int, b: int) -> int:\n"
        '    """Add two integers.\n\n    Args:\n        a: one\n        b: two\n    """\n'
        "    return a + b\n"
        'reward_funcs = [correctness_reward, "accuracy"]\n'
        "tools = [add]\n")
    cfg = load_config(["--config", str(path)])
    assert cfg.reward_funcs[0].__name__ == "correctness_reward"
    assert cfg.reward_funcs[1] == "accuracy"
    assert cfg.tools[0](2, 3) == 5
    with pytest.raises(ConfigError, match="reward_funcs"):
        convert("reward_funcs", [3])  # a name or a function, nothing else
    from nanogrpo.run import config_record
    record = config_record(cfg)
    assert record["reward_funcs"] == ["correctness_reward (config file)", "accuracy"]
    json.dumps(record)


def test_the_trl_recipe_example_loads_in_trls_names():
    """examples/trl_recipe.py: a TRL recipe, inline reward functions, LoRA."""
    from conftest import ROOT
    cfg = load_config(["--config", os.path.join(ROOT, "examples", "trl_recipe.py")])
    assert cfg.lr_scheduler_type == "cosine" and cfg.warmup_ratio == 0.1
    assert [f.__name__ for f in cfg.reward_funcs] == ["correctness_reward", "reward_len"]
    assert cfg.lora_settings()["target_modules"] == "all-linear"
    assert cfg.schedule().prompts_per_step == 1


def test_model_init_kwargs_dtype_and_disable_dropout():
    """model_init_kwargs={"dtype": ...} is the weights' dtype (TRL's);
    disable_dropout zeroes LoRA's dropout."""
    assert TrainConfig().weight_dtype() == "float32"
    assert TrainConfig(model_init_kwargs={"dtype": "bfloat16"}).weight_dtype() == "bfloat16"
    assert TrainConfig(model_init_kwargs={"torch_dtype": "auto"}).weight_dtype() == "float32"
    lora = TrainConfig(use_peft=True, disable_dropout=True).lora_settings()
    assert lora["lora_dropout"] == 0.0
    assert TrainConfig(use_peft=True).lora_settings()["lora_dropout"] == 0.05
