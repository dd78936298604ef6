"""SAE causal test on a tiny model: conditions, controls and edits do what they say."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import torch

from poslens.data import DataConfig, build_task
from poslens.errors import ConfigError
from poslens.experiments import sae_causal
from poslens.experiments.output import save
from poslens.models import hooks
from poslens.models.vit import ViT
from poslens.sae import TopKSAE
from tests.conftest import tiny

DATA = DataConfig(image_size=16, object_scale=0.32, n_val=30, n_test=40)


def test_sae_causal_end_to_end(tmp_path: Path) -> None:
    # a planted row + column code at the residual's scale: the SAEs find positional latents
    m, task = tiny("ape", num_classes=16, ape_code="rowcol", ape_init_std=1.0), build_task(DATA)
    sites = ("blocks.0.hook_resid_pre", "blocks.1.ln1.hook_normalized")
    cfg = sae_causal.Config(
        sites=sites, n_images=30, probe_images=20, batch_size=30,
        train_images=40, epochs=2, k=4, doses=(2,), draws=1,
    )  # fmt: skip
    res = sae_causal.run(m, task, cfg)
    assert [r.site for r in res.results] == list(sites)
    assert [r.site_index for r in res.results] == [0, 1]
    for r in res.results:
        families = {c.meta["family"] for c in r.conditions}
        assert {
            "reconstruction",
            "positional",
            "positional+error",
            "uniform",
            "matched_all",
        } <= families
        # intact: its own refitted probes (clean and RPI) at the SAE's site and the output
        assert set(r.probes["intact"]) == {"refit", "refit_rpi"}
        assert r.probes["intact"]["refit"].shape == (2, 3)
        assert np.allclose(r.probes["chance"]["refit"][:, 0], 1 / 16)  # 4x4 grid
        # every edit is read by the intact model's fixed probes and by refitted ones
        assert set(r.probes["reconstruction"]) == {"refit", "fixed", "refit_rpi", "fixed_rpi"}
        n_pos = len(r.positional.latents)
        assert n_pos > 0
        # the dose ladder always ends with all positional latents
        assert any(c.name == f"zero_{n_pos}" for c in r.conditions)
        assert {"mean_all", "resample_other_image", "resample_other_position"} <= {
            c.name for c in r.conditions
        }
        s = r.summary()
        z = r.probes[f"zero_{n_pos}+error"]["fixed"][0, 0]
        intact, chance = r.probes["intact"]["refit"][0, 0], 1 / 16
        assert s["zero_all+error"]["fixed_drop_site"] == pytest.approx(
            (intact - z) / (intact - chance)
        )
    # the intact probes at a site are the baseline's, whichever SAE site asked for them
    assert np.array_equal(
        res.results[0].probes["intact"]["refit"][1], res.results[1].probes["intact"]["refit"][1]
    )
    save(res, tmp_path, sae_causal.plot)
    rows = list(csv.DictReader((tmp_path / "sae_causal_conditions.csv").open()))
    assert {r["sae_site"] for r in rows} == set(sites)
    with pytest.raises(ConfigError, match="analysis.sites"):
        sae_causal.run(m, task, sae_causal.Config(sites=("blocks.9.nope",)))
    with pytest.raises(ConfigError, match="analysis.sites"):
        sae_causal.Config(sites=())


def test_probe_site_is_the_baseline_probe_block() -> None:
    """sites=("probe",): one SAE at the normalised residual the baseline probes choose, or at
    analysis.probe_block when that is set."""
    from poslens.experiments.readout import choose_probe_site, eval_images, measure

    m, task = tiny("ape", num_classes=16), build_task(DATA)
    kw = dict(n_images=30, probe_images=20, batch_size=30, train_images=40, epochs=1, k=4,
              doses=(2,), draws=1)  # fmt: skip
    cfg = sae_causal.Config(sites=("probe",), **kw)
    x, y = eval_images(task, cfg)
    base = measure(m, x, y, cfg, probe_sites=range(m.cfg.depth + 1))
    b = choose_probe_site(base)
    want = "ln_final.hook_normalized" if b == m.cfg.depth else f"blocks.{b}.ln1.hook_normalized"
    res = sae_causal.run(m, task, cfg)
    assert [r.site for r in res.results] == [want] and res.results[0].site_index == b
    fixed = sae_causal.run(m, task, sae_causal.Config(sites=("probe",), probe_block=1, **kw))
    assert [r.site for r in fixed.results] == ["blocks.1.ln1.hook_normalized"]


def test_edits() -> None:
    codes = torch.arange(2 * 4 * 5, dtype=torch.float32).view(2, 4, 5)
    lat = np.array([1, 3])
    z = sae_causal.zero(lat)(codes)
    assert (z[..., [1, 3]] == 0).all() and torch.equal(z[..., [0, 2, 4]], codes[..., [0, 2, 4]])
    same = codes[:1].repeat(2, 1, 1)
    assert torch.equal(sae_causal.resample(lat, "other_image", 0)(same), same)
    moved = sae_causal.resample(lat, "other_position", 0)(codes)
    assert not torch.equal(moved[..., 1], codes[..., 1])
    assert torch.equal(moved[..., 0], codes[..., 0])
    mean = sae_causal.set_to(lat, torch.full((5,), 7.0))(codes)
    assert (mean[..., [1, 3]] == 7).all()


def test_matched_random_draws_from_the_pool_and_matches_rate() -> None:
    rng = np.random.default_rng(0)
    rates = np.linspace(0.05, 0.9, 12)
    codes = (rng.random((50, 16, 12)) < rates).astype(float)
    pool = np.setdiff1d(np.arange(12), [0, 11])
    chosen = sae_causal.matched_random(codes, np.array([0, 11]), pool, seed=0)
    assert len(chosen) == 2 and not set(chosen) & {0, 11}
    assert chosen[0] in (1, 2, 3) and chosen[1] in (8, 9, 10)  # nearest firing rates


def test_resampling_from_another_image_of_the_same_scene_changes_nothing() -> None:
    """The "other image" control is spliced +error: with identical images it is the identity,
    so any effect it shows comes from real differences between images, not from reconstruction."""
    from poslens.sae import TopKSAE

    m = tiny("ape", num_classes=16)
    sae = TopKSAE(m.cfg.dim, 2 * m.cfg.dim, k=4, seed=0, site="blocks.1.hook_resid_pre")
    x = torch.randn(1, 1, 16, 16, generator=torch.Generator().manual_seed(3)).repeat(4, 1, 1, 1)
    lat = np.arange(sae.d_sae // 2)
    with torch.no_grad():
        clean = m(x)
        with sae_causal.spliced(sae, sae_causal.resample(lat, "other_image", 0), with_error=True)(
            m
        ):
            same = m(x)
        with sae_causal.spliced(sae, sae_causal.resample(lat, "other_image", 0))(m):
            plain = m(x)
    torch.testing.assert_close(same, clean, rtol=0, atol=1e-5)
    assert (plain - clean).abs().max() > 1e-3  # the plain splice carries the reconstruction error


AXIS_SITE = "blocks.0.hook_resid_pre"


@torch.no_grad()
def planted_axis_sae(m: ViT, images: torch.Tensor) -> TopKSAE:
    """An SAE that is the planted row + column code by construction: latent r decodes to row r's
    effect, latent gh + c to column c's (table[r, c] = row[r] + col[c] exactly), encoded by the
    pseudo-inverse (one-hot codes on the table); the other latents never fire (the controls' pool).
    """
    _, cache = m.run_with_cache(images, [hooks.POS_EMBED, AXIS_SITE])
    gh, gw = m.grid_of(images[:1])
    table = cache[hooks.POS_EMBED][0].reshape(gh, gw, -1)  # [gh, gw, D]
    rest = cache[AXIS_SITE][:, m.cfg.num_prefix :] - table.reshape(1, gh * gw, -1)
    half = table.mean((0, 1)) / 2
    dec = torch.cat([table.mean(1) - half, table.mean(0) - half])  # [gh + gw, D]
    n = gh + gw
    sae = TopKSAE(m.cfg.dim, 2 * n, k=2, site=AXIS_SITE)
    for p in (sae.W_dec, sae.W_enc):
        p.zero_()
    sae.W_dec[:n], sae.W_enc[:, :n] = dec, torch.linalg.pinv(dec)
    sae.b_enc.fill_(-1e3)
    sae.b_enc[:n] = 0
    sae.b_dec.copy_(rest.reshape(-1, m.cfg.dim).mean(0))
    return sae


def test_zeroing_one_axis_costs_that_axis_fixed_probe_only() -> None:
    """The axis split on a planted row + column code read by an SAE that is that code: zeroing
    the row latents (+error) sends the intact model's row probe toward chance at the site and
    the output and leaves its column probe; the mirror for the columns; matched random latents
    (which never fire here) cost nothing."""
    m, task = tiny("ape", num_classes=16, ape_code="rowcol", ape_init_std=1.0), build_task(DATA)
    cfg = sae_causal.Config(sites=(AXIS_SITE,), n_images=30, probe_images=20, batch_size=30,
                            doses=(2,), draws=1)  # fmt: skip
    sae = planted_axis_sae(m, task.split("val")[0][:20])
    r = sae_causal.run(m, task, cfg, saes={AXIS_SITE: sae}).results[0]
    assert r.positional.counts["row"] == 4 and r.positional.counts["col"] == 4
    s = r.summary()
    for zeroed, matched, own, other in (
        (sae_causal.ROW_ZEROED, sae_causal.MATCHED_ROW, "row", "col"),
        (sae_causal.COL_ZEROED, sae_causal.MATCHED_COL, "col", "row"),
    ):
        assert s[zeroed]["n_latents"] == 4 and s[matched]["n_edited"] == 4
        for where in ("site", "out"):
            assert s[zeroed][sae_causal.fixed_drop(where, own)] > 0.6, (zeroed, where)
            assert abs(s[zeroed][sae_causal.fixed_drop(where, other)]) < 0.1, (zeroed, where)
            for axis in ("row", "col"):
                assert abs(s[matched][sae_causal.fixed_drop(where, axis)]) < 0.1
    # the number is the row probe's drop toward chance, read at the SAE's site
    j = 1  # TARGETS: exact, row, col
    intact, chance = r.probes["intact"]["refit"][0, j], r.probes["chance"]["refit"][0, j]
    zeroed_row = next(c.name for c in r.group(sae_causal.ROW_ZEROED))
    assert s[sae_causal.ROW_ZEROED][sae_causal.FIXED_DROP_SITE_ROW] == pytest.approx(
        (intact - r.probes[zeroed_row]["fixed"][0, j]) / (intact - chance)
    )
    # both axes zeroed: both probes fall
    rc = s[sae_causal.ROWCOL_ZEROED]
    assert min(rc[sae_causal.FIXED_DROP_SITE_ROW], rc[sae_causal.FIXED_DROP_SITE_COL]) > 0.6
