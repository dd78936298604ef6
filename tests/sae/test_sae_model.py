from __future__ import annotations

import pytest
import torch

from poslens.sae import TopKSAE, Whitening, evaluate, fvu
from poslens.sae.model import WHITEN_EPS, topk_indices
from poslens.sae.train import sae_step


@pytest.mark.parametrize(("n", "f", "k"), [(300, 512, 16), (200, 96, 4), (50, 40, 16)])
def test_topk_indices_pick_the_k_largest_values(n: int, f: int, k: int) -> None:
    g = torch.Generator().manual_seed(0)
    for x in (torch.randn(n, f, generator=g), torch.randint(0, 5, (n, f), generator=g).float()):
        idx = topk_indices(x, k)  # the second case is full of ties
        assert idx.shape == (n, k)
        assert (idx.sort(1).values.diff(dim=1) > 0).all()  # k distinct latents per row
        got = x.gather(1, idx).sort(1).values
        assert torch.equal(got, x.topk(k, dim=1).values.sort(1).values)


def reference_loss(
    sae: TopKSAE, x: torch.Tensor, dead_F: torch.Tensor, aux_k: int, aux_coef: float
) -> torch.Tensor:
    """dictionary_learning's TopK loss written densely with autograd (the oracle for sae_step)."""
    post_BF = ((x - sae.b_dec) @ sae.W_enc + sae.b_enc).relu()
    vals, idx = post_BF.topk(sae.k)
    e_BD = x - (torch.zeros_like(post_BF).scatter(1, idx, vals) @ sae.W_dec + sae.b_dec)
    res = e_BD.detach()
    aux_vals, aux_idx = torch.where(dead_F[None], post_BF, -torch.inf).topk(aux_k)
    aux_rec = torch.zeros_like(post_BF).scatter(1, aux_idx, aux_vals) @ sae.W_dec
    aux = (res - aux_rec).pow(2).sum(-1).mean() / (res - res.mean(0)).pow(2).sum(-1).mean()
    return e_BD.pow(2).sum(-1).mean() + aux_coef * aux


def test_hand_written_gradients_match_autograd_with_dead_latents() -> None:
    sae = TopKSAE(16, 64, 4, seed=1)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        sae.b_enc.copy_(torch.randn(64, generator=g))
        sae.b_dec.copy_(torch.randn(16, generator=g))
    x = 2 * torch.randn(32, 16, generator=g)
    sae.tokens_since_fired[:20] = 10**6  # 20 stale latents; those firing now are not dead
    with torch.no_grad():
        post = ((x - sae.b_dec) @ sae.W_enc + sae.b_enc).relu()
        fired = torch.zeros(64, dtype=torch.bool)
        fired[post.topk(4).indices[post.topk(4).values > 0]] = True
    dead = (sae.tokens_since_fired >= 1000) & ~fired
    assert 8 <= int(dead.sum()) < 20
    reference_loss(sae, x, dead, 8, 0.5).backward()
    expected = {name: p.grad.clone() for name, p in sae.named_parameters()}
    for p in sae.parameters():
        p.grad = None
    sae_step(sae, x, dead_tokens=1000, aux_k=8, aux_coef=0.5)
    for name, p in sae.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], atol=1e-5, rtol=1e-5, msg=name)


def test_zero_codes_among_the_top_k_do_not_count_as_firing() -> None:
    sae = TopKSAE(4, 16, 4)
    acts = torch.tensor([[2.0, 1.0, 0.0, 0.0], [3.0, 0.0, 0.0, 0.0]])  # ReLU left zeros
    idx = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    sae.tokens_since_fired += 5
    sae.record_firing(acts, idx)
    expected = torch.full((16,), 7)
    expected[[0, 1, 4]] = 0
    assert torch.equal(sae.tokens_since_fired, expected)
    assert sae.dead_mask(7).tolist() == [i not in (0, 1, 4) for i in range(16)]
    assert not sae.dead_mask(8).any()


def test_dead_fraction_on_data_counts_latents_never_positive() -> None:
    sae = TopKSAE(8, 32, 4, seed=3)
    with torch.no_grad():
        sae.b_enc[:10] = -1e3  # can never be positive
        sae.b_enc[10:12] = 1e3  # always positive: fire on every token
    x = torch.randn(500, 8, generator=torch.Generator().manual_seed(0))
    codes = sae.encode(x)
    assert (codes[:, 10:12] > 0).all() and (codes[:, :10] == 0).all()
    never = int(((codes > 0).sum(0) == 0).sum())
    assert never >= 10
    assert evaluate(sae, x)["dead_fraction"] == pytest.approx(never / 32)
    # a latent chosen in the top k with a zero code is not firing
    with torch.no_grad():
        sae.b_enc.fill_(-1e3)
        sae.b_enc[0] = 1e3
    m = evaluate(sae, x)
    assert m["dead_fraction"] == pytest.approx(31 / 32) and m["l0"] == 1.0


def whitening_data(n: int = 4000, d: int = 12) -> torch.Tensor:
    """Correlated, anisotropic tokens lying in a (d-1)-dim affine subspace, like LayerNorm output."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, d, generator=g) @ torch.randn(d, d, generator=g) * torch.logspace(0, 1, d)
    x = x - x.mean(1, keepdim=True)  # rank-deficient: every token sums to 0
    return x + torch.randn(d, generator=g)


def test_whitening_is_exactly_invertible_and_whitens() -> None:
    x = whitening_data()
    xd = x.double()
    w = Whitening.fit(xd.sum(0), xd.T @ xd, len(x))
    z = w(x)
    torch.testing.assert_close(w.inverse(z), x, atol=4e-6 * x.abs().max().item(), rtol=0)
    lam = torch.linalg.eigvalsh(torch.cov(xd.T, correction=0))
    eps = WHITEN_EPS * lam.clamp_min(0).mean()
    eig = torch.linalg.eigvalsh(torch.cov(z.double().T, correction=0))
    expected = lam.clamp_min(0) / (lam.clamp_min(0) + eps)  # 1 where variance >> eps, 0 if none
    torch.testing.assert_close(eig, expected, atol=1e-4, rtol=0)
    assert eig[0] < 1e-6 and eig[-1] > 0.999


def test_whitened_sae_decodes_back_to_the_original_space_and_fvu_is_measured_there() -> None:
    x = whitening_data()
    xd = x.double()
    d = x.shape[1]
    sae = TopKSAE(d, 2 * d, d)
    sae.whitening = Whitening.fit(xd.sum(0), xd.T @ xd, len(x))
    with torch.no_grad():  # dictionary +-e_i with k = d: any whitened vector is coded exactly
        sae.W_dec.copy_(torch.cat([torch.eye(d), -torch.eye(d)]))
        sae.W_enc.copy_(sae.W_dec.T)
        sae.b_dec.zero_()
        sae.b_enc.zero_()
        x_hat, _ = sae(x)
    torch.testing.assert_close(x_hat, x, atol=4e-6 * x.abs().max().item(), rtol=0)
    # an imperfect dictionary: drop the last three basis directions
    with torch.no_grad():
        sae.W_dec[[d - 3, d - 2, d - 1, 2 * d - 3, 2 * d - 2, 2 * d - 1]] = 0.0
        sae.W_enc.copy_(sae.W_dec.T)
        x_hat, _ = sae(x)
        z, z_hat = sae.whitening(x), sae.whitening(x_hat)
    m = evaluate(sae, x)
    assert m["fvu"] == pytest.approx(fvu(x, x_hat), rel=1e-6)  # original space ...
    assert abs(fvu(z, z_hat) - m["fvu"]) > 0.05  # ... which is not the whitened space's


def test_decoder_gradient_loses_its_component_along_each_row() -> None:
    sae = TopKSAE(8, 16, 2)
    g = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    sae.W_dec.grad = g.clone()
    sae.remove_parallel_grad()
    along = (sae.W_dec.grad * sae.W_dec).sum(1)
    torch.testing.assert_close(along, torch.zeros(16), atol=1e-6, rtol=0)
    torch.testing.assert_close(sae.W_dec.grad, g - (g * sae.W_dec).sum(1, keepdim=True) * sae.W_dec)


def test_fvu_is_against_the_per_dimension_mean() -> None:
    x = torch.randn(100, 4) * torch.tensor([1.0, 2.0, 3.0, 4.0]) + 10.0
    assert fvu(x, x) == 0.0
    assert fvu(x, x.mean(0).expand_as(x)) == pytest.approx(1.0)  # the mean explains nothing
    half = x.clone()
    half[:, 3] = x[:, 3].mean()  # leave the last dimension's variance unexplained
    var = x.var(0)
    assert fvu(x, half) == pytest.approx(float(var[3] / var.sum()), rel=1e-6)
    assert evaluate(TopKSAE(4, 8, 2), x)["tokens"] == 100
