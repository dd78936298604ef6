"""Attention statistics: along which grid axis each attention head looks. Streaming over batches.

Per block and head, intact model unless a condition is given, patch queries x patch keys (prefix
tokens such as CLS left out, the attention renormalised over patch keys):

- E|d_row| and E|d_col|: the expected absolute row and column offset between a query and the
  keys it attends to, beside the same under uniform attention over patch keys.
- eta2_row and eta2_col: the share of the within-query variance of the patch logits
  (`hook_attn_scores` minus each query's mean over patch keys, since softmax ignores it)
  explained by an arbitrary function of the signed row offset / signed column offset, fitted by
  least squares together with a free constant per query (so logits that are exactly f(d_row)
  plus a per-query shift give eta2_row = 1 despite the grid's edges; one function for all
  queries and images). On a full grid the two groupings are orthogonal: the shares of
  f(d_row) + g(d_col) add to one.
- the axis-specialization score, one number in [-1, 1]:

      spec = (eta2_row - eta2_col) / max(eta2_row + eta2_col, min_explained)

  +1: only the row offset explains the logits (row-only head), -1: only the column offset, 0:
  neither, or both equally. Heads whose logits position barely explains (eta2_row + eta2_col
  below min_explained) are shrunk towards 0, so a near-uniform head does not get a large score
  by noise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from poslens import distributed
from poslens.models import hooks
from poslens.models.posenc import grid_coords
from poslens.models.vit import ViT
from poslens.precision import autocast


@dataclass(frozen=True)
class AttentionStats:
    """Per block and head [depth, H], patch queries x patch keys (see the module doc)."""

    mean_abs_drow: np.ndarray  # E|d_row| under the attention renormalised over patch keys
    mean_abs_dcol: np.ndarray
    uniform_abs_drow: float  # the same under uniform attention over patch keys
    uniform_abs_dcol: float
    eta2_row: np.ndarray  # share of within-query logit variance explained by the row offset
    eta2_col: np.ndarray
    specialization: np.ndarray  # in [-1, 1]: +1 row-only, -1 column-only
    patch_mass: np.ndarray  # attention patch queries give patch keys (1 - prefix share)
    min_explained: float
    n_images: int

    def rows(self) -> list[dict[str, Any]]:
        """CSV rows: one per block and head."""
        depth, heads = self.specialization.shape
        return [
            {
                "block": b,
                "head": h,
                "specialization": float(self.specialization[b, h]),
                "eta2_row": float(self.eta2_row[b, h]),
                "eta2_col": float(self.eta2_col[b, h]),
                "mean_abs_drow": float(self.mean_abs_drow[b, h]),
                "mean_abs_dcol": float(self.mean_abs_dcol[b, h]),
                "uniform_abs_drow": self.uniform_abs_drow,
                "uniform_abs_dcol": self.uniform_abs_dcol,
                "patch_mass": float(self.patch_mass[b, h]),
            }
            for b in range(depth)
            for h in range(heads)
        ]


def specialization(eta2_row: np.ndarray, eta2_col: np.ndarray, min_explained: float) -> np.ndarray:
    """(eta2_row - eta2_col) / max(eta2_row + eta2_col, min_explained), in [-1, 1]."""
    total = np.maximum(eta2_row + eta2_col, min_explained)
    return (eta2_row - eta2_col) / total


class AttentionAccumulator:
    """Streams the attention statistics over batches through hooks on every block's logits and
    pattern (nothing is cached: memory is one block's [B, H, T, T] at a time)."""

    def __init__(self, depth: int, heads: int, gh: int, gw: int, prefix: int, device: Any) -> None:
        row, col = grid_coords(gh, gw, device)  # [N] each, row-major patches
        d_row = row[None, :] - row[:, None]  # [N queries, N keys]: key row - query row
        d_col = col[None, :] - col[:, None]
        self.abs_d = torch.stack([d_row.abs(), d_col.abs()]).double()  # [2, N, N]
        # one-hot of the signed offset of every (query, key) pair: [N * N, 2g - 1]
        self.onehot = [
            F.one_hot((d + g - 1).long().flatten(), 2 * g - 1).double()
            for d, g in ((d_row, gh), (d_col, gw))
        ]
        # Least squares of the logits on an offset function plus a free constant per query:
        # with X~ the one-hot centred within each query, the explained sum of squares is
        # g' pinv(X~'X~) g / images for group sums g (one image's Gram: the same for every image).
        n = len(row)
        self.gram_pinv = []
        for onehot in self.onehot:
            x = onehot.view(n, n, -1)  # [queries, keys, offsets]
            xc = x - x.mean(1, keepdim=True)
            self.gram_pinv.append(torch.linalg.pinv(torch.einsum("qko,qkp->op", xc, xc)))
        self.prefix = prefix
        z = lambda *s: torch.zeros(*s, dtype=torch.float64, device=device)  # noqa: E731
        self.ss_total = z(depth, heads)
        self.group_sums = [z(depth, heads, 2 * g - 1) for g in (gh, gw)]
        self.abs_d_sum = z(depth, heads, 2)
        self.mass_sum = z(depth, heads)
        self.n_images = 0

    def hooks(self, depth: int) -> list[tuple[str, Callable[[torch.Tensor, str], None]]]:
        """(hook name, hook) pairs on the logits and pattern of blocks 0..depth-1."""
        out = []
        for b in range(depth):
            out.append((hooks.attn(b, "attn_scores"), self._scores_hook(b)))
            out.append((hooks.attn(b, "pattern"), self._pattern_hook(b)))
        return out

    def _scores_hook(self, b: int) -> Callable[[torch.Tensor, str], None]:
        def hook(scores: torch.Tensor, _name: str) -> None:
            p = self.prefix
            s = scores[:, :, p:, p:].double()  # [B, H, N, N] patch queries x patch keys
            s = s - s.mean(-1, keepdim=True)  # softmax ignores each query's offset
            self.ss_total[b] += s.square().sum((0, 2, 3))
            flat = s.sum(0).flatten(1)  # [H, N * N]: summed over images
            for sums, onehot in zip(self.group_sums, self.onehot, strict=True):
                sums[b] += flat @ onehot  # [H, offsets]

        return hook

    def _pattern_hook(self, b: int) -> Callable[[torch.Tensor, str], None]:
        def hook(pattern: torch.Tensor, _name: str) -> None:
            p = self.prefix
            a = pattern[:, :, p:, p:].double()  # [B, H, N, N]
            mass = a.sum(-1, keepdim=True)  # [B, H, N, 1]
            w = a / mass.clamp_min(1e-30)  # renormalised over patch keys
            n = a.shape[-1]
            self.abs_d_sum[b] += torch.einsum("bhqk,aqk->ha", w, self.abs_d) / n  # query mean
            self.mass_sum[b] += mass[..., 0].mean(-1).sum(0)

        return hook

    def all_reduce(self) -> None:
        """Sum the statistics and image counts of every rank (torchrun)."""
        for t in (self.ss_total, *self.group_sums, self.abs_d_sum, self.mass_sum):
            distributed.all_reduce_sum(t)
        self.n_images = distributed.sum_count(self.n_images)

    def result(self, min_explained: float) -> AttentionStats:
        """The statistics of the images seen so far (after `all_reduce` under torchrun)."""
        n = self.n_images
        explained = [  # [depth, H]
            torch.einsum("dho,op,dhp->dh", sums, pinv, sums) / n
            for sums, pinv in zip(self.group_sums, self.gram_pinv, strict=True)
        ]
        total = self.ss_total
        eta = [torch.where(total > 0, e / total.clamp_min(1e-300), 0.0) for e in explained]
        eta_row, eta_col = (e.clamp(0, 1).cpu().numpy() for e in eta)
        uniform = self.abs_d.mean((1, 2)).cpu().numpy()
        d = (self.abs_d_sum / n).cpu().numpy()
        return AttentionStats(
            mean_abs_drow=d[..., 0],
            mean_abs_dcol=d[..., 1],
            uniform_abs_drow=float(uniform[0]),
            uniform_abs_dcol=float(uniform[1]),
            eta2_row=eta_row,
            eta2_col=eta_col,
            specialization=specialization(eta_row, eta_col, min_explained),
            patch_mass=(self.mass_sum / n).cpu().numpy(),
            min_explained=min_explained,
            n_images=n,
        )


@torch.no_grad()
def attention_stats(
    model: ViT,
    images: torch.Tensor,
    batch_size: int = 250,
    min_explained: float = 0.05,
    condition: Callable[[ViT], contextlib.AbstractContextManager[Any]] | None = None,
    precision: str = "fp32",
) -> AttentionStats:
    """Attention statistics of every block and head on `images` (under `condition`, a function
    model -> context manager; None: the intact model), the batches sharded across ranks under
    torchrun and the sums reduced."""
    cfg = model.cfg
    dev = model.head.weight.device
    gh, gw = model.grid_of(images[:1])
    acc = AttentionAccumulator(cfg.depth, cfg.heads, gh, gw, cfg.num_prefix, dev)
    if condition is None:
        condition = lambda _model: contextlib.nullcontext()  # noqa: E731
    with autocast(model, precision), condition(model), model.hooks(acc.hooks(cfg.depth)):
        for start in distributed.shard(len(images), batch_size):
            xb = images[start : start + batch_size].to(dev)
            model(xb)
            acc.n_images += len(xb)
    acc.all_reduce()
    return acc.result(min_explained)


__all__ = ["AttentionAccumulator", "AttentionStats", "attention_stats", "specialization"]
