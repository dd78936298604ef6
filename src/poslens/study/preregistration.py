"""docs/preregistration.md, generated from the rules themselves (METHODS.md, "Exploration, then
confirmation"): each level's design (effect, threshold and its source, study models, controls,
test, fingerprint), what the exploration changed and why, the exploration's seeds judged by these
rules, and what the pre-registered confirmation count gives at the exploration's spreads.

`python -m poslens.study.preregistration [EXPLORATION]` prints it; EXPLORATION is the
exploration's results.json (default docs/exploration/results.json), re-judged here by the current
rules. A test regenerates the page and compares it with the committed one, so the page can only
say what the code decides.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from poslens.io import write_json
from poslens.study.claims import LEVELS, RULES, Rule, View
from poslens.study.config import CONFIRM_SEEDS, CONFIRM_START, EXPLORED_SEEDS, StudyConfig, preset
from poslens.study.judge import DECISION, evaluate_claims, level_fingerprint
from poslens.study.judged import ALPHA, MIN_SEEDS
from poslens.study.power import level_power
from poslens.study.replication import STABLE, Outcome, codes_of, fresh_draws, in_holm
from poslens.study.result import ClaimResult, claims_of
from poslens.study.wording import fmt_values

EXPLORATION = Path("docs/exploration/results.json")
COUNTS = (10, 15, 20, 25, 30, 40)  # confirmation sizes shown beside the pre-registered one


def outcomes(cl: ClaimResult) -> list[Outcome]:
    """A judged level's family as replication.Outcome values, from its typed result (study
    models, then the controls that were measured)."""
    out = []
    for model, t in cl.primary.models.items():
        values = tuple(float(v) for v in t.values if v is not None and math.isfinite(v))
        counts = len(values) >= MIN_SEEDS and len(set(values)) > 1
        out.append(Outcome("study", values, counts, bool(t.detected), _f(t.lower), _f(t.upper),
                           t.seeds or len(values), model))  # fmt: skip
    for row in cl.calibration.controls:
        t = row.test
        values = tuple(float(v) for v in t.values if v is not None and math.isfinite(v))
        out.append(Outcome(row.role, values, bool(row.measured), row.detected, _f(t.lower),
                           _f(t.upper), t.seeds or len(values), row.model))  # fmt: skip
    return out


def _f(x: float | None) -> float:
    return math.nan if x is None else float(x)


def projected(rule: Rule, cl: ClaimResult, seeds: int) -> tuple[str, float]:
    """The outcome a fresh confirmation of `seeds` seeds most often gives, and how often, drawn
    from the exploration's posterior (its effects and spreads, with their doubt)."""
    original = rule.level == "original"
    tests = outcomes(cl)
    draws = fresh_draws(tests, rule.threshold, ALPHA, seeds, f"prereg:{rule.id}", False, original,
                        exact=True)  # fmt: skip
    shares = draws.shares
    best = int(shares.argmax())
    return codes_of(original)[best], float(shares[best])


def mde(rule: Rule, cl: ClaimResult, seeds: int) -> float:
    """The smallest effect the level's test detects with 80% power at `seeds` seeds, at the
    exploration's pooled spread and the Holm family's strictest step."""
    original = rule.level == "original"
    tests = [t for t in outcomes(cl) if t.counts]
    family = sum(in_holm(t.role, original) for t in tests)
    power = level_power(rule.threshold, rule.threshold, seeds, ALPHA / max(family, 1),
                        [t.values for t in tests], {})  # fmt: skip
    return power.mde


def _controls(rule: Rule) -> str:
    parts = []
    for c in rule.controls:
        if c.edit:
            name = f"in situ `MODEL~{c.edit}`"
        elif c.label:  # a null built inside each judged model
            name = f"`{c.label}` in each judged model"
        else:
            name = f"`{c.model}`"
        design = c.design.removeprefix("in situ: ")
        parts.append(f"{c.role} {name}{' (optional)' if c.optional else ''}: {design}")
    return "; ".join(parts) or "none"


def _number(cl: ClaimResult) -> str:
    """Each study model's effect over the exploration's seeds, mean [95% interval]."""
    return "; ".join(f"{m} {fmt_values([_f(v) for v in t.values])}"
                     for m, t in cl.primary.models.items()) or "not measured"  # fmt: skip


def render(exploration: Mapping[str, Any], cfg: StudyConfig | None = None) -> str:
    """The preregistration page: the rules as the code states them, judged on the
    exploration's results (a results.json of the default's design on the explored seeds)."""
    cfg = cfg or preset("default")
    explored = replace(cfg, seeds=len(EXPLORED_SEEDS), seed_start=EXPLORED_SEEDS.start)
    judged = {c.id: c for c in evaluate_claims(exploration["models"], explored, confirmations={})}
    first, last = CONFIRM_START, CONFIRM_START + CONFIRM_SEEDS - 1
    lines = [
        "# Preregistration: the claims' rules, frozen before the confirmation",
        "",
        "Generated by `python -m poslens.study.preregistration` from the claims modules",
        "(`src/poslens/study/claims/`) and the exploration's results",
        f"(`{EXPLORATION}`, re-judged by these rules). Do not edit it by hand:",
        "`tests/study/test_preregistration.py` regenerates it and fails when the two differ, so a",
        "rule changed after this page was committed shows up as a changed page and changed",
        "fingerprints (and needs a new exploration and a fresh block of seeds).",
        "",
        "## Protocol",
        "",
        f"- **Exploration**: seeds {EXPLORED_SEEDS.start}-{EXPLORED_SEEDS.stop - 1} of the default "
        "study and the accuracy gate's reserve seeds of those (1000-1019, 2000-2019), and every "
        "run before this page. Any of it may have shaped the rules below.",
        f"- **Confirmation**: `poslens study --preset confirm` on seeds {first}-{last} "
        f"({CONFIRM_SEEDS} seeds), every model of the default's design trained; in blocks "
        "(`--seeds A-B`) joined by `poslens merge`. No earlier run trained these seeds or their "
        f"gate reserves ({first + 1000}-{last + 1000}, {first + 2000}-{last + 2000}). Its "
        "results.json is committed at `docs/confirmation/results.json` after this page; no rule "
        "changes after it.",
        f"- **Decision** (every level): one-sided t-tests over seeds against the threshold at "
        f"alpha {DECISION['alpha']}, Holm over the level's family, at least {MIN_SEEDS} measured "
        f"seeds per test; a decided outcome must replicate on at least {STABLE:.0%} of fresh "
        f"seed sets (posterior predictive, {DECISION['draws']} draws), else it reads "
        "inconclusive (fragile).",
        "- **The original's level** answers whether the published observation reproduces here: "
        "*reproduces* (every study model above the threshold) or *does not reproduce* (every "
        "study model's upper bound below the smallest effect the rule detects, with a positive "
        "control detected), qualified *specific* where every negative control is shown below "
        "the threshold (its one-sided upper bound), *not specific* otherwise. Its negative "
        "controls stand outside its Holm family.",
        "- **The sharper level** decides the mechanism: *supported*, *not supported* (every study "
        "model excluded), or *instrument failed calibration* (a positive not detected, or a "
        "negative detected).",
        "- **After the confirmation** a run of the same design (the same fingerprint) reads each "
        "level's calibration from it (`src/poslens/study/confirmed.json`) and tests its study "
        "models among themselves; a run of another design calibrates itself.",
        "",
        "## Levels",
        "",
        f"The exploration's column judges seeds {EXPLORED_SEEDS.start}-{EXPLORED_SEEDS.stop - 1} "
        "by these rules (with the share of fresh sets of that size that repeat it); the "
        f"confirmation's column is the outcome a fresh {CONFIRM_SEEDS}-seed set gives most often "
        "at the exploration's effects and spreads, and how often.",
        "",
        "| level | fingerprint | threshold | exploration (seeds "
        f"{EXPLORED_SEEDS.start}-{EXPLORED_SEEDS.stop - 1}) | at {CONFIRM_SEEDS} seeds | "
        f"detects at {CONFIRM_SEEDS} seeds |",
        "|---|---|---|---|---|---|",
    ]
    for rule in RULES:
        cl = judged[rule.id]
        fp = level_fingerprint(rule, cfg)
        if rule.descriptive:
            lines.append(
                f"| {rule.id} | `{fp}` | - | descriptive: {_number(cl)} | descriptive | - |"
            )
            continue
        rep = (cl.replication or {}).get("probability")
        seen = cl.verdict + (f" ({cl.qualifier})" if cl.qualifier else "")
        seen += "" if rep is None else f", {rep:.0%}"
        outcome, share = projected(rule, cl, CONFIRM_SEEDS)
        lines.append(f"| {rule.id} | `{fp}` | {rule.threshold:g} | {seen} | {outcome}, "
                     f"{share:.0%} | {mde(rule, cl, CONFIRM_SEEDS):.3g} |")  # fmt: skip
    lines += ["", "How often the most frequent outcome comes out at other confirmation sizes "
              "(the same draws):", "",
              "| level | " + " | ".join(f"{n} seeds" for n in COUNTS) + " |",
              "|---|" + "---|" * len(COUNTS)]  # fmt: skip
    for rule in RULES:
        if rule.descriptive:
            continue
        cells = []
        for n in COUNTS:
            outcome, share = projected(rule, judged[rule.id], n)
            cells.append(f"{outcome}, {share:.0%}")
        lines.append(f"| {rule.id} | " + " | ".join(cells) + " |")
    for rule in RULES:
        cl = judged[rule.id]
        lines += ["", f"### {rule.id}: {LEVELS[rule.level]}", "",
                  f"*{rule.title}.* {rule.statement[0].upper()}{rule.statement[1:]}.", "",
                  f"- Effect (per seed): {rule.effect_name}.",
                  f"- Threshold: {'none (descriptive)' if rule.descriptive else f'{rule.threshold:g}'}"
                  f" ({rule.threshold_source}).",
                  f"- Study models: {', '.join(f'`{m}`' for m in rule.study)}.",
                  f"- Controls: {_controls(rule)}.",
                  f"- Reads: {', '.join(f'`{e}`' for e in rule.reads)}.",
                  f"- Fingerprint: `{level_fingerprint(rule, cfg)}`.",
                  f"- Exploration: {_number(cl)}; {cl.verdict}"
                  f"{f' ({cl.qualifier})' if cl.qualifier else ''}.",
                  f"- Changed by the exploration: {rule.exploration or 'nothing'}"
                  f"{'' if rule.exploration.endswith('.') or not rule.exploration else '.'}"]  # fmt: skip
    return "\n".join(lines) + "\n"


def read_keys(entry: Mapping[str, Any]) -> set[str]:
    """The numbers of one model's results.json entry that some rule reads (its effects, its
    controls' nulls, its notes), as "experiment/key"."""
    v = View("m", entry)
    for rule in RULES:
        rule.effect(v)
        rule.notes(v)
        rule.control_notes(v)
        for c in rule.controls:
            if c.effect is not None:
                c.effect(v)
    return {f"{k.experiment}/{k.text}" for k in v.read}


def _estimate(cl: ClaimResult) -> str:
    """Each study model's mean with its two-sided 95% interval: 'ape 0.06 [0.05, 0.08]'."""
    out = []
    for m, t in cl.primary.models.items():
        if t.mean is None:
            out.append(f"{m} not measured")
        elif t.ci[0] is None or t.ci[1] is None:
            out.append(f"{m} {t.mean:.3g}")
        else:
            out.append(f"{m} {t.mean:.3g} [{t.ci[0]:.3g}, {t.ci[1]:.3g}]")
    return "; ".join(out) or "-"


def _outcome(cl: ClaimResult) -> str:
    rep = (cl.replication or {}).get("probability")
    text = cl.verdict + (f" ({cl.qualifier})" if cl.qualifier else "")
    return text if rep is None else f"{text}, {rep:.0%}"


def _run_line(name: str, results: Mapping[str, Any]) -> str:
    """'the confirmation: seeds 100-129, 2-core Intel Xeon, 1 h 56 min of study' (blocks: each)."""
    cfg = results.get("config") or {}
    first, n = int(cfg.get("seed_start", 0)), int(cfg.get("seeds", 0))
    runs = results.get("blocks") or [{"environment": results.get("environment", {}),
                                      "seconds": (results.get("timings") or {}).get("total_seconds")}]  # fmt: skip
    cpus = sorted({str(((b.get("environment") or {}).get("cpu") or {}).get("model", "?"))
                   for b in runs})  # fmt: skip
    seconds = (results.get("timings") or {}).get("total_seconds")
    wall = "" if not seconds else f", {float(seconds) / 60:.0f} min of study"
    return f"{name}: seeds {first}-{first + n - 1}, {' / '.join(cpus)}{wall}"


def results_table(confirmation: Mapping[str, Any], exploration: Mapping[str, Any]) -> str:
    """docs/study.md's table of confirmed results: per level the confirmation's outcome (as it
    recorded it), its estimate with interval, threshold and source, replication share and seeds,
    beside the exploration's seeds judged by the same (frozen) rules."""
    confirmed = {c.id: c for c in claims_of(confirmation)}
    explored = replace(preset("default"), seeds=len(EXPLORED_SEEDS), seed_start=0)
    again = {c.id: c for c in evaluate_claims(exploration["models"], explored, confirmations={})}
    lines = [
        "| level | confirmed outcome, replication | estimate [95% interval] | threshold (source) "
        "| seeds | seeds 0-19, frozen rules |",
        "|---|---|---|---|---|---|",
    ]
    for rule in RULES:
        c, e = confirmed.get(rule.id), again[rule.id]
        if c is None:
            lines.append(f"| {rule.id} | not in the confirmation | - | - | - | {_outcome(e)} |")
            continue
        threshold = "-" if rule.descriptive else f"{rule.threshold:g} ({rule.threshold_source})"
        lines.append(f"| {rule.id} | {_outcome(c)} | {_estimate(c)} | {threshold} | {c.seeds} | "
                     f"{_outcome(e)}: {_estimate(e)} |")  # fmt: skip
    lines += ["", f"- {_run_line('The confirmation', confirmation)}.",
              f"- {_run_line('The exploration', exploration)}."]  # fmt: skip
    return "\n".join(lines) + "\n"


def slim(results: Mapping[str, Any]) -> dict[str, Any]:
    """A results.json cut to what the judge reads (each model's encoding, scale, in-situ record,
    which experiments each seed ran, and the per-seed values of every number a rule reads): the
    exploration as committed, judged the same as the whole file."""
    models = {}
    for name, e in results["models"].items():
        runs = [{"seed": r["seed"], "experiments": {x: {} for x in r["experiments"]}}
                | ({"gate": r["gate"]} if r.get("gate") else {}) for r in e["runs"]]  # fmt: skip
        keep = read_keys(e)
        aggregate = {x: {k: {"values": v.get("values", [])} for k, v in keyed.items()
                         if f"{x}/{k}" in keep}
                     for x, keyed in e["aggregate"].items()}  # fmt: skip
        models[name] = {k: e[k] for k in ("posenc", "scale", "in_situ") if k in e}
        models[name] |= {"runs": runs, "aggregate": aggregate}
    keep = ("schema", "poslens_version", "created", "config", "environment", "timings")
    return {k: results[k] for k in keep if k in results} | {"models": models}


def main(argv: Sequence[str]) -> int:
    """`python -m poslens.study.preregistration [EXPLORATION]` prints the page;
    `... slim RESULTS OUT` writes a results.json as committed (the exploration, a block);
    `... table CONFIRMATION EXPLORATION` prints docs/study.md's table of confirmed results."""
    if argv[:1] == ["slim"] and len(argv) == 3:
        write_json(Path(argv[2]), slim(json.loads(Path(argv[1]).read_text())))
        return 0
    if argv[:1] == ["table"] and len(argv) == 3:  # CONFIRMATION EXPLORATION
        confirmation, exploration = (json.loads(Path(a).read_text()) for a in argv[1:])
        sys.stdout.write(results_table(confirmation, exploration))
        return 0
    path = Path(argv[0]) if argv else EXPLORATION
    sys.stdout.write(render(json.loads(path.read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))


__all__ = [
    "EXPLORATION",
    "mde",
    "outcomes",
    "projected",
    "read_keys",
    "render",
    "results_table",
    "slim",
]
