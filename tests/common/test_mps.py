"""common/mps.py with a stand-in control program on PATH (the CPU machine has no driver): the
daemon is started with its own directories, told to quit at the end, and the environment given
back; a missing program or a failed start is an error."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from common.mps import CONTROL, MpsDaemon, MpsUnavailable, mps_daemon


def fake_control(tmp_path: Path, monkeypatch, start_rc: int = 0) -> Path:
    """Put a stand-in ``nvidia-cuda-mps-control`` first on PATH; returns the file where it
    writes one line per call: its arguments, its pipe directory and what it read on stdin."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    script = bin_dir / CONTROL
    script.write_text(
        "#!/bin/sh\n"
        f'echo "args=$* pipe=$CUDA_MPS_PIPE_DIRECTORY stdin=$(cat)" >> {log}\n'
        f'[ "$1" = -d ] && exit {start_rc}\n'
        "exit 0\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    return log


def test_the_daemon_runs_with_its_own_directories_and_quits_at_the_end(tmp_path, monkeypatch):
    log = fake_control(tmp_path, monkeypatch)
    work = tmp_path / "work"
    with mps_daemon(work):
        assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == str(work / "mps-pipe")
        assert (work / "mps-log").is_dir()
        assert log.read_text().splitlines() == [f"args=-d pipe={work / 'mps-pipe'} stdin="]
    assert log.read_text().splitlines()[1] == f"args= pipe={work / 'mps-pipe'} stdin=quit"
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ


def test_a_daemon_that_does_not_start_is_an_error(tmp_path, monkeypatch):
    log = fake_control(tmp_path, monkeypatch, start_rc=3)
    with pytest.raises(MpsUnavailable, match="-d failed"):
        with mps_daemon(tmp_path / "work"):
            pass
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
    assert len(log.read_text().splitlines()) == 1  # nothing to quit


def test_no_control_program_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(MpsUnavailable, match="not on PATH"):
        MpsDaemon(tmp_path / "work").start()


def test_stop_without_start_does_nothing(tmp_path, monkeypatch):
    log = fake_control(tmp_path, monkeypatch)
    MpsDaemon(tmp_path / "work").stop()
    assert not log.exists()
