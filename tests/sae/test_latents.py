"""The positional-latent finder recovers planted row, column and cell latents, from statistics
computed without copies of the codes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from poslens.models import hooks
from poslens.sae import latents
from poslens.sae.latents import find_positional_latents, position_score
from poslens.sae.model import TopKSAE
from poslens.sae.pipeline import patch_codes
from tests.conftest import tiny


def planted(seed: int = 0, g: int = 4, n: int = 50) -> np.ndarray:
    """Codes [n, g*g, 20]: latents 0..g-1 fire on one row each, g..2g-1 on one column each,
    latent 2g only at cell (1, 2), the rest are position-free content latents."""
    rng = np.random.default_rng(seed)
    t = g * g
    k = np.arange(t)
    codes = np.zeros((n, t, 20))
    for i in range(g):
        codes[:, k // g == i, i] = 1 + 0.1 * rng.random((n, g))
        codes[:, k % g == i, g + i] = 1 + 0.1 * rng.random((n, g))
    codes[:, g + 2, 2 * g] = 2.0
    codes[:, :, 2 * g + 1 :] = rng.random((n, t, 20 - 2 * g - 1)) * (rng.random((n, t, 11)) < 0.3)
    return codes


def test_planted_row_column_and_cell_latents_are_found_and_classified() -> None:
    p = find_positional_latents(planted(), 4, 4)
    kinds = dict(zip(p.latents.tolist(), p.kind.tolist(), strict=True))
    assert kinds == {
        0: "row",
        1: "row",
        2: "row",
        3: "row",
        4: "col",
        5: "col",
        6: "col",
        7: "col",
        8: "cell",
    }
    assert p.best_row.tolist() == [0, 1, 2, 3] and p.best_col.tolist() == [4, 5, 6, 7]
    assert p.counts == {"row": 4, "col": 4, "cell": 1, "mixed": 0}
    assert "row and column" in p.verdict()
    np.testing.assert_allclose(p.maps[p.latents.tolist().index(8)][1, 2], 2.0)


def test_content_only_codes_give_no_row_or_column_latents() -> None:
    rng = np.random.default_rng(1)
    codes = rng.random((200, 16, 12)) * (rng.random((200, 16, 12)) < 0.3)
    p = find_positional_latents(codes, 4, 4)
    assert p.counts["row"] == p.counts["col"] == p.counts["cell"] == 0


def test_position_score_is_there_minus_elsewhere() -> None:
    mean = np.array([[3.0, 1.0], [1.0, 1.0], [2.0, 1.0]])
    np.testing.assert_allclose(position_score(mean)[:, 0], [3 - 1.5, 1 - 2.5, 2 - 2.0])
    np.testing.assert_allclose(position_score(mean)[:, 1], 0)


@pytest.mark.parametrize("chunk_bytes", [1 << 24, 8 * 20 * 7])  # one pass; passes of 7 rows
def test_eta_and_firing_rate_are_the_float64_formulas_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, chunk_bytes: int
) -> None:
    """Computed a chunk of token rows at a time, eta and the firing rate are exactly what the
    whole float64 copy of the codes gives (the positional set's thresholds see the same numbers)."""
    monkeypatch.setattr(latents, "CHUNK_BYTES", chunk_bytes)
    rng = np.random.default_rng(3)
    for codes in (planted().astype(np.float32), planted(1, n=7),
                  np.maximum(rng.standard_normal((9, 16, 20)), 0).astype(np.float32)):  # fmt: skip
        flat = codes.reshape(-1, codes.shape[-1]).astype(np.float64)
        total, between = flat.var(0), codes.mean(0, dtype=np.float64).var(0)
        with np.errstate(invalid="ignore", divide="ignore"):
            want = np.where(total > 0, between / np.where(total > 0, total, 1.0), np.nan)
        assert np.array_equal(latents.position_eta(codes), want, equal_nan=True)
        assert np.array_equal(latents.firing_rate(codes), (flat > 0).mean(0))
    assert np.isnan(latents.position_eta(np.zeros((3, 4, 2), dtype=np.float32))).all()


def test_patch_codes_are_the_per_batch_codes_in_order() -> None:
    """Codes written batch by batch into one array equal each image's codes alone, in image
    order, also when the batch does not divide the images."""
    model = tiny("ape")
    site = hooks.normalized(1)
    sae = TopKSAE(model.cfg.dim, 4 * model.cfg.dim, 4, site=site)
    x = torch.randn(7, model.cfg.in_chans, model.cfg.image_size, model.cfg.image_size)
    got = patch_codes(model, sae, x, batch=3)
    assert got.shape == (7, model.cfg.grid**2, 4 * model.cfg.dim) and got.dtype == np.float32
    for i in range(7):
        np.testing.assert_allclose(got[i], patch_codes(model, sae, x[i : i + 1])[0], atol=1e-6)
