"""report.md: the same content as report.html in Markdown, with figures linked by relative path.

Text from the results is escaped (`<`, `>`, `&` as entities, `|` and newlines in table cells) so
a summary can neither break a table nor inject HTML into a Markdown viewer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

from poslens.report import common as c
from poslens.study.result import ClaimResult
from poslens.study.verdicts import CLAIMS_FIGURE


def md(text: Any) -> str:
    """Escape text for Markdown: HTML-significant characters as entities, lines joined."""
    s = str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return " ".join(s.split("\n"))


def cell(text: Any) -> str:
    """Escape text for one Markdown table cell (pipes too)."""
    return md(text).replace("|", "\\|")


def table(head: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """A pipe table; every cell escaped."""
    out = ["| " + " | ".join(cell(h) for h in head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return [*out, ""]


def _bullets(title: str, items: Any) -> list[str]:
    """A bold heading line and a bullet list (a dash when empty)."""
    items = [items] if isinstance(items, str) else list(items or [])
    return [f"**{title}**", "", *(f"- {md(i)}" for i in items or [c.NONE]), ""]


def _claims(
    results: Mapping[str, Any], claims: Sequence[ClaimResult], out_dir: Path | None
) -> list[str]:
    """The Claims table, then each claim's evidence, controls and caveats."""
    out = ["## Claims", ""]
    if not claims:
        return [*out, "No claims were evaluated in this study.", ""]
    for f in c.figures(results, CLAIMS_FIGURE):
        out += [figure(f, out_dir), ""]
    rows = [[*cells[:2], f"**{cells[2]}**", *cells[3:]] for _, cells in c.claim_rows(claims)]
    out += table(c.CLAIMS_HEAD, rows)
    for cl in claims:
        out += [f"### {md(c.claim_heading(cl))}: {md(c.verdict_label(cl))}", ""]
        out += [md(cl.summary), ""]
        for title, lines in c.claim_sections(cl):
            out += _bullets(title, lines)
    out += ["## Calibration", ""]
    rows = c.calibration_rows(claims)
    out += table(c.CALIBRATION_HEAD, rows) if rows else ["No control models in this study.", ""]
    return out


def _setup(results: Mapping[str, Any]) -> list[str]:
    """Config, environment and the training table."""
    out = ["## Setup", "", "### Configuration", ""]
    out += table(["Setting", "Value"], c.kv_rows(results.get("config")))
    out += ["### Environment", ""]
    out += table(["Package", "Version"], c.kv_rows(results.get("environment")))
    out += [f"### {c.runs_heading(results)}", ""]
    head, rows = c.training_table(results)
    out += table(head, rows) if rows else ["No training runs recorded.", ""]
    gate = c.gate_lines(results)  # the seeds retrained at the accuracy gate
    if gate:
        out += [f"**{c.GATE_HEADING}**", "", *(f"- {md(x)}" for x in gate), ""]
    return out


def figure(fig: Mapping[str, Any], out_dir: Path | None) -> str:
    """An image link to the PNG (relative), or the 'figure missing' note when out_dir shows it
    cannot be read."""
    title = str(fig.get("title") or fig.get("png") or "figure")
    if fig.get("model") is not None:
        title += f" — {fig['model']}"
    png = fig.get("png")
    if out_dir is not None:
        data, why = c.read_png(out_dir, png)
        if data is None:
            return f"**figure missing: {md(png or '')} ({md(why)})** — {md(title)}"
    if not png:
        return f"**figure missing: (no PNG path given)** — {md(title)}"
    alt = md(title).replace("[", "\\[").replace("]", "\\]")
    line = f"![{alt}]({quote(str(png))})"
    if fig.get("svg"):
        line += f"  \n*{alt}* ([SVG]({quote(str(fig['svg']))}))"
    return line


def _experiment(results: Mapping[str, Any], exp: str, out_dir: Path | None) -> list[str]:
    """One experiment: figures, headline table, skipped models, data files."""
    out = [f"## {md(exp)}", ""]
    figs = c.figures(results, exp)
    for f in figs:
        out += [figure(f, out_dir), ""]
    keys, cols, cells = c.headline_table(results, exp)
    if keys:
        out += ["Headline metrics: mean ± SE (n seeds) — per-seed values.", ""]
        rows = []
        for k in keys:
            row = [k]
            for m in cols:
                v = cells.get((k, m))
                row.append(c.NONE if v is None else v.main + (f" — {v.seeds}" if v.seeds else ""))
            rows.append(row)
        out += table(["Metric", *cols], rows)
    skipped = c.skipped(results, exp)
    if skipped:
        out += ["Skipped:", "", *(f"- **{md(m)}**: {md(why)}" for m, why in skipped), ""]
    files = c.data_files(results, exp)
    if files:
        out += ["Data: " + ", ".join(f"[{md(lab)}]({quote(p)})" for lab, p in files), ""]
    if not (figs or keys or skipped):
        out += ["No results for this experiment.", ""]
    return out


def render_markdown(results: Mapping[str, Any], out_dir: Path | None = None) -> str:
    """The report as Markdown; with out_dir, unreadable figures get the 'figure missing' note."""
    claims = c.claims_of(results)
    out = ["# poslens study report", "", md(c.summary(results, claims)), ""]
    out += _claims(results, claims, out_dir)
    out += _setup(results)
    for exp in c.experiments(results):
        out += _experiment(results, exp, out_dir)
    other = c.figures(results, None)
    if other:
        out += ["## Other figures", ""]
        for f in other:
            out += [figure(f, out_dir), ""]
    t = results.get("timings") or {}
    out += ["## Timings", "", f"Total wall time: {c.fmt_duration(t.get('total_seconds'))}.", ""]
    rows = c.timing_rows(results)
    if rows:
        out += table(c.TIMING_COLUMNS, rows)
    return "\n".join(out).rstrip("\n") + "\n"
