"""SAE tests run single-threaded: the matrices are tiny and OpenMP only adds waiting."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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
