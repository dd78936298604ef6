"""StudyConfig and the three presets: what `poslens study` trains, runs and how large."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from poslens._config import ANALYSIS_PRECISIONS, AUTO, experiment_sets, one_of, positive_int
from poslens.errors import ConfigError
from poslens.experiments import EXPERIMENTS
from poslens.limits import check_count
from poslens.study.claims import models_read, study_models, trained_controls
from poslens.training.config import PRESETS as MODEL_PRESETS

PRESETS = ("quick", "default", "confirm", "paper")

# Experiments whose claims the report states; the rest run in the paper preset.
TASK_PREFIX = "task:"  # study.images naming a poslens checkpoint's task instead of an image folder
# The accuracy gate's retries at most: reserve seeds slot + 1000 * attempt stay below 1000 * 10
MAX_GATE_RETRIES = 9
CORE = ("depth_profile", "position_removal", "axis_map", "windows", "heads", "sae_causal")


@dataclass(frozen=True)
class Pretrained:
    """A pretrained model of the study: its key in results.json, timm spec and weights."""

    key: str  # NAME
    spec: str  # timm:NAME
    weights: str  # a .safetensors file, or "hub"


@dataclass(frozen=True)
class StudyConfig:
    """Everything that decides a study's results (the output folder and progress do not).

    train_set / analysis_set are `section.field=value` / `experiment.field=value` overrides, the
    same syntax as `poslens train --set` and `poslens analyze --set`, applied to every model;
    a train_set item prefixed with an encoding (`ape:train.steps=2000`) applies to that one only.

    The string fields are what results.json records and hashes; `__post_init__` parses them once
    into the typed values the plan reads (`pretrained_models`, `only_models`,
    `analysis_overrides`).
    """

    preset: str = "default"
    models: tuple[str, ...] = ("ape", "rope_axial")
    seeds: int = 2
    # the first seed: a study runs seeds seed_start .. seed_start + seeds - 1, so a replication
    # on a disjoint seed set is `seed_start=5` (seed i trains and analyses the same either way)
    seed_start: int = 0
    # "MODEL=N": that study model (and its in-situ controls) runs N seeds from seed_start instead
    # of `seeds`, e.g. more seeds for the one model a level's power asks for (study/power.py)
    model_seeds: tuple[str, ...] = ()
    task: str = "relation"
    experiments: tuple[str, ...] = CORE
    train_set: tuple[str, ...] = ()
    analysis_set: tuple[str, ...] = ()
    n_images: int = 300
    probe_images: int = 150
    batch_size: int = 0  # 0: chosen per model and device (limits.auto_batch_size)
    ssdc_images: int = 0  # SSDC on the first ssdc_images of n_images (0: all)
    precision: str = "fp32"  # the experiments' forward passes: fp32, bf16 / fp16 (autocast), auto
    # "experiment=model,model": run that experiment only on those models (the others record why);
    # a name is a study model or an encoding (so "sae_causal=ape" covers a pretrained APE ViT)
    only: tuple[str, ...] = ()
    # Pretrained models studied instead of trained ones: "timm:NAME=WEIGHTS" (a local .safetensors
    # file, or "hub") or "hf:DIR" (a Hugging Face ViT / DeiT folder, studied as DIR's last name).
    # `images` is then their image folder and `seeds` are analysis seeds: the image subset, RPI
    # permutation and random draws change with the seed, the weights do not.
    # `images` may also be "task:CHECKPOINT": that poslens checkpoint's own task (its fixed val and
    # test splits, no preprocessing), to study a model exported with `poslens export` on its data;
    # seed 0 reads each split in order (the native study's images), seed s > 0 in a seeded order.
    pretrained: tuple[str, ...] = ()
    images: str = ""
    # In-situ controls (interventions.in_situ): each judged model under the weight edits its
    # rules name, run through the same experiments as the model itself; the only controls of a
    # pretrained study
    in_situ: bool = True
    # The rebuild claim's fine-tuned controls (training.finetune), for pretrained RoPE models:
    # the studied weights fine-tuned finetune_steps steps (0: none) at peak finetune_lr, batches
    # of finetune_batch, on the study's images (their val half), rotations withheld in held-out
    # windows (positive) or in late blocks only (negative)
    finetune_steps: int = 0
    finetune_lr: float = 1e-4
    finetune_batch: int = 32
    # The accuracy gate (study/gate.py): a trained seed that never reached its train.stop_acc is
    # retrained from reserve seeds (slot + 1000 * attempt), up to gate_retries times (0: off)
    gate_retries: int = 0

    def seeds_of(self, model: str) -> tuple[int, ...]:
        """The seeds `model` runs (study.model_seeds, else study.seeds), in order."""
        n = self._model_seeds.get(model, self.seeds)  # type: ignore[attr-defined]
        return tuple(range(self.seed_start, self.seed_start + n))

    @property
    def n_runs(self) -> int:
        """Model-seed runs of the study models (their in-situ controls not counted)."""
        return sum(len(self.seeds_of(m)) for m in self.model_keys)

    def __post_init__(self) -> None:
        one_of("study.preset", self.preset, PRESETS)
        pretrained = tuple(Pretrained(*parse_pretrained(item)) for item in self.pretrained)
        if self.pretrained:
            keys = [p.key for p in pretrained]
            if len(set(keys)) != len(keys):
                raise ConfigError(f"study.pretrained lists a model twice: {', '.join(keys)}")
            if not self.images:
                raise ConfigError(
                    "study.images must name an image folder when study.pretrained is set"
                )
        else:
            if self.images:
                raise ConfigError("study.images goes with study.pretrained (pretrained models)")
            if not self.models:
                raise ConfigError("study.models must name at least one encoding")
            for m in self.models:
                one_of("study.models", m, MODEL_PRESETS)
            if len(set(self.models)) != len(self.models):
                raise ConfigError(f"study.models lists an encoding twice: {', '.join(self.models)}")
        positive_int("study.seeds", self.seeds)
        check_count("study.seeds", self.seeds, "seeds")
        positive_int("study.seed_start", self.seed_start, allow_zero=True)
        check_count("study.seed_start", self.seed_start + self.seeds, "seeds")
        for e in self.experiments:
            one_of("study.experiments", e, EXPERIMENTS)
        for name in ("n_images", "probe_images"):
            positive_int(f"study.{name}", getattr(self, name))
        positive_int("study.batch_size", self.batch_size, allow_zero=True)
        for name in ("n_images", "probe_images"):
            check_count(f"study.{name}", getattr(self, name), "images")
        only: dict[str, frozenset[str]] = {}
        for item in self.only:
            exp, eq, models = item.partition("=")
            if not eq or exp not in self.experiments or not models:
                raise ConfigError(
                    f"study.only entries look like EXPERIMENT=MODEL,MODEL with a study "
                    f"experiment; got {item!r}"
                )
            only[exp] = frozenset(m.strip() for m in models.split(","))
        if self.probe_images > self.n_images:
            raise ConfigError(
                f"study.probe_images ({self.probe_images}) exceeds study.n_images ({self.n_images})"
            )
        positive_int("study.ssdc_images", self.ssdc_images, allow_zero=True)
        if self.ssdc_images > self.n_images:
            raise ConfigError(
                f"study.ssdc_images ({self.ssdc_images}) exceeds study.n_images ({self.n_images})"
            )
        one_of("study.precision", self.precision, ANALYSIS_PRECISIONS)
        if not isinstance(self.in_situ, bool):
            raise ConfigError(f"study.in_situ must be true or false, got {self.in_situ!r}")
        if not isinstance(self.finetune_steps, int) or self.finetune_steps < 0:
            raise ConfigError(
                f"study.finetune_steps must be a whole number >= 0, got {self.finetune_steps!r}"
            )
        if not (isinstance(self.finetune_lr, int | float) and self.finetune_lr > 0):
            raise ConfigError(f"study.finetune_lr must be positive, got {self.finetune_lr!r}")
        positive_int("study.finetune_batch", self.finetune_batch)
        if (
            not isinstance(self.gate_retries, int)
            or isinstance(self.gate_retries, bool)
            or not 0 <= self.gate_retries <= MAX_GATE_RETRIES
        ):
            raise ConfigError(f"study.gate_retries must be a whole number from 0 to "
                              f"{MAX_GATE_RETRIES}, got {self.gate_retries!r}")  # fmt: skip
        if self.gate_retries and self.pretrained:
            raise ConfigError("study.gate_retries goes with trained models: a pretrained study "
                              "trains nothing to retry")  # fmt: skip
        if self.finetune_steps and not self.pretrained:
            raise ConfigError(
                "study.finetune_steps goes with study.pretrained: trained studies calibrate the "
                "rebuild claim on models trained for it (rope_rebuild, rope_late)"
            )
        # parsed once (not fields: results.json records the strings above)
        object.__setattr__(self, "_pretrained", pretrained)
        object.__setattr__(self, "_model_seeds", self._parse_model_seeds(pretrained))
        object.__setattr__(self, "_only", only)
        object.__setattr__(self, "_sets", experiment_sets(self.analysis_set, "study.analysis_set"))

    def _parse_model_seeds(self, pretrained: tuple[Pretrained, ...]) -> dict[str, int]:
        """study.model_seeds as model -> seed count; ConfigError naming the field otherwise."""
        keys = tuple(p.key for p in pretrained) if self.pretrained else self.models
        out: dict[str, int] = {}
        for item in self.model_seeds:
            model, eq, count = str(item).partition("=")
            model = model.strip()
            try:
                n = int(count)
            except ValueError:
                n = -1
            if not eq or model not in keys or n < 1:
                raise ConfigError(
                    f"study.model_seeds entries look like MODEL=N with a study model "
                    f"({', '.join(keys)}) and N >= 1; got {item!r}"
                )
            if model in out:
                raise ConfigError(f"study.model_seeds gives {model} twice")
            check_count(f"study.model_seeds ({model})", self.seed_start + n, "seeds")
            out[model] = n
        return out

    @property
    def pretrained_models(self) -> tuple[Pretrained, ...]:
        """study.pretrained parsed: the pretrained models, in order."""
        return self._pretrained  # type: ignore[attr-defined, no-any-return]

    @property
    def only_models(self) -> dict[str, frozenset[str]]:
        """study.only parsed: experiment -> the models (study names or encodings) it runs on."""
        return self._only  # type: ignore[attr-defined, no-any-return]

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @property
    def model_keys(self) -> tuple[str, ...]:
        """The study's models: encodings to train, or the names of the pretrained models."""
        if self.pretrained:
            return tuple(p.key for p in self.pretrained_models)
        return self.models

    def train_changes(self, model: str) -> list[str]:
        """train_set items for one model: unprefixed ones, then those prefixed `model:`."""
        common = [t for t in self.train_set if _model_prefix(t) is None]
        own = [t.split(":", 1)[1] for t in self.train_set if _model_prefix(t) == model]
        return common + own

    @property
    def analysis_sets(self) -> dict[str, dict[str, str]]:
        """analysis_set parsed: experiment -> {field: text} (experiments the study does not run
        are ignored, so a preset's settings survive a narrower study.experiments)."""
        return self._sets  # type: ignore[attr-defined, no-any-return]


def _model_prefix(item: str) -> str | None:
    """ "ape:train.steps=2000" -> "ape" (an override for one encoding only); else None."""
    head, colon, _ = item.partition(":")
    return head if colon and head in MODEL_PRESETS else None


def parse_pretrained(item: str) -> tuple[str, str, str]:
    """ "timm:NAME=WEIGHTS" -> (NAME, "timm:NAME", WEIGHTS); "hf:DIR" (a Hugging Face folder)
    -> (DIR's last name, "hf:DIR", DIR/model.safetensors); ConfigError naming the field."""
    if item.startswith("hf:"):
        folder = Path(item[len("hf:") :])
        if not folder.name:
            raise ConfigError(f"study.pretrained entry {item!r}: hf:DIR needs a folder name")
        return folder.name, item, str(folder / "model.safetensors")
    spec, eq, weights = item.partition("=")
    name = spec[len("timm:") :] if spec.startswith("timm:") else ""
    if not eq or not name or not weights:
        raise ConfigError(
            f"study.pretrained entries look like timm:NAME=WEIGHTS (a .safetensors file or hub) "
            f"or hf:DIR; got {item!r}"
        )
    return name, spec, weights


def config_hash(d: dict[str, Any]) -> str:
    """Short stable hash of a JSON-able config (the key for reusing a trained checkpoint)."""
    text = json.dumps(d, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


# The study models and the calibration models of every claim, derived from the rules
# (study/claims/): mechanism present (positive) or absent (negative) by design. Each is trained
# with every seed; the paper preset also trains the optional ones (sincos).
STUDY_MODELS = study_models()
CALIBRATION_MODELS = trained_controls()
ALL_CALIBRATION_MODELS = trained_controls(optional=True)


def claims_only(models: tuple[str, ...], experiments: tuple[str, ...]) -> tuple[str, ...]:
    """`only` entries running each experiment on the models some claim reads through it (in the
    preset's model order), and the depth profile on the study models (the report draws it)."""
    out = []
    for e in experiments:
        read = set(models_read(e)) | (set(STUDY_MODELS) if e == "depth_profile" else set())
        out.append(f"{e}={','.join(m for m in models if m in read)}")
    return tuple(out)


# The default preset's model and training (docs/study.md, "How the default was chosen"): width 32,
# 4 blocks, 24 px images (a 6 x 6 grid), lr 6e-3 under a cosine over at most 2,000 steps, stopped
# once validation accuracy reaches 90% at two evaluations in a row (the long high-learning-rate
# phase is what makes the APE models learn reliably); the APE tables learned or planted at std 1;
# fp32 on every CPU (bf16 crawls where the CPU lacks it, and the verdicts must not depend on the
# CPU). The model trained with its patches permuted reaches only its content level: 600 steps, no
# target. The rebuilding positive trains its whole budget (the gate still asks for the target at
# the end): stopped at 90% it had seen about 300 steps with an early window withheld, too few
# to plant compensation detected on every seed set
# (docs/runs/2026-12-06-rebuilding-positive-whole-budget.md).
DEFAULT_TRAIN = (
    "model.dim=32", "model.depth=4", "data.image_size=24", "model.ape_init_std=1.0",
    "train.lr=6e-3", "train.steps=2000", "train.stop_acc=0.9", "train.eval_every=50",
    "train.eval_images=500", 'train.precision="fp32"', "none:train.steps=600",
    "none:train.stop_acc=0.0", "ape_shuffled:train.steps=600", "ape_shuffled:train.stop_acc=0.0",
    "rope_rebuild:train.min_steps=2000",
)  # fmt: skip


# The confirmation (METHODS.md, "Exploration, then confirmation"; docs/preregistration.md): the
# default's design (the same fingerprints), every calibration model trained, at the pre-registered
# seed count on a block of seeds no earlier run trained. The exploration trained seeds 0-19 and the
# accuracy gate's reserves of those (1000-1019, 2000-2019); the block starts at 100, so neither its
# seeds nor its own reserves (1100-..., 2100-...) meet them (tests/study/test_confirm.py).
EXPLORED_SEEDS = range(0, 20)
CONFIRM_START = 100
CONFIRM_SEEDS = 30  # docs/preregistration.md: the split's original level sets it


# On pretrained models `quick` is the fast route to the verdicts (docs/pretrained.md): it leaves
# out what no rule reads and a pretrained forward pass makes costly, a third of a five-seed CPU
# study of a ViT-S: heads' carrying and top-k, the depth profile's random-init control, and the
# top-frequency and extra random-plane removals (the split rule's random planes stay). The
# default preset, and `quick` on trained models (every figure's smoke test), measure them.
PRETRAINED_QUICK = (
    "heads.carrying=false", "depth_profile.control=false",
    "position_removal.kinds=ape,table,axis,random_axis",
)  # fmt: skip


def preset(name: str, **changes: Any) -> StudyConfig:
    """A named preset with optional field changes (e.g. models=..., seeds=...). A pretrained
    study's forward passes are its cost: unless `precision` is given they run under "auto" (bf16
    where the device runs it natively, else fp32; docs/pretrained.md), trained models' in fp32."""
    one_of("study.preset", name, PRESETS)
    if changes.get("pretrained") and "precision" not in changes:
        changes = changes | {"precision": AUTO}
    if changes.get("pretrained") and "gate_retries" not in changes:  # nothing trained to retry
        changes = changes | {"gate_retries": 0}
    if name == "quick":  # CI smoke: tiny everything, verdicts inconclusive by design
        cfg = StudyConfig(
            preset="quick",
            seeds=1,
            train_set=(
                "model.dim=32", "model.depth=3", "model.heads=2", "train.steps=150",
                "train.eval_every=50", "train.eval_images=200", "data.n_val=300",
                "data.n_test=300", 'train.precision="fp32"',
            ),
            analysis_set=(
                "windows.axis_windows=false", "windows.prefix_ks=0", "windows.probe_curves=false",
                "windows.every_suffix=false",
                "position_removal.n_planes=4", "position_removal.draws=2",
                # no rule reads a removal condition under RPI (Needs.passes.rpi): quick skips
                # those passes (a third of a pretrained RoPE model's position_removal)
                "position_removal.rpi=false",
                "heads.units=head", "heads.cumulative=1", "heads.axis_windows=false",
                "heads.rebuild_probes=false", "heads.rebuild_ssdc=false", "heads.draws=2",
                "sae_causal.sites=early,table", "sae_causal.train_images=200",
                "sae_causal.epochs=2", "sae_causal.doses=4", "sae_causal.draws=2",
                # each edit read by the intact model's fixed probes alone, as in the default (the
                # table site keeps every edit here: quick on trained models is every figure's
                # smoke test)
                "sae_causal.refit=false",
            ),
            n_images=100,
            probe_images=80,
            only=("sae_causal=ape,sincos",),
        )  # fmt: skip
        if changes.get("pretrained"):
            cfg = replace(cfg, analysis_set=cfg.analysis_set + PRETRAINED_QUICK)
    elif name == "default":
        cfg = StudyConfig(
            preset="default",
            models=(*STUDY_MODELS, *CALIBRATION_MODELS),
            seeds=5,
            train_set=DEFAULT_TRAIN,
            analysis_set=(
                "position_removal.n_planes=2", "position_removal.draws=2",
                "windows.prefix_ks=0,1", "windows.axis_windows=false",
                "windows.probe_curves=false",
                "heads.units=block_head", "heads.cumulative=1", "heads.rebuild_probes=false",
                "heads.draws=2",
                # the SAEs train at the experiment's defaults (1,000 images, 5 epochs): with 400
                # images and 4 epochs the planted row + column code went undetected in one seed
                # of five (docs/study.md, "How the default was chosen"). k = 8 (a quarter of the
                # width): the reconstruction criterion's k = 32 is a dense code in which the
                # planted row + column positives moved the site's probe only 0.13 / 0.09 of the
                # way to chance, under the APE threshold 0.10; at k = 8 they move it 0.32 / 0.30
                # (docs/runs/2026-12-05-sae-instrument-k8.md). The +error splice keeps
                # the model exact whatever the SAE's own reconstruction costs (reported beside).
                # Three SAEs per site, their effects averaged: the SAE's seed moved one model's
                # planted effect from 0.14 to 0.43. The sharper level reads a second SAE at
                # block 0's raw residual ("table"), where the planted positives' row and column
                # latents carrying another position cost 0.35 / 0.22 accuracy beyond their own
                # position from another image with one SAE, and the negatives 0.00-0.01
                # (docs/runs/2026-12-05-ape-sharper-table-site.md): one SAE there.
                # Each edit reads the intact model's fixed probes alone, the probes the APE rules
                # read (refitting probes on every edit took a third of the test's time), and the
                # table site runs only the row and column edits its level reads
                # (docs/runs/2026-12-05-faster-sae-edits.md).
                "sae_causal.sites=early,table", "sae_causal.draw_sites=early", "sae_causal.k=8",
                "sae_causal.sae_draws=3", "sae_causal.doses=1000", "sae_causal.draws=2",
                "sae_causal.refit=false", "sae_causal.rowcol_sites=table",
            ),
            n_images=150,
            probe_images=100,
            batch_size=150,
            only=claims_only((*STUDY_MODELS, *CALIBRATION_MODELS), CORE),
            gate_retries=2,
        )  # fmt: skip
    elif name == "confirm":
        cfg = replace(preset("default"), preset="confirm", seeds=CONFIRM_SEEDS,
                      seed_start=CONFIRM_START, models=(*STUDY_MODELS, *CALIBRATION_MODELS))  # fmt: skip
    elif changes.get("pretrained"):  # the original study itself: pretrained ViT-Bs, on a GPU
        cfg = StudyConfig(
            preset="paper",
            seeds=3,
            experiments=EXPERIMENTS,
            # the original protocol: 5,000 images for accuracy, 1,000 for SSDC and the probes;
            # SAEs 5x, k = 64 at the early site the APE claims read (block 2 of 12, the original's)
            # and at the probe block (the normalised residual where the probes peak)
            n_images=5000,
            probe_images=1000,
            ssdc_images=1000,
            analysis_set=(
                "sae_causal.sites=early,probe,table",
                "sae_causal.expansion=5", "sae_causal.k=64",
            ),
            only=("sae_causal=ape,sincos",),
        )  # fmt: skip
    else:  # the original protocol's sizes, for a GPU
        cfg = StudyConfig(
            preset="paper",
            models=(*STUDY_MODELS, *ALL_CALIBRATION_MODELS),
            seeds=5,
            train_set=('train.precision="fp32"',),
            experiments=EXPERIMENTS,
            # the APE rules' SAE sites: the early block (original level) and block 0's raw
            # residual (sharper level), besides the probe block
            analysis_set=("sae_causal.sites=early,probe,table",),
            n_images=1000,
            probe_images=500,
            gate_retries=2,
        )
    return replace(cfg, **changes)


__all__ = [
    "ALL_CALIBRATION_MODELS",
    "CALIBRATION_MODELS",
    "CONFIRM_SEEDS",
    "CONFIRM_START",
    "CORE",
    "EXPLORED_SEEDS",
    "PRESETS",
    "STUDY_MODELS",
    "Pretrained",
    "StudyConfig",
    "config_hash",
    "parse_pretrained",
    "preset",
]
