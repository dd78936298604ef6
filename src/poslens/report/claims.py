"""The claims as both reports show them: verdict labels, the claims table's cells, each level's
detail sections (threshold, power, replication among them) and the calibration table."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from poslens.report.format import NONE, fmt_num, fmt_value
from poslens.study.verdicts import VERDICTS


def verdict_counts(results: Mapping[str, Any]) -> dict[str, int]:
    """How many claim levels got each verdict (the known ones always present)."""
    counts = dict.fromkeys(VERDICTS, 0)
    for c in results.get("claims") or []:
        v = str(c.get("verdict"))
        counts[v] = counts.get(v, 0) + 1
    return counts


def verdict_label(cl: Mapping[str, Any]) -> str:
    """The verdict as printed: 'inconclusive (no power)' where the claim names a qualifier."""
    v = cl.get("verdict")
    text = "no verdict" if v is None else str(v)
    return f"{text} ({cl['qualifier']})" if cl.get("qualifier") else text


def measured_cell(cl: Mapping[str, Any]) -> str:
    """Per study model, its measured seeds of those run: 'ape 4 of 5, rope_axial 5 of 5'
    (results without that record list the models)."""
    measured = cl.get("measured")
    if not isinstance(measured, Mapping) or not measured:
        return fmt_value(cl.get("models"))
    return ", ".join(
        f"{m} {fmt_value(x.get('measured'))} of {fmt_value(x.get('seeds'))}"
        for m, x in measured.items()
        if isinstance(x, Mapping)
    )


def claim_heading(cl: Mapping[str, Any]) -> str:
    """'APE: position lives in ...: the original's observation' (the title alone without levels)."""
    title = str(cl.get("title", cl.get("id", "")))
    return f"{title}: {cl['level_name']}" if cl.get("level_name") else title


def reference_cell(cl: Mapping[str, Any]) -> str:
    """The original's verdict on this level and the rule's on the original's published numbers."""
    ref = cl.get("reference") or {}
    if not ref:
        return NONE
    orig = str(ref.get("original_verdict", NONE))
    got = ref.get("rule_verdict")
    if got is None or got == "not comparable" or not ref.get("comparable", True):
        return orig
    effect = ref.get("effect")
    value = f" at {fmt_num(float(effect))}" if effect is not None else ""
    return f"{orig}; the rule on its numbers: {got}{value}"


CLAIMS_HEAD = ["Claim", "Level", "Verdict", "The original", "Summary", "Measured seeds per model",
               "Threshold, power, replication"]  # fmt: skip


def power_cell(cl: Mapping[str, Any]) -> str:
    """'threshold 0.1; detects >= 0.18 at 5 seeds; the same verdict on 97% of fresh 5-seed sets'
    (what is absent from older results is left out)."""
    parts = []
    if cl.get("primary", {}).get("threshold") is not None and cl.get("power"):
        parts.append(f"threshold {fmt_num(float(cl['primary']['threshold']))}")
    power = cl.get("power") or {}
    if power.get("mde") is not None:
        parts.append(f"detects >= {fmt_num(float(power['mde']))} at {power.get('seeds')} seeds")
    if power.get("seeds_needed") is not None:
        parts.append(f"{power['seeds_needed']} seeds would decide it")
    rep = cl.get("replication") or {}
    if rep.get("text"):
        parts.append(str(rep["text"]))
    return "; ".join(parts) or NONE


def claim_rows(results: Mapping[str, Any]) -> list[tuple[Mapping[str, Any], list[str]]]:
    """(claim level, cells) for the claims table; the claim's title on its first level only."""
    rows, seen = [], set()
    for cl in results.get("claims") or []:
        group = cl.get("claim", cl.get("id"))
        title = "" if group in seen else str(cl.get("title", cl.get("id", "")))
        seen.add(group)
        level = str(cl.get("level_name") or NONE)
        if cl.get("statement"):
            level += f": {cl['statement']}"
        rows.append((cl, [title, level, verdict_label(cl), reference_cell(cl),
                          str(cl.get("summary", "")), measured_cell(cl), power_cell(cl)]))  # fmt: skip
    return rows


def power_lines(cl: Mapping[str, Any]) -> list[str]:
    """The threshold with its source, the power at the run's seeds and the replication estimate."""
    out = []
    if cl.get("threshold_source"):
        threshold = (cl.get("primary") or {}).get("threshold")
        value = "" if threshold is None else f"{fmt_num(float(threshold))}: "
        out.append(f"Threshold {value}{cl['threshold_source']}.")
    if (cl.get("power") or {}).get("text"):
        out.append(f"Power: {cl['power']['text']}.")
    if (cl.get("replication") or {}).get("text"):
        out.append(f"Replication: {cl['replication']['text']}.")
    return out


def claim_sections(cl: Mapping[str, Any]) -> list[tuple[str, list[str]]]:
    """A claim's detail as (heading, lines): the primary test per study model, the calibration
    on controls, the caveats, what would change the verdict and the reference check."""
    ref = cl.get("reference") or {}
    if ref:
        got = ref.get("rule_verdict") or "not computable"
        line = (
            f"On the original study's published numbers the rule gives: {got} (the original: "
            f"{ref.get('original_verdict', NONE)}). {ref.get('note', '')}"
        )
        if ref.get("effect") is not None:
            line += f" Effect {fmt_num(float(ref['effect']))}."
        reference = [line]
    else:
        reference = []
    cal = cl.get("calibration") or {}
    tally = []
    if cal:
        tally.append(
            f"sensitivity {fmt_value(cal.get('sensitivity'))}, specificity "
            f"{fmt_value(cal.get('specificity'))}; "
            + ("passed" if cal.get("passed") else "not passed")
        )
    return [
        ("What this level tests", [cl["statement"]] if cl.get("statement") else []),
        ("Primary test", list(cl.get("evidence") or [])),
        ("Threshold, power and replication", power_lines(cl)),
        ("Secondary numbers", list(cl.get("notes") or [])),
        ("Calibration", [*(cl.get("controls") or []), *tally]),
        ("Caveats", list(cl.get("caveats") or [])),
        ("What would change the verdict", [cl["would_change"]] if cl.get("would_change") else []),
        ("Reference check", reference),
    ]


def calibration_rows(results: Mapping[str, Any]) -> list[list[str]]:
    """One row per (claim, control model): role, the effect over seeds, detected, as designed."""
    rows = []
    for cl in results.get("claims") or []:
        for ctrl in (cl.get("calibration") or {}).get("controls") or []:
            t = ctrl.get("test") or {}
            bound = t.get("lower") if "lower" in t else (t.get("ci") or [None])[0]
            seeds = fmt_value(t.get("n"))
            if t.get("seeds") is not None:
                seeds += f" of {fmt_value(t.get('seeds'))}"
            detected = "yes" if ctrl.get("detected") else "no"
            if ctrl.get("measured") is False:
                detected = "not measured"
            rows.append([
                claim_heading(cl), str(ctrl.get("model")),
                str(ctrl.get("role")), f"{fmt_value(t.get('mean'))} (>= {fmt_value(bound)})",
                seeds, fmt_value(ctrl.get("seeds_above_threshold")), detected,
                "yes" if ctrl.get("as_designed") else "NO",
            ])  # fmt: skip
    return rows


CALIBRATION_HEAD = ["Claim", "Control", "Role", "Effect (one-sided 95% lower bound)",
                    "Seeds measured", "Seeds above threshold", "Detected", "As designed"]  # fmt: skip
