"""The study resolved once into a typed plan: every run (model x seed) with its source and stages.

`StudyConfig` keeps its small string languages ("timm:NAME=WEIGHTS", "experiment=model,model",
`section.field=value` overrides) because they are what results.json records and hashes; it parses
them once, on construction, into the typed values read here. Everything that can be wrong in a
config is found before any work.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from poslens.api import read_task_config
from poslens.checkpoint import CONFIG
from poslens.errors import CheckpointError, ConfigError, DataError, UserError
from poslens.experiments.config import ExperimentConfig
from poslens.experiments.position_removal import KINDS
from poslens.experiments.registry import configs, get
from poslens.interventions import in_situ
from poslens.study.claims import RULES
from poslens.study.claims.base import Needs, union
from poslens.study.config import TASK_PREFIX, Pretrained, StudyConfig, config_hash
from poslens.training.config import RunConfig, apply_overrides, preset
from poslens.training.finetune import FineTune


@dataclass(frozen=True)
class Stage:
    """One unit of work of a run: "train" or "load" first, then one experiment each."""

    kind: str  # "train", "load" or an experiment name
    model: str
    seed: int
    weight: float  # rough relative cost, for the ETA
    config: ExperimentConfig | None = None  # experiments, and the sizes of a "load" stage
    # the models (study names or encodings) this experiment is limited to (study.only); None: all
    only: frozenset[str] | None = None

    @property
    def label(self) -> str:
        return f"{self.kind} {self.model} seed {self.seed}"

    def skipped_for(self, posenc: str) -> bool:
        """Whether study.only leaves this run's model out (named by study name or encoding)."""
        return self.only is not None and self.model not in self.only and posenc not in self.only


@dataclass(frozen=True)
class RunPlan:
    """One model and seed: where its model comes from and its stages in order."""

    model: str
    seed: int
    stages: tuple[Stage, ...]
    run_config: RunConfig | None = None  # trained models
    checkpoint: Path | None = None  # trained models: checkpoints/<model>_s<seed>_<hash>
    pretrained: Pretrained | None = None
    images: str = ""  # pretrained models: their image folder
    edit: str = ""  # an in-situ control: the base model's weights under this edit
    finetune: FineTune | None = None  # a fine-tune control: how the base weights are tuned

    @property
    def base(self) -> str:
        """The model whose weights this run reads (itself, unless it is an in-situ control)."""
        return in_situ.split_name(self.model)[0]

    @property
    def weight(self) -> float:
        return sum(s.weight for s in self.stages)


@dataclass(frozen=True)
class Plan:
    """The whole study: its config, output folder, where it runs and every run."""

    cfg: StudyConfig
    out: Path
    device: str
    jobs: int  # parallel processes
    threads: int  # torch threads per process (0: torch's default)
    runs: tuple[RunPlan, ...]

    @property
    def stages_total(self) -> int:
        return sum(len(r.stages) for r in self.runs)

    @property
    def models(self) -> tuple[str, ...]:
        """Every model of results.json: the study's, then their in-situ controls."""
        return tuple(dict.fromkeys(r.model for r in self.runs))


def run_config(cfg: StudyConfig, model: str, seed: int, threads: int = 0) -> RunConfig:
    """The training config of one model and seed: the encoding's preset plus the study's changes."""
    rc = apply_overrides(preset(model), cfg.train_changes(model))
    train = replace(rc.train, seed=seed, threads=threads or rc.train.threads)
    return replace(rc, train=train, data=replace(rc.data, task=cfg.task))


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
    return configs(cfg.experiments, common, cfg.analysis_sets)


def checkpoint_dir(out: Path, model: str, seed: int, rc: RunConfig) -> Path:
    d = rc.to_dict()
    d["train"] = {k: v for k, v in d["train"].items() if k != "threads"}  # threads change no weight
    return out / "checkpoints" / f"{model}_s{seed}_{config_hash(d)}"


def stage_weight(kind: str, cfg: StudyConfig, rc: RunConfig | None) -> float:
    """Relative cost of a stage (training images vs evaluated images) for the progress ETA."""
    if kind == "train":
        assert rc is not None
        return rc.train.steps * rc.train.batch_size / 100
    if kind == "load":
        return cfg.n_images / 100
    return get(kind).cost * cfg.n_images / 100


def jobs_for(jobs: int, device: str, n_runs: int) -> int:
    """Parallel model/seed runs: by default one per core on the CPU (each single-threaded)."""
    if jobs:
        return max(1, min(jobs, n_runs))
    if device != "cpu":
        return 1
    return max(1, min(os.cpu_count() or 1, n_runs))


def check_sources(models: tuple[Pretrained, ...], images: str) -> None:
    """timm is installed and knows each timm model, the weights files and the image folder exist,
    a checkpoint's task (task:CHECKPOINT) has a valid [data] section: one-line errors before any
    work (and before --out is created). A Hugging Face folder (hf:DIR) needs neither timm nor
    transformers. How the images fit each model is checked once it is read (prepared.checked)."""
    timm_models = [m for m in models if m.spec.startswith("timm:")]
    if timm_models:
        from poslens._timm import import_timm

        timm = import_timm()
        for m in timm_models:
            if not timm.is_model(m.key):
                raise UserError(f"{m.spec}: unknown timm model {m.key!r}")
    for m in models:
        if m.weights != "hub" and not Path(m.weights).is_file():
            raise CheckpointError(f"{m.spec}: weights file {m.weights} not found")
    if models and images.startswith(TASK_PREFIX):
        folder = Path(images[len(TASK_PREFIX) :])
        if not (folder / CONFIG).is_file():
            raise CheckpointError(f"{images}: {folder} is not a poslens checkpoint folder")
        read_task_config(folder)
    elif models and not Path(images).exists():
        raise DataError(f"image folder {images} does not exist")


def make_plan(
    cfg: StudyConfig, out: str | Path, device: str = "cpu", threads: int = 0, jobs: int = 1
) -> Plan:
    """Resolve `cfg` into every run's stages; ConfigError, CheckpointError or DataError before
    any work. jobs 0: one process per core on the CPU; threads 0: the cores divided among them."""
    out = Path(out)
    if not isinstance(jobs, int) or jobs < 0:
        raise ConfigError(f"jobs must be 0 (one per core) or a positive count, got {jobs!r}")
    if not isinstance(threads, int) or threads < 0:
        raise ConfigError(f"threads must be 0 (automatic) or a positive count, got {threads!r}")
    pretrained = cfg.pretrained_models
    check_sources(pretrained, cfg.images)
    only = cfg.only_models
    keys = cfg.model_keys
    n_jobs = jobs_for(jobs, device, cfg.n_runs)
    if not threads and n_jobs > 1:
        threads = max(1, (os.cpu_count() or 1) // n_jobs)
    runs = []
    for model in keys:
        for seed in cfg.seeds_of(model):
            ecfgs = experiment_configs(cfg, seed)
            if pretrained:
                rc, first, ckpt = None, "load", None
                source = next(p for p in pretrained if p.key == model)
            else:
                rc, first, source = run_config(cfg, model, seed, threads), "train", None
                ckpt = checkpoint_dir(out, model, seed, rc)
            # the load stage measures accuracy on the evaluation images: the study's sizes and precision
            lcfg = ExperimentConfig(n_images=cfg.n_images, probe_images=cfg.probe_images,
                                    batch_size=cfg.batch_size, precision=cfg.precision,
                                    ) if pretrained else None  # fmt: skip
            stages = [Stage(first, model, seed, stage_weight(first, cfg, rc), lcfg)]
            stages += [
                Stage(name, model, seed, stage_weight(name, cfg, rc), ecfgs[name], only.get(name))
                for name in cfg.experiments
            ]
            runs.append(
                RunPlan(model, seed, tuple(stages), rc, ckpt, source, cfg.images if source else "")
            )
    runs += [d for r in runs for d in in_situ_runs(cfg, r)]
    return Plan(cfg, out, device, n_jobs, threads, tuple(runs))


def in_situ_needs(cfg: StudyConfig, run: RunPlan) -> dict[str, Needs]:
    """The in-situ controls a study model gets: edit -> the union of the needs of the rules
    judging it (claims.Needs), narrowed to the study's experiments. A rule judges a trained model
    that is one of its study models, where the edit applies to its config; it judges a
    pretrained model always, the edit's fit checked when the weights are loaded."""
    if not cfg.in_situ:
        return {}
    judging: dict[str, list[Needs]] = {}
    for rule in RULES:
        if run.run_config is not None and run.model not in rule.study:
            continue
        if rule.experiment not in cfg.experiments:  # nothing to judge the control on
            continue
        for edit in rule.edits:
            if in_situ.get(edit).finetune and not cfg.finetune_steps:  # fine-tunes: on request
                continue
            if run.run_config is not None and not in_situ.get(edit).applies(run.run_config.model):
                continue
            judging.setdefault(edit, []).append(rule.needs)
    out = {}
    for edit, needs in judging.items():
        n = union(needs)
        reads = tuple(x for x in cfg.experiments if x in n.reads)
        if reads:
            out[edit] = replace(n, reads=reads)
    return out


def narrowed(config: ExperimentConfig, kind: str, needs: Needs) -> ExperimentConfig:
    """An experiment's config for an in-situ control: only the passes (and of position_removal
    only the condition kinds) its rules need; rpi_probes only narrows the study's own choice."""
    p = needs.passes
    if kind == "position_removal":
        kinds = tuple(k for k in KINDS if k in needs.removal)
        config = replace(config, kinds=kinds, rpi=p.rpi, probes=p.probes)
    return config if p.rpi_probes else replace(config, rpi_probes=False)


def in_situ_runs(cfg: StudyConfig, run: RunPlan) -> list[RunPlan]:
    """`run`'s in-situ controls as runs of their own ("ape~table_rowcol"): the same checkpoint
    or weights, the edit applied on loading, only the experiments their rules read (study.only
    does not limit them) with only the passes they read (`narrowed`). A trained model's control
    re-reads its finished checkpoint (no training of its own)."""
    first = run.stages[0]
    out = []
    for edit, needs in in_situ_needs(cfg, run).items():
        name = in_situ.model_name(run.model, edit)
        stages = [replace(first, model=name, weight=0.0 if first.kind == "train" else first.weight)]
        stages += [
            replace(s, model=name, only=None, config=narrowed(s.config, s.kind, needs))
            for s in run.stages[1:]
            if s.kind in needs.reads and s.config is not None
        ]
        windows = in_situ.get(edit).finetune
        tune = FineTune(windows, cfg.finetune_steps, cfg.finetune_lr, cfg.finetune_batch,
                        seed=run.seed) if windows else None  # fmt: skip
        out.append(replace(run, model=name, stages=tuple(stages), edit=edit, finetune=tune))
    return out


def stage_hash(stage: Stage, skip: bool, source_identity: dict[str, object]) -> str:
    """The reuse key of an experiment stage: its config, whether it is skipped, and the source."""
    assert stage.config is not None
    return config_hash(asdict(stage.config) | {"skip": skip} | source_identity)


__all__ = ["Plan", "Pretrained", "RunPlan", "Stage", "make_plan", "run_config"]
