"""Positional latents: which SAE latents fire by where a token is rather than what it shows.

From codes [N_images, T, F] of the patch tokens (T = gh * gw, row-major):
- per position, the mean code there minus its mean elsewhere (`position_score` [T, F]);
- candidates: the top latents of every position; each gets its G x G mean map;
- selectivity: row = max row mean / overall mean (G for a perfect row latent, 1 for a flat one),
  column likewise, cell = max cell mean / overall mean;
- per row the candidate most selective for that row, per column likewise: their union is the
  positional set; every positional latent is also classified by where its map's mass sits:
  "cell" (one position holds at least CELL_SHARE of it), "row" / "col" (one row / column holds at
  least LINE_SHARE and the other axis does not), or "mixed".
A small model may factor position into cell latents instead of row and column latents (see
`../shared/NOTES.md`); `counts` says which kind was found.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CELL_SHARE = 0.5  # a latent with half its mass on one position is a cell latent
LINE_SHARE = 0.6  # ... with this share on one row (column) and less on any column (row): row (col)


@dataclass(frozen=True)
class PositionalLatents:
    """The positional set of an SAE, ordered by positional score (strongest first)."""

    latents: np.ndarray  # [P] latent indices
    kind: np.ndarray  # [P] "row" | "col" | "cell" | "mixed"
    score: np.ndarray  # [P] max over positions of (mean there - mean elsewhere)
    maps: np.ndarray  # [P, gh, gw] mean code per position
    row_selectivity: np.ndarray  # [P]
    col_selectivity: np.ndarray  # [P]
    cell_selectivity: np.ndarray  # [P]
    best_row: np.ndarray  # [gh] latent most selective for each row (-1: none fires)
    best_col: np.ndarray  # [gw]
    candidates: np.ndarray  # all latents considered

    @property
    def counts(self) -> dict[str, int]:
        return {k: int((self.kind == k).sum()) for k in ("row", "col", "cell", "mixed")}

    def verdict(self) -> str:
        """One line: which kind of positional code this SAE found."""
        c = self.counts
        if not len(self.latents):
            return "no positional latents found"
        lines, cells = c["row"] + c["col"], c["cell"]
        kind = (
            "row and column latents"
            if lines > cells
            else "cell (single-position) latents"
            if cells > lines
            else "as many cell as row/column latents"
        )
        return f"position is factored mostly into {kind}: {c}"

    def to_dict(self) -> dict[str, object]:
        return {
            "latents": self.latents.tolist(),
            "kind": self.kind.tolist(),
            "score": self.score.tolist(),
            "row_selectivity": self.row_selectivity.tolist(),
            "col_selectivity": self.col_selectivity.tolist(),
            "cell_selectivity": self.cell_selectivity.tolist(),
            "best_row": self.best_row.tolist(),
            "best_col": self.best_col.tolist(),
            "counts": self.counts,
            "verdict": self.verdict(),
            "n_candidates": len(self.candidates),
        }


def position_score(mean_TF: np.ndarray) -> np.ndarray:
    """[T, F]: mean code at each position minus the mean over the other positions."""
    T = mean_TF.shape[0]
    elsewhere = (mean_TF.sum(0, keepdims=True) - mean_TF) / (T - 1)
    return mean_TF - elsewhere


def _classify(maps_PGG: np.ndarray) -> np.ndarray:
    mass = maps_PGG / np.maximum(maps_PGG.sum((1, 2), keepdims=True), 1e-12)
    cell = mass.max((1, 2))
    row, col = mass.sum(2).max(1), mass.sum(1).max(1)
    return np.where(
        cell >= CELL_SHARE,
        "cell",
        np.where(
            (row >= LINE_SHARE) & (col < LINE_SHARE),
            "row",
            np.where((col >= LINE_SHARE) & (row < LINE_SHARE), "col", "mixed"),
        ),
    )


def find_positional_latents(
    codes_NTF: np.ndarray, gh: int, gw: int, top_per_position: int = 3
) -> PositionalLatents:
    """The positional set from patch-token codes [N_images, gh*gw, F] (all >= 0)."""
    _, T, F = codes_NTF.shape
    if T != gh * gw:
        raise ValueError(f"{T} tokens do not fit a {gh}x{gw} grid")
    mean_TF = codes_NTF.mean(0, dtype=np.float64)
    score_TF = position_score(mean_TF)
    k = min(top_per_position, F)
    candidates = np.unique(np.argsort(-score_TF, axis=1)[:, :k])
    candidates = candidates[score_TF[:, candidates].max(0) > 0]
    maps = mean_TF[:, candidates].T.reshape(-1, gh, gw)  # [C, gh, gw]
    overall = np.maximum(maps.mean((1, 2)), 1e-12)
    row_sel = maps.mean(2).max(1) / overall
    col_sel = maps.mean(1).max(1) / overall
    cell_sel = maps.max((1, 2)) / overall
    # per row: among candidates whose strongest row is this row, the most row-selective
    best_row = np.full(gh, -1)
    best_col = np.full(gw, -1)
    strongest_row, strongest_col = maps.mean(2).argmax(1), maps.mean(1).argmax(1)
    for r in range(gh):
        idx = np.flatnonzero(strongest_row == r)
        if len(idx):
            best_row[r] = idx[np.argmax(row_sel[idx])]
    for c in range(gw):
        idx = np.flatnonzero(strongest_col == c)
        if len(idx):
            best_col[c] = idx[np.argmax(col_sel[idx])]
    chosen = np.unique(np.concatenate([best_row[best_row >= 0], best_col[best_col >= 0]]))
    # add cell latents: the single-position specialists among the candidates
    kinds_all = _classify(maps)
    chosen = np.union1d(chosen, np.flatnonzero(kinds_all == "cell"))
    peak = score_TF[:, candidates].max(0)
    chosen = chosen[np.argsort(-peak[chosen], kind="stable")]
    return PositionalLatents(
        latents=candidates[chosen],
        kind=kinds_all[chosen],
        score=peak[chosen],
        maps=maps[chosen],
        row_selectivity=row_sel[chosen],
        col_selectivity=col_sel[chosen],
        cell_selectivity=cell_sel[chosen],
        best_row=np.where(best_row >= 0, candidates[np.maximum(best_row, 0)], -1),
        best_col=np.where(best_col >= 0, candidates[np.maximum(best_col, 0)], -1),
        candidates=candidates,
    )
