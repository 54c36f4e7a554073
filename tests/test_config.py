"""Config files plus command-line overrides: types, unknown keys, consistency checks, derived
sizes, which file a --config name means."""

import dataclasses
import json
import os
import re

import pytest

from nanogrpo.extras import loss_terms
from nanogrpo.run import configurator, rules, trl_names
from nanogrpo.run.config import LOSS_FIELDS, ConfigError, TrainConfig
from nanogrpo.run.configurator import convert, load_config

CONFIG_FILE = """
import math
_helper = 3
model = "my/model"
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
    cfg = load_config(
        [
            "--config",
            str(path),
            "--learning_rate=2e-6",
            "--top-p",
            "0.9",
            "--gradient_checkpointing",
            "--eval_dataset=None",
            "--resume_from_checkpoint=runs/a",
            "--reward_weights=2,3",
            "--epsilon_high",
            "0.28",
        ]
    )
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
    (tmp_path / "mine.py").write_text("model = 'm'\nmax_steps = 7\n")
    monkeypatch.setattr(configurator, "CONFIGS_DIR", str(tmp_path))
    assert load_config(["--config=mine"]).max_steps == 7
    assert load_config(["--config=mine.py"]).max_steps == 7
    with pytest.raises(ConfigError, match="not found"):
        load_config(["--config=absent"])


def test_a_stray_config_in_the_current_directory_never_replaces_a_builtin(tmp_path, monkeypatch):
    """Security regression: `python train.py` (= --config tiny.py) run from
    a directory holding any tiny.py used to execute that file instead of the
    built-in default."""
    marker = tmp_path / "ran"
    (tmp_path / "tiny.py").write_text(
        f"open({str(marker)!r}, 'w').write('pwned')\nmodel = 'm'\nmax_steps = 3\n"
    )
    monkeypatch.chdir(tmp_path)
    for name in ("tiny", "tiny.py"):
        # the built-in configs/tiny.py
        assert load_config(["--config", name]).max_steps == 400
    assert not marker.exists()
    # a .py of your own (no built-in of that name)
    (tmp_path / "mine.py").write_text("model = 'm'\nmax_steps = 9\n")
    assert load_config(["--config", "mine.py"]).max_steps == 9
    # an explicit path is yours
    assert load_config(["--config", "./tiny.py"]).max_steps == 3


def test_unknown_keys_suggest_the_closest(tmp_path):
    with pytest.raises(
        ConfigError, match="'learnng_rate' on the command line; did you mean learning_rate"
    ):
        load_config(["--learnng_rate=1e-6"])
    (tmp_path / "c.py").write_text("num_generation = 4\n")
    with pytest.raises(
        ConfigError,
        match=r"'num_generation' in config file "
        r".*c\.py; did you mean num_generations",
    ):
        load_config([f"--config={tmp_path / 'c.py'}"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--learning_rate=fast"], "learning_rate='fast': expected float"),
        (["--seed=1.5"], "seed='1.5': expected int"),
        (["--gradient_checkpointing=maybe"], "gradient_checkpointing='maybe': expected bool"),
        (["--reward_weights=[1, 'a']"], "reward_weights"),
        (["--reward_weights=[1,"], "not a Python literal"),
        (["--max_steps"], "--max_steps needs a value"),
        (["small.py"], "unexpected argument"),
    ],
)
def test_wrong_types(argv, message):
    with pytest.raises(ConfigError, match=message):
        load_config(argv)


def test_file_values_are_type_checked():
    assert convert("learning_rate", 1) == 1.0
    wrong = [
        ("max_steps", True),
        ("max_steps", 2.0),
        ("gradient_checkpointing", 1),
        ("model", 3),
        ("init_model", [1]),
    ]
    for key, value in wrong:
        with pytest.raises(ConfigError, match=key):
            convert(key, value)


@pytest.mark.parametrize(
    "overrides, key",
    [
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
    ],
)
def test_inconsistent_settings(overrides, key):
    with pytest.raises(ConfigError, match=key):
        TrainConfig(**overrides).validate()


def test_every_range_rule_names_real_fields_and_rejects_just_outside():
    """Each RANGES rule: its fields exist, the default passes, and a value
    just outside is refused by name."""
    outside = {
        "must be at least 1": 0,
        "must be >= 0 (0 = off)": -1,
        "must be > 0": 0,
        "must be in [0, 1)": 1,
        "must be in [0, 1]": 1.5,
    }
    for _, why, keys in rules.RANGES:
        for key in keys:
            assert key in configurator.FIELD_TYPES
            with pytest.raises(ConfigError, match=rf"^{key}=.*{re.escape(why)}"):
                TrainConfig(**{key: outside[why]}).validate()
    # None = off
    TrainConfig(soft_punish_cache=None, max_grad_norm=None, save_total_limit=None).validate()


def test_defaults_follow_trl_and_loss_config():
    cfg = TrainConfig().validate()
    assert cfg.loss_type == "dapo"
    assert cfg.adam_beta2 == 0.999
    assert cfg.output_dir == "trainer_output"
    kwargs = cfg.loss_config()
    assert set(kwargs) == set(LOSS_FIELDS)
    assert kwargs["max_completion_length"] == cfg.max_completion_length

    from nanogrpo.grpo import LossConfig

    fields = dataclasses.fields(LossConfig) + dataclasses.fields(loss_terms.LossTerms)
    for f in fields:  # one default for each loss setting
        assert getattr(TrainConfig(), f.name) == f.default, f.name
    assert loss_terms.loss_settings(**kwargs)[0].loss_type == "dapo"


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
    cfg = TrainConfig(
        reward_funcs=["accuracy"],
        init_model={"hidden_size": 8},
        resume_from_checkpoint="x",
        bf16=False,
    )
    saved = json.loads(json.dumps(dataclasses.asdict(cfg)))
    assert TrainConfig(**saved) == cfg
    assert cfg.use_bf16("cuda:0") is False
    assert TrainConfig().use_bf16("cuda")
    assert not TrainConfig().use_bf16("cpu")
    assert TrainConfig(bf16=True).use_bf16("cpu")


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
    cfg = load_config(["--config", "tiny.py", "--dataset=countdown", "--eval_dataset=countdown"])
    assert cfg.eval_dataset == "countdown"
    assert load_config(["--config", "tiny.py"]).eval_dataset == "default"


def test_temperature_zero_is_refused_for_training():
    """One rule (was in train.py's setup): training samples, so temperature
    must be > 0."""
    with pytest.raises(
        ConfigError,
        match=r"temperature=0\.0: training "
        "samples, so it must be > 0",
    ):
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


@pytest.mark.parametrize(
    "text, resume", [("False", False), ("false", False), ("TRUE", True), ("runs/a", "runs/a")]
)
def test_resume_text_in_a_config_file_is_a_bool(tmp_path, text, resume):
    """Regression: resume = "False" in a config file was a checkpoint path
    named False, which train.py read as "resume"."""
    path = tmp_path / "c.py"
    path.write_text(f"model = 'm'\nresume_from_checkpoint = {text!r}\n")
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


@pytest.mark.parametrize(
    "filters",
    [
        {"top_k": 50},
        {"top_p": 0.9},
        {"min_p": 0.05},
        # the same filters through TRL's generation_kwargs, and its token suppression
        {"generation_kwargs": {"top_k": 50}},
        {"generation_kwargs": {"suppress_tokens": [3]}},
        {"generation_kwargs": {"min_new_tokens": 2}},
    ],
)
def test_sampling_filters_with_the_sampler_correction_warn(filters):
    """With top-k/p or min-p the correction's weights carry the mass the filters kept: said once
    at the start, and silent once the correction is off (configs/smollm.py)."""
    (warning,) = TrainConfig(**filters).warnings()
    assert "vllm_importance_sampling_correction=False matches it" in warning
    assert TrainConfig(**filters, vllm_importance_sampling_correction=False).warnings() == []
    assert load_config(["--config", "smollm.py"]).warnings() == []
    # generation_kwargs that lift a field's filter silence it
    assert TrainConfig(top_k=50, generation_kwargs={"top_k": 0}).warnings() == []


def test_vespo_with_a_sequence_level_sampler_correction_trains_as_trl_without_vllm():
    """Regression: loss_type='vespo' with the default sequence_mask mode was refused. TRL
    refuses it only with use_vllm (GRPOTrainer.__init__: `loss_type == "vespo" and use_vllm
    and vllm_importance_sampling_correction` with a mode outside token_truncate/token_mask);
    without vLLM it applies no correction, so the loss gets none, and a warning says so."""
    import torch

    from nanogrpo.grpo import LossInputs, sampler_correction

    cfg = TrainConfig(loss_type="vespo").validate()
    (warning,) = cfg.warnings()
    assert "vllm_importance_sampling_mode='sequence_mask' it trains with none" in warning
    loss, _ = loss_terms.loss_settings(**cfg.loss_config())
    assert loss.vllm_importance_sampling_correction is False
    logps = torch.zeros(2, 3, dtype=torch.float64)  # a step with the sampler's log-probs runs
    inputs = LossInputs(
        logps=logps,
        advantages=torch.ones(2, dtype=torch.float64),
        completion_mask=torch.ones(2, 3),
    )
    weights, compared = sampler_correction(inputs, logps - 0.5, loss)
    assert weights is None and compared is not None  # no correction, as TRL; the mismatch logged
    assert cfg.vllm_importance_sampling_correction is True  # the setting stays as given
    for quiet in (
        dict(vllm_importance_sampling_mode="token_mask"),
        dict(vllm_importance_sampling_correction=False),
    ):
        cfg = TrainConfig(loss_type="vespo", **quiet).validate()
        assert cfg.warnings() == []
        assert cfg.loss_config()["vllm_importance_sampling_correction"] == (
            cfg.vllm_importance_sampling_correction
        )
    assert TrainConfig(vllm_importance_sampling_mode="sequence_mask").loss_config()[
        "vllm_importance_sampling_correction"
    ]  # other losses keep it


@pytest.mark.parametrize("loss_type", ["bnpo", "dr_grpo", "dapo", "cispo"])
def test_sequence_level_ratios_with_a_token_sum_warn_as_trl(loss_type):
    """TRL's GRPOTrainer.__init__ warns when importance_sampling_level='sequence' meets a loss
    in ["bnpo", "dr_grpo", "dapo", "cispo"]: those sum the sequence's weight over its tokens,
    so each sequence counts by its length. grpo, sapo and luspo (and token level) stay silent."""
    (warning,) = TrainConfig(loss_type=loss_type, importance_sampling_level="sequence").warnings()
    assert warning.startswith(
        f"importance_sampling_level='sequence' with loss_type={loss_type!r}: the loss adds"
    )
    assert "a longer completion counts more" in warning and "loss_type='grpo'" in warning
    assert TrainConfig(loss_type=loss_type).warnings() == []
    for quiet in ("grpo", "sapo", "luspo"):
        cfg = TrainConfig(loss_type=quiet, importance_sampling_level="sequence").validate()
        assert cfg.warnings() == []


@pytest.mark.parametrize(
    "given, expected",
    [
        ({"scale_rewards": True}, "group"),
        ({"scale_rewards": False}, "none"),
        ({"scale_rewards": "batch"}, "batch"),
        (["--scale_rewards=true"], "group"),
        (["--scale_rewards", "False"], "none"),
        (["--scale_rewards=0"], "none"),
        (["--scale_rewards=none"], "none"),
        (["--scale_rewards=batch"], "batch"),
    ],
)
def test_scale_rewards_takes_trls_bools(given, expected, tmp_path):
    """Regression: scale_rewards=True was refused. TRL's GRPOConfig.__post_init__ maps True to
    "group" and False to "none"; on the command line true/false read as for a bool field."""
    if isinstance(given, dict):
        assert TrainConfig(**given).validate().scale_rewards == expected
        path = tmp_path / "c.py"
        path.write_text(f"model = 'm'\nscale_rewards = {given['scale_rewards']!r}\n")
        given = ["--config", str(path)]
    assert load_config(given).scale_rewards == expected


def test_scale_rewards_text_that_is_neither_bool_nor_a_choice_is_refused():
    with pytest.raises(ConfigError, match="scale_rewards='maybe': must be one of"):
        load_config(["--scale_rewards=maybe"])


def test_pad_to_multiple_of_is_accepted_with_a_note(capsys):
    """Regression: TRL 1.16's pad_to_multiple_of was refused. It pads TRL's prompt and
    completion tensors to a multiple of positions (GRPOTrainer._generate_and_score_completions'
    pad calls), masked out of every sum: it changes no number, so it is read with a note."""
    for value in ("64", "None", "auto"):
        assert load_config([f"--pad_to_multiple_of={value}"]).model == "out/tiny-init"
        err = capsys.readouterr().err
        assert "note: pad_to_multiple_of changes nothing here: TRL pads its tensors" in err


def test_eval_on_start_needs_an_eval_set(tmp_path):
    """transformers' eval_on_start (Trainer._inner_training_loop evaluates before the first
    epoch, whatever eval_strategy says) is read; without an eval_dataset transformers' evaluate
    raises, so it is refused at load."""
    assert TrainConfig().eval_on_start is False
    with pytest.raises(ConfigError, match="eval_on_start=True: needs an eval_dataset"):
        TrainConfig(eval_on_start=True).validate()
    cfg = TrainConfig(eval_on_start=True, eval_dataset="default").validate()
    assert cfg.evaluates() and cfg.eval_every() == 0  # once, before step 1
    assert not TrainConfig(eval_dataset="default").evaluates()
    assert TrainConfig(eval_dataset="default", eval_strategy="steps").evaluates()
    assert load_config(["--config", "tiny.py", "--eval_on_start"]).eval_on_start is True
    # a new --dataset drops the file's eval set, and its eval_on_start with it
    path = tmp_path / "c.py"
    path.write_text("model = 'm'\neval_dataset = 'default'\neval_on_start = True\n")
    assert load_config(["--config", str(path)]).eval_on_start is True
    assert load_config(["--config", str(path), "--dataset=countdown"]).eval_on_start is False


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
        refused = rf"^config '{re.escape(name)}' is not a \.py or \.yaml file"
        with pytest.raises(ConfigError, match=refused):
            load_config(["--config", name])


def test_which_file_a_config_name_means(tmp_path, monkeypatch, capsys):
    """A bare built-in name runs the built-in, and says so when the current
    directory holds a file of that name; a path runs that file; another bare
    name.py is the file here."""
    monkeypatch.chdir(tmp_path)
    assert load_config(["--config", "tiny"]).max_steps == 400
    assert capsys.readouterr().err == ""  # nothing to say: no ./tiny.py
    (tmp_path / "tiny.py").write_text("model = 'm'\nmax_steps = 3\n")
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
    (tmp_path / "sub" / "small.py").write_text("model = 'm'\nmax_steps = 5\n")
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
        "fp16": "use bf16=True",
        "deepspeed": "FSDP2 under torchrun",
        "label_smoothing_factor": "a TRL/transformers setting nanogrpo does not have",
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
        "tools = [add]\n"
        "model = 'm'\n"
    )
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
    assert cfg.schedule().prompts_per_round == 1


def test_model_init_kwargs_dtype_and_disable_dropout():
    """model_init_kwargs={"dtype": ...} is the weights' dtype (TRL's);
    disable_dropout zeroes LoRA's dropout."""
    assert TrainConfig().weight_dtype() == "float32"
    assert TrainConfig(model_init_kwargs={"dtype": "bfloat16"}).weight_dtype() == "bfloat16"
    assert TrainConfig(model_init_kwargs={"torch_dtype": "auto"}).weight_dtype() == "float32"
    lora = TrainConfig(use_peft=True, disable_dropout=True).lora_settings()
    assert lora["lora_dropout"] == 0.0
    assert TrainConfig(use_peft=True).lora_settings()["lora_dropout"] == 0.05


# -----------------------------------------------------------------------------
# Which values run without --config; --help; TRL's other names; code in a config


def test_without_config_one_rule_says_which_values_run(tmp_path, capsys):
    """Regression: a command line without --config sat on configs/tiny.py,
    so `--model X --dataset d` trained with tiny.py's lr 1e-3, 8 tokens and
    out/tiny; a user's config without `model` stopped at "no such directory:
    'tiny'". Now: no config and no model -> tiny.py; a model -> TRL's defaults."""
    default = load_config(["--max_steps=3"])
    assert (default.model, default.learning_rate, default.max_steps) == ("out/tiny-init", 1e-3, 3)
    assert "note: no --config and no --model: the embedded default configs/tiny.py runs" in (
        capsys.readouterr().out
    )
    for name in ("--model", "--model_name_or_path"):
        mine = load_config([name, "my/model", "--dataset", "countdown"])
        assert mine.model == "my/model" and mine.dataset == "countdown"
        trl = TrainConfig()
        for key in (
            "learning_rate",
            "max_completion_length",
            "output_dir",
            "init_model",
            "eval_dataset",
            "device",
            "seed",
        ):
            assert getattr(mine, key) == getattr(trl, key), key
        assert "note: no --config: TrainConfig's defaults (TRL's) with your settings" in (
            capsys.readouterr().out
        )
    assert TrainConfig().model is None  # TRL's model_name_or_path: no default
    path = tmp_path / "mine.py"
    path.write_text("learning_rate = 1e-5\n")
    with pytest.raises(
        ConfigError,
        match=r"^no model: set model = \.\.\. .* in your config "
        r"file, or pass --model",
    ):
        load_config(["--config", str(path)])
    assert load_config(["--config", str(path), "--model", "m"]).learning_rate == 1e-5
    assert "note:" not in capsys.readouterr().out  # --config: the user said which


def test_help_shows_the_values_that_would_run(capsys):
    """Regression: --help listed TrainConfig's defaults (lr 1e-6) while a
    bare run trained with tiny.py's (1e-3); --help --config X ignored X."""
    from nanogrpo.run import main

    assert "--learning_rate=0.001" in configurator.help_text([])
    assert "the embedded default configs/tiny.py" in configurator.help_text([])
    trl = configurator.help_text(["--model", "m"])
    assert "--learning_rate=1e-06" in trl and "--max_completion_length=512" in trl
    assert main(["--config", "smollm.py", "--help", "--max_steps=7"], train=None) == 0
    out = capsys.readouterr().out
    assert "--model='HuggingFaceTB/SmolLM2-135M-Instruct'" in out
    assert "--max_steps=7" in out and "Values shown: --config smollm.py:" in out


def test_help_prints_every_field_once_with_its_help_under_group_titles():
    """Regression: --help parsed config.py's comments, so a title spread
    over two comment lines was cut ("batch (TRL's arithmetic: an optimizer
    step trains on:") and "see tools.py" was glued to --tools. Now each
    field's metadata holds its help and the first of a group its title."""
    assert not hasattr(configurator, "field_comments")
    lines = configurator.help_text(["--model", "m"]).splitlines()
    fields = dataclasses.fields(TrainConfig)
    keys = [line.split("=")[0] for line in lines if line.startswith("  --")]
    assert keys == [f"  --{f.name}" for f in fields]  # every setting once, in order
    for f in fields:
        assert f.metadata["help"], f.name
        at = [n for n, line in enumerate(lines) if line.startswith(f"  --{f.name}=")][0]
        text = []
        for line in lines[at + 1 :]:
            if not line.startswith("      "):
                break
            text.append(line.strip())
        assert " ".join(text) == f.metadata["help"], f.name  # its help, nothing glued
        if "group" in f.metadata:  # a title on its own line, after a blank one
            assert lines[at - 2 : at] == ["", f"  {f.metadata['group']}:"], f.name
    titles = [f.metadata["group"] for f in fields if "group" in f.metadata]
    assert "batch (TRL's arithmetic)" in titles and "tools (TRL's names)" in titles


def test_trl_script_names_and_a_yaml_config_as_trls_cli_reads(tmp_path, capsys, monkeypatch):
    """A TRL user's recipe.yaml (ScriptArguments, ModelConfig, GRPOConfig
    names; `trl grpo --config recipe.yaml`) runs: aliases, dtype, report_to
    as a list, save_strategy, and TrainingArguments that change nothing
    here accepted with a note."""
    monkeypatch.delenv("NANOGRPO_YAML_ENV", raising=False)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "model_name_or_path: my/model\n"
        "dtype: bfloat16\n"
        "lora_task_type: CAUSAL_LM\n"
        "dataset_name: gsm8k\n"
        "dataset_config: main\n"
        "dataset_train_split: train\n"
        "learning_rate: 1e-6\n"  # YAML reads 1e-6 as text
        "per_device_train_batch_size: 16\n"
        "report_to: [wandb]\n"
        "save_strategy: no\n"  # YAML reads an unquoted no as False
        "logging_strategy: steps\n"
        "remove_unused_columns: false\n"
        "dataloader_num_workers: 4\n"
        "use_vllm: false\n"
        "vllm_mode: colocate\n"
        "gradient_checkpointing_kwargs: {use_reentrant: false}\n"
        "env:\n  NANOGRPO_YAML_ENV: on\n"
    )
    cfg = load_config(["--config", str(recipe)])
    assert (cfg.model, cfg.dataset, cfg.dataset_split) == ("my/model", "gsm8k", "train")
    assert cfg.weight_dtype() == "bfloat16" and cfg.learning_rate == 1e-6
    assert cfg.report_to == "wandb" and cfg.reporters() == ["wandb"]
    assert cfg.save_steps == 0 and cfg.per_device_train_batch_size == 16
    assert os.environ["NANOGRPO_YAML_ENV"] == "True"  # str(YAML's on), as TRL sets it
    err = capsys.readouterr().err
    for key in (
        "remove_unused_columns",
        "dataloader_num_workers",
        "vllm_mode",
        "gradient_checkpointing_kwargs",
        "dataset_config",
    ):
        assert f"note: {key}" in err and "changes nothing here" in err, key
    assert "save_strategy='no': save_steps=0" in err
    # the command line's TRL names win over the file's
    cfg = load_config(
        [
            "--config",
            str(recipe),
            "--torch_dtype",
            "float16",
            "--use_cpu",
            "--report_to",
            "none",
            "--dataset_test_split=eval",
            "--save_strategy=steps",
            "--save_steps=50",
        ]
    )
    assert cfg.weight_dtype() == "float16" and cfg.device == "cpu"
    assert cfg.reporters() == [] and cfg.eval_split == "eval" and cfg.save_steps == 50
    assert TrainConfig(report_to=["wandb", "tensorboard"]).reporters() == ["wandb", "tensorboard"]
    assert load_config(["--load_in_4bit=false", "--use_dora", "False"]).model == "out/tiny-init"
    assert load_config(["--bf16"]).bf16 is True  # a bare flag, as TRL's parser takes it


@pytest.mark.parametrize(
    "arg, message",
    [
        ("--save_strategy=epoch", "save_strategy='epoch': checkpoints come every save_steps"),
        ("--load_in_4bit=true", "'load_in_4bit' on the command line: needs bitsandbytes"),
        ("--use_dora", "not DoRA"),
        ("--dataset_config=socratic", "dataset_config='socratic': nanogrpo reads one file"),
        ("--model_revision=v2", "model_revision='v2': a hub id loads its main revision"),
        ("--lora_task_type=SEQ_CLS", "nanogrpo trains causal LMs"),
        ("--fp16=true", "use bf16=True"),
    ],
)
def test_trl_values_that_would_change_the_result_are_refused(arg, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(["--model", "m", arg])


def test_two_names_for_one_setting_in_one_place_must_agree(tmp_path):
    path = tmp_path / "c.py"
    path.write_text("model = 'a'\nmodel_name_or_path = 'b'\n")
    with pytest.raises(ConfigError, match="model is set twice in one place"):
        load_config(["--config", str(path)])
    path.write_text("model = 'a'\nmodel_name_or_path = 'a'\n")
    assert load_config(["--config", str(path)]).model == "a"


@pytest.mark.parametrize(
    "code, key, why",
    [
        ("def cb():\n    pass\ncallbacks = [cb]\n", "callbacks", "no trainer callbacks"),
        ("import json as fsdp\n", "fsdp", "FSDP2 under torchrun"),
        ("def ds():\n    pass\ndeepspeed = ds\n", "deepspeed", "FSDP2 under torchrun"),
    ],
)
def test_code_under_a_trl_name_is_refused_not_dropped(tmp_path, code, key, why):
    """Regression: read_config_file skipped every module, function and
    class, so `environment_factory = MyEnv` or `rollout_func = f` vanished
    without a word (both are settings now: tests/test_environments.py)."""
    path = tmp_path / "c.py"
    path.write_text("model = 'm'\n" + code)
    with pytest.raises(ConfigError) as e:
        load_config(["--config", str(path)])
    assert str(e.value).startswith(f"unsupported config key '{key}'") and why in str(e.value)


def test_helpers_of_a_config_file_stay_allowed(tmp_path):
    """Functions, classes and imports under names that are no setting are
    the file's own (a reward function that reward_funcs lists, a helper)."""
    path = tmp_path / "c.py"
    path.write_text(
        "import math\nfrom math import sqrt\nclass Helper:\n    pass\n"
        "def my_reward(completions, **kwargs):\n    return [sqrt(4.0) for _ in completions]\n"
        "model = 'm'\nreward_funcs = [my_reward]\n"
    )
    cfg = load_config(["--config", str(path)])
    assert cfg.reward_funcs[0](["a"]) == [2.0]


def test_a_dump_of_trls_config_is_read_and_its_defaults_accepted_with_a_note(capsys):
    """Regression: a dump of TRL's GRPOConfig().to_dict() was refused on 13 keys at TRL's own
    defaults (ds3_gather_for_generation=True was refused while False was accepted). A name
    nanogrpo lacks is read at TRL's default, with a note, and still refused at any other value;
    TRL_DEFAULTS is the dump's value of each such name that is not off."""
    path = os.path.join(os.path.dirname(__file__), "fixtures", "trl", "grpo_config_defaults.json")
    fixture = json.load(open(path))
    for dump in (fixture["defaults"], fixture["to_dict"]):
        assert [k for k, v in dump.items() if not configurator.is_read(k, v, False)] == []
    dumped = fixture["to_dict"]
    read_anyway = {*configurator.ALIASES, *configurator.NO_EFFECT, *configurator.TRANSLATED}
    refusable = {k for k in dumped if configurator.refusal(k) and k not in read_anyway}
    not_off = {k for k in refusable if not configurator.is_off(dumped[k], False)}
    assert trl_names.TRL_DEFAULTS == {k: dumped[k] for k in not_off}
    load_config(["--ds3_gather_for_generation=true", "--eval_delay=0", "--project", "huggingface"])
    err = capsys.readouterr().err
    said = "note: ds3_gather_for_generation, project at TRL's default change nothing"
    assert said in err
    load_config(["--project=huggingface", "--vllm_mode=server", "--vllm_server_port=1"])
    err = capsys.readouterr().err
    assert "note: project at TRL's default changes nothing here\n" in err
    assert "note: vllm_mode, vllm_server_port change nothing here: there is no vLLM" in err
    for arg in ("--project=mine", "--eval_delay=2", "--label_smoothing_factor=0.1"):
        with pytest.raises(ConfigError, match="a TRL/transformers setting nanogrpo does not have"):
            load_config([arg])


def test_activation_checkpointing_is_transformers_5s_name_for_gradient_checkpointing():
    """And TRL's deprecated vllm_importance_sampling_cap is the clip_max it sets (it was taken
    for a vLLM setting that changes nothing)."""
    assert load_config(["--vllm_importance_sampling_cap=2"]).vllm_importance_sampling_clip_max == 2
    assert load_config(["--activation_checkpointing=false"]).gradient_checkpointing is False
    assert load_config(["--activation_checkpointing"]).gradient_checkpointing is True
    with pytest.raises(ConfigError, match="gradient_checkpointing is set twice in one place"):
        load_config(["--gradient_checkpointing=true", "--activation_checkpointing=false"])


def test_steps_below_1_are_a_fraction_of_the_runs_steps_as_in_transformers():
    """Regression: logging_steps=0.1, transformers' ratio form, was refused as not an int. Below 1,
    logging_steps, eval_steps and save_steps are a fraction of the run's steps, rounded up
    (transformers' TrainerState.compute_steps); from 1 up, whole numbers."""
    cfg = load_config(["--logging_steps=0.1", "--eval_steps=0.5", "--save_steps", "0.34"])
    assert (cfg.logging_steps, cfg.eval_steps, cfg.save_steps) == (0.1, 0.5, 0.34)
    run = cfg.with_total_steps(25)
    assert (run.max_steps, run.logging_steps, run.eval_steps, run.save_steps) == (25, 3, 13, 9)
    assert TrainConfig(save_steps=0, logging_steps=10.0).with_total_steps(-1).save_steps == 0
    assert type(TrainConfig(logging_steps=10.0).logging_steps) is int
    with pytest.raises(ConfigError, match=r"^logging_steps=2\.5: must be a whole number of steps"):
        TrainConfig(logging_steps=2.5).validate()
