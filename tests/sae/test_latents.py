"""The positional-latent finder recovers planted row, column and cell latents."""

from __future__ import annotations

import numpy as np

from poslens.sae.latents import find_positional_latents, position_score


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
