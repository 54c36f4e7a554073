"""train.py end to end on the embedded default (tiny model, CPU): smoke, learning, resume, errors."""

import dataclasses
import json
import math
import os
import re

import conftest
import pytest
import torch

import train
from nanogrpo import fast, run
from nanogrpo.checkpoint import load_model
from nanogrpo.extras.loss_terms import grpo_step_with_terms, loss_settings
from nanogrpo.fast.logprobs import token_logprobs
from nanogrpo.rewards import RewardError
from nanogrpo.run import report
from nanogrpo.run.config import ConfigError
from nanogrpo.run.configurator import load_config, read_config_file
from nanogrpo.tokenizer import Tokenizer

TIMING = (
    "step_time",
    "tokens_per_sec",
    "time/sample",
    "time/score",
    "time/logprobs",
    "time/update",
    "time/dynamic_sampling",
)
INIT = f"--init_model={read_config_file('tiny')['init_model']!r}"  # build tiny.py's random model elsewhere


def tiny(tmp_path, *overrides):
    """The embedded default config, made small, with its init checkpoint and outputs under tmp_path."""
    return load_config(
        [
            "--config",
            "tiny.py",
            f"--model={tmp_path}/init",
            INIT,
            f"--output_dir={tmp_path}/run",
            "--gradient_accumulation_steps=2",
            "--num_generations=4",
            "--per_device_train_batch_size=8",
            "--max_completion_length=6",
            "--eval_strategy=no",
            "--max_steps=3",
            *overrides,
        ]
    )


def strip_timing(history):
    return [{k: v for k, v in m.items() if k not in TIMING} for m in history]


def test_smoke_metrics_and_checkpoint(tmp_path, capsys):
    cfg = tiny(
        tmp_path,
        "--eval_strategy=steps",
        "--eval_steps=2",
        "--eval_size=8",
        "--log_completions=true",
    )
    history = train.train(cfg)
    assert [m["step"] for m in history] == [1, 2, 3]
    lines = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert strip_timing(lines) == strip_timing(history)
    for key in (
        "step",
        "reward",
        "reward_std",
        "rewards/default_task/mean",
        "entropy",
        "clip_ratio/region_mean",
        "completions/mean_length",
        "completions/clipped_ratio",
        "frac_reward_zero_std",
        "loss",
        "grad_norm",
        "learning_rate",
        "tokens_per_sec",
        "num_tokens",
        "completions/mean_terminated_length",
        "completions/max_terminated_length",
        "time/sample",
        "time/score",
        "time/logprobs",
        "time/update",
    ):
        assert key in lines[0], key
    assert (
        lines[0]["num_tokens"] < lines[1]["num_tokens"] < lines[2]["num_tokens"]
    )  # cumulative, as TRL
    assert "kl" not in lines[0]  # beta = 0: no reference model, no kl
    assert all(math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) for m in lines)
    assert "eval/reward" in lines[1] and "eval/pass@1" in lines[2]
    out = capsys.readouterr().out
    assert (
        "step    3/3 | reward" in out
        and "eta" in out
        and "done: 3 steps" in out
        and re.search(r"^    prompt +\| completion", out, re.M)
    )
    ckpt = tmp_path / "run" / "checkpoint"
    model = load_model(ckpt)  # HF format, loadable with the same code as any checkpoint
    tok = Tokenizer.from_pretrained(ckpt)
    assert model.generation_config["eos_token_id"] == [0] and tok.eos_token_ids == {0}
    assert not [p for p in os.listdir(tmp_path / "run") if ".tmp" in p]
    import sample  # sample.py on the trained checkpoint, scored by the task's reward

    sample.main(
        [
            "--model",
            str(ckpt),
            "--prompt",
            "abcd=",
            "--num_samples",
            "2",
            "--max_new_tokens",
            "6",
            "--reward",
            "default_task",
            "--column",
            "target=abcd",
            "--device",
            "cpu",
            "--dtype",
            "float32",
        ]
    )
    out = capsys.readouterr().out
    assert "prompt (5 tokens): 'abcd='" in out and out.count("default_task=") == 2
    sample.main(
        [
            "--model",
            str(ckpt),
            "--prompt",
            "abcd=",
            "--num_samples",
            "1",
            "--device",
            "cpu",
            "--dtype",
            "float32",
        ]
    )  # default max_new_tokens=128 > the tiny 64-position context: capped
    assert "--- sample 0" in capsys.readouterr().out


def starts_with_a(completions, **kwargs):
    """1 for a completion that starts with "a": most groups of the untrained tiny model get all 0."""
    return [float(c.startswith("a")) for c in completions]


ADAPTIVE = [
    "--use_adaptive_entropy=true",
    "--entropy_target=5.0",
    "--entropy_coef=0.01",
    "--entropy_coef_delta=0.02",
]
DYNAMIC = ["--dynamic_sampling=true", f"--reward_funcs={__name__}:starts_with_a"]


@pytest.mark.parametrize(
    "split,args",
    [
        (3, ["--beta=0.04"]),  # on-policy, with a reference model: 3 + resume + 3
        (
            4,
            ["--num_iterations=2", "--loss_type=grpo"],
        ),  # off-policy rounds of 2 steps: resume at a round boundary
        (3, ADAPTIVE),  # the adaptive entropy coefficient is checkpointed
        (3, DYNAMIC),  # so is the prompt order that dynamic sampling consumed
        (4, [*DYNAMIC, "--num_iterations=2"]),  # rounds of 2 steps over the groups kept
        # a step over parts of two rounds (accumulation 3, rounds of 2 micro-batches): cycles of 3
        # rounds and 2 steps, resumed where a cycle ends
        (2, ["--gradient_accumulation_steps=3", "--steps_per_generation=2", "--num_generations=8"]),
    ],
)
def test_resume_is_exact(tmp_path, split, args):
    full = train.train(tiny(tmp_path / "a", "--max_steps=6", *args))
    first = train.train(tiny(tmp_path / "b", f"--max_steps={split}", *args))
    resumed = train.train(
        tiny(tmp_path / "b", "--resume_from_checkpoint=true", "--max_steps=6", *args)
    )
    assert len(full) == 6
    assert strip_timing(first) == strip_timing(full[:split])
    assert strip_timing(resumed) == strip_timing(full)
    a = load_model(tmp_path / "a" / "run" / "checkpoint").state_dict()
    b = load_model(tmp_path / "b" / "run" / "checkpoint").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_crash_while_saving_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    train.train(tiny(tmp_path, "--max_steps=2"))
    ckpt = tmp_path / "run" / "checkpoint"
    assert os.path.realpath(ckpt).endswith("checkpoint-2")

    def crash(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C in the middle of writing the next checkpoint

    monkeypatch.setattr(train.run.checkpoint, "write_model", crash)
    with pytest.raises(KeyboardInterrupt):
        train.train(tiny(tmp_path, "--max_steps=3", "--resume_from_checkpoint=true"))
    assert os.path.realpath(ckpt).endswith("checkpoint-2")  # still the last complete one
    load_model(ckpt)
    monkeypatch.undo()
    history = train.train(tiny(tmp_path, "--max_steps=3", "--resume_from_checkpoint=true"))
    assert [m["step"] for m in history] == [1, 2, 3]
    # save_total_limit=None (TRL's default) keeps every checkpoint; no half-written one is left
    assert sorted(p for p in os.listdir(tmp_path / "run") if p.startswith("checkpoint")) == [
        "checkpoint",
        "checkpoint-2",
        "checkpoint-3",
    ]


def test_save_total_limit_prunes_only_this_runs_checkpoints(tmp_path):
    """Regression: saving used to delete every other checkpoint-* in out_dir, the resume source and
    checkpoints a user put there included."""
    os.makedirs(tmp_path / "run" / "checkpoint-99-mine")
    train.train(tiny(tmp_path, "--max_steps=2", "--save_steps=1", "--save_total_limit=1"))
    run = tmp_path / "run"
    assert sorted(p for p in os.listdir(run) if p.startswith("checkpoint")) == [
        "checkpoint",
        "checkpoint-2",
        "checkpoint-99-mine",
    ]
    train.train(
        tiny(
            tmp_path,
            "--max_steps=4",
            "--save_steps=1",
            "--save_total_limit=1",
            "--resume_from_checkpoint=true",
        )
    )
    # the resume source (checkpoint-2) is kept; checkpoint-3 went when checkpoint-4 came
    assert sorted(p for p in os.listdir(run) if p.startswith("checkpoint")) == [
        "checkpoint",
        "checkpoint-2",
        "checkpoint-4",
        "checkpoint-99-mine",
    ]


def test_learning_default_task(tmp_path):
    # the embedded default's batch and learning rate (1e-3) for the first 80 of its 400 steps (~20 s): the
    # last 10 steps clearly beat the first 10 (measured at step 80 for seeds 1, 2 and 1337: +0.20, +0.23, +0.24)
    history = train.train(
        tiny(
            tmp_path,
            "--max_steps=80",
            "--gradient_accumulation_steps=2",
            "--num_generations=8",
            "--per_device_train_batch_size=64",
            "--max_completion_length=8",
        )
    )
    start = sum(m["reward"] for m in history[:10]) / 10
    end = sum(m["reward"] for m in history[-10:]) / 10
    assert end > start + 0.1, (start, end)


def bad_length_reward(completions, **kwargs):
    return [1.0]


SEEN = []


def column_reward(prompts, completions, completion_ids, difficulty, **kwargs):
    SEEN.append((prompts, completions, completion_ids, difficulty))
    return [float(d) for d in difficulty]


def test_reward_function_errors_name_the_function(tmp_path):
    cfg = tiny(tmp_path, f"--reward_funcs={__name__}:bad_length_reward")
    with pytest.raises(
        RewardError, match="bad_length_reward.*returned 1 values for 16 completions"
    ):
        train.train(cfg)


def test_resume_from_a_missing_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="no trainer state"):
        train.train(tiny(tmp_path, f"--resume_from_checkpoint={tmp_path}/nowhere"))


def test_config_errors():
    with pytest.raises(ConfigError, match="did you mean learning_rate"):
        load_config(["--config", "tiny.py", "--learnng_rate=1e-3"])
    with pytest.raises(ConfigError, match="per_device_train_batch_size"):
        load_config(["--config", "tiny.py", "--per_device_train_batch_size=3"])
    with pytest.raises(ConfigError, match="num_generations"):
        load_config(["--config", "tiny.py", "--num_generations=1"])


def test_conversational_jsonl_with_extra_columns(tmp_path):
    from nanogrpo.tokenizer import char_level_tokenizer

    rows = [
        {"prompt": [{"role": "user", "content": "abc" + "abcdefgh"[i] + "="}], "difficulty": i}
        for i in range(8)
    ]
    with open(tmp_path / "data.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    cfg = tiny(
        tmp_path,
        f"--dataset={tmp_path}/data.jsonl",
        f"--reward_funcs={__name__}:column_reward",
        "--max_steps=1",
    )
    run.ensure_tiny_checkpoint(cfg, train.dist.DistInfo())
    config = dict(
        char_level_tokenizer("abcdefgh=").config,
        chat_template="{% for m in messages %}{{ m.content }}{% endfor %}",
    )
    json.dump(config, open(os.path.join(cfg.model, "tokenizer_config.json"), "w"))
    SEEN.clear()
    history = train.train(cfg)
    prompts, completions, completion_ids, difficulty = SEEN[0]
    assert (
        len(prompts) == len(completions) == len(completion_ids) == len(difficulty) == 16
    )  # 4 prompts x G=4
    for i, (p, c, d) in enumerate(zip(prompts, completions, difficulty)):
        assert p == prompts[i // 4 * 4]  # a prompt's G completions are consecutive
        assert d == "abcdefgh".index(p[-1]["content"][3])  # its own row's column value
        assert c[0]["role"] == "assistant" and isinstance(c[0]["content"], str)
    assert history[0]["rewards/column_reward/mean"] == pytest.approx(sum(difficulty) / 16)


def test_a_stale_init_model_is_rebuilt_not_reused(tmp_path):
    """Regression: out/tiny-init was reused after init_model or the tokenizer characters changed."""
    run.ensure_tiny_checkpoint(tiny(tmp_path), train.dist.DistInfo())
    assert load_model(tmp_path / "init").config.hidden_size == 64
    run.ensure_tiny_checkpoint(
        tiny(
            tmp_path,
            "--init_model={'hidden_size': 32, 'intermediate_size': 64, "
            "'num_hidden_layers': 1, 'num_attention_heads': 2}",
            "--init_tokenizer_chars=abc=",
        ),
        train.dist.DistInfo(),
    )
    model, tok = load_model(tmp_path / "init"), Tokenizer.from_pretrained(tmp_path / "init")
    assert model.config.hidden_size == 32 and tok.vocab_size == 5


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("num_rows", [1, 2, 3, 7, 8])
def test_every_eval_row_counts_once_on_any_world_size(num_rows, world_size):
    """Regression: eval dropped len(rows) % world_size rows, and eval_size < world_size failed."""
    shards = [train.dist.equal_shard(num_rows, r, world_size) for r in range(world_size)]
    assert len({len(s) for s in shards}) == 1  # equal shapes for all_gather
    gathered = [i for s in shards for i in s][:num_rows]  # what evaluate keeps after the gather
    assert gathered == list(range(num_rows))


# -----------------------------------------------------------------------------
# A newcomer's first hour: nothing lost without being asked, errors at load, a visible result


def test_a_second_run_never_overwrites_the_first(tmp_path):
    train.train(tiny(tmp_path, "--max_steps=1"))
    with pytest.raises(
        ConfigError, match="holds a run.*--resume_from_checkpoint=true.*--overwrite_output_dir=true"
    ):
        train.train(tiny(tmp_path, "--max_steps=1"))
    assert os.path.isdir(tmp_path / "run" / "checkpoint-1")  # untouched by the refused run
    os.makedirs(tmp_path / "run" / "checkpoint-7-mine")
    train.train(tiny(tmp_path, "--max_steps=2", "--overwrite_output_dir=true"))
    kept = sorted(
        set(os.listdir(tmp_path / "run")) - {"reward.png"}
    )  # the curve is drawn when matplotlib is there
    assert kept == ["checkpoint", "checkpoint-2", "checkpoint-7-mine", "metrics.jsonl", "run.lock"]


def test_model_paths_that_are_not_checkpoints_are_errors(tmp_path):
    user_file = tmp_path / "notes.txt"
    user_file.write_text("mine")
    with pytest.raises(NotADirectoryError, match="is a file"):
        train.train(
            load_config(
                ["--config", "tiny.py", f"--model={user_file}", f"--output_dir={tmp_path}/run"]
            )
        )
    assert user_file.read_text() == "mine" and sorted(os.listdir(tmp_path)) == ["notes.txt", "run"]
    assert os.listdir(tmp_path / "run") == [
        "run.lock"
    ]  # taken before the model loads: nothing else
    cfg = load_config(
        ["--config", "tiny.py", f"--model={tmp_path}/missing", f"--output_dir={tmp_path}/run"]
    )
    assert cfg.init_model is None  # the file's init_model builds only at the file's own model path
    with pytest.raises(FileNotFoundError, match="no such directory"):
        train.train(cfg)
    assert not os.path.exists(tmp_path / "missing")


def test_reward_columns_are_checked_at_load(tmp_path):
    with open(tmp_path / "data.jsonl", "w") as f:
        f.writelines(
            json.dumps({"prompt": "abc=", "target": "abc"} if i != 3 else {"prompt": "abd="}) + "\n"
            for i in range(8)
        )
    with pytest.raises(
        ValueError, match=r"'default_task' needs the column\(s\) \['target'\], which row 3"
    ):
        train.train(tiny(tmp_path, f"--dataset={tmp_path}/data.jsonl"))
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")  # stopped before step 1


def test_a_prompt_longer_than_the_context_is_named_at_load(tmp_path):
    with open(tmp_path / "data.jsonl", "w") as f:
        f.writelines(
            json.dumps({"prompt": "ab" * (30 if i == 5 else 2) + "=", "target": "ab"}) + "\n"
            for i in range(8)
        )
    with pytest.raises(ValueError, match="row 5: the prompt is 61 tokens"):
        train.train(tiny(tmp_path, f"--dataset={tmp_path}/data.jsonl"))
    with pytest.raises(ConfigError, match="max_completion_length=64: the model's context is 64"):
        train.train(tiny(tmp_path, "--max_completion_length=64"))


def test_a_failing_evaluation_keeps_what_was_trained(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("eval broke")

    monkeypatch.setattr(train, "evaluate", broken)
    with pytest.raises(RuntimeError, match="eval broke"):
        train.train(
            tiny(
                tmp_path,
                "--eval_strategy=steps",
                "--eval_steps=2",
                "--save_steps=0",
                "--max_steps=4",
            )
        )
    assert os.path.isdir(tmp_path / "run" / "checkpoint-2")
    assert [json.loads(line)["step"] for line in open(tmp_path / "run" / "metrics.jsonl")] == [1, 2]


def test_ctrl_c_saves_and_the_resumed_run_is_exact(tmp_path, monkeypatch, capsys):
    full = train.train(tiny(tmp_path / "a", "--max_steps=4", "--save_steps=0"))
    calls, score = [], train.reward_rollout

    def interrupted(*args):  # Ctrl-C while the third round is being scored
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return score(*args)

    monkeypatch.setattr(train, "reward_rollout", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train.train(tiny(tmp_path / "b", "--max_steps=4", "--save_steps=0"))
    out = capsys.readouterr().out
    assert "interrupted at step 2/4: saved" in out and "--resume_from_checkpoint=true" in out
    monkeypatch.setattr(train, "reward_rollout", score)
    resumed = train.train(
        tiny(tmp_path / "b", "--max_steps=4", "--save_steps=0", "--resume_from_checkpoint=true")
    )
    assert strip_timing(resumed) == strip_timing(full)
    a, b = (
        load_model(tmp_path / "a" / "run" / "checkpoint"),
        load_model(tmp_path / "b" / "run" / "checkpoint"),
    )
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


def unscored(completions, **kwargs):
    return [None] * len(completions)


def huge(completions, **kwargs):
    return [1e30 * len(c) for c in completions]


def constant(completions, **kwargs):
    return [1.0] * len(completions)


ROUNDS = []


def differs_once(completions, **kwargs):
    """Rewards that differ within every group in the first round only; every group ties after."""
    ROUNDS.append(len(completions))
    return [float(i % 2 and len(ROUNDS) == 1) for i in range(len(completions))]


@pytest.mark.parametrize("adam_beta1,moves", [(0.9, True), (0.0, False)])
def test_rounds_whose_groups_all_tie_move_the_weights_only_through_momentum(
    tmp_path, adam_beta1, moves
):
    """When every group of a round ties, the gradient is 0 and AdamW still steps (as TRL's Trainer
    does). At adam_beta1 0.9 its momentum goes on moving the weights in the direction of the last
    round with an advantage; at 0 (configs/vault.py) they stay where that round left them."""
    from safetensors.torch import load_file

    ROUNDS.clear()
    overrides = ("--gradient_accumulation_steps=1", "--save_steps=1", f"--adam_beta1={adam_beta1}")
    train.train(tiny(tmp_path, f"--reward_funcs={__name__}:differs_once", *overrides))
    first, *tied = (
        load_file(tmp_path / "run" / f"checkpoint-{s}" / "model.safetensors") for s in (1, 2, 3)
    )
    init = load_file(tmp_path / "init" / "model.safetensors")
    assert len(ROUNDS) == 3 and not all(torch.equal(init[k], first[k]) for k in first)
    for after in tied:
        assert moves == any(not torch.equal(first[k], after[k]) for k in first)


@pytest.mark.parametrize(
    "func,steps,warning",
    [
        ("unscored", 1, "no completion got a reward this round"),
        ("huge", 1, "overflow float32"),
        ("constant", 10, "identical for 10 rounds"),
    ],
)
def test_rewards_that_cannot_teach_are_warned_about(tmp_path, capsys, func, steps, warning):
    history = train.train(
        tiny(tmp_path, f"--reward_funcs={__name__}:{func}", f"--max_steps={steps}")
    )
    assert "warning: " in capsys.readouterr().out.split(warning)[0][-200:]
    if func == "unscored":  # NaN is written as null, never as a number
        line = open(tmp_path / "run" / "metrics.jsonl").read()
        assert (
            "NaN" not in line
            and json.loads(line)["reward"] is None
            and history[0]["reward"] is None
        )


def test_resume_reports_what_it_does(tmp_path, capsys):
    train.train(tiny(tmp_path, "--max_steps=2", "--resume_from_checkpoint=true"))
    assert "no checkpoint in" in capsys.readouterr().out
    train.train(tiny(tmp_path, "--max_steps=2", "--resume_from_checkpoint=true"))
    assert "nothing to do: the checkpoint is at step 2 and max_steps=2" in capsys.readouterr().out
    train.train(
        tiny(tmp_path, "--max_steps=3", "--resume_from_checkpoint=true", "--learning_rate=0.5")
    )
    out = capsys.readouterr().out
    assert "note: learning_rate was 0.001 in the checkpoint's run; 0.5 is ignored" in out
    # what the checkpoint records is what the run used: the restored optimizer's rate
    saved = json.load(open(tmp_path / "run" / "checkpoint-3" / "train_config.json"))
    assert saved["learning_rate"] == 0.001


def test_resuming_with_another_model_names_both(tmp_path):
    train.train(tiny(tmp_path, "--max_steps=1"))
    other = tmp_path / "other"
    with pytest.raises(
        ConfigError, match="trained from model=.*init.*not .*other.*resume without --model"
    ):
        train.train(
            tiny(tmp_path, "--max_steps=2", "--resume_from_checkpoint=true", f"--model={other}")
        )


def test_an_out_dir_that_cannot_hold_a_run_is_one_clear_error(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="output_dir=.*afile.* is a file, not a directory"):
        train.train(tiny(tmp_path, f"--output_dir={tmp_path}/afile"))
    with pytest.raises(ConfigError, match="output_dir='/proc/nanogrpo' cannot be written"):
        train.train(tiny(tmp_path, "--output_dir=/proc/nanogrpo"))


def nan_reward(completions, **kwargs):
    return [math.nan] * len(completions)


def test_all_nan_rewards_are_named_and_the_summary_says_so(tmp_path, capsys):
    train.train(tiny(tmp_path, f"--reward_funcs={__name__}:nan_reward", "--max_steps=2"))
    out = capsys.readouterr().out
    assert "returned None or NaN for every completion" in out
    assert "no step had a scored reward" in out and "0.000 -> 0.000" not in out


def fails_on_third_call(completions, **kwargs):
    fails_on_third_call.calls += 1
    if fails_on_third_call.calls == 3:
        raise ValueError("reward broke")
    return [float(len(c)) for c in completions]


def test_a_reward_function_that_raises_keeps_the_last_completed_step(tmp_path, capsys):
    fails_on_third_call.calls = 0
    with pytest.raises(RewardError, match="reward broke"):
        train.train(
            tiny(
                tmp_path,
                f"--reward_funcs={__name__}:fails_on_third_call",
                "--max_steps=4",
                "--save_steps=0",
            )
        )
    assert "stopped by an error at step 2/4: saved" in capsys.readouterr().out
    assert os.path.realpath(tmp_path / "run" / "checkpoint").endswith("checkpoint-2")


def test_ctrl_c_during_a_save_never_claims_a_checkpoint_that_is_not_there(
    tmp_path, monkeypatch, capsys
):
    real = train.run.checkpoints.save_checkpoint
    calls = []

    def interrupted(out_dir, step, *args, **kwargs):
        calls.append(step)
        if len(calls) == 1:  # Ctrl-C inside the first save, before anything is on disk
            raise KeyboardInterrupt
        return real(out_dir, step, *args, **kwargs)

    monkeypatch.setattr(train.run.checkpoints, "save_checkpoint", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train.train(tiny(tmp_path, "--max_steps=4", "--save_steps=2"))
    assert "saved" in capsys.readouterr().out
    assert os.path.realpath(tmp_path / "run" / "checkpoint").endswith("checkpoint-2")
    assert calls == [2, 2]  # the interrupted save is made again, not taken as done


def test_round_seeds_never_repeat_after_a_round_cut_short(tmp_path, monkeypatch):
    seen = []
    real = train.round_seed

    def recording(cfg, rnd, rank, salt=0):
        if salt == 0:
            seen.append(rnd)
        return real(cfg, rnd, rank, salt)

    monkeypatch.setattr(train, "round_seed", recording)
    args = [
        "--steps_per_generation=2",
        "--per_device_train_batch_size=8",
        "--gradient_accumulation_steps=1",
    ]
    train.train(tiny(tmp_path, "--max_steps=3", *args))  # round 1 is cut after one of its two steps
    train.train(tiny(tmp_path, "--max_steps=5", "--resume_from_checkpoint=true", *args))
    assert seen == [0, 1, 2]


def test_nothing_to_do_still_tears_down(tmp_path, monkeypatch):
    train.train(tiny(tmp_path, "--max_steps=1"))
    calls = []
    monkeypatch.setattr(train.dist, "teardown", lambda: calls.append(1))
    train.train(tiny(tmp_path, "--max_steps=1", "--resume_from_checkpoint=true"))
    assert calls == [1]


def test_several_processes_never_save_after_a_stop():
    """After an error on one rank the others may be inside a collective: a save would hang them."""
    cfg = tiny_cfg = load_config(["--config", "tiny.py"])
    state = train.Trainer.__new__(train.Trainer)
    state.step = 3
    two = run.Run(cfg=cfg, info=train.dist.DistInfo(rank=0, world_size=2))
    assert "several processes" in run.unsaveable(two, state)
    one = run.Run(cfg=tiny_cfg, info=train.dist.DistInfo())
    assert run.unsaveable(one, state) is None


def test_report_to(tmp_path, monkeypatch):
    import sys
    import types

    logged = []
    fake = types.SimpleNamespace(
        init=lambda **kw: None, log=lambda m, step: logged.append((step, m))
    )
    monkeypatch.setitem(sys.modules, "trackio", fake)
    train.train(tiny(tmp_path, "--max_steps=2", "--report_to=trackio"))
    assert [s for s, _ in logged] == [1, 2]
    assert {
        "train/reward",
        "train/loss",
        "train/learning_rate",
        "train/completions/mean_length",
    } <= set(logged[0][1])
    monkeypatch.setitem(sys.modules, "trackio", None)  # not installed
    with pytest.raises(
        ConfigError,
        match="report_to='trackio', but trackio cannot be imported.*pip install trackio",
    ):
        train.train(
            tiny(tmp_path, "--max_steps=2", "--report_to=trackio", "--overwrite_output_dir=true")
        )


def test_command_line_help_errors_and_the_reward_curve_hint(tmp_path, monkeypatch):
    import subprocess
    import sys

    from conftest import ROOT

    done = subprocess.run(
        [sys.executable, "train.py", "--help"], capture_output=True, text=True, cwd=ROOT
    )
    assert (
        done.returncode == 0
        and "--learning_rate=0.001" in done.stdout
        and "optimizer and learning-rate schedule (transformers' names):" in done.stdout
    )
    from dataclasses import fields

    from nanogrpo.run.config import TrainConfig

    keys = [
        line.split("=")[0].strip() for line in done.stdout.splitlines() if line.startswith("  --")
    ]
    assert keys == [f"--{f.name}" for f in fields(TrainConfig)]  # every setting, once, in order
    assert not [
        line
        for line in done.stdout.splitlines()
        if line.strip().startswith(("def ", "raise ", "--def"))
    ]
    bad = subprocess.run(
        [sys.executable, "train.py", "--max_steps=0"], capture_output=True, text=True, cwd=ROOT
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith(
        "train.py: error: max_steps=0: must be > 0, or -1 for num_train_epochs"
    )
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert report.plot_rewards(tiny(tmp_path)).startswith(
        "pip install matplotlib, then: python bench/plot.py"
    )


def test_printed_samples_show_a_tool_conversation_whole():
    """A tool-calling completion prints its call, the tool's result and the answer, not only the first turn."""
    messages = [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "multiply", "arguments": {"a": 12, "b": 34}},
                }
            ],
        },
        {"role": "tool", "name": "multiply", "content": "408"},
        {"role": "assistant", "content": "408"},
    ]
    assert (
        report.conversation_text(messages) == '[call multiply {"a": 12, "b": 34}] [tool: 408] 408'
    )
    assert report.conversation_text([{"role": "assistant", "content": "hi"}]) == "hi"


def _rollout_batch(advantages, P=5, C=6, seed=0):
    """Rows in pairs that share a prompt (groups of 2), random completions of random lengths."""
    from nanogrpo.rollout import Rollout

    g = torch.Generator().manual_seed(seed)
    N = len(advantages)
    ids = torch.randint(0, 300, (N, P + C), generator=g)
    ids[1::2, :P] = ids[::2, :P]
    mask = (torch.arange(C)[None] < torch.randint(1, C + 1, (N,), generator=g)[:, None]).float()
    return Rollout(
        rows=[],
        num_generations=2,
        prompt_ids=[],
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        completion_mask=mask,
        completion_lengths=mask.sum(1).long(),
        truncated=torch.zeros(N, dtype=bool),
        prompts=[],
        completions=[],
        completion_token_ids=[],
        advantages=torch.tensor(advantages),
        old_logps=-torch.rand(N, C, generator=g) * 3,
        num_items=mask.sum(),
    )


def trainer_for(model, optimizer, cfg, settings):
    """The fields of train.py's Trainer an optimizer step reads; settings: loss_settings' pair."""
    loss_cfg, terms = settings
    """The fields of train.Trainer that an optimizer step reads."""
    from types import SimpleNamespace

    from nanogrpo.distributed import DistInfo

    return SimpleNamespace(
        model=model,
        optimizer=optimizer,
        cfg=cfg,
        loss_cfg=loss_cfg,
        loss_terms=terms if terms.on() else None,
        info=DistInfo(),
        autocast=torch.autocast("cpu", enabled=False),
        tok=SimpleNamespace(vocab_size=None),
        sched=SimpleNamespace(steps_per_generation=2),
        kernels=train.Kernels(**fast.kernels()),
        entropy_coef=terms.entropy_coef,
        last_entropy=math.inf,
    )


class RecordingAdamW(torch.optim.AdamW):
    """AdamW that keeps a copy of the gradients it stepped with."""

    def step(self, closure=None):
        self.grads = [[p.grad.clone() for p in g["params"]] for g in self.param_groups]
        return super().step(closure)


@pytest.mark.parametrize("beta", [0.0, 0.1])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "cispo", "sapo"])
def test_rows_without_advantage_skip_the_backward_and_change_nothing(loss_type, beta, monkeypatch):
    """train.update scores zero-advantage rows without gradient when beta = 0. Its gradients and metrics equal a
    plain loop that backpropagates through every row (to fp32 rounding: the rows run in other batches), also in a
    round where every advantage is 0, where every parameter still gets its (zero) gradient and AdamW still steps.
    (The fixture model is far below the size where skipping pays, so the floor is lowered to 0 here.)"""
    from nanogrpo.fast import logprobs

    monkeypatch.setitem(logprobs.SKIP_MIN_FLOPS, "cpu", 0)
    calls = []
    monkeypatch.setattr(
        logprobs,
        "token_logprobs",
        lambda *a, **k: calls.append(torch.is_grad_enabled()) or token_logprobs(*a, **k),
    )
    from conftest import fixture_path

    from nanogrpo.grpo import LossInputs, LossScale
    from nanogrpo.run.config import TrainConfig

    rounds = [
        _rollout_batch([0.0, 0.0, 1.0, -1.0, 0.0, 0.0, 0.5, 0.0]),
        _rollout_batch([0.0] * 8, seed=1),
    ]
    cfg = TrainConfig(temperature=0.9, max_grad_norm=0.5, per_device_train_batch_size=4)
    loss_cfg, terms = loss_settings(loss_type=loss_type, beta=beta, top_entropy_quantile=0.5)
    micro = [torch.arange(0, 4), torch.arange(4, 8)]
    results = []
    for skip in (True, False):
        model, ref_model = load_model(fixture_path("qwen2")), load_model(fixture_path("qwen2"))
        optimizer = RecordingAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        history, grads = [], []
        for ro in rounds:
            if beta:
                with torch.no_grad():
                    ro.ref_logps = token_logprobs(
                        ref_model,
                        ro.input_ids,
                        ro.attention_mask,
                        ro.completion_mask,
                        temperature=0.9,
                    )[0]
            if skip:
                t = trainer_for(model, optimizer, cfg, (loss_cfg, terms))
                history.append(conftest.optimizer_step(t, [(ro, idx) for idx in micro]))
            else:
                sums = {}
                for idx in micro:  # the plain loop: every row with its gradient
                    logps, entropies = token_logprobs(
                        model,
                        ro.input_ids[idx],
                        ro.attention_mask[idx],
                        ro.completion_mask[idx],
                        temperature=0.9,
                    )
                    inputs = LossInputs(
                        logps=logps,
                        advantages=ro.advantages[idx],
                        completion_mask=ro.completion_mask[idx],
                        old_logps=ro.old_logps[idx],
                        ref_logps=None if beta == 0 else ro.ref_logps[idx],
                        entropies=entropies,
                    )
                    scale = LossScale(num_items=ro.num_items, grad_accum=2, steps_per_generation=2)
                    loss, metrics = grpo_step_with_terms(inputs, loss_cfg, terms, scale)
                    loss.backward()
                    for k, v in {**metrics, "loss": loss.item()}.items():
                        sums[k] = sums.get(k, 0.0) + v / (1 if k == "loss" else 2)
                sums["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                history.append(sums)
            grads.append(torch.cat([g.flatten() for group in optimizer.grads for g in group]))
        assert all(
            s["step"] == 2 for s in optimizer.state.values()
        )  # every parameter stepped twice
        results.append((history, grads))
    (h_skip, g_skip), (h_plain, g_plain) = results
    assert (h_skip[1]["loss"] == 0) == (beta == 0)  # the second round has no advantage at all
    assert calls == ([False, True] * 4 if beta == 0 else [True] * 4)  # 2 rounds x 2 micro-batches
    for a, b in zip(h_skip, h_plain):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), k
    for a, b in zip(g_skip, g_plain):
        scale = b.abs().max()
        assert scale > 0 or beta == 0
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6 * scale)


def test_small_models_do_not_split_off_rows_without_advantage():
    """Below SKIP_MIN_FLOPS (the embedded tiny model, the fixtures) the extra forward call costs more than the
    backward it would save: zero-advantage rows keep their gradient and one forward runs."""
    from conftest import fixture_path

    from nanogrpo.fast import logprobs

    model, ro = load_model(fixture_path("qwen2")), _rollout_batch([0.0, 0.0, 1.0, -1.0])
    free = logprobs.rows_without_gradient(ro.advantages, 0.0, model, ro.input_ids.shape[1])
    assert not free.any()
    logps, _ = logprobs.policy_logprobs(
        model,
        ro.input_ids,
        ro.attention_mask,
        ro.completion_mask,
        ro.advantages,
        beta=0.0,
        entropy_bonus=False,
    )
    assert logps.requires_grad and logps.grad_fn.name().startswith(
        "IndexPut"
    )  # token_logprobs' own scatter
    saved = 4 * sum(p.numel() for p in model.parameters()) * 2 * ro.input_ids.shape[1]
    assert saved < logprobs.SKIP_MIN_FLOPS["cpu"]  # the backward the split would save


def test_eval_every_zero_is_silent_and_an_eval_without_data_is_named(tmp_path, capsys):
    train.train(tiny(tmp_path, "--max_steps=1", "--eval_strategy=no"))
    assert "warning" not in capsys.readouterr().out
    train.train(
        tiny(
            tmp_path,
            "--max_steps=1",
            "--eval_strategy=steps",
            "--eval_dataset=None",
            "--overwrite_output_dir=true",
        )
    )
    assert (
        "warning: eval_strategy='steps' without an eval_dataset: no evaluation"
        in capsys.readouterr().out
    )


def test_a_reward_file_with_a_syntax_error_is_one_line(tmp_path):
    import subprocess
    import sys

    from conftest import ROOT

    bad = tmp_path / "myreward.py"
    bad.write_text("def reward(completions, **kw):\n    return [1.0 for c in completions\n")
    done = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--config",
            "tiny.py",
            f"--reward_funcs={bad}:reward",
            f"--output_dir={tmp_path}/o",
            f"--model={tmp_path}/init",
            INIT,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith(
        f"train.py: error: reward function '{bad}:reward': {bad}, line 2:"
    )


def test_reward_functions_get_trls_trainer_state_log_metric_and_log_extra(tmp_path, capsys):
    """A TRL script's step-dependent reward ports unchanged: trainer_state,
    log_metric (logged beside the others) and log_extra (shown with the
    logged completions)."""
    seen = []

    def staged(completions, target, trainer_state, log_metric, log_extra, **kwargs):
        seen.append((trainer_state.global_step, trainer_state.max_steps))
        log_metric("my/first_letter_right", 0.5)
        log_extra("guess", [c[:1] for c in completions])
        return [float(c[:1] == t[:1]) for c, t in zip(completions, target)]

    cfg = tiny(tmp_path, "--max_steps=2", "--log_completions=true", "--logging_steps=1")
    cfg.reward_funcs = [staged, "default_task"]
    history = train.train(cfg)
    assert seen == [(0, 2), (1, 2)]
    assert [m["my/first_letter_right"] for m in history] == [0.5, 0.5]
    assert re.search(
        r"^    prompt +\| completion +\| reward +\| guess$", capsys.readouterr().out, re.M
    )


def test_trainer_state_is_read_by_attribute_as_transformers_trainer_state(tmp_path):
    """TRL passes transformers' TrainerState, not a dict: a reward written
    for TRL reads trainer_state.global_step and sees it advance."""
    seen = []

    def warmup(completions, trainer_state, **kwargs):
        s = trainer_state
        seen.append(
            (
                s.global_step,
                s.max_steps,
                s.epoch,
                s.num_train_epochs,
                s.logging_steps,
                s.is_world_process_zero,
                s.log_history,
                s.best_metric,
            )
        )
        return [1.0 if trainer_state.global_step < 1 else 0.0 for _ in completions]

    cfg = tiny(tmp_path, "--max_steps=2", "--logging_steps=1")
    cfg.reward_funcs = [warmup, "default_task"]
    train.train(cfg)
    assert [s[:2] for s in seen] == [(0, 2), (1, 2)]
    epochs = [s[2] for s in seen]
    assert epochs[0] == 0.0 and 0.0 < epochs[1] < 1.0 and isinstance(epochs[1], float)
    assert all(s[3:] == (1, 1, True, [], None) for s in seen)


def test_trainer_state_counts_epochs_in_optimizer_steps_as_transformers():
    """8 prompts, 4 per round, a round per step: 2 steps an epoch, so step 3
    is halfway through the second epoch, and 5 steps reach into a third."""
    from types import SimpleNamespace

    from nanogrpo.distributed import DistInfo
    from nanogrpo.extras.trainer_info import trainer_state_of

    cfg = tiny("unused", "--max_steps=5", "--logging_steps=4", "--eval_steps=6", "--save_steps=7")
    cfg.validate(1)
    t = SimpleNamespace(cfg=cfg, step=3, prompts=SimpleNamespace(rows=[{}] * 8), info=DistInfo())
    state = trainer_state_of(t)
    assert (state.epoch, state.num_train_epochs) == (1.5, 3)
    assert (state.global_step, state.max_steps) == (3, 5)
    assert (state.logging_steps, state.eval_steps, state.save_steps) == (4, 6, 7)
    assert state.train_batch_size == 8 and state.log_history == [] and state.trial_name is None


def test_log_metric_twice_in_a_round_logs_the_mean_and_log_extra_the_last(tmp_path, capsys):
    """TRL appends each log_metric value and logs their mean; log_extra's
    table keeps one batch of rows: the last call's column."""

    def twice(completions, log_metric, log_extra, **kwargs):
        log_metric("my/metric", 1.0)
        log_metric("my/metric", 3.0)
        log_extra("guess", ["first"] * len(completions))
        log_extra("guess", ["second"] * len(completions))
        return [0.0 for _ in completions]

    cfg = tiny(tmp_path, "--max_steps=1", "--log_completions=true", "--logging_steps=1")
    cfg.reward_funcs = [twice, "default_task"]
    history = train.train(cfg)
    assert history[0]["my/metric"] == 2.0
    out = capsys.readouterr().out
    assert re.search(r"\| second$", out, re.M) and not re.search(r"\| first$", out, re.M)


def test_push_to_hub_uploads_each_checkpoint_without_its_optimizer(tmp_path, monkeypatch):
    """push_to_hub goes through huggingface-hub's upload API: checked here by
    what would be uploaded (no network)."""
    import huggingface_hub

    calls = []

    class FakeApi:
        def create_repo(self, repo, exist_ok=False):
            calls.append(("create", repo, exist_ok))

        def upload_folder(self, repo_id, folder_path, commit_message, ignore_patterns):
            files = sorted(os.listdir(folder_path))
            calls.append(("upload", repo_id, os.path.basename(folder_path), files, ignore_patterns))

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setenv("HF_TOKEN", "hf_test")  # a token is checked for before step 1
    train.train(
        tiny(
            tmp_path,
            "--max_steps=2",
            "--save_steps=1",
            "--push_to_hub=true",
            "--hub_model_id=me/tiny-grpo",
        )
    )
    uploads = [c for c in calls if c[0] == "upload"]
    assert [c[2] for c in uploads] == ["checkpoint-1", "checkpoint-2"]
    assert all(c[1] == "me/tiny-grpo" and c[4] == ["trainer/*"] for c in uploads)
    assert "model.safetensors" in uploads[0][3] and "config.json" in uploads[0][3]
    assert ("create", "me/tiny-grpo", True) in calls


def test_a_warning_when_most_completions_hit_max_completion_length(tmp_path, capsys):
    """The most common cause of a reward stuck at 0 in TRL's tracker gets a
    line of its own (the tiny task's answers are 5 tokens: 2 cut them)."""
    train.train(tiny(tmp_path, "--max_steps=6", "--max_completion_length=2"))
    assert "most completions hit max_completion_length=2 for 5 rounds" in capsys.readouterr().out


def test_num_generations_eval_and_max_prompt_length(tmp_path, capsys):
    """num_generations_eval samples each eval prompt that many times;
    max_prompt_length cuts prompts from the left and says how many."""
    cfg = tiny(
        tmp_path,
        "--max_steps=1",
        "--eval_strategy=steps",
        "--eval_steps=1",
        "--eval_size=6",
        "--num_generations_eval=3",
        "--max_prompt_length=3",
    )
    info = train.dist.setup("cpu")
    _, cfg = train.run.start(cfg, info)  # builds the tiny init checkpoint
    t = train.setup(cfg, info)
    assert (
        "warning: 10000 of 10000 prompts of default are longer than max_prompt_length=3"
        in capsys.readouterr().out
    )
    prompt_ids = t.tok.encode_prompt(t.eval_rows[0]["prompt"], max_length=3)
    assert len(prompt_ids) == 3
    assert prompt_ids == t.tok.encode_prompt(t.eval_rows[0]["prompt"])[-3:]
    seen = []
    score = train.reward_rollout
    train.reward_rollout = lambda ro, funcs, *a: (
        seen.append(len(ro.completions)) or score(ro, funcs)
    )
    try:
        metrics = train.evaluate(t)
    finally:
        train.reward_rollout = score
    assert seen == [18] and 0 <= metrics["eval/reward"] <= 1
    t.cfg = dataclasses.replace(t.cfg, num_generations_eval=None)  # TRL's: num_generations
    train.reward_rollout = lambda ro, funcs, *a: (
        seen.append(len(ro.completions)) or score(ro, funcs)
    )
    try:
        train.evaluate(t)
    finally:
        train.reward_rollout = score
    assert seen == [18, 6 * 4]


STATS = ("min", "mean", "max")


def test_each_algorithm_option_runs_and_logs_trls_metrics(tmp_path):
    """The entropy bonus (static, adaptive), OPSM and each importance-sampling mode: a run
    finishes and logs what TRL logs for it."""
    history = train.train(tiny(tmp_path / "static", "--entropy_coef=0.01"))
    assert all(m["entropy_coef"] == 0.01 and math.isfinite(m["policy_loss"]) for m in history)
    history = train.train(tiny(tmp_path / "adaptive", *ADAPTIVE, "--max_steps=4"))
    # the first step applies no bonus (no entropy measured yet); each step moves it one delta
    assert [round(m["entropy_coef"], 6) for m in history] == [0.03, 0.05, 0.07, 0.09]
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        history = train.train(
            tiny(
                tmp_path / mode,
                f"--vllm_importance_sampling_mode={mode}",
                "--off_policy_mask_threshold=0.5",
                "--max_steps=2",
            )
        )
        for m in history:
            # fp32 on CPU: the sampler and the trainer agree to float rounding
            assert m["sampling/sampling_logp_difference/max"] < 1e-4
            assert 1 - 1e-3 < m["sampling/importance_sampling_ratio/min"] <= 1
            assert 1 <= m["sampling/importance_sampling_ratio/max"] < 1 + 1e-3
    history = train.train(
        tiny(tmp_path / "off", "--vllm_importance_sampling_correction=false", "--max_steps=1")
    )
    # no correction, TRL's sampling/ metrics off; the raw sampler/trainer ratios stay (trl#5231)
    logged = sorted(k for k in history[0] if k.startswith("sampling/"))
    raw = "sampling/raw_importance_sampling_ratio/"
    assert logged == sorted(f"{raw}{lv}/{s}" for lv in ("sequence", "token") for s in STATS)
    assert 1 - 1e-3 < history[0][f"{raw}token/min"] <= 1 <= history[0][f"{raw}token/max"] < 1.001


def test_dynamic_sampling_trains_only_groups_with_spread(tmp_path, monkeypatch):
    """Every group that reaches the update has rewards that differ; more were drawn than kept."""
    trained = []
    step = train.optimizer_step

    def spy(t, micro):
        trained.extend(ro for ro, _ in micro)
        return step(t, micro)

    monkeypatch.setattr(train, "optimizer_step", spy)
    history = train.train(tiny(tmp_path, *DYNAMIC, "--max_num_gen_batches=20"))
    for ro in trained:
        total = torch.tensor([float(c.startswith("a")) for c in ro.completions])
        assert (total.view(-1, ro.num_generations).std(dim=1) > 0).all()
        assert len(ro.rows) == 4  # the round's full number of groups
    for m in history:
        assert m["frac_reward_zero_std"] == 0
        assert m["dynamic_sampling/groups_kept"] == 4
        assert m["dynamic_sampling/groups_drawn"] > 4
    assert sum(m["dynamic_sampling/gen_batches"] for m in history) > len(history)


def test_dynamic_sampling_fills_the_round_at_its_bound(tmp_path, capsys):
    history = train.train(
        tiny(
            tmp_path,
            "--dynamic_sampling=true",
            "--max_num_gen_batches=2",
            f"--reward_funcs={__name__}:constant",
            "--max_steps=2",
        )
    )
    for m in history:
        assert m["dynamic_sampling/groups_kept"] == 0
        assert m["dynamic_sampling/groups_drawn"] == 8
        assert m["time/dynamic_sampling"] > 0
    out = capsys.readouterr().out
    assert "dynamic_sampling found 0 groups with differing rewards of the 4 a round" in out
    assert out.count("dynamic_sampling found") == 1  # said once


@pytest.mark.parametrize("coef", [0.5, -0.5])
def test_an_entropy_bonus_alone_moves_the_entropy_its_way(coef):
    """Every advantage 0: the step's only gradient is the bonus's, -coef x d(mean entropy), so one
    small SGD step raises the batch's entropy for coef > 0 and lowers it for coef < 0."""
    from conftest import fixture_path

    from nanogrpo.run.config import TrainConfig

    ro = _rollout_batch([0.0] * 8)
    ro.old_logps = None
    model = load_model(fixture_path("qwen2"))
    cfg = TrainConfig(temperature=0.9, max_grad_norm=0.0, per_device_train_batch_size=4)
    loss_cfg = loss_settings(loss_type="dapo", entropy_coef=coef)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    micro = [torch.arange(0, 4), torch.arange(4, 8)]

    def mean_entropy():
        with torch.no_grad():
            _, ent = token_logprobs(
                model, ro.input_ids, ro.attention_mask, ro.completion_mask, temperature=0.9
            )
        return (ent * ro.completion_mask).sum() / ro.completion_mask.sum()

    before = mean_entropy()
    metrics = conftest.optimizer_step(
        trainer_for(model, optimizer, cfg, loss_cfg), [(ro, idx) for idx in micro]
    )
    after = mean_entropy()
    assert metrics["entropy_coef"] == coef
    assert metrics["grad_norm"] > 0
    assert (after - before) * coef > 1e-4


def test_max_steps_inside_a_cycle_is_said(tmp_path, capsys):
    """A round's samples are not checkpointed: max_steps that cuts a cycle of rounds and steps
    short says that a run resumed from it would not be exact (test_resume_is_exact splits at a
    cycle's end)."""
    train.train(tiny(tmp_path / "a", "--num_iterations=2", "--max_steps=3"))
    assert "max_steps=3 ends inside a cycle of 2 optimizer steps" in capsys.readouterr().out
    train.train(tiny(tmp_path / "b", "--num_iterations=2", "--max_steps=4"))
    assert "ends inside a cycle" not in capsys.readouterr().out


def test_checking_an_out_dir_creates_nothing(tmp_path, monkeypatch):
    """Regression: the check made out_dir's missing folders and removed them again, so under
    torchrun one rank could remove a folder while another wrote its probe there ("cannot be
    written (No such file or directory)" at random). Now no folder is made, at any moment."""

    def no_folders(*args, **kwargs):
        raise AssertionError("check_out_dir made a folder")

    monkeypatch.setattr(os, "makedirs", no_folders)
    monkeypatch.setattr(os, "mkdir", no_folders)
    run.check_out_dir(str(tmp_path / "a" / "b" / "run"))
    assert list(tmp_path.iterdir()) == []


def test_lora_dropout_does_not_reach_the_sampler_correction(tmp_path):
    """The update's forward drops adapter inputs, the sampler's does not: the correction compares
    the sampler with the policy it ran (an eval-mode forward), so in fp32 its weights stay 1 to
    float rounding instead of weighing completions by dropout noise."""
    history = train.train(
        tiny(
            tmp_path,
            "--use_peft=true",
            "--lora_dropout=0.3",
            "--lora_modules_to_save=embed_tokens,lm_head",
            "--learning_rate=1e-2",
            "--max_steps=4",
        )
    )
    for m in history:
        assert m["sampling/sampling_logp_difference/max"] < 1e-3
        assert 1 - 1e-3 < m["sampling/importance_sampling_ratio/min"] <= 1
        assert 1 <= m["sampling/importance_sampling_ratio/max"] < 1 + 1e-3


@pytest.mark.parametrize("mode", ["sequence_mask", "token_truncate"])
def test_sampling_metrics_are_over_the_whole_step_as_trl(mode):
    """TRL takes sampling/* over the step's tokens: one token that differs by 1 in one micro-batch
    and three that agree in another give a mean difference of 1/4 (a mean of micro-batch means
    gave 1/2); the correction's mean weight is over the step's sequences or tokens likewise."""
    from conftest import fixture_path

    from nanogrpo.run.config import TrainConfig

    ro = _rollout_batch([1.0, -1.0])
    ro.completion_mask = torch.zeros_like(ro.completion_mask)
    ro.completion_mask[0, :1] = 1  # micro-batch 1: one token
    ro.completion_mask[1, :3] = 1  # micro-batch 2: three tokens
    ro.num_items = ro.completion_mask.sum()
    ro.sampling_logps = ro.old_logps.clone()
    ro.sampling_logps[0, 0] -= 1.0  # the trainer finds that token e times likelier
    model = load_model(fixture_path("qwen2"))
    cfg = TrainConfig(temperature=0.9, per_device_train_batch_size=1)
    loss_cfg = loss_settings(
        vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_max=3.0
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    t = trainer_for(model, optimizer, cfg, loss_cfg)
    m = conftest.optimizer_step(t, [(ro, torch.tensor([0])), (ro, torch.tensor([1]))])
    assert m["sampling/sampling_logp_difference/mean"] == pytest.approx(0.25, rel=1e-6)
    assert m["sampling/sampling_logp_difference/max"] == pytest.approx(1.0, rel=1e-6)
    e = math.exp(1.0)
    expected = (e + 1) / 2 if mode == "sequence_mask" else (e + 3) / 4  # per sequence / per token
    assert m["sampling/importance_sampling_ratio/mean"] == pytest.approx(expected, rel=1e-6)
    assert m["sampling/importance_sampling_ratio/max"] == pytest.approx(e, rel=1e-6)


# -----------------------------------------------------------------------------
# The plain path: the course functions alone train as the fast default does

EXACT = ("reward", "reward_std", "frac_reward_zero_std", "num_tokens", "learning_rate")


def test_plain_path_trains_as_the_fast_default(tmp_path):
    """plain=true (the course's draw and log-probs, no rows skipped) against nanogrpo/fast/: the
    draw is equal bit for bit on CPU, so every round samples the same tokens and rewards, lengths
    and token counts are exact; the log-probs differ by float32 rounding only (the chunked LM head,
    the shared prompt forward), so loss, gradient norm and entropy agree to 1e-5, and the weights
    after 4 steps to 1e-4 (AdamW's m / sqrt(v) turns a rounding difference in a near-zero gradient
    entry into a larger one of its step)."""
    fast = train.train(tiny(tmp_path / "fast", "--max_steps=4", "--beta=0.04"))
    plain = train.train(tiny(tmp_path / "plain", "--max_steps=4", "--beta=0.04", "--plain=true"))
    assert len(fast) == len(plain) == 4
    for f, p in zip(fast, plain):
        for key in EXACT + tuple(k for k in f if k.startswith("completions/")):
            assert f[key] == p[key], key
        for key in ("loss", "grad_norm", "entropy", "kl"):
            assert p[key] == pytest.approx(f[key], rel=1e-5, abs=1e-7), key
    a = load_model(tmp_path / "fast" / "run" / "checkpoint").state_dict()
    b = load_model(tmp_path / "plain" / "run" / "checkpoint").state_dict()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-4)


def test_plain_picks_the_course_functions_and_refuses_a_compiled_step():
    from nanogrpo import logprobs, sampler

    plain = train.kernels(load_config(["--config", "tiny.py", "--plain=true"]))
    assert plain.sample_token is sampler.sample_next_token and plain.decoder is None
    assert plain.token_logprobs is logprobs.token_logprobs
    assert plain.policy_logprobs is logprobs.policy_logprobs
    default = train.kernels(load_config(["--config", "tiny.py"]))
    assert default == train.Kernels(**fast.kernels(torch_compile=False))
    assert default.sample_token is not sampler.sample_next_token
    with pytest.raises(ConfigError, match="plain=true"):
        load_config(["--config", "tiny.py", "--plain=true", "--torch_compile=true"]).validate()


FAMILY_MODELS = {  # the family's own config.json keys, as init_model settings
    "smollm3": {"model_type": "smollm3", "no_rope_layers": [1, 0]},
    "gemma3": {
        "model_type": "gemma3_text",
        "head_dim": 16,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 3,
        "query_pre_attn_scalar": 16,
    },
    "qwen3_5": {
        "model_type": "qwen3_5_text",
        "head_dim": 16,
        "layer_types": ["linear_attention", "full_attention"],
        "partial_rotary_factor": 0.5,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4,
    },
}


@pytest.mark.parametrize("use_peft", [False, True])
@pytest.mark.parametrize("family", ["smollm3", "gemma3", "qwen3_5"])
def test_a_new_family_trains(tmp_path, family, use_peft):
    """A few GRPO steps of a SmolLM3 (a NoPE layer) and a Gemma 3 (a sliding window shorter than the
    prompts) with and without LoRA; the checkpoint keeps the family's config.json keys."""
    init = dict(read_config_file("tiny")["init_model"], **FAMILY_MODELS[family])
    lora = ["--use_peft=true", "--lora_target_modules=all-linear", "--lora_r=4"] * use_peft
    history = train.train(
        tiny(tmp_path, f"--init_model={init!r}", "--max_steps=2", "--learning_rate=1e-2", *lora)
    )
    assert [m["step"] for m in history] == [1, 2]
    assert all(math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) for m in history)
    ckpt = tmp_path / "run" / "checkpoint"
    model = load_model(ckpt)
    wanted = {k: v for k, v in FAMILY_MODELS[family].items()}
    assert {k: getattr(model.config, k) for k in wanted} == wanted
    base = load_model(tmp_path / "init")
    changed = [
        name
        for name, p in model.state_dict().items()
        if not torch.equal(p, base.state_dict().get(name, p))
    ]
    if use_peft:
        assert os.path.exists(ckpt / "adapter_config.json")
        trained = [p.abs().sum() > 0 for n, p in model.state_dict().items() if ".lora_B" in n]
        assert changed == [] and trained and all(trained)  # B starts at zero: the adapters moved
    else:
        saved = json.load(open(ckpt / "config.json"))
        assert saved["architectures"] == [
            {
                "smollm3": "SmolLM3ForCausalLM",
                "gemma3": "Gemma3ForCausalLM",
                "qwen3_5": "Qwen3_5ForCausalLM",
            }[family]
        ]
        saved = {**saved, **saved.get("rope_parameters", {})}  # (Qwen3.5's partial RoPE is there)
        assert {k: saved[k] for k in wanted} == wanted and changed


def state_reward(completions, trainer_state, log_metric, log_extra, **kwargs):
    """A TRL reward function that uses all three of TRL's keyword arguments."""
    log_metric("steps_seen", trainer_state.global_step)
    log_extra("length", [len(c) for c in completions])
    return [float(len(c) % 2) for c in completions]


def test_evaluation_passes_trls_reward_arguments_and_logs_eval_loss(tmp_path):
    """Evaluation calls reward functions as training does, with trainer_state, log_metric and
    log_extra (a function that takes them trained, then failed at its first evaluation); what
    log_metric logged there is eval/<name>; eval/loss is grpo_step's on the eval completions: with
    one completion a prompt there is no advantage, so with beta=0 it is 0 and with beta>0 it is
    the KL to the reference, which training has moved away from."""
    common = [
        "--num_generations_eval=1",
        f"--reward_funcs={__name__}:state_reward",
        "--max_steps=2",
        "--eval_strategy=steps",
        "--eval_steps=2",
        "--eval_size=4",
        "--learning_rate=1e-2",
    ]
    history = train.train(tiny(tmp_path / "a", *common))
    assert history[-1]["eval/steps_seen"] == 2
    assert history[-1]["eval/loss"] == 0.0
    history = train.train(tiny(tmp_path / "b", *common, "--beta=0.5"))
    assert history[-1]["eval/loss"] > 0
    history = train.train(tiny(tmp_path / "c", *common, "--num_generations_eval=4"))
    assert math.isfinite(history[-1]["eval/loss"])
    none = "--num_generations_eval=None"  # num_generations, as TRL (tiny.py sets 1)
    history = train.train(tiny(tmp_path / "d", *common[1:], none))
    assert history[-1]["eval/loss"] != 0.0


def test_an_epochs_short_last_step_trains_what_the_epoch_has_left(tmp_path, monkeypatch):
    """num_train_epochs over 8 prompts, a round of 1 prompt feeding 2 micro-batches and a step
    taking 3: transformers' loop runs an epoch as 5 steps of 3 micro-batches and one of 1, TRL's 6
    steps and 16 micro-batches an epoch (the loop took 3 a step across epochs: 15 steps, 45 in 3
    epochs)."""
    rows = [{"prompt": "abc" + "abcdefgh"[i] + "=", "target": "abc"} for i in range(8)]
    with open(tmp_path / "data.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    sizes = []
    step = train.optimizer_step
    monkeypatch.setattr(
        train, "optimizer_step", lambda t, micro: sizes.append(len(micro)) or step(t, micro)
    )
    cfg = tiny(
        tmp_path,
        f"--dataset={tmp_path}/data.jsonl",
        "--max_steps=-1",
        "--num_train_epochs=1",
        "--per_device_train_batch_size=4",
        "--gradient_accumulation_steps=3",
        "--steps_per_generation=2",
        "--num_generations=8",
        "--max_completion_length=2",
    )
    history = train.train(cfg)
    assert sizes == [3, 3, 3, 3, 3, 1]
    assert [m["step"] for m in history] == [1, 2, 3, 4, 5, 6]
    assert cfg.max_steps == -1  # validated, never changed: the trainer's copy holds the count


def test_eval_on_start_evaluates_before_the_first_step(tmp_path):
    """eval_on_start (transformers' sanity check): an evaluation before step 1, its own record
    at step 0 in metrics.jsonl, and none at the end when eval_strategy is "no"."""
    cfg = tiny(
        tmp_path,
        "--max_steps=1",
        "--eval_on_start=true",
        "--eval_dataset=default",
        "--eval_size=4",
    )
    history = train.train(cfg)
    assert history[0]["step"] == 0 and "eval/reward" in history[0] and "loss" not in history[0]
    assert history[1]["step"] == 1 and "eval/reward" not in history[1]
    lines = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [m["step"] for m in lines] == [0, 1]


def test_the_reward_plot_skips_records_without_a_training_reward(tmp_path):
    """With matplotlib installed, a run's reward.png is drawn from metrics.jsonl, whose
    eval_on_start record (step 0) has eval metrics and no training reward."""
    pytest.importorskip("matplotlib")
    cfg = tiny(tmp_path)
    os.makedirs(cfg.output_dir)
    with open(os.path.join(cfg.output_dir, "metrics.jsonl"), "w") as f:
        for row in ({"step": 0, "eval/reward": 0.1}, {"step": 1, "reward": 0.2}):
            f.write(json.dumps(row) + "\n")
    assert report.plot_rewards(cfg) == os.path.join(cfg.output_dir, "reward.png")
    assert os.path.getsize(os.path.join(cfg.output_dir, "reward.png")) > 0


def test_a_small_model_trains_on_one_thread_and_the_count_is_said(tmp_path, capsys, monkeypatch):
    """The embedded default's ops take microseconds: it trains on one CPU thread (two runs at once
    on 2 cores stalled each other 6x), said on the run's first line; torch_num_threads and
    OMP_NUM_THREADS choose otherwise; torch's count is the caller's again after the run."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    seen = []
    step = train.optimizer_step
    monkeypatch.setattr(
        train,
        "optimizer_step",
        lambda t, micro: seen.append(torch.get_num_threads()) or step(t, micro),
    )
    train.train(tiny(tmp_path / "a", "--max_steps=1"))
    assert seen == [1] and torch.get_num_threads() == before
    assert "1 process(es) on cpu, 1 thread each (torch_num_threads)" in capsys.readouterr().out
    train.train(tiny(tmp_path / "b", "--max_steps=1", "--torch_num_threads=3"))
    assert seen == [1, 3] and torch.get_num_threads() == before
    assert "on cpu, 3 threads each" in capsys.readouterr().out
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    train.train(tiny(tmp_path / "c", "--max_steps=1"))
    assert seen == [1, 3, before] and torch.get_num_threads() == before
