"""The claims as both reports show them: verdict labels, the claims table's cells, each level's
detail sections (threshold, power, replication among them) and the calibration table."""

from __future__ import annotations

from collections.abc import Sequence

from poslens.report.format import NONE, fmt_num, fmt_value
from poslens.study.result import ClaimResult
from poslens.study.verdicts import NOT_COMPARABLE, VERDICTS


def verdict_counts(claims: Sequence[ClaimResult]) -> dict[str, int]:
    """How many claim levels got each verdict (the known ones always present)."""
    counts = dict.fromkeys(VERDICTS, 0)
    for cl in claims:
        counts[cl.verdict] = counts.get(cl.verdict, 0) + 1
    return counts


def verdict_text(verdict: str | None, qualifier: str | None) -> str:
    """A verdict as printed: 'inconclusive (no power)' where there is a qualifier."""
    text = "no verdict" if verdict is None else str(verdict)
    return f"{text} ({qualifier})" if qualifier else text


def verdict_label(cl: ClaimResult) -> str:
    """The claim's verdict as printed, with its qualifier where it names one."""
    return verdict_text(cl.verdict, cl.qualifier)


def measured_cell(cl: ClaimResult) -> str:
    """Per study model, its measured seeds of those run: 'ape 4 of 5, rope_axial 5 of 5'
    (results without that record list the models)."""
    if not cl.measured:
        return fmt_value(list(cl.models))
    return ", ".join(
        f"{m} {fmt_value(x.measured)} of {fmt_value(x.seeds)}" for m, x in cl.measured.items()
    )


def claim_heading(cl: ClaimResult) -> str:
    """'APE: position lives in ...: the original's observation' (the title alone without levels)."""
    return f"{cl.title}: {cl.level_name}" if cl.level_name else cl.title


def reference_cell(cl: ClaimResult) -> str:
    """The original's verdict on this level and the rule's on the original's published numbers."""
    ref = cl.reference
    orig = str(ref.original_verdict)
    got = ref.rule_verdict
    if got is None or got == NOT_COMPARABLE or ref.comparable is False:
        return orig
    value = f" at {fmt_num(float(ref.effect))}" if ref.effect is not None else ""
    return f"{orig}; the rule on its numbers: {got}{value}"


CLAIMS_HEAD = ["Claim", "Level", "Verdict", "The original", "Summary", "Measured seeds per model",
               "Threshold, power, replication"]  # fmt: skip


def power_cell(cl: ClaimResult) -> str:
    """'threshold 0.1; detects >= 0.18 at 5 seeds; the same verdict on 97% of fresh 5-seed sets'
    (what is absent from older results is left out)."""
    parts = []
    if cl.primary.threshold is not None and cl.power:
        parts.append(f"threshold {fmt_num(float(cl.primary.threshold))}")
    power = cl.power or {}
    if power.get("mde") is not None:
        parts.append(f"detects >= {fmt_num(float(power['mde']))} at {power.get('seeds')} seeds")
    if power.get("seeds_needed") is not None:
        parts.append(f"{power['seeds_needed']} seeds would decide it")
    rep = cl.replication or {}
    if rep.get("text"):
        parts.append(str(rep["text"]))
    if (cl.confirmation or {}).get("text"):
        parts.append(f"confirmed: {(cl.confirmation or {})['text']}")
    return "; ".join(parts) or NONE


def claim_rows(claims: Sequence[ClaimResult]) -> list[tuple[ClaimResult, list[str]]]:
    """(claim level, cells) for the claims table; the claim's title on its first level only."""
    rows, seen = [], set()
    for cl in claims:
        title = "" if cl.claim in seen else cl.title
        seen.add(cl.claim)
        level = str(cl.level_name or NONE)
        if cl.statement:
            level += f": {cl.statement}"
        if cl.fingerprint:
            level += f" (design {cl.fingerprint})"
        rows.append((cl, [title, level, verdict_label(cl), reference_cell(cl), str(cl.summary),
                          measured_cell(cl), power_cell(cl)]))  # fmt: skip
    return rows


def power_lines(cl: ClaimResult) -> list[str]:
    """The threshold with its source, the power at the run's seeds and the replication estimate."""
    out = []
    if cl.threshold_source:
        threshold = cl.primary.threshold
        value = "" if threshold is None else f"{fmt_num(float(threshold))}: "
        out.append(f"Threshold {value}{cl.threshold_source}.")
    if (cl.power or {}).get("text"):
        out.append(f"Power: {(cl.power or {})['text']}.")
    if (cl.replication or {}).get("text"):
        out.append(f"Replication: {(cl.replication or {})['text']}.")
    return out


def claim_sections(cl: ClaimResult) -> list[tuple[str, list[str]]]:
    """A claim's detail as (heading, lines): the primary test per study model, the calibration
    on controls, the caveats, what would change the verdict and the reference check."""
    ref = cl.reference
    line = (
        f"On the original study's published numbers the rule gives: "
        f"{ref.rule_verdict or 'not computable'} (the original: {ref.original_verdict}). "
        f"{ref.note}"
    )
    if ref.effect is not None:
        line += f" Effect {fmt_num(float(ref.effect))}."
    cal = cl.calibration
    tally = (
        f"sensitivity {fmt_value(cal.sensitivity)}, specificity {fmt_value(cal.specificity)}; "
        + ("passed" if cal.passed else "not passed")
    )
    design = ([f"Design fingerprint {cl.fingerprint}: its rule, the decision's constants and "
               "the configs of the models and experiments it reads (not its seeds); a run with "
               "the same fingerprint ran the same design (docs/preregistration.md)."]
              if cl.fingerprint else [])  # fmt: skip
    return [
        ("What this level tests", ([cl.statement] if cl.statement else []) + design),
        ("Primary test", list(cl.evidence)),
        ("Threshold, power and replication", power_lines(cl)),
        (
            "Confirmation",
            [
                f"The confirmation of this design: {cl.confirmation['text']}; this run's "
                "verdict reads its calibration."
            ]
            if cl.confirmation
            else [],
        ),
        ("Secondary numbers", list(cl.notes or [])),
        ("Calibration", [*cl.controls, tally]),
        ("Caveats", list(cl.caveats)),
        ("What would change the verdict", [cl.would_change] if cl.would_change else []),
        ("Reference check", [line]),
    ]


def calibration_rows(claims: Sequence[ClaimResult]) -> list[list[str]]:
    """One row per (claim, control model): role, the effect over seeds, detected, as designed."""
    rows = []
    for cl in claims:
        for ctrl in cl.calibration.controls:
            t = ctrl.test
            seeds = fmt_value(t.n)
            if t.seeds is not None:
                seeds += f" of {fmt_value(t.seeds)}"
            detected = "yes" if ctrl.detected else "no"
            if ctrl.measured is False:
                detected = "not measured"
            rows.append([
                claim_heading(cl), str(ctrl.model),
                str(ctrl.role), f"{fmt_value(t.mean)} (>= {fmt_value(t.bound)})",
                seeds, fmt_value(ctrl.seeds_above_threshold), detected,
                "yes" if ctrl.as_designed else "NO",
            ])  # fmt: skip
    return rows


CALIBRATION_HEAD = ["Claim", "Control", "Role", "Effect (one-sided 95% lower bound)",
                    "Seeds measured", "Seeds above threshold", "Detected", "As designed"]  # fmt: skip
