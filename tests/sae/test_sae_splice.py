from __future__ import annotations

import pytest
import torch

from poslens.sae import ActivationStore, SAEConfig, TopKSAE, splice, spliced_quality, train_sae
from tests.conftest import tiny

SITE = "blocks.1.ln1.hook_normalized"


@pytest.fixture(scope="module")
def setup() -> tuple[torch.nn.Module, TopKSAE, torch.Tensor]:
    model = tiny("ape")
    imgs = torch.randn(40, 1, 16, 16, generator=torch.Generator().manual_seed(2))
    store = ActivationStore.from_model(model, imgs, SITE)
    sae, _ = train_sae(store, SAEConfig(site=SITE, k=4, batch=128, steps=40, lr=3e-3))
    return model, sae, imgs[:6]


def spliced_activation(model: torch.nn.Module, imgs: torch.Tensor, **kw: object) -> torch.Tensor:
    """The site's activation as the rest of the model sees it inside the splice."""
    with torch.no_grad(), splice(model, kw.pop("sae"), **kw):  # type: ignore[arg-type]
        return model.run_with_cache(imgs, SITE)[1][SITE]


def test_error_term_with_no_edit_returns_the_original_activation(setup: tuple) -> None:
    model, sae, imgs = setup
    with torch.no_grad():
        clean_logits, cache = model.run_with_cache(imgs, SITE)
        with splice(model, sae, with_error=True):
            logits = model(imgs)
    out = spliced_activation(model, imgs, sae=sae, with_error=True)
    assert torch.equal(out, cache[SITE])  # x + (D(z) - D(z)) is exactly x
    torch.testing.assert_close(logits, clean_logits, atol=1e-6, rtol=0)


def resid_and_site(model: torch.nn.Module, imgs: torch.Tensor, **kw: object) -> dict:
    """The residual entering block 1, the site, and the residual entering block 2, as the model
    sees them inside the splice (or without one when no sae is given)."""
    names = ["blocks.1.hook_resid_pre", SITE, "blocks.1.hook_resid_post"]
    sae = kw.pop("sae", None)
    with torch.no_grad():
        if sae is None:
            return model.run_with_cache(imgs, names)[1]
        with splice(model, sae, **kw):  # type: ignore[arg-type]
            return model.run_with_cache(imgs, names)[1]


def test_a_normalised_site_is_edited_in_the_residual(setup: tuple) -> None:
    """The edit of an SAE on blocks.1.ln1 is written into the residual entering block 1 (as
    sigma * dy / gamma per token), so every later block sees it: the residual after block 1
    moves too. Editing only the norm's output would leave both residuals unchanged."""
    model, sae, imgs = setup
    clean = resid_and_site(model, imgs)
    out = resid_and_site(model, imgs, sae=sae)  # the reconstruction alone
    x, y = clean["blocks.1.hook_resid_pre"][:, 1:], clean[SITE][:, 1:]
    ln = model.blocks[1].ln1
    with torch.no_grad():
        dy = sae(y)[0] - y
        sigma = (x.var(-1, unbiased=False, keepdim=True) + ln.eps).sqrt()
        expected = x + sigma * dy / ln.weight
    torch.testing.assert_close(
        out["blocks.1.hook_resid_pre"][:, 1:], expected, atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(
        out["blocks.1.hook_resid_pre"][:, :1],
        clean["blocks.1.hook_resid_pre"][:, :1],
        atol=0,
        rtol=0,
    )  # CLS untouched
    assert (out["blocks.1.hook_resid_post"] - clean["blocks.1.hook_resid_post"]).abs().max() > 1e-2
    with_cls = resid_and_site(model, imgs, sae=sae, include_prefix=True)
    assert (
        with_cls["blocks.1.hook_resid_pre"][:, :1] - clean["blocks.1.hook_resid_pre"][:, :1]
    ).abs().max() > 1e-3


def test_edit_moves_the_site_along_the_edited_latents(setup: tuple) -> None:
    """Dropping one latent (+error): the norm's output moves by that latent's decoder direction,
    up to what the norm removes again (the mean and the scale): to first order, exactly."""
    model, sae, imgs = setup
    clean = resid_and_site(model, imgs)[SITE][:, 1:]
    with torch.no_grad():
        j = int((sae.encode(clean) > 0).sum((0, 1)).argmax())  # the latent that fires most
    seen: list[torch.Tensor] = []

    def drop(codes_BTF: torch.Tensor) -> torch.Tensor:
        seen.append(codes_BTF)
        return codes_BTF * (torch.arange(codes_BTF.shape[-1]) != j)

    out = resid_and_site(model, imgs, sae=sae, with_error=True, edit=drop)[SITE][:, 1:]
    assert seen[0].shape == (6, 16, sae.d_sae)
    with torch.no_grad():
        dy = -seen[0][..., j : j + 1] * sae.W_dec[j]  # D(z') - D(z)
    moved = seen[0][..., j] > 0
    assert moved.sum() >= 10
    cos = torch.nn.functional.cosine_similarity((out - clean)[moved], dy[moved], dim=-1)
    assert cos.min() > 0.9
    torch.testing.assert_close(out[~moved], clean[~moved], atol=1e-5, rtol=0)


def test_spliced_quality_reports_both_splices(setup: tuple) -> None:
    model, sae, imgs = setup
    labels = model(imgs).argmax(-1)
    q = spliced_quality(model, sae, imgs, labels, batch=4)
    assert q["clean"]["acc"] == 1.0
    assert q["spliced_error"]["kl"] < 1e-6 and q["spliced_error"]["d_acc"] == 0.0
    assert q["spliced"]["kl"] > 1e-6
    assert set(q["spliced"]) >= {"acc", "margin", "kl", "d_acc", "d_acc_se", "d_margin"}


def test_spliced_quality_without_the_error_check_reports_the_same_splice(setup: tuple) -> None:
    """error_check=False (choosing k reads the splice alone): the same "spliced" numbers, no
    "spliced_error" pass."""
    model, sae, imgs = setup
    labels = model(imgs).argmax(-1)
    full = spliced_quality(model, sae, imgs, labels, batch=4)
    lean = spliced_quality(model, sae, imgs, labels, batch=4, error_check=False)
    assert "spliced_error" not in lean and lean["spliced"] == full["spliced"]


@pytest.mark.parametrize(
    ("site", "d_in", "message"),
    [
        (
            SITE,
            16,
            r"the SAE \(d_in 16\) at 'blocks.1.ln1.hook_normalized': the model's width there is 32",
        ),
        (
            "blocks.0.attn.hook_pattern",
            32,
            "'blocks.0.attn.hook_pattern': not in the residual stream",
        ),
        ("blocks.0.attn.hook_z", 32, "not in the residual stream"),
        ("hook_embed", 32, "not in the residual stream"),
        ("blocks.9.hook_resid_pre", 32, "not a hook of this model"),
        ("nope", 32, "not a hook of this model"),
    ],
)
def test_a_splice_that_cannot_fit_is_refused_naming_site_and_widths(
    site: str, d_in: int, message: str, images: torch.Tensor
) -> None:
    """Issue 51: no raw torch shape error from inside the forward pass."""
    from poslens.errors import ConfigError

    model, sae = tiny("ape"), TopKSAE(d_in, 4 * d_in, 4, site=site)
    with pytest.raises(ConfigError, match=message) as info, splice(model, sae):
        model(images)
    assert "\n" not in str(info.value)
    assert not any(h._forward_hooks for h in model._hook_points.values())  # nothing left attached


@pytest.mark.parametrize("site", ["blocks.0.hook_attn_out", "blocks.1.hook_mlp_out",
                                  "blocks.1.hook_resid_post", "ln_final.hook_normalized"])  # fmt: skip
def test_every_residual_stream_site_splices(site: str, images: torch.Tensor) -> None:
    model, sae = tiny("ape"), TopKSAE(32, 64, 4, site=site)
    with torch.no_grad(), splice(model, sae):
        assert model(images).shape == (3, 5)


def test_an_rms_normalised_site_is_edited_through_the_root_mean_square() -> None:
    """Under an RMSNorm (model.norm "rms", AIMv2) the residual's edit is rms(x) * dy / gamma per
    token: the same splice, with the root mean square in place of the standard deviation."""
    model = tiny("ape", norm="rms")
    with torch.no_grad():  # a gamma away from 1, so that dividing by it matters
        model.blocks[1].ln1.weight.uniform_(0.5, 1.5)
    imgs = torch.randn(40, 1, 16, 16, generator=torch.Generator().manual_seed(2))
    store = ActivationStore.from_model(model, imgs, SITE)
    sae, _ = train_sae(store, SAEConfig(site=SITE, k=4, batch=128, steps=20, lr=3e-3))
    clean = resid_and_site(model, imgs[:6])
    out = resid_and_site(model, imgs[:6], sae=sae)
    x, y = clean["blocks.1.hook_resid_pre"][:, 1:], clean[SITE][:, 1:]
    norm = model.blocks[1].ln1
    assert isinstance(norm, torch.nn.RMSNorm)
    with torch.no_grad():
        dy = sae(y)[0] - y
        rms = (x.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt()
        expected = x + rms * dy / norm.weight
    edited = out["blocks.1.hook_resid_pre"][:, 1:]
    torch.testing.assert_close(edited, expected, atol=1e-5, rtol=1e-5)
