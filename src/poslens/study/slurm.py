"""Tasks as SLURM jobs through submitit (the optional [slurm] extra): `--executor slurm`.

Each task is one job. Its events go to a file in the shared output folder, which this process
reads; its result comes back through submitit. A job that ends without a result (out of memory,
cancelled, a failed node) is submitted once more; one that reaches its time limit or is preempted
is requeued by submitit (3 times at most) and continues from what it saved. With
POSLENS_SUBMITIT_CLUSTER=local submitit runs the same jobs as local processes (the tests, CI).
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import time
import traceback
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from poslens.errors import ConfigError
from poslens.study.executor import Message, OnEvent, Task, portable, schedule


@dataclass(frozen=True)
class SlurmOptions:
    """What each job asks SLURM for (`--slurm-*` options)."""

    partition: str | None = None  # None: the cluster's default partition
    time_min: int = 720
    gpus_per_task: int = 0
    cpus_per_task: int = 4
    mem_gb: float | None = None  # None: the partition's default
    options: tuple[str, ...] = ()  # more sbatch options as KEY=VALUE: account=A, qos=Q, ...

    def check(self, device: str) -> None:
        """One-line ConfigErrors before any job is submitted."""
        for flag, value, low in (("--slurm-time", self.time_min, 1),
                                 ("--slurm-cpus-per-task", self.cpus_per_task, 1),
                                 ("--slurm-gpus-per-task", self.gpus_per_task, 0)):  # fmt: skip
            if value < low:
                raise ConfigError(f"{flag} must be at least {low}, got {value}")
        if self.mem_gb is not None and not self.mem_gb > 0:
            raise ConfigError(f"--slurm-mem-gb must be positive, got {self.mem_gb}")
        for opt in self.options:
            if not re.fullmatch(r"[a-z][a-z0-9_-]*=\S.*", opt):
                raise ConfigError(f"--slurm-option {opt!r}: expected KEY=VALUE, e.g. account=abc")
        gpu = device.startswith("cuda")
        if gpu and not self.gpus_per_task:
            raise ConfigError(f"--device {device} needs GPUs in each job: --slurm-gpus-per-task 1")
        if self.gpus_per_task and device == "cpu":
            raise ConfigError("--slurm-gpus-per-task asks for GPUs: run on them with --device cuda")


def cluster() -> str:
    """submitit's cluster: "slurm", or "local" (jobs as local processes) from the environment."""
    return os.environ.get("POSLENS_SUBMITIT_CLUSTER", "slurm")


class _FileEvents:
    """A job's events, appended to a file as length-prefixed pickles (one write each)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def put(self, event: Any) -> None:
        data = pickle.dumps(event)
        with open(self.path, "ab") as f:
            f.write(len(data).to_bytes(8, "little") + data)


@dataclass
class _EventReader:
    path: Path
    offset: int = 0

    def read(self) -> list[Any]:
        """The events written since the last read (a record still being written waits)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        events, pos = [], 0
        while pos + 8 <= len(data):
            size = int.from_bytes(data[pos : pos + 8], "little")
            if pos + 8 + size > len(data):
                break
            events.append(pickle.loads(data[pos + 8 : pos + 8 + size]))
            pos += 8 + size
        self.offset += pos
        return events


class _Job:
    """What each SLURM job runs: the task, its result or exception returned as a Message."""

    def __call__(self, task: Task, events: str) -> Message:
        try:
            return ("done", task.fn(*task.args, _FileEvents(Path(events))))
        except Exception as e:
            return ("failed", portable(e), traceback.format_exc())

    def checkpoint(self, task: Task, events: str) -> Any:
        """Called by submitit at the time limit or on preemption: requeue the same task."""
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self, task, events)


@dataclass
class _Submitted:
    job: Any  # submitit.Job
    events: _EventReader


def _submitit() -> Any:
    """The submitit module, on a machine that can submit jobs; else a one-line ConfigError."""
    try:
        import submitit
    except ImportError:
        raise ConfigError("--executor slurm needs submitit: pip install 'poslens[slurm]'") from None
    if cluster() == "slurm" and shutil.which("sbatch") is None:
        raise ConfigError("--executor slurm: no sbatch here; run it on a SLURM login node")
    return submitit


class SubmititJobs:
    """The executor backend: one submitit job per task, polled every `poll_s` seconds."""

    def __init__(self, opts: SlurmOptions, folder: Path, poll_s: float = 1.0) -> None:
        self.submitit, self.opts, self.folder, self.poll_s = _submitit(), opts, folder, poll_s
        self.executor: Any = None  # made at the first job: it creates its folder

    def _executor(self) -> Any:
        if self.executor is None:
            o = self.opts
            self.executor = self.submitit.AutoExecutor(folder=self.folder, cluster=cluster())
            self.executor.update_parameters(
                timeout_min=o.time_min,
                nodes=1,
                tasks_per_node=1,
                cpus_per_task=o.cpus_per_task,
                gpus_per_node=o.gpus_per_task,
                mem_gb=o.mem_gb,
                slurm_partition=o.partition,
                slurm_additional_parameters=dict(opt.split("=", 1) for opt in o.options),
            )
        return self.executor

    def start(self, task: Task) -> _Submitted:
        name = re.sub(r"[^\w.-]+", "_", task.key)
        events = self.folder / "events" / f"{name}.{uuid.uuid4().hex[:8]}.pkl"
        events.parent.mkdir(parents=True, exist_ok=True)
        ex = self._executor()
        ex.update_parameters(name=f"poslens-{name}")
        return _Submitted(ex.submit(_Job(), task, str(events)), _EventReader(events))

    def wait(self, running: dict[str, _Submitted]) -> list[tuple[str, Message]]:
        while True:
            news: list[tuple[str, Message]] = []
            for key, h in running.items():
                finished = h.job.done()  # before reading: no event after it is missed
                news += [(key, ("event", e)) for e in h.events.read()]
                if finished:
                    news.append((key, self._outcome(h.job)))
            if news:
                return news
            time.sleep(self.poll_s)

    def _outcome(self, job: Any) -> Message:
        utils = self.submitit.core.utils
        log = job.paths.stderr
        try:
            return tuple(job.result())
        except utils.UncompletedJobError:
            return ("lost", f"its job {job.job_id} ended without a result ({job.state}; see {log})")
        except utils.FailedJobError:
            return ("lost", f"its job {job.job_id} failed outside the task (see {log})")

    def stop(self, handle: _Submitted) -> None:
        if not handle.job.done():
            handle.job.cancel(check=False)


@dataclass(frozen=True)
class SubmititPool:
    """Tasks as SLURM jobs, at most `jobs` queued or running at a time."""

    opts: SlurmOptions
    folder: Path  # on the filesystem the nodes share: the study's out/slurm
    jobs: int

    def __post_init__(self) -> None:
        _submitit()  # before any work

    def run(self, tasks: Sequence[Task], on_event: OnEvent) -> dict[str, Any]:
        return schedule(tasks, SubmititJobs(self.opts, self.folder), self.jobs, on_event)


__all__ = ["SlurmOptions", "SubmititPool"]
