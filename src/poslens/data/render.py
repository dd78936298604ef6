"""Drawing primitives: 1/f noise backgrounds, anti-aliased glyphs, exact area downsampling."""

from __future__ import annotations

import numpy as np
import torch

from poslens.data.config import GLYPHS

_SQRT2 = np.sqrt(2.0)


def pink_noise(rng: np.random.Generator, n: int, size: int) -> np.ndarray:
    """n fields with a 1/f amplitude spectrum, each zero mean and unit std. [n, size, size] f32.

    White noise filtered in Fourier space, so every image has natural-image-like statistics:
    large smooth blobs plus finer texture, no dominant orientation or period. The white noise is
    uniform (3x cheaper than normal); each Fourier coefficient sums all pixels, so it is Gaussian.
    """
    white = torch.from_numpy(rng.random((n, size, size), dtype=np.float32) - 0.5)
    f_row = torch.fft.fftfreq(size)[:, None]  # [size, 1] cycles per pixel
    f_col = torch.fft.rfftfreq(size)[None, :]  # [1, size // 2 + 1]
    gain = 1.0 / torch.sqrt(f_row**2 + f_col**2)
    gain[0, 0] = 0.0  # drop the mean (DC) component
    field = torch.fft.irfft2(torch.fft.rfft2(white) * gain, s=(size, size))  # [n, size, size]
    rms = torch.linalg.vector_norm(field.reshape(n, -1), dim=1) / size  # the std: mean is 0
    return (field / rms[:, None, None]).numpy()


def _cross_sdf(u: np.ndarray, v: np.ndarray, arm: float, half_width: float) -> np.ndarray:
    """Plus sign: union of a horizontal and a vertical bar."""
    horizontal = np.maximum(np.abs(u) - arm, np.abs(v) - half_width)
    vertical = np.maximum(np.abs(u) - half_width, np.abs(v) - arm)
    return np.minimum(horizontal, vertical)


def _triangle_sdf(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Filled triangle pointing up (apex at v=-0.9, base at v=0.8): max of three half-planes."""
    apex_v, base_v = -0.9, 0.8
    nu, nv = 1.7, -1.0  # outward normal of the right edge (the left edge mirrors it)
    norm = np.hypot(nu, nv)
    right = (nu * u + nv * (v - apex_v)) / norm
    left = (-nu * u + nv * (v - apex_v)) / norm
    return np.maximum(np.maximum(left, right), v - base_v)


# Signed distance (negative inside) of each shape in box units: the glyph fills [-1, 1]^2 with
# u along columns and v along rows (v < 0 is up). Distances are exact or slight underestimates.
_SDF = {
    "ring": lambda u, v: np.abs(np.hypot(u, v) - 0.78) - 0.22,
    "cross": lambda u, v: _cross_sdf(u, v, arm=1.0, half_width=0.25),
    "square": lambda u, v: np.maximum(np.abs(u), np.abs(v)) - 0.8,
    "triangle": _triangle_sdf,
    "x": lambda u, v: _cross_sdf((u + v) / _SQRT2, (u - v) / _SQRT2, arm=1.1, half_width=0.25),
    "disk": lambda u, v: np.hypot(u, v) - 0.9,
    "hbar": lambda u, v: np.maximum(np.abs(u) - 1.0, np.abs(v) - 0.3),
    "vbar": lambda u, v: np.maximum(np.abs(u) - 0.3, np.abs(v) - 1.0),
    "diamond": lambda u, v: (np.abs(u) + np.abs(v) - 1.0) / _SQRT2,
}
assert set(GLYPHS) <= set(_SDF), "every content glyph needs a shape"


def glyph_alpha(name: str, centre: np.ndarray, size: np.ndarray, image_size: int) -> np.ndarray:
    """Coverage in [0, 1] of glyph `name` drawn in square boxes. [m, H, W] f32.

    centre [m, 2] (row, col) and size [m] (box side) are in pixels; pixel (i, j) covers
    [i, i+1] x [j, j+1]. Coverage is exactly 0 beyond half a pixel outside the box, so it is
    computed only in a window around each box (6x fewer pixels than the canvas at 32 px).
    """
    half = (size / 2)[:, None, None]  # [m, 1, 1]
    window = int(np.ceil(size.max())) + 2  # covers every pixel the coverage can reach
    top_left = np.minimum(np.floor(centre - half[:, 0]), image_size - window).astype(np.int64)
    rows = top_left[:, 0, None] + np.arange(window)  # [m, window]
    cols = top_left[:, 1, None] + np.arange(window)
    v = ((rows + 0.5 - centre[:, 0, None]) / half[:, 0])[:, :, None]  # [m, window, 1]
    u = ((cols + 0.5 - centre[:, 1, None]) / half[:, 0])[:, None, :]  # [m, 1, window]
    u, v = u.astype(np.float32), v.astype(np.float32)
    inside_box = np.maximum(np.abs(u), np.abs(v)) - 1.0  # clips every shape to its box
    dist_px = np.maximum(_SDF[name](u, v), inside_box) * half.astype(np.float32)
    return paste(np.clip(0.5 - dist_px, 0.0, 1.0), top_left, image_size)


def paste(patches: np.ndarray, top_left: np.ndarray, image_size: int) -> np.ndarray:
    """Place patches [m, k, k] with top-left pixels top_left [m, 2] on zero canvases. [m, H, W]."""
    m, k = patches.shape[:2]
    canvas = np.zeros((m, image_size, image_size), dtype=np.float32)
    rows = top_left[:, 0, None, None] + np.arange(k)[None, :, None]  # [m, k, 1]
    cols = top_left[:, 1, None, None] + np.arange(k)[None, None, :]  # [m, 1, k]
    canvas[np.arange(m)[:, None, None], rows, cols] = patches
    return canvas


def area_resize_matrix(n_in: int, n_out: int) -> np.ndarray:
    """[n_out, n_in] weights that average each output pixel's exact footprint (area resampling).

    Downsample an image X [n_in, n_in] with M @ X @ M.T; each row of M sums to 1.
    """
    edges = np.arange(n_out + 1) * (n_in / n_out)  # output pixel borders in input pixels
    lo, hi = edges[:-1, None], edges[1:, None]  # [n_out, 1]
    j = np.arange(n_in)[None, :]  # [1, n_in]
    overlap = np.clip(np.minimum(hi, j + 1) - np.maximum(lo, j), 0.0, None)
    return overlap / (n_in / n_out)
