"""Planted sparse data for the SAE tests."""

from __future__ import annotations

import torch


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
