"""The study's runs as executor tasks (study/executor.py): in this process (jobs 1), in local
worker processes, or as SLURM jobs (study/slurm.py), with one progress display fed by the runs'
StageEvents."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.progress import Progress

from poslens.progress import progress_bar
from poslens.study.executor import Executor, InProcess, LocalPool, OnEvent, Rerun, Task
from poslens.study.plan import Plan, RunPlan
from poslens.study.slurm import SlurmOptions, SubmititPool
from poslens.study.stages import Events, StageEvent, run_one, train_group

RunResult = tuple[dict[str, Any], list[dict[str, Any]]]  # results.json entry, stage timings


def run_task(run: RunPlan, out: Path, device: str, threads: int, events: Events) -> RunResult:
    """One model/seed run as an executor task. The device is checked where the task runs: a
    cluster node may have the GPU that the submitting machine lacks."""
    from poslens.limits import check_device, resolve_device

    device = resolve_device(device)
    check_device(device)
    return run_one(run, out, device, threads, events)


def model_task(
    runs: list[RunPlan], out: Path, device: str, threads: int, retries: int, events: Events
) -> dict[tuple[str, int], RunResult]:
    """One trained model as an executor task: its seeds trained as one ensemble, each seed that
    fails the accuracy gate retrained from reserve seeds up to `retries` times (study/gate.py),
    then each seed's experiments, then its in-situ controls' (which read the same checkpoints);
    a run's training timing is its share of the ensembles'. One process per model, so the
    experiments start as soon as their model is trained. Results by (model, slot seed)."""
    import torch

    from poslens.limits import check_device, resolve_device
    from poslens.study.gate import gated

    device = resolve_device(device)
    check_device(device)
    if threads:
        torch.set_num_threads(threads)
    base = [r for r in runs if not r.edit]
    slots = gated(base, train_group(base, device, events), retries, out, device, events)
    results = {}
    for run in runs:
        slot = slots[run.seed]
        entry, timings = run_one(slot.holding(run), out, device, threads, events)
        seconds, reused = (0.0, True) if run.edit else (slot.seconds, slot.reused)
        for t in timings:
            if t["stage"] == "train":
                t.update(seconds=round(seconds, 2), reused=reused)
        record = slot.record()
        if record is not None:  # the seed this slot's checkpoint was trained with
            entry |= {"seed": slot.trained_seed, "gate": record}
        results[run.model, run.seed] = (entry, timings)
    return results


def make_executor(plan: Plan, slurm: SlurmOptions | None = None) -> Executor:
    """The plan's executor; one-line ConfigErrors (no submitit, no SLURM) before any work."""
    if slurm is not None:
        slurm.check(plan.device)
        return SubmititPool(slurm, plan.out / "slurm", plan.jobs)
    return InProcess() if plan.jobs == 1 else LocalPool(plan.jobs)


def _say(bar: Progress | None, line: str) -> None:
    """A line on stderr, above the progress display when there is one."""
    if bar is not None:
        bar.console.print(line, markup=False, highlight=False, soft_wrap=True)
    else:
        print(line, file=sys.stderr, flush=True)


@contextmanager
def _display(plan: Plan, enabled: bool) -> Iterator[OnEvent]:
    """The executor's event callback, keeping the study's progress: on a terminal a progress line
    (the running stages, stages done, ETA); elsewhere (a log file, CI, nohup) one line per
    finished stage with its seconds and the ETA. A lost run's rerun is said in one line."""
    running: dict[str, str] = {}  # task -> its running stage's label
    done: set[tuple[str, int, str]] = set()  # a rerun's reused stages are not counted again
    total, weight = plan.stages_total, sum(r.weight for r in plan.runs)
    done_weight, start = 0.0, time.perf_counter()

    def eta() -> str:
        left = (time.perf_counter() - start) * (weight - done_weight) / max(done_weight, 1e-9)
        return f"{round(left)} s" if done_weight else "?"

    def update(bar: Progress | None, task: Any, key: str, ev: StageEvent | Rerun) -> None:
        nonlocal done_weight
        if isinstance(ev, Rerun):
            running.pop(key, None)
            _say(bar, f"poslens: {key}: {ev.why}; running it again (finished stages are kept)")
            return
        st, advance = ev.stage, 0.0
        if ev.kind == "start":
            running[key] = st.label
        else:
            running.pop(key, None)
            if (st.model, st.seed, st.kind) not in done:
                done.add((st.model, st.seed, st.kind))
                advance = st.weight
                done_weight += advance
                if lines:
                    seconds = f"{ev.seconds:.1f} s"
                    what = "skipped" if ev.skipped else "reused" if ev.reused else seconds
                    _say(None, f"poslens: [{len(done)}/{total}] {st.kind} {st.model} seed "
                               f"{st.seed}: {what}; ETA {eta()}")  # fmt: skip
        if bar is not None:
            bar.update(
                task,
                advance=advance,
                description=" | ".join(running.values()) or f"finished {st.label}",
                done=f"{len(done)}/{total}",
            )

    lines = enabled and not sys.stderr.isatty()
    if not enabled or lines:
        yield lambda key, ev: update(None, None, key, ev)
        return
    with progress_bar("{task.fields[done]}", min_width=120) as bar:
        task = bar.add_task("study", total=weight, done=f"0/{total}")
        yield lambda key, ev: update(bar, task, key, ev)


def _cost(run: RunPlan) -> float:
    """A pretrained run's rough cost, for the order only: its stages' weights times the size of
    its weights file (a forward pass costs about as the parameter count; 1 for hub weights)."""
    assert run.pretrained is not None
    weights = Path(run.pretrained.weights)
    return run.weight * (weights.stat().st_size if weights.is_file() else 1)


def execute(plan: Plan, executor: Executor, progress: bool) -> dict[tuple[str, int], RunResult]:
    """Every run of the plan, by (model, seed), through `executor` (see make_executor): one task
    per trained model (its seeds as one ensemble, then their experiments), or one task per
    pretrained model and analysis seed."""
    groups: dict[str, list[RunPlan]] = {}  # by the model whose weights the runs read
    for r in plan.runs:
        groups.setdefault(r.base, []).append(r)

    # the slowest learners first (APE tables; docs/study.md), so that the last tasks running
    # alone are short ones
    def learns_slowly(model: str) -> bool:
        rc = groups[model][0].run_config
        return rc is not None and rc.model.posenc == "ape"

    order = sorted(groups, key=lambda m: not learns_slowly(m))
    args = (plan.out, plan.device, plan.threads)
    tasks: dict[str, Task] = {}
    for model in order:
        runs = groups[model]
        if runs[0].run_config is not None:
            key = f"{model} seeds {runs[0].seed}-{runs[-1].seed}"
            tasks[key] = Task(key, model_task, (runs, *args, plan.cfg.gate_retries))
    # pretrained runs, the costliest first: the last tasks running alone are the short ones
    for r in sorted((r for r in plan.runs if r.run_config is None), key=lambda r: -_cost(r)):
        key = f"{r.model} seed {r.seed}"
        tasks[key] = Task(key, run_task, (r, *args))
    with _display(plan, progress) as on_event:
        by_key = executor.run(list(tasks.values()), on_event)
    results: dict[tuple[str, int], RunResult] = {}
    for key, got in by_key.items():  # model_task: (model, seed) -> result; run_task: one result
        if tasks[key].fn is model_task:
            results |= got
        else:
            run = tasks[key].args[0]
            results[run.model, run.seed] = got
    return results


__all__ = ["execute", "make_executor", "model_task", "run_task"]
