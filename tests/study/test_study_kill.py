"""A study SIGKILLed in its training stage or between experiment stages continues when rerun and
ends with exactly the results of an uninterrupted study (timings aside)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from poslens.io import read_metadata
from poslens.study import run_study
from tests.study.test_study import TINY_STUDY

CFG = replace(
    TINY_STUDY,
    models=("rope_axial",),
    seeds=1,
    experiments=("depth_profile", "position_removal", "axis_map"),
    train_set=(*TINY_STUDY.train_set, "train.steps=90", "train.eval_every=45"),
)
RUN = "from tests.study.test_study_kill import CFG; from poslens.study import run_study; " \
      "import sys; run_study(CFG, sys.argv[1], progress=False, jobs=1, threads=1)"  # fmt: skip


def _strip(results: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in results.items() if k not in ("created", "timings")}


def _train_step(out: Path) -> int:
    try:
        (state,) = out.glob("checkpoints/*/train_state.safetensors")
        return int(read_metadata(state)["step"])
    except Exception:  # not written yet, or being replaced this instant
        return -1


def _kill_when(out: Path, ready: Any) -> None:
    """Start the study in a subprocess and SIGKILL it as soon as `ready(out)` holds."""
    proc = subprocess.Popen(
        [sys.executable, "-c", RUN, str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 180
    while not ready(out):
        if proc.poll() is not None or time.monotonic() > deadline:
            err = proc.stderr.read().decode() if proc.stderr else ""
            pytest.fail(f"the study ended or stalled before the kill point: {err[-500:]}")
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_study(CFG, tmp_path_factory.mktemp("ref"), progress=False, jobs=1, threads=1)


def _marker(out: Path, exp: str) -> Path:
    return out / "runs" / "rope_axial" / "seed0" / f"{exp}.stage.json"


@pytest.mark.parametrize("where", ["training", "experiments"])
def test_killed_study_continues_to_the_uninterrupted_results(
    reference: dict[str, Any], tmp_path: Path, where: str
) -> None:
    out = tmp_path / "study"
    if where == "training":
        _kill_when(out, lambda o: _train_step(o) >= 30)
        assert not list(out.glob("checkpoints/*/metrics.json"))  # killed mid-training
    else:
        _kill_when(out, lambda o: _marker(o, "depth_profile").is_file())
        assert not _marker(out, "axis_map").exists()  # killed before the last stage
    assert not (out / "results.json").exists()
    res = run_study(CFG, out, progress=False, jobs=1, threads=1)
    reused = {s["stage"]: s["reused"] for s in res["timings"]["stages"]}
    assert reused["depth_profile"] is (where == "experiments")
    assert reused["axis_map"] is False
    assert _strip(res) == _strip(reference)
    assert not list(out.rglob("*.tmp"))
