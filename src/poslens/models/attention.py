"""Softmax attention written out (matmul, softmax, matmul), in slices of the batch whose scores
stay in the CPU's cache: the kernel that trains the ViT and the ensemble on the CPU.

Layouts: q [N, H, Tq, dh], k and v [N, H, T, dh] (N: the batch, or members x batch; any
strides, e.g. views of the qkv linear's token-major output [N, T, 3, H, dh]); scores and pattern
[N, H, Tq, T]; output z [N, H, Tq, dh], contiguous.

Written out over the whole batch, the scores and the pattern of a 14 x 14 grid (T = 197, 4
heads, batch 64) are 40 MB each, so the softmax and every matmul after the first stream them
through memory, forward and backward. A slice of n images (n x H score matrices of Tq x T) runs
all three ops, and autograd later their backwards, on scores that stay in cache. Measured on a
2-core AMD EPYC shared with another job (`benchmarks/attention_cpu.py --slices`, one thread):
alone, forward plus backward took 0.45-0.7x the whole batch's time at T = 101-197 when the
whole batch's blocks were mapped fresh on every call (glibc's default over 32 MB), but
0.8-1.1x with freed memory kept (poslens.allocator, as the CLI trains); inside the training step
(memory kept) the slices gave 1.0-1.4x at the 14 x 14 rungs. Every slice computes exactly the
ops of the whole (the same matmul per matrix, the same softmax per row), so the numbers are the
same up to float rounding.

In fp32 (no autocast), with head dim >= 16 and at least 64 keys, torch's fused
F.scaled_dot_product_attention trains faster (forward plus backward 0.5-0.9x the whole batch's
time at T = 65-197, dh 16-32; at dh 8, or T = 37, 1.0-1.4x), so there the fused kernel runs
instead; its bf16 backward is 2.5-6x slower (docs/benchmarks.md), so never under autocast.
"""

from __future__ import annotations

from itertools import repeat

import torch
import torch.nn.functional as F

# bytes of fp32 scores per slice, on a 2-core AMD EPYC (1 MB L2 per core, 32 MB L3): 2 MB was the
# fastest at T = 197 without kept freed memory, 0.25-4 MB within noise with it; a batch whose
# scores fit (T = 37: 1.4 MB for batch 64) stays whole
SLICE_BYTES = 2 << 20
# where fp32 training takes the fused kernel instead (see above)
FUSED_MIN_HEAD_DIM, FUSED_MIN_KEYS = 16, 64


def slice_rows(n: int, heads: int, tq: int, t: int, budget: int | None = None) -> int:
    """Batch rows per slice: as many as keep heads x tq x t fp32 scores within `budget` bytes
    (default SLICE_BYTES; at least one row, at most n)."""
    budget = SLICE_BYTES if budget is None else budget
    return max(1, min(n, budget // max(1, 4 * heads * tq * t)))


def softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale + bias) v over the last two dims: fused where fused_trains_faster,
    else sliced_attention; q [N, H, Tq, dh], k, v [N, H, T, dh] -> z [N, H, Tq, dh]; bias (a
    relative position bias) [H, Tq, T] or [N, H, Tq, T]."""
    if fused_trains_faster(q, k):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    return sliced_attention(q, k, v, scale, bias)


def sliced_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The written-out formula in batch slices of SLICE_BYTES of scores (shapes as above)."""
    N, H, Tq, _ = q.shape
    rows = slice_rows(N, H, Tq, k.shape[2])
    if rows >= N or torch.compiler.is_compiling():  # inductor fuses the whole batch itself
        return _attend(q, k, v, scale, bias)
    parts = zip(q.split(rows), k.split(rows), v.split(rows), strict=True)
    biases = bias.split(rows) if bias is not None and bias.ndim == 4 else repeat(bias)
    return torch.cat([_attend(*p, scale, b) for p, b in zip(parts, biases, strict=False)])


def fused_trains_faster(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the fused kernel trains faster than the slices at this shape: fp32 without
    autocast, head dim >= FUSED_MIN_HEAD_DIM, keys >= FUSED_MIN_KEYS (measured on the CPU)."""
    return (
        q.dtype == torch.float32
        and not torch.is_autocast_enabled(q.device.type)
        and q.shape[-1] >= FUSED_MIN_HEAD_DIM
        and k.shape[-2] >= FUSED_MIN_KEYS
    )


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bias: torch.Tensor | None
) -> torch.Tensor:
    """The written-out attention on one slice (the formula of the ViT's hooked path)."""
    scores = (q * scale) @ k.transpose(-2, -1)  # [n, H, Tq, T]
    if bias is not None:
        scores = scores + bias
    return scores.softmax(dim=-1) @ v


__all__ = [
    "SLICE_BYTES",
    "fused_trains_faster",
    "slice_rows",
    "sliced_attention",
    "softmax_attention",
]
