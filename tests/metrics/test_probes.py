from __future__ import annotations

import numpy as np
import pytest
import torch

from poslens.metrics.probes import fit_position_probes, position_labels, split_images


def test_split_is_disjoint_and_covers_all_images() -> None:
    tr, va, te = split_images(50, seed=0)
    assert (len(tr), len(va), len(te)) == (30, 10, 10)
    assert sorted(np.concatenate([tr, va, te]).tolist()) == list(range(50))


def test_one_hot_position_is_decoded_perfectly_and_noise_is_at_chance() -> None:
    gh = gw = 4
    g = torch.Generator().manual_seed(0)
    onehot = torch.eye(16)[None, None].repeat(1, 30, 1, 1) + 0.05 * torch.randn(
        1, 30, 16, 16, generator=g
    )
    noise = torch.randn(1, 30, 16, 16, generator=g)
    res = fit_position_probes(torch.cat([onehot, noise]), gh, gw, max_iter=100)
    np.testing.assert_allclose(res.test_acc[0], 1.0)
    assert res.chance == (1 / 16, 1 / 4, 1 / 4)
    assert res.test_acc[1, 0] < 0.2 and np.all(
        res.test_acc[1, 1:] < 0.45
    )  # exact / row, col chance


def test_row_only_features_decode_rows_not_columns() -> None:
    labels = position_labels(4, 4)
    row_code = torch.nn.functional.one_hot(labels[:, 1], 4).double()  # [16, 4]: the row only
    g = torch.Generator().manual_seed(1)
    feats = row_code[None, None].repeat(1, 30, 1, 1) + 0.05 * torch.randn(1, 30, 16, 4, generator=g)
    res = fit_position_probes(feats, 4, 4, max_iter=100)
    exact, row, col = res.test_acc[0]
    assert row == 1.0 and col < 0.45 and exact < 0.35


def test_shuffled_label_control_sits_at_chance() -> None:
    feats = torch.eye(16)[None, None].repeat(1, 30, 1, 1)
    res = fit_position_probes(feats, 4, 4, shuffle_labels=True, max_iter=100)
    assert res.test_acc[0, 0] < 0.2


def test_a_large_problem_is_fitted_in_groups_of_sites_with_the_same_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Over MAX_LOGITS the sites are fitted in groups: the merged probes are exactly those of
    each group fitted alone, score other activations the same way, and decode what the joint fit
    decodes (separable losses: only the line searches differ)."""
    from poslens.metrics import probes

    g = torch.Generator().manual_seed(3)
    code = torch.eye(16)[None, None].repeat(3, 30, 1, 1)
    feats = code * torch.tensor([1.0, 0.3, 0.1])[:, None, None, None]
    feats = feats + 0.2 * torch.randn(3, 30, 16, 16, generator=g)
    joint = probes.fit_probes(feats, 4, 4)
    monkeypatch.setattr(probes, "MAX_LOGITS", 1)  # one site per group
    grouped = probes.fit_probes(feats, 4, 4)
    for i in range(3):
        alone = probes.fit_probes(feats[i : i + 1], 4, 4)
        np.testing.assert_array_equal(grouped.result.test_acc[i], alone.result.test_acc[0])
        for t in range(3):
            torch.testing.assert_close(grouped.weights[t][i], alone.weights[t][0])
    np.testing.assert_allclose(grouped.result.test_acc, joint.result.test_acc, atol=0.1)
    np.testing.assert_allclose(grouped.score(feats), grouped.result.test_acc, atol=1e-6)
