"""The status line of long work: drawn on a terminal only (rank 0), throttled, fed by generate."""

import io
import os
import pty
import subprocess
import sys
import time
from types import SimpleNamespace

import torch
from conftest import ROOT, tiny_config
from test_train import INIT, tiny

import train
from nanogrpo import sampler
from nanogrpo.model import Transformer
from nanogrpo.run import report


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def slow_decoding(monkeypatch, seconds=0.05):
    """Every decode step sleeps: a round of the tiny run takes longer than the interval."""
    step = sampler.Decoder.step

    def slow(self, *args, **kwargs):
        time.sleep(seconds)
        return step(self, *args, **kwargs)

    monkeypatch.setattr(sampler.Decoder, "step", slow)


def test_generate_reports_every_decode_step(monkeypatch):
    model = Transformer(tiny_config()).eval()
    calls = []
    prompts = [[1, 2, 3], [4, 5]]
    settings = sampler.Sampling(max_new_tokens=7)
    monkeypatch.setattr(sampler, "on_decode_step", lambda *args: calls.append(args))
    out = sampler.generate(model, prompts, settings, num_samples=2, seeds=[1, 2])
    assert calls == [(t, 7, 4) for t in range(1, 8)] and out.completion_ids.shape == (4, 7)
    monkeypatch.setattr(sampler, "on_decode_step", None)
    quiet = sampler.generate(model, prompts, settings, num_samples=2, seeds=[1, 2])
    assert torch.equal(quiet.completion_ids, out.completion_ids)  # a callback changes no sample


def test_the_status_line_is_throttled(monkeypatch):
    screen = FakeTerminal()
    monkeypatch.setattr(sys, "stdout", screen)
    clock = [100.0]
    monkeypatch.setattr(report, "time", SimpleNamespace(time=lambda: clock[0]))
    progress = report.Progress(lambda: "step 1/9 | ")
    for done in range(1, 1026):  # 1025 decode steps of 1/512 s: two seconds, two draws
        progress(done, 2048, 8)
        clock[0] += 1 / 512
    assert screen.getvalue() == (
        "\rstep 1/9 | sampling 513/2048 tokens, 4096 tok/s\033[K\r"
        "\rstep 1/9 | sampling 1025/2048 tokens, 4096 tok/s\033[K\r"
    )
    progress.clear()
    assert screen.getvalue().endswith("\r\033[K") and not progress.shown
    run = SimpleNamespace(cfg=SimpleNamespace(max_steps=9), started=(clock[0] - 2.0, 0))
    m = {"step": 2, "tokens_per_sec": 512.3, "step_time": 2.0}
    progress.draw_step(m, run)  # throttled: drawn a moment ago
    assert "s/step" not in screen.getvalue()
    clock[0] += 2.0
    progress.draw_step(m, run)  # a step whose line logging_steps skips: where the run is
    assert screen.getvalue().endswith("\rstep 2/9 | eta 0.2 min | 512 tok/s | 2.00 s/step\033[K\r")


def test_a_terminal_shows_progress_during_rounds(tmp_path, monkeypatch):
    monkeypatch.setattr(sampler, "on_decode_step", None)  # put back after the test, whatever it did
    monkeypatch.setattr(report, "PROGRESS_INTERVAL", 0.1)
    slow_decoding(monkeypatch)
    screen = FakeTerminal()
    monkeypatch.setattr(sys, "stdout", screen)
    train.train(tiny(tmp_path, "--logging_steps=10", "--max_steps=2"))
    out = screen.getvalue()
    assert "\rstep 1/2 | sampling " in out and " tok/s\033[K\r" in out  # during the first round
    assert "\rstep 2/2 | eta " in out  # after a step, the ETA
    assert "step    2/2 | reward" in out  # the step lines as ever, on a line of their own
    assert out[out.index("step    2/2 | reward") - 4 :].startswith("\r\033[K")
    assert sampler.on_decode_step is None  # the run is over: the sampler is quiet again


def test_a_log_that_is_not_a_terminal_gets_no_progress(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(report, "PROGRESS_INTERVAL", 0.1)
    slow_decoding(monkeypatch)
    train.train(tiny(tmp_path, "--logging_steps=10", "--max_steps=2"))
    out = capsys.readouterr().out
    assert "step    2/2 | reward" in out
    assert "\r" not in out and "\033[K" not in out and "tok/s" not in out


def test_train_py_on_a_pseudo_terminal(tmp_path):
    """The real thing: train.py's stdout a pty, its rounds slowed past a 0.1 s interval."""
    script = (
        "import sys, time; from nanogrpo import sampler; from nanogrpo.run import report; import train\n"
        "report.PROGRESS_INTERVAL = 0.1\n"
        "step = sampler.Decoder.step\n"
        "sampler.Decoder.step = lambda *a: (time.sleep(0.03), step(*a))[1]\n"
        "sys.exit(train.run.main(sys.argv[1:], train.train))\n"
    )
    args = [
        "--config",
        "tiny.py",
        f"--model={tmp_path}/init",
        INIT,
        f"--output_dir={tmp_path}/run",
        "--max_steps=2",
        "--eval_strategy=no",
        "--per_device_train_batch_size=16",
        "--num_generations=4",
    ]
    master, slave = pty.openpty()
    child = subprocess.Popen(
        [sys.executable, "-c", script, *args], stdout=slave, stderr=slave, cwd=ROOT
    )
    os.close(slave)  # the child holds it: reading ends when the child is gone
    out = b""
    while True:  # read as it comes: a full pty would block the child
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    text = out.decode()
    assert child.wait(timeout=300) == 0, text
    assert "\rstep 1/2 | sampling " in text and "tok/s" in text and "step    2/2 | reward" in text
