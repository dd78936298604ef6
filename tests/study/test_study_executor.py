"""The study's executor: a killed worker's run is rerun once (then exit 1 in one line naming the
run and its stage), a killed main process leaves nothing running, one study at a time per --out,
and the same runs as SLURM jobs through submitit's local executor. Never a hang: each test that
waits on processes has a deadline."""

from __future__ import annotations

import faulthandler
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from poslens.cli import main
from poslens.errors import ConfigError
from poslens.study import run_study
from poslens.study.executor import LocalPool, Rerun, Task
from tests.study.test_study import TINY_STUDY

ROOT = Path(__file__).resolve().parents[2]
CFG = replace(
    TINY_STUDY,
    models=("rope_axial",),
    seeds=2,
    experiments=("depth_profile", "position_removal"),
    train_set=(*TINY_STUDY.train_set, "train.steps=120", "train.eval_every=60"),
)
# `poslens study` on CFG (the CLI with its preset replaced), in a subprocess that a test can kill
STUDY = (
    "import sys, poslens.study as s; from tests.study.test_study_executor import CFG; "
    "s.preset = lambda *a, **k: CFG; from poslens.cli import main; sys.exit(main(sys.argv[1:]))"
)
on_linux = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")


@pytest.fixture(autouse=True)
def deadline() -> Iterator[None]:
    """A hang fails the test run (with every thread's traceback) instead of blocking it."""
    faulthandler.dump_traceback_later(300, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def _strip(results: dict[str, Any]) -> dict[str, Any]:
    """results.json without timings, creation time and the environment (jobs, executor)."""
    return {k: v for k, v in results.items() if k not in ("created", "timings", "environment")}


# ---- the executor on its own ----------------------------------------------------------------


def _task(action: str, marker: str, events: Any) -> str:
    """A task that reports an event, then dies (always, or only the first time), fails, sleeps
    or finishes."""
    events.put("during step one")
    if action == "die" or (action == "die_once" and not Path(marker).exists()):
        Path(marker).touch()
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "fail":
        raise ConfigError("a bad value found by a worker")
    if action == "sleep":
        time.sleep(120)
    return f"{action} done"


def _collect() -> tuple[list[tuple[str, Any]], Callable[[str, Any], None]]:
    seen: list[tuple[str, Any]] = []
    return seen, lambda key, ev: seen.append((key, ev))


def test_a_killed_worker_loses_only_its_task_which_runs_again(tmp_path: Path) -> None:
    seen, on_event = _collect()
    tasks = [
        Task("a", _task, ("die_once", str(tmp_path / "a"))),
        Task("b", _task, ("ok", str(tmp_path / "b"))),
    ]
    assert LocalPool(2).run(tasks, on_event) == {"a": "die_once done", "b": "ok done"}
    reruns = [(k, ev.why) for k, ev in seen if isinstance(ev, Rerun)]
    assert reruns == [("a", "its worker process was killed by SIGKILL (as the out-of-memory "
                             "killer does) during step one")]  # fmt: skip
    assert [k for k, ev in seen if ev == "during step one"] in (["a", "b", "a"], ["b", "a", "a"])
    assert not multiprocessing.active_children()


def _draw(events: Any) -> tuple[int, float]:
    import torch

    return os.getpid(), float(torch.rand(()))


def test_a_worker_runs_task_after_task_each_from_a_fresh_seed() -> None:
    """A worker is kept for the next task (its imports paid once), and every task draws what a
    fresh process would: torch's global generator is reset between tasks; none is left running."""
    tasks = [Task(str(i), _draw) for i in range(3)]
    got = LocalPool(1).run(tasks, lambda key, ev: None)
    assert len({pid for pid, _ in got.values()}) == 1 and got["0"][0] != os.getpid()
    assert len({x for _, x in got.values()}) == 1
    assert not multiprocessing.active_children()


def test_a_task_error_reaches_the_caller_and_stops_the_other_workers(tmp_path: Path) -> None:
    start = time.monotonic()
    tasks = [Task("s", _task, ("sleep", "")), Task("f", _task, ("fail", ""))]
    with pytest.raises(ConfigError, match="a bad value found by a worker") as e:
        LocalPool(2).run(tasks, lambda key, ev: None)
    assert "Traceback" in str(e.value.__cause__)  # the worker's traceback, kept as the cause
    assert not multiprocessing.active_children()  # the sleeping worker was stopped
    assert time.monotonic() - start < 60


# ---- the study, killed ---------------------------------------------------------------------


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process, None if it does not exist."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1])


def _children(pid: int) -> dict[int, str]:
    """The live (not zombie) children of `pid`, with their command lines."""
    out = {}
    for d in Path("/proc").iterdir():
        stat = _proc_stat(int(d.name)) if d.name.isdigit() else None
        if stat is not None and stat[1] == pid and stat[0] != "Z":
            try:
                out[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
    return out


def _workers(pid: int) -> set[int]:
    return {p for p, cmd in _children(pid).items() if "spawn_main" in cmd}


def _alive(pid: int) -> bool:
    stat = _proc_stat(pid)
    return stat is not None and stat[0] != "Z"


def _files(out: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in out.rglob("*") if p.is_file()}


def _start(out: Path) -> subprocess.Popen[bytes]:
    argv = ["study", "--out", str(out), "--jobs", "2", "--threads", "1", "--no-progress"]
    return subprocess.Popen(
        [sys.executable, "-c", STUDY, *argv], cwd=ROOT, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip


def _wait_for(proc: subprocess.Popen[bytes], ready: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 120
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            err = proc.communicate()[1].decode()
            pytest.fail(f"the study ended or stalled before {what}: {err[-800:]}")
        time.sleep(0.005)


def _both_training(out: Path) -> bool:
    """Both runs (seeds) have saved a training state: both workers are in their train stage."""
    return len(list(out.glob("checkpoints/*/train_state.safetensors"))) == 2


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """CFG run uninterrupted, in one process."""
    return run_study(CFG, tmp_path_factory.mktemp("ref"), progress=False, threads=1)


@on_linux
def test_killed_main_leaves_nothing_running_and_the_rerun_completes(
    reference: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "study"
    proc = _start(out)
    _wait_for(proc, lambda: _both_training(out), "both runs trained")
    # meanwhile a second study on the same folder is refused, in one line
    assert main(["study", "--preset", "quick", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"poslens: error: --out {out} is in use by another poslens study (pid "
                   f"{proc.pid}); wait for it to end or choose another --out"]  # fmt: skip

    family = set(_children(proc.pid))  # the workers, and multiprocessing's resource tracker
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in family) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in family if _alive(p)], "processes of the killed study still run"
    files = _files(out)
    time.sleep(1.5)
    assert _files(out) == files, "files still appear in --out after the study was killed"
    assert not (out / "results.json").exists()

    res = run_study(CFG, out, progress=False, threads=1)  # the stale lock does not block
    assert _strip(res) == _strip(reference)


@on_linux
def test_a_killed_worker_is_rerun_and_the_study_ends_with_the_same_results(
    reference: dict[str, Any], tmp_path: Path
) -> None:

    out = tmp_path / "study"
    proc = _start(out)
    _wait_for(proc, lambda: _both_training(out), "both runs trained")
    os.kill(min(_workers(proc.pid)), signal.SIGKILL)
    _, err = proc.communicate(timeout=240)
    lines = err.decode().strip().splitlines()
    assert proc.returncode == 0, lines
    assert len(lines) == 1, lines
    assert re.fullmatch(
        r"poslens: rope_axial seeds? [0-9-]+: its worker process was killed by SIGKILL \(as the "
        r"out-of-memory killer does\) during stage \w+; running it again \(finished stages are "
        r"kept\)",
        lines[0],
    ), lines[0]
    assert _strip(json.loads((out / "results.json").read_text())) == _strip(reference)


@on_linux
def test_a_worker_killed_twice_ends_the_study_with_exit_1_in_one_line(tmp_path: Path) -> None:
    out = tmp_path / "study"
    proc = _start(out)
    _wait_for(proc, lambda: _both_training(out), "both runs trained")
    first = _workers(proc.pid)
    os.kill(min(first), signal.SIGKILL)
    _wait_for(proc, lambda: bool(_workers(proc.pid) - first), "the rerun started")
    second = _workers(proc.pid) - first
    os.kill(max(second), signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert not [p for p in first | second if _alive(p)]  # the other run's worker was stopped
    lines = err.decode().strip().splitlines()
    assert proc.returncode == 1, lines
    assert "Traceback" not in err.decode() and "EOFError" not in err.decode()
    assert [line for line in lines if line.startswith("poslens: error:")] == [lines[-1]]
    assert re.fullmatch(
        r"poslens: error: rope_axial seeds? [0-9-]+: its worker process was killed by SIGKILL \(as the "
        r"out-of-memory killer does\) during stage \w+, and again when rerun; finished stages "
        r"are kept; rerun the same command to continue",
        lines[-1],
    ), lines[-1]
    assert not (out / "results.json").exists()


# ---- SLURM jobs through submitit's local executor -------------------------------------------


def test_slurm_executor_runs_the_study_through_submitit(
    reference: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if os.environ.get("POSLENS_FULL") != "1":  # CI installs the [slurm] extra: there it must run
        pytest.importorskip("submitit")

    import poslens.study

    monkeypatch.setenv("POSLENS_SUBMITIT_CLUSTER", "local")  # submitit runs the jobs locally
    monkeypatch.setattr(poslens.study, "preset", lambda *a, **k: CFG)
    out = tmp_path / "study"
    argv = ["study", "--out", str(out), "--no-progress", "--executor", "slurm",
            "--slurm-partition", "gpu", "--slurm-time", "30", "--slurm-cpus-per-task", "1",
            "--slurm-option", "account=poslens"]  # fmt: skip
    assert main(argv) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["environment"]["executor"] == "slurm" and res["environment"]["jobs"] == 2
    assert _strip(res) == _strip(reference)
    # one job per trained model: its seeds trained as one ensemble, then their experiments
    assert len(list((out / "slurm").glob("*_0_result.pkl"))) == 1
