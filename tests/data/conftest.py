"""Shared helpers for the data tests."""

from __future__ import annotations

import numpy as np
import pytest


def expected_relation(ref: np.ndarray, target: np.ndarray, relation: str) -> np.ndarray:
    """Relation class from centres (row, col), written out from the spec, one image at a time."""
    out = []
    for (r0, c0), (r1, c1) in zip(ref, target, strict=True):
        d_row, d_col = r1 - r0, c1 - c0
        if relation == "sector":
            if abs(d_row) > abs(d_col):
                out.append(0 if d_row < 0 else 2)  # above / below
            else:
                out.append(1 if d_col > 0 else 3)  # right / left
        else:
            out.append(2 * int(d_row < 0) + int(d_col < 0))
    return np.array(out)


def alpha_centroid(alpha: np.ndarray) -> np.ndarray:
    """Coverage-weighted centre (row, col) in pixels of each image in alpha [n, H, W]. [n, 2]"""
    coords = np.arange(alpha.shape[1]) + 0.5
    mass = alpha.sum(axis=(1, 2))
    rows = (alpha.sum(axis=2) * coords).sum(axis=1) / mass
    cols = (alpha.sum(axis=1) * coords).sum(axis=1) / mass
    return np.stack([rows, cols], axis=1)


@pytest.fixture
def relation_from_centres():
    """expected_relation, as a fixture (test folders are not packages, so no imports)."""
    return expected_relation


@pytest.fixture
def centroid():
    """alpha_centroid, as a fixture."""
    return alpha_centroid
