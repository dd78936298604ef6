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


def test_reconstruction_alone_replaces_only_patch_tokens(setup: tuple) -> None:
    model, sae, imgs = setup
    with torch.no_grad():  # the same attention kernel as inside spliced_activation
        clean = model.run_with_cache(imgs, SITE)[1][SITE]
    out = spliced_activation(model, imgs, sae=sae)
    torch.testing.assert_close(out[:, :1], clean[:, :1], atol=0, rtol=0)  # CLS untouched
    assert (out[:, 1:] - clean[:, 1:]).abs().max() > 1e-2
    with torch.no_grad():
        torch.testing.assert_close(out[:, 1:], sae(clean[:, 1:])[0])
    with_cls = spliced_activation(model, imgs, sae=sae, include_prefix=True)
    assert (with_cls[:, :1] - clean[:, :1]).abs().max() > 1e-2


def test_edit_moves_only_by_the_edited_latents(setup: tuple) -> None:
    model, sae, imgs = setup
    clean = model.run_with_cache(imgs, SITE)[1][SITE][:, 1:]
    seen: list[torch.Tensor] = []

    def drop_latent_0(codes_BTF: torch.Tensor) -> torch.Tensor:
        seen.append(codes_BTF)
        return codes_BTF * (torch.arange(codes_BTF.shape[-1]) != 0)

    out = spliced_activation(model, imgs, sae=sae, with_error=True, edit=drop_latent_0)[:, 1:]
    assert seen[0].shape == (6, 16, sae.d_sae)
    with torch.no_grad():
        expected = clean - seen[0][..., :1] * sae.W_dec[0]  # x + D(z') - D(z)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


def test_spliced_quality_reports_both_splices(setup: tuple) -> None:
    model, sae, imgs = setup
    labels = model(imgs).argmax(-1)
    q = spliced_quality(model, sae, imgs, labels, batch=4)
    assert q["clean"]["acc"] == 1.0
    assert q["spliced_error"]["kl"] < 1e-6 and q["spliced_error"]["d_acc"] == 0.0
    assert q["spliced"]["kl"] > 1e-6
    assert set(q["spliced"]) >= {"acc", "margin", "kl", "d_acc", "d_acc_se", "d_margin"}
