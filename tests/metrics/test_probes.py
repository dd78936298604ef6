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
    monkeypatch.setattr(probes, "MAX_LOGITS", probes.MAX_LOGITS * 10**9)
    monkeypatch.setattr(probes, "MAX_FEATURE_BYTES", feats[0].numel() * 4)  # so by features
    by_bytes = probes.fit_probes(feats, 4, 4)
    np.testing.assert_array_equal(by_bytes.result.test_acc, grouped.result.test_acc)
    for i in range(3):
        alone = probes.fit_probes(feats[i : i + 1], 4, 4)
        np.testing.assert_array_equal(grouped.result.test_acc[i], alone.result.test_acc[0])
        for t in range(3):
            torch.testing.assert_close(grouped.weights[t][i], alone.weights[t][0])
    np.testing.assert_allclose(grouped.result.test_acc, joint.result.test_acc, atol=0.1)
    np.testing.assert_allclose(grouped.score(feats), grouped.result.test_acc, atol=1e-6)


def test_the_written_out_gradients_equal_autograd_through_cross_entropy() -> None:
    """Parity at random weights: the probes' objective and its hand-written gradients against
    the same loss through autograd and F.cross_entropy (weights [R, L, D+1, C])."""
    from poslens.metrics.probes import objective

    g = torch.Generator().manual_seed(5)
    L, M, D, R, sizes = 2, 40, 6, 3, (16, 4, 4)
    x = torch.cat([torch.randn(L, M, D, generator=g), torch.ones(L, M, 1)], dim=-1)
    y = position_labels(4, 4).repeat(M // 16 + 1, 1)[:M]
    lam = torch.tensor([1e-4, 1e-2, 0.3])
    ref = [(0.5 * torch.randn(R, L, D + 1, c, generator=g)).requires_grad_() for c in sizes]
    total = torch.zeros(())
    for t, w in enumerate(ref):
        logits = torch.einsum("lmd,rldc->rlmc", x, w)
        ce = (
            torch.nn.functional.cross_entropy(
                logits.flatten(0, 2), y[:, t].repeat(R * L), reduction="none"
            )
            .view(R, L, -1)
            .mean(-1)
        )
        total = total + (ce + lam[:, None] * (w[:, :, :-1] ** 2).sum(dim=(2, 3))).sum()
    total.backward()
    # the same weights in objective's layout [L, R*C, D+1]
    to_rows = lambda w: w.detach().permute(1, 0, 3, 2).reshape(L, -1, D + 1)  # noqa: E731
    value, grads = objective([to_rows(w) for w in ref], x, y, lam)
    torch.testing.assert_close(value, total.detach(), rtol=1e-5, atol=1e-5)
    for w, grad in zip(ref, grads, strict=True):
        torch.testing.assert_close(grad, to_rows(w.grad), rtol=1e-4, atol=1e-6)


def test_identical_inputs_reuse_the_fit_and_any_change_refits() -> None:
    from poslens.metrics import probes

    g = torch.Generator().manual_seed(6)
    feats = torch.eye(16)[None, None] + 0.5 * torch.randn(1, 30, 16, 16, generator=g)
    first = probes.fit_probes(feats, 4, 4)
    assert probes.fit_probes(feats.clone(), 4, 4) is first  # same bytes: the same fit
    other_seed = probes.fit_probes(feats, 4, 4, seed=1)
    assert other_seed is not first
    assert not np.array_equal(other_seed.test_idx, first.test_idx)
    nudged = feats.clone()
    nudged[0, 0, 0, 0] += 1e-3
    assert probes.fit_probes(nudged, 4, 4) is not first
    shuffled = probes.fit_probes(feats, 4, 4, shuffle_labels=True)
    assert shuffled.result.test_acc[0, 0] < first.result.test_acc[0, 0]


def _cell_code(n: int, seed: int, gh: int = 4, gw: int = 4, d: int = 12) -> torch.Tensor:
    """Features [1, n, T, d]: a random direction per cell plus correlated noise, so that the
    within-class covariance (and its shrinkage) matters."""
    g = torch.Generator().manual_seed(seed)
    cells = torch.randn(gh * gw, d, generator=g)
    mix = torch.randn(d, d, generator=g)
    return (cells[None] + 1.5 * torch.randn(n, gh * gw, d, generator=g) @ mix)[None]


@pytest.mark.parametrize("shrinkage", [1e-3, 0.1, 0.3])
def test_the_exact_cell_lda_predicts_what_scikit_learns_lda_predicts(shrinkage: float) -> None:
    """Parity: poslens' closed-form LDA at one shrinkage, on whitened features, predicts what
    scikit-learn's LinearDiscriminantAnalysis(solver="eigen") predicts (scikit-learn shrinks
    each class's covariance toward a multiple of the identity; poslens the pooled one)."""
    da = pytest.importorskip("sklearn.discriminant_analysis")
    from poslens.metrics.probes import lda

    feats = _cell_code(40, seed=5)[0]  # [n, T, D]
    n, T, D = feats.shape
    x_MD = feats.reshape(n * T, D).double()
    y_M = position_labels(4, 4)[:, 0].repeat(n)
    w = lda(x_MD[None].float(), y_M, T, torch.tensor([shrinkage], dtype=torch.float64))[0]
    logits = torch.cat([x_MD.float(), torch.ones(n * T, 1)], -1) @ w.T
    ref = da.LinearDiscriminantAnalysis(solver="eigen", shrinkage=shrinkage).fit(x_MD, y_M)
    agree = (logits.argmax(-1).numpy() == ref.predict(x_MD.numpy())).mean()
    assert agree > 0.995
    assert 0.3 < (logits.argmax(-1) == y_M).double().mean() < 0.95  # neither trivial nor chance


def test_the_exact_probe_takes_the_shrinkage_validation_prefers() -> None:
    """The shrinkage is chosen per site on validation: the reported exact accuracy is that of
    the grid's best validation score, and each grid point alone reproduces its own score."""
    from poslens.metrics import probes

    feats = torch.cat([_cell_code(40, seed=6), 0.3 * _cell_code(40, seed=7)])  # two sites
    res = probes.fit_position_probes(feats, 4, 4)
    per = []
    for s in probes.SHRINKAGE:
        probes.SHRINKAGE, keep = (s,), probes.SHRINKAGE
        try:
            per.append(probes.fit_position_probes(feats, 4, 4))
        finally:
            probes.SHRINKAGE = keep
    for site in range(2):
        vals = [p.val_acc[site, 0] for p in per]
        best = int(np.argmax(vals))
        assert res.l2[site, 0] == probes.SHRINKAGE[best]
        assert res.val_acc[site, 0] == vals[best]
        assert res.test_acc[site, 0] == per[best].test_acc[site, 0]
        np.testing.assert_array_equal(res.test_acc[site, 1:], per[0].test_acc[site, 1:])
