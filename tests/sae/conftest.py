"""Planted sparse data and a tiny checkpoint folder for the SAE tests."""

from __future__ import annotations

from pathlib import Path

import torch

import poslens
from poslens.data import DataConfig
from tests.conftest import tiny

TINY_DATA = DataConfig(image_size=16, object_scale=0.32, n_val=40, n_test=16)


def planted(
    n: int, d: int = 32, f: int = 64, active: int = 3, seed: int = 100
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [n, d] that are sums of `active` of f unit-norm features (magnitudes 0.5-1.5) plus
    1% noise, and the features [f, d]. Seeded apart from the SAE's init (seed 0)."""
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(f, d, generator=g)
    feats /= feats.norm(dim=1, keepdim=True)
    idx = torch.rand(n, f, generator=g).argsort(dim=1)[:, :active]
    mag = 0.5 + torch.rand(n, active, generator=g)
    x = torch.nn.functional.embedding_bag(idx, feats, per_sample_weights=mag, mode="sum")
    return x + 0.01 * torch.randn(n, d, generator=g), feats


def tiny_checkpoint(folder: Path) -> Path:
    """A checkpoint folder (config.json + model.safetensors) of an untrained tiny APE model on a
    16-class 16x16 task: what poslens.load / load_task and `poslens sae train` read."""
    m = tiny("ape", num_classes=16)
    return poslens.save(m, folder, TINY_DATA)
