"""Power before verdicts and replication: the minimum detectable effect is the noncentral-t one
(checked by simulation), seeds-to-decide is the smallest count that reaches it, every threshold
is a stated smallest effect of interest (never 0), the replication estimate is deterministic and
reads a borderline verdict as fragile, and the observed verdict and every replication draw are
decided by one function."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from scipy import stats as st

from poslens.metrics.stats import holm
from poslens.study.aggregate import mean_se
from poslens.study.claims import RULES
from poslens.study.judge import FRAGILE, INCONCLUSIVE, NO_POWER, SUPPORTED
from poslens.study.power import detectable_shift, level_power, pooled_sd, seeds_to_decide
from poslens.study.reference import CHECKS
from poslens.study.replication import (
    REPRODUCTION_CODES,
    STABLE,
    TURNS_ON,
    VERDICT_CODES,
    Outcome,
    Part,
    decide,
    fresh_draws,
    holm_rows,
    least_stable,
    replication,
)
from poslens.study.verdicts import NOT_SPECIFIC, REPRODUCES
from tests.study.test_claims import (
    calibrated,
    claim,
    entry,
    heads,
    jitter,
    judged,
    merge,
    split,
    windows,
)


@pytest.mark.parametrize(("sd", "n", "alpha"), [(0.1, 5, 0.05), (0.3, 8, 0.0125)])
def test_the_detectable_shift_is_detected_with_80_percent_power(
    sd: float, n: int, alpha: float
) -> None:
    shift = detectable_shift(sd, n, alpha)
    x = np.random.default_rng(0).normal(shift, sd, (100_000, n))
    t = x.mean(1) / (x.std(1, ddof=1) / math.sqrt(n))
    assert (t > st.t.ppf(1 - alpha, n - 1)).mean() == pytest.approx(0.8, abs=0.01)


def test_seeds_to_decide_is_the_first_count_that_reaches_the_gap() -> None:
    n = seeds_to_decide(0.3, 0.2, 0.1, 0.1, 0.0125)
    assert n is not None and n > 5
    assert detectable_shift(0.2, n, 0.0125) <= 0.2 < detectable_shift(0.2, n - 1, 0.0125)
    # below the threshold: the count that would put the upper bound under the detectable floor
    assert seeds_to_decide(-0.1, 0.2, 0.1, 0.1, 0.0125) == n
    assert seeds_to_decide(0.1, 0.2, 0.1, 0.1, 0.0125) is None  # on the line: never decided
    assert seeds_to_decide(0.3, 0.0, 0.1, 0.1, 0.0125) is None  # no spread: no power to compute


def test_pooled_sd_weighs_groups_by_their_degrees_of_freedom() -> None:
    sd, df = pooled_sd([[1.0, 3.0], [0.0, 0.0, 3.0], [5.0]])
    assert df == 3 and sd == pytest.approx(math.sqrt((2.0 + 6.0) / 3))
    p = level_power(0.1, 0.1, 5, 0.05, [[0.0, 0.2, 0.4, 0.1, 0.3]], {"m": 0.15})
    assert p.mde == pytest.approx(0.1 + detectable_shift(p.sd, 5, 0.05))
    assert p.seeds_needed == p.needed["m"] and "detects >= " in p.text()


def test_no_threshold_is_zero_and_each_names_its_source() -> None:
    for r in RULES:
        assert r.threshold_source, r.id
        if r.descriptive:
            continue
        assert r.threshold > 0, r.id
        effect, _, comparable = CHECKS[r.id]()
        if effect is not None and comparable:  # a threshold set from the original's number cites it
            assert f"{effect:.2f}" in r.threshold_source or f"{effect:.3g}" in r.threshold_source, (
                r.id
            )


def test_holm_rows_is_holm_on_each_row() -> None:
    p = np.random.default_rng(1).uniform(0, 0.2, (50, 6))
    adjusted = holm_rows(p)
    for row, got in zip(p, adjusted, strict=True):
        assert got.tolist() == pytest.approx(holm(row.tolist()))


def test_decide_orders_calibration_support_and_exclusion() -> None:
    roles = ["study", "positive", "negative"]
    detected = np.array([[True, True, False], [True, False, False], [False, True, True],
                         [False, True, False], [False, True, False]])  # fmt: skip
    lower = np.array([[0.5, 0.3, -1]] * 5)
    upper = np.array([[1, 1, 0], [1, 1, 0], [1, 1, 0], [0.05, 1, 0], [0.5, 1, 0]])
    codes, state = decide(0.1, roles, detected, lower, upper)
    assert [VERDICT_CODES[c] for c in codes] == [
        VERDICT_CODES[1],
        VERDICT_CODES[0],
        VERDICT_CODES[0],
        VERDICT_CODES[2],
        VERDICT_CODES[3],
    ]
    # each test's state: a study model below the floor is excluded (row 4), a negative control
    # below the threshold shown below, a positive never either
    assert state.tolist() == [[1, 1, 3], [1, 0, 3], [0, 1, 1], [2, 1, 3], [0, 1, 3]]
    # an original level: reproduces whatever its positive does (row 2), does not reproduce only
    # with its positive detected (row 4), each specific where the negative is shown below
    codes, _ = decide(0.1, roles, detected, lower, upper, original=True)
    assert [REPRODUCTION_CODES[c] for c in codes] == [
        "reproduces (specific)", "reproduces (specific)", "inconclusive (no power)",
        "does not reproduce (specific)", "inconclusive (no power)"]  # fmt: skip
    loud = upper.copy()
    loud[:, 2] = 0.3  # the negative is not detected, but not shown below either
    codes, state = decide(0.1, roles, detected, lower, loud, original=True)
    assert [REPRODUCTION_CODES[c] for c in codes[[0, 3]]] == [
        "reproduces (not specific)", "does not reproduce (not specific)"]  # fmt: skip
    assert state[0, 2] == 0
    no_negative, _ = decide(0.1, roles[:2], detected[:1, :2], lower[:1, :2], upper[:1, :2], True)
    assert REPRODUCTION_CODES[no_negative[0]] == "reproduces (not specific)"  # never assumed


def _level(study_mean: float, spread: float) -> list[Outcome]:
    vals = tuple(jitter(study_mean, 5, spread))
    return [Outcome("study", vals, True, True, min(vals), max(vals)),
            Outcome("positive", tuple(jitter(0.8, 5, 0.02)), True, True, 0.7, 0.9),
            Outcome("negative", tuple(jitter(-0.5, 5, 0.02)), True, False, -0.6, -0.4)]  # fmt: skip


def test_replication_is_deterministic_and_reads_a_borderline_verdict_as_unstable() -> None:
    clear = replication(_level(0.9, 0.02), 0.1, 0.05, 5, "x")
    assert clear.stable and clear.probability >= STABLE and clear.stable_at is None
    again = replication(_level(0.9, 0.02), 0.1, 0.05, 5, "x")
    assert again == clear
    border = replication(_level(0.3, 0.1), 0.1, 0.05, 5, "x")
    assert not border.stable and border.stable_at is not None and border.stable_at > 5
    assert border.stable_verdict == SUPPORTED
    # more seeds make the same true effect replicate more often
    few, many = (fresh_draws(_level(0.3, 0.1), 0.1, 0.05, n, "x").shares[1] for n in (5, 30))
    assert many > few


def test_a_fragile_verdict_names_the_test_it_turns_on() -> None:
    """A clear study model and negative with a positive near the line: the parts say that the
    positive's detection is what a fresh seed set may not repeat, and every verdict's share is
    bounded by the parts it needs."""
    vals = tuple(jitter(0.3, 5, 0.1))
    tests = [Outcome("study", tuple(jitter(0.9, 5, 0.02)), True, True, 0.88, 0.92, model="m"),
             Outcome("positive", vals, True, True, 0.15, 0.45, model="pos"),
             Outcome("negative", tuple(jitter(-0.5, 5, 0.02)), True, False, -0.52, -0.48,
                     model="neg")]  # fmt: skip
    rep = replication(tests, 0.1, 0.05, 5, "x")
    assert not rep.stable
    assert [(p.model, p.role, p.observed) for p in rep.parts] == [
        ("m", "study", "detected"), ("pos", "positive", "detected"),
        ("neg", "negative", "shown below")]  # fmt: skip
    share = {p.model: p.share for p in rep.parts}
    assert share["m"] >= TURNS_ON and share["neg"] >= TURNS_ON and share["pos"] < STABLE
    assert [p.model for p in rep.least_stable] == ["pos"]  # the others repeat on over 99%
    assert "least stable: positive pos (detected here; on " in rep.text()
    # supported needs every part as observed; a positive not detected fails calibration
    assert rep.shares[SUPPORTED] <= min(share.values())
    assert rep.shares[VERDICT_CODES[0]] >= 1 - share["pos"]
    assert rep.to_dict()["parts"][1] == {"model": "pos", "role": "positive",
                                         "observed": "detected", "share": share["pos"]}  # fmt: skip
    # several parts each above STABLE can make a verdict fragile together: they are named
    together = replace(rep, probability=0.89, parts=(
        Part("m", "study", "excluded", 1.0), Part("a", "positive", "detected", 0.96),
        Part("b", "positive", "detected", 0.94)))  # fmt: skip
    assert [p.model for p in together.least_stable] == ["b", "a"]
    assert "least stable: positive b (detected here; on 94% of fresh sets)" in together.text()
    # a stable verdict names nothing
    assert replication(_level(0.9, 0.02), 0.1, 0.05, 5, "x").least_stable == ()
    # results.json's parts read back into the same parts (what `poslens compare` ranks); a
    # malformed record is dropped, never ranked as a share of 0
    back = [Part.from_dict(p.to_dict()) for p in rep.parts]
    assert back == list(rep.parts)
    assert Part.from_dict({"model": "x"}) is None and Part.from_dict("x") is None
    assert least_stable(together.parts, most=1) == together.least_stable[:1]


def test_a_fragile_verdict_is_inconclusive_and_says_what_would_stabilise_it() -> None:
    ms = calibrated()
    # the split barely clears its threshold in rope_axial: supported on these seeds, not stably
    ms["rope_axial"] = entry("rope_axial", merge(split(0.55, 0.4), windows(0.8, 0.3),
                                                  heads(0.2, 0.0, 0.6)))  # fmt: skip
    ms["rope_axial"]["aggregate"]["position_removal"] = {
        **ms["rope_axial"]["aggregate"]["position_removal"]
    }
    c = claim(judged(ms), "rope_planes_split.original")
    rep = c["replication"]
    assert rep is not None and rep["shares"] and math.isclose(sum(rep["shares"].values()), 1.0)
    if rep["stable"]:  # the constructed numbers must sit near the line for this test to mean much
        pytest.fail(f"expected a borderline split, got {rep}")
    assert c["verdict"] == INCONCLUSIVE and c["qualifier"] == FRAGILE
    assert c["summary"].startswith("Fragile: ") and str(rep["seeds_for_stable"]) in c["summary"]
    # what it turns on: rope_axial's split near its threshold, named in the summary
    parts = {p["model"]: p for p in rep["parts"]}
    assert parts["rope_axial"]["role"] == "study" and parts["rope_axial"]["share"] < STABLE
    assert "least stable: study rope_axial (detected here" in c["summary"]


def test_every_claim_carries_power_threshold_source_and_replication() -> None:
    for c in judged(calibrated()):
        rule = next(r for r in RULES if r.id == c["id"])
        assert c["threshold_source"] == rule.threshold_source
        if rule.descriptive:
            assert c["power"] is None and c["replication"] is None
            continue
        assert c["power"]["mde"] > rule.threshold and c["power"]["seeds"] == 5
        want = REPRODUCES if rule.level == "original" else SUPPORTED
        assert c["replication"]["stable"] and c["verdict"] == want


def test_no_power_names_the_seeds_that_would_decide() -> None:
    ms = calibrated()
    line = next(r.threshold for r in RULES if r.id == "rope_rebuilds.sharper")
    ms["rope_axial"] = entry("rope_axial", windows(0.8, line + 0.03))
    ms["rope_mixed"] = entry("rope_mixed", windows(0.8, line + 0.03))
    c = claim(judged(ms), "rope_rebuilds.sharper")
    assert c["verdict"] == INCONCLUSIVE and c["qualifier"] == NO_POWER
    n = c["power"]["seeds_needed"]
    assert n is not None and n > 5 and f"--seeds {n}" in c["summary"]


def test_the_default_runs_each_experiment_on_what_the_claims_read() -> None:
    """The default preset's `only` is derived from the rules: every model a rule reads through an
    experiment runs it, and no other (the depth profile on the study models, for the report)."""
    from poslens.study import preset
    from poslens.study.claims import models_read
    from poslens.study.config import STUDY_MODELS

    cfg = preset("default")
    only = dict(item.split("=") for item in cfg.only)
    for exp, models in only.items():
        want = set(models_read(exp)) & set(cfg.models)
        if exp == "depth_profile":
            want |= set(STUDY_MODELS)
        assert set(models.split(",")) == want, exp
    assert only["sae_causal"] == "ape,ape_rowcol,ape_cell,ape_shuffled"


def test_the_calibration_record_and_the_verdict_agree() -> None:
    """results.json's calibration.passed and the verdict come from two readings of the same
    controls: a level whose controls came out against their design fails calibration, and only
    then (before the fragility check)."""
    ms = calibrated()
    ms["rope_axial"]["aggregate"]["heads"][hd_null_key()] = mean_se(jitter(0.15))
    seen = set()
    for c in judged(ms):
        if c["verdict"] == "descriptive" or not c["calibration"]["complete"]:
            continue
        if c["level"] == "original":  # a negative not shown below: not specific, not a failure
            loud = c["qualifier"] == NOT_SPECIFIC or "(not specific) on this" in c["summary"]
            assert loud == (not c["calibration"]["passed"]), c["id"]
            seen.add(loud)
            continue
        fragile = c["summary"].startswith("Fragile: instrument failed calibration")
        failed = c["verdict"] == "instrument failed calibration" or fragile
        assert failed == (not c["calibration"]["passed"]), c["id"]
    assert seen == {True, False}  # the heads null made one original level not specific


def hd_null_key() -> str:
    from poslens.experiments.heads import result as hd
    from poslens.study.claims.heads import UNITS

    return hd.held_out_key(UNITS, hd.NULL_EXCESS_ACCURACY)


def test_more_seeds_on_the_study_model_alone_decide_what_five_could_not() -> None:
    """study.model_seeds: the study model runs more seeds than its controls. The judge tests it
    over all of them (controls at 5 still count), power is computed at its count, and the
    no-power text names the --model-seeds that would decide it."""
    from poslens.experiments.heads import result as hd
    from poslens.study.claims.heads import UNITS
    from tests.study.test_claims import removal

    key = hd.held_out_key(UNITS, hd.EXCESS_ACCURACY)

    def with_excess(n: int, mean: float = 0.06) -> dict[str, dict[str, object]]:
        ms = calibrated()
        ms["rope_axial"] = entry("rope_axial", merge(split(1.0, 0.4, n=n), windows(0.8, 0.3, n),
                                 heads(0.2, -0.1, 0.6, n), removal(0.97, 0.17, n)), n)  # fmt: skip
        pattern = [mean + 0.04 * (((i * 7) % 5) - 2) / 2 for i in range(n)]  # mean +- 0.04
        ms["rope_axial"]["aggregate"]["heads"][str(key)] = mean_se(pattern)
        return ms

    few = claim(judged(with_excess(5, 0.05)), "heads_rebuild.original")
    assert few["verdict"] == INCONCLUSIVE and few["qualifier"] == NO_POWER
    n = few["power"]["needed"]["rope_axial"]
    assert 5 < n <= 15 and f"--model-seeds rope_axial={n} for that model alone" in few["summary"]
    few = claim(judged(with_excess(5)), "heads_rebuild.original")
    assert few["verdict"] == INCONCLUSIVE and few["qualifier"] == FRAGILE
    more = claim(judged(with_excess(15)), "heads_rebuild.original")
    assert more["seeds"] == 15 and more["power"]["seeds"] == 15
    assert more["measured"]["rope_axial"]["seeds"] == 15
    late = next(line for line in more["controls"] if "control rope_late" in line)
    assert "over 5 of 5 seeds measured" in late and "shown below 0.02 (specific)" in late
    assert more["verdict"] == REPRODUCES and more["replication"]["stable"]
    assert "fresh seed sets of the same sizes" in more["replication"]["text"]
    # a level judging several models redraws each at its own count: position's 5-seed models
    # are not redrawn at fewer seeds because rope_axial ran 15 (it read "fragile, 10%" before)
    position = claim(judged(with_excess(15)), "position_matters.original")
    assert position["verdict"] == REPRODUCES and position["replication"]["probability"] >= STABLE
