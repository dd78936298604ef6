"""The claims' rules on constructed numbers: each primary effect is computed from the headline
keys the experiments write; a value that was not measured stays missing, with its reason, and
never reaches a verdict; a verdict needs enough measured seeds with spread, a rule whose controls
were measured and came out as designed, and (for "not supported") the power to exclude an effect
the rule detects; study models and controls share one Holm correction; the reference check says
"not comparable" where the original's published numbers cannot meet a rule."""

from __future__ import annotations

import math
from typing import Any

import pytest

from poslens.experiments import windows as win
from poslens.experiments.sae_causal.result import key as sae_key
from poslens.experiments.sae_causal.result import latents_key
from poslens.metrics.stats import holm, seed_test
from poslens.study.aggregate import mean_se
from poslens.study.claims import (
    FAILED_CALIBRATION,
    INCONCLUSIVE,
    MIN_SEEDS,
    NO_POWER,
    NOT_SUPPORTED,
    SUPPORTED,
    evaluate_claims,
)
from poslens.study.reference import CHECKS, NOT_COMPARABLE, reference_check
from poslens.study.rules import RULES, View, ape_rowcol_effect, rope_split_effect

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
        sae_key("early", "rowcol+error", "fixed_drop_out"): jitter(drop, n),
        sae_key("early", "matched_rowcol", "fixed_drop_out"): [matched] * n,
        latents_key("early", "row"): [2.0] * n, latents_key("early", "col"): [2.0] * n,
    }}  # fmt: skip


def removal(intact: float, floor: float, n: int = SEEDS) -> dict[str, dict[str, list[float]]]:
    return {
        "position_removal": {
            "intact.accuracy": jitter(intact, n),
            "floor.accuracy": [floor] * n,
        }
    }


def split(kept: float | None, rand: float, n: int = SEEDS) -> dict[str, dict[str, list[float]]]:
    pr: dict[str, list[float]] = {
        "random_4.retention_probe_fixed_row": [rand] * n,
        "random_4.retention_probe_fixed_col": [rand - 0.1] * n,
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


def test_no_row_column_latents_is_missing_with_its_reason_not_a_zero() -> None:
    """An SAE without row or column latents writes no rowcol keys: nothing was measured, so the
    seed is missing (with the reason), never an effect of 0."""
    none = {"early.fvu": [0.1] * SEEDS, latents_key("early", "row"): [0.0] * SEEDS,
            latents_key("early", "col"): [0.0] * SEEDS}  # fmt: skip
    e = ape_rowcol_effect(View("ape_cell", entry("ape", {"sae_causal": none})))
    assert e.measured == 0 and all(math.isnan(x) for x in e.values)
    assert set(e.missing.values()) == {"the SAE found no row or column latents"}


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
        rope_mixed=split(0.9, 0.3), rope_axial=split(1.0, 0.4), rope_oblique=split(0.35, 0.4)
    )
    c = claim(evaluate_claims(ms), "rope_planes_split")
    assert c["models"] == ["rope_mixed"] and c["verdict"] == SUPPORTED
    # the other axis survives clearly worse than under random planes: not supported
    ms["rope_mixed"] = entry("rope_mixed", split(0.1, 0.4))
    assert claim(evaluate_claims(ms), "rope_planes_split")["verdict"] == NOT_SUPPORTED
    ms["rope_oblique"] = entry("rope_axial", split(None, 0.4))
    c = claim(evaluate_claims(ms), "rope_planes_split")
    # no axis-aligned planes at all (the oblique control): the gate closes every seed, an
    # outcome ("nothing to split"), not an effect of 0; the rule is then not calibrated
    e = rope_split_effect(View("x", ms["rope_oblique"]))
    assert e.measured == 0 and e.gate and "nothing to split" in e.reasons()
    assert c["calibration"]["sensitivity_only"]  # a degenerate negative: sensitivity only
    assert any("nothing to split" in line and "degenerate" in line for line in c["controls"])


def test_rebuilding_needs_compensation_beyond_the_ordinary_contribution() -> None:
    ms = models(rope_axial=windows(0.3), rope_mixed=windows(0.25), rope_rebuild=windows(0.5),
                rope_early=windows(0.0))  # fmt: skip
    c = claim(evaluate_claims(ms), "rope_rebuilds")
    assert c["verdict"] == SUPPORTED  # the headline's rebuild window (0..1), not 0..0 (-1.0)
    # no compensation, within noise of 0: no power to say "not supported" at threshold 0
    ms["rope_axial"] = entry("rope_axial", windows(0.0))
    c = claim(evaluate_claims(ms), "rope_rebuilds")
    assert c["verdict"] == INCONCLUSIVE and c["qualifier"] == NO_POWER
    assert "upper bound" in c["summary"]
    # clearly less after the window than anyway: the interval excludes what the rule detects
    ms["rope_axial"] = entry("rope_axial", windows(-0.3))
    assert claim(evaluate_claims(ms), "rope_rebuilds")["verdict"] == NOT_SUPPORTED


def test_the_rebuilding_window_is_the_last_in_the_first_half_of_the_blocks() -> None:
    assert win.rebuild_window([0, 1], depth=4) == 1 and win.rebuild_window([0, 1, 2], 4) == 1
    assert win.rebuild_window([2, 3], depth=4) == 2  # none fits: the smallest
    assert win.rebuild_window([], depth=4) is None and win.rebuild_window([0], depth=1) is None


def test_heads_claim_reads_the_scale_free_axis_preference() -> None:
    ms = models(rope_axial=heads(0.6), rope_rebuild=heads(0.8), rope_early=heads(0.0))
    c = claim(evaluate_claims(ms), "heads_rebuild")
    assert c["calibration"]["passed"] and c["verdict"] == SUPPORTED
    # a negative control whose correlation is undefined (no preference varies) in every seed
    # has nothing to measure: it shows nothing about specificity, and the claim says the rule is
    # calibrated for sensitivity only
    ms["rope_early"] = entry("rope_axial", heads(math.nan))
    c = claim(evaluate_claims(ms), "heads_rebuild")
    assert c["calibration"]["sensitivity_only"] and c["calibration"]["specificity"] is None
    assert any("sensitivity only" in x for x in c["caveats"])
    ctrl = next(x for x in c["calibration"]["controls"] if x["model"] == "rope_early")
    assert ctrl["degenerate"] and not ctrl["measured"]


def test_holm_spans_every_primary_test() -> None:
    assert holm([0.01, 0.04, 0.03, 0.5]) == pytest.approx([0.04, 0.09, 0.09, 0.5])
    ms = models(ape=removal(0.95, 0.25), ape_rowcol=removal(0.9, 0.3), none=removal(0.27, 0.27),
                rope_axial=windows(0.3), rope_rebuild=windows(0.5), rope_early=windows(0.0))  # fmt: skip
    claims = evaluate_claims(ms)
    tests = [t for c in claims for t in c["primary"]["models"].values()]
    tests += [ctrl["test"] for c in claims for ctrl in c["calibration"]["controls"]]
    p, p_holm = [t["p"] for t in tests], [t["p_holm"] for t in tests]
    real = [(a, b) for a, b in zip(p_holm, p, strict=True) if math.isfinite(b)]
    assert len(real) == 6  # 2 study tests + 4 controls that ran: one family, one standard
    assert p_holm == pytest.approx(holm(p), nan_ok=True)
    assert all(a >= b for a, b in real)


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
    the check says why."""
    ref = reference_check(rule)
    assert rule.id in CHECKS and ref["note"]
    if ref["comparable"]:
        assert ref["agrees"] is True and ref["rule_verdict"] == "supported"
    else:
        assert ref["rule_verdict"] == NOT_COMPARABLE and ref["agrees"] is None
        assert "not comparable" in ref["note"]
    expected = {"rope_rebuilds": 0.19, "position_matters": 0.46}  # METHODS.md, "Orientation"
    if rule.id in expected:
        assert ref["effect"] == pytest.approx(expected[rule.id], abs=0.005)
    if rule.id == "ape_explicit_features":
        assert "mixed" in ref["note"]  # the finder's 60% rule on the original's latents


# ------------------------------------------------------------------- broken inputs, rule by rule


def merge(*aggs: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, list[float]]]:
    """Several experiments' numbers of one model, one experiment's keys merged."""
    out: dict[str, dict[str, list[float]]] = {}
    for agg in aggs:
        for exp, keys in agg.items():
            out.setdefault(exp, {}).update(keys)
    return out


def calibrated() -> dict[str, dict[str, Any]]:
    """Every rule's study models and controls, with numbers that make each verdict supported."""
    return models(
        ape=merge(sae(0.6, 0.1), removal(0.95, 0.25)), ape_rowcol=merge(sae(0.7, 0.1),
        removal(0.9, 0.3)), ape_cell=sae(0.05, 0.02), none=removal(0.27, 0.27),
        rope_mixed=merge(split(0.9, 0.3), windows(0.3), removal(0.96, 0.2)),
        rope_axial=merge(split(1.0, 0.4), windows(0.3), heads(0.6), removal(0.97, 0.17)),
        rope_oblique=split(0.35, 0.4), rope_rebuild=merge(windows(0.5), heads(0.8)),
        rope_early=merge(windows(0.0), heads(0.0)),
    )  # fmt: skip


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


BROKEN = [  # (rule, model, experiment, how, keys, the reason the verdict names)
    ("ape_explicit_features", "ape", "sae_causal", "drop",
     [sae_key("early", "rowcol+error", "fixed_drop_out"),
      sae_key("early", "matched_rowcol", "fixed_drop_out")], "not measured"),
    ("ape_explicit_features", "ape", "sae_causal", "nan",
     [sae_key("early", "matched_rowcol", "fixed_drop_out")], "matched random latents"),
    ("rope_planes_split", "rope_mixed", "axis_map", "set_gate", [], "nothing to split"),
    ("rope_planes_split", "rope_mixed", "position_removal", "drop",
     ["random_4.retention_probe_fixed_row"], "was not run"),
    ("rope_rebuilds", "rope_axial", "windows", "drop", ["rebuild.window", "rebuild.relative"],
     "no compensation window"),
    ("rope_rebuilds", "rope_axial", "windows", "nan", ["rebuild.relative"], "no share"),
    ("heads_rebuild", "rope_axial", "heads", "nan",
     ["consistency/axis_preference_relative_vs_spec/block_head.pearson"], "no variance"),
    ("position_matters", "ape", "position_removal", "drop", ["floor.accuracy"], "no accuracy"),
]  # fmt: skip


def test_the_calibrated_numbers_support_every_claim() -> None:
    assert {c["id"]: c["verdict"] for c in evaluate_claims(calibrated())} == {
        r.id: SUPPORTED for r in RULES
    }


@pytest.mark.parametrize("rule,model,exp,how,keys,reason", BROKEN, ids=lambda x: str(x)[:24])
def test_a_broken_input_makes_the_claim_inconclusive_with_its_reason(
    rule: str, model: str, exp: str, how: str, keys: list[str], reason: str
) -> None:
    """An experiment that finds nothing, a gate that fails, a missing key or a NaN in one seed of
    a study model: the claim is inconclusive and says why, never supported or not supported."""
    ms = calibrated()
    if how == "set_gate":  # the axis map finds the planes oblique in seeds 0 and 1
        agg = ms[model]["aggregate"]["axis_map"]
        agg["fraction_axis_aligned"] = mean_se([0.1, 0.2, 1.0, 1.0, 1.0])
    else:
        _break(ms, model, exp, how, keys)
    c = claim(evaluate_claims(ms), rule)
    assert c["verdict"] == INCONCLUSIVE, c["summary"]
    assert reason in c["summary"] and model in c["summary"]
    assert c["measured"][model]["measured"] < SEEDS
    m = c["primary"]["models"][model]
    nan = {i for i, v in enumerate(m["values"]) if not math.isfinite(v)}
    assert nan and nan == {int(k) for k in m["missing"]}  # NaN exactly where a reason is given


def test_a_broken_control_leaves_the_rule_uncalibrated() -> None:
    for rule, control, exp, keys in [
        ("rope_rebuilds", "rope_early", "windows", ["rebuild.relative"]),
        ("ape_explicit_features", "ape_cell", "sae_causal",
         [sae_key("early", "rowcol+error", "fixed_drop_out")]),
    ]:  # fmt: skip
        ms = calibrated()
        _break(ms, control, exp, "nan", keys)
        c = claim(evaluate_claims(ms), rule)
        assert c["verdict"] == INCONCLUSIVE and "not calibrated" in c["summary"]
        assert control in c["summary"]


def test_a_control_with_no_spread_does_not_count() -> None:
    """Five identical values (a zero by construction) are no test: a positive control with no
    spread leaves the rule uncalibrated; a negative one is degenerate (sensitivity only)."""
    ms = calibrated()
    ms["rope_rebuild"]["aggregate"]["windows"]["rebuild.relative"] = mean_se([0.5] * SEEDS)
    c = claim(evaluate_claims(ms), "rope_rebuilds")
    assert c["verdict"] == INCONCLUSIVE and "no spread" in c["summary"]
    ms = calibrated()
    ms["rope_early"]["aggregate"]["windows"]["rebuild.relative"] = mean_se([0.0] * SEEDS)
    c = claim(evaluate_claims(ms), "rope_rebuilds")
    assert c["calibration"]["sensitivity_only"] and c["verdict"] == SUPPORTED
    assert any("degenerate" in line for line in c["controls"])
