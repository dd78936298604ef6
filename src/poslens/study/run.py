"""`poslens study`: train (or reuse) every model and seed, run every experiment, aggregate, report.

Output folder layout (all paths in results.json are relative to it):
  checkpoints/<model>_s<seed>_<hash>/   trained models, reused when the run config hashes the same
  runs/<model>/seed<seed>/<exp>.*       each experiment's JSON, CSV tables, PNG and SVG figure
  runs/<model>/seed<seed>/<exp>.stage.json   written last: the stage is finished (resume key)
  figures/                              study-level figures (seeds aggregated)
  results.json, report.html, report.md
Every file is written atomically, so an interrupted study leaves finished stages intact and
`poslens study` with the same arguments continues from them.
"""

from __future__ import annotations

import dataclasses
import platform
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

import poslens
from poslens._config import override
from poslens.errors import CheckpointError
from poslens.experiments import get
from poslens.experiments.common import ExperimentConfig, jsonable, save
from poslens.io import read_json, write_json
from poslens.study.aggregate import aggregate, headline
from poslens.study.claims import evaluate_claims
from poslens.study.config import StudyConfig, config_hash
from poslens.training.config import RunConfig, apply_overrides, preset

SCHEMA = "poslens.study/1"


@dataclass(frozen=True)
class Stage:
    """One unit of work: training a model/seed, or one experiment on it."""

    kind: str  # "train" or an experiment name
    model: str
    seed: int
    weight: float  # rough relative cost, for the ETA

    @property
    def label(self) -> str:
        return f"{self.kind:<16} {self.model:<11} seed {self.seed}"


def run_config(cfg: StudyConfig, model: str, seed: int, threads: int = 0) -> RunConfig:
    """The training config of one model and seed: the encoding's preset plus the study's changes."""
    sets = [*cfg.train_set, f"train.seed={seed}", f'data.task="{cfg.task}"']
    if threads:
        sets.append(f"train.threads={threads}")
    return apply_overrides(preset(model), sets)


def experiment_configs(cfg: StudyConfig) -> dict[str, ExperimentConfig]:
    """Each experiment's config (shared sizes + the study's overrides); ConfigError before work."""
    common = {
        "n_images": cfg.n_images,
        "probe_images": cfg.probe_images,
        "batch_size": cfg.batch_size,
    }
    out = {}
    for name in cfg.experiments:
        module = get(name)
        out[name] = module.Config(
            **common, **override(module.Config, name, cfg.analysis_overrides(name))
        )
    return out


def checkpoint_dir(out: Path, model: str, seed: int, rc: RunConfig) -> Path:
    d = rc.to_dict()
    d["train"] = {k: v for k, v in d["train"].items() if k != "threads"}  # threads change no weight
    return out / "checkpoints" / f"{model}_s{seed}_{config_hash(d)}"


def _weight(kind: str, cfg: StudyConfig, rc: RunConfig) -> float:
    """Relative cost of a stage (training images vs evaluated images) for the progress ETA."""
    if kind == "train":
        return rc.train.steps * rc.train.batch_size / 100
    per_image = {"windows": 12, "heads": 20, "sae_causal": 30, "components": 40}.get(kind, 4)
    return per_image * cfg.n_images / 100


@contextmanager
def _progress(enabled: bool) -> Iterator[Progress | None]:
    if not enabled:
        yield None
        return
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[done]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=Console(file=sys.stderr),
    ) as bar:
        yield bar


def train_stage(rc: RunConfig, ckpt: Path, device: str) -> tuple[dict[str, Any], bool]:
    """Train into `ckpt`, resuming a partial run; returns (metrics, reused)."""
    from poslens.training.train import METRICS, STATE, train

    if (ckpt / METRICS).is_file():
        return read_json(ckpt / METRICS, "training metrics"), True
    resume = (ckpt / STATE).is_file()
    return train(rc, ckpt, resume=resume, progress=False, device=device), False


def experiment_stage(
    name: str, ecfg: ExperimentConfig, ckpt: Path, run_dir: Path, device: str
) -> dict[str, Any]:
    """Run one experiment on a checkpoint, save its files, and mark the stage finished."""
    module = get(name)
    model = poslens.load(ckpt, device=device)
    data = poslens.load_task(ckpt)
    reason = module.applies(model)
    ehash = config_hash(dataclasses.asdict(ecfg))
    record: dict[str, Any] = {"experiment": name, "config_hash": ehash}
    if reason is not None:
        record["skipped"] = reason
    else:
        torch.manual_seed(ecfg.seed)
        result = module.run(model, data, ecfg, progress=False)
        files = save(result, run_dir, formats=("png", "svg"))
        record["files"] = [str(f.relative_to(run_dir.parents[2])) for f in files]
        record["headline"] = headline(name, jsonable(result.to_dict()))
    return record


def _finished(path: Path, ehash: str) -> dict[str, Any] | None:
    """The stage record if this stage already finished with the same experiment config."""
    if not path.is_file():
        return None
    try:
        rec = read_json(path, "stage record")
    except CheckpointError:
        return None
    return rec if rec.get("config_hash") == ehash else None


def run_study(
    cfg: StudyConfig,
    out: str | Path,
    progress: bool = True,
    device: str = "cpu",
    threads: int = 0,
) -> dict[str, Any]:
    """Run (or continue) the study into `out`; returns the results.json content."""
    out = Path(out)
    ecfgs = experiment_configs(cfg)
    rcs = {(m, s): run_config(cfg, m, s, threads) for m in cfg.models for s in range(cfg.seeds)}
    if threads:
        torch.set_num_threads(threads)
    stages = [
        Stage(kind, m, s, _weight(kind, cfg, rcs[m, s]))
        for m in cfg.models
        for s in range(cfg.seeds)
        for kind in ("train", *cfg.experiments)
    ]
    start = time.perf_counter()
    timings: list[dict[str, Any]] = []
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in cfg.models}
    with _progress(progress) as bar:
        task = None
        if bar is not None:
            total = sum(st.weight for st in stages)
            task = bar.add_task("study", total=total, done=f"0/{len(stages)}")
        for i, st in enumerate(stages):
            if bar is not None and task is not None:
                bar.update(task, description=st.label)
            t0 = time.perf_counter()
            rc = rcs[st.model, st.seed]
            ckpt = checkpoint_dir(out, st.model, st.seed, rc)
            run_dir = out / "runs" / st.model / f"seed{st.seed}"
            extra: dict[str, Any] = {}
            if st.kind == "train":
                metrics, reused = train_stage(rc, ckpt, device)
                extra["train_seconds"] = round(float(metrics["train_seconds"]), 1)
                runs[st.model].append(
                    {
                        "seed": st.seed,
                        "checkpoint": str(ckpt.relative_to(out)),
                        "config_hash": ckpt.name.rsplit("_", 1)[1],
                        "train": _train_summary(metrics),
                        "experiments": {},
                        "skipped": {},
                    }
                )
            else:
                ecfg = ecfgs[st.kind]
                marker = run_dir / f"{st.kind}.stage.json"
                record = _finished(marker, config_hash(dataclasses.asdict(ecfg)))
                reused = record is not None
                if record is None:
                    record = experiment_stage(st.kind, ecfg, ckpt, run_dir, device)
                    write_json(marker, jsonable(record))
                entry = runs[st.model][-1]
                if "skipped" in record:
                    entry["skipped"][st.kind] = record["skipped"]
                else:
                    entry["experiments"][st.kind] = {
                        "headline": record["headline"],
                        "files": record["files"],
                    }
            seconds = time.perf_counter() - t0
            timings.append(
                {"stage": st.kind, "model": st.model, "seed": st.seed, "seconds": round(seconds, 2),
                 "reused": reused} | extra
            )  # fmt: skip
            if bar is not None and task is not None:
                bar.update(task, advance=st.weight, done=f"{i + 1}/{len(stages)}")
    models = {
        m: {"posenc": m, "runs": runs[m], "aggregate": aggregate(runs[m], cfg.experiments)}
        for m in cfg.models
    }
    from poslens.study.figures import study_figures

    results: dict[str, Any] = {
        "schema": SCHEMA,
        "poslens_version": poslens.__version__,
        "created": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "config": cfg.to_dict() | {"device": device},
        "environment": environment(),
        "models": models,
        "claims": evaluate_claims(models, cfg),
        "figures": study_figures(out, models, cfg),
        "timings": {
            "total_seconds": round(time.perf_counter() - start, 1),
            "stages": timings,
        },
    }
    results = jsonable(results)
    write_json(out / "results.json", results)
    from poslens.report import write_report

    write_report(out, results)
    return results


def _train_summary(m: dict[str, Any]) -> dict[str, Any]:
    return {
        "test_acc": m["test"]["acc"],
        "val_acc": m["val"]["acc"],
        "train_acc": m["train"]["acc"],
        "chance": m["chance"],
        "steps": m["steps"],
        "steps_to_90": m["steps_to_90"],
    }


def environment() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
    }


__all__ = ["SCHEMA", "run_study"]
