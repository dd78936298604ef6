"""The stages of one run: train (or load a pretrained model), then each experiment.

Each stage's files are written atomically and then its `<stage>.stage.json` marker, keyed by a
hash of everything its results depend on; a stage whose marker matches is reused, so an
interrupted study continues where it stopped.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import torch

import poslens
from poslens.allocator import release_freed_memory
from poslens.data import Task
from poslens.data.task import ShuffledSplits
from poslens.errors import CheckpointError
from poslens.experiments.analyze import analyze
from poslens.experiments.config import ExperimentConfig, resolved
from poslens.experiments.readout import ReferenceCache, eval_images
from poslens.interventions import in_situ
from poslens.io import (
    jsonable,
    load_tensors,
    parse_json,
    read_json,
    read_metadata,
    save_tensors,
    write_json,
)
from poslens.models.vit import ViT
from poslens.precision import autocast
from poslens.study.config import TASK_PREFIX, config_hash
from poslens.study.plan import RunPlan, Stage, stage_hash
from poslens.study.prepared import (
    check_task_fits,
    is_prepared,
    load_prepared,
    prepared_dir,
    prepared_images,
)
from poslens.training.finetune import FineTune

TUNED_FILE = "finetuned.safetensors"  # a fine-tune control's tuned weights, in its run folder


@dataclass(frozen=True)
class StageEvent:
    """A run's progress, for the display: a stage starts, or is done (its seconds, whether its
    finished files were reused, and whether the experiment was skipped on this model)."""

    kind: Literal["start", "done"]
    stage: Stage
    seconds: float = 0.0
    reused: bool = False
    skipped: bool = False

    def __str__(self) -> str:  # how a lost run's last event is named
        return f"{'during' if self.kind == 'start' else 'after'} stage {self.stage.kind}"


class Events(Protocol):
    """Where a run reports its StageEvents."""

    def put(self, event: StageEvent) -> None: ...


@dataclass
class Source:
    """Where one run's model and images come from: a study checkpoint, or pretrained weights
    ("timm:NAME" + a weights file or "hub") with an image folder shuffled by `seed`."""

    checkpoint: Path | None = None
    spec: str = ""
    weights: str = ""
    images: str = ""
    seed: int = 0
    edit: str = ""  # an in-situ control (interventions.in_situ) applied to every model loaded
    finetune: FineTune | None = None  # a fine-tune control: how the studied weights are tuned
    cache: Path | None = None  # a fine-tune control's run folder: its tuned weights are kept there
    prepared: Path | None = None  # the model converted by the study's parent (study/prepared.py)
    not_applied: str | None = field(default=None, init=False, compare=False)  # why not, once loaded
    # what was done
    finetuned: dict[str, Any] | None = field(default=None, init=False, compare=False)

    # The run's images, built once per run and shared by its stages (decoding a large image folder
    # again for every experiment would cost more than the experiment); tasks are read-only.
    _task: Task | None = field(default=None, init=False, compare=False, repr=False)
    _tuned: dict[str, torch.Tensor] | None = field(default=None, init=False, compare=False,
                                                  repr=False)  # fmt: skip
    # the model as loaded (unedited), once per run: each stage gets a deep copy (a timm model's
    # conversion costs seconds per load, a copy a fraction of one); a prepared model is read
    # from its folder per stage instead, so no second copy is held
    _loaded: ViT | None = field(default=None, init=False, compare=False, repr=False)

    @classmethod
    def of(cls, run: RunPlan, run_dir: Path | None = None, out: Path | None = None) -> Source:
        """`run`'s source; with the study's `out`, a pretrained model its parent converted
        there is loaded from that folder (else converted in this process)."""
        if run.pretrained is None:
            return cls(checkpoint=run.checkpoint, edit=run.edit)
        p = run.pretrained
        folder = None if out is None else prepared_dir(out, p, run.images)
        return cls(spec=p.spec, weights=p.weights, images=run.images, seed=run.seed, edit=run.edit,
                   finetune=run.finetune, cache=run_dir,
                   prepared=folder if is_prepared(folder) else None)  # fmt: skip

    def load(self, device: str) -> tuple[ViT, Task]:
        """A fresh model (stages never share one), under the in-situ edit (or fine-tune) where it
        applies, and the run's images."""
        if self.prepared is not None:  # read again per stage: no second copy held meanwhile
            model = load_prepared(self.prepared, device)
        else:
            if self._loaded is None:  # a run's stages all run on its one device
                if self.checkpoint is not None:
                    self._loaded = poslens.load(self.checkpoint, device=device)
                else:
                    self._loaded = converted(self.spec, self.weights, device)
            model = copy.deepcopy(self._loaded)
        if self._task is None:
            if self.checkpoint is not None:
                self._task = poslens.load_task(self.checkpoint)
            elif self.images.startswith(TASK_PREFIX):  # a poslens checkpoint's own task
                task = poslens.load_task(self.images[len(TASK_PREFIX) :])
                check_task_fits(task, model.cfg, self.images)
                self._task = ShuffledSplits(task, self.seed)  # seed 0: the splits in order
            elif self.prepared is not None:
                self._task = prepared_images(self.prepared, self.images, model.cfg.num_classes,
                                             self.seed)  # fmt: skip
            else:
                self._task = poslens.load_images(self.images, self.spec, model, seed=self.seed)
        if self.edit:
            self.not_applied = edit_problem(model, self.edit)  # judged on the unedited model
            if self.not_applied is None and self.finetune is not None:
                self._fine_tuned(model)
            elif self.not_applied is None:
                in_situ.apply(model, self.edit)
        return model, self._task

    def _fine_tuned(self, model: ViT) -> None:
        """`model` given the fine-tuned weights: tuned once per run (on the run's val images) and
        kept in memory and in the run folder, which a later process reads back if its key (this
        source's identity) matches."""
        from poslens.training.finetune import finetune

        assert self.finetune is not None and self._task is not None
        if self._tuned is None:
            key = config_hash(self.identity())
            path = self.cache / TUNED_FILE if self.cache is not None else None
            if path is not None and path.is_file() and read_metadata(path).get("key") == key:
                self._tuned = load_tensors(path)
                self.finetuned = parse_json(read_metadata(path)["finetune"], str(path))
            else:
                x, y = self._task.split("val")
                self.finetuned = finetune(model, x, y, self.finetune)
                self._tuned = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
                if path is not None:
                    meta = {"key": key, "finetune": json.dumps(jsonable(self.finetuned))}
                    save_tensors(path, self._tuned, meta)
                return
        model.load_state_dict(self._tuned)

    def identity(self) -> dict[str, Any]:
        """What the results depend on, for the stage reuse key: the checkpoint (its name holds
        its config hash), or the pretrained model, its weights file (path and size) and images;
        an in-situ control's edit, and a fine-tune's settings."""
        edit = {"in_situ": self.edit} if self.edit else {}
        if self.finetune is not None:
            edit["finetune"] = asdict(self.finetune)
        if self.checkpoint is not None:
            return {"checkpoint": self.checkpoint.name} | edit
        weights = Path(self.weights)
        size = weights.stat().st_size if weights.is_file() else None
        task = self.images.startswith(TASK_PREFIX)
        where = Path(self.images[len(TASK_PREFIX) :] if task else self.images).resolve()
        images = f"{TASK_PREFIX}{where}" if task else str(where)
        # a task's splits are read in a seeded order per analysis seed (data.task.ShuffledSplits)
        order = {"split_order": "seeded"} if task else {}
        return {"model": self.spec, "weights": self.weights, "weights_bytes": size,
                "images": images, "image_seed": self.seed} | order | edit  # fmt: skip


# The last pretrained model this process converted, by (spec, weights file and its size and
# time, device): a worker runs task after task (study.executor), and the next run of the same
# weights (another seed, an in-situ control) copies it instead of converting the weights again.
# One model is kept: the memory of one more copy (88 MB for a ViT-S), not of every model.
_CONVERTED: dict[tuple[object, ...], ViT] = {}


def converted(spec: str, weights: str, device: str) -> ViT:
    """The pretrained model `spec` with `weights`, converted once per process (never edited:
    every user takes a deep copy)."""
    path = Path(weights)
    stat = path.stat() if path.is_file() else None
    key = (spec, weights, None if stat is None else (stat.st_size, stat.st_mtime_ns), device)
    if key not in _CONVERTED:
        _CONVERTED.clear()
        _CONVERTED[key] = poslens.load(spec, weights=weights, device=device)
    return _CONVERTED[key]


def edit_problem(model: ViT, edit: str) -> str | None:
    """Why in-situ control `edit` cannot be built on `model` (None: it can)."""
    if in_situ.get(edit).applies(model.cfg):
        return None
    return f"in-situ control {edit} does not apply to a {model.cfg.posenc} model"


def finished(path: Path, key: str) -> dict[str, Any] | None:
    """The stage record if this stage already finished with the same reuse key."""
    if not path.is_file():
        return None
    try:
        rec = read_json(path, "stage record")
    except CheckpointError:
        return None
    return rec if rec.get("config_hash") == key else None


def train_stage(run: RunPlan, device: str) -> tuple[dict[str, Any], bool]:
    """Train into the run's checkpoint folder, resuming a partial run; (metrics, reused)."""
    from poslens.checkpoint import STATE, is_finished, read_metrics
    from poslens.training.train import train

    ckpt, rc = run.checkpoint, run.run_config
    assert ckpt is not None and rc is not None
    if is_finished(ckpt):
        return read_metrics(ckpt), True
    resume = (ckpt / STATE).is_file()
    return train(rc, ckpt, resume=resume, progress=False, device=device), False


def train_group(
    runs: list[RunPlan], device: str, events: Events | None = None
) -> dict[int, tuple[float, bool]]:
    """Train every seed of one model configuration as one ensemble (the seeds whose checkpoint is
    not finished; a partial one resumes), before their analysis. Returns per seed (seconds of
    training attributed to it, reused)."""
    from poslens.checkpoint import is_finished
    from poslens.training.ensemble import train_ensemble

    todo = [r for r in runs if r.checkpoint is not None and not is_finished(r.checkpoint)]
    first = {r.seed: r.stages[0] for r in runs}
    for r in todo:
        if events is not None:
            events.put(StageEvent("start", first[r.seed]))
    t0 = time.perf_counter()
    if todo:
        cfgs = [r.run_config for r in todo]
        assert all(c is not None for c in cfgs)
        train_ensemble(cfgs, [r.checkpoint for r in todo], resume=True, device=device)  # type: ignore[misc]
    share = (time.perf_counter() - t0) / max(1, len(todo))
    trained = {r.seed for r in todo}
    out = {r.seed: (share if r.seed in trained else 0.0, r.seed not in trained) for r in runs}
    for r in todo:
        if events is not None:
            events.put(StageEvent("done", first[r.seed], round(share, 2), False))
    return out


def baseline_stage(stages: tuple[Stage, ...], model: ViT) -> Stage | None:
    """The first of `stages` that runs on `model` and reads the intact baseline at every site
    (Experiment.reads_baseline, no fixed probe_block, position_removal probed), or None."""
    from poslens.experiments import position_removal
    from poslens.experiments.registry import get

    for s in stages:
        c, exp = s.config, get(s.kind)
        if s.skipped_for(model.cfg.posenc) or exp.applies(model) is not None or c is None:
            continue
        unprobed = isinstance(c, position_removal.Config) and not c.probes
        if exp.reads_baseline and c.probe_block < 0 and not unprobed:
            return s
    return None


@torch.no_grad()
def load_stage(
    source: Source,
    ecfg: ExperimentConfig,
    device: str,
    stages: tuple[Stage, ...] = (),
    references: ReferenceCache | None = None,
) -> dict[str, Any]:
    """A pretrained run's first stage: load the model and images, and measure test accuracy on the
    evaluation images (the pretrained counterpart of a trained model's training summary).

    Where one of the run's experiment `stages` reads the intact baseline (baseline_stage), the
    accuracy is read from that baseline, measured here into `references` for the experiment to
    reuse: the same clean pass, so the same number, and one forward pass fewer per run."""
    model, data = source.load(device)
    ecfg = resolved(ecfg, model)
    x, y = eval_images(data, ecfg)
    dev, n_classes = model.head.weight.device, model.cfg.num_classes
    edit = {"in_situ": source.edit, "not_applied": source.not_applied} if source.edit else {}
    if source.finetuned is not None:
        edit["finetune"] = source.finetuned
    # a control whose edit does not fit this model is dropped from the study: nothing to measure
    first = baseline_stage(stages, model) if references is not None else None
    correct = None
    if n_classes and source.not_applied is None and first is not None:
        from poslens.experiments.readout import baseline
        from poslens.experiments.registry import get

        assert first.config is not None
        cfg = resolved(first.config, model)
        x, y = eval_images(data, cfg)  # the experiment's images: the accuracy is over these
        sites = range(model.cfg.depth + 1)
        clean = get(first.kind).baseline_clean_ssdc
        base = baseline(model, x, y, cfg, sites, cache=references, clean_ssdc=clean)
        correct = int(base.correct.sum())
    elif n_classes and source.not_applied is None:
        with autocast(dev, ecfg.precision):  # the precision of the study's forward passes
            correct = sum(
                int((model(x[i : i + ecfg.batch_size].to(dev)).argmax(-1).cpu() == y[i : i + ecfg.batch_size]).sum())
                for i in range(0, len(x), ecfg.batch_size)
            )  # fmt: skip
    return {  # a backbone without classifier (num_classes=0) has no accuracy: null
        "model": source.spec,
        "weights": source.weights,
        "images": source.images,
        "posenc": model.cfg.posenc,
        "scale": model.cfg.scale,
        "test_acc": None if correct is None else correct / len(x),
        "chance": 1 / n_classes if n_classes else None,
        "n_images": len(x),
        "params": sum(p.numel() for p in model.parameters()),
    } | edit


def experiment_stage(
    stage: Stage,
    source: Source,
    run_dir: Path,
    out: Path,
    device: str,
    references: ReferenceCache | None = None,
) -> dict[str, Any]:
    """Run one experiment on a run's model and save its files (the marker is the caller's).

    references: the run's intact references, measured by its first experiment that needs one and
    reused, exactly, by the later ones (readout.ReferenceCache; keyed by weights, images, config).
    """
    assert stage.config is not None
    model, data = source.load(device)
    name = stage.kind
    record = analyze(
        model, data, [name], [stage.config], run_dir, formats=("png", "svg"), references=references
    )[name]
    if "skipped" in record:
        return {"experiment": name, "skipped": record["skipped"]}
    files = [str(f.relative_to(out)) for f in record["files"]]
    return {"experiment": name, "files": files, "headline": record["headline"]}


def run_one(
    run: RunPlan, out: Path, device: str, threads: int, events: Events | None = None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Train or load (or reuse) one model/seed and run every experiment on it, stage by stage.

    Returns the run's entry for results.json and its stage timings.
    """
    if threads:
        torch.set_num_threads(threads)
    run_dir = out / "runs" / run.model / f"seed{run.seed}"
    source = Source.of(run, run_dir, out)
    entry: dict[str, Any] = {}
    posenc = run.model
    not_applied: str | None = None  # a pretrained model that its in-situ edit does not fit
    timings: list[dict[str, Any]] = []
    references: ReferenceCache = {}  # shared by this run's experiment stages
    for st in run.stages:
        if events is not None:
            events.put(StageEvent("start", st))
        t0 = time.perf_counter()
        extra: dict[str, Any] = {}
        if st.kind == "train":
            assert run.checkpoint is not None
            metrics, reused = train_stage(run, device)
            extra["train_seconds"] = round(float(metrics["train_seconds"]), 1)
            entry = {
                "seed": run.seed,
                "checkpoint": str(run.checkpoint.relative_to(out)),
                "config_hash": run.checkpoint.name.rsplit("_", 1)[1],
                "train": train_summary(metrics),
                "experiments": {},
                "skipped": {},
            }
        elif st.kind == "load":
            assert st.config is not None
            c = st.config
            key = config_hash(
                source.identity()
                | {"n_images": c.n_images, "batch_size": c.batch_size, "precision": c.precision}
            )
            marker = run_dir / "load.stage.json"
            record = finished(marker, key)
            reused = record is not None
            if record is None:
                record = load_stage(source, c, device, run.stages[1:], references)
                record |= {"config_hash": key}
                write_json(marker, jsonable(record))
            posenc = record["posenc"]
            not_applied = record.get("not_applied")
            entry = {
                "seed": run.seed,
                "checkpoint": source.spec,
                "config_hash": key,
                "train": None,
                "pretrained": {k: v for k, v in record.items() if k != "config_hash"},
                "experiments": {},
                "skipped": {},
            }
        else:
            marker = run_dir / f"{st.kind}.stage.json"
            skip = st.skipped_for(posenc) or not_applied is not None
            key = stage_hash(st, skip, source.identity())
            record = finished(marker, key)
            reused = record is not None
            if record is None:
                if not_applied is not None:
                    record = {"skipped": not_applied}
                elif skip:
                    record = {"skipped": f"not run on {run.model} in this study (study.only)"}
                else:
                    record = experiment_stage(st, source, run_dir, out, device, references)
                record["config_hash"] = key
                write_json(marker, jsonable(record))
            if "skipped" in record:
                entry["skipped"][st.kind] = record["skipped"]
            else:
                entry["experiments"][st.kind] = {
                    "headline": record["headline"],
                    "files": record["files"],
                }
        # the heap keeps its peak (allocator.py): its free part goes back after each stage, or
        # the fragments of one stage's peak add to the next one's (2.0 -> 2.5 GB over a ViT-S's
        # stages)
        release_freed_memory()
        seconds = time.perf_counter() - t0
        timings.append(
            {"stage": st.kind, "model": run.model, "seed": run.seed,
             "seconds": round(seconds, 2), "reused": reused} | extra
        )  # fmt: skip
        if events is not None:
            skipped = st.kind != "train" and "skipped" in record
            events.put(StageEvent("done", st, round(seconds, 2), reused, skipped))
    return entry, timings


def train_summary(m: dict[str, Any]) -> dict[str, Any]:
    """The training numbers results.json keeps per run."""
    return {
        "test_acc": m["test"]["acc"],
        "val_acc": m["val"]["acc"],
        "train_acc": m["train"]["acc"],
        "chance": m["chance"],
        "steps": m["steps"],
        "steps_to_90": m["steps_to_90"],
        "stopped_at": m.get("stopped_at"),  # early stopping at train.stop_acc (None: all steps)
    }


__all__ = ["Source", "StageEvent", "run_one"]
