"""The claims' rules on constructed numbers: each primary effect is computed from the headline
keys the experiments write, a verdict needs enough seeds and a rule that came out as designed on
its controls, the Holm correction spans the claims, and the reference check on the original
study's published numbers agrees with the original where it can be computed."""

from __future__ import annotations

import math
from typing import Any

import pytest

from poslens.experiments import windows as win
from poslens.metrics.stats import holm, seed_test
from poslens.study.aggregate import mean_se
from poslens.study.claims import (
    FAILED_CALIBRATION,
    INCONCLUSIVE,
    MIN_SEEDS,
    NOT_SUPPORTED,
    SUPPORTED,
    evaluate_claims,
)
from poslens.study.reference import CHECKS, reference_check
from poslens.study.rules import RULES, View, rope_split_effect

SEEDS = MIN_SEEDS


def entry(
    posenc: str, agg: dict[str, dict[str, list[float]]], seeds: int = SEEDS
) -> dict[str, Any]:
    """A results.json model entry whose aggregate holds the given per-seed values."""
    return {
        "posenc": posenc,
        "runs": [{"seed": s, "experiments": {e: {} for e in agg}} for s in range(seeds)],
        "aggregate": {e: {k: mean_se(v) for k, v in keys.items()} for e, keys in agg.items()},
    }


def jitter(x: float, n: int = SEEDS, spread: float = 0.02) -> list[float]:
    """n per-seed values around x (a deterministic spread, so intervals have a width)."""
    return [x + spread * (i - (n - 1) / 2) for i in range(n)]


def sae(drop: float, matched: float, n: int = SEEDS) -> dict[str, dict[str, list[float]]]:
    return {"sae_causal": {
        "early.rowcol+error.fixed_drop_out": jitter(drop, n),
        "early.matched_rowcol.fixed_drop_out": jitter(matched, n),
    }}  # fmt: skip


def removal(intact: float, floor: float, n: int = SEEDS) -> dict[str, dict[str, list[float]]]:
    return {
        "position_removal": {
            "intact.accuracy": jitter(intact, n),
            "floor.accuracy": jitter(floor, n),
        }
    }


def split(kept: float | None, rand: float, n: int = SEEDS) -> dict[str, dict[str, list[float]]]:
    pr: dict[str, list[float]] = {
        "random_4.retention_probe_fixed_row": jitter(rand, n),
        "random_4.retention_probe_fixed_col": jitter(rand - 0.1, n),
    }
    if kept is not None:
        pr |= {
            "axis_row.accuracy": jitter(0.5, n), "axis_col.accuracy": jitter(0.5, n),
            "axis_row.retention_probe_fixed_col": jitter(kept, n),
            "axis_col.retention_probe_fixed_row": jitter(kept + 0.2, n),
        }  # fmt: skip
    aligned = 1.0 if kept is not None else 0.0
    return {
        "position_removal": pr,
        "axis_map": {"row_planes_per_head": [4.0] * n, "fraction_axis_aligned": [aligned] * n},
    }


def windows(relative: float, n: int = SEEDS) -> dict[str, dict[str, list[float]]]:
    """The windows headline of a depth-4 model: the rebuilding window is 0..1 (the headline
    names it), window 0..0's compensation is not the rule's."""
    w = {win.key(win.suffix_window(k), "accuracy"): [0.5] * n for k in (1, 2, 3)}
    w[win.key(win.compensation_of(1), "relative")] = jitter(relative, n)
    w[win.key(win.compensation_of(0), "relative")] = jitter(-1.0, n)
    w[win.key(win.REBUILD, "window")] = [1.0] * n
    w[win.key(win.REBUILD, "relative")] = jitter(relative, n)
    return {"windows": w}


def heads(r: float, n: int = SEEDS) -> dict[str, dict[str, list[float]]]:
    key = "consistency/axis_preference_relative_vs_spec/block_head.pearson"
    return {"heads": {key: jitter(r, n)}}


def models(**kw: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, Any]]:
    posenc = {"ape_rowcol": "ape", "ape_cell": "ape", "rope_oblique": "rope_axial",
              "rope_rebuild": "rope_axial", "rope_early": "rope_axial"}  # fmt: skip
    return {name: entry(posenc.get(name, name), agg) for name, agg in kw.items()}


def claim(claims: list[dict[str, Any]], cid: str) -> dict[str, Any]:
    return next(c for c in claims if c["id"] == cid)


def test_ape_claim_is_calibrated_on_planted_codes() -> None:
    ms = models(ape=sae(0.6, 0.1), ape_rowcol=sae(0.7, 0.1), sincos=sae(0.5, 0.05),
                ape_cell=sae(0.05, 0.02))  # fmt: skip
    c = claim(evaluate_claims(ms), "ape_explicit_features")
    assert c["calibration"]["passed"] and c["calibration"]["sensitivity"] == 1.0
    assert c["calibration"]["specificity"] == 1.0
    assert c["verdict"] == SUPPORTED
    assert c["primary"]["models"]["ape"]["mean"] == pytest.approx(0.5)
    # a study model whose row/column latents move the probe no more than matched ones
    ms["ape"] = entry("ape", sae(0.3, 0.27))
    assert claim(evaluate_claims(ms), "ape_explicit_features")["verdict"] == NOT_SUPPORTED
    # an instrument that also "detects" the cell code fails calibration: no verdict
    ms["ape_cell"] = entry("ape", sae(0.8, 0.1))
    c = claim(evaluate_claims(ms), "ape_explicit_features")
    assert c["verdict"] == FAILED_CALIBRATION and "ape_cell" in c["summary"]


def test_no_row_column_latents_is_a_zero_effect_not_a_missing_one() -> None:
    """An SAE without row or column latents writes no rowcol keys: the effect is 0 (nothing
    row/column-specific to remove), so the rule rejects it instead of having no answer."""
    v = View("ape_cell", entry("ape", {"sae_causal": {"early.fvu": [0.1] * SEEDS}}))
    from poslens.study.rules import ape_rowcol_effect

    assert ape_rowcol_effect(v) == [0.0] * SEEDS


def test_fewer_than_five_seeds_is_inconclusive() -> None:
    ms = models(ape=sae(0.6, 0.1, n=3), ape_rowcol=sae(0.7, 0.1), ape_cell=sae(0.0, 0.0))
    ms["ape"] = entry("ape", sae(0.6, 0.1, n=3), seeds=3)
    c = claim(evaluate_claims(ms), "ape_explicit_features")
    assert c["verdict"] == INCONCLUSIVE and "seed" in c["summary"]


def test_a_rule_without_its_controls_gives_no_verdict() -> None:
    c = claim(evaluate_claims(models(ape=removal(0.95, 0.25))), "position_matters")
    assert c["verdict"] == INCONCLUSIVE and "calibrated" in c["summary"]
    assert c["primary"]["models"]["ape"]["detected"]  # the effect itself is clear


def test_position_matters_against_the_none_model() -> None:
    ms = models(ape=removal(0.95, 0.25), rope_axial=removal(0.97, 0.17),
                ape_rowcol=removal(0.9, 0.3), none=removal(0.27, 0.27))  # fmt: skip
    c = claim(evaluate_claims(ms), "position_matters")
    assert c["verdict"] == SUPPORTED and set(c["models"]) == {"ape", "rope_axial"}
    ms["rope_axial"] = entry("rope_axial", removal(0.9, 0.85))  # 5 points: below the threshold
    c = claim(evaluate_claims(ms), "position_matters")
    assert c["verdict"] == NOT_SUPPORTED and "rope_axial" in c["summary"]


def test_rope_split_is_judged_on_learned_frequencies() -> None:
    ms = models(
        rope_mixed=split(0.9, 0.3), rope_axial=split(1.0, 0.4), rope_oblique=split(None, 0.4)
    )
    c = claim(evaluate_claims(ms), "rope_planes_split")
    assert c["models"] == ["rope_mixed"] and c["verdict"] == SUPPORTED
    # no axis-aligned planes at all (the oblique control): a zero effect
    assert rope_split_effect(View("x", ms["rope_oblique"])) == [0.0] * SEEDS
    # the other axis survives no better than under random planes: not supported
    ms["rope_mixed"] = entry("rope_mixed", split(0.35, 0.4))
    assert claim(evaluate_claims(ms), "rope_planes_split")["verdict"] == NOT_SUPPORTED


def test_rebuilding_needs_compensation_beyond_the_ordinary_contribution() -> None:
    ms = models(rope_axial=windows(0.3), rope_mixed=windows(0.25), rope_rebuild=windows(0.5),
                rope_early=windows(0.0))  # fmt: skip
    c = claim(evaluate_claims(ms), "rope_rebuilds")
    assert c["verdict"] == SUPPORTED  # the headline's rebuild window (0..1), not 0..0 (-1.0)
    ms["rope_axial"] = entry("rope_axial", windows(0.0))
    assert claim(evaluate_claims(ms), "rope_rebuilds")["verdict"] == NOT_SUPPORTED


def test_the_rebuilding_window_is_the_last_in_the_first_half_of_the_blocks() -> None:
    assert win.rebuild_window([0, 1], depth=4) == 1 and win.rebuild_window([0, 1, 2], 4) == 1
    assert win.rebuild_window([2, 3], depth=4) == 2  # none fits: the smallest
    assert win.rebuild_window([], depth=4) is None and win.rebuild_window([0], depth=1) is None


def test_heads_claim_reads_the_scale_free_axis_preference() -> None:
    ms = models(rope_axial=heads(0.6), rope_rebuild=heads(0.8), rope_early=heads(math.nan))
    c = claim(evaluate_claims(ms), "heads_rebuild")
    assert c["calibration"]["passed"]  # NaN (no preference varies) counts as no association
    assert c["verdict"] == SUPPORTED


def test_holm_spans_every_primary_test() -> None:
    assert holm([0.01, 0.04, 0.03, 0.5]) == pytest.approx([0.04, 0.09, 0.09, 0.5])
    ms = models(ape=removal(0.95, 0.25), ape_rowcol=removal(0.9, 0.3), none=removal(0.27, 0.27),
                rope_axial=windows(0.3), rope_rebuild=windows(0.5), rope_early=windows(0.0))  # fmt: skip
    claims = evaluate_claims(ms)
    p = [t["p"] for c in claims for t in c["primary"]["models"].values()]
    p_holm = [t["p_holm"] for c in claims for t in c["primary"]["models"].values()]
    assert p_holm == pytest.approx(holm(p)) and all(a >= b for a, b in zip(p_holm, p, strict=True))


def test_seed_test_interval_and_p_value() -> None:
    t = seed_test([0.3, 0.4, 0.35, 0.5, 0.45], 0.25)
    assert t.mean == pytest.approx(0.4) and t.ci_low < 0.4 < t.ci_high
    half = 2.7764451 * math.sqrt(0.00625 / 5)  # t(0.975, 4) * sd / sqrt(n)
    assert t.ci_high - t.mean == pytest.approx(half, rel=1e-6) and t.p < 0.01
    assert seed_test([0.0] * 5, 0.0).p == 1.0  # no spread, not above: never detected
    assert seed_test([math.nan, 0.3], 0.0).n == 1


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.id)
def test_reference_check_on_the_original_numbers(rule: Any) -> None:
    """Where the original's published numbers can feed the rule, it gives the original's verdict
    (the rules are not stricter than the evidence the original rested on); where they cannot,
    the check says why."""
    ref = reference_check(rule)
    assert rule.id in CHECKS and ref["note"]
    if ref["effect"] is None:
        assert ref["rule_verdict"] is None and "cannot" in ref["note"]
    else:
        assert ref["agrees"] is True and ref["rule_verdict"] == "supported"
    if rule.id == "rope_planes_split":
        assert "built into" in ref["note"]  # by its nature, not evidence for the rule
