"""The original study's claims, each stated at two levels (the original's observation, then the
sharper test) and each level decided by a calibrated rule (study/claims/).

Per level: the primary effect per seed on each study model, measured or missing with its reason
(never a stand-in 0), the one-sided t-test of "the effect exceeds the rule's threshold" over the
measured seeds with its one-sided 95% bounds, and the same rule on its controls (mechanism present
/ absent by design). A level's study models and controls are one Holm family, judged at the same
level (an original level's negative controls are read by their upper bounds, outside it). The
verdict, in order:

- descriptive: a level that measures without claiming (its effect and interval only);
- inconclusive: a model with fewer than MIN_SEEDS measured seeds (which seeds, and why), a test
  with no spread, or a rule whose controls were not all measured;
- a sharper level (the mechanism): instrument failed calibration (a measured control did not come
  out as designed); supported (every study model's effect exceeds the threshold, Holm-corrected);
  not supported (not observed in these models: a study model's one-sided upper bound lies below
  the smallest effect the rule is known to detect, the smaller of the threshold and the positive
  controls' lower bounds);
- an original level (does the published observation reproduce here?): reproduces (every study
  model exceeds the threshold) or does not reproduce (every study model excluded, with its
  positive controls detected), each qualified "specific" where every negative control is shown
  below the threshold and "not specific" otherwise (a model built without the mechanism reads as
  much: a finding about the original's measure);
- otherwise inconclusive (no power), with the numbers and the seeds that would decide it.

The decided outcomes come from `replication.decide`, which also decides every replication draw;
one that fresh seed sets would not replicate (replication.STABLE), its qualifier included, reads
inconclusive (fragile). Every level states its threshold's source and
its power at the run's seeds (study/power.py). Every verdict names the models it describes (encoding, width, depth, heads, grid).
"""

from __future__ import annotations

import math
from typing import Any

from poslens.interventions import in_situ
from poslens.metrics.stats import holm, seed_test
from poslens.study.claims import EACH, LEVELS, ORIGINAL, RULES, Control, Rule, View
from poslens.study.config import StudyConfig
from poslens.study.confirmed import Confirmed
from poslens.study.confirmed import load as load_confirmations
from poslens.study.fingerprint import design, fingerprint_of
from poslens.study.judged import ALPHA, MIN_SEEDS, Judged
from poslens.study.power import Power, level_power
from poslens.study.reference import reference_check
from poslens.study.replication import (
    DRAWS,
    STABLE,
    Outcome,
    codes_of,
    in_holm,
    observed,
    replication,
)
from poslens.study.result import (
    Calibration,
    ClaimResult,
    ControlRow,
    Measured,
    Primary,
    Reference,
)
from poslens.study.verdicts import (
    DESCRIPTIVE,
    FAILED_CALIBRATION,
    INCONCLUSIVE,
    NOT_REPRODUCED,
    NOT_SPECIFIC,
    NOT_SUPPORTED,
    REPRODUCES,
    SPECIFIC,
    SUPPORTED,
    VERDICTS,
)
from poslens.study.wording import (
    confirmed_text,
    contradictions,
    control_line,
    control_notes,
    failed_text,
    fmt_test,
    fmt_values,
    no_power_text,
    not_observed_text,
    notes,
    scale_text,
    specificity_text,
    supported_text,
)

NO_POWER = "no power"  # the qualifier of an inconclusive verdict whose interval is too wide
# the qualifier of a verdict that would not replicate on a fresh seed set (replication.STABLE)
FRAGILE = "fragile"
PRETRAINED_CAVEAT = (
    "Pretrained weights: each model is one set of weights, so its seeds are analysis seeds (image "
    "subset, RPI permutation, probe split, random draws) and the interval measures analysis "
    "noise, not variation between trainings. No calibration models are trained in such a study: "
    "its controls are in situ, the studied weights edited to plant or remove each mechanism."
)

Models = dict[str, dict[str, Any]]
# the decision's constants, part of every level's design (study/fingerprint.py)
DECISION = {"alpha": ALPHA, "min_seeds": MIN_SEEDS, "stable": STABLE, "draws": DRAWS}


def level_design(rule: Rule, cfg: StudyConfig) -> dict[str, Any]:
    """The level's design as data: what its fingerprint hashes and the preregistration lists."""
    return design(rule, cfg, DECISION)


def level_fingerprint(rule: Rule, cfg: StudyConfig) -> str:
    """The fingerprint of the level's design under `cfg` (not of its seeds)."""
    return fingerprint_of(level_design(rule, cfg))


def _study_views(rule: Rule, views: dict[str, View], pretrained: bool) -> list[View]:
    if pretrained:  # every pretrained model of the rule's family (not its in-situ controls)
        return [v for v in views.values() if in_situ.split_name(v.model)[1] is None
                and rule.applies_to(v.family) and v.seeds(rule.experiment)]  # fmt: skip
    return [views[m] for m in rule.study if m in views and views[m].seeds(rule.experiment)]


def _judge(rule: Rule, v: View, role: str, control: Control | None = None) -> Judged:
    measure = control.effect if control is not None and control.effect else rule.effect
    eff = measure(v)
    if control is not None and control.model == EACH:
        name = f"{v.model}, {control.label}"
    else:
        name = control.name if control is not None and not control.in_situ else v.model
    return Judged(name, role, eff, seed_test(eff.values, rule.threshold, ALPHA),
                  design=control.design if control is not None else "")  # fmt: skip


def _controls(rule: Rule, views: dict[str, View], study: list[Judged]) -> list[Judged]:
    """The rule on each of its controls present in this study: the trained control models, the
    nulls inside each judged model, and each judged model under each in-situ edit
    ("ape~table_rowcol")."""
    out = []
    for c in rule.controls:
        if c.model == EACH:  # a null inside each judged model
            out += [_judge(rule, views[j.model], c.role, c) for j in study]
            continue
        if not c.in_situ:
            if c.model in views:
                out.append(_judge(rule, views[c.model], c.role, c))
            continue
        for j in study:
            name = in_situ.model_name(j.model, c.edit)
            if name in views and views[name].seeds(rule.experiment):
                out.append(_judge(rule, views[name], c.role, c))
    return out


def _seed_range(cfg: StudyConfig) -> tuple[int, int]:
    """The first and last seed any model of the study runs."""
    last = max(cfg.seeds_of(m)[-1] for m in cfg.model_keys)
    return cfg.seed_start, last


def evaluate_claims(
    models: Models,
    cfg: StudyConfig | None = None,
    confirmations: dict[str, Confirmed] | None = None,
) -> list[ClaimResult]:
    """Every claim level with its primary test per study model, calibration, verdict and the
    words, in rule order (each claim's original level first). `confirmations`: fingerprint ->
    the confirmation of that design (default: study/confirmed.json's); a level whose design was
    confirmed on other seeds than this run's reads its calibration from there."""
    pretrained = bool(cfg is not None and cfg.pretrained)
    confirmations = load_confirmations() if confirmations is None else confirmations
    views = {m: View(m, e) for m, e in models.items()}
    out = []
    for rule in RULES:
        study = [_judge(rule, v, "study") for v in _study_views(rule, views, pretrained)]
        controls = _controls(rule, views, study)
        fingerprint = None if cfg is None else level_fingerprint(rule, cfg)
        conf = None if fingerprint is None or pretrained else confirmations.get(fingerprint)
        if conf is not None and cfg is not None and conf.covers(*_seed_range(cfg)):
            conf = None  # the confirmation itself (or a part of it): it calibrates itself
        # one family per level: its study models and its controls, judged at the same level (an
        # original level's negative controls are read by their upper bounds, outside it); with a
        # confirmed design, its study models among themselves (its controls are shown beside)
        original = rule.level == ORIGINAL
        family = [j for j in (*study, *([] if conf else controls)) if in_holm(j.role, original)]
        for j in (*study, *controls):
            j.p_holm = j.test.p
        for j, p in zip(family, holm([j.test.p for j in family]), strict=True):
            j.p_holm = p
        out.append(_claim(rule, study, controls, pretrained, views, fingerprint, conf))
    return out


def _as_designed(rule: Rule, j: Judged) -> bool:
    """A positive control detected; a negative one not detected, or for an original level shown
    below the threshold (its specificity shown, not assumed)."""
    if j.role == "positive":
        return j.detected
    if rule.level == ORIGINAL:
        return not j.detected and j.test.upper < rule.threshold
    return not j.detected


def _calibration(rule: Rule, controls: list[Judged]) -> Calibration:
    """The rule on each control present: measured or not (and why), detected or not, and
    whether that is the designed outcome."""
    rows = []
    for j in controls:
        measured = j.problem is None
        rows.append(ControlRow(
            model=j.model, role=j.role, design=j.design, test=j.result(), detected=j.detected,
            enough_seeds=j.test.n >= MIN_SEEDS, measured=measured, degenerate=j.degenerate,
            not_measured=j.problem,
            seeds_above_threshold=sum(x > rule.threshold for x in j.test.values),
            as_designed=measured and _as_designed(rule, j),
        ))  # fmt: skip
    positives = [c for c in rows if c.role == "positive"]
    negatives = [c for c in rows if c.role == "negative"]
    # a degenerate negative control (nothing there to measure) shows nothing about specificity:
    # the rule then counts as calibrated for sensitivity only, and the claim says so
    counted = [c for c in negatives if c.measured]
    degenerate = [c for c in negatives if not c.measured and c.degenerate]
    aside = [j.model for j in controls if j.set_aside]
    complete = (bool(positives) and all(c.measured for c in positives) and bool(negatives)
                and len(counted) + len(degenerate) >= 1
                and len(counted) + len(degenerate) + len(aside) == len(negatives))  # fmt: skip
    return Calibration(
        controls=tuple(rows),
        sensitivity=sum(c.detected for c in positives) / len(positives) if positives else None,
        specificity=sum(c.as_designed for c in counted) / len(counted) if counted else None,
        complete=complete,
        sensitivity_only=complete and not counted,
        passed=complete and all(c.as_designed for c in [*positives, *counted]),
    )


def detectable(rule: Rule, controls: list[Judged]) -> float:
    """The smallest effect the rule is known to detect here: the smaller of its threshold and the
    one-sided lower bounds of the positive controls it detected."""
    lows = [j.test.lower for j in controls if j.role == "positive" and j.detected]
    return min([rule.threshold, *lows])


FAILED_CODE, SUPPORTED_CODE, NOT_SUPPORTED_CODE, NO_POWER_CODE = range(len(codes_of(False)))
# an original level's codes: each outcome specific, then not specific (replication.decide)
REPRODUCES_CODE, NOT_REPRODUCED_CODE = 0, 2


def _tests(study: list[Judged], controls: list[Judged]) -> list[Outcome]:
    """The level's family as replication.Outcome values (study models first)."""
    return [Outcome(j.role, j.test.values, j.problem is None, j.detected, j.test.lower, j.test.upper,
                    j.seeds, j.model, j.fixed) for j in [*study, *controls]]  # fmt: skip


def _decide_observed(rule: Rule, study: list[Judged], controls: list[Judged]) -> int:
    """The observed outcome (an index into codes_of(original)), by the same `decide` that decides
    each replication draw: over the tests that count (a degenerate negative control does not)."""
    return observed(_tests(study, controls), rule.threshold, rule.level == ORIGINAL)[0]


def _outcome(rule: Rule, code: int, study: list[Judged], controls: list[Judged],
             power: Power | None) -> tuple[str, str | None, str]:  # fmt: skip
    """The verdict, qualifier and summary of a decided level's observed outcome `code`."""
    floor = detectable(rule, controls)
    if rule.level == ORIGINAL:
        if code == len(codes_of(True)) - 1:
            return INCONCLUSIVE, NO_POWER, no_power_text(rule.threshold, study, floor, power,
                                                         controls)  # fmt: skip
        reproduces = code < NOT_REPRODUCED_CODE
        specific = code % 2 == 0
        summary = (supported_text(rule.threshold, study, True) if reproduces
                   else not_observed_text(study, floor, True))  # fmt: skip
        return ((REPRODUCES if reproduces else NOT_REPRODUCED),
                SPECIFIC if specific else NOT_SPECIFIC,
                summary + " " + specificity_text(controls, rule.threshold))  # fmt: skip
    if code == FAILED_CODE:
        return FAILED_CALIBRATION, None, failed_text(study, controls)
    if code == SUPPORTED_CODE:
        return SUPPORTED, None, supported_text(rule.threshold, study, False)
    if code == NOT_SUPPORTED_CODE:
        return NOT_SUPPORTED, None, not_observed_text(study, floor, False)
    return INCONCLUSIVE, NO_POWER, no_power_text(rule.threshold, study, floor, power, controls)


def _power(rule: Rule, study: list[Judged], controls: list[Judged], seeds: int) -> Power:
    """The level's power at the run's seeds, at the Holm family's strictest step."""
    original = rule.level == ORIGINAL
    family = sum(math.isfinite(j.test.p) and in_holm(j.role, original) and not j.fixed
                 for j in [*study, *controls])  # fmt: skip
    counted = [j.test.values for j in [*study, *controls] if j.problem is None]
    floor = detectable(rule, controls)
    undecided = {j.model: j.test.mean for j in study
                 if j.test.n and not j.detected and not j.test.upper < floor}  # fmt: skip
    return level_power(rule.threshold, floor, seeds, ALPHA / max(family, 1), counted, undecided)


def _claim(
    rule: Rule,
    study: list[Judged],
    controls: list[Judged],
    pretrained: bool,
    views: dict[str, View],
    fingerprint: str | None = None,
    conf: Confirmed | None = None,
) -> ClaimResult:
    cal = _calibration(rule, controls)
    # what calibrates the level: this run's controls, or the confirmation's (fixed)
    deciding = controls if conf is None else [c.judged(rule.threshold) for c in conf.controls]
    measured = {j.model: Measured(j.test.n, j.seeds, j.effect.reasons() or None, j.effect.gate)
                for j in study}  # fmt: skip
    evidence = [
        f"{j.model}: {rule.effect_name}: {fmt_test(j)}"
        + ("" if rule.descriptive else f" (threshold {rule.threshold:g})")
        for j in study
    ]
    described = [views[j.model] for j in study]
    scale = "; ".join(scale_text(v) for v in described) or "no model"
    caveats = [rule.by_construction] + ([PRETRAINED_CAVEAT] if pretrained else [])
    if pretrained and not cal.complete and rule.in_situ_gap:  # whatever the verdict says first
        caveats.append(f"Not calibrated on the studied model: {rule.in_situ_gap}.")
    aside = [j for j in controls if j.set_aside]
    if cal.complete and aside:
        caveats.append("Set aside: " + "; ".join(f"negative control {j.problem}" for j in aside)
                       + "; the level is calibrated on its other controls.")  # fmt: skip
    if cal.sensitivity_only:
        names = [c.model for c in cal.controls if c.role == "negative"]
        caveats.append(
            f"Calibrated for sensitivity only: the negative control ({', '.join(names)}) is "
            "degenerate (nothing there to measure by construction), so no model showed that the "
            "rule stays quiet where a signal is present but the mechanism is not."
        )
    problems = [j.problem for j in study if j.problem is not None]
    qualifier = None
    run_seeds = min((j.seeds for j in study), default=0)
    power = None if rule.descriptive or not study else _power(rule, study, deciding, run_seeds)
    if conf is not None:
        caveats += contradictions(rule, controls, conf)
    replicates = None
    if not study:
        verdict, summary = INCONCLUSIVE, f"No study model ran {rule.experiment} in this study."
    elif rule.descriptive:
        verdict = DESCRIPTIVE
        summary = "Descriptive (no verdict): " + "; ".join(
            f"{j.model} {fmt_values(list(j.effect.values))}" for j in study) + "."  # fmt: skip
    elif problems:
        verdict, summary = INCONCLUSIVE, "Not enough measured: " + "; ".join(problems) + "."
    elif conf is None and not cal.complete:
        missing = [c.not_measured for c in cal.controls
                   if not c.measured and not (c.role == "negative" and c.degenerate)]  # fmt: skip
        verdict = INCONCLUSIVE
        summary = (
            "The rule was not calibrated in this study: it needs a measured positive and negative "
            f"control with at least {MIN_SEEDS} seeds each"
            + (f" ({'; '.join(missing)})" if missing else " (none was run)")
            + (f"; {rule.in_situ_gap}" if rule.in_situ_gap else "")
            + "."
        )
    else:
        original = rule.level == ORIGINAL
        code = _decide_observed(rule, study, deciding)
        verdict, qualifier, summary = _outcome(rule, code, study, deciding, power)
        if conf is not None:
            summary += " " + confirmed_text(conf)
        tests = _tests(study, deciding)
        seeds = min(t.design for t in tests if not t.fixed)
        replicates = replication(tests, rule.threshold, ALPHA, seeds, rule.id, original)
        if qualifier != NO_POWER and not replicates.stable:
            summary = (f"Fragile: {codes_of(original)[code]} on this seed set, but "
                       f"{replicates.text()}. " + summary)  # fmt: skip
            verdict, qualifier = INCONCLUSIVE, FRAGILE
    summary += f" Describes {scale}."
    return ClaimResult(
        id=rule.id,
        claim=rule.claim,
        level=rule.level,
        level_name=LEVELS[rule.level],
        title=rule.title,
        statement=rule.statement,
        verdict=verdict,
        qualifier=qualifier,
        summary=summary,
        scale={v.model: v.scale for v in described},
        evidence=tuple(evidence),
        notes=tuple(notes(rule, described) + control_notes(rule, controls, views)),
        controls=tuple(control_line(j, rule.threshold, rule.level == ORIGINAL) for j in controls),
        caveats=tuple(caveats),
        models=tuple(j.model for j in study),
        seeds=min((j.test.n for j in study), default=0),
        measured=measured,
        threshold_source=rule.threshold_source,
        power=None if power is None else power.to_dict(),
        replication=None if replicates is None else replicates.to_dict(),
        primary=Primary(rule.effect_name, rule.threshold, {j.model: j.result() for j in study}),
        calibration=cal,
        would_change=rule.would_change,
        reference=Reference.from_dict(reference_check(rule), "reference"),
        fingerprint=fingerprint,
        confirmation=None if conf is None else conf.summary(),
    )


__all__ = ["ALPHA", "DECISION", "DESCRIPTIVE", "FAILED_CALIBRATION", "FRAGILE", "INCONCLUSIVE", "MIN_SEEDS", "NOT_SUPPORTED", "NO_POWER",
           "SUPPORTED", "VERDICTS", "detectable", "evaluate_claims", "level_design", "level_fingerprint"]  # fmt: skip
