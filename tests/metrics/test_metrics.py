from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

from poslens.metrics import (
    SSDC,
    correct_class_margin,
    effective_rank,
    manhattan_distance,
    paired_diff,
    retention,
    ssdc_from_similarity,
)


def test_ssdc_is_plus_one_minus_one_and_zero_on_constructed_similarity() -> None:
    d = manhattan_distance(4, 5).astype(float)
    assert ssdc_from_similarity(-d, 4, 5) == pytest.approx(1.0)
    assert ssdc_from_similarity(np.exp(-d), 4, 5) == pytest.approx(1.0)  # any falling function
    assert ssdc_from_similarity(d, 4, 5) == pytest.approx(-1.0)
    noise = np.random.default_rng(0).normal(size=(20, 20))
    assert abs(ssdc_from_similarity(noise + noise.T, 4, 5)) < 0.1


def test_ssdc_matches_scipy_spearman() -> None:
    rng = np.random.default_rng(1)
    sim = rng.normal(size=(9, 9)) - manhattan_distance(3, 3)
    iu = np.triu_indices(9, 1)
    expected = spearmanr(sim[iu], -manhattan_distance(3, 3)[iu]).statistic
    assert ssdc_from_similarity(sim, 3, 3) == pytest.approx(expected)


def test_streaming_equals_all_at_once() -> None:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randn(10, 16, 8, generator=g) + torch.linspace(0, 3, 16)[None, :, None]
    stream = SSDC(4, 4)
    for chunk in tokens.split(3):
        stream.update(chunk)
    unit = torch.nn.functional.normalize(tokens.double(), dim=-1)
    at_once = (unit @ unit.transpose(1, 2)).mean(0).numpy()
    np.testing.assert_allclose(stream.similarity, at_once, atol=1e-12)
    assert stream.value() == pytest.approx(ssdc_from_similarity(at_once, 4, 4))
    assert stream.sum.shape == (16, 16)  # memory does not grow with the number of images


def test_float32_streaming_matches_float64_reference() -> None:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randn(23, 16, 32, generator=g) + torch.linspace(0, 3, 16)[None, :, None]
    before = tokens.clone()
    stream = SSDC(4, 4, dtype=torch.float32)
    for chunk in tokens.split(5):  # uneven last batch
        stream.update(chunk)
    assert torch.equal(tokens, before)  # normalised in place, but on a copy
    unit = torch.nn.functional.normalize(tokens.double(), dim=-1)
    at_once = (unit @ unit.transpose(1, 2)).mean(0).numpy()
    assert stream.sum.dtype == torch.float64 and stream.count == 23
    np.testing.assert_allclose(stream.similarity, at_once, atol=1e-6)
    assert stream.value() == pytest.approx(ssdc_from_similarity(at_once, 4, 4), abs=1e-6)
    with pytest.raises(ValueError):
        SSDC(4, 4, dtype=torch.float16)


def test_float32_streaming_keeps_the_ranks_of_nearly_parallel_tokens() -> None:
    """Tokens that differ by 1e-3 around one direction (a random-init ViT's): their cosines
    differ by ~1e-6, below a float32 product's rounding, yet the float32 path's similarities
    match float64 to 1e-12 and its SSDC is float64's; a plain float32 product misses both."""
    g = torch.Generator().manual_seed(2)
    base, where = torch.randn(64, generator=g), torch.randn(16, 64, generator=g)
    tokens = base + 1e-3 * (where[None] + 0.3 * torch.randn(20, 16, 64, generator=g))
    exact, fast = SSDC(4, 4), SSDC(4, 4, dtype=torch.float32)
    for chunk in tokens.split(7):
        exact.update(chunk)
        fast.update(chunk)
    np.testing.assert_allclose(fast.similarity, exact.similarity, rtol=0, atol=1e-12)
    assert fast.value() == pytest.approx(exact.value(), abs=1e-12)
    unit = torch.nn.functional.normalize(tokens, dim=-1)
    plain = (unit @ unit.mT).double().mean(0).numpy()
    assert np.abs(plain - exact.similarity).max() > 1e-8
    assert ssdc_from_similarity(plain, 4, 4) != pytest.approx(exact.value(), abs=1e-3)


def test_tokens_that_encode_position_give_high_ssdc() -> None:
    row, col = np.divmod(np.arange(36), 6)
    # Gaussian bumps centred on each token's own cell: nearby tokens overlap more
    centres = np.stack([row, col], 1)
    feats = np.exp(-((centres[:, None, :] - centres[None, :, :]) ** 2).sum(-1) / 4.0)
    stream = SSDC(6, 6)
    stream.update(torch.tensor(feats)[None].repeat(2, 1, 1))
    assert stream.value() > 0.9


def test_retention_and_paired_diff() -> None:
    assert retention(0.5, 1.0, 0.0) == 0.5
    assert retention(0.25, 1.0, 0.25) == 0.0
    assert math.isnan(retention(0.3, 0.2, 0.2))
    a, b = np.array([1.0, 0.0, 1.0, 1.0]), np.array([1.0, 1.0, 1.0, 1.0])
    d = paired_diff(a, b)
    assert d.mean == -0.25 and d.n == 4
    assert d.se == pytest.approx(np.std(a - b, ddof=1) / 2)
    with pytest.raises(ValueError):
        paired_diff(a, b[:3])


def test_correct_class_margin() -> None:
    logits = torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, 5.0]])
    torch.testing.assert_close(
        correct_class_margin(logits, torch.tensor([0, 1])), torch.tensor([2.0, -3.0])
    )


def test_effective_rank() -> None:
    assert effective_rank(torch.eye(6)) == pytest.approx(6.0)
    assert effective_rank(torch.ones(5, 4)) == pytest.approx(1.0)
