"""`poslens study`: train (or reuse) every model and seed, run every experiment, aggregate, report.

Output folder layout (all paths in results.json are relative to it):
  checkpoints/<model>_s<seed>_<hash>/   trained models, reused when the run config hashes the same
  runs/<model>/seed<seed>/<exp>.*       each experiment's JSON, CSV tables, PNG and SVG figure
  runs/<model>/seed<seed>/<exp>.stage.json   written last: the stage is finished (resume key)
  figures/                              study-level figures (seeds aggregated)
  results.json, report.html, report.md
  .lock                                 held (flock) while a study runs here: one study at a time
  slurm/                                with --executor slurm: submitit's job files and logs
Every file is written atomically, so an interrupted study leaves finished stages intact and
`poslens study` with the same arguments continues from them. The study is resolved into a plan
(study/plan.py), its runs executed stage by stage (study/stages.py, study/pool.py), then
aggregated over seeds (study/aggregate.py) and judged (study/judge.py).
"""

from __future__ import annotations

import platform
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from poslens._version import __version__
from poslens.allocator import kept as allocator_kept
from poslens.io import jsonable, locked, sweep_temp_files, write_json
from poslens.study.aggregate import aggregate
from poslens.study.config import StudyConfig
from poslens.study.executor import Executor
from poslens.study.judge import evaluate_claims
from poslens.study.plan import Plan, make_plan
from poslens.study.pool import execute, make_executor
from poslens.study.prepared import PREPARED_DIR, checked, prepare
from poslens.study.schema import SCHEMA
from poslens.study.slurm import SlurmOptions, SubmititPool


def run_study(
    cfg: StudyConfig,
    out: str | Path,
    progress: bool = True,
    device: str = "cpu",
    threads: int = 0,
    jobs: int = 1,
    slurm: SlurmOptions | None = None,
) -> dict[str, Any]:
    """Run (or continue) the study into `out`; returns the results.json content.

    jobs: model/seed runs in parallel processes (0: one per core on the CPU); threads: torch
    threads per process (0: the cores divided among the jobs). slurm: each model/seed run as a
    SLURM job instead (jobs: at most that many at a time, 0: all; threads 0: the job's CPUs).
    """
    if slurm is not None:
        jobs = jobs or cfg.n_runs
        threads = threads or slurm.cpus_per_task
    plan = make_plan(cfg, out, device, threads, jobs)  # every config error before any work
    executor = make_executor(plan, slurm)
    # each pretrained model read and the images checked against it, still before --out exists
    converted = checked(plan.out, cfg.pretrained_models, cfg.images)
    with locked(plan.out, "study"):
        sweep_temp_files(plan.out, ("checkpoints", "runs", "figures", PREPARED_DIR))  # kill -9's
        # once here, not in every worker
        prepare(plan.out, cfg.pretrained_models, cfg.images, converted)
        return _run(plan, executor, progress)


def _run(plan: Plan, executor: Executor, progress: bool) -> dict[str, Any]:
    cfg, out, device = plan.cfg, plan.out, plan.device
    start = time.perf_counter()
    by_run = execute(plan, executor, progress)
    runs_seconds = time.perf_counter() - start
    runs: dict[str, list[dict[str, Any]]] = {}  # model -> its runs in seed order (as planned)
    for r in plan.runs:
        runs.setdefault(r.model, []).append(by_run[r.model, r.seed][0])
    # a pretrained model's in-situ controls whose edit does not fit it (an APE edit on a RoPE
    # model: the plan cannot know the encoding before the weights load) are not models of it
    runs = {m: rs for m, rs in runs.items()
            if not all((r.get("pretrained") or {}).get("not_applied") for r in rs)}  # fmt: skip
    # a trained model's encoding (a calibration model's is the one it is built on)
    posenc = {r.model: r.run_config.model.posenc for r in plan.runs if r.run_config is not None}
    # what a verdict describes (the image size is the task's, as training takes it)
    scale = {r.model: replace(r.run_config.model, image_size=r.run_config.data.image_size).scale
             for r in plan.runs if r.run_config is not None}  # fmt: skip
    timings = [t for r in plan.runs for t in by_run[r.model, r.seed][1]]
    models = {
        m: {
            "posenc": runs[m][0]["pretrained"]["posenc"] if cfg.pretrained else posenc[m],
            "scale": runs[m][0]["pretrained"].get("scale") if cfg.pretrained else scale[m],
            "runs": runs[m],
            "aggregate": aggregate(runs[m], cfg.experiments),
        }
        | in_situ_entry(m)
        for m in runs
    }
    from poslens.study.figures import study_figures

    claims = evaluate_claims(models, cfg)
    results: dict[str, Any] = {
        "schema": SCHEMA,
        "poslens_version": __version__,
        "created": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "config": results_config(cfg, device),
        "environment": environment(plan.threads or torch.get_num_threads(), plan.jobs, executor),
        "models": models,
        "claims": [c.to_dict() for c in claims],
        "figures": study_figures(out, models, cfg, claims),
        "timings": {
            "total_seconds": round(time.perf_counter() - start, 1),
            "runs_seconds": round(runs_seconds, 1),  # training and experiments, all runs
            "stages": timings,
        },
    }
    results = jsonable(results)
    write_json(out / "results.json", results)
    from poslens.report import write_report

    write_report(out, results)
    return results


def results_config(cfg: StudyConfig, device: str) -> dict[str, Any]:
    """results.json's `config`: the StudyConfig as given (auto values as the schema describes
    them: batch_size 0, precision "auto") and the device."""
    return cfg.to_dict() | {"device": device}


def in_situ_entry(model: str) -> dict[str, Any]:
    """{"in_situ": {of, edit, role}} for an in-situ control's model name, else {}."""
    from poslens.interventions import in_situ

    base, edit = in_situ.split_name(model)
    if edit is None:
        return {}
    return {"in_situ": {"of": base, "edit": edit, "role": in_situ.get(edit).role}}


def cpu() -> dict[str, Any]:
    """The CPU model and the vector extensions that decide float speed and rounding (bf16 is
    native with avx512_bf16 or amx_bf16), read from /proc/cpuinfo where there is one, and the
    instruction set torch's own kernels run with (ATEN_CPU_CAPABILITY can lower it)."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    for line in info.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            name = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
            break
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
    return {
        "model": name,
        "extensions": [f for f in wanted if f in flags],
        "kernels": torch.backends.cpu.get_cpu_capability(),
    }


def environment(threads: int, jobs: int, executor: Executor | None = None) -> dict[str, Any]:
    return {
        "cpu": cpu(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "threads": threads,
        "jobs": jobs,
        "executor": "slurm" if isinstance(executor, SubmititPool) else "local",
        "malloc": "keep_freed" if allocator_kept() else "default",
    }


__all__ = ["SCHEMA", "results_config", "run_study"]
