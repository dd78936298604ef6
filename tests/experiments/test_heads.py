"""Heads: planted row / column / uniform heads get the right specialization, masking the planted
row head removes row information downstream, the rebuilding bookkeeping matches direct margins,
the delta-method SE matches a bootstrap, a planted rebuilder beats the held-out null across heads
(and a model with nothing to rebuild does not), config errors name the field, APE uses head
ablation."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from poslens.cli import main
from poslens.data import DataConfig, Task, build_task
from poslens.errors import ConfigError
from poslens.experiments import EXPERIMENTS, get, heads
from poslens.experiments.config import Passes
from poslens.experiments.heads.config import window_last
from poslens.experiments.heads.result import (
    AXIS_PREFERENCE_PERMUTED,
    AXIS_PREFERENCE_RELATIVE,
    AXIS_PREFERENCE_SSDC,
    EXCESS,
    EXCESS_ACCURACY,
    HELD_OUT,
    N_IMAGES,
    N_UNITS,
    NULL_EXCESS,
    NULL_EXCESS_ACCURACY,
    TOP_MINUS_NULL,
    TOP_MINUS_NULL_ACCURACY,
    TOP_RANK,
    UNIT,
    held_out,
    held_out_key,
    se_key,
)
from poslens.experiments.heads.units import head_mask, heads_off, window_mask
from poslens.experiments.output import save
from poslens.experiments.readout import eval_images, measure, reference
from poslens.interventions import axis_map, rotary_mask
from poslens.io import jsonable, save_tensors, write_json
from poslens.metrics import correct_class_margin
from poslens.metrics.attention import AttentionAccumulator, attention_stats, specialization
from poslens.metrics.stats import correlation, ratio_diff_se, ratio_se
from poslens.models import ViT
from tests.conftest import tiny

DIM, HEADS = 32, 4  # head_dim 8: 4 rotation planes, 2 per axis
FAST = dict(n_images=200, probe_images=200, batch_size=200, draws=1)


class NoiseTask(Task):
    """White-noise images with random labels: content says nothing about position, so any
    position a probe finds came through the attention heads."""

    def __init__(self) -> None:
        super().__init__()
        self.name, self.num_classes, self.in_chans, self.image_size = "noise", 5, 1, 16
        self.class_names = ["a", "b", "c", "d", "e"]

    def _make_split(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(7 if name == "test" else 8)
        x = torch.randn(200, 1, 16, 16, generator=g)
        return x, torch.randint(0, 5, (200,), generator=g)


def _channels(model: ViT, planes: list[int]) -> list[int]:
    """Channels of the given planes in one head, by the model's pairing layout."""
    dh = model.cfg.head_dim
    if model.cfg.rope_layout == "interleaved":
        return [c for p in planes for c in (2 * p, 2 * p + 1)]
    return [c for p in planes for c in (p, p + dh // 2)]


@torch.no_grad()
def plant(
    model: ViT, block: int, head: int, axis: str | None, seed: int, loud: bool = False
) -> None:
    """Queries and keys of (block, head) use only the planes of `axis` (from the axis map; every
    other q/k weight and bias zeroed); axis None zeroes them all (uniform attention). Large
    biases make the logits mostly positional; `loud` scales up the head's values and output."""
    g = torch.Generator().manual_seed(seed)
    cfg, dh = model.cfg, model.cfg.head_dim
    attn = model.blocks[block].attn
    planes = [] if axis is None else np.flatnonzero(axis_map(model).axis[block, head] == axis)
    keep = _channels(model, [int(p) for p in planes])
    for s in (0, 1):  # qkv output rows: [q | k | v] x heads x head_dim
        rows = s * cfg.dim + head * dh + torch.arange(dh)
        attn.qkv.weight[rows] = 0
        attn.qkv.bias[rows] = 0
        for c in keep:
            attn.qkv.weight[s * cfg.dim + head * dh + c] = 0.05 * torch.randn(cfg.dim, generator=g)
            attn.qkv.bias[s * cfg.dim + head * dh + c] = 2.0 * torch.randn((), generator=g)
    if loud:
        attn.qkv.weight[2 * cfg.dim + head * dh + torch.arange(dh)] = 0.3 * torch.randn(
            dh, cfg.dim, generator=g
        )
        attn.proj.weight[:, head * dh : (head + 1) * dh] = 0.3 * torch.randn(
            cfg.dim, dh, generator=g
        )


def planted(layout: str = "interleaved") -> ViT:
    """Block 0: head 0 row-only, head 1 column-only (both loud), heads 2-3 uniform; block 1:
    head 0 row-only, head 1 column-only (loud), heads 2-3 untouched. A distinct CLS token
    (identity rotation) lets rotated queries tell absolute rows and columns apart."""
    m = tiny("rope_axial", rope_layout=layout, dim=DIM, heads=HEADS)
    for h, axis in enumerate(("row", "col", None, None)):
        plant(m, 0, h, axis, seed=h, loud=axis is not None)
    plant(m, 1, 0, "row", seed=10, loud=True)
    plant(m, 1, 1, "col", seed=11, loud=True)
    with torch.no_grad():
        m.cls_token.copy_(torch.randn(1, 1, DIM, generator=torch.Generator().manual_seed(3)))
    return m


@pytest.fixture(scope="module")
def noise() -> Task:
    return NoiseTask()


@pytest.fixture(scope="module")
def planted_result(noise: Task) -> heads.Heads:
    cfg = heads.Config(
        **FAST,
        probe_block=1,
        window_k=0,
        units=("block_head",),
        cumulative=(1, 2),
        rebuild_probes=False,
    )
    return heads.run(planted(), noise, cfg)


# ------------------------------------------------------------------------ attention statistics


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_planted_heads_get_their_axis_score(layout: str, noise: Task) -> None:
    m = planted(layout)
    x, _ = noise.split("test")
    st = attention_stats(m, x[:64])
    spec = st.specialization
    assert spec[0, 0] > 0.95 and spec[1, 0] > 0.95  # row-only heads
    assert spec[0, 1] < -0.95 and spec[1, 1] < -0.95  # column-only heads
    assert st.eta2_row[0, 0] > 0.3 and st.eta2_col[0, 0] < 0.01
    assert st.eta2_col[0, 1] > 0.3 and st.eta2_row[0, 1] < 0.01
    # Uniform heads: nothing explained, score 0, and E|d| exactly the uniform value over patch
    # keys (1.25 on a 4x4 grid; the CLS key must not count, it would give 16/17 of that).
    assert st.uniform_abs_drow == pytest.approx(1.25) and st.uniform_abs_dcol == pytest.approx(1.25)
    for h in (2, 3):
        assert spec[0, h] == 0 and st.eta2_row[0, h] == 0 and st.eta2_col[0, h] == 0
        assert st.mean_abs_drow[0, h] == pytest.approx(1.25, abs=1e-9)
        assert st.mean_abs_dcol[0, h] == pytest.approx(1.25, abs=1e-9)
    # The row head attends closer along rows than uniform, and not along columns.
    assert st.mean_abs_drow[0, 0] < 1.1 and abs(st.mean_abs_dcol[0, 0] - 1.25) < 0.1
    assert ((st.patch_mass > 0) & (st.patch_mass <= 1)).all()


def test_explained_shares_are_exact_on_synthetic_logits() -> None:
    """Logits that are a function of the row offset (plus per-query offsets softmax ignores)
    are explained entirely by d_row and not at all by d_col; a sum of both splits exactly."""
    gh = gw = 4
    row = torch.arange(16) // gw
    col = torch.arange(16) % gw
    d_row = (row[None, :] - row[:, None]).double()  # [queries, keys]
    d_col = (col[None, :] - col[:, None]).double()
    f = torch.sin(1.3 * d_row) + 0.2 * d_row**2
    gcol = torch.cos(0.7 * d_col) - 0.3 * d_col
    offsets = torch.randn(3, 2, 16, 1, dtype=torch.float64)  # [B, H, queries, 1]
    scores = torch.stack([f, gcol])[None] + offsets  # head 0: rows, head 1: columns
    mixed = (f + gcol)[None, None] + offsets[:, :1]
    for logits, expect in ((scores, [(1, 0), (0, 1)]), (mixed, [(None, None)])):
        acc = AttentionAccumulator(1, logits.shape[1], gh, gw, 0, "cpu")
        acc._scores_hook(0)(logits, "")
        acc._pattern_hook(0)(logits.softmax(-1), "")
        acc.n_images = 3
        st = acc.result(0.05)
        for h, (er, ec) in enumerate(expect):
            if er is None:  # both axes: the shares add to one (orthogonal groupings)
                assert st.eta2_row[0, h] + st.eta2_col[0, h] == pytest.approx(1, abs=1e-9)
                assert 0.05 < st.eta2_row[0, h] < 0.95
            else:
                assert st.eta2_row[0, h] == pytest.approx(er, abs=1e-9)
                assert st.eta2_col[0, h] == pytest.approx(ec, abs=1e-9)
    assert specialization(np.array([0.01]), np.array([0.0]), 0.05)[0] == pytest.approx(0.2)
    assert specialization(np.array([0.3]), np.array([0.1]), 0.05)[0] == pytest.approx(0.5)


# --------------------------------------------------------------------- carrying in the planted


def test_masking_the_planted_row_head_removes_row_information(
    planted_result: heads.Heads,
) -> None:
    res = planted_result
    assert res.probe_site == 1 and res.intervention == "rotary"
    chance = 0.25  # 4 rows, 4 columns
    row_base, col_base = res.baseline["probe@1"][1:]
    assert row_base > chance + 0.1 and col_base > chance + 0.1  # both axes reach site 1
    carry = {c.meta["unit"]: c for c in res.carrying}
    # block_head units at or after the probe site cannot reach it and are not measured
    assert {u for u in carry if u.startswith("b")} == {f"b0h{h}" for h in range(HEADS)}
    row_off, col_off = carry["b0h0"].probe, carry["b0h1"].probe
    assert row_off is not None and col_off is not None
    assert row_off[1] < chance + 0.06  # row information gone downstream...
    assert row_off[2] > col_base - 0.06  # ...column information kept
    assert col_off[2] < chance + 0.06 and col_off[1] > row_base - 0.06  # the mirror
    # Uniform heads have no rotation to lose: exactly nothing changes.
    for h in (2, 3):
        assert carry[f"b0h{h}"].d_margin.mean == 0 and carry[f"b0h{h}"].meta["damage"] == 0
    assert {carry["b0h0"].meta["rank"], carry["b0h1"].meta["rank"]} == {1, 2}
    # Masking a head of block 1 cannot change the residual entering block 1.
    m = planted()
    x, _ = NoiseTask().split("test")
    with torch.no_grad():
        _, before = m.run_with_cache(x[:8], ["blocks.1.hook_resid_pre"])
        with heads_off(m, [(1, 0), (1, 1)])(m):
            logits, after = m.run_with_cache(x[:8], ["blocks.1.hook_resid_pre"])
    torch.testing.assert_close(after["blocks.1.hook_resid_pre"], before["blocks.1.hook_resid_pre"])
    assert not torch.allclose(logits, m(x[:8]))  # but it does change the output


def test_cumulative_top_k_and_random_draws(planted_result: heads.Heads) -> None:
    cum = planted_result.cumulative
    for kind in ("block_head",):
        tops = [c for c in cum if c.meta["kind"] == kind and c.meta["selection"] == "top"]
        assert sorted(c.meta["k"] for c in tops) == [1, 2]
        ranked = sorted(
            (c for c in planted_result.carrying if c.meta["kind"] == kind),
            key=lambda c: c.meta["rank"],
        )
        top2 = next(c for c in tops if c.meta["k"] == 2)
        assert top2.meta["units"] == [c.meta["unit"] for c in ranked[:2]]
        rand = [c for c in cum if c.meta["kind"] == kind and c.meta["selection"] == "random"]
        assert len(rand) == 2 and {c.meta["k"] for c in rand} == {1, 2}  # one draw per k
    table = planted_result.top_k_vs_random("block_head")
    assert [t["k"] for t in table] == [1, 2] and all(t["draws"] == 1 for t in table)
    rand2 = next(c for c in cum if c.meta["selection"] == "random" and c.meta["k"] == 2)
    assert table[1]["random"] == rand2.meta["damage"]
    # the two planted block-0 heads together remove both axes at site 1
    both = next(
        c
        for c in cum
        if c.meta["kind"] == "block_head" and c.meta["selection"] == "top" and c.meta["k"] == 2
    )
    assert both.probe is not None and both.probe[1] < 0.31 and both.probe[2] < 0.31


# ------------------------------------------------------------------------------ rebuilding


def test_rebuilding_scores_match_direct_margins(planted_result: heads.Heads, noise: Task) -> None:
    res = planted_result
    m = planted()
    x, y = noise.split("test")
    depth, p = m.cfg.depth, m.cfg.head_dim // 2

    @torch.no_grad()
    def margin(mask: torch.Tensor | None) -> np.ndarray:
        if mask is None:
            return correct_class_margin(m(x), y).double().numpy()
        with rotary_mask(m, planes=mask):
            return correct_class_margin(m(x), y).double().numpy()

    def mask_of(pairs: list[tuple[int, int]]) -> torch.Tensor:
        out = torch.zeros(depth, HEADS, p, dtype=torch.bool)
        for b, h in pairs:
            out[b, h] = True
        return out

    amap = axis_map(m)
    window = {"all": mask_of([(0, h) for h in range(HEADS)])}
    window["row"] = torch.as_tensor(amap.axis == "row") & mask_of([(0, h) for h in range(HEADS)])
    window["col"] = torch.as_tensor(amap.axis == "col") & mask_of([(0, h) for h in range(HEADS)])
    later = mask_of([(1, h) for h in range(HEADS)])
    base, later_off = margin(None), margin(later)
    assert res.window_k == 0 and {w.window for w in res.windows} == {"all", "row", "col"}
    for w in res.windows:
        win = margin(window[w.window])
        c_win, c_int = win - margin(window[w.window] | later), base - later_off
        assert w.later_after_window.mean == pytest.approx(c_win.mean(), abs=1e-4)
        assert w.later_intact.mean == pytest.approx(c_int.mean(), abs=1e-4)
        assert w.compensation.mean == pytest.approx((c_win - c_int).mean(), abs=1e-4)
        assert w.ratio == pytest.approx(c_win.mean() / c_int.mean(), rel=1e-3)
        for r in res.rebuild(w.window, "block_head"):
            u = mask_of([(1, r.head)])
            dw, di = win - margin(window[w.window] | u), base - margin(u)
            assert r.drop_window.mean == pytest.approx(dw.mean(), abs=1e-4)
            assert r.drop_intact.mean == pytest.approx(di.mean(), abs=1e-4)
            assert r.excess.mean == pytest.approx((dw - di).mean(), abs=1e-4)
            # an SE at float-noise level (a head whose mask changes nothing) is compared absolutely
            assert r.excess.se == pytest.approx(
                (dw - di).std(ddof=1) / np.sqrt(len(dw)), rel=1e-3, abs=1e-6
            )
    # The loud planted heads of block 1 cost margin when masked; untouched ones much less.
    drops = {r.head: r.drop_intact.mean for r in res.rebuild("all", "block_head")}
    assert min(abs(drops[0]), abs(drops[1])) > 10 * max(abs(drops[2]), abs(drops[3]))


@pytest.mark.parametrize("rebuild_probes", [True, False])
def test_reused_readouts_equal_fresh_ones(noise: Task, rebuild_probes: bool) -> None:
    """With the probe site at the output, a block-head unit masked in the intact model is its
    carrying condition, and a cumulative draw of one unit is too: run() measures them once. The
    reused numbers equal a fresh measurement of the same condition."""
    m = planted()
    cfg = heads.Config(
        n_images=60, probe_images=30, batch_size=60, draws=2, probe_block=2, window_k=0,
        units=("block_head",), cumulative=(1,), axis_windows=False, rebuild_probes=rebuild_probes,
    )  # fmt: skip
    res = heads.run(m, noise, cfg)
    x, y = eval_images(noise, cfg)
    ref = reference(m, x, y, cfg, extra_sites=[2])
    carrying = {c.meta["unit"]: c for c in res.carrying}
    assert {r.unit for r in res.rebuild("all")} <= set(carrying)  # every one was reused
    for r in res.rebuild("all"):
        fresh = measure(m, x, y, cfg, heads_off(m, [(1, r.head)]), [2], fixed=ref.fixed)
        assert r.drop_intact.mean == pytest.approx(
            (ref.base.margin - fresh.margin).mean(), abs=1e-9
        )
        assert r.ssdc_out_intact == pytest.approx(fresh.ssdc_rpi[-1], abs=1e-9)
        if rebuild_probes:
            assert r.probe_out_intact is not None
            np.testing.assert_allclose(r.probe_out_intact, fresh.probe_at(2))
        else:
            assert r.probe_out_intact is None and r.probe_out is None
    assert len(res.cumulative) == 3  # the top unit and two random ones
    for c in res.cumulative:
        (unit,) = c.meta["units"]
        block, head = int(unit[1]), int(unit[3])
        fresh = measure(m, x, y, cfg, heads_off(m, [(block, head)]), [2], fixed=ref.fixed)
        assert c.margin == pytest.approx(fresh.margin.mean(), abs=1e-9)
        assert c.probe is not None
        np.testing.assert_allclose(c.probe, fresh.probe_at(2))
        assert c.meta["damage"] == carrying[unit].meta["damage"]
        assert c.name.startswith(c.meta["selection"]) and "rank" not in c.meta


def test_rebuilding_without_ssdc_gives_the_same_margins_and_no_ssdc(
    noise: Task, planted_result: heads.Heads
) -> None:
    """heads.rebuild_ssdc=false skips the RPI pass of every rebuilding readout: every margin and
    accuracy number is the full run's, and every output RPI-SSDC is NaN (never a stale value)."""
    cfg = heads.Config(**FAST, probe_block=1, window_k=0, units=("block_head",), cumulative=(1, 2),
                       rebuild_probes=False, rebuild_ssdc=False)  # fmt: skip
    res = heads.run(planted(), noise, cfg)
    full = {(r.unit, r.window): r for r in planted_result.rebuilding}
    assert len(res.rebuilding) == len(full) > 0
    for r in res.rebuilding:
        f = full[r.unit, r.window]
        assert (r.excess.mean, r.ratio, r.drop_window.mean) == (
            f.excess.mean,
            f.ratio,
            f.drop_window.mean,
        )
        assert math.isnan(r.ssdc_out) and math.isnan(r.ssdc_out_intact)
        assert math.isfinite(f.ssdc_out)
    for w, f in zip(res.windows, planted_result.windows, strict=True):
        assert w.compensation.mean == f.compensation.mean and math.isnan(w.ssdc_out)
    # the axis preference in RPI-SSDC is then undefined (no pairs), never a stale correlation
    ssdc_pref = res.consistency()[f"{AXIS_PREFERENCE_SSDC}/block_head"]
    assert ssdc_pref["n"] == 0 and math.isnan(ssdc_pref["pearson"])
    # without the RPI pass a readout's probes are the clean ones alone, the full readout's
    x, y = eval_images(noise, cfg)
    clean = measure(planted(), x, y, cfg, probe_sites=[1], passes=Passes(rpi=False))
    both = measure(planted(), x, y, cfg, probe_sites=[1])
    assert clean.probes is not None and both.probes is not None
    np.testing.assert_array_equal(clean.probes.test_acc, both.probes.test_acc)
    assert clean.probes_rpi is None and both.probes_rpi is not None
    assert np.isnan(clean.ssdc_rpi).all() and np.isfinite(both.ssdc_rpi).all()
    with pytest.raises(ValueError, match="no RPI pass"):
        clean.fixed_probes()  # fixed probes need both kinds


def test_clean_rebuilding_readouts_share_the_windows_prefix_pass(noise: Task) -> None:
    """Without SSDC and probes, rebuilding masks that agree on the window's blocks start from
    one pass of those blocks (the intact one, each window's): block 0 runs once per window and
    once more, not once per mask, and every margin is the whole pass's, bit for bit."""
    from poslens.experiments.heads.phases import (
        measure_rebuilding,
        plan_rebuilding,
        rebuilding_masks,
    )
    from poslens.experiments.heads.units import units_of

    m = planted()
    cfg = heads.Config(**FAST, window_k=0, units=("block_head",), rebuild_probes=False,
                       rebuild_ssdc=False)  # fmt: skip
    x, y = eval_images(noise, cfg)
    plan = plan_rebuilding(m, cfg)
    masks = rebuilding_masks(m, plan, units_of(m, "block_head", plan.later))
    calls = []
    with m.hooks([("blocks.0.hook_resid_pre", lambda t, name: calls.append(1))]):
        shared = measure_rebuilding(m, x, y, cfg, masks, lambda: None, first=1)
    # the intact prefix and one per window (all, row, col), one batch each
    assert len(masks) > 10 and len(calls) == 1 + len(plan.windows) == 4
    whole = measure_rebuilding(m, x, y, cfg, masks, lambda: None, first=0)
    assert set(shared) == set(whole)
    for k in masks:
        assert np.array_equal(shared[k].margin, whole[k].margin), k
        assert np.array_equal(shared[k].correct, whole[k].correct), k


def test_ratio_delta_method_matches_a_paired_bootstrap() -> None:
    """a and b strongly correlated per image: ignoring the covariance would overstate the SE."""
    rng = np.random.default_rng(0)
    common = rng.normal(1.0, 1.0, 400)
    a = 2 * common + rng.normal(0, 0.2, 400)
    b = common + rng.normal(0, 0.2, 400) + 0.5
    r, se = ratio_se(a, b)
    assert r == pytest.approx(a.mean() / b.mean())
    idx = rng.integers(0, 400, (4000, 400))
    boot = a[idx].mean(1) / b[idx].mean(1)
    assert se == pytest.approx(boot.std(), rel=0.1)
    naive = r * np.hypot(a.std() / a.mean(), b.std() / b.mean()) / np.sqrt(400)
    assert naive > 3 * se  # the check above would fail without the covariance
    d, dse = ratio_diff_se(a, b, a, b)
    assert d == 0 and dse == 0
    assert np.isnan(ratio_se(a, np.zeros(400))[0])


def test_verdict_and_consistency(planted_result: heads.Heads) -> None:
    v = planted_result.verdict()
    assert v["row_heads"] >= 2 and v["col_heads"] >= 2
    assert v["specialized_heads"] == v["row_heads"] + v["col_heads"]
    assert v["carrying/block_head"]["top_carrier"] in {"b0h0", "b0h1"}
    reb = v["rebuilding/block_head"]
    assert reb["tests"] == HEADS and isinstance(v["any_rebuilder"], bool)
    assert v["any_rebuilder"] == bool(reb["rebuilders"]) and "rebuilding/head" not in v
    for r in planted_result.rebuild("all", "block_head"):
        assert (r.unit in reb["rebuilders"]) == (r.excess.mean > 2 * r.excess.se)
        assert (r.unit in reb["cheaper_after_window"]) == (r.excess.mean < -2 * r.excess.se)
    assert v["carrying/block_head"]["top_k_vs_random"][1]["top"] > 0
    assert reb[HELD_OUT][N_IMAGES] == 100
    corr = planted_result.consistency()
    assert corr["carrying_vs_abs_spec/block_head"]["n"] == HEADS
    # block 0: planted heads carry position and are specialized, uniform ones neither
    assert corr["carrying_vs_abs_spec/block_head"]["spearman"] > 0.5
    # the null: the same preferences against permuted specialisations, seeded by the analysis
    # seed (the same seed, the same permutation; another seed, another)
    pref, null = (f"{m}/block_head" for m in (AXIS_PREFERENCE_RELATIVE, AXIS_PREFERENCE_PERMUTED))
    # the axis preference in final RPI-SSDC (METHODS.md's score): each head's drop against its
    # window alone, row-only minus column-only window, correlated with its specialisation
    rows = {r.unit: r for r in planted_result.rebuild("row", "block_head")}
    cols = {r.unit: r for r in planted_result.rebuild("col", "block_head")}
    assert rows and rows.keys() == cols.keys()
    win = {w.window: w.ssdc_out for w in planted_result.windows}
    by_hand = [(win["row"] - rows[u].ssdc_out) - (win["col"] - cols[u].ssdc_out) for u in rows]
    spec = planted_result.attention.specialization
    assert corr[f"{AXIS_PREFERENCE_SSDC}/block_head"] == correlation(
        by_hand, [float(spec[rows[u].block, rows[u].head]) for u in rows]
    )
    assert corr[f"{AXIS_PREFERENCE_SSDC}/block_head"]["n"] == len(rows)
    if pref in corr:
        assert corr[null]["n"] == corr[pref]["n"]
        again = dataclasses.replace(planted_result, seed=planted_result.seed).consistency()
        assert again[null] == corr[null]
        others = {json.dumps(dataclasses.replace(planted_result, seed=s).consistency()[null])
                  for s in range(6)}  # fmt: skip
        assert len(others) > 1


# ---------------------------------------------------------- held-out top rebuilder and its null


class ZeroLabels(NoiseTask):
    """NoiseTask with every label 0: the planted classifier below sets every image's margin."""

    def _make_split(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = super()._make_split(name)
        return x, torch.zeros_like(y)


@torch.no_grad()
def rebuilder(redundant: bool = True) -> ViT:
    """A planted rebuilder for the window of block 0 (window_k=0). Patches share one embedding
    (little content noise) and the MLPs are off; block 0 has one loud row head A = b0h0 (its other
    heads write nothing), block 1 one loud column head u = b1h0. Each one's rotations move the CLS
    token's attention and so shift its final features along a direction d; the classifier's
    margin saturates in z = d . features: 1 while either shift is there, lower when both are gone.
    Intact, masking u costs nothing (A's shift remains); after the window (A's rotations withheld)
    it removes the last shift, so u costs more after the window than in the intact model.
    redundant=False then makes A attend uniformly (its queries and keys zeroed), which is what
    its masked rotations did: the window changes nothing, nothing is rebuilt, and masking u costs
    the same margin with or without the window."""
    m = tiny("rope_axial", dim=DIM, heads=HEADS)
    g = torch.Generator().manual_seed(0)
    dh = m.cfg.head_dim
    m.patch_embed.weight.mul_(0.05)
    m.patch_embed.bias.copy_(torch.randn(DIM, generator=g))
    m.cls_token.copy_(torch.randn(1, 1, DIM, generator=g))
    for block in m.blocks:
        block.mlp.fc2.weight.zero_()
        block.mlp.fc2.bias.zero_()
    m.blocks[0].attn.proj.weight[:, dh:] = 0  # block 0: only head 0 writes
    plant(m, 0, 0, "row", seed=1, loud=True)
    plant(m, 1, 0, "col", seed=2, loud=True)
    x, _ = ZeroLabels().split("test")
    window, u = window_mask(m, "all", 0), head_mask(m, [(1, 0)])

    def cls_features(mask: torch.Tensor) -> torch.Tensor:  # [D] mean final CLS features
        with rotary_mask(m, planes=mask):
            _, cache = m.run_with_cache(x[:64], ["ln_final.hook_normalized"])
        return cache["ln_final.hook_normalized"][:, 0].mean(0)

    feats = {k: cls_features(mask) for k, mask in (("u", u), ("w", window), ("wu", window | u))}
    a_shift, u_shift = feats["u"] - feats["wu"], feats["w"] - feats["wu"]
    d = a_shift / a_shift.norm() + u_shift / u_shift.norm()
    d /= d.norm()
    z = {k: float(f @ d) for k, f in feats.items()}
    assert z["wu"] < min(z["u"], z["w"])  # each head's rotations alone move z up
    theta, t = (z["wu"] + min(z["u"], z["w"])) / 2, 20.0
    # logits: class 0 = 0, class 1 = -t (z - theta) - 1, class 2 = -1, others far below, so the
    # margin of class 0 is min(1, 1 + t (z - theta)): saturated above theta
    m.head.weight.zero_()
    m.head.weight[1] = -t * d
    m.head.bias.copy_(torch.tensor([0.0, t * theta - 1, -1.0, -50.0, -50.0]))
    if not redundant:
        plant(m, 0, 0, None, seed=1)  # A's queries and keys zeroed: uniform attention
    return m


# every held-out statistic that comes with a paired SE
HELD_OUT_STATS = (
    EXCESS, EXCESS_ACCURACY, NULL_EXCESS, NULL_EXCESS_ACCURACY, TOP_MINUS_NULL,
    TOP_MINUS_NULL_ACCURACY,
)  # fmt: skip
REBUILD_CFG = dict(
    n_images=120, probe_images=30, batch_size=120, draws=1, probe_block=1, window_k=0,
    units=("block_head",), cumulative=(1,), rebuild_probes=False, axis_windows=False,
)  # fmt: skip


def test_planted_rebuilder_beats_the_held_out_null() -> None:
    res = heads.run(rebuilder(), ZeroLabels(), heads.Config(**REBUILD_CFG))
    rows = {r.unit: r for r in res.rebuild("all", "block_head")}
    assert rows["b1h0"].drop_intact.mean == pytest.approx(0, abs=1e-6)  # redundant when intact
    assert rows["b1h0"].drop_window.mean > 0.5  # the last shift after the window
    ho = res.verdict()["rebuilding/block_head"][HELD_OUT]
    assert ho[UNIT] == "b1h0" and ho[N_IMAGES] == 60 and ho[N_UNITS] == 4 and ho[TOP_RANK] == 1
    for name in (EXCESS, TOP_MINUS_NULL, EXCESS_ACCURACY, TOP_MINUS_NULL_ACCURACY):
        assert ho[name] > 5 * ho[se_key(name)] > 0, name
    # the null is the mean over the 4 units: the rebuilder's excess and three near-zero ones
    assert ho[NULL_EXCESS] == pytest.approx(ho[EXCESS] / 4, rel=0.05)
    assert ho[EXCESS_ACCURACY] > 0.5  # masking u after the window costs most images
    h = heads.headline(jsonable(res.to_dict()))
    for name in HELD_OUT_STATS:
        assert h[held_out_key("block_head", name)] == pytest.approx(ho[name])
        assert h[held_out_key("block_head", se_key(name))] == pytest.approx(ho[se_key(name)])


def test_nothing_to_rebuild_leaves_top_and_null_at_zero() -> None:
    res = heads.run(rebuilder(redundant=False), ZeroLabels(), heads.Config(**REBUILD_CFG))
    rows = {r.unit: r for r in res.rebuild("all", "block_head")}
    assert rows["b1h0"].drop_intact.mean > 0.5  # the head matters, with or without the window
    assert all(abs(r.excess.mean) < 1e-9 for r in rows.values())
    h = heads.headline(jsonable(res.to_dict()))
    for name in HELD_OUT_STATS:
        assert abs(h[held_out_key("block_head", name)]) < 1e-9, name
        assert held_out_key("block_head", se_key(name)) in h


def _planted_margins(
    excess: list[float], n: int = 400, seed: int = 0
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], list[str]]:
    """Per-image margins of units whose cost after the window exceeds their intact cost by
    `excess` (plus noise), and correctness = margin > 0."""
    rng = np.random.default_rng(seed)
    units = [f"u{i}" for i in range(len(excess))]
    m = {"intact": rng.normal(2, 1, n), "window:all": rng.normal(1, 1, n)}
    for u, e in zip(units, excess, strict=True):
        cost = rng.normal(0.5, 1, n)
        m[f"unit:{u}"] = m["intact"] - cost
        m[f"window:all+{u}"] = m["window:all"] - cost - e + rng.normal(0, 1, n)
    return m, {k: (v > 0).astype(float) for k, v in m.items()}, units


def test_held_out_null_catches_a_generic_excess() -> None:
    """Every unit costs 0.4 more after the window: the top unit clears 2 SE alone, but so does
    the null, and the top does not beat it. One planted unit of 0.8 among them does."""
    margins, correct, units = _planted_margins([0.4] * 8)
    ho = held_out(margins, correct, units)
    assert ho[EXCESS] > 2 * ho[se_key(EXCESS)] and ho[NULL_EXCESS] > 2 * ho[se_key(NULL_EXCESS)]
    assert abs(ho[TOP_MINUS_NULL]) < 3 * ho[se_key(TOP_MINUS_NULL)]
    margins, correct, units = _planted_margins([0.4] * 7 + [1.2])
    ho = held_out(margins, correct, units)
    assert ho[UNIT] == "u7" and ho[TOP_MINUS_NULL] > 3 * ho[se_key(TOP_MINUS_NULL)]
    # accuracy: the same unit's held-out excess in per-image correctness
    perm = np.random.default_rng(12345).permutation(400)[200:]
    e = (correct["window:all"] - correct["window:all+u7"]) - (
        correct["intact"] - correct["unit:u7"]
    )
    assert ho[EXCESS_ACCURACY] == pytest.approx(e[perm].mean())


# --------------------------------------------------------------------------- config, APE, IO


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"window_k": -2}, "analysis.window_k"),
        ({"units": ("heads",)}, "analysis.units"),
        ({"units": ()}, "analysis.units"),
        ({"units": ("head", "head")}, "analysis.units"),
        ({"cumulative": (0,)}, "analysis.cumulative"),
        ({"axis_windows": "yes"}, "analysis.axis_windows"),
        ({"min_explained": 0.0}, "analysis.min_explained"),
        ({"min_explained": 2.0}, "analysis.min_explained"),
        ({"n_images": 5}, "analysis.n_images"),
    ],
)
def test_config_errors_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        heads.Config(**kwargs)


def test_window_beyond_the_model_names_the_field(noise: Task) -> None:
    with pytest.raises(ConfigError, match=r"analysis\.window_k=1 leaves no later block"):
        heads.run(tiny("rope_axial"), noise, heads.Config(**FAST, window_k=1))
    assert window_last(tiny("rope_axial", depth=6), heads.Config()) == 2
    assert window_last(tiny("ape"), heads.Config()) is None
    assert heads.applies(tiny("none")) is not None and heads.applies(tiny("ape")) is None


def test_ape_uses_head_output_ablation(noise: Task) -> None:
    m = tiny("ape", dim=DIM, heads=HEADS)
    x, _ = noise.split("test")
    with torch.no_grad():
        _, cache = m.run_with_cache(x[:4], ["blocks.0.attn.hook_z", "blocks.1.attn.hook_z"])
        with heads_off(m, [(0, 1), (1, 2), (1, 3)])(m):
            _, off = m.run_with_cache(x[:4], ["blocks.0.attn.hook_z", "blocks.1.attn.hook_z"])
    z0, z1 = off["blocks.0.attn.hook_z"], off["blocks.1.attn.hook_z"]  # [B, H, T, dh]
    assert (z0[:, 1] == 0).all() and (z1[:, 2:] == 0).all()
    torch.testing.assert_close(z0[:, [0, 2, 3]], cache["blocks.0.attn.hook_z"][:, [0, 2, 3]])
    cfg = heads.Config(n_images=60, probe_images=60, batch_size=60, draws=1, cumulative=(1,))
    res = heads.run(m, noise, cfg)
    assert res.intervention == "ablation" and res.rebuilding == [] and res.windows == []
    assert "no rotations" in res.notes[0] and "not measured" in res.verdict()["rebuilding"]
    assert len([c for c in res.carrying if c.meta["kind"] == "head"]) == HEADS
    assert any(c.d_margin.mean != 0 for c in res.carrying)  # ablation changed the model
    assert res.attention.specialization.shape == (2, HEADS)
    assert {"attention", "carrying", "cumulative"} == set(res.tables())
    heads.plot(res)


def test_outputs_json_csv_png(planted_result: heads.Heads, tmp_path: Path) -> None:
    written = save(planted_result, tmp_path, heads.plot)
    assert {p.name for p in written} == {
        "heads.json",
        *(
            f"heads_{t}.csv"
            for t in ("attention", "carrying", "cumulative", "windows", "rebuilding")
        ),
        "heads.png",
    }
    doc = json.loads(
        (tmp_path / "heads.json").read_text(),
        parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"),
    )
    assert doc["verdict"]["intervention"] == "rotary" and "margins" not in doc
    assert len(doc["attention"]["specialization"]) == 2
    with open(tmp_path / "heads_rebuilding.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3 * HEADS  # 3 windows x block_head units of block 1
    assert {"excess", "excess_se", "ratio", "ratio_se", "ratio_minus_blocks_se"} <= set(rows[0])
    with open(tmp_path / "heads_attention.csv") as f:
        assert len(list(csv.DictReader(f))) == 2 * HEADS
    assert (tmp_path / "heads.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    axis = planted_result.axis_preference("block_head")
    assert len(axis) == HEADS and all(np.isfinite(a["se"]) for a in axis)


def test_registered_and_runs_from_the_cli(tmp_path: Path) -> None:
    assert EXPERIMENTS.index("heads") == EXPERIMENTS.index("sae_causal") - 1
    assert get("heads") is heads.EXPERIMENT and get("heads").run is heads.run
    data = DataConfig(image_size=16, object_scale=0.32, n_val=16, n_test=30)
    build_task(data)
    m = tiny("rope_axial", num_classes=16)
    ckpt = tmp_path / "ckpt"
    write_json(ckpt / "config.json", {"model": m.cfg.to_dict(), "data": data.__dict__})
    save_tensors(ckpt / "model.safetensors", m.state_dict())
    out = tmp_path / "out"
    argv = ["analyze", str(ckpt), "--out", str(out), "--images", "20", "--probe-images", "10"]
    argv += ["--experiments", "heads", "--no-progress", "--set", "heads.cumulative=1"]
    argv += ["--set", "heads.draws=1", "--set", "heads.axis_windows=false"]
    assert main(argv) == 0
    summary = json.loads((out / "analysis.json").read_text())
    assert summary["experiments"]["heads"]["config"]["cumulative"] == [1]
    assert (out / "heads.png").is_file()
    with open(out / "heads_rebuilding.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 + 2  # all-plane window x (2 head units + 2 heads of block 1)
    assert all(0 <= float(r["probe_out_row"]) <= 1 for r in rows)
    # A head unit is head h in every later block: with one later block, the same as b1h<h>.
    by = {(r["window"], r["unit"]): float(r["excess"]) for r in rows}
    for h in (0, 1):
        assert by[("all", f"h{h}")] == pytest.approx(by[("all", f"b1h{h}")], abs=1e-9)
