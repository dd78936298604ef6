"""The ladder's report.html and report.md (from the ladder's results.json): each claim level
along the rungs, the APE predictions, the figures and a link to every rung's own report."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

from poslens.metrics.stats import seed_test
from poslens.report import common as c
from poslens.report import html as h
from poslens.report import markdown as md

SCHEMA = "poslens.ladder/1"  # the ladder's results.json (study.ladder writes it)
RUNG_HEAD = ["Rung", "Grid", "Width", "Depth", "Relation", "G^2 / width", "Models", "Seconds"]


def _num(x: Any) -> float:
    return float(x) if isinstance(x, int | float) and math.isfinite(x) else math.nan


def effect_text(t: Mapping[str, Any] | None) -> str:
    """'0.41 [0.30, 0.52]' (mean, one-sided 95% bounds), '0.41 (1 seed)' or a dash."""
    if not t or t.get("mean") is None:
        return "not measured"
    mean = c.fmt_num(float(t["mean"]))
    lo, hi = _num(t.get("lower")), _num(t.get("upper"))
    if math.isfinite(lo) and math.isfinite(hi):
        return f"{mean} [{c.fmt_num(lo)}, {c.fmt_num(hi)}]"
    n = t.get("n") or 0
    return f"{mean} ({n} seed{'s' * (n != 1)}, no interval)"


def calibration_text(rc: Mapping[str, Any]) -> str:
    """Whether the rung's controls of this level came out as designed."""
    cal = rc["calibration"]
    if not rc["controls"]:
        return "no controls"
    if cal["passed"]:
        return "controls as designed"
    return "controls incomplete" if not cal["complete"] else "controls NOT as designed"


def model_lines(rc: Mapping[str, Any]) -> list[str]:
    """Each study model's effect on one rung: 'ape 0.41 [0.30, 0.52]'."""
    return [f"{m} {effect_text(t)}" for m, t in rc["models"].items()] or ["not run"]


def rung_verdict(rc: Mapping[str, Any]) -> str:
    """The rung's verdict on a claim level, with its qualifier where it has one."""
    return c.verdict_text(rc["verdict"], rc.get("qualifier"))


def rung_cell(rc: Mapping[str, Any]) -> str:
    """One claim level on one rung: each study model's effect, the verdict, the calibration."""
    return f"{'; '.join(model_lines(rc))} — {rung_verdict(rc)}; {calibration_text(rc)}"


def original_cell(cl: Mapping[str, Any]) -> str:
    ref = cl.get("reference") or {}
    orig = c.fmt_num(float(ref["effect"])) if ref.get("effect") is not None else c.NONE
    return f"{ref.get('original_verdict', c.NONE)}; {orig}"


def claim_rows(results: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Rows = claim levels, columns = rungs."""
    names = [r["name"] for r in results["rungs"]]
    head = ["Claim", "Level", *names, "The original (ViT-B/16)"]
    rows = [[cl["title"], cl["level_name"], *(rung_cell(cl["rungs"][n]) for n in names),
             original_cell(cl)] for cl in results["claims"]]  # fmt: skip
    return head, rows


def _claims_html(results: Mapping[str, Any]) -> str:
    """The claims table with one line per study model and the verdict as a badge."""
    names = [r["name"] for r in results["rungs"]]
    head, _ = claim_rows(results)
    out = ["<table><thead><tr>", *(f"<th>{h.esc(x)}</th>" for x in head), "</tr></thead><tbody>"]
    for cl in results["claims"]:
        out.append(f"<tr><th>{h.esc(cl['title'])}</th><td>{h.esc(cl['level_name'])}</td>")
        for n in names:
            rc = cl["rungs"][n]
            lines = "<br>".join(h.esc(x) for x in model_lines(rc))
            out.append(f'<td class="num">{lines}<br>{h.badge(rc["verdict"], rung_verdict(rc))}'
                       f'<small class="seeds">{h.esc(calibration_text(rc))}</small></td>')  # fmt: skip
        out.append(f"<td>{h.esc(original_cell(cl))}</td></tr>")
    out.append("</tbody></table>")
    return "".join(out)


def prediction_rows(results: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Rows = rungs with an APE model, columns = the predictions' numbers (mean [95% CI])."""
    preds = results["predictions"]
    head = [
        "Rung",
        "G^2 / width",
        "row + column share of random cells",
        *(p["label"] for p in preds),
    ]
    rows = []
    for r in results["rungs"]:
        if not any(p["rungs"].get(r["name"]) for p in preds):
            continue
        cells = []
        for p in preds:
            e = p["rungs"].get(r["name"])
            t = seed_test([_num(v) for v in (e or {}).get("values", [])], 0.0)
            if not math.isfinite(t.mean):
                cells.append(c.NONE)
            elif math.isfinite(t.ci_low):
                cells.append(f"{c.fmt_num(t.mean)} [{c.fmt_num(t.ci_low)}, {c.fmt_num(t.ci_high)}]")
            else:
                cells.append(f"{c.fmt_num(t.mean)} ({t.n} seed{'s' * (t.n != 1)})")
        rows.append([r["name"], c.fmt_num(float(r["g2_per_width"])),
                     c.fmt_num(float(r["rowcol_chance"])), *cells])  # fmt: skip
    return head, rows


TRAINING_HEAD = ["Rung", "Model", "Test accuracy per seed", "Early stop (step per seed)", "Chance"]
TRAINING_NOTE = (
    "How each trained model's seeds learned the rung's task. A seed marked 'never' ran every "
    "step without meeting the preset's early-stopping target (train.stop_acc on validation "
    "accuracy): its numbers in the claims describe a model that learned the task less well."
)


def training_rows(results: Mapping[str, Any]) -> list[list[str]]:
    """One row per rung and trained model (in-situ controls share their model's training)."""
    rows = []
    for r in results["rungs"]:
        for m, e in r["models"].items():
            t = (e or {}).get("training")
            if not t:
                continue
            acc = ", ".join(f"{100 * a:.1f}%" for a in t["test_acc"])
            stops = ", ".join("never" if s is None else f"{s:,}" for s in t["stopped_at"])
            rows.append([r["name"], m, acc, f"{stops} (of {t['steps']:,})",
                         f"{100 * t['chance']:.2f}%"])  # fmt: skip
    return rows


def _models_text(models: Mapping[str, Any]) -> str:
    """'ape, rope_axial (+ 6 in-situ controls)': the trained models, the edits counted."""
    trained = [m for m, e in models.items() if not (e or {}).get("in_situ")]
    edits = len(models) - len(trained)
    return ", ".join(trained) + (f" (+ {edits} in-situ controls)" if edits else "")


def rung_rows(results: Mapping[str, Any]) -> list[list[str]]:
    secs = (results.get("timings") or {}).get("rung_study_seconds", {})
    return [[r["name"], str(r["grid"]), str(r["width"]), str(r["depth"]), r["relation"],
             c.fmt_num(float(r["g2_per_width"])), _models_text(r["models"]),
             c.fmt_duration(secs.get(r["name"]))] for r in results["rungs"]]  # fmt: skip


def summary(results: Mapping[str, Any]) -> str:
    cfg = results["config"]
    t = (results.get("timings") or {}).get("total_seconds")
    return (
        f"{len(results['rungs'])} rungs, study models {', '.join(cfg['models'])}, "
        f"{cfg['seeds']} seeds per model (a verdict needs 5: with fewer every level reads "
        f"inconclusive, and the effects and their intervals are what the ladder shows), the "
        f"'{cfg['base']}' preset's training and analysis on every rung; wall time of this "
        f"invocation {c.fmt_duration(t)} (stages reused from an earlier invocation count 0)."
    )


BOUNDS_NOTE = (
    "Each cell: every study model's primary effect as its mean over seeds with the one-sided 95% "
    "bounds the rule tests [lower, upper], the rung's verdict, and whether the rung's controls "
    "(trained, in situ) came out as designed."
)


def render_html(results: Mapping[str, Any], out_dir: Path) -> str:
    phead, prows = prediction_rows(results)
    rungs = "".join(
        f'<li><a href="{h.esc(quote(r["report"]))}">{h.esc(r["name"])}</a>: '
        f"{h.esc(r['folder'])}/</li>"
        for r in results["rungs"]
    )
    figs = "".join(h.figure(out_dir, f) for f in results.get("figures", []))
    body = [
        "<header><h1>poslens ladder report</h1>",
        f"<p>{h.esc(summary(results))}</p></header>",
        '<section id="rungs"><h2>Rungs</h2>',
        h.table(RUNG_HEAD, rung_rows(results), num_from=1),
        f"<p>Each rung's own report: </p><ul>{rungs}</ul></section>",
        '<section id="training"><h2>Training</h2>',
        f"<p>{h.esc(TRAINING_NOTE)}</p>",
        h.table(TRAINING_HEAD, training_rows(results), num_from=2),
        "</section>",
        '<section id="claims"><h2>Claims along the ladder</h2>',
        f"<p>{h.esc(BOUNDS_NOTE)}</p>",
        _claims_html(results),
        "</section>",
        '<section id="predictions"><h2>APE: row and column factors as G^2 outgrows the width</h2>',
        "<p>Per rung, the APE model's learned table's row + column share of variance (beside the "
        "share a table of independent random cells has, 2 / (G + 1)) and the SAE's positional "
        "latents by kind (mean over seeds, two-sided 95% t-interval).</p>",
        h.table(phead, prows, num_from=1) if prows else "<p>No rung ran an APE model.</p>",
        "</section>",
        f'<section id="figures"><h2>Figures</h2><div class="figures">{figs}</div></section>',
        "<footer>Written by poslens from <code>results.json</code> in this folder (schema "
        f"{h.esc(results['schema'])}); each rung's study is in <code>rungs/</code>.</footer>",
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{h.CSP}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>poslens ladder report</title><style>{h.CSS}</style></head>\n"
        "<body><main>\n" + "\n".join(body) + "\n</main></body></html>\n"
    )


def render_markdown(results: Mapping[str, Any], out_dir: Path | None = None) -> str:
    head, rows = claim_rows(results)
    phead, prows = prediction_rows(results)
    lines = ["# poslens ladder report", "", md.md(summary(results)), "", "## Rungs", ""]
    lines += md.table(RUNG_HEAD, rung_rows(results))
    lines += [f"- [{md.md(r['name'])}]({quote(r['report'])})" for r in results["rungs"]] + [""]
    lines += ["## Training", "", md.md(TRAINING_NOTE), ""]
    lines += md.table(TRAINING_HEAD, training_rows(results))
    lines += ["## Claims along the ladder", "", md.md(BOUNDS_NOTE), ""]
    lines += md.table(head, rows)
    lines += ["## APE: row and column factors as G^2 outgrows the width", ""]
    lines += md.table(phead, prows) if prows else ["No rung ran an APE model.", ""]
    lines += ["## Figures", ""]
    lines += [md.figure(f, out_dir) + "\n" for f in results.get("figures", [])]
    return "\n".join(lines) + "\n"


__all__ = ["SCHEMA", "render_html", "render_markdown"]
