"""The words of a judged level: its tests, controls, secondary numbers and the summary of each
outcome. study/judge.py decides; this module only says what it decided, from the judged tests
(judged.Judged: a model's or control's per-seed effect, its test and whether it was detected)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from poslens.metrics.stats import seed_test
from poslens.study.claims import ORIGINAL, Rule, View
from poslens.study.confirmed import Confirmed
from poslens.study.judged import Judged
from poslens.study.power import MAX_SEEDS, POWER, Power
from poslens.study.verdicts import NOT_SPECIFIC

Tests = Sequence[Judged]
INTERVAL_ALPHA = 0.05  # secondary numbers' two-sided 95% intervals


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
    holm_p = "" if math.isnan(j.p_holm) or j.p_holm == t.p else f" (Holm {j.p_holm:.3g})"
    return (f"{t.mean:.2f}, one-sided 95% bounds >= {t.lower:.2f} and <= {t.upper:.2f}, {seeds}, "
            f"p = {t.p:.3g}{holm_p}")  # fmt: skip


def control_line(j: Judged, threshold: float, original: bool) -> str:
    """A control as the level reads it: detected or not (a sharper level's), or for an original
    level's negative control, shown below the threshold or not (its measure's specificity)."""
    head = f"{j.role} control {j.model} ({j.design}): {fmt_test(j)}"
    if j.problem is not None:
        kind = "degenerate, shows nothing about specificity" if j.degenerate else "does not count"
        return f"{head}: {kind} ({j.problem})"
    if original and j.role == "negative":
        below = j.test.upper < threshold
        return (f"{head}: {'shown' if below else 'not shown'} below {threshold:g} "
                f"({'specific' if below else 'NOT specific'})")  # fmt: skip
    outcome = "detected" if j.detected else "not detected"
    design = "as designed" if j.detected == (j.role == "positive") else "NOT as designed"
    return f"{head}: {outcome} ({design})"


def scale_text(v: View) -> str:
    """'rope_axial (rope_axial, width 32, depth 4, 4 heads, 6x6 grid)': what a verdict describes."""
    sc = v.scale
    if not sc:
        return f"{v.model} ({v.posenc})"
    return (f"{v.model} ({v.posenc}, width {sc['dim']}, depth {sc['depth']}, {sc['heads']} heads, "
            f"{sc['grid']}x{sc['grid']} grid)")  # fmt: skip


def fmt_values(values: list[float]) -> str:
    """'0.41 [0.30, 0.52] over 5 seeds' (two-sided 95% t-interval), or 'not measured'."""
    t = seed_test(values, 0.0, INTERVAL_ALPHA)
    if t.n == 0:
        return "not measured"
    if math.isnan(t.ci_low):
        return f"{t.mean:.3g} over {t.n} seed{'s' * (t.n > 1)}"
    return f"{t.mean:.3g} [{t.ci_low:.3g}, {t.ci_high:.3g}] over {t.n} seeds"


def notes(rule: Rule, views: list[View]) -> list[str]:
    """The rule's secondary numbers per study model, each with its interval over seeds."""
    return [f"{v.model}: {what}: {fmt_values(vals)}" for v in views for what, vals in rule.notes(v)]


def control_notes(rule: Rule, controls: Tests, views: dict[str, View]) -> list[str]:
    """The rule's control notes per control model (a model of the study's own: controls built
    inside each model, such as permuted heads, have none)."""
    return [f"{j.model} ({j.role} control): {what}: {fmt_values(vals)}"
            for j in controls if j.model in views
            for what, vals in rule.control_notes(views[j.model])]  # fmt: skip


def which(study: Tests) -> str:
    return ", ".join(f"{j.model} {j.test.mean:.2f}" for j in study)


def failed_text(study: Tests, controls: Tests) -> str:
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
            f"study models ({which(study)}) says nothing about them.")  # fmt: skip


def supported_text(threshold: float, study: Tests, original: bool) -> str:
    family = "models and positive controls" if original else "models and controls"
    head = "Reproduces: the" if original else "The"
    return (f"{head} effect exceeds {threshold:g} in every study model ({which(study)}), "
            f"Holm-corrected over this level's {family}.")  # fmt: skip


def not_observed_text(study: Tests, floor: float, original: bool) -> str:
    undetected = [j for j in study if not j.detected]
    head = "Does not reproduce" if original else "Not observed in these models"
    return (
        f"{head} ({', '.join(j.model for j in undetected)}: {which(study)}): the one-sided 95% "
        f"upper bound ({', '.join(f'{j.test.upper:.2f}' for j in undetected)}) lies below "
        f"{floor:.2f}, the smallest effect the rule is known to detect here."
    )


def specificity_text(controls: Tests, threshold: float) -> str:
    """An original level's qualifier in words: every counted negative control shown below the
    threshold (specific), or the ones that are not (a model built without the mechanism reads
    as much on this measure)."""
    counted = [j for j in controls if j.role == "negative" and j.problem is None]
    if not counted:
        return ("Specificity not shown: no negative control was measured, so the measure is read "
                "as not specific.")  # fmt: skip
    loud = [j for j in counted if not j.test.upper < threshold]
    if not loud:
        return (
            f"Specific: every negative control is shown below {threshold:g} ("
            + ", ".join(f"{j.model} <= {j.test.upper:.2f}" for j in counted)
            + ")."
        )
    return ("Not specific: "
            + "; ".join(f"{j.model} ({j.design}) reads {j.test.mean:.2f} (one-sided 95% upper "
                        f"bound {j.test.upper:.2f})" for j in loud)
            + f", not shown below {threshold:g}: a model built without the mechanism reads as "
            "much on this measure.")  # fmt: skip


def insensitive_text(controls: Tests) -> str:
    """Why an original level whose study models are excluded still does not read 'does not
    reproduce': a positive control was not detected."""
    missed = [j for j in controls if j.role == "positive" and not j.detected]
    return ("The study models are excluded, but the instrument did not detect its planted "
            "positive (" + ", ".join(f"{j.model} {j.test.mean:.2f}" for j in missed)
            + "), so their low effect may be the instrument's.")  # fmt: skip


def no_power_text(
    threshold: float, study: Tests, floor: float, power: Power | None, controls: Tests = ()
) -> str:
    undetected = [j for j in study if not j.detected]
    wide = [j for j in undetected if not j.test.upper < floor]
    narrow = [j for j in undetected if j.test.upper < floor]
    if not wide:  # every study model excluded: what is missing is the positive's detection
        return "No power: " + insensitive_text(controls)

    def bounds(js: Tests) -> str:
        return ", ".join(f"{j.model} {j.test.upper:.2f}" for j in js)

    out = (
        f"No power: the effect does not clearly exceed {threshold:g} in "
        f"{', '.join(j.model for j in undetected)} ({which(study)}), and the one-sided 95% upper "
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


def confirmed_text(conf: Confirmed) -> str:
    """Where the level's calibration came from when its design was confirmed elsewhere."""
    return (f"Calibrated by the confirmation of this design ({conf.seeds} seeds, "
            f"{conf.first_seed}-{conf.last_seed}: {conf.text()}): its controls are taken as "
            "established and this run's study models are tested among themselves.")  # fmt: skip


def contradictions(rule: Rule, controls: Tests, conf: Confirmed) -> list[str]:
    """This run's own controls that contradict the confirmation of its design: a positive shown
    below the threshold, a negative detected above it (an original level's: shown above it where
    the confirmation found the measure specific). Empty where none does."""
    specific = conf.qualifier != NOT_SPECIFIC
    out = []
    for j in controls:
        if j.problem is not None:
            continue
        t = j.test
        if j.role == "positive" and t.upper < rule.threshold:
            out.append(f"{j.model} (positive) reads {t.mean:.2f}, upper bound {t.upper:.2f} below "
                       f"{rule.threshold:g}")  # fmt: skip
        elif j.role == "negative" and rule.level != ORIGINAL and t.p < INTERVAL_ALPHA:
            out.append(f"{j.model} (negative) detected above {rule.threshold:g} at "
                       f"{t.mean:.2f}")  # fmt: skip
        elif (
            j.role == "negative"
            and rule.level == ORIGINAL
            and specific
            and t.lower > rule.threshold
        ):
            out.append(f"{j.model} (negative) reads {t.mean:.2f}, lower bound {t.lower:.2f} above "
                       f"{rule.threshold:g}")  # fmt: skip
    if not out:
        return []
    return ["Contradicts the confirmation of this design: " + "; ".join(out) + ". This run's "
            "controls came out against what the confirmation established; its verdict reads "
            "the confirmation's calibration all the same."]  # fmt: skip


__all__ = [
    "confirmed_text",
    "contradictions",
    "control_line",
    "control_notes",
    "failed_text",
    "fmt_test",
    "fmt_values",
    "no_power_text",
    "not_observed_text",
    "notes",
    "scale_text",
    "specificity_text",
    "supported_text",
    "which",
]
