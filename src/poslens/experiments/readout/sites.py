"""The residual sites a readout measures, and the evaluation images it reads.

"block b" is the residual entering block b (b = 0 is the embedded input) and the last site,
labelled "out", is the residual after the final block. The raw residual is
`blocks.b.hook_resid_pre`; the normalised one is the block's attention input `blocks.b.ln1`
(`ln_final` for "out").
"""

from __future__ import annotations

import torch

from poslens.data import Task
from poslens.errors import UserError
from poslens.experiments.config import ExperimentConfig
from poslens.models import hooks
from poslens.models.vit import ViT


def needs_classifier(model: ViT, why: str) -> str | None:
    """applies() of an experiment that needs accuracy or margins: the reason it cannot run on a
    backbone without classifier head (num_classes=0, e.g. DINOv3), else None."""
    if model.cfg.num_classes == 0:
        return f"the model has no classifier head (num_classes=0) and {why}"
    return None


def site_labels(model: ViT) -> list[str]:
    """'0', '1', ..., 'out': the residual sites, in depth order."""
    return [str(b) for b in range(model.cfg.depth)] + ["out"]


def site_names(model: ViT) -> tuple[list[str], list[str]]:
    """Hook names of the raw and the normalised residual at every site."""
    d = model.cfg.depth
    raw = [hooks.resid_pre(b) for b in range(d)] + [hooks.resid_post(d - 1)]
    norm = [hooks.normalized(b) for b in range(d)] + [hooks.FINAL_NORM]
    return raw, norm


def check_site(model: ViT, site: int) -> int:
    n = model.cfg.depth + 1
    if not 0 <= site < n:
        raise UserError(f"site {site} out of range: this model has sites 0..{n - 1} ({n - 1}=out)")
    return site


def eval_images(data: Task, cfg: ExperimentConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The first cfg.n_images images and labels of the configured split."""
    x, y = data.split(cfg.split)
    if len(x) < cfg.n_images:
        raise UserError(
            f"the {cfg.split} split has {len(x)} images, fewer than analysis.n_images={cfg.n_images}"
        )
    return x[: cfg.n_images], y[: cfg.n_images]
