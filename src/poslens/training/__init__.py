"""Training small ViTs: configs, presets and the loop."""

from poslens.training.config import RunConfig, TrainConfig, apply_overrides, load_config, preset
from poslens.training.train import evaluate, train

__all__ = [
    "RunConfig",
    "TrainConfig",
    "apply_overrides",
    "evaluate",
    "load_config",
    "preset",
    "train",
]
