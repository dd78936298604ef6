"""The original study's claims, each decided by a calibrated rule (study/rules.py).

Per claim: the primary effect per training seed on each study model, its 95% t-interval over
seeds and one-sided p-value against the rule's threshold, Holm-corrected across every claim's
primary tests; the same rule on the calibration models (mechanism present / absent by design).
A verdict needs at least MIN_SEEDS seeds per model and a rule that detected every positive
control and rejected every negative one; otherwise it says why not.
"""

from __future__ import annotations

import math
from typing import Any

from poslens.metrics.stats import SeedTest, holm, seed_test
from poslens.study.config import StudyConfig
from poslens.study.reference import reference_check
from poslens.study.rules import RULES, Rule, View
from poslens.study.verdicts import (
    FAILED_CALIBRATION,
    INCONCLUSIVE,
    NOT_SUPPORTED,
    SUPPORTED,
    VERDICTS,
)

MIN_SEEDS = 5  # a verdict (and a calibration result) needs at least this many training seeds
ALPHA = 0.05
PRETRAINED_CAVEAT = (
    "Pretrained weights: each model is one set of weights, so its seeds are analysis seeds (image "
    "subset, RPI permutation, probe split, random draws) and the interval measures analysis "
    "noise, not variation between trainings; no calibration models are trained in such a study."
)

Models = dict[str, dict[str, Any]]


def _test_dict(t: SeedTest) -> dict[str, Any]:
    return {"n": t.n, "mean": t.mean, "ci": [t.ci_low, t.ci_high], "p": t.p,
            "values": list(t.values)}  # fmt: skip


def fmt_test(t: SeedTest) -> str:
    """'0.41 [0.30, 0.50] over 5 seeds, p = 0.007'."""
    if t.n == 0:
        return "not measured"
    ci = "" if math.isnan(t.ci_low) else f" [{t.ci_low:.2f}, {t.ci_high:.2f}]"
    return f"{t.mean:.2f}{ci} over {t.n} seed{'s' * (t.n != 1)}, p = {t.p:.3g}"


def _calibration(rule: Rule, views: dict[str, View]) -> dict[str, Any]:
    """The rule on each control present: detected (p < ALPHA with enough seeds) or not, and
    whether that is the designed outcome."""
    controls = []
    for role, names in (("positive", rule.positive), ("negative", rule.negative)):
        for name in names:
            if name not in views:
                continue
            t = seed_test(rule.effect(views[name]), rule.threshold)
            enough = t.n >= MIN_SEEDS
            detected = enough and t.p < ALPHA
            per_seed = sum(x > rule.threshold for x in t.values)
            controls.append({
                "model": name, "role": role, "test": _test_dict(t), "detected": detected,
                "enough_seeds": enough, "seeds_above_threshold": per_seed,
                "as_designed": enough and detected == (role == "positive"),
            })  # fmt: skip
    positives = [c for c in controls if c["role"] == "positive"]
    negatives = [c for c in controls if c["role"] == "negative"]
    return {
        "controls": controls,
        "sensitivity": sum(c["detected"] for c in positives) / len(positives)
        if positives
        else None,
        "specificity": sum(not c["detected"] for c in negatives) / len(negatives)
        if negatives
        else None,
        "complete": bool(positives and negatives) and all(c["enough_seeds"] for c in controls),
        "passed": bool(positives and negatives) and all(c["as_designed"] for c in controls),
    }


def _study_views(rule: Rule, views: dict[str, View], pretrained: bool) -> list[View]:
    if pretrained:
        return [
            v for v in views.values() if rule.applies_to(v.family) and v.seeds(rule.experiment)
        ]
    return [views[m] for m in rule.study if m in views and views[m].seeds(rule.experiment)]


def _cal_line(c: dict[str, Any], rule: Rule) -> str:
    t = SeedTest(tuple(c["test"]["values"]), rule.threshold, c["test"]["mean"],
                 *c["test"]["ci"], c["test"]["p"])  # fmt: skip
    outcome = "detected" if c["detected"] else "not detected"
    design = "as designed" if c["as_designed"] else "NOT as designed"
    return f"{c['role']} control {c['model']}: {fmt_test(t)}: {outcome} ({design})"


def evaluate_claims(models: Models, cfg: StudyConfig | None = None) -> list[dict[str, Any]]:
    """Every claim with its primary test per study model, calibration, verdict and the words."""
    pretrained = bool(cfg is not None and cfg.pretrained)
    views = {m: View(m, e) for m, e in models.items()}
    claims, family = [], []  # family: (claim index, model, p) of every primary test, for Holm
    for rule in RULES:
        study = _study_views(rule, views, pretrained)
        tests = {v.model: seed_test(rule.effect(v), rule.threshold) for v in study}
        cal = _calibration(rule, views)
        claims.append({"rule": rule, "tests": tests, "calibration": cal})
        family += [(len(claims) - 1, m, t.p) for m, t in tests.items()]
    adjusted = holm([p for *_, p in family]) if family else []
    p_holm: dict[tuple[int, str], float] = {
        (i, m): a for (i, m, _), a in zip(family, adjusted, strict=True)
    }
    return [
        _claim(c["rule"], c["tests"], c["calibration"], p_holm, i, pretrained)
        for i, c in enumerate(claims)
    ]


def _claim(
    rule: Rule,
    tests: dict[str, SeedTest],
    cal: dict[str, Any],
    p_holm: dict[tuple[int, str], float],
    index: int,
    pretrained: bool,
) -> dict[str, Any]:
    seeds = min((t.n for t in tests.values()), default=0)
    primary = {
        m: _test_dict(t) | {"p_holm": p_holm[index, m], "detected": p_holm[index, m] < ALPHA}
        for m, t in tests.items()
    }
    evidence = [
        f"{m}: {rule.effect_name}: {fmt_test(t)} (threshold {rule.threshold:g}; Holm-corrected "
        f"p = {p_holm[index, m]:.3g})"
        for m, t in tests.items()
    ]
    controls = [_cal_line(c, rule) for c in cal["controls"]]
    caveats = [rule.by_construction] + ([PRETRAINED_CAVEAT] if pretrained else [])
    if not tests:
        verdict, summary = INCONCLUSIVE, f"No study model ran {rule.experiment} in this study."
    elif all(t.n == 0 for t in tests.values()):
        verdict = INCONCLUSIVE
        summary = (
            f"The primary effect could not be computed on {', '.join(tests)}: no seed gave a "
            "finite value (a backbone without classifier head has no accuracy or margin)."
        )
    elif seeds < MIN_SEEDS:
        verdict = INCONCLUSIVE
        summary = f"Only {seeds} seed(s): a verdict needs at least {MIN_SEEDS} per model."
    elif not cal["controls"] or not cal["complete"]:
        verdict = INCONCLUSIVE
        summary = (
            "The rule was not calibrated in this study (it needs a positive and a negative "
            f"control model with at least {MIN_SEEDS} seeds each)."
        )
    elif not cal["passed"]:
        verdict = FAILED_CALIBRATION
        wrong = [c["model"] for c in cal["controls"] if not c["as_designed"]]
        summary = (
            f"The rule did not behave as designed on {', '.join(wrong)}, so its answer on the "
            "study models says nothing about them."
        )
    else:
        detected = [m for m in tests if primary[m]["detected"]]
        verdict = SUPPORTED if len(detected) == len(tests) else NOT_SUPPORTED
        which = ", ".join(f"{m} {t.mean:.2f}" for m, t in tests.items())
        summary = (
            f"The effect exceeds {rule.threshold:g} in every study model ({which}), "
            "Holm-corrected across the claims."
            if verdict == SUPPORTED
            else f"The effect does not clearly exceed {rule.threshold:g} in "
            f"{', '.join(m for m in tests if m not in detected)} ({which})."
        )
    return {
        "id": rule.id,
        "title": rule.title,
        "verdict": verdict,
        "summary": summary,
        "evidence": evidence,
        "controls": controls,
        "caveats": caveats,
        "models": list(tests),
        "seeds": seeds,
        "primary": {"effect": rule.effect_name, "threshold": rule.threshold, "models": primary},
        "calibration": cal,
        "would_change": rule.would_change,
        "reference": reference_check(rule),
    }


__all__ = ["FAILED_CALIBRATION", "INCONCLUSIVE", "MIN_SEEDS", "NOT_SUPPORTED", "SUPPORTED",
           "VERDICTS", "evaluate_claims"]  # fmt: skip
