"""A claim level's design as data, and its fingerprint (METHODS.md, "Exploration, then
confirmation").

The design is what decides a level's outcome apart from the seeds: its rule's design fields
(`DESIGN_FIELDS`: the effect, threshold, test, study models and controls, what it reads), the
decision's constants, the training config of every model the rule reads and the config of every
experiment it reads. Not in it: the seed count, which of its controls a run trains, and the
rule's wording (`WORDING_FIELDS`). Two runs whose level has the same fingerprint ran the same
design, so a confirmation of that fingerprint speaks for the other run; a change to one level
leaves every other level's fingerprint, and so its confirmation, standing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from poslens.errors import UserError
from poslens.study.claims import EACH, Rule
from poslens.study.claims.base import Control, Needs
from poslens.study.config import StudyConfig
from poslens.study.plan import experiment_configs, run_config

# Rule fields that only word a level (not hashed); every other field decides its outcome and is
# hashed, so a field added to Rule is part of the design unless it is named here
WORDING_FIELDS = ("title", "statement", "effect_name", "threshold_source", "would_change",
                  "by_construction", "notes", "control_notes", "in_situ_gap", "reference",
                  "exploration")  # fmt: skip
DESIGN_FIELDS = tuple(f.name for f in dataclasses.fields(Rule) if f.name not in WORDING_FIELDS)
# a control's fields that decide what it measures (its design phrase and whether the laptop
# presets train it are not)
CONTROL_FIELDS = ("model", "role", "effect", "label", "edit")
FINGERPRINT_CHARS = 16
# model training fields that change no weight of a seed's model, or name the seed itself
NOT_DESIGN_TRAIN = ("seed", "threads")


def _plain(value: Any) -> Any:
    """A rule field as JSON: functions by their qualified name, controls and needs as objects."""
    if isinstance(value, Control):
        return {f: _plain(getattr(value, f)) for f in CONTROL_FIELDS}
    if isinstance(value, Needs):
        return {"reads": list(value.reads), "removal": list(value.removal),
                "passes": dataclasses.asdict(value.passes)}  # fmt: skip
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: _plain(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, Callable):  # type: ignore[arg-type]
        return f"{value.__module__}.{value.__qualname__}"
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def rule_design(rule: Rule) -> dict[str, Any]:
    """The rule's design fields as JSON."""
    return {f: _plain(getattr(rule, f)) for f in DESIGN_FIELDS}


def _model_config(cfg: StudyConfig, model: str) -> dict[str, Any]:
    """A trained model's config as the study would train it, without its seed (a control this
    study's shape cannot build, e.g. a windowed control at depth 2: the reason, which is as much
    the design)."""
    try:
        d = run_config(cfg, model, 0).to_dict()
    except UserError as e:
        return {"cannot_build": str(e)}
    d["train"] = {k: v for k, v in d["train"].items() if k not in NOT_DESIGN_TRAIN}
    return d


def models_design(rule: Rule, cfg: StudyConfig) -> dict[str, Any]:
    """The configs of the models the rule reads: a trained study's study and control models (all
    of them, whether or not this run trains them), or a pretrained study's sources."""
    if cfg.pretrained:
        out: dict[str, Any] = {p.key: {"spec": p.spec, "weights": Path(p.weights).name}
                               for p in cfg.pretrained_models}  # fmt: skip
        out["images"] = cfg.images
        if any(c.edit.startswith("finetune") for c in rule.controls):
            out["finetune"] = {"steps": cfg.finetune_steps, "lr": cfg.finetune_lr,
                               "batch": cfg.finetune_batch}  # fmt: skip
        return out
    return {m: _model_config(cfg, m) for m in rule.models if m != EACH}


def experiments_design(rule: Rule, cfg: StudyConfig) -> dict[str, Any]:
    """The configs of the experiments the rule reads (None where the study does not run one)."""
    ran = experiment_configs(cfg)
    return {e: dataclasses.asdict(ran[e]) if e in ran else None for e in rule.reads}


def design(rule: Rule, cfg: StudyConfig, decision: Mapping[str, Any]) -> dict[str, Any]:
    """A level's whole design: its rule, the decision's constants (`decision`: alpha, the seeds a
    verdict needs, the replication share), the models and experiments it reads, the study's
    gate. What the fingerprint hashes and docs/preregistration.md lists."""
    return {
        "level": rule.id,
        "rule": rule_design(rule),
        "decision": dict(decision),
        "gate_retries": cfg.gate_retries,
        "models": models_design(rule, cfg),
        "experiments": experiments_design(rule, cfg),
    }


def fingerprint_of(d: Mapping[str, Any]) -> str:
    """The short hash of a design (canonical JSON, sorted keys)."""
    text = json.dumps(d, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:FINGERPRINT_CHARS]


__all__ = [
    "CONTROL_FIELDS",
    "DESIGN_FIELDS",
    "WORDING_FIELDS",
    "design",
    "fingerprint_of",
    "rule_design",
]
