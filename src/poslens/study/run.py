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
import multiprocessing as mp
import os
import platform
import queue
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
from poslens.allocator import keep_freed_memory
from poslens.allocator import kept as allocator_kept
from poslens.data import Task
from poslens.errors import CheckpointError
from poslens.experiments import get
from poslens.experiments.config import ExperimentConfig
from poslens.experiments.output import save
from poslens.experiments.readout import eval_images
from poslens.io import jsonable, read_json, write_json
from poslens.models.vit import ViT
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
        return f"{self.kind} {self.model} seed {self.seed}"


def run_config(cfg: StudyConfig, model: str, seed: int, threads: int = 0) -> RunConfig:
    """The training config of one model and seed: the encoding's preset plus the study's changes."""
    sets = [*cfg.train_changes(model), f"train.seed={seed}", f'data.task="{cfg.task}"']
    if threads:
        sets.append(f"train.threads={threads}")
    return apply_overrides(preset(model), sets)


def experiment_configs(cfg: StudyConfig, seed: int = 0) -> dict[str, ExperimentConfig]:
    """Each experiment's config (shared sizes + the study's overrides); ConfigError before work.

    A trained model's seed changes its weights, so its analysis uses seed 0 throughout; a
    pretrained model's seeds are analysis seeds (RPI permutation, probe split, random draws).
    """
    common = {
        "n_images": cfg.n_images,
        "probe_images": cfg.probe_images,
        "batch_size": cfg.batch_size,
        "seed": seed if cfg.pretrained else 0,
        "ssdc_images": cfg.ssdc_images,
        "precision": cfg.precision,
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


def _weight(kind: str, cfg: StudyConfig, rc: RunConfig | None) -> float:
    """Relative cost of a stage (training images vs evaluated images) for the progress ETA."""
    if kind == "train":
        assert rc is not None
        return rc.train.steps * rc.train.batch_size / 100
    if kind == "load":
        return cfg.n_images / 100
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
        console=Console(file=sys.stderr, width=max(120, Console(file=sys.stderr).width)),
    ) as bar:
        yield bar


@dataclass
class Source:
    """Where one run's model and images come from: a study checkpoint, or pretrained weights
    ("timm:NAME" + a weights file or "hub") with an image folder shuffled by `seed`."""

    checkpoint: Path | None = None
    spec: str = ""
    weights: str = ""
    images: str = ""
    seed: int = 0

    # The run's images, built once per run and shared by its stages (decoding a large image folder
    # again for every experiment would cost more than the experiment); tasks are read-only.
    _task: Task | None = dataclasses.field(default=None, init=False, compare=False, repr=False)

    def load(self, device: str) -> tuple[ViT, Task]:
        """A fresh model (stages never share one) and the run's images."""
        if self.checkpoint is not None:
            model = poslens.load(self.checkpoint, device=device)
        else:
            model = poslens.load(self.spec, weights=self.weights, device=device)
        if self._task is None:
            self._task = (
                poslens.load_task(self.checkpoint)
                if self.checkpoint is not None
                else poslens.load_images(self.images, self.spec, model, seed=self.seed)
            )
        return model, self._task

    def identity(self) -> dict[str, Any]:
        """What the results depend on, for the stage reuse key: the checkpoint (its name holds
        its config hash), or the pretrained model, its weights file (path and size) and images."""
        if self.checkpoint is not None:
            return {"checkpoint": self.checkpoint.name}
        weights = Path(self.weights)
        size = weights.stat().st_size if weights.is_file() else None
        return {"model": self.spec, "weights": self.weights, "weights_bytes": size,
                "images": str(Path(self.images).resolve()), "image_seed": self.seed}  # fmt: skip


def train_stage(rc: RunConfig, ckpt: Path, device: str) -> tuple[dict[str, Any], bool]:
    """Train into `ckpt`, resuming a partial run; returns (metrics, reused)."""
    from poslens.training.train import METRICS, STATE, train

    if (ckpt / METRICS).is_file():
        return read_json(ckpt / METRICS, "training metrics"), True
    resume = (ckpt / STATE).is_file()
    return train(rc, ckpt, resume=resume, progress=False, device=device), False


@torch.no_grad()
def load_stage(source: Source, ecfg: ExperimentConfig, device: str) -> dict[str, Any]:
    """A pretrained run's first stage: load the model and images, and measure test accuracy on the
    evaluation images (the pretrained counterpart of a trained model's training summary)."""
    model, data = source.load(device)
    x, y = eval_images(data, ecfg)
    dev, n_classes = model.head.weight.device, model.cfg.num_classes
    correct = sum(
        int((model(x[i : i + ecfg.batch_size].to(dev)).argmax(-1).cpu() == y[i : i + ecfg.batch_size]).sum())
        for i in range(0, len(x), ecfg.batch_size)
    ) if n_classes else None  # fmt: skip
    return {  # a backbone without classifier (num_classes=0) has no accuracy: null
        "model": source.spec,
        "weights": source.weights,
        "images": source.images,
        "posenc": model.cfg.posenc,
        "test_acc": None if correct is None else correct / len(x),
        "chance": 1 / n_classes if n_classes else None,
        "n_images": len(x),
        "params": sum(p.numel() for p in model.parameters()),
    }


def experiment_stage(
    name: str, ecfg: ExperimentConfig, source: Source, run_dir: Path, device: str
) -> dict[str, Any]:
    """Run one experiment on a run's model, save its files, and mark the stage finished."""
    module = get(name)
    model, data = source.load(device)
    reason = module.applies(model)
    record: dict[str, Any] = {"experiment": name}
    if reason is not None:
        record["skipped"] = reason
    else:
        torch.manual_seed(ecfg.seed)
        result = module.run(model, data, ecfg, progress=False)
        files = save(result, run_dir, formats=("png", "svg"), config=ecfg)
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


def run_one(
    cfg: StudyConfig,
    out: Path,
    model: str,
    seed: int,
    device: str,
    threads: int,
    events: Any = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Train or load (or reuse) one model/seed and run every experiment on it, stage by stage.

    Returns the run's entry for results.json and its stage timings. `events` (a queue) gets
    ("start" | "done", Stage) messages for the progress display of the parent process.
    """
    if threads:
        torch.set_num_threads(threads)
    ecfgs = experiment_configs(cfg, seed)
    run_dir = out / "runs" / model / f"seed{seed}"
    if cfg.pretrained:
        spec, weights = cfg.source(model)
        source = Source(spec=spec, weights=weights, images=cfg.images, seed=seed)
        first, rc = "load", None
    else:
        rc = run_config(cfg, model, seed, threads)
        source = Source(checkpoint=checkpoint_dir(out, model, seed, rc))
        first = "train"
    entry: dict[str, Any] = {}
    posenc = model
    timings: list[dict[str, Any]] = []
    for kind in (first, *cfg.experiments):
        st = Stage(kind, model, seed, _weight(kind, cfg, rc))
        if events is not None:
            events.put(("start", st))
        t0 = time.perf_counter()
        extra: dict[str, Any] = {}
        if kind == "train":
            assert rc is not None and source.checkpoint is not None
            ckpt = source.checkpoint
            metrics, reused = train_stage(rc, ckpt, device)
            extra["train_seconds"] = round(float(metrics["train_seconds"]), 1)
            entry = {
                "seed": seed,
                "checkpoint": str(ckpt.relative_to(out)),
                "config_hash": ckpt.name.rsplit("_", 1)[1],
                "train": _train_summary(metrics),
                "experiments": {},
                "skipped": {},
            }
        elif kind == "load":
            lcfg = ExperimentConfig(n_images=cfg.n_images, probe_images=cfg.probe_images,
                                    batch_size=cfg.batch_size)  # fmt: skip
            lhash = config_hash(source.identity() | {"n_images": cfg.n_images,
                                                     "batch_size": cfg.batch_size})  # fmt: skip
            marker = run_dir / "load.stage.json"
            record = _finished(marker, lhash)
            reused = record is not None
            if record is None:
                record = load_stage(source, lcfg, device) | {"config_hash": lhash}
                write_json(marker, jsonable(record))
            posenc = record["posenc"]
            entry = {
                "seed": seed,
                "checkpoint": source.spec,
                "config_hash": lhash,
                "train": None,
                "pretrained": {k: v for k, v in record.items() if k != "config_hash"},
                "experiments": {},
                "skipped": {},
            }
        else:
            ecfg = ecfgs[kind]
            marker = run_dir / f"{kind}.stage.json"
            skip = cfg.skips(kind, model, posenc)
            shash = config_hash(dataclasses.asdict(ecfg) | {"skip": skip} | source.identity())
            record = _finished(marker, shash)
            reused = record is not None
            if record is None:
                if skip:
                    record = {"skipped": f"not run on {model} in this study (study.only)"}
                else:
                    record = experiment_stage(kind, ecfg, source, run_dir, device)
                record["config_hash"] = shash
                write_json(marker, jsonable(record))
            if "skipped" in record:
                entry["skipped"][kind] = record["skipped"]
            else:
                entry["experiments"][kind] = {
                    "headline": record["headline"],
                    "files": record["files"],
                }
        seconds = time.perf_counter() - t0
        timings.append(
            {"stage": kind, "model": model, "seed": seed, "seconds": round(seconds, 2),
             "reused": reused} | extra
        )  # fmt: skip
        if events is not None:
            events.put(("done", st))
    return entry, timings


def _jobs(jobs: int, device: str, n_runs: int) -> int:
    """Parallel model/seed runs: by default one per core on the CPU (each single-threaded)."""
    if jobs:
        return max(1, min(jobs, n_runs))
    if device != "cpu":
        return 1
    return max(1, min(os.cpu_count() or 1, n_runs))


def run_study(
    cfg: StudyConfig,
    out: str | Path,
    progress: bool = True,
    device: str = "cpu",
    threads: int = 0,
    jobs: int = 1,
) -> dict[str, Any]:
    """Run (or continue) the study into `out`; returns the results.json content.

    jobs: model/seed runs in parallel processes (0: one per core on the CPU); threads: torch
    threads per process (0: the cores divided among the jobs).
    """
    out = Path(out)
    experiment_configs(cfg)  # ConfigError before any work
    _check_sources(cfg)
    runs_todo = [(m, s) for m in cfg.model_keys for s in range(cfg.seeds)]
    rcs = {(m, s): None if cfg.pretrained else run_config(cfg, m, s) for m, s in runs_todo}
    first = "load" if cfg.pretrained else "train"
    n_jobs = _jobs(jobs, device, len(runs_todo))
    if not threads and n_jobs > 1:
        threads = max(1, (os.cpu_count() or 1) // n_jobs)
    start = time.perf_counter()
    stages_total = len(runs_todo) * (1 + len(cfg.experiments))
    weights = {
        (m, s): sum(_weight(k, cfg, rcs[m, s]) for k in (first, *cfg.experiments))
        for m, s in runs_todo
    }
    results_by_run: dict[tuple[str, int], tuple[dict[str, Any], list[dict[str, Any]]]] = {}
    with _progress(progress) as bar:
        task = None
        if bar is not None:
            task = bar.add_task("study", total=sum(weights.values()), done=f"0/{stages_total}")
        running: dict[tuple[str, int], str] = {}
        done = 0

        def on_event(kind: str, st: Stage) -> None:
            nonlocal done
            if kind == "start":
                running[st.model, st.seed] = st.label
            else:
                done += 1
                running.pop((st.model, st.seed), None)
            if bar is not None and task is not None:
                bar.update(
                    task,
                    advance=st.weight if kind == "done" else 0,
                    description=" | ".join(running.values()) or f"finished {st.label}",
                    done=f"{done}/{stages_total}",
                )

        if n_jobs == 1:
            for m, s in runs_todo:
                events = _Direct(on_event)
                results_by_run[m, s] = run_one(cfg, out, m, s, device, threads, events)
        else:
            ctx = mp.get_context("spawn")
            init = keep_freed_memory if allocator_kept() else None  # workers follow this process
            with ctx.Manager() as manager, ctx.Pool(n_jobs, initializer=init) as pool:
                events = manager.Queue()
                pending = {
                    (m, s): pool.apply_async(run_one, (cfg, out, m, s, device, threads, events))
                    for m, s in runs_todo
                }
                while pending:
                    try:
                        on_event(*events.get(timeout=0.2))
                    except queue.Empty:
                        pass
                    for key in [k for k, r in pending.items() if r.ready()]:
                        results_by_run[key] = pending.pop(key).get()  # re-raises worker errors
                while not events.empty():
                    on_event(*events.get())
    runs_seconds = time.perf_counter() - start
    runs = {m: [results_by_run[m, s][0] for s in range(cfg.seeds)] for m in cfg.model_keys}
    timings = [t for key in runs_todo for t in results_by_run[key][1]]
    models = {
        m: {
            "posenc": runs[m][0]["pretrained"]["posenc"] if cfg.pretrained else m,
            "runs": runs[m],
            "aggregate": aggregate(runs[m], cfg.experiments),
        }
        for m in cfg.model_keys
    }
    from poslens.study.figures import study_figures

    results: dict[str, Any] = {
        "schema": SCHEMA,
        "poslens_version": poslens.__version__,
        "created": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "config": cfg.to_dict() | {"device": device},
        "environment": environment(threads or torch.get_num_threads(), n_jobs),
        "models": models,
        "claims": evaluate_claims(models, cfg),
        "figures": study_figures(out, models, cfg),
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


def _check_sources(cfg: StudyConfig) -> None:
    """Pretrained weights files and the image folder exist: one-line errors before any work."""
    from poslens.errors import DataError

    for key in cfg.model_keys if cfg.pretrained else ():
        spec, weights = cfg.source(key)
        if weights != "hub" and not Path(weights).is_file():
            raise CheckpointError(f"{spec}: weights file {weights} not found")
    if cfg.pretrained and not Path(cfg.images).exists():
        raise DataError(f"image folder {cfg.images} does not exist")


class _Direct:
    """The queue interface for the single-process case: events go straight to the display."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def put(self, item: tuple[str, Stage]) -> None:
        self.fn(*item)


def _train_summary(m: dict[str, Any]) -> dict[str, Any]:
    return {
        "test_acc": m["test"]["acc"],
        "val_acc": m["val"]["acc"],
        "train_acc": m["train"]["acc"],
        "chance": m["chance"],
        "steps": m["steps"],
        "steps_to_90": m["steps_to_90"],
    }


def environment(threads: int, jobs: int) -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "threads": threads,
        "jobs": jobs,
        "malloc": "keep_freed" if allocator_kept() else "default",
    }


__all__ = ["SCHEMA", "run_study"]
