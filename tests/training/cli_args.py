"""A tiny fp32 training run, as a RunConfig (in-process tests) or `poslens train` arguments
(subprocess tests)."""

from __future__ import annotations

from typing import Any

from poslens.data import DataConfig
from poslens.models import ModelConfig
from poslens.training.config import RunConfig, TrainConfig


def tiny_run_config(
    posenc: str, steps: int, model_kw: dict[str, Any] | None = None, **train_kw: Any
) -> RunConfig:
    """Width 32, 2 blocks, 16 px images, batch 16, fp32; `train_kw` sets the rest of `train`."""
    return RunConfig(
        model=ModelConfig(dim=32, depth=2, heads=2, posenc=posenc, **(model_kw or {})),
        data=DataConfig(image_size=16, object_scale=0.32, n_val=32, n_test=32),
        train=TrainConfig(
            **{"steps": steps, "batch_size": 16, "eval_images": 32, "precision": "fp32", **train_kw}
        ),
    )


def tiny_train_args(steps: int, eval_every: int, ckpt_every: int = 4) -> list[str]:
    sets = [
        "model.dim=16", "model.depth=2", "model.heads=2", f"train.steps={steps}",
        "train.batch_size=16", f"train.ckpt_every={ckpt_every}", f"train.eval_every={eval_every}",
        "train.eval_images=16", "data.n_val=32", "data.n_test=32", "data.image_size=16",
        "data.object_scale=0.32", "train.threads=1", 'train.precision="fp32"',
    ]  # fmt: skip
    return ["--preset", "rope_axial", *(a for s in sets for a in ("--set", s)), "--no-progress"]
