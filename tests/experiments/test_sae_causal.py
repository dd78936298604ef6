"""SAE causal test on a tiny model: conditions, controls and edits do what they say."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from poslens.data import DataConfig, build_task
from poslens.errors import ConfigError
from poslens.experiments import sae_causal
from poslens.experiments.output import save
from poslens.io import jsonable
from poslens.models import hooks
from poslens.models.vit import ViT
from poslens.sae import TopKSAE
from tests.conftest import tiny

DATA = DataConfig(image_size=16, object_scale=0.32, n_val=30, n_test=40)


def test_rowcol_resampling_swaps_only_those_latents_from_another_image_or_position(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The last two edits resample the row and column latents (and no other) from the same
    position of another image (the batch rolled by one), then from another position of the same
    image, spliced with the error term."""
    from poslens.experiments.sae_causal import phases
    from poslens.sae.latents import find_positional_latents

    gen = np.random.default_rng(0)
    n, g, f = 12, 4, 24
    rows, cols = np.repeat(np.arange(g), g), np.tile(np.arange(g), g)
    codes = gen.random((n, g * g, f)).astype(np.float32) * 0.05  # content: no position
    for r in range(g):  # latents 0..3 fire on one row each, 4..7 on one column each
        codes[:, rows == r, r] += 1 + gen.random((n, g)) * 0.1
        codes[:, cols == r, g + r] += 1 + gen.random((n, g)) * 0.1
    pl = find_positional_latents(codes, g, g)
    rowcol = pl.of_kind("row", "col")
    assert set(rowcol.tolist()) == set(range(2 * g))
    monkeypatch.setattr(
        phases, "spliced", lambda sae, edit=None, with_error=False: (edit, with_error)
    )
    planned = phases.conditions(None, pl, codes, sae_causal.Config(doses=(2,), draws=1))  # type: ignore[arg-type]
    name, (edit, with_error), meta = planned[-2]
    assert name == sae_causal.ROWCOL_OTHER_IMAGE and with_error
    assert meta["group"] == sae_causal.ROWCOL_OTHER_IMAGE and meta["n"] == len(rowcol)
    x = torch.from_numpy(codes)
    out = edit(x)
    moved = np.isin(np.arange(f), rowcol)
    assert torch.equal(out[..., moved], x.roll(1, dims=0)[..., moved])  # same position
    assert torch.equal(out[..., ~moved], x[..., ~moved])
    # the last: the same latents from another position of the same image (one fixed permutation
    # of the positions, the same for every image), the other latents untouched
    name, (edit, with_error), meta = planned[-1]
    assert name == sae_causal.ROWCOL_OTHER_POSITION and with_error
    assert meta["group"] == sae_causal.ROWCOL_OTHER_POSITION and meta["n"] == len(rowcol)
    out = edit(x)
    assert torch.equal(out[..., ~moved], x[..., ~moved])
    mv = torch.from_numpy(moved)
    src, got = x[0][:, mv], out[0][:, mv]  # [T, moved]
    perm = [int((src == got[t]).all(1).nonzero()[0]) for t in range(g * g)]
    assert sorted(perm) == list(range(g * g)) and perm != list(range(g * g))
    assert torch.equal(out[..., moved], x[:, perm][..., moved])  # each image's own values


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
    # an explicit k is kept and its reconstruction cost reported beside it
    h = sae_causal.headline(json.loads((tmp_path / "sae_causal.json").read_text()))
    for r in res.results:
        assert h[sae_causal.k_key(r.site)] == 4 and h[sae_causal.k_key(r.site, "k_tried")] == 1
        cost = -r.family("reconstruction")[0].d_accuracy.mean  # on the evaluation images
        assert np.isfinite(h[sae_causal.k_cost_at_key(r.site, 4)]) and np.isfinite(cost)
        assert not r.k_selection["by_criterion"]
        axis_drops = (sae_causal.FIXED_DROP_SITE_ROW, sae_causal.FIXED_DROP_SITE_COL,
                      sae_causal.FIXED_DROP_OUT_ROW, sae_causal.FIXED_DROP_OUT_COL)  # fmt: skip
        for group in set(r.summary()) & set(sae_causal.GROUPS):  # every group, per axis
            assert all(np.isfinite(h[sae_causal.key(r.site, group, d)]) for d in axis_drops)
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


@pytest.fixture(scope="module")
def axis_run() -> sae_causal.SAECausal:
    """The test on a planted row + column code read by planted_axis_sae (doses 2, 3, 7 and all 8
    positional latents)."""
    m, task = tiny("ape", num_classes=16, ape_code="rowcol", ape_init_std=1.0), build_task(DATA)
    cfg = sae_causal.Config(sites=(AXIS_SITE,), n_images=30, probe_images=20, batch_size=30,
                            doses=(2, 3, 7), draws=1)  # fmt: skip
    return sae_causal.run(
        m, task, cfg, saes={AXIS_SITE: planted_axis_sae(m, task.split("val")[0][:20])}
    )


def test_zeroing_one_axis_costs_that_axis_fixed_probe_only(axis_run: sae_causal.SAECausal) -> None:
    """The axis split on a planted row + column code read by an SAE that is that code: zeroing
    the row latents (+error) sends the intact model's row probe toward chance at the site and
    the output and leaves its column probe; the mirror for the columns; matched random latents
    (which never fire here) cost nothing."""
    r = axis_run.results[0]
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


def fake_ladder(
    monkeypatch: pytest.MonkeyPatch, costs: dict[int, float]
) -> tuple[ViT, sae_causal.Config, list[int]]:
    """fit_site_sae with each rung's SAE untrained and its reconstruction cost planted by k;
    returns the model, a k = 0 config and the ks that were trained, in order."""
    from poslens.experiments.sae_causal import phases

    trained: list[int] = []

    def train_sae(store, cfg, device=None):  # type: ignore[no-untyped-def]
        trained.append(cfg.k)
        return TopKSAE(store.d_in, cfg.expansion * store.d_in, cfg.k, site=cfg.site), []

    def cost(model, sae, x, y, cfg):  # type: ignore[no-untyped-def]
        return {"k": sae.k, "cost": costs[sae.k], "cost_se": 0.01, "kl": 0.0}

    monkeypatch.setattr(phases, "train_sae", train_sae)
    monkeypatch.setattr(phases, "reconstruction_cost", cost)
    cfg = sae_causal.Config(n_images=30, probe_images=20, train_images=10, k=0)
    return tiny("ape", num_classes=16), cfg, trained


def test_auto_k_is_the_first_rung_that_keeps_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """k = 0: the ladder (the width rule's k, doublings, up to d_in) stops at the first k whose
    reconstruction alone costs at most RECON_MAX_COST; with none, the cheapest is kept and the
    headline says the criterion failed; the width rule's k is kept when it already passes."""
    site, task, top = "blocks.1.ln1.hook_normalized", build_task(DATA), sae_causal.RECON_MAX_COST
    assert sae_causal.Config().k_ladder(32) == (4, 8, 16, 32)
    assert sae_causal.Config(expansion=1).k_ladder(40) == (4, 8, 16, 20)  # d_sae / 2
    assert sae_causal.Config(k=6).k_ladder(32) == (6,)
    for costs, trained_ks, k, met in (
        ({4: 0.3, 8: top + 0.01, 16: top, 32: 0.0}, [4, 8, 16], 16, True),
        ({4: 0.0, 8: 0.0, 16: 0.0, 32: 0.0}, [4], 4, True),
        ({4: 0.3, 8: 0.1, 16: 0.05, 32: 0.08}, [4, 8, 16, 32], 16, False),
    ):
        m, cfg, trained = fake_ladder(monkeypatch, costs)
        sae, sel = sae_causal.fit_site_sae(m, task, cfg, site)
        assert trained == trained_ks and sae.k == k == sel["k"]
        assert sel["criterion_met"] is met and sel["cost"] == costs[k]
        assert [r["k"] for r in sel["ladder"]] == trained_ks
        h = sae_causal.result.k_numbers(site, sel)
        assert h[sae_causal.k_key(site, sae_causal.K)] == k
        assert h[sae_causal.k_key(site, sae_causal.K_CRITERION_MET)] == float(met)
        assert h[sae_causal.k_key(site, sae_causal.K_TRIED)] == len(trained_ks)
        assert h[sae_causal.k_cost_at_key(site, trained_ks[-1])] == costs[trained_ks[-1]]


# a tiny APE model that learns its task in seconds (one glyph, four quadrants: position decides)
TINY_TRAIN = (
    "model.dim=32", "model.depth=2", "model.heads=2", "data.image_size=16",
    "data.object_scale=0.32", "model.ape_init_std=1.0", "train.lr=6e-3", "train.steps=300",
    "train.batch_size=64", "train.eval_every=300", "train.eval_images=200",
    'train.precision="fp32"', "data.n_val=500", "data.n_test=200", 'data.relation="quadrant"',
    "data.n_content=1",
)  # fmt: skip


def test_auto_k_on_a_trained_model_meets_the_criterion_or_says_it_did_not(
    tmp_path: Path,
) -> None:
    """On a trained APE model, k = 0 with the SAE trained enough (1,000 images, 10 epochs) keeps
    the width rule's k = 4 (measured: 1 point of accuracy); starved (200 images, 2 epochs) no
    rung keeps the model (measured 8-10 points), every rung is tried and the cheapest is kept,
    flagged as failing. Either way the recorded cost is what splicing the kept SAE costs,
    measured independently here the way the study measures its "reconstruction" condition."""
    import poslens
    from poslens.experiments.readout import measure
    from poslens.training.config import apply_overrides, preset
    from poslens.training.train import train

    metrics = train(apply_overrides(preset("ape"), list(TINY_TRAIN)), tmp_path, progress=False)
    assert metrics["test"]["acc"] > 0.6  # chance 0.25
    m, task = poslens.load(tmp_path), poslens.load_task(tmp_path)
    site, top = "blocks.1.ln1.hook_normalized", sae_causal.RECON_MAX_COST
    kw = dict(sites=("early",), n_images=100, probe_images=50, batch_size=250)
    for images, epochs, met in ((1000, 10, True), (200, 2, False)):
        cfg = sae_causal.Config(train_images=images, epochs=epochs, **kw)
        sae, sel = sae_causal.fit_site_sae(m, task, cfg, site)
        ladder, costs = [r["k"] for r in sel["ladder"]], [r["cost"] for r in sel["ladder"]]
        assert sel["criterion_met"] is met and sel["k"] == sae.k and sel["by_criterion"]
        assert ladder == list(cfg.k_ladder(m.cfg.dim)[: len(ladder)])  # the ladder, in order
        assert all(c > top for c in costs[:-1])  # it stopped at the first rung that passed ...
        if met:
            assert costs[-1] <= top and sae.k == ladder[-1] == 4
        else:  # ... or tried them all and kept the cheapest
            assert ladder == list(cfg.k_ladder(m.cfg.dim)) and sel["cost"] == min(costs)
        xs, ys = sae_causal.phases.selection_images(task, cfg)
        assert len(xs) == sel["images"] == 500
        intact = measure(m, xs, ys, cfg).accuracy
        assert intact - measure(m, xs, ys, cfg, sae_causal.spliced(sae)).accuracy == (
            pytest.approx(sel["cost"], abs=1e-9)
        )


def test_the_dose_axis_is_ticked_at_the_doses(axis_run: sae_causal.SAECausal) -> None:
    """Every log dose axis has one major tick per dose (2, 3, 7, all = 8), plain integer labels
    (7 left blank: it would print over 8) and no minor ticks."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = sae_causal.plot(axis_run)
    FigureCanvasAgg(fig).draw()
    axes = fig.axes[:3]  # one site: the probe, accuracy and RPI-SSDC panels (then legends)
    assert axis_run.results[0].dose_curve("positional")[0] == [2, 3, 7, 8]
    for ax in axes:
        assert ax.get_xscale() == "log"
        assert list(ax.get_xticks()) == [2, 3, 7, 8]
        assert [t.get_text() for t in ax.get_xticklabels()] == ["2", "3", "", "8"]
        assert len(ax.xaxis.get_minorticklocs()) == 0


def test_sae_draws_average_their_headlines_and_keep_the_first_draw(tmp_path: Path) -> None:
    """sae_draws=2: draw 0 is the one-draw run itself (same SAE, same JSON), the second SAE is
    another seed's, and every headline number is the mean of the two draws' own numbers."""
    m, task = tiny("ape", num_classes=16, ape_code="rowcol", ape_init_std=1.0), build_task(DATA)
    one = sae_causal.Config(
        sites=("blocks.1.ln1.hook_normalized",), n_images=30, probe_images=20, batch_size=30,
        train_images=40, epochs=2, k=4, doses=(2,), draws=1,
    )  # fmt: skip
    two = replace(one, sae_draws=2)
    d1 = json.loads(json.dumps(jsonable(sae_causal.run(m, task, one).to_dict())))
    res = sae_causal.run(m, task, two)
    d2 = json.loads(json.dumps(jsonable(res.to_dict())))
    assert "sae_draws" not in d1 and len(d2["sae_draws"]) == 1
    assert d2["sae_sites"] == d1["sae_sites"]  # draw 0 is unchanged by asking for more
    other = d2["sae_draws"][0]["blocks.1.ln1.hook_normalized"]
    first = d2["sae_sites"]["blocks.1.ln1.hook_normalized"]
    assert other["positional_latents"] != first["positional_latents"]  # another SAE
    h1, h2 = sae_causal.headline(d1), sae_causal.headline(d2)
    h_other = sae_causal.headline({"sae_sites": d2["sae_draws"][0]})
    # every key of either draw (a group exists only where that draw's SAE found its latents)
    assert set(h2) == set(h1) | set(h_other)
    for k, x in h2.items():
        both = [v for v in (h1.get(k), h_other.get(k)) if v is not None and np.isfinite(v)]
        if both:
            assert x == pytest.approx(float(np.mean(both))), k
    save(res, tmp_path, sae_causal.plot)
    rows = list(csv.DictReader((tmp_path / "sae_causal_conditions.csv").open()))
    assert {r["sae_draw"] for r in rows} == {"0", "1"}
    for bad in (0, 21, True):
        with pytest.raises(ConfigError, match="analysis.sae_draws"):
            replace(one, sae_draws=bad)
    with pytest.raises(ConfigError, match="sae_draws must be 1 with given SAEs"):
        site = "blocks.1.ln1.hook_normalized"
        sae_causal.run(m, task, two, saes={site: TopKSAE(m.cfg.dim, 4 * m.cfg.dim, 4, site=site)})


def test_sae_passes_stay_within_the_analysis_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SAE's activation stores and codes are collected at most the analysis batch per forward
    pass (a pretrained ViT's batch is sized to its memory), and at their own default when the
    analysis batch is larger; the store holds the same tokens either way."""
    m, task = tiny("ape", num_classes=16), build_task(DATA)
    seen: list[int] = []
    cache_until = ViT.cache_until

    def recording(self: ViT, x: torch.Tensor, *a: object, **k: object) -> dict[str, torch.Tensor]:
        seen.append(len(x))
        return cache_until(self, x, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(ViT, "cache_until", recording)
    site = "blocks.1.ln1.hook_normalized"
    for batch, most in ((7, 7), (400, sae_causal.phases.STORE_BATCH_IMAGES)):
        seen.clear()
        cfg = sae_causal.Config(sites=(site,), n_images=30, probe_images=20, batch_size=batch,
                                train_images=300, epochs=1, k=4, doses=(2,), draws=1)  # fmt: skip
        sae_causal.fit_site_sae(m, task, cfg, site)
        assert seen and max(seen) == most
    x = task.split("val")[0][:40]
    small = sae_causal.phases.ActivationStore.from_model(m, x, site, batch_images=7)
    whole = sae_causal.phases.ActivationStore.from_model(m, x, site)
    assert torch.allclose(torch.as_tensor(small.acts_ND), torch.as_tensor(whole.acts_ND), atol=1e-6)


def test_the_table_site_and_draw_sites_limit_the_further_draws_to_the_sites_named() -> None:
    """sites "table" is block 0's raw residual (role "table"); draw_sites=("early",) repeats only
    the early site's SAE in the further draws, so the table site's numbers are draw 0's alone
    while the early site's are the mean of both; draw_sites must name entries of sites."""
    m, task = tiny("ape", num_classes=16, ape_code="rowcol", ape_init_std=1.0), build_task(DATA)
    cfg = sae_causal.Config(
        sites=("early", "table"), draw_sites=("early",), sae_draws=2, n_images=30,
        probe_images=20, batch_size=30, train_images=40, epochs=1, k=4, doses=(2,), draws=1,
    )  # fmt: skip
    from poslens.experiments.sae_causal.config import early_block, resolve_sites

    early, table = hooks.normalized(early_block(m)), hooks.resid_pre(0)
    assert resolve_sites(m, cfg, 0) == {early: ["early"], table: ["table"]}
    d = json.loads(json.dumps(jsonable(sae_causal.run(m, task, cfg).to_dict())))
    assert list(d["sae_sites"]) == [early, table]
    assert [list(x) for x in d["sae_draws"]] == [[early]]  # the early site alone drawn again
    h, h0 = sae_causal.headline(d), sae_causal.headline({"sae_sites": d["sae_sites"]})
    h1 = sae_causal.headline({"sae_sites": d["sae_draws"][0]})
    fvu = "table.fvu"
    assert fvu in h and h[fvu] == h0[fvu] and fvu not in h1
    assert h["early.fvu"] == pytest.approx((h0["early.fvu"] + h1["early.fvu"]) / 2)
    with pytest.raises(ConfigError, match="analysis.draw_sites"):
        replace(cfg, draw_sites=("probe",))


def test_without_refits_every_edit_keeps_its_fixed_probe_and_accuracy_numbers() -> None:
    """sae_causal.refit=false (the default study's): each edit reads the intact model's fixed
    probes alone; every number but the refitted probes' is the same, those are not measured."""
    m, task = tiny("ape", num_classes=16, ape_code="rowcol", ape_init_std=1.0), build_task(DATA)
    cfg = sae_causal.Config(
        sites=("blocks.0.hook_resid_pre",), n_images=30, probe_images=20, batch_size=30,
        train_images=40, epochs=2, k=4, doses=(2,), draws=1,
    )  # fmt: skip
    both = sae_causal.run(m, task, cfg).results[0]
    alone = sae_causal.run(m, task, replace(cfg, refit=False)).results[0]
    assert [c.name for c in alone.conditions] == [c.name for c in both.conditions]
    for a, b in zip(alone.conditions, both.conditions, strict=True):
        assert a.d_accuracy == b.d_accuracy and a.d_margin == b.d_margin
        np.testing.assert_array_equal(a.probe_fixed, b.probe_fixed)
        np.testing.assert_array_equal(a.probe_fixed_rpi, b.probe_fixed_rpi)
        assert a.probe is None and a.probe_rpi is None and b.probe is not None
    sa, sb = alone.summary(), both.summary()
    for group in set(sb) & set(sae_causal.GROUPS):
        for name, value in sb[group].items():
            if name.startswith("refit_"):
                assert math.isnan(sa[group][name]) and math.isfinite(value)
            else:
                assert sa[group][name] == pytest.approx(value, nan_ok=True), (group, name)
    with pytest.raises(ConfigError, match="analysis.refit"):
        sae_causal.Config(refit="no")  # type: ignore[arg-type]


def test_a_rowcol_site_runs_only_the_row_and_column_edits_with_the_same_numbers() -> None:
    """rowcol_sites (the default study's table site): the reconstruction and the row and column
    latents zeroed and resampled, exactly as a full run of the same SAE measures them, and no
    other edit; rowcol_sites must name entries of sites."""
    m, task = tiny("ape", num_classes=16, ape_code="rowcol", ape_init_std=1.0), build_task(DATA)
    cfg = sae_causal.Config(
        sites=("table",), n_images=30, probe_images=20, batch_size=30, train_images=40,
        epochs=2, k=4, doses=(2,), draws=1, refit=False,
    )  # fmt: skip
    full = sae_causal.run(m, task, cfg).results[0]
    only = sae_causal.run(m, task, replace(cfg, rowcol_sites=("table",))).results[0]
    names = [c.name for c in only.conditions]
    assert names == [c.name for c in full.conditions if c.name in sae_causal.ROWCOL_EDITS]
    assert set(names) == set(sae_causal.ROWCOL_EDITS)  # the planted code has row + col latents
    by_name = {c.name: c for c in full.conditions}
    for c in only.conditions:
        assert c.d_accuracy == by_name[c.name].d_accuracy
        np.testing.assert_array_equal(c.probe_fixed, by_name[c.name].probe_fixed)
    s_only, s_full = only.summary(), full.summary()
    assert set(s_only) & set(sae_causal.GROUPS) == set(sae_causal.ROWCOL_EDITS)
    for group in sae_causal.ROWCOL_EDITS:
        assert s_only[group] == pytest.approx(s_full[group], nan_ok=True)
    # a preset's entry that a user's own sites drop: the error says how to clear it
    with pytest.raises(
        ConfigError, match=r"analysis.rowcol_sites .*--set sae_causal.rowcol_sites="
    ):
        replace(cfg, rowcol_sites=("early",))
