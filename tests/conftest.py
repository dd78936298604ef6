"""Shared fixtures: tiny models that run in milliseconds."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from poslens.models import ModelConfig, ViT, build_model

TINY = dict(image_size=16, patch_size=4, dim=32, depth=2, heads=2, num_classes=5)


def tiny(posenc: str = "rope_axial", **kw: object) -> ViT:
    """A 2-block, 2-head, 4x4-grid model in eval mode with deterministic weights."""
    cfg = ModelConfig(**{**TINY, "posenc": posenc, **kw})  # type: ignore[arg-type]
    return build_model(cfg, seed=0).eval()


@pytest.fixture(autouse=True, scope="session")
def one_thread() -> Iterator[None]:
    """Tests run single-threaded: their tensors are tiny, and a 2-thread pool only adds waiting
    (tiny probe fits took 15 s instead of 0.1 s when the cores were busy)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def images() -> torch.Tensor:
    return torch.randn(3, 1, 16, 16, generator=torch.Generator().manual_seed(1))
