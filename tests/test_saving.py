"""run/saving.py and run/checkpoints.py when a save fails: one line that names the checkpoint and
the cause, the previous checkpoint intact (checked, and resumed), the command that continues."""

import errno
import os
import resource
import shlex
import signal

import safetensors.torch
from test_resume import tiny, tiny_args, train_py

import train
from nanogrpo import run
from nanogrpo.run import checkpoints

SAVES = ["--max_steps=2", "--save_steps=1"]


def assert_kept_the_first_checkpoint(tmp_path, err: str, cause: str):
    """The one error line (and main's hint), the previous checkpoint whole and linked, nothing
    of the failed save left; then the command the line gives resumes it."""
    out_dir = tmp_path / "run"
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[1] == "(the traceback: add --debug)", err
    failed = f"train.py: error: could not save {out_dir}/checkpoint-2 ({cause}): "
    kept = f"the previous checkpoint, {out_dir}/checkpoint-1, is intact; once that is fixed, "
    command = ["train.py", *tiny_args(tmp_path, *SAVES), "--resume_from_checkpoint=true"]
    assert lines[0] == failed + kept + f"continue with: python {shlex.join(command)}"
    saved = sorted(p for p in os.listdir(out_dir) if p.startswith("checkpoint"))
    assert saved == ["checkpoint", "checkpoint-1"]
    assert os.path.realpath(out_dir / "checkpoint") == str(out_dir / "checkpoint-1")
    assert checkpoints.unresumable(out_dir / "checkpoint-1") is None
    history = train.train(tiny(tmp_path, *SAVES, "--resume_from_checkpoint=true"))
    assert [m["step"] for m in history] == [1, 2]
    assert checkpoints.unresumable(out_dir / "checkpoint-2") is None


def test_a_full_disk_at_a_save_ends_in_one_line(tmp_path, monkeypatch, capsys):
    """A save that hit a full disk printed "could not save after the error" (the save was tried
    again) above main's line."""
    real = safetensors.torch.save_file

    def full_at_step_2(tensors, filename, metadata=None):
        if "checkpoint-2" in str(filename):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", full_at_step_2)
    assert run.main(tiny_args(tmp_path, *SAVES), train.train) == 2
    out, err = capsys.readouterr()
    assert "could not save after the error" not in out + err
    monkeypatch.undo()
    assert_kept_the_first_checkpoint(tmp_path, err, "No space left on device")


def file_limit(size: int):
    """For a child process: files end at `size` bytes (a write past it fails with EFBIG, and
    SIGXFSZ does not kill it), as a full disk ends a write."""

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))

    return limit


def test_a_write_that_safetensors_cannot_finish_ends_in_one_line(tmp_path):
    """safetensors' own error for a failed write (SafetensorError, not an OSError) ended train.py
    in a traceback. Here a real write fails: the resumed run's files may not pass 100 kB, and the
    tiny model's model.safetensors is larger."""
    first = train.train(tiny(tmp_path, "--max_steps=1", "--save_steps=1"))
    assert [m["step"] for m in first] == [1]
    args = tiny_args(tmp_path, *SAVES)
    proc = train_py(*args, "--resume_from_checkpoint=true", preexec_fn=file_limit(100_000))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, out + err
    assert "Traceback" not in err and "could not save after the error" not in out
    assert_kept_the_first_checkpoint(tmp_path, err, "File too large (os error 27)")
