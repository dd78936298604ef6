"""report.html: one self-contained page (inline CSS, figures as PNG data URIs, no scripts).

A Content-Security-Policy in the page forbids scripts and any load that is not a data: image, so
the report opens from disk with no server and never reaches the network, whatever text it holds.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

from poslens.report import common as c
from poslens.study.result import ClaimResult
from poslens.study.verdicts import CLAIMS_FIGURE

CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"

CSS = """
body { font: 15px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1f2328;
  background: #fff; margin: 0; }
main { max-width: 1200px; margin: 0 auto; padding: 1.5rem 2rem 3rem; }
h1 { margin: 0 0 .5rem; } h2 { border-bottom: 1px solid #d0d7de; padding-bottom: .25rem;
  margin-top: 2.5rem; } h3 { margin: 1.5rem 0 .5rem; }
nav ul { list-style: none; padding: 0; display: flex; flex-wrap: wrap; gap: .25rem 1rem; }
table { border-collapse: collapse; margin: .5rem 0 1rem; font-size: 14px; }
th, td { border: 1px solid #d0d7de; padding: .3rem .6rem; text-align: left; vertical-align: top; }
caption { text-align: left; color: #57606a; font-size: 13px; padding: .2rem 0; }
th { background: #f6f8fa; } td.num { font-variant-numeric: tabular-nums; white-space: nowrap; }
tr.chance td, tr.chance th { color: #57606a; font-style: italic; }
small.seeds { display: block; color: #57606a; font-size: 12px; white-space: normal; }
code { font: 13px ui-monospace, SFMono-Regular, Menlo, Consolas, monospace;
  overflow-wrap: anywhere; }
.verdict { display: inline-block; padding: .1rem .55rem; border-radius: 1rem; font-weight: 600;
  white-space: nowrap; border: 1px solid; }
.v-supported { background: #dafbe1; color: #116329; border-color: #1a7f37; }
.v-not-supported { background: #ffebe9; color: #a40e26; border-color: #cf222e; }
.v-reproduces { background: #dafbe1; color: #116329; border-color: #1a7f37; }
.v-does-not-reproduce { background: #ffebe9; color: #a40e26; border-color: #cf222e; }
.v-inconclusive { background: #fff8c5; color: #6f4e00; border-color: #bf8700; }
.v-instrument-failed-calibration { background: #fbefff; color: #6639ba; border-color: #8250df; }
.v-other { background: #eaeef2; color: #24292f; border-color: #8c959f; }
article.claim { border-left: 4px solid #d0d7de; padding: .1rem 0 .1rem 1rem; margin: 1rem 0; }
article.claim h4 { margin: .8rem 0 .2rem; font-size: 14px; }
article.claim ul { margin: .2rem 0; }
.figures { display: flex; flex-wrap: wrap; gap: 1rem; }
figure { margin: 0; max-width: 100%; border: 1px solid #d0d7de; padding: .5rem;
  background: #fff; }
figure img { display: block; max-width: 100%; height: auto; }
figcaption { font-size: 13px; color: #57606a; margin-top: .3rem; }
.missing { color: #a40e26; font-weight: 600; }
footer { margin-top: 3rem; color: #57606a; font-size: 13px; }
"""


def esc(text: Any) -> str:
    """Escape any value for HTML text or a quoted attribute."""
    return html.escape(str(text), quote=True)


def table(
    head: Sequence[str], rows: Iterable[Sequence[str]], num_from: int = 99, cls: str = ""
) -> str:
    """A plain table of text cells (escaped); columns from num_from on are right-aligned numbers."""
    out = [f'<table class="{esc(cls)}">' if cls else "<table>", "<thead><tr>"]
    out += [f"<th>{esc(h)}</th>" for h in head]
    out.append("</tr></thead><tbody>")
    for row in rows:
        tds = (
            f'<td class="num">{esc(v)}</td>' if i >= num_from else f"<td>{esc(v)}</td>"
            for i, v in enumerate(row)
        )
        out.append("<tr>" + "".join(tds) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _kv_table(rows: list[tuple[str, str]]) -> str:
    """Two-column settings table with the values in monospace."""
    if not rows:
        return f"<p>{esc(c.NONE)}</p>"
    body = "".join(f"<tr><th>{esc(k)}</th><td><code>{esc(v)}</code></td></tr>" for k, v in rows)
    return f"<table><tbody>{body}</tbody></table>"


def badge(verdict: Any, label: str | None = None) -> str:
    """The verdict as a coloured label whose text is the verdict itself (or `label`, the verdict
    with its qualifier)."""
    v = label or ("no verdict" if verdict is None else str(verdict))
    return f'<span class="verdict v-{c.verdict_class(verdict)}">{esc(v)}</span>'


def _list(title: str, items: Any) -> str:
    """A headed bullet list, or a dash when the claim gives none."""
    items = [items] if isinstance(items, str) else list(items or [])
    body = "".join(f"<li>{esc(i)}</li>" for i in items) or f"<li>{esc(c.NONE)}</li>"
    return f"<h4>{esc(title)}</h4><ul>{body}</ul>"


def _claims(results: Mapping[str, Any], claims: Sequence[ClaimResult], out_dir: Path) -> str:
    """The Claims section: the claims at a glance, a table of verdicts (two levels per claim),
    then each level's evidence, secondary numbers, controls and caveats."""
    out = ['<section id="claims"><h2>Claims</h2>']
    if not claims:
        out.append("<p>No claims were evaluated in this study.</p></section>")
        return "".join(out)
    glance = c.figures(results, CLAIMS_FIGURE)
    if glance:
        out.append('<div class="figures">' + "".join(figure(out_dir, f) for f in glance) + "</div>")
    out.append('<table class="claims"><thead><tr>'
               + "".join(f"<th>{esc(h)}</th>" for h in c.CLAIMS_HEAD) + "</tr></thead><tbody>")  # fmt: skip
    for cl, cells in c.claim_rows(claims):
        anchor = f"claim-{c.slug(cl.id)}"
        title, level, _, ref, summary, measured, power = cells
        out.append(
            f'<tr><td>{esc(title)}</td><td><a href="#{esc(anchor)}">{esc(level)}</a></td>'
            f"<td>{badge(cl.verdict, c.verdict_label(cl))}</td><td>{esc(ref)}</td>"
            f"<td>{esc(summary)}</td><td>{esc(measured)}</td><td>{esc(power)}</td></tr>"
        )
    out.append("</tbody></table>")
    for cl in claims:
        anchor = f"claim-{c.slug(cl.id)}"
        out.append(
            f'<article class="claim" id="{esc(anchor)}">'
            f"<h3>{esc(c.claim_heading(cl))} "
            f"{badge(cl.verdict, c.verdict_label(cl))}</h3>"
            f"<p>{esc(cl.summary)}</p>"
            + "".join(_list(title, lines) for title, lines in c.claim_sections(cl))
            + "</article>"
        )
    out.append("</section>")
    return "".join(out)


def _calibration(claims: Sequence[ClaimResult]) -> str:
    """The Calibration section: each claim's rule on the control models."""
    rows = c.calibration_rows(claims)
    intro = (
        "<p>Each claim's rule, run on models in which its mechanism is present (positive) or "
        "absent (negative) by design, through the same pipeline. A claim's verdict counts only "
        "when every control came out as designed.</p>"
    )
    if not rows:
        return f'<section id="calibration"><h2>Calibration</h2>{intro}<p>No control models in this study.</p></section>'
    return (
        f'<section id="calibration"><h2>Calibration</h2>{intro}'
        + table(c.CALIBRATION_HEAD, rows)
        + "</section>"
    )


def _setup(results: Mapping[str, Any]) -> str:
    """Config, environment and the per-model, per-seed training table."""
    head, rows = c.training_table(results)
    train = (
        table(head, rows, num_from=1, cls="training")
        if rows
        else "<p>No training runs recorded.</p>"
    )
    return (
        '<section id="setup"><h2>Setup</h2><h3>Configuration</h3>'
        + _kv_table(c.kv_rows(results.get("config")))
        + "<h3>Environment</h3>"
        + _kv_table(c.kv_rows(results.get("environment")))
        + f"<h3>{c.runs_heading(results)}</h3>"
        + train
        + _gate(results)
        + "</section>"
    )


def _gate(results: Mapping[str, Any]) -> str:
    """The seeds retrained at the accuracy gate, one line each (nothing when none was)."""
    lines = c.gate_lines(results)
    if not lines:
        return ""
    return f"<h4>{c.GATE_HEADING}</h4><ul>" + "".join(f"<li>{esc(x)}</li>" for x in lines) + "</ul>"


def figure(out_dir: Path, fig: Mapping[str, Any]) -> str:
    """A <figure> with the PNG embedded as a data URI, or a visible note when it cannot be read."""
    title = str(fig.get("title") or fig.get("png") or "figure")
    if fig.get("model") is not None:
        title += f" — {fig['model']}"
    caption = esc(title)
    if fig.get("svg"):
        caption += f' (<a href="{esc(quote(str(fig["svg"])))}">SVG</a>)'
    data, why = c.read_png(out_dir, fig.get("png"))
    if data is None:
        body = f'<p class="missing">figure missing: {esc(fig.get("png") or "")} ({esc(why)})</p>'
    else:
        uri = "data:image/png;base64," + base64.b64encode(data).decode("ascii")
        body = f'<img src="{uri}" alt="{esc(title)}">'
    return f"<figure>{body}<figcaption>{caption}</figcaption></figure>"


def _headline(results: Mapping[str, Any], exp: str) -> str:
    """Headline metrics, rows = keys and columns = models: mean ± SE (n seeds), seeds below."""
    keys, cols, cells = c.headline_table(results, exp)
    if not keys:
        return ""
    out = [
        '<table class="headline"><caption>Headline metrics: mean ± SE over seeds '
        "(per-seed values below)</caption><thead><tr><th>Metric</th>"
    ]
    out += [f"<th>{esc(m)}</th>" for m in cols]
    out.append("</tr></thead><tbody>")
    for k in keys:
        cls = ' class="chance"' if c.chance_target(k) else ""
        out.append(f"<tr{cls}><th>{esc(k)}</th>")
        for m in cols:
            cell = cells.get((k, m))
            if cell is None:
                out.append(f'<td class="num">{esc(c.NONE)}</td>')
                continue
            seeds = f'<small class="seeds">{esc(cell.seeds)}</small>' if cell.seeds else ""
            out.append(f'<td class="num">{esc(cell.main)}{seeds}</td>')
        out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _experiment(results: Mapping[str, Any], out_dir: Path, exp: str) -> str:
    """One experiment: its figures, headline table, skipped models and data files."""
    figs = c.figures(results, exp)
    parts = [f'<section id="exp-{esc(c.slug(exp))}"><h2>{esc(exp)}</h2>']
    if figs:
        parts.append('<div class="figures">' + "".join(figure(out_dir, f) for f in figs) + "</div>")
    table = _headline(results, exp)
    parts.append(table)
    skipped = c.skipped(results, exp)
    if skipped:
        parts.append("<h3>Skipped</h3><ul>")
        parts += [f"<li><b>{esc(m)}</b>: {esc(why)}</li>" for m, why in skipped]
        parts.append("</ul>")
    files = c.data_files(results, exp)
    if files:
        links = ", ".join(
            f'<a href="{esc(quote(p))}" title="{esc(p)}">{esc(label)}</a>' for label, p in files
        )
        parts.append(f"<p><small>Data: {links}</small></p>")
    if not (figs or table or skipped):
        parts.append("<p>No results for this experiment.</p>")
    parts.append("</section>")
    return "".join(parts)


def _timings(results: Mapping[str, Any]) -> str:
    """Wall time in total and per stage, with whether a stage was reused from an earlier run."""
    t = results.get("timings") or {}
    rows = c.timing_rows(results)
    timing = table(c.TIMING_COLUMNS, rows, num_from=2) if rows else ""
    return (
        f'<section id="timings"><h2>Timings</h2><p>Total wall time: '
        f"{esc(c.fmt_duration(t.get('total_seconds')))}.</p>{timing}</section>"
    )


def render_html(results: Mapping[str, Any], out_dir: Path) -> str:
    """The whole report as one HTML document; figure paths are read relative to out_dir."""
    out_dir = Path(out_dir)
    claims = c.claims_of(results)
    exps = c.experiments(results)
    other_figs = c.figures(results, None)
    nav = [("claims", "Claims"), ("calibration", "Calibration"), ("setup", "Setup")]
    nav += [(f"exp-{c.slug(e)}", e) for e in exps]
    if other_figs:
        nav.append(("other-figures", "Other figures"))
    nav.append(("timings", "Timings"))
    body = [
        "<header><h1>poslens study report</h1>",
        f'<p class="summary">{esc(c.summary(results, claims))}</p>',
        "<nav><ul>"
        + "".join(f'<li><a href="#{esc(a)}">{esc(t)}</a></li>' for a, t in nav)
        + "</ul></nav></header>",
        _claims(results, claims, out_dir),
        _calibration(claims),
        _setup(results),
        *(_experiment(results, out_dir, e) for e in exps),
    ]
    if other_figs:
        body.append(
            '<section id="other-figures"><h2>Other figures</h2><div class="figures">'
            + "".join(figure(out_dir, f) for f in other_figs)
            + "</div></section>"
        )
    body.append(_timings(results))
    body.append(
        "<footer>Written by poslens from <code>results.json</code> in this folder; "
        "figures are embedded, the SVG and data links point at files next to this page.</footer>"
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>poslens study report</title><style>{CSS}</style></head>\n"
        "<body><main>\n" + "\n".join(body) + "\n</main></body></html>\n"
    )
