"""SSDC: does token similarity fall with grid distance? Streaming over batches, memory O(T^2).

SSDC = Spearman rank correlation, over patch-token pairs i < j, between the image-averaged cosine
similarity S_ij and minus the Manhattan grid distance D_ij = |row_i - row_j| + |col_i - col_j|.
+1 when similarity falls exactly with distance, -1 when it rises, about 0 for noise.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import rankdata


def manhattan_distance(gh: int, gw: int) -> np.ndarray:
    """D [gh*gw, gh*gw]: grid distance between row-major patch tokens."""
    k = np.arange(gh * gw)
    row, col = k // gw, k % gw
    return np.abs(row[:, None] - row[None, :]) + np.abs(col[:, None] - col[None, :])


def ssdc_from_similarity(sim: np.ndarray, gh: int, gw: int) -> float:
    """Spearman correlation of the upper triangle of `sim` [T, T] with -D (T = gh * gw)."""
    n = gh * gw
    if sim.shape != (n, n):
        raise ValueError(f"similarity is {sim.shape}, expected ({n}, {n}) for a {gh}x{gw} grid")
    iu = np.triu_indices(n, k=1)
    a, b = rankdata(sim[iu]), rankdata(-manhattan_distance(gh, gw)[iu])
    a, b = a - a.mean(), b - b.mean()
    denom = np.sqrt((a * a).sum() * (b * b).sum())
    return float((a * b).sum() / denom) if denom > 0 else 0.0


def _offset_products(tokens: torch.Tensor) -> torch.Tensor:
    """sum over images of u_i . u_j [T, T] (float64) for the unit tokens u of `tokens` [B, T, D],
    as m.m + d_i.m + m.d_j + d_i.d_j with m the image's mean unit vector and d = u - m: only
    d_i.d_j, of the size of the tokens' spread, is multiplied in float32."""
    unit = tokens.to(torch.float64, copy=True)
    unit /= unit.norm(dim=-1, keepdim=True).clamp_min_(1e-12)  # as F.normalize
    mean = unit.mean(dim=1, keepdim=True)  # [B, 1, D]
    unit -= mean  # the offsets d, in place
    md = torch.bmm(unit, mean.mT)[..., 0].sum(0)  # [T]: sum over images of d_i . m
    mm = (mean * mean).sum()  # sum over images of m . m
    offsets = unit.float()
    del unit
    dd = torch.bmm(offsets, offsets.mT).double().sum(0)  # [T, T]
    return dd + md[:, None] + md[None, :] + mm


class SSDC:
    """Streaming SSDC: feed patch tokens [B, T, D] batch by batch, read `value()` at the end.

    Keeps only the running sum of per-image cosine-similarity matrices (float64, [T, T]); memory
    does not grow with the number of images. `dtype` is the precision of each batch's [T, T]
    product: float64 (default) matches an all-float64 computation to ~1e-15; float32 is 2-4x
    faster on CPU. SSDC ranks the similarities, so where tokens are nearly parallel (a random-init
    ViT's) a float32 product's rounding (~1e-6) reorders them: the float32 path multiplies each
    token's offset from its image's mean unit vector and adds the mean's terms in float64, so its
    error scales with the spread of the tokens, not with 1 (on random-init ViT-Ti and ViT-S
    features SSDC moved by at most 5e-5 from float64's; a plain float32 product's by 4e-4). The
    sum over batches stays float64 either way. benchmarks/ssdc.py compares time and memory with
    the keep-everything implementation.
    """

    def __init__(self, gh: int, gw: int, dtype: torch.dtype = torch.float64) -> None:
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
        self.gh, self.gw, self.dtype = gh, gw, dtype
        self.sum = torch.zeros(gh * gw, gh * gw, dtype=torch.float64)
        self.count = 0

    @torch.no_grad()
    def update(self, tokens: torch.Tensor) -> None:
        """Add a batch of patch tokens [B, T, D] (prefix tokens already removed)."""
        if tokens.shape[1] != self.gh * self.gw:
            raise ValueError(f"got {tokens.shape[1]} tokens for a {self.gh}x{self.gw} grid")
        if self.dtype == torch.float64:
            unit = tokens.to(torch.float64, copy=True)  # normalised in place: one batch's copy
            unit /= unit.norm(dim=-1, keepdim=True).clamp_min_(1e-12)  # as F.normalize
            # One batched matmul and a sum over images: on CPU this beats the einsum (which
            # permutes to one [T, B*D] GEMM) by ~1.5x; its [B, T, T] temporary is freed per batch.
            self.sum += torch.bmm(unit, unit.mT).sum(0).to("cpu", torch.float64)
        else:
            self.sum += _offset_products(tokens).to("cpu")
        self.count += tokens.shape[0]

    def all_reduce(self) -> None:
        """Sum the running sums and counts of every rank (torchrun), so each holds the total."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(self.sum)
            count = torch.tensor([self.count], dtype=torch.float64)
            dist.all_reduce(count)
            self.count = int(count.item())

    @property
    def similarity(self) -> np.ndarray:
        """Image-averaged cosine similarity [T, T]."""
        if not self.count:
            raise ValueError("SSDC has seen no images")
        return (self.sum / self.count).numpy()

    def value(self) -> float:
        return ssdc_from_similarity(self.similarity, self.gh, self.gw)
