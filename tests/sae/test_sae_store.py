from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from poslens.sae import ActivationStore
from tests.conftest import tiny

SITE = "blocks.1.ln1.hook_normalized"


def test_patch_tokens_and_positions_match_the_cache(images: torch.Tensor) -> None:
    model = tiny("ape")
    store = ActivationStore.from_model(model, images, SITE, batch_images=2)
    _, cache = model.run_with_cache(images, SITE)
    p = model.cfg.num_prefix
    assert p == 1 and store.grid == (4, 4) and len(store) == 3 * 16
    torch.testing.assert_close(store.rows(slice(None)), cache[SITE][:, p:].reshape(-1, 32))
    assert store.pos_N.tolist() == list(range(16)) * 3
    assert store.image_N.tolist() == [i for i in range(3) for _ in range(16)]


def test_prefix_tokens_get_negative_positions(images: torch.Tensor) -> None:
    model = tiny("ape", num_registers=2)
    store = ActivationStore.from_model(model, images, SITE, include_prefix=True)
    _, cache = model.run_with_cache(images, SITE)
    assert len(store) == 3 * 19
    assert store.pos_N[:19].tolist() == [-3, -2, -1, *range(16)]
    torch.testing.assert_close(store.rows(slice(None)), cache[SITE].reshape(-1, 32))


def test_memmap_and_memory_give_identical_batches(images: torch.Tensor, tmp_path: Path) -> None:
    model = tiny("ape")
    mem = ActivationStore.from_model(model, images, SITE)
    disk = ActivationStore.from_model(model, images, SITE, path=tmp_path / "acts.npy")
    assert isinstance(disk.acts_ND, np.memmap)
    assert np.load(tmp_path / "acts.npy", mmap_mode="r", allow_pickle=False).shape == (48, 32)
    a, b = mem.batches(10, seed=3), disk.batches(10, seed=3)
    for _ in range(12):  # more than two epochs, including the short last batches
        assert torch.equal(next(a), next(b))
    assert not torch.equal(next(mem.batches(10, seed=3)), next(mem.batches(10, seed=4)))


def test_each_epoch_visits_every_token_once() -> None:
    x = torch.arange(25.0)[:, None].repeat(1, 3)
    it = ActivationStore(x).batches(7, seed=0)
    for _ in range(2):
        epoch = torch.cat([next(it) for _ in range(4)])  # 7 + 7 + 7 + 4
        assert sorted(epoch[:, 0].tolist()) == list(range(25))
    s_D, s_DD = ActivationStore(x).moments()
    torch.testing.assert_close(s_D, x.double().sum(0))
    torch.testing.assert_close(s_DD, x.double().T @ x.double())
