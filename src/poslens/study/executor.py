"""Independent tasks run in this process, in local worker processes or as SLURM jobs (slurm.py).

A task is `fn(*args, events)` with a picklable, module-level fn; `events.put(obj)` sends obj to
the parent's `on_event(key, obj)` while the task runs. A worker that dies without its result (kill
-9, the out-of-memory killer) loses only its task, which runs once more (it reuses what it saved);
lost twice, the executor raises WorkerLost naming the task and its last event. Local workers end
with the parent process, however it ends (kill -9 included).
"""

from __future__ import annotations

import ctypes
import gc
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import connection, get_context
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

from poslens.allocator import keep_freed_memory, release_freed_memory
from poslens.allocator import kept as allocator_kept
from poslens.errors import WorkerLost, show_warning_line

OnEvent = Callable[[str, Any], None]  # (task key, event)
# What a backend reports about a started task: ("event", obj), then ("done", result),
# ("failed", exception, traceback text) or ("lost", why its worker ended without a result).
Message = tuple[Any, ...]


@dataclass(frozen=True)
class Task:
    """One independent unit of work: `fn(*args, events)` in a worker; `key` names it."""

    key: str
    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Rerun:
    """The executor's own event: the task's worker was lost (`why`) and the task starts again."""

    why: str


class Executor(Protocol):
    def run(self, tasks: Sequence[Task], on_event: OnEvent) -> dict[str, Any]:
        """Every task's result by key; a task's exception is raised here, others stopped."""
        ...


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker (the `__cause__` of the one re-raised)."""


class _Direct:
    def __init__(self, key: str, on_event: OnEvent) -> None:
        self.key, self.on_event = key, on_event

    def put(self, event: Any) -> None:
        self.on_event(self.key, event)


class InProcess:
    """Tasks one after another in this process (no workers: nothing to lose)."""

    def run(self, tasks: Sequence[Task], on_event: OnEvent) -> dict[str, Any]:
        return {t.key: t.fn(*t.args, _Direct(t.key, on_event)) for t in tasks}


class Backend(Protocol):
    """Where tasks run: start one, wait for news of those running, stop one."""

    def start(self, task: Task) -> Any: ...

    def wait(self, running: dict[str, Any]) -> list[tuple[str, Message]]: ...

    def stop(self, handle: Any) -> None: ...


def schedule(
    tasks: Sequence[Task], backend: Backend, jobs: int, on_event: OnEvent
) -> dict[str, Any]:
    """Run `tasks` on `backend`, at most `jobs` at a time; a lost task runs once more."""
    assert len({t.key for t in tasks}) == len(tasks), "task keys must be unique"
    todo, running = deque(tasks), dict[str, Any]()
    tries: dict[str, int] = {}
    last: dict[str, Any] = {}  # each task's last event (of any try), named when it is lost
    results: dict[str, Any] = {}
    by_key = {t.key: t for t in tasks}
    try:
        while todo or running:
            while todo and len(running) < jobs:
                task = todo.popleft()
                running[task.key] = backend.start(task)
                tries[task.key] = tries.get(task.key, 0) + 1
            for key, (kind, *rest) in backend.wait(running):
                if kind == "event":
                    last[key] = rest[0]
                    on_event(key, rest[0])
                    continue
                del running[key]
                if kind == "done":
                    results[key] = rest[0]
                elif kind == "failed":
                    exc, tb = rest
                    raise exc from RemoteTraceback(tb)
                else:
                    why = f"{rest[0]} {last[key]}" if key in last else rest[0]
                    if tries[key] > 1:
                        raise WorkerLost(f"{key}: {why}, and again when rerun")
                    on_event(key, Rerun(why))
                    todo.appendleft(by_key[key])
    finally:
        for handle in running.values():
            backend.stop(handle)
    return results


def portable(exc: Exception) -> Exception:
    """`exc` if it survives pickling (to the parent), else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


# ---- local worker processes ----------------------------------------------------------------

PR_SET_PDEATHSIG = 1  # prctl(2)


def _end_with(parent: int) -> None:
    """This process ends when `parent` does, however it ends: the kernel's parent-death signal on
    Linux, and everywhere a thread that watches for this process being handed to another parent."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    if os.getppid() != parent:  # it ended before the signal was armed
        os._exit(1)
    threading.Thread(target=watch, name="poslens-parent-watch", daemon=True).start()


class _Pipe:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def put(self, event: Any) -> None:
        self.conn.send(("event", event))


def _worker(conn: Connection, parent: int, keep_memory: bool) -> None:
    """A worker process: runs the tasks it is sent over `conn`, one at a time, sending each one's
    events and then its result, until it is sent None. Importing torch and timm costs a worker
    about 8 s on one core, so a worker is kept for the next task rather than spawned per task;
    each task starts from torch's global seed as a fresh process has it."""
    _end_with(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches all; the parent stops workers
    warnings.showwarning = show_warning_line  # one line each, as in the CLI
    if keep_memory:
        keep_freed_memory()
    import torch

    seed = torch.initial_seed()
    while (task := conn.recv()) is not None:
        torch.manual_seed(seed)
        try:
            conn.send(("done", task.fn(*task.args, _Pipe(conn))))
        except Exception as e:
            conn.send(("failed", portable(e), traceback.format_exc()))
        # the heap keeps its peak (allocator.py); between tasks its free part goes back, or the
        # fragments of one task's peak add to the next one's (3.1 -> 3.5 GB over a ViT-S's runs)
        gc.collect()
        release_freed_memory()
    conn.close()


@dataclass
class _Process:
    process: BaseProcess
    conn: Connection


def ended(exitcode: int | None) -> str:
    """Why a worker ended without its result, from its exit code."""
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        oom = " (as the out-of-memory killer does)" if -exitcode == signal.SIGKILL else ""
        return f"its worker process was killed by {name}{oom}"
    return f"its worker process exited (code {exitcode}) without a result"


class LocalProcesses:
    """Tasks in `spawn` worker processes, each worker kept for the next task once it has sent a
    result (close() ends the idle ones); a worker's pipe reaching its end without a result means
    the worker died, and a rerun gets a fresh one."""

    def __init__(self) -> None:
        self.ctx = get_context("spawn")
        self.idle: list[_Process] = []

    def start(self, task: Task) -> _Process:
        handle = self.idle.pop() if self.idle else self._spawn()
        handle.conn.send(task)
        return handle

    def _spawn(self) -> _Process:
        conn, child = self.ctx.Pipe()
        args = (child, os.getpid(), allocator_kept())  # workers follow this process
        process = self.ctx.Process(target=_worker, args=args, daemon=True)
        process.start()
        child.close()  # the worker holds the only other end: its death ends the pipe
        return _Process(process, conn)

    def close(self) -> None:
        """End the idle workers (each finishes its loop; stopped if it does not)."""
        for handle in self.idle:
            try:
                handle.conn.send(None)
            except OSError:  # it has died meanwhile
                pass
            handle.process.join(timeout=30)
            self.stop(handle)
        self.idle.clear()

    def wait(self, running: dict[str, _Process]) -> list[tuple[str, Message]]:
        by_conn = {h.conn: key for key, h in running.items()}
        news = []
        for conn in connection.wait(list(by_conn)):
            key = by_conn[conn]  # type: ignore[index]
            h = running[key]
            try:
                msg: Message | None = conn.recv()
            except (EOFError, ConnectionResetError):  # the worker ended without a result
                msg = None
            if msg is None:
                h.process.join(timeout=30)
                self.stop(h)
                msg = ("lost", ended(h.process.exitcode))
            elif msg[0] != "event":  # a result: the worker waits for its next task
                self.idle.append(h)
            news.append((key, msg))
        return news

    def stop(self, handle: _Process) -> None:
        p = handle.process
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
        handle.conn.close()


@dataclass(frozen=True)
class LocalPool:
    """Up to `jobs` tasks at a time in worker processes (a task per worker at a time)."""

    jobs: int

    def run(self, tasks: Sequence[Task], on_event: OnEvent) -> dict[str, Any]:
        backend = LocalProcesses()
        try:
            return schedule(tasks, backend, self.jobs, on_event)
        finally:
            backend.close()


__all__ = ["Executor", "InProcess", "LocalPool", "Rerun", "Task", "schedule"]
