"""Positional latents: which SAE latents fire by where a token is rather than what it shows.

From codes [N_images, T, F] of the patch tokens (T = gh * gw, row-major):
- per latent, `eta` = the share of its activation variance (over all patch tokens) explained by
  position: var over positions of its mean code at each position / its total variance. 1 for a
  latent that fires by position alone, about 0 for a content latent;
- the positional set: every latent with eta >= POSITIONAL_ETA that fires on at least MIN_RATE of
  the tokens, strongest first. Duplicates count: an SAE may spread one row over several latents,
  and zeroing only the best one per row leaves the others carrying it;
- each positional latent's G x G mean map, classified by where its mass sits: "cell" (one
  position holds at least CELL_SHARE of it), "row" / "col" (one row / column holds at least
  LINE_SHARE and the other axis does not), or "mixed"; and its row, column and cell selectivity
  (max row mean / overall mean: G for a perfect row latent, 1 for a flat one);
- controls are drawn from the non-positional latents (eta < NON_POSITIONAL_ETA).
A small model may factor position into cell latents instead of row and column latents (see
`../shared/NOTES.md`); `counts` says which kind was found.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

POSITIONAL_ETA = 0.5  # position explains at least half of a positional latent's variance
NON_POSITIONAL_ETA = 0.1  # ... and at most a tenth of a control latent's
MIN_RATE = 0.002  # a latent must fire on this share of tokens to be judged at all
CELL_SHARE = 0.5  # a latent with half its mass on one position is a cell latent
LINE_SHARE = 0.6  # ... with this share on one row (column) and less on any column (row): row (col)
KINDS = ("row", "col", "cell", "mixed")


@dataclass(frozen=True)
class PositionalLatents:
    """The positional set of an SAE, ordered by eta (most positional first)."""

    latents: np.ndarray  # [P] latent indices
    kind: np.ndarray  # [P] "row" | "col" | "cell" | "mixed"
    score: np.ndarray  # [P] eta: share of the latent's variance explained by position
    maps: np.ndarray  # [P, gh, gw] mean code per position
    row_selectivity: np.ndarray  # [P]
    col_selectivity: np.ndarray  # [P]
    cell_selectivity: np.ndarray  # [P]
    best_row: np.ndarray  # [gh] the row latent most selective for each row (-1: none)
    best_col: np.ndarray  # [gw]
    non_positional: np.ndarray  # latents with eta < NON_POSITIONAL_ETA: the controls' pool
    eta: np.ndarray  # [F] every latent's eta (NaN for latents that never fire)

    @property
    def counts(self) -> dict[str, int]:
        return {k: int((self.kind == k).sum()) for k in KINDS}

    def of_kind(self, *kinds: str) -> np.ndarray:
        """The positional latents of the given kinds, strongest first."""
        return self.latents[np.isin(self.kind, kinds)]

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
            "n_non_positional": len(self.non_positional),
            "thresholds": {
                "positional_eta": POSITIONAL_ETA,
                "non_positional_eta": NON_POSITIONAL_ETA,
            },
        }


def position_score(mean_TF: np.ndarray) -> np.ndarray:
    """[T, F]: mean code at each position minus the mean over the other positions."""
    T = mean_TF.shape[0]
    elsewhere = (mean_TF.sum(0, keepdims=True) - mean_TF) / (T - 1)
    return mean_TF - elsewhere


CHUNK_BYTES = 1 << 24  # float64 token rows per pass of _token_variance (16 MiB)


def position_eta(codes_NTF: np.ndarray) -> np.ndarray:
    """[F]: share of each latent's variance over all patch tokens that its per-position mean
    explains (the correlation ratio eta^2 with position as the factor); NaN where it never varies."""
    total = _token_variance(codes_NTF.reshape(-1, codes_NTF.shape[-1]))
    between = codes_NTF.mean(0, dtype=np.float64).var(0)  # [F]: over positions (equal counts)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, between / np.where(total > 0, total, 1.0), np.nan)


def _token_variance(flat_NF: np.ndarray) -> np.ndarray:
    """[F]: `flat_NF.astype(float64).var(0)` bit for bit (the same sums in the same order),
    without the float64 copy and its deviations, four times the codes (230 MiB at a ViT-Ti's
    80 images x 196 tokens x 960 latents), held at once: a chunk of rows at a time."""
    n, F = flat_NF.shape
    mean = np.add.reduce(flat_NF, axis=0, dtype=np.float64) / n  # [F]
    acc = np.zeros((1, F))  # running sum of squared deviations, row after row as numpy adds them
    rows = _chunk_rows(F)
    for i in range(0, n, rows):
        dev = flat_NF[i : i + rows].astype(np.float64)
        dev -= mean
        dev *= dev
        acc = np.add.reduce(np.concatenate([acc, dev]), axis=0, keepdims=True)
    return acc[0] / n


def _chunk_rows(F: int) -> int:
    """Token rows of F float64 values in CHUNK_BYTES."""
    return max(1, CHUNK_BYTES // (8 * F))


def firing_rate(codes_NTF: np.ndarray) -> np.ndarray:
    """[F]: share of the patch tokens on which each latent fires, counted a chunk at a time (no
    boolean copy of the codes)."""
    flat = codes_NTF.reshape(-1, codes_NTF.shape[-1])
    rows = _chunk_rows(flat.shape[1])
    fired = sum(
        (np.count_nonzero(flat[i : i + rows] > 0, axis=0) for i in range(0, len(flat), rows)),
        np.zeros(flat.shape[1], dtype=np.int64),
    )
    return fired / len(flat)


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


def find_positional_latents(codes_NTF: np.ndarray, gh: int, gw: int) -> PositionalLatents:
    """The positional set from patch-token codes [N_images, gh*gw, F] (all >= 0)."""
    T = codes_NTF.shape[1]
    if T != gh * gw:
        raise ValueError(f"{T} tokens do not fit a {gh}x{gw} grid")
    eta = position_eta(codes_NTF)
    rate = firing_rate(codes_NTF)
    fires = (rate >= MIN_RATE) & np.isfinite(eta)
    positional = np.flatnonzero(fires & (np.nan_to_num(eta) >= POSITIONAL_ETA))
    positional = positional[np.argsort(-eta[positional], kind="stable")]
    non_positional = np.flatnonzero(~fires | (np.nan_to_num(eta) < NON_POSITIONAL_ETA))
    maps = codes_NTF.mean(0, dtype=np.float64)[:, positional].T.reshape(-1, gh, gw)  # [P, gh, gw]
    overall = np.maximum(maps.mean((1, 2)), 1e-12)
    row_sel, col_sel = maps.mean(2).max(1) / overall, maps.mean(1).max(1) / overall
    cell_sel = maps.max((1, 2)) / overall
    kinds = _classify(maps) if len(positional) else np.array([], dtype="<U5")
    best_row, best_col = np.full(gh, -1), np.full(gw, -1)
    strongest_row, strongest_col = maps.mean(2).argmax(1), maps.mean(1).argmax(1)
    for best, strongest, sel, kind in (
        (best_row, strongest_row, row_sel, "row"),
        (best_col, strongest_col, col_sel, "col"),
    ):  # per row (column): among latents of that kind whose strongest row it is, the most selective
        for r in range(len(best)):
            idx = np.flatnonzero((strongest == r) & (kinds == kind))
            if len(idx):
                best[r] = positional[idx[np.argmax(sel[idx])]]
    return PositionalLatents(
        latents=positional,
        kind=kinds,
        score=eta[positional],
        maps=maps,
        row_selectivity=row_sel,
        col_selectivity=col_sel,
        cell_selectivity=cell_sel,
        best_row=best_row,
        best_col=best_col,
        non_positional=non_positional,
        eta=eta,
    )
