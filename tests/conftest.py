"""Shared fixtures and helpers: tiny models that run in milliseconds, torchrun ports, JSON
comparison, small timm models."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
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


def free_port() -> int:
    """A TCP port free on localhost now (torchrun's --master_port)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def json_numbers(a: object, b: object, path: str = "") -> list[tuple[str, float, float]]:
    """Pairs of numbers at the same place in two JSON documents (the rest must be equal)."""
    if isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), path
        return [x for k in a for x in json_numbers(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), path
        return [
            x
            for i, (u, v) in enumerate(zip(a, b, strict=True))
            for x in json_numbers(u, v, f"{path}[{i}]")
        ]
    if isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool):
        return [(path, float(a), float(b))]
    assert a == b, path
    return []


def shrink_timm(mp: pytest.MonkeyPatch, **sizes: object) -> None:
    """poslens builds timm:NAME at its default size; make it build the small variant (`sizes`)
    that test weights were saved from, offline."""
    import poslens.models.timm_convert as tc

    mp.setenv("HF_HUB_OFFLINE", "1")
    real = tc.create_timm
    mp.setattr(
        tc, "create_timm", lambda name, pretrained=False, **kw: real(name, pretrained, **sizes)
    )


def image_folder(root: Path, classes: int, per_class: int, size: tuple[int, int]) -> Path:
    """`classes` class folders named by index under `root`, `per_class` random RGB PNGs each of
    `size` (height, width): an offline image folder for the pretrained tests."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for k in range(classes):
        (root / str(k)).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / str(k) / f"{i}.png")
    return root
