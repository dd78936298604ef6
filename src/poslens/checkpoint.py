"""The checkpoint folder: its file names, what its weights' metadata records, and its state.

A training folder holds config.json, model.safetensors (the weights `poslens.load` reads),
train_state.safetensors (weights and AdamW moments in one file, for resume) and, once the run is
finished, metrics.json. metrics.json is written last, after the final config, weights and resume
state, and never after a failed write or a loss that stopped being finite: a folder is finished
exactly when it exists. `poslens.load`, training and the study all rely on this rule, so it lives
here, in one module below both.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from poslens._version import __version__
from poslens.errors import CheckpointError, ConfigError
from poslens.io import (
    MAX_CONFIG_BYTES,
    MAX_JSON_BYTES,
    check_float_weights,
    load_tensors,
    parse_json,
    read_json,
    read_metadata,
    save_tensors,
    write_json,
)
from poslens.models.config import ModelConfig, config_mismatch

if TYPE_CHECKING:
    from poslens.data import DataConfig
    from poslens.training.config import RunConfig

CONFIG, WEIGHTS, STATE, METRICS = (
    "config.json",
    "model.safetensors",
    "train_state.safetensors",
    "metrics.json",
)
FINISHED = METRICS  # the marker of a finished run: written last (see the module docstring)
DATA_CONFIG_KEY = "data_config"  # weights metadata: the training data's config (canonical JSON)


# ------------------------------------------------------------------------------ data metadata


def data_metadata(cfg: DataConfig) -> dict[str, str]:
    """Weights metadata naming the data they were trained on (checked by load_task)."""
    text = json.dumps(dataclasses.asdict(cfg), sort_keys=True, separators=(",", ":"))
    return {DATA_CONFIG_KEY: text}


def data_mismatch(cfg: DataConfig, saved: str) -> str | None:
    """The first [data] field that differs from the stored one, as a phrase; `path` (where an
    image folder lives, which may move) is not compared."""
    from poslens._config import from_dict
    from poslens.data import DataConfig

    try:
        stored = from_dict(DataConfig, parse_json(saved, "data_config"), "data")
    except (CheckpointError, ConfigError) as e:
        return f"the data config stored with the weights is unreadable ({e})"
    for f in dataclasses.fields(cfg):
        ours, theirs = getattr(cfg, f.name), getattr(stored, f.name)
        if f.name != "path" and ours != theirs:
            return f"data.{f.name} is {ours!r} but the weights were trained with {theirs!r}"
    return None


# ------------------------------------------------------------------------------ status


@dataclass(frozen=True)
class CheckpointStatus:
    """Whether a checkpoint folder holds a finished training run, and at which step."""

    finished: bool
    step: int | None = None  # the weights' training step, when their metadata records it
    steps: int | None = None  # the run's planned steps (config.json [train]), when known

    def to_dict(self) -> dict[str, Any]:
        return {"finished": self.finished, "step": self.step, "steps": self.steps}

    def describe(self) -> str:
        at = f"step {self.step}" if self.step is not None else "an unknown step"
        of = f" of {self.steps}" if self.steps is not None else ""
        return f"unfinished training run (weights at {at}{of}, no metrics.json)"


def _stopped_at(metrics: Path) -> int | None:
    """The step a finished run stopped at early (metrics.json "stopped_at"), or None."""
    doc = read_json(metrics, "training metrics", MAX_JSON_BYTES) if metrics.is_file() else None
    v = doc.get("stopped_at") if isinstance(doc, dict) else None
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def checkpoint_status(
    folder: str | Path, weights: str | Path | None = None, metadata: dict[str, str] | None = None
) -> CheckpointStatus:
    """The training state of a checkpoint folder: finished exactly when metrics.json exists. A
    folder with no trace of training (no resume state, no step in the weights' metadata: an
    export or a hand-made checkpoint) counts as finished."""
    folder = Path(folder)
    weights_path = Path(weights) if weights is not None else folder / WEIGHTS
    meta = metadata if metadata is not None else read_metadata(weights_path)
    try:
        step = int(meta["step"]) if "step" in meta else None
    except ValueError:
        raise CheckpointError(f"{weights_path} records a malformed step {meta['step']!r}") from None
    raw = (
        read_json(folder / CONFIG, "checkpoint config", MAX_CONFIG_BYTES)
        if (folder / CONFIG).is_file()
        else None
    )
    train = raw.get("train") if isinstance(raw, dict) else None
    steps = train.get("steps") if isinstance(train, dict) else None
    steps = steps if isinstance(steps, int) and not isinstance(steps, bool) else None
    trained_here = step is not None or (folder / STATE).is_file()
    finished = not trained_here or (folder / FINISHED).is_file()
    if finished and trained_here and step is not None and steps is not None:
        # a run stopped early (train.stop_acc) ends at the step its metrics.json records
        end = _stopped_at(folder / FINISHED)
        end = steps if end is None else end
        if step != end:
            raise CheckpointError(
                f"{folder}: the weights are at step {step} but the run was finished at step "
                f"{end} ({FINISHED} belongs to other weights)"
            )
    return CheckpointStatus(finished, step, steps)


def is_finished(folder: Path) -> bool:
    return (folder / FINISHED).is_file()


def read_metrics(folder: Path) -> dict[str, Any]:
    """A finished run's metrics.json."""
    return read_json(folder / METRICS, "training metrics")


# ------------------------------------------------------------------------------ writing


def write_checkpoint(
    out: Path,
    cfg: RunConfig,
    step: int,
    history: list,
    weights: dict[str, torch.Tensor],
    moments: dict[str, dict[str, Any]],
) -> None:
    """Config, weights (for loading) and the resume state, each file written atomically.

    `moments` maps a parameter name to its AdamW state. The resume state holds weights and
    optimiser moments in one file, so a kill between two writes can never pair weights of one
    step with moments of another.
    """
    meta = {
        "step": str(step),
        "poslens": __version__,
        **cfg.model.weights_metadata(),
        **data_metadata(cfg.data),
    }
    write_json(out / CONFIG, {"poslens_version": __version__, **cfg.to_dict()})
    save_tensors(out / WEIGHTS, weights, meta)
    state = {f"model::{k}": v for k, v in weights.items()}
    for name, param_state in moments.items():
        for key, value in param_state.items():
            state[f"optim::{name}::{key}"] = torch.as_tensor(value)
    save_tensors(out / STATE, state, {**meta, "history": json.dumps(history)})


def mark_finished(out: Path, metrics: dict[str, Any]) -> None:
    """Write metrics.json: the last write of a run, after its final checkpoint."""
    write_json(out / FINISHED, metrics)


# ------------------------------------------------------------------------------ resume


def read_resume_state(
    out: Path, model_cfg: ModelConfig | None = None
) -> tuple[int, list, dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """(step, history, weights, AdamW state by parameter name) from the resume state in `out`;
    refuses one saved for another model than `model_cfg`."""
    meta = read_metadata(out / STATE)  # the header goes through the same guard as any weights
    why = None if model_cfg is None else config_mismatch(model_cfg, meta)
    if why is not None:
        raise CheckpointError(f"the resume state in {out} belongs to another model: {why}")
    try:
        step = int(meta["step"])
    except (KeyError, ValueError):
        raise CheckpointError(f"the resume state in {out} records no valid step") from None
    history = parse_json(meta.get("history", "[]"), f"the training history in {out / STATE}")
    if not isinstance(history, list):
        raise CheckpointError(f"the training history in {out / STATE} is not a list")
    weights: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in load_tensors(out / STATE).items():
        if key.startswith("model::"):
            weights[key.removeprefix("model::")] = value
        elif key.startswith("optim::"):
            pname, _, skey = key.removeprefix("optim::").partition("::")
            moments.setdefault(pname, {})[skey] = value
    check_float_weights(weights, str(out / STATE))
    return step, history, weights, moments


def has_resume_state(out: Path, cfg: RunConfig, resume: bool) -> bool:
    """Whether `out` holds a run to continue; refuses a different config, or a run without
    `resume`. Removes the temp files that a killed atomic write may have left, on every run (a
    run killed while writing its first config.json is rerun without --resume)."""
    for name in (CONFIG, WEIGHTS, STATE, METRICS):
        for tmp in out.glob(f".{name}.*.tmp"):
            tmp.unlink(missing_ok=True)
    if resume and (out / STATE).is_file():
        saved = read_json(out / CONFIG, "checkpoint config", MAX_CONFIG_BYTES)
        if isinstance(saved, dict):
            saved.pop("poslens_version", None)
        if saved != cfg.to_dict():
            raise CheckpointError(f"--resume: the config in {out} differs from the requested one")
        return True
    if (out / STATE).is_file() or (out / METRICS).is_file():
        raise CheckpointError(
            f"{out} already holds a run; pass --resume to continue it or pick another --out"
        )
    return False


__all__ = [
    "CONFIG",
    "DATA_CONFIG_KEY",
    "FINISHED",
    "METRICS",
    "STATE",
    "WEIGHTS",
    "CheckpointStatus",
    "checkpoint_status",
    "data_metadata",
    "data_mismatch",
    "has_resume_state",
    "is_finished",
    "mark_finished",
    "read_metrics",
    "read_resume_state",
    "write_checkpoint",
]
