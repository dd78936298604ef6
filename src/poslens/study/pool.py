"""Running a plan's runs: in this process, or in parallel worker processes, with one progress
display fed by the runs' stage events."""

from __future__ import annotations

import multiprocessing as mp
import queue
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.progress import Progress

from poslens.allocator import keep_freed_memory
from poslens.allocator import kept as allocator_kept
from poslens.progress import progress_bar
from poslens.study.plan import Plan, Stage
from poslens.study.stages import run_one

RunResult = tuple[dict[str, Any], list[dict[str, Any]]]  # results.json entry, stage timings


class _Direct:
    """The queue interface for the single-process case: events go straight to the display."""

    def __init__(self, fn: Callable[[str, Stage], None]) -> None:
        self.fn = fn

    def put(self, item: tuple[str, Stage]) -> None:
        self.fn(*item)


@contextmanager
def _display(plan: Plan, enabled: bool) -> Iterator[Callable[[str, Stage], None]]:
    """A callback for ("start" | "done", Stage) events that keeps the study's progress line: the
    running stages (experiment, model, seed), stages done and the ETA."""
    running: dict[tuple[str, int], str] = {}
    done = 0
    total = plan.stages_total

    def update(bar: Progress | None, task: Any, kind: str, st: Stage) -> None:
        nonlocal done
        if kind == "start":
            running[st.model, st.seed] = st.label
        else:
            done += 1
            running.pop((st.model, st.seed), None)
        if bar is not None:
            bar.update(
                task,
                advance=st.weight if kind == "done" else 0,
                description=" | ".join(running.values()) or f"finished {st.label}",
                done=f"{done}/{total}",
            )

    if not enabled:
        yield lambda kind, st: update(None, None, kind, st)
        return
    with progress_bar("{task.fields[done]}", min_width=120) as bar:
        task = bar.add_task("study", total=sum(r.weight for r in plan.runs), done=f"0/{total}")
        yield lambda kind, st: update(bar, task, kind, st)


def execute(plan: Plan, progress: bool) -> dict[tuple[str, int], RunResult]:
    """Every run of the plan, by (model, seed): one after another in this process (jobs 1), or
    in a `spawn` pool of plan.jobs processes (each with plan.threads torch threads)."""
    results: dict[tuple[str, int], RunResult] = {}
    args = (plan.out, plan.device, plan.threads)
    with _display(plan, progress) as on_event:
        if plan.jobs == 1:
            for run in plan.runs:
                results[run.model, run.seed] = run_one(run, *args, events=_Direct(on_event))
            return results
        ctx = mp.get_context("spawn")
        init = keep_freed_memory if allocator_kept() else None  # workers follow this process
        with ctx.Manager() as manager, ctx.Pool(plan.jobs, initializer=init) as pool:
            events = manager.Queue()
            pending = {
                (run.model, run.seed): pool.apply_async(run_one, (run, *args, events))
                for run in plan.runs
            }
            while pending:
                try:
                    on_event(*events.get(timeout=0.2))
                except queue.Empty:
                    pass
                for key in [k for k, r in pending.items() if r.ready()]:
                    results[key] = pending.pop(key).get()  # re-raises worker errors
            while not events.empty():
                on_event(*events.get())
    return results


__all__ = ["execute"]
