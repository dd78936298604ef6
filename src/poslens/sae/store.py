"""ActivationStore: tokens [N, D] from one hook site, with their grid positions, in memory or on disk.

Activations are float32, held as a torch tensor or, when `path` is given, a .npy file opened as
an np.memmap (np.load(path, mmap_mode="r") reads it back; nothing is pickled). Per token the
store keeps `pos_N` (row-major index in the patch grid; prefix tokens, when included, get
-num_prefix..-1; -1 when built from a bare tensor) and `image_N`, so latents can later be mapped
to positions. Minibatches are shuffled by a seeded generator; each batch's
indices are sorted, so memmap reads go forward and both backends yield identical batches.
Under torchrun `from_model` shards the images' batches across the ranks and gathers them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from poslens import distributed
from poslens.errors import DataError
from poslens.models import ViT

# images per forward pass when a store is built (analysis passes it its smaller batch on big models)
STORE_BATCH_IMAGES = 128


class ActivationStore:
    """Tokens [N, D] (float32) with positions and image indices; `grid` is (gh, gw) or None."""

    def __init__(
        self,
        acts_ND: torch.Tensor | np.ndarray,
        pos_N: torch.Tensor | None = None,
        image_N: torch.Tensor | None = None,
        grid: tuple[int, int] | None = None,
        site: str = "",
    ) -> None:
        if acts_ND.ndim != 2 or acts_ND.shape[0] == 0:
            raise DataError(f"activations must be a non-empty [N, D] array, got {acts_ND.shape}")
        self.acts_ND = acts_ND
        n = acts_ND.shape[0]
        self.pos_N = torch.full((n,), -1, dtype=torch.long) if pos_N is None else pos_N
        self.image_N = torch.arange(n) if image_N is None else image_N
        self.grid, self.site = grid, site

    @classmethod
    @torch.no_grad()
    def from_model(
        cls,
        model: ViT,
        images: torch.Tensor,
        site: str,
        include_prefix: bool = False,
        path: str | Path | None = None,
        batch_images: int = STORE_BATCH_IMAGES,
        shard: bool = True,
    ) -> ActivationStore:
        """Run `model` over images [N, C, H, W] and keep the tokens at `site` (patches unless
        include_prefix); into a float32 .npy memmap at `path` when given, else in memory.

        Under torchrun (and `shard`) this is collective: each rank runs every world-th batch of
        `batch_images` and the batches are gathered in order, so every rank gets the very store
        one process builds (the same batches, bit for bit). With `path`, rank 0 writes the file
        and the others map it copy-on-write (it must be on a filesystem they share).
        """
        model.eval()
        device = model.head.weight.device
        gh, gw = model.grid_of(images[:1])
        prefix = model.cfg.num_prefix
        first = 0 if include_prefix else prefix
        per_image = prefix + gh * gw - first
        n, d = images.shape[0] * per_image, model.cfg.dim
        rank, world = distributed.world() if shard else (0, 1)
        writes = rank == 0 or path is None  # under torchrun only rank 0 writes the file
        acts = (
            (torch.empty(n, d) if path is None else _open_npy(Path(path), (n, d)))
            if writes
            else None
        )
        starts = list(range(0, images.shape[0], batch_images))
        for r in range(0, len(starts), world):  # one round: one batch per rank
            mine = starts[r + rank] if r + rank < len(starts) else None
            tok = None
            if mine is not None:
                # the pass stops at the site: the blocks after it do not change what is read
                cache = model.cache_until(images[mine : mine + batch_images].to(device), [site])
                tok = cache[site][:, first:].float().reshape(-1, d).cpu()
            pieces = [(mine, tok)] if world == 1 else distributed.gather_objects((mine, tok))
            for start, part in pieces:
                if start is None or acts is None:
                    continue
                rows = slice(start * per_image, start * per_image + part.shape[0])
                acts[rows] = part if path is None else part.numpy()
        if isinstance(acts, np.memmap):
            acts.flush()
        if world > 1 and path is not None:
            distributed.barrier()  # the file is complete
            if acts is None:
                acts = np.load(Path(path), mmap_mode="c", allow_pickle=False)  # never written
        assert acts is not None
        pos = torch.arange(first, prefix + gh * gw) - prefix
        return cls(
            acts,
            pos_N=pos.repeat(images.shape[0]),
            image_N=torch.arange(images.shape[0]).repeat_interleave(per_image),
            grid=(gh, gw),
            site=site,
        )

    def __len__(self) -> int:
        return self.acts_ND.shape[0]

    @property
    def d_in(self) -> int:
        return self.acts_ND.shape[1]

    def rows(self, idx: torch.Tensor | slice) -> torch.Tensor:
        """Activations [len(idx), D] as a float32 torch tensor."""
        if isinstance(self.acts_ND, torch.Tensor):
            rows = (
                self.acts_ND[idx] if isinstance(idx, slice) else self.acts_ND.index_select(0, idx)
            )
            return rows.float()
        idx = idx if isinstance(idx, slice) else idx.numpy()
        return torch.from_numpy(np.ascontiguousarray(self.acts_ND[idx], dtype=np.float32))

    def chunks(self, size: int = 65536) -> Iterator[torch.Tensor]:
        """All activations in order, `size` tokens at a time."""
        for i in range(0, len(self), size):
            yield self.rows(slice(i, i + size))

    def batches(self, batch: int, seed: int) -> Iterator[torch.Tensor]:
        """Endless shuffled minibatches: each epoch a fresh seeded permutation, last batch short."""
        gen = torch.Generator().manual_seed(seed)
        while True:
            perm = torch.randperm(len(self), generator=gen)
            for i in range(0, len(self), batch):
                yield self.rows(perm[i : i + batch].sort().values)

    def moments(self, outer: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """float64 sums over all tokens of x [D] and, if outer, of x x^T [D, D] (for whitening)."""
        s_D = torch.zeros(self.d_in, dtype=torch.float64)
        s_DD = torch.zeros(self.d_in, self.d_in, dtype=torch.float64) if outer else None
        for x in self.chunks():
            x = x.double()
            s_D += x.sum(0)
            if s_DD is not None:
                s_DD += x.T @ x
        return s_D, s_DD


def _open_npy(path: Path, shape: tuple[int, int]) -> np.memmap:
    """A new float32 .npy file of `shape`, mapped for writing."""
    return np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=shape)
