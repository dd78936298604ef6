"""Shared fixtures: tiny models that run in milliseconds."""

from __future__ import annotations

import pytest
import torch

from poslens.models import ModelConfig, ViT, build_model

TINY = dict(image_size=16, patch_size=4, dim=32, depth=2, heads=2, num_classes=5)


def tiny(posenc: str = "rope_axial", **kw: object) -> ViT:
    """A 2-block, 2-head, 4x4-grid model in eval mode with deterministic weights."""
    cfg = ModelConfig(**{**TINY, "posenc": posenc, **kw})  # type: ignore[arg-type]
    return build_model(cfg, seed=0).eval()


@pytest.fixture
def images() -> torch.Tensor:
    return torch.randn(3, 1, 16, 16, generator=torch.Generator().manual_seed(1))
