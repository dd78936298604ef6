"""Training killed with SIGKILL at several points, then resumed, ends with exactly the weights of
an uninterrupted run; whatever the kill left behind is a valid checkpoint or a hidden temp file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from poslens.io import check_safetensors, load_tensors, read_metadata
from tests.training.cli_args import tiny_train_args

ARGS = tiny_train_args(steps=120, eval_every=60)


def _train(out: Path, *extra: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "poslens", "train", *ARGS, "--out", str(out), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _step(out: Path) -> int:
    try:
        return int(read_metadata(out / "train_state.safetensors")["step"])
    except Exception:  # not written yet, or being replaced this instant
        return -1


def _kill_after(out: Path, step: int) -> int:
    """Start a run, SIGKILL it once a checkpoint at >= `step` exists; the step it had saved."""
    proc = _train(out)
    deadline = time.monotonic() + 120
    while _step(out) < step:
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"training ended or stalled before step {step}")
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return _step(out)


@pytest.mark.parametrize("kill_at", [4, 36, 92])
def test_sigkill_then_resume_gives_the_uninterrupted_weights(tmp_path: Path, kill_at: int) -> None:
    ref = tmp_path / "ref"
    assert _train(ref).wait() == 0
    out = tmp_path / "killed"
    saved = _kill_after(out, kill_at)
    assert saved >= kill_at and not (out / "metrics.json").exists()
    # everything visible is whole: the checkpoint loads, the config parses
    for name in ("model.safetensors", "train_state.safetensors"):
        check_safetensors(out / name)
        load_tensors(out / name)
    json.loads((out / "config.json").read_text())
    resumed = _train(out, "--resume")
    assert resumed.wait() == 0, resumed.stderr.read() if resumed.stderr else ""
    a, b = load_tensors(ref / "model.safetensors"), load_tensors(out / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((out / "metrics.json").read_text())["resumed_from"] >= kill_at
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]


def test_resume_removes_the_temp_file_of_a_killed_write(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _kill_after(out, 8)
    stale = out / ".model.safetensors.abc123.tmp"
    stale.write_bytes(b"half a file")
    assert _train(out, "--resume").wait() == 0
    assert not stale.exists() and (out / "metrics.json").is_file()
