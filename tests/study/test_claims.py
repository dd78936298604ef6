"""The claims' rules on constructed numbers: every claim at two levels (the original's
observation, the sharper test), each primary effect computed from the headline keys the
experiments write; a value that was not measured stays missing, with its reason, and never
reaches a verdict; a verdict needs enough measured seeds with spread, controls that were measured
and came out as designed, and (for "not supported") the power to exclude an effect the rule
detects; a level's study models and controls share one Holm correction; the reference check
says "not comparable" where the original's published numbers cannot meet a rule."""

from __future__ import annotations

import math
from typing import Any

import pytest

from poslens.experiments import axis_map as am
from poslens.experiments import position_removal as pr
from poslens.experiments import windows as win
from poslens.experiments.heads import result as hd
from poslens.experiments.output import retention_number
from poslens.experiments.sae_causal import result as sae
from poslens.metrics.stats import holm, seed_test
from poslens.study.aggregate import mean_se
from poslens.study.claims import CLAIMS, ORIGINAL, RULES, SHARPER, View
from poslens.study.claims.ape import ape_downstream_effect, ape_downstream_notes, ape_site_effect
from poslens.study.claims.heads import UNITS
from poslens.study.claims.split import rope_split_effect
from poslens.study.config import StudyConfig
from poslens.study.judge import (
    DESCRIPTIVE,
    FAILED_CALIBRATION,
    INCONCLUSIVE,
    MIN_SEEDS,
    NO_POWER,
    NOT_SUPPORTED,
    SUPPORTED,
    evaluate_claims,
)
from poslens.study.reference import CHECKS, NOT_COMPARABLE, reference_check
from poslens.study.verdicts import NOT_REPRODUCED, NOT_SPECIFIC, REPRODUCES, SPECIFIC

SEEDS = MIN_SEEDS
Agg = dict[str, dict[str, list[float]]]
SCALE = {"dim": 32, "depth": 4, "heads": 4, "grid": 6}


def entry(posenc: str, agg: Agg, seeds: int = SEEDS) -> dict[str, Any]:
    """A results.json model entry whose aggregate holds the given per-seed values."""
    return {
        "posenc": posenc,
        "scale": SCALE,
        "runs": [{"seed": s, "experiments": {e: {} for e in agg}} for s in range(seeds)],
        "aggregate": {e: {k: mean_se(v) for k, v in keys.items()} for e, keys in agg.items()},
    }


def jitter(x: float, n: int = SEEDS, spread: float = 0.02) -> list[float]:
    """n per-seed values around x (a deterministic spread, so intervals have a width)."""
    return [x + spread * (i - (n - 1) / 2) for i in range(n)]


def sae_numbers(
    site: float, matched: float, acc: float = 0.3, n: int = SEEDS, spread: float = 0.02
) -> Agg:
    """At the early site, the row + column latents zeroed: the site probe's drop toward chance
    (matched random latents: `matched`) and `acc` accuracy points lost (matched: none); at the
    table site, `acc` accuracy points lost when they carry another position (their own from
    another image: none)."""
    k = sae.key
    s, t = "early", "table"
    return {"sae_causal": {
        k(s, sae.ROWCOL_ZEROED, sae.fixed_drop("site")): jitter(site, n),
        k(s, sae.MATCHED_ROWCOL, sae.fixed_drop("site")): [matched] * n,
        k(s, sae.ROWCOL_ZEROED, "d_accuracy"): jitter(-acc, n, spread),
        k(s, sae.MATCHED_ROWCOL, "d_accuracy"): [0.0] * n,
        sae.latents_key(s, "row"): [2.0] * n, sae.latents_key(s, "col"): [2.0] * n,
        k(t, sae.ROWCOL_OTHER_IMAGE, "d_accuracy"): [0.0] * n,
        k(t, sae.ROWCOL_OTHER_POSITION, "d_accuracy"): jitter(-acc, n, spread),
        sae.latents_key(t, "row"): [2.0] * n, sae.latents_key(t, "col"): [2.0] * n,
    }}  # fmt: skip


def removal(intact: float, floor: float, n: int = SEEDS) -> Agg:
    return {"position_removal": {pr.key(pr.INTACT, "accuracy"): jitter(intact, n),
                                 pr.key(pr.FLOOR, "accuracy"): [floor] * n}}  # fmt: skip


def split(kept: float, rand: float, aligned: float = 1.0, pre: float = 0.0, n: int = SEEDS) -> Agg:
    """The other axis's fixed-probe retention after one axis's planes are removed, and the
    random planes' (4 per head); `pre` 1: the axes came from the construction (oblique)."""
    fixed = lambda axis: retention_number("probe_fixed", axis)  # noqa: E731
    return {
        "position_removal": {
            pr.key(pr.random_condition(4), fixed("row")): [rand] * n,
            pr.key(pr.random_condition(4), fixed("col")): [rand - 0.1] * n,
            pr.key(pr.axis_condition("row"), fixed("col")): jitter(kept, n),
            pr.key(pr.axis_condition("col"), fixed("row")): jitter(kept + 0.2, n),
            pr.AXES_PRE_ROTATION: [pre] * n,
            pr.AXIS_PLANES_PER_HEAD: [4.0] * n,
            # the conditions ran (their accuracy is measured): a NaN retention is undefined
            **{
                pr.key(c, "accuracy"): [0.5] * n
                for c in (
                    pr.random_condition(4),
                    pr.axis_condition("row"),
                    pr.axis_condition("col"),
                )
            },
        },
        "axis_map": {am.FRACTION_ALIGNED: [aligned] * n},
    }


def alignment(trained: float, init: float, n: int = SEEDS) -> Agg:
    return {"axis_map": {am.FRACTION_ALIGNED: jitter(trained, n),
                         am.FRACTION_ALIGNED_INIT: [init] * n}}  # fmt: skip


def windows(retention: float, relative: float, n: int = SEEDS) -> Agg:
    """The windows headline of a depth-4 model: the rebuilding window is 0..1 (the headline
    names it); window 0..0's numbers are not the rules'."""
    w = {
        win.key(win.prefix_window(1), "retention_ssdc_out"): jitter(retention, n),
        win.key(win.prefix_window(0), "retention_ssdc_out"): jitter(0.0, n),
        win.key(win.suffix_window(2), "retention_ssdc_out"): [0.5] * n,
        win.key(win.REBUILD, "window"): [1.0] * n,
        win.key(win.REBUILD, "relative"): jitter(relative, n),
    }
    return {"windows": w}


def heads(excess: float, null: float, r: float, n: int = SEEDS, permuted: float = 0.0) -> Agg:
    return {"heads": {
        hd.held_out_key(UNITS, hd.EXCESS_ACCURACY): jitter(excess, n),
        hd.held_out_key(UNITS, hd.NULL_EXCESS_ACCURACY): jitter(null, n),
        hd.consistency_key(hd.AXIS_PREFERENCE_RELATIVE, UNITS): jitter(r, n),
        hd.consistency_key(hd.AXIS_PREFERENCE_PERMUTED, UNITS): jitter(permuted, n),
    }}  # fmt: skip


def merge(*aggs: Agg) -> Agg:
    """Several experiments' numbers of one model, one experiment's keys merged."""
    out: Agg = {}
    for agg in aggs:
        for exp, keys in agg.items():
            out.setdefault(exp, {}).update(keys)
    return out


POSENC = {"ape_rowcol": "ape", "ape_cell": "ape", "ape_shuffled": "ape",
          "rope_oblique": "rope_axial", "rope_rebuild": "rope_axial", "rope_late": "rope_axial"}  # fmt: skip


def models(**kw: Agg) -> dict[str, dict[str, Any]]:
    return {name: entry(POSENC.get(name, name), agg) for name, agg in kw.items()}


def calibrated() -> dict[str, dict[str, Any]]:
    """Every rule's study models and controls, with numbers that make each sharper level
    supported and each original level reproduce, specific (every control comes out as designed,
    none of them degenerate; the negatives shown below their thresholds)."""
    return models(
        ape=merge(sae_numbers(0.6, 0.1), removal(0.95, 0.25)),
        ape_rowcol=merge(sae_numbers(0.7, 0.1, 0.4), removal(0.9, 0.3)),
        ape_cell=sae_numbers(0.0, 0.02),
        ape_shuffled=merge(sae_numbers(0.6, 0.1, 0.0), removal(0.3, 0.3)),
        rope_axial=merge(split(1.0, 0.4), windows(0.8, 0.3), heads(0.2, -0.1, 0.6),
                         removal(0.97, 0.17)),
        rope_mixed=merge(alignment(0.3, 0.1), windows(0.8, 0.3), removal(0.96, 0.2)),
        rope_oblique=split(0.35, 0.4, aligned=0.0, pre=1.0),
        rope_rebuild=merge(split(0.9, 0.3), windows(0.9, 0.5), heads(0.3, 0.0, 0.8)),
        rope_late=merge(windows(0.2, 0.0), heads(-0.1, 0.0, 0.0)),
    )  # fmt: skip


def judged(ms: dict[str, dict[str, Any]], cfg: StudyConfig | None = None) -> list[dict[str, Any]]:
    """evaluate_claims as results.json records it (each ClaimResult's to_dict)."""
    return [c.to_dict() for c in evaluate_claims(ms, cfg)]


def claim(claims: list[dict[str, Any]], rid: str) -> dict[str, Any]:
    return next(c for c in claims if c["id"] == rid)


def test_every_claim_has_both_levels_in_order() -> None:
    ids = [r.id for r in RULES]
    assert len(set(ids)) == len(ids)
    for name in CLAIMS:
        levels = [r.level for r in RULES if r.claim == name]
        assert levels[0] == ORIGINAL and set(levels) <= {ORIGINAL, SHARPER}
    assert sum(r.level == SHARPER for r in RULES) == 4  # position matters: one measure


def test_the_calibrated_numbers_support_every_level() -> None:
    """Sharper levels decide the mechanism (supported); original levels answer whether the
    published observation reproduces, with their measure's specificity."""
    got = {c["id"]: (c["verdict"], c["qualifier"]) for c in judged(calibrated())}
    want = {r.id: (DESCRIPTIVE, None) if r.descriptive else (SUPPORTED, None) if r.level == SHARPER
            else (REPRODUCES, SPECIFIC) for r in RULES}  # fmt: skip
    assert got == want
    for c in judged(calibrated()):
        if c["verdict"] == DESCRIPTIVE:
            continue
        cal = c["calibration"]
        assert cal["passed"] and not cal["sensitivity_only"], c["id"]
        assert all(not ctrl["degenerate"] for ctrl in cal["controls"])  # controls that could fail


def test_every_verdict_names_the_scale_it_describes() -> None:
    for c in judged(calibrated()):
        assert "width 32, depth 4, 4 heads, 6x6 grid" in c["summary"], c["id"]
        assert set(c["scale"]) == set(c["models"])


def test_ape_original_reads_the_site_probe_and_its_negative_is_the_cell_code() -> None:
    ms = calibrated()
    c = claim(judged(ms), "ape_explicit_features.original")
    assert c["primary"]["models"]["ape"]["mean"] == pytest.approx(0.5)
    # a study model whose row/column latents move the probe no more than matched ones
    ms["ape"] = entry("ape", sae_numbers(0.1, 0.1))
    c = claim(judged(ms), "ape_explicit_features.original")
    assert (c["verdict"], c["qualifier"]) == (NOT_REPRODUCED, SPECIFIC), c["summary"]
    # a measure that also "detects" the cell code is not specific: a finding about the measure,
    # stated beside the outcome (the outcome itself still reads the study model)
    ms["ape"] = calibrated()["ape"]
    ms["ape_cell"] = entry("ape", sae_numbers(0.8, 0.1))
    c = claim(judged(ms), "ape_explicit_features.original")
    assert (c["verdict"], c["qualifier"]) == (REPRODUCES, NOT_SPECIFIC), c["summary"]
    assert "Not specific: ape_cell" in c["summary"]


def test_ape_levels_can_disagree_decodable_but_unused() -> None:
    """The site probe falls (the original's observation holds) while the model loses no accuracy
    (the sharper test fails): the two levels are judged apart."""
    ms = calibrated()
    ms["ape"] = entry("ape", merge(sae_numbers(0.6, 0.1, acc=0.0, spread=0.005),
                                    removal(0.95, 0.25)))  # fmt: skip
    claims = judged(ms)
    assert claim(claims, "ape_explicit_features.original")["verdict"] == REPRODUCES
    assert claim(claims, "ape_explicit_features.sharper")["verdict"] == NOT_SUPPORTED
    # the shuffled negative control detected (it uses its table after all): calibration fails
    ms = calibrated()
    ms["ape_shuffled"] = entry("ape", merge(sae_numbers(0.6, 0.1, 0.3), removal(0.9, 0.3)))
    c = claim(judged(ms), "ape_explicit_features.sharper")
    assert c["verdict"] == FAILED_CALIBRATION and "ape_shuffled" in c["summary"]


def test_the_sharper_level_shows_zeroing_beyond_resampling_from_another_image() -> None:
    """Beside the sharper level, at both SAE sites: the accuracy zeroing the row and column
    latents costs beyond resampling them from the same position of another image; positive where
    zeroing costs more (their position is what the model uses), about 0 where both cost alike
    (their content). At the early site also the level's own comparison (another position of the
    same image against the same position of another image)."""
    agg = sae_numbers(0.3, 0.1, acc=0.3)
    agg["sae_causal"][sae.key("early", sae.ROWCOL_OTHER_IMAGE, "d_accuracy")] = [-0.1] * SEEDS
    agg["sae_causal"][sae.key("early", sae.ROWCOL_OTHER_POSITION, "d_accuracy")] = [-0.4] * SEEDS
    notes = dict(ape_downstream_notes(View("ape", entry("ape", agg))))
    (beyond,) = [v for k, v in notes.items() if "beyond resampling them" in k and "early" in k]
    assert beyond == pytest.approx(jitter(0.2, spread=-0.02))  # 0.3 lost against 0.1
    (at_table,) = [v for k, v in notes.items() if "beyond resampling them" in k and "raw" in k]
    assert all(math.isnan(x) for x in at_table)  # not zeroed at the table site here
    (moved,) = [v for k, v in notes.items() if k.startswith("the level's comparison at the early")]
    assert moved == pytest.approx([0.3] * SEEDS)  # 0.4 lost against 0.1
    # the level's effect reads the table site: 0.3 lost against none (sae_numbers)
    assert ape_downstream_effect(View("ape", entry("ape", agg))).values == pytest.approx(
        jitter(0.3, spread=-0.02))  # fmt: skip
    # the controls show the notes too, named with their role: why a positive was (not) detected
    ms = calibrated()
    ms["ape_rowcol"]["aggregate"]["sae_causal"][
        sae.key("early", sae.ROWCOL_OTHER_IMAGE, "d_accuracy")] = mean_se([-0.35] * SEEDS)  # fmt: skip
    c = claim(judged(ms), "ape_explicit_features.sharper")
    (line,) = [n for n in c["notes"] if n.startswith("ape_rowcol (positive control): ")
               and "beyond resampling them" in n and "early site" in n]  # fmt: skip
    assert ": 0.05 [" in line  # 0.4 lost against 0.35
    shuffled = [n for n in c["notes"] if n.startswith("ape_shuffled (negative control): ")]
    assert len(shuffled) == 3  # no number where the edits were not run
    assert all(n.endswith(": not measured") for n in shuffled)
    assert c["notes"][0].startswith("ape: ")  # the study model's notes come first


def test_no_row_column_latents_is_missing_with_its_reason_not_a_zero() -> None:
    """An SAE without row or column latents writes no rowcol keys: nothing was measured, so the
    seed is missing (with the reason), never an effect of 0."""
    none = {"early.fvu": [0.1] * SEEDS, sae.latents_key("early", "row"): [0.0] * SEEDS,
            sae.latents_key("early", "col"): [0.0] * SEEDS}  # fmt: skip
    e = ape_site_effect(View("ape_cell", entry("ape", {"sae_causal": none})))
    assert e.measured == 0 and all(math.isnan(x) for x in e.values)
    assert set(e.missing.values()) == {"the SAE found no row or column latents"}
    # as the only negative control: degenerate, the rule calibrated for sensitivity only
    ms = calibrated()
    ms["ape_cell"] = entry("ape", {"sae_causal": none})
    c = claim(judged(ms), "ape_explicit_features.original")
    assert c["calibration"]["sensitivity_only"] and c["verdict"] == REPRODUCES
    assert any("sensitivity only" in x for x in c["caveats"])
    # no negative control measured: specificity is not shown, so not assumed
    assert c["qualifier"] == NOT_SPECIFIC and "Specificity not shown" in c["summary"]


def test_fewer_than_five_seeds_is_inconclusive() -> None:
    ms = calibrated()
    ms["ape"] = entry("ape", sae_numbers(0.6, 0.1, n=3), seeds=3)
    c = claim(judged(ms), "ape_explicit_features.original")
    assert c["verdict"] == INCONCLUSIVE and "seed" in c["summary"]
    # every seed the study ran was measured: the reason is the study's seed count
    assert "3 of 3 seeds measured, a verdict needs 5 (the study ran 3 seeds)" in c["summary"]
    assert "no seed ran" not in c["summary"]


def test_a_rule_without_its_controls_gives_no_verdict() -> None:
    c = claim(judged(models(ape=removal(0.95, 0.25))), "position_matters.original")
    assert c["verdict"] == INCONCLUSIVE and "calibrated" in c["summary"]
    assert c["primary"]["models"]["ape"]["detected"]  # the effect itself is clear


def test_position_matters_against_position_present_but_unusable() -> None:
    ms = calibrated()
    c = claim(judged(ms), "position_matters.original")
    assert c["verdict"] == REPRODUCES and set(c["models"]) == {"ape", "rope_axial", "rope_mixed"}
    ms["rope_axial"] = entry("rope_axial", removal(0.9, 0.89))  # 1 point: below the threshold
    c = claim(judged(ms), "position_matters.original")
    assert c["verdict"] == INCONCLUSIVE and "rope_axial" in c["summary"]  # one of three models
    none = {"position_removal": {pr.key(pr.INTACT, "accuracy"): jitter(0.9, spread=0.005),
                                 pr.key(pr.FLOOR, "accuracy"): [0.9] * SEEDS}}  # fmt: skip
    for m in ("ape", "rope_axial", "rope_mixed"):  # no point lost in any of them
        ms[m] = entry(m, none)
    c = claim(judged(ms), "position_matters.original")
    assert c["verdict"] == NOT_REPRODUCED and "Does not reproduce" in c["summary"]


def test_split_original_is_judged_on_axial_rope_against_oblique_pre_rotation_axes() -> None:
    ms = calibrated()
    c = claim(judged(ms), "rope_planes_split.original")
    assert c["models"] == ["rope_axial"] and c["verdict"] == REPRODUCES
    ctrl = next(x for x in c["calibration"]["controls"] if x["model"] == "rope_oblique")
    assert ctrl["measured"] and not ctrl["detected"]  # measured, not gated: it could have failed
    assert ctrl["as_designed"] and ctrl["test"]["upper"] < 0.1  # shown below the threshold
    # the other axis survives worse than under random planes: does not reproduce
    ms["rope_axial"] = entry("rope_axial", split(0.1, 0.4))
    assert claim(judged(ms), "rope_planes_split.original")["verdict"] == NOT_REPRODUCED
    # oblique planes whose axes came from the angle tensors: the gate closes every seed, an
    # outcome ("nothing to split"), not an effect of 0; the negative control is then degenerate
    ms["rope_oblique"] = entry("rope_axial", split(0.35, 0.4, aligned=0.0, pre=0.0))
    e = rope_split_effect(View("x", ms["rope_oblique"]))
    assert e.measured == 0 and e.gate and "nothing to split" in e.reasons()
    c = claim(judged(ms), "rope_planes_split.original")
    assert c["calibration"]["sensitivity_only"]
    assert any("nothing to split" in line and "degenerate" in line for line in c["controls"])


def test_split_sharper_is_descriptive() -> None:
    c = claim(judged(calibrated()), "rope_planes_split.sharper")
    assert c["verdict"] == DESCRIPTIVE and c["models"] == ["rope_mixed"]
    assert c["primary"]["models"]["rope_mixed"]["mean"] == pytest.approx(0.2)
    assert "0.2 [" in c["summary"] and not c["calibration"]["controls"]


def test_rebuild_levels_read_retention_then_compensation() -> None:
    ms = calibrated()
    claims = judged(ms)
    a, b = (claim(claims, f"rope_rebuilds.{lvl}") for lvl in (ORIGINAL, SHARPER))
    assert a["primary"]["models"]["rope_axial"]["mean"] == pytest.approx(0.8)  # window 0..1
    assert any("RPI-SSDC units" in n and "0.3 [" in n for n in b["notes"])  # 0.8 + 0.5 - 1
    # the retention returns but nothing clearly beyond the threshold: no power on the line
    line = next(r.threshold for r in RULES if r.id == "rope_rebuilds.sharper")
    ms["rope_axial"] = entry("rope_axial", windows(0.8, line))
    ms["rope_mixed"] = entry("rope_mixed", windows(0.8, line))
    claims = judged(ms)
    assert claim(claims, "rope_rebuilds.original")["verdict"] == REPRODUCES
    b = claim(claims, "rope_rebuilds.sharper")
    assert b["verdict"] == INCONCLUSIVE and b["qualifier"] == NO_POWER
    ms["rope_axial"] = entry("rope_axial", windows(0.3, -0.3))
    ms["rope_mixed"] = entry("rope_mixed", windows(0.3, -0.3))
    claims = judged(ms)
    assert claim(claims, "rope_rebuilds.original")["verdict"] == NOT_REPRODUCED
    assert claim(claims, "rope_rebuilds.sharper")["verdict"] == NOT_SUPPORTED
    # a negative that rotates reads over half too: the retention reproduces, but not specifically
    ms = calibrated()
    ms["rope_late"] = entry("rope_axial", merge(windows(0.5, 0.0), heads(-0.1, 0.0, 0.0)))
    a = claim(judged(ms), "rope_rebuilds.original")
    assert (a["verdict"], a["qualifier"]) == (REPRODUCES, NOT_SPECIFIC)
    assert "Not specific: rope_late" in a["summary"] and "reads 0.50" in a["summary"]


def test_a_positive_control_that_fails_its_held_out_window_fails_calibration() -> None:
    ms = calibrated()
    ms["rope_rebuild"] = entry("rope_axial", merge(split(0.9, 0.3), windows(0.1, 0.0),
                                                   heads(0.1, 0.0, 0.8)))  # fmt: skip
    c = claim(judged(ms), "rope_rebuilds.sharper")
    assert c["verdict"] == FAILED_CALIBRATION and "rope_rebuild" in c["summary"]


def test_heads_original_has_a_random_head_null_built_inside_the_study_model() -> None:
    ms = calibrated()
    c = claim(judged(ms), "heads_rebuild.original")
    assert c["verdict"] == REPRODUCES
    null = next(x for x in c["calibration"]["controls"] if x["model"] == "rope_axial, random head")
    assert null["role"] == "negative" and null["measured"] and not null["detected"]
    # every head costs more after the window (the null shows an excess): calibration fails
    ms["rope_axial"]["aggregate"]["heads"][hd.held_out_key(UNITS, hd.NULL_EXCESS_ACCURACY)] = (
        mean_se(jitter(0.15))
    )
    c = claim(judged(ms), "heads_rebuild.original")
    assert c["qualifier"] == NOT_SPECIFIC and "random head" in c["summary"]


def test_heads_sharper_shows_the_same_correlation_in_rpi_ssdc_beside_it() -> None:
    """METHODS.md scores rebuilding in final RPI-SSDC: the level shows its correlation in that
    unit for the study model and each trained control, and never lets it decide the verdict."""
    ms = calibrated()
    ssdc = hd.consistency_key(hd.AXIS_PREFERENCE_SSDC, UNITS)
    for model, r in (("rope_axial", -0.4), ("rope_rebuild", 0.5)):
        ms[model]["aggregate"]["heads"][ssdc] = mean_se(jitter(r))
    c = claim(judged(ms), "heads_rebuild.sharper")
    assert c["verdict"] == SUPPORTED  # the margin correlation decides, as before
    lines = [n for n in c["notes"] if "the same correlation in final RPI-SSDC" in n]
    by_model = {n.split(":")[0]: n for n in lines}
    assert set(by_model) == {"rope_axial", "rope_rebuild (positive control)",
                             "rope_late (negative control)"}  # fmt: skip
    assert (
        "-0.4 [" in by_model["rope_axial"]
        and "0.5 [" in by_model["rope_rebuild (positive control)"]
    )
    assert by_model["rope_late (negative control)"].endswith("not measured")  # no key: not 0


def test_holm_is_one_family_per_level() -> None:
    """A level's study models and controls share one Holm correction; an original level's
    negative controls, read by their upper bounds for specificity, stand outside it."""
    assert holm([0.01, 0.04, 0.03, 0.5]) == pytest.approx([0.04, 0.09, 0.09, 0.5])
    for c in judged(calibrated()):
        outside = [x["test"] for x in c["calibration"]["controls"]
                   if c["level"] == ORIGINAL and x["role"] == "negative"]  # fmt: skip
        tests = [*c["primary"]["models"].values(),
                 *(x["test"] for x in c["calibration"]["controls"]
                   if not (c["level"] == ORIGINAL and x["role"] == "negative"))]  # fmt: skip
        p, p_holm = [t["p"] for t in tests], [t["p_holm"] for t in tests]
        assert p_holm == pytest.approx(holm(p), nan_ok=True), c["id"]
        assert [t["p_holm"] for t in outside] == pytest.approx([t["p"] for t in outside])


def test_seed_test_interval_and_p_value() -> None:
    t = seed_test([0.3, 0.4, 0.35, 0.5, 0.45], 0.25)
    assert t.mean == pytest.approx(0.4) and t.ci_low < 0.4 < t.ci_high
    half = 2.7764451 * math.sqrt(0.00625 / 5)  # t(0.975, 4) * sd / sqrt(n)
    assert t.ci_high - t.mean == pytest.approx(half, rel=1e-6) and t.p < 0.01
    assert t.lower > t.ci_low and t.upper < t.ci_high  # one-sided bounds lie inside
    flat = seed_test([0.0] * 5, 0.0)  # no spread: no test at all, said explicitly
    assert flat.no_spread and math.isnan(flat.p) and math.isnan(flat.upper)
    one = seed_test([math.nan, 0.3], 0.0)
    assert one.n == 1 and one.missing == 1 and math.isnan(one.p)
    assert holm([0.01, math.nan, 0.02]) == pytest.approx([0.02, math.nan, 0.02], nan_ok=True)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.id)
def test_reference_check_on_the_original_numbers(rule: Any) -> None:
    """Where the original's published numbers can feed the rule, it gives the original's verdict
    (the rules are not stricter than the evidence the original rested on); where they cannot,
    the check says why. Every original level has a comparable reference."""
    ref = reference_check(rule)
    assert rule.id in CHECKS and ref["note"]
    if ref["comparable"]:
        assert ref["agrees"] is True and ref["rule_verdict"] == "supported"
    else:
        assert ref["rule_verdict"] == NOT_COMPARABLE and ref["agrees"] is None
        assert "not tested by the original" in ref["note"]
    assert ref["comparable"] == (
        rule.level == ORIGINAL or rule.id == "ape_explicit_features.sharper"
    )
    expected = {"rope_rebuilds.original": 0.71, "position_matters.original": 0.46,
                "heads_rebuild.original": 0.038}  # METHODS.md, "Orientation"  # fmt: skip
    if rule.id in expected:
        assert ref["effect"] == pytest.approx(expected[rule.id], abs=0.005)


# ------------------------------------------------------------------- broken inputs, rule by rule


def _break(ms: dict[str, Any], model: str, exp: str, how: str, keys: list[str]) -> None:
    """Break the numbers of `keys` of one model: drop the keys (an experiment that found
    nothing / a missing key) or set seed 2 to NaN (not measured there)."""
    agg = ms[model]["aggregate"][exp]
    for k in keys:
        if how == "drop":
            agg.pop(k, None)
        else:
            values = list(agg[k]["values"])
            values[2] = None
            agg[k] = mean_se(values)


SITE_DROP = sae.key("early", sae.ROWCOL_ZEROED, sae.fixed_drop("site"))
MATCHED_SITE_DROP = sae.key("early", sae.MATCHED_ROWCOL, sae.fixed_drop("site"))
REBUILD_RET = win.key(win.prefix_window(1), "retention_ssdc_out")
REL = win.key(win.REBUILD, "relative")
RANDOM_ROW = pr.key(pr.random_condition(4), retention_number("probe_fixed", "row"))
BROKEN = [  # (rule, model, experiment, how, keys, the reason the verdict names)
    ("ape_explicit_features.original", "ape", "sae_causal", "drop", [SITE_DROP, MATCHED_SITE_DROP],
     "not measured"),
    ("ape_explicit_features.original", "ape", "sae_causal", "nan", [MATCHED_SITE_DROP],
     "matched random latents"),
    ("ape_explicit_features.sharper", "ape", "sae_causal", "nan",
     [sae.key("table", sae.ROWCOL_OTHER_POSITION, "d_accuracy")], "row/column resampling"),
    ("rope_planes_split.original", "rope_axial", "axis_map", "set_gate", [], "nothing to split"),
    ("rope_planes_split.original", "rope_axial", "position_removal", "drop",
     [pr.key(pr.random_condition(4), "accuracy"), RANDOM_ROW], "was not run"),
    # the condition ran, but intact and floor read the same (random weights): no retention
    ("rope_planes_split.original", "rope_axial", "position_removal", "nan", [RANDOM_ROW],
     "retention is undefined"),
    ("rope_rebuilds.original", "rope_axial", "windows", "nan", [REBUILD_RET], "no retention"),
    ("rope_rebuilds.sharper", "rope_axial", "windows", "drop", [win.key(win.REBUILD, "window"), REL],
     "no compensation window"),
    ("rope_rebuilds.sharper", "rope_axial", "windows", "nan", [REL], "no share"),
    ("heads_rebuild.original", "rope_axial", "heads", "nan",
     [hd.held_out_key(UNITS, hd.EXCESS_ACCURACY)], "no rebuilding test"),
    ("heads_rebuild.sharper", "rope_axial", "heads", "nan",
     [hd.consistency_key(hd.AXIS_PREFERENCE_RELATIVE, UNITS)], "no variance"),
    ("position_matters.original", "ape", "position_removal", "drop",
     [pr.key(pr.FLOOR, "accuracy")], "no accuracy"),
]  # fmt: skip


@pytest.mark.parametrize("rule,model,exp,how,keys,reason", BROKEN, ids=lambda x: str(x)[:30])
def test_a_broken_input_makes_the_level_inconclusive_with_its_reason(
    rule: str, model: str, exp: str, how: str, keys: list[str], reason: str
) -> None:
    """An experiment that finds nothing, a gate that fails, a missing key or a NaN in one seed of
    a study model: the level is inconclusive and says why, never supported or not supported."""
    ms = calibrated()
    if how == "set_gate":  # the axis map finds the planes oblique in seeds 0 and 1
        agg = ms[model]["aggregate"]["axis_map"]
        agg[am.FRACTION_ALIGNED] = mean_se([0.1, 0.2, 1.0, 1.0, 1.0])
    else:
        _break(ms, model, exp, how, keys)
    c = claim(judged(ms), rule)
    assert c["verdict"] == INCONCLUSIVE, c["summary"]
    assert reason in c["summary"] and model in c["summary"]
    assert c["measured"][model]["measured"] < SEEDS
    m = c["primary"]["models"][model]
    nan = {i for i, v in enumerate(m["values"]) if not math.isfinite(v)}
    assert nan and nan == {int(k) for k in m["missing"]}  # NaN exactly where a reason is given


def test_a_broken_control_leaves_the_rule_uncalibrated() -> None:
    for rule, control, exp, keys in [
        ("rope_rebuilds.sharper", "rope_late", "windows", [REL]),
        ("ape_explicit_features.original", "ape_cell", "sae_causal", [SITE_DROP]),
    ]:
        ms = calibrated()
        _break(ms, control, exp, "nan", keys)
        c = claim(judged(ms), rule)
        assert c["verdict"] == INCONCLUSIVE and "not calibrated" in c["summary"]
        assert control in c["summary"]


def test_a_control_with_no_spread_does_not_count() -> None:
    """Five identical values (a zero by construction) are no test: a positive control with no
    spread leaves the rule uncalibrated; a negative one is degenerate (sensitivity only)."""
    ms = calibrated()
    ms["rope_rebuild"]["aggregate"]["windows"][REL] = mean_se([0.5] * SEEDS)
    c = claim(judged(ms), "rope_rebuilds.sharper")
    assert c["verdict"] == INCONCLUSIVE and "no spread" in c["summary"]
    ms = calibrated()
    ms["rope_late"]["aggregate"]["windows"][REL] = mean_se([0.0] * SEEDS)
    c = claim(judged(ms), "rope_rebuilds.sharper")
    assert c["calibration"]["sensitivity_only"] and c["verdict"] == SUPPORTED
    assert any("degenerate" in line for line in c["controls"])


def test_a_failed_calibration_names_the_controls_that_failed_and_how() -> None:
    """On a sharper level an undetected positive fails the rule; a degenerate negative beside it
    does not count, so it is not named as a failure; the study model's effect is still given."""
    ms = calibrated()
    ms["ape_rowcol"] = entry("ape", sae_numbers(0.7, 0.1, acc=0.0))  # planted code unused
    none = {sae.latents_key("table", "row"): [0.0] * SEEDS,
            sae.latents_key("table", "col"): [0.0] * SEEDS}  # fmt: skip
    ms["ape_shuffled"] = entry("ape", {"sae_causal": none})
    c = claim(judged(ms), "ape_explicit_features.sharper")
    assert c["verdict"] == FAILED_CALIBRATION, c["summary"]
    assert "ape_rowcol (positive control) not detected: -0.00" in c["summary"]
    assert "ape_shuffled" not in c["summary"] and "ape 0.30" in c["summary"]


def test_an_original_level_needs_its_positive_only_to_say_it_does_not_reproduce() -> None:
    """The published observation reproduces on the study model whatever the planted positive
    does; a study model below the threshold reads "does not reproduce" only where the instrument
    detected what it planted, else no power."""
    ms = calibrated()
    ms["ape_rowcol"] = entry("ape", sae_numbers(0.12, 0.1))  # planted code barely moves
    assert claim(judged(ms), "ape_explicit_features.original")["verdict"] == REPRODUCES
    ms["ape"] = entry("ape", sae_numbers(0.1, 0.1))
    c = claim(judged(ms), "ape_explicit_features.original")
    assert (c["verdict"], c["qualifier"]) == (INCONCLUSIVE, NO_POWER), c["summary"]
    assert "did not detect its planted positive (ape_rowcol 0.02)" in c["summary"]


def test_the_heads_nulls_are_read_inside_each_judged_model_pretrained_too() -> None:
    """The random head and the permuted heads are nulls of the judged model itself: a pretrained
    RoPE model gets them under its own name, as the trained rope_axial does."""
    from poslens.study import StudyConfig

    ms = {"vit_rope": entry("rope_axial", merge(windows(0.8, 0.3), heads(0.05, 0.0, 0.6)))}
    cfg = StudyConfig(pretrained=("timm:vit_small_patch16_rope_224=hub",), images="imgs")
    claims = judged(ms, cfg)
    for rid, label in (("heads_rebuild.original", "random head"),
                       ("heads_rebuild.sharper", "heads permuted")):  # fmt: skip
        rows = {r["model"]: r for r in claim(claims, rid)["calibration"]["controls"]}
        assert set(rows) == {f"vit_rope, {label}"}, rid
        assert rows[f"vit_rope, {label}"]["measured"] and not rows[f"vit_rope, {label}"]["detected"]
    trained = {r["model"] for r in claim(judged(calibrated()), "heads_rebuild.sharper")
               ["calibration"]["controls"]}  # fmt: skip
    assert "rope_axial, heads permuted" in trained


def test_a_negative_control_empty_in_some_seeds_is_set_aside_not_blocking() -> None:
    """An in-situ negative whose SAE found no row or column latents in one seed (nothing there to
    measure, by construction of the edit) has 4 measured seeds: it does not count, but the level
    is calibrated on its other negative; alone, it leaves the level uncalibrated."""
    ms = calibrated()
    cell = sae_numbers(0.02, 0.02)
    agg = cell["sae_causal"]
    for k in (sae.latents_key("early", "row"), sae.latents_key("early", "col")):
        agg[k] = [2.0, 2.0, 0.0, 2.0, 2.0]  # seed 2: no row or column latents
    agg[SITE_DROP] = [*agg[SITE_DROP][:2], None, *agg[SITE_DROP][3:]]
    ms |= models(**{"ape~table_cell": cell})
    c = claim(judged(ms), "ape_explicit_features.original")
    assert c["verdict"] == REPRODUCES, c["summary"]
    assert any(x.startswith("Set aside: negative control ape~table_cell") for x in c["caveats"])
    row = next(r for r in c["calibration"]["controls"] if r["model"] == "ape~table_cell")
    assert not row["measured"] and "no row or column latents" in row["not_measured"]
    del ms["ape_cell"]  # the set-aside control alone cannot calibrate the level
    c = claim(judged(ms), "ape_explicit_features.original")
    assert c["verdict"] == INCONCLUSIVE and "not calibrated" in c["summary"]
