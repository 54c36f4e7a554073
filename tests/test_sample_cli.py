"""sample.py's command line: a train.py output_dir as --model, and one-line errors."""

import os
import subprocess
import sys

import pytest
from conftest import ROOT
from test_train import tiny

import sample
import train


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    """The tiny default trained for 2 steps: out_dir/checkpoint -> checkpoint-2."""
    tmp = tmp_path_factory.mktemp("sample")
    train.train(tiny(tmp, "--max_steps=2"))
    return tmp / "run"


def sample_args(model, *more):
    return [
        "--model",
        str(model),
        "--prompt",
        "abcd=",
        "--num_samples",
        "2",
        "--max_new_tokens",
        "6",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        *more,
    ]


def test_sampling_from_an_output_dir(out_dir, capsys):
    capsys.readouterr()
    args = sample_args(out_dir, "--reward", "default_task", "--column", "target=abcd")
    assert sample.cli(args) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"model: {out_dir / 'checkpoint'}\n")  # its newest checkpoint
    assert "prompt (5 tokens): 'abcd='" in out and out.count("default_task=") == 2


def test_the_newest_checkpoint_of_an_output_dir(tmp_path):
    for name in ("checkpoint-2", "checkpoint-10", "checkpoint-11.tmp", "runs"):
        os.makedirs(tmp_path / name)
    assert sample.newest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-10")
    os.symlink("checkpoint-2", tmp_path / "checkpoint")  # train.py's link wins: it is complete
    assert sample.newest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint")
    (tmp_path / "checkpoint-2" / "config.json").write_text("{}")
    step_dir = str(tmp_path / "checkpoint-2")
    assert sample.newest_checkpoint(step_dir) == step_dir  # a checkpoint itself
    assert sample.newest_checkpoint("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"  # a hub id
    with pytest.raises(FileNotFoundError, match="neither a checkpoint .* nor a train.py"):
        sample.newest_checkpoint(str(tmp_path / "runs"))


def test_a_bad_model_path_is_one_line(tmp_path):
    done = subprocess.run(
        [sys.executable, "sample.py", "--model", str(tmp_path / "missing"), "--prompt", "abcd="],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.splitlines() == [
        f"sample.py: error: no such directory: '{tmp_path / 'missing'}' (and it is not a hub id "
        "like 'Qwen/Qwen2.5-0.5B')",
        "(the traceback: add --debug)",
    ]


@pytest.mark.parametrize(
    "args,said",
    [
        (
            ["--reward", "default_task"],  # no --column target=...: the function raises
            "reward function 'default_task' raised TypeError: ",
        ),
        (["--reward", "defualt_task"], "unknown reward function 'defualt_task' (did you mean"),
        (["--prompt", "abcd=" * 13], "the prompt (65 tokens) fills the model's whole context"),
    ],
)
def test_reward_and_prompt_errors_are_one_line(out_dir, capsys, args, said):
    capsys.readouterr()
    assert sample.cli(sample_args(out_dir, *args)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"sample.py: error: {said}") and len(err.splitlines()) == 2
