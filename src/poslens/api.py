"""The notebook entry point: `poslens.load(...)` returns a ready, eval-mode model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from poslens.errors import CheckpointError, ConfigError, UserError
from poslens.io import (
    MAX_CONFIG_BYTES,
    MAX_JSON_BYTES,
    check_state_dict,
    load_tensors,
    read_json,
    read_metadata,
)
from poslens.models.config import ModelConfig, config_mismatch
from poslens.models.vit import ViT

if TYPE_CHECKING:
    from poslens.data import DataConfig, Task


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
    """The training state of a checkpoint folder.

    `poslens train` writes metrics.json last, after the final weights and resume state, so a
    folder it wrote is finished exactly when metrics.json exists. A folder with no trace of
    training (no train_state.safetensors, no step in the weights' metadata: an export or a
    hand-made checkpoint) counts as finished.
    """
    from poslens.training.train import CONFIG, FINISHED, STATE, WEIGHTS

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


def load(
    spec: str | Path,
    weights: str | Path | None = None,
    device: str = "cpu",
    allow_unfinished: bool = False,
) -> ViT:
    """Load a poslens checkpoint folder (config.json + model.safetensors) in eval mode.

    `spec` may also be the model.safetensors file itself; `weights` overrides the weights file.
    `spec` "timm:NAME" converts timm model NAME with weights from a local .safetensors file
    (`weights=PATH`) or timm's pretrained download (`weights="hub"`); needs the [timm] extra.
    The weights must match config.json (their stored model fingerprint) and come from a
    finished training run (checkpoint_status) unless `allow_unfinished`.
    """
    if isinstance(spec, str) and spec.startswith("timm:"):
        from poslens.models.timm_convert import load_timm

        name = spec[len("timm:") :]
        if not name:
            raise UserError("timm: spec needs a model name, e.g. timm:vit_base_patch16_224")
        if weights is None:
            raise UserError(
                f"{spec} needs weights: a local .safetensors file, or 'hub' to download them"
            )
        return load_timm(name, weights, device=device)
    path = Path(spec)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    folder = path if path.is_dir() else path.parent
    if not path.is_dir() and not (folder / "config.json").exists():
        raise CheckpointError(
            f"{path} is a file, not a checkpoint folder (one with config.json and "
            "model.safetensors), and no config.json is beside it"
        )
    weights_path = (
        Path(weights)
        if weights is not None
        else (path if path.is_file() else folder / "model.safetensors")
    )
    raw = read_json(folder / "config.json", "checkpoint config", MAX_CONFIG_BYTES)
    if not isinstance(raw, dict) or not isinstance(raw.get("model"), dict):
        raise CheckpointError(f"{folder / 'config.json'} has no [model] section")
    try:
        cfg = ModelConfig.from_dict(raw["model"])
    except ConfigError as e:
        raise CheckpointError(f"{folder / 'config.json'}: {e}") from None
    meta = read_metadata(weights_path)
    why = config_mismatch(cfg, meta)
    if why is not None:
        raise CheckpointError(f"{folder / 'config.json'} does not describe {weights_path}: {why}")
    status = checkpoint_status(weights_path.parent, weights_path, meta)
    if not status.finished and not allow_unfinished:
        raise CheckpointError(
            f"{weights_path.parent} is an {status.describe()}: finish it with poslens train "
            "--resume, or pass --allow-unfinished (allow_unfinished=True) to use it anyway"
        )
    from poslens.limits import check_model

    check_model(cfg, device)
    state = load_tensors(weights_path)
    model = ViT(cfg)
    check_state_dict(state, model.state_dict(), str(weights_path))
    model.load_state_dict(state)
    return model.to(torch.device(device)).eval()


def save(model: ViT, folder: str | Path, data: DataConfig | None = None) -> Path:
    """Write `model` as a poslens checkpoint folder that `load` reads back: config.json (the model,
    and the data it was trained on when given, for `load_task`) and model.safetensors tied to it
    by its fingerprint; each file atomically. Returns the folder."""
    import dataclasses

    from poslens._version import __version__
    from poslens.io import save_tensors, write_json

    folder = Path(folder)
    config: dict[str, Any] = {"poslens_version": __version__, "model": model.cfg.to_dict()}
    meta = model.cfg.weights_metadata()
    if data is not None:
        config["data"] = dataclasses.asdict(data)
        meta |= data_metadata(data)
    write_json(folder / "config.json", config)
    save_tensors(folder / "model.safetensors", model.state_dict(), meta)
    return folder


def load_task(spec: str | Path) -> Task:
    """The task a poslens checkpoint was trained on, from its config.json [data] section."""
    from poslens._config import from_dict
    from poslens.data import DataConfig, build_task

    path = Path(spec)
    folder = path if path.is_dir() else path.parent
    raw = read_json(folder / "config.json", "checkpoint config", MAX_CONFIG_BYTES)
    if not isinstance(raw, dict) or not isinstance(raw.get("data"), dict):
        raise CheckpointError(f"{folder / 'config.json'} has no [data] section")
    try:
        cfg = from_dict(DataConfig, raw["data"], "data")
    except ConfigError as e:
        raise CheckpointError(f"{folder / 'config.json'}: {e}") from None
    weights = folder / "model.safetensors"
    saved = read_metadata(weights).get(DATA_CONFIG_KEY) if weights.is_file() else None
    if saved is not None:  # the data the weights were trained on (absent before fingerprints)
        why = _data_mismatch(cfg, saved)
        if why is not None:
            raise CheckpointError(f"{folder / 'config.json'} does not describe {weights}: {why}")
    task = build_task(cfg)
    model = raw.get("model") if isinstance(raw.get("model"), dict) else {}
    for task_field, model_field in TASK_SHAPE:
        ours, theirs = getattr(task, task_field), model.get(model_field, getattr(task, task_field))
        if ours != theirs:
            raise CheckpointError(
                f"{folder / 'config.json'}: its [data] section makes {task_field} {ours}, but "
                f"model.{model_field} is {theirs}"
            )
    return task


# What the task decides about the model (training takes them from the task; see FROM_DATA).
TASK_SHAPE = (
    ("image_size", "image_size"),
    ("in_chans", "in_chans"),
    ("num_classes", "num_classes"),
)
DATA_CONFIG_KEY = "data_config"  # weights metadata: the training data's config (canonical JSON)


def data_metadata(cfg: DataConfig) -> dict[str, str]:
    """Weights metadata naming the data they were trained on (checked by load_task)."""
    import dataclasses
    import json

    text = json.dumps(dataclasses.asdict(cfg), sort_keys=True, separators=(",", ":"))
    return {DATA_CONFIG_KEY: text}


def _data_mismatch(cfg: DataConfig, saved: str) -> str | None:
    """The first [data] field that differs from the stored one, as a phrase; `path` (where an
    image folder lives, which may move) is not compared."""
    import dataclasses

    from poslens._config import from_dict
    from poslens.data import DataConfig
    from poslens.io import parse_json

    try:
        stored = from_dict(DataConfig, parse_json(saved, "data_config"), "data")
    except (CheckpointError, ConfigError) as e:
        return f"the data config stored with the weights is unreadable ({e})"
    for f in dataclasses.fields(cfg):
        ours, theirs = getattr(cfg, f.name), getattr(stored, f.name)
        if f.name != "path" and ours != theirs:
            return f"data.{f.name} is {ours!r} but the weights were trained with {theirs!r}"
    return None


def load_images(path: str | Path, spec: str, model: ViT, seed: int = 0) -> Task:
    """Images for pretrained model `spec` ("timm:NAME"), preprocessed with its timm pretrained
    config and labelled in `model`'s class order, halved (seeded) into val and test.

    `path` is an ImageNet-style folder (one subfolder per class) or a Hugging Face `datasets`
    directory from save_to_disk (needs the [hf] extra); for a DatasetDict, "DIR::SPLIT" picks the
    split (default "validation", else "test", else the only one).
    """
    from poslens.data.folder import PretrainedFolderTask
    from poslens.data.hf import PretrainedHFTask, is_hf_dataset
    from poslens.data.preprocess import imagenet_synsets, timm_preprocess

    if not (isinstance(spec, str) and spec.startswith("timm:")):
        raise UserError(f"images with pretrained preprocessing need a timm:NAME model, got {spec}")
    if model.cfg.in_chans != 3:
        raise UserError(f"{spec} takes {model.cfg.in_chans} input channels; images are read as RGB")
    preprocess = timm_preprocess(spec[len("timm:") :], model.cfg.image_size)
    n = model.cfg.num_classes
    if is_hf_dataset(path):
        return PretrainedHFTask(path, preprocess, n, imagenet_synsets(n), seed=seed)
    return PretrainedFolderTask(path, preprocess, n, imagenet_synsets(n), seed=seed)
