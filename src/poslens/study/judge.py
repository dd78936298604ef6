"""The original study's claims, each stated at two levels (the original's observation, then the
sharper test) and each level decided by a calibrated rule (study/claims/).

Per level: the primary effect per seed on each study model, measured or missing with its reason
(never a stand-in 0), the one-sided t-test of "the effect exceeds the rule's threshold" over the
measured seeds with its one-sided 95% bounds, and the same rule on its controls (mechanism present
/ absent by design). A level's study models and controls are one Holm family, judged at the same
level. The verdict, in order:

- descriptive: a level that measures without claiming (its effect and interval only);
- inconclusive: a model with fewer than MIN_SEEDS measured seeds (which seeds, and why), a test
  with no spread, or a rule whose controls were not all measured;
- instrument failed calibration: a measured control did not come out as designed;
- supported: every study model's effect exceeds the threshold (Holm-corrected);
- not supported (not observed in these models): a study model's one-sided upper bound lies below
  the smallest effect the rule is known to detect (the smaller of the threshold and the positive
  controls' lower bounds);
- otherwise inconclusive (no power), with the numbers and the seeds that would decide it.

The last four come from `replication.decide`, which also decides every replication draw; a
supported, not supported or failed-calibration verdict that fresh seed sets would not replicate
(replication.STABLE) reads inconclusive (fragile). Every level states its threshold's source and
its power at the run's seeds (study/power.py). Every verdict names the models it describes (encoding, width, depth, heads, grid).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from poslens.interventions import in_situ
from poslens.metrics.stats import SeedTest, holm, seed_test
from poslens.study.claims import EACH, LEVELS, RULES, Control, Effect, Rule, View
from poslens.study.config import StudyConfig
from poslens.study.fingerprint import design, fingerprint_of
from poslens.study.power import MAX_SEEDS, POWER, Power, level_power
from poslens.study.reference import reference_check
from poslens.study.replication import DRAWS, STABLE, VERDICT_CODES, Outcome, observed, replication
from poslens.study.result import (
    Calibration,
    ClaimResult,
    ControlRow,
    EffectTest,
    Measured,
    Primary,
    Reference,
)
from poslens.study.verdicts import (
    DESCRIPTIVE,
    FAILED_CALIBRATION,
    INCONCLUSIVE,
    NOT_SUPPORTED,
    SUPPORTED,
    VERDICTS,
)

MIN_SEEDS = 5  # a verdict (and a calibration result) needs at least this many measured seeds
ALPHA = 0.05
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


@dataclass
class Judged:
    """One rule on one model: the per-seed effect, its test and (once the family is known) the
    Holm-corrected p-value."""

    model: str  # the model, or a control's label ("rope_axial, random head")
    role: str  # "study", "positive" or "negative"
    effect: Effect
    test: SeedTest
    p_holm: float = math.nan
    design: str = ""  # a control's design, in a phrase

    @property
    def seeds(self) -> int:
        return len(self.effect.values)

    @property
    def problem(self) -> str | None:
        """Why this test cannot count (None: it can): too few measured seeds, or no spread."""
        if self.test.n < MIN_SEEDS:
            why = self.effect.reasons() or (
                "no seed ran the experiment"
                if self.test.n < self.seeds
                else f"the study ran {self.seeds} seed{'s' * (self.seeds != 1)}"
            )
            return (f"{self.model}: {self.test.n} of {self.seeds} seeds measured, a verdict needs "
                    f"{MIN_SEEDS} ({why})")  # fmt: skip
        if self.test.no_spread:
            return (f"{self.model}: every measured seed gives {self.test.mean:.3g}, so there is no "
                    "spread to test against (a value fixed by construction)")  # fmt: skip
        return None

    @property
    def degenerate(self) -> bool:
        """Nothing there to measure by construction: every value equal (no spread), or every seed
        empty (no latents, a closed gate, no variance). Such a control cannot show specificity."""
        e = self.effect
        return self.test.no_spread or (self.seeds >= MIN_SEEDS and len(e.empty) == self.seeds)

    @property
    def set_aside(self) -> bool:
        """A negative control with too few measured seeds only because the others had nothing to
        measure by construction (every missing seed empty: e.g. an edit that removes row/column
        structure leaves an SAE no row or column latents): it does not count, and unlike a
        control broken by a failed measurement it does not leave the rule uncalibrated when
        another negative control counts."""
        e = self.effect
        return (self.role == "negative" and self.problem is not None and not self.degenerate
                and bool(e.missing) and set(e.missing) <= e.empty)  # fmt: skip

    @property
    def detected(self) -> bool:
        return self.problem is None and self.p_holm < ALPHA

    def result(self) -> EffectTest:
        t = self.test
        return EffectTest(n=t.n, seeds=self.seeds, mean=t.mean, ci=(t.ci_low, t.ci_high),
                          lower=t.lower, upper=t.upper, p=t.p, p_holm=self.p_holm,
                          values=tuple(self.effect.values),
                          missing={str(s): why for s, why in sorted(self.effect.missing.items())},
                          gate=self.effect.gate, detected=self.detected)  # fmt: skip


def fmt_test(j: Judged) -> str:
    """'0.41, one-sided 95% bound >= 0.30, over 5 of 5 seeds, p = 0.007 (Holm 0.03)'."""
    t = j.test
    if t.n == 0:
        return f"not measured ({j.effect.reasons() or 'the experiment did not run'})"
    seeds = f"over {t.n} of {j.seeds} seeds measured"
    if j.effect.missing:
        seeds += f" ({j.effect.reasons()})"
    if math.isnan(t.p):
        return f"{t.mean:.2f} {seeds}; no test ({'no spread' if t.no_spread else 'one seed'})"
    holm_p = "" if math.isnan(j.p_holm) else f" (Holm {j.p_holm:.3g})"
    return (f"{t.mean:.2f}, one-sided 95% bounds >= {t.lower:.2f} and <= {t.upper:.2f}, {seeds}, "
            f"p = {t.p:.3g}{holm_p}")  # fmt: skip


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


def evaluate_claims(models: Models, cfg: StudyConfig | None = None) -> list[ClaimResult]:
    """Every claim level with its primary test per study model, calibration, verdict and the
    words, in rule order (each claim's original level first)."""
    pretrained = bool(cfg is not None and cfg.pretrained)
    views = {m: View(m, e) for m, e in models.items()}
    out = []
    for rule in RULES:
        study = [_judge(rule, v, "study") for v in _study_views(rule, views, pretrained)]
        controls = _controls(rule, views, study)
        # one family per level: its study models and its controls, judged at the same level
        family = [*study, *controls]
        for j, p in zip(family, holm([j.test.p for j in family]), strict=True):
            j.p_holm = p
        fingerprint = None if cfg is None else level_fingerprint(rule, cfg)
        out.append(_claim(rule, study, controls, pretrained, views, fingerprint))
    return out


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
            as_designed=measured and j.detected == (j.role == "positive"),
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
        specificity=sum(not c.detected for c in counted) / len(counted) if counted else None,
        complete=complete,
        sensitivity_only=complete and not counted,
        passed=complete and all(c.as_designed for c in [*positives, *counted]),
    )


def _cal_line(j: Judged) -> str:
    if j.problem is not None:
        kind = "degenerate, shows nothing about specificity" if j.degenerate else "does not count"
        return f"{j.role} control {j.model} ({j.design}): {fmt_test(j)}: {kind} ({j.problem})"
    outcome = "detected" if j.detected else "not detected"
    design = "as designed" if j.detected == (j.role == "positive") else "NOT as designed"
    return f"{j.role} control {j.model} ({j.design}): {fmt_test(j)}: {outcome} ({design})"


def detectable(rule: Rule, controls: list[Judged]) -> float:
    """The smallest effect the rule is known to detect here: the smaller of its threshold and the
    one-sided lower bounds of the positive controls it detected."""
    lows = [j.test.lower for j in controls if j.role == "positive" and j.detected]
    return min([rule.threshold, *lows])


def scale_text(v: View) -> str:
    """'rope_axial (rope_axial, width 32, depth 4, 4 heads, 6x6 grid)': what a verdict describes."""
    sc = v.scale
    if not sc:
        return f"{v.model} ({v.posenc})"
    return (f"{v.model} ({v.posenc}, width {sc['dim']}, depth {sc['depth']}, {sc['heads']} heads, "
            f"{sc['grid']}x{sc['grid']} grid)")  # fmt: skip


def fmt_values(values: list[float]) -> str:
    """'0.41 [0.30, 0.52] over 5 seeds' (two-sided 95% t-interval), or 'not measured'."""
    t = seed_test(values, 0.0, ALPHA)
    if t.n == 0:
        return "not measured"
    if math.isnan(t.ci_low):
        return f"{t.mean:.3g} over {t.n} seed{'s' * (t.n > 1)}"
    return f"{t.mean:.3g} [{t.ci_low:.3g}, {t.ci_high:.3g}] over {t.n} seeds"


def _notes(rule: Rule, views: list[View]) -> list[str]:
    """The rule's secondary numbers per study model, each with its interval over seeds."""
    return [f"{v.model}: {what}: {fmt_values(vals)}" for v in views for what, vals in rule.notes(v)]


def _control_notes(rule: Rule, controls: list[Judged], views: dict[str, View]) -> list[str]:
    """The rule's control notes per control model (a model of the study's own: controls built
    inside each model, such as permuted heads, have none)."""
    return [f"{j.model} ({j.role} control): {what}: {fmt_values(vals)}"
            for j in controls if j.model in views
            for what, vals in rule.control_notes(views[j.model])]  # fmt: skip


FAILED_CODE, SUPPORTED_CODE, NOT_SUPPORTED_CODE, NO_POWER_CODE = range(len(VERDICT_CODES))


def _tests(study: list[Judged], controls: list[Judged]) -> list[Outcome]:
    """The level's family as replication.Outcome values (study models first)."""
    return [Outcome(j.role, j.test.values, j.problem is None, j.detected, j.test.lower, j.test.upper,
                    j.seeds, j.model) for j in [*study, *controls]]  # fmt: skip


def _decide_observed(rule: Rule, study: list[Judged], controls: list[Judged]) -> int:
    """The observed verdict (an index into VERDICT_CODES), by the same `decide` that decides each
    replication draw: over the tests that count (a degenerate negative control does not)."""
    return observed(_tests(study, controls), rule.threshold)[0]


def _power(rule: Rule, study: list[Judged], controls: list[Judged], seeds: int) -> Power:
    """The level's power at the run's seeds, at the Holm family's strictest step."""
    family = sum(math.isfinite(j.test.p) for j in [*study, *controls])
    counted = [j.test.values for j in [*study, *controls] if j.problem is None]
    floor = detectable(rule, controls)
    undecided = {j.model: j.test.mean for j in study
                 if j.test.n and not j.detected and not j.test.upper < floor}  # fmt: skip
    return level_power(rule.threshold, floor, seeds, ALPHA / max(family, 1), counted, undecided)


def _which(study: list[Judged]) -> str:
    return ", ".join(f"{j.model} {j.test.mean:.2f}" for j in study)


def _failed_text(study: list[Judged], controls: list[Judged]) -> str:
    """The controls that counted and came out against their design (a degenerate negative
    control does not count, so it cannot fail)."""
    wrong = [j for j in controls if (j.role == "positive" or j.problem is None)
             and j.detected != (j.role == "positive")]  # fmt: skip
    how = "; ".join(
        f"{j.model} ({j.role} control) {'not ' * (j.role == 'positive')}detected: "
        f"{j.test.mean:.2f}, one-sided 95% bounds {j.test.lower:.2f} to {j.test.upper:.2f}"
        for j in wrong
    )
    return (f"The rule did not behave as designed on its controls ({how}), so its answer on the "
            f"study models ({_which(study)}) says nothing about them.")  # fmt: skip


def _not_observed_text(rule: Rule, study: list[Judged], controls: list[Judged]) -> str:
    undetected = [j for j in study if not j.detected]
    return (
        f"Not observed in these models ({', '.join(j.model for j in undetected)}: "
        f"{_which(study)}): the one-sided 95% upper bound "
        f"({', '.join(f'{j.test.upper:.2f}' for j in undetected)}) lies below "
        f"{detectable(rule, controls):.2f}, the smallest effect the rule is known to detect here."
    )


def _no_power_text(
    rule: Rule, study: list[Judged], controls: list[Judged], power: Power | None
) -> str:
    floor = detectable(rule, controls)
    undetected = [j for j in study if not j.detected]
    wide = [j for j in undetected if not j.test.upper < floor]
    narrow = [j for j in undetected if j.test.upper < floor]

    def bounds(js: list[Judged]) -> str:
        return ", ".join(f"{j.model} {j.test.upper:.2f}" for j in js)

    out = (
        f"No power: the effect does not clearly exceed {rule.threshold:g} in "
        f"{', '.join(j.model for j in undetected)} ({_which(study)}), and the one-sided 95% upper "
        f"bound ({bounds(wide)}) does not exclude {floor:.2f}, the smallest effect the "
        "rule is known to detect here"
        + (f" (it does for {bounds(narrow)})" if narrow else "")
        + "."
    )
    if power is not None and power.seeds_needed is not None:
        n = power.seeds_needed
        own = ",".join(f"{m}={k}" for m, k in power.needed.items())
        out += (f" At the observed effect and spread, {n} seeds would decide it with "
                f"{POWER:.0%} power (--seeds {n}, or --model-seeds {own} for "
                f"{'that model' if len(power.needed) == 1 else 'those models'} alone).")  # fmt: skip
    elif power is not None and power.needed:
        out += (" No seed count up to "
                f"{MAX_SEEDS} would decide it: the effect sits on the threshold.")  # fmt: skip
    return out


def _claim(
    rule: Rule,
    study: list[Judged],
    controls: list[Judged],
    pretrained: bool,
    views: dict[str, View],
    fingerprint: str | None = None,
) -> ClaimResult:
    cal = _calibration(rule, controls)
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
    power = None if rule.descriptive or not study else _power(rule, study, controls, run_seeds)
    replicates = None
    if not study:
        verdict, summary = INCONCLUSIVE, f"No study model ran {rule.experiment} in this study."
    elif rule.descriptive:
        verdict = DESCRIPTIVE
        summary = "Descriptive (no verdict): " + "; ".join(
            f"{j.model} {fmt_values(list(j.effect.values))}" for j in study) + "."  # fmt: skip
    elif problems:
        verdict, summary = INCONCLUSIVE, "Not enough measured: " + "; ".join(problems) + "."
    elif not cal.complete:
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
        code = _decide_observed(rule, study, controls)
        if code == FAILED_CODE:
            verdict, summary = FAILED_CALIBRATION, _failed_text(study, controls)
        elif code == SUPPORTED_CODE:
            verdict = SUPPORTED
            summary = (f"The effect exceeds {rule.threshold:g} in every study model "
                       f"({_which(study)}), Holm-corrected over this level's models and "
                       "controls.")  # fmt: skip
        elif code == NOT_SUPPORTED_CODE:
            verdict, summary = NOT_SUPPORTED, _not_observed_text(rule, study, controls)
        else:
            verdict, qualifier = INCONCLUSIVE, NO_POWER
            summary = _no_power_text(rule, study, controls, power)
        tests = _tests(study, controls)
        replicates = replication(tests, rule.threshold, ALPHA, min(t.design for t in tests),
                                 rule.id)  # fmt: skip
        if code != NO_POWER_CODE and not replicates.stable:
            summary = (f"Fragile: {VERDICT_CODES[code]} on this seed set, but {replicates.text()}. "
                       + summary)  # fmt: skip
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
        notes=tuple(_notes(rule, described) + _control_notes(rule, controls, views)),
        controls=tuple(_cal_line(j) for j in controls),
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
    )


__all__ = ["ALPHA", "DECISION", "DESCRIPTIVE", "FAILED_CALIBRATION", "FRAGILE", "INCONCLUSIVE", "MIN_SEEDS", "NOT_SUPPORTED", "NO_POWER",
           "SUPPORTED", "VERDICTS", "detectable", "evaluate_claims", "level_design", "level_fingerprint"]  # fmt: skip
