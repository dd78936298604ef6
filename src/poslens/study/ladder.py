"""`poslens study --preset ladder`: the study repeated along a scale ladder of trained models.

The default study's models (width 32, 4 blocks, 6 x 6 grid) are far from a ViT-B/16 (width 768,
12 blocks, 14 x 14 grid). The ladder asks where the original's mechanisms start to appear by
changing one thing at a time from that base rung:

- grid 6 -> 10 -> 14 at width 32 (a table with one direction per cell needs G^2 directions, a
  row + column code 2G: does APE factor position once G^2 outgrows the width?), and one wider
  rung (grid 14, width 64);
- depth 4 -> 8 -> 12 for RoPE (rebuilding needs blocks after the withheld window; the withheld
  window grows with depth as in the original, blocks 0..depth/2-1);
- the `quadrant` relation (two one-axis label bits) beside the default `sector` relation.

Each rung is a whole study (`run_study`) in `OUT/rungs/NAME/`, with its own results.json and
report; this module runs them in turn (rerunning continues from the finished stages) and writes
`OUT/results.json` (every rung's claims and aggregates, schema poslens.ladder/1), `OUT/ladder.csv`,
the ladder figures and `OUT/report.html` / `report.md`.
"""

from __future__ import annotations

import csv
import io
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from poslens._config import one_of
from poslens._version import __version__
from poslens.data.config import RELATIONS
from poslens.errors import ConfigError
from poslens.experiments import position_removal
from poslens.experiments import sae_causal as sae
from poslens.io import atomic_write, jsonable, locked, write_json
from poslens.limits import check_count
from poslens.report.ladder import SCHEMA
from poslens.study.claims import rebuild
from poslens.study.config import StudyConfig, preset
from poslens.study.ladder_figures import AXES, ladder_figures
from poslens.study.plan import experiment_configs, run_config
from poslens.study.result import ClaimResult, EffectTest, claims_of
from poslens.study.run import environment, run_study
from poslens.study.slurm import SlurmOptions
from poslens.study.verdicts import DESCRIPTIVE
from poslens.training.config import PRESETS as MODEL_PRESETS
from poslens.training.config import preset as model_preset

LADDER_BASES = ("default", "quick")  # the preset each rung starts from (quick: smoke tests)
PATCH = 4  # the study's patch size: a G x G grid is G * PATCH pixels
# The original's ViT-B/16 on each numeric axis (METHODS.md, "Orientation"), marked in the figures
VIT_B = {"grid": 14, "width": 768, "depth": 12}
# trained: no weight edit plants rebuilding (the rebuild rules' own control models)
REBUILD_CONTROLS = tuple(c.model for c in rebuild.REBUILD_CONTROLS)


@dataclass(frozen=True)
class Rung:
    """One step of the ladder: a model shape and task, the study models it trains and the
    trained calibration models beside them (the others are calibrated in situ)."""

    name: str
    grid: int
    width: int = 32
    depth: int = 4
    relation: str = "sector"
    ladders: tuple[str, ...] = ()  # the axes this rung lies on (AXES)
    rotary_only: bool = False  # only the rotary study models (the depth ladder asks about RoPE)
    calibration: tuple[str, ...] = ()  # trained calibration models of this rung

    def __post_init__(self) -> None:
        where = f"ladder rung {self.name!r}"
        for name in ("grid", "width", "depth"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 2:
                raise ConfigError(f"{where}: {name} must be a whole number >= 2, got {value!r}")
        if self.relation not in RELATIONS:
            raise ConfigError(f"{where}: relation must be one of {', '.join(RELATIONS)}")
        bad = [a for a in self.ladders if a not in AXES]
        if bad:
            raise ConfigError(f"{where}: ladders must be among {', '.join(AXES)}, got {bad}")

    @property
    def train_set(self) -> tuple[str, ...]:
        """The rung's shape as `poslens train --set` overrides, applied after the base preset's."""
        return (
            f"data.image_size={self.grid * PATCH}",
            f"model.dim={self.width}",
            f"model.depth={self.depth}",
            f'data.relation="{self.relation}"',
        )

    @property
    def analysis_set(self) -> tuple[str, ...]:
        """The rebuilding window grows with depth as in the original (blocks 0..depth/2-1 of 12
        there): the windows run block 0 alone and that window."""
        last = max(self.depth // 2 - 1, 0)
        return (f"windows.prefix_ks={','.join(str(k) for k in sorted({0, last}))}",)

    def describe(self) -> str:
        task = "" if self.relation == "sector" else f", {self.relation} relation"
        return (f"grid {self.grid}x{self.grid}, width {self.width}, depth {self.depth}"
                f"{task}")  # fmt: skip


# The ladder (docs/ladder.md): the base rung g6 is the default study's shape. The depth rungs train
# the rebuild claim's trained controls (nothing else calibrates it); every other claim is
# calibrated in situ on each rung's own models.
LADDER = (
    Rung("g6", 6, ladders=("grid", "depth", "task"), calibration=REBUILD_CONTROLS),
    Rung("g10", 10, ladders=("grid",)),
    Rung("g14", 14, ladders=("grid", "width")),
    Rung("g14_w64", 14, width=64, ladders=("width",)),
    Rung("d8", 6, depth=8, ladders=("depth",), rotary_only=True, calibration=REBUILD_CONTROLS),
    Rung("d12", 6, depth=12, ladders=("depth",), rotary_only=True, calibration=REBUILD_CONTROLS),
    Rung("g6_quadrant", 6, relation="quadrant", ladders=("task",)),
)
LADDER_MODELS = ("ape", "rope_axial")  # the study models of every rung (rope_mixed: --models)


def _rotary(model: str) -> bool:
    return model_preset(model).model.posenc.startswith("rope")


@dataclass(frozen=True)
class LadderConfig:
    """The ladder: its rungs, the study models each trains, seeds per model and the base preset
    whose training and analysis settings every rung starts from."""

    rungs: tuple[Rung, ...] = LADDER
    models: tuple[str, ...] = LADDER_MODELS
    seeds: int = 3
    base: str = "default"
    in_situ: bool = True
    # other StudyConfig fields for every rung; its train_set / analysis_set items come after the
    # base preset's and before the rung's own
    changes: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.base not in LADDER_BASES:
            raise ConfigError(f"ladder.base must be one of {', '.join(LADDER_BASES)}")
        if not self.rungs:
            raise ConfigError("ladder.rungs must name at least one rung")
        names = [r.name for r in self.rungs]
        if len(set(names)) != len(names):
            raise ConfigError(f"ladder.rungs lists a rung twice: {', '.join(names)}")
        if not isinstance(self.seeds, int) or isinstance(self.seeds, bool) or self.seeds < 1:
            raise ConfigError(f"ladder.seeds must be a whole number >= 1, got {self.seeds!r}")
        check_count("ladder.seeds", self.seeds, "seeds")
        if not self.models:
            raise ConfigError("ladder.models must name at least one study model")
        for m in self.models:
            one_of("ladder.models", m, MODEL_PRESETS)
        empty = [r.name for r in self.rungs if not self.rung_models(r)]
        if empty:
            raise ConfigError(
                f"ladder.models ({', '.join(self.models) or 'none'}) leaves rung(s) "
                f"{', '.join(empty)} without a study model (depth rungs take rotary models only)"
            )
        for r in self.rungs:  # every rung's config error before any work
            study = self.study_config(r)
            try:
                for m in study.models:
                    run_config(study, m, seed=0)
                experiment_configs(study)
            except ConfigError as e:
                raise ConfigError(f"ladder rung {r.name}: {e}") from None

    def rung_models(self, rung: Rung) -> tuple[str, ...]:
        """The study models this rung trains (without its calibration models)."""
        return tuple(m for m in self.models if not rung.rotary_only or _rotary(m))

    def study_config(self, rung: Rung) -> StudyConfig:
        """The rung as a study: the base preset, the rung's models, shape and windows."""
        base = preset(self.base)
        study = self.rung_models(rung)
        models = (*study, *(m for m in rung.calibration if m not in study))
        # train_set / analysis_set: the base preset's, then the ladder's own, then the rung's
        others = {k: v for k, v in self.changes.items() if k not in ("train_set", "analysis_set")}
        try:
            return replace(
                base,
                models=models,
                seeds=self.seeds,
                train_set=(*base.train_set, *self.changes.get("train_set", ()), *rung.train_set),
                analysis_set=(
                    *base.analysis_set,
                    *self.changes.get("analysis_set", ()),
                    *rung.analysis_set,
                ),
                in_situ=self.in_situ,
                **others,
            )
        except ConfigError as e:
            raise ConfigError(f"ladder rung {rung.name}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        return {
            "rungs": [asdict(r) for r in self.rungs],
            "models": list(self.models),
            "seeds": self.seeds,
            "base": self.base,
            "in_situ": self.in_situ,
            "changes": dict(self.changes),
        }


def ladder_preset(rungs: str | None = None, **changes: Any) -> LadderConfig:
    """The ladder preset, optionally with only some rungs (comma-separated names, in ladder
    order) and other LadderConfig fields changed."""
    chosen = LADDER
    if rungs:
        names = [n.strip() for n in rungs.split(",") if n.strip()]
        known = {r.name: r for r in LADDER}
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise ConfigError(f"ladder rungs must be among {', '.join(known)}; got {rungs!r}")
        chosen = tuple(r for r in LADDER if r.name in names)
    return LadderConfig(rungs=chosen, **changes)


# ---------------------------------------------------------------------------------------- run


def run_ladder(
    cfg: LadderConfig,
    out: str | Path,
    progress: bool = True,
    device: str = "cpu",
    threads: int = 0,
    jobs: int = 1,
    slurm: SlurmOptions | None = None,
    say: Callable[[str], object] = print,
) -> dict[str, Any]:
    """Run (or continue) every rung's study into OUT/rungs/NAME, then write the ladder's
    results.json, ladder.csv, figures and report; returns the results.json content."""
    out = Path(out)
    start = time.perf_counter()
    rung_results: dict[str, dict[str, Any]] = {}
    seconds: dict[str, float] = {}
    with locked(out, "ladder"):
        for i, rung in enumerate(cfg.rungs, 1):
            say(f"ladder rung {i}/{len(cfg.rungs)}: {rung.name} ({rung.describe()})")
            t = time.perf_counter()
            rung_results[rung.name] = run_study(
                cfg.study_config(rung), out / "rungs" / rung.name, progress=progress,
                device=device, threads=threads, jobs=jobs, slurm=slurm,
            )  # fmt: skip
            seconds[rung.name] = round(time.perf_counter() - t, 1)
        results = ladder_results(cfg, rung_results)
        results["environment"] = environment(threads or torch.get_num_threads(), jobs)
        results["config"]["device"] = device
        results["timings"] = {
            "total_seconds": round(time.perf_counter() - start, 1),
            "rungs": seconds,
            # the rung's own study time (0 where every stage was reused)
            "rung_study_seconds": {
                n: r["timings"]["total_seconds"] for n, r in rung_results.items()
            },
        }
        results["figures"] = ladder_figures(out, results)
        results = jsonable(results)
        write_json(out / "results.json", results)
        atomic_write(out / "ladder.csv", lambda p: p.write_text(ladder_csv(results)))
        from poslens.report import write_report

        write_report(out, results)
    return results


# -------------------------------------------------------------------------------- assembly

# What the ladder's predictions read per rung: (id, label, study model's encoding, headline Key). The APE table's row + column share of variance and the SAE's latent kinds at the
# site the claims read.
SAE_SITE = "early"
PREDICTIONS = (
    ("table_rowcol_share", "APE table: row + column share of variance", "ape",
     position_removal.TABLE_ROWCOL_SHARE),
    *((f"sae_latents_{kind}", f"SAE {kind} latents", "ape", sae.latents_key(SAE_SITE, kind))
      for kind in ("row", "col", "cell", "mixed")),
)  # fmt: skip


def rowcol_chance(grid: int) -> float:
    """The row + column share of a table of independent random cells on a G x G grid:
    (G - 1) / (G^2 - 1) per axis of the two-way decomposition's degrees of freedom, 2 / (G + 1)
    in all (0.29 at G = 6, 0.13 at G = 14): what the table's share must exceed to mean more than
    a cell code."""
    return 2 / (grid + 1)


def _test_summary(t: EffectTest) -> dict[str, Any]:
    keep = ("n", "seeds", "mean", "ci", "lower", "upper", "p_holm", "values", "detected")
    d = t.to_dict()
    return {k: d.get(k) for k in keep}


def _rung_claim(cl: ClaimResult) -> dict[str, Any]:
    """One claim level on one rung: its verdict, the study models' tests and the controls'."""
    cal = cl.calibration
    return {
        "verdict": cl.verdict,
        "qualifier": cl.qualifier,
        "summary": cl.summary,
        "threshold": cl.primary.threshold,
        "models": {m: _test_summary(t) for m, t in cl.primary.models.items()},
        "controls": [
            {
                "model": k.model,
                "role": k.role,
                "as_designed": k.as_designed,
                "measured": k.measured,
                **_test_summary(k.test),
            }
            for k in cal.controls
        ],
        "calibration": {
            "complete": cal.complete,
            "passed": cal.passed,
            "sensitivity": cal.sensitivity,
            "specificity": cal.specificity,
        },
    }


def _training(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Per seed, how a trained model's training ended: test and validation accuracy and the step
    early stopping ended at (None: it ran every step, never meeting train.stop_acc). None for
    runs that record no training (pretrained weights)."""
    trains = [r.get("train") for r in runs]
    if not trains or any(t is None for t in trains):
        return None
    return {
        "chance": trains[0]["chance"],
        "steps": trains[0]["steps"],
        "test_acc": [t["test_acc"] for t in trains],
        "val_acc": [t["val_acc"] for t in trains],
        "stopped_at": [t["stopped_at"] for t in trains],
    }


def ladder_results(cfg: LadderConfig, rung_results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The ladder's results from each rung's study results: every rung (its shape, models,
    claims and aggregates), every claim level across rungs, and the predictions' numbers."""
    rungs = []
    for rung in cfg.rungs:
        r = rung_results[rung.name]
        folder = f"rungs/{rung.name}"
        rungs.append({
            **asdict(rung),
            "folder": folder,
            "report": f"{folder}/report.html",
            "g2_per_width": rung.grid**2 / rung.width,
            "rowcol_chance": rowcol_chance(rung.grid),
            "models": {m: {**{k: e.get(k) for k in ("posenc", "scale", "in_situ", "aggregate")},
                           "training": None if e.get("in_situ") else _training(e["runs"])}
                       for m, e in r["models"].items()},
            "claims": r["claims"],
        })  # fmt: skip
    claims = []
    judged = {r.name: claims_of(rung_results[r.name]) for r in cfg.rungs}
    first = judged[cfg.rungs[0].name]
    for r in cfg.rungs:  # the rules are the same on every rung, in the same order
        assert [(c.id, c.level) for c in judged[r.name]] == [(c.id, c.level) for c in first]
    for j, cl in enumerate(first):
        claims.append({
            "id": cl.id, "claim": cl.claim, "level": cl.level,
            "level_name": cl.level_name, "title": cl.title,
            "effect": cl.primary.effect, "descriptive": cl.verdict == DESCRIPTIVE,
            "reference": cl.reference.to_dict(),
            "rungs": {r.name: _rung_claim(judged[r.name][j]) for r in cfg.rungs},
        })  # fmt: skip
    predictions = []
    for pid, label, model, key in PREDICTIONS:
        per = {}
        for rung in cfg.rungs:
            agg = rung_results[rung.name]["models"].get(model, {}).get("aggregate", {})
            per[rung.name] = agg.get(key.experiment, {}).get(key)  # mean, se, n, values
        predictions.append({"id": pid, "label": label, "model": model,
                            "experiment": key.experiment, "key": key.text,
                            "rungs": per})  # fmt: skip
    return {
        "schema": SCHEMA,
        "poslens_version": __version__,
        "created": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "config": cfg.to_dict(),
        "vit_b": VIT_B,
        "rungs": rungs,
        "claims": claims,
        "predictions": predictions,
    }


CSV_COLUMNS = ("rung", "grid", "width", "depth", "relation", "claim", "level", "model", "role",
               "n", "mean", "lower", "upper", "verdict", "calibration_passed")  # fmt: skip


def ladder_csv(results: dict[str, Any]) -> str:
    """One row per rung, claim level and study model or control."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    shape = {r["name"]: r for r in results["rungs"]}
    for cl in results["claims"]:
        for name, rc in cl["rungs"].items():
            r = shape[name]
            rows = [(m, "study", t) for m, t in rc["models"].items()]
            rows += [(k["model"], k["role"], k) for k in rc["controls"]]
            for model, role, t in rows:
                w.writerow([name, r["grid"], r["width"], r["depth"], r["relation"], cl["id"],
                            cl["level"], model, role, t["n"], t["mean"], t["lower"], t["upper"],
                            rc["verdict"], rc["calibration"]["passed"]])  # fmt: skip
    return buf.getvalue()


__all__ = [
    "LADDER",
    "LADDER_MODELS",
    "SCHEMA",
    "LadderConfig",
    "Rung",
    "ladder_preset",
    "ladder_results",
    "rowcol_chance",
    "run_ladder",
]
