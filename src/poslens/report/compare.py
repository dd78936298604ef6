"""`poslens compare`: the claims of several study runs side by side, one row per claim level:
each run's verdict (with its qualifier), each study model's effect mean with its one-sided 95%
bounds, the minimum detectable effect and the replication probability where the run has them,
and whether the runs agree on the verdict. As a rich terminal table, Markdown, and a
self-contained HTML page that embeds each run's claims-at-a-glance figure.

Runs are read as they are: a field a run lacks (older runs have no power or replication
record) shows as a dash. Runs of different results schemas are refused.
"""

from __future__ import annotations

import base64
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any
from urllib.parse import quote

from poslens.errors import UserError
from poslens.io import read_json
from poslens.report import common as c
from poslens.report import html as h
from poslens.study.replication import Part
from poslens.study.replication import least_stable as weakest
from poslens.study.result import ClaimResult, claims_of
from poslens.study.schema import SCHEMA
from poslens.study.verdicts import CLAIMS_FIGURE

DASH = "-"
AGREE, DIFFER = "agree", "differ"
RESULTS = "results.json"
CLAIMS_PNG = "figures/claims.png"  # where a study draws it when results.json lists no path


@dataclass(frozen=True)
class Run:
    """One study folder: its name as given on the command line and its results.json."""

    name: str
    folder: Path
    results: Mapping[str, Any]
    label: str = ""  # the column heading: the folder's own name, or all of it where two share one

    @cached_property
    def parsed(self) -> list[ClaimResult]:
        """Its claims, parsed once (UserError, one line, for a claim that lacks a required key)."""
        return claims_of(self.results)

    def claims(self) -> dict[tuple[str, str], ClaimResult]:
        """Its claim levels by (claim, level), in the run's order."""
        return {(cl.claim, cl.level): cl for cl in self.parsed}

    def claims_png(self) -> str:
        """The claims-at-a-glance figure's path inside the folder."""
        for fig in self.results.get("figures") or []:
            if isinstance(fig, Mapping) and fig.get("experiment") == CLAIMS_FIGURE:
                return str(fig.get("png") or CLAIMS_PNG)
        return CLAIMS_PNG


def load_runs(folders: Sequence[str]) -> list[Run]:
    """Each folder's results.json, checked: a folder holding one, a JSON object with a list of
    claims, all of one schema and that the study's; UserError (one line) otherwise."""
    runs = []
    for name in folders:
        folder = Path(name)
        if not folder.is_dir():
            raise UserError(f"{name} is not a folder (give `poslens study` output folders)")
        if not (folder / RESULTS).is_file():
            raise UserError(f"{name} is not a study folder: it has no {RESULTS}")
        results = read_json(folder / RESULTS, "results")  # size, depth, valid and finite JSON
        if not isinstance(results, dict):
            raise UserError(f"{folder / RESULTS} holds no JSON object")
        runs.append(Run(name, folder, results))
    short = [Path(r.name).resolve().name or r.name for r in runs]
    unique = len(set(short)) == len(short)
    runs = [
        Run(r.name, r.folder, r.results, s if unique else r.name)
        for r, s in zip(runs, short, strict=True)
    ]
    first = runs[0]
    for run in runs[1:]:
        if run.results.get("schema") != first.results.get("schema"):
            raise UserError(
                f"{run.name} has results schema {run.results.get('schema')!r}, {first.name} "
                f"{first.results.get('schema')!r}: compare takes runs of one schema"
            )
    if first.results.get("schema") != SCHEMA:
        raise UserError(
            f"{first.name} has results schema {first.results.get('schema')!r}; compare reads "
            f"study results ({SCHEMA}); for a ladder, compare its rungs/NAME folders"
        )
    for run in runs:
        if not isinstance(run.results.get("claims"), list):
            raise UserError(f"{run.folder / RESULTS} has no list of claims")
        try:
            run.parsed  # noqa: B018 (parsed once here, so a bad claim is refused before output)
        except UserError as e:
            raise UserError(f"{run.folder / RESULTS}: {e}") from None
    return runs


@dataclass(frozen=True)
class Level:
    """One claim level across the runs: each run's claim dict (None where it lacks the level)."""

    claim: str
    level: str
    title: str
    cells: list[ClaimResult | None]

    @property
    def agreement(self) -> str:
        """'agree' when every run has this level with the same verdict and qualifier ("inconclusive
        (fragile)" and "inconclusive (no power)" differ), else 'differ'."""
        verdicts = {None if cl is None else (cl.verdict, cl.qualifier) for cl in self.cells}
        return AGREE if len(verdicts) == 1 and None not in verdicts else DIFFER


def levels(runs: Sequence[Run]) -> list[Level]:
    """Every claim level found in any run, in the order they first appear."""
    per_run = [r.claims() for r in runs]
    keys: dict[tuple[str, str], str] = {}
    for claims in per_run:
        for key, cl in claims.items():
            keys.setdefault(key, cl.title or key[0])
    return [Level(k[0], k[1], t, [cl.get(k) for cl in per_run]) for k, t in keys.items()]


def _num(x: Any) -> str:
    """A number as the report writes it; a dash for null, absent or not finite."""
    real = isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
    return c.fmt_num(x) if real else DASH


def verdict(cl: ClaimResult | None) -> str:
    """The verdict with its qualifier ('inconclusive (no power)'), or a dash."""
    return DASH if cl is None else c.verdict_label(cl)


def effects(cl: ClaimResult | None) -> list[str]:
    """Per study model: 'ape 0.41 [0.3, 0.52]' (mean, one-sided 95% lower and upper bounds; the
    mean alone where there are none, 'not measured' where there is no mean)."""
    if cl is None:
        return []
    if not cl.primary.models:
        return ["no study model ran"]
    out = []
    for m, t in cl.primary.models.items():
        mean, lo, hi = _num(t.mean), _num(t.lower), _num(t.upper)
        if mean == DASH:
            out.append(f"{m} not measured")
        else:  # no bounds without two seeds that differ
            out.append(f"{m} {mean}" + ("" if lo == hi == DASH else f" [{lo}, {hi}]"))
    return out


def _field(rec: Mapping[str, Any] | None, key: str) -> Any:
    return rec.get(key) if isinstance(rec, Mapping) else None


def mde(cl: ClaimResult | None) -> str:
    """The minimum detectable effect at the run's seeds (power.mde), or a dash."""
    return _num(None if cl is None else _field(cl.power, "mde"))


def replication(cl: ClaimResult | None) -> str:
    """The probability that a rerun gives the same verdict (replication.probability), or a dash."""
    return _num(None if cl is None else _field(cl.replication, "probability"))


def least_stable(cl: ClaimResult | None, most: int = 2) -> str:
    """The parts a verdict that does not replicate turns on (replication.parts that fresh seed
    sets fail to repeat more than 1% of the time, least first): 'positive ape~table_rowcol 63%',
    or a dash (stable, or a run without parts)."""
    rep = None if cl is None else cl.replication
    parts = _field(rep, "parts")
    if not isinstance(parts, list) or _field(rep, "stable") is not False:
        return DASH
    known = [p for p in map(Part.from_dict, parts) if p is not None]
    text = "; ".join(f"{p.role} {p.model} {p.share:.0%}" for p in weakest(known, most))
    return text or DASH


HEAD = ["Claim", "Level"]
PER_RUN = (
    "verdict", "effect per model: mean [one-sided 95% bounds]", "MDE", "P(replicates)",
    "least stable (share of fresh seed sets)",
)  # fmt: skip


def table_rows(runs: Sequence[Run], rows: Sequence[Level]) -> tuple[list[str], list[list[str]]]:
    """The comparison as text cells: claim, level, then per run its verdict, effects, MDE and
    replication probability, then the agreement."""
    head = [*HEAD]
    for run in runs:
        head += [f"{run.label}: {p}" for p in PER_RUN]
    head.append("Verdicts")
    body = []
    for lv in rows:
        cells = [lv.title, lv.level]
        for cl in lv.cells:
            cells += [verdict(cl), "; ".join(effects(cl)) or DASH, mde(cl), replication(cl),
                      least_stable(cl)]  # fmt: skip
        body.append([*cells, lv.agreement])
    return head, body


def render_markdown(runs: Sequence[Run], rows: Sequence[Level], base: Path | None = None) -> str:
    """The comparison as Markdown: the runs, one table, each run's claims figure linked (relative
    to `base`, the folder the Markdown goes into; default the current one)."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    head, body = table_rows(runs, rows)
    agree = sum(lv.agreement == AGREE for lv in rows)
    out = ["# poslens: study runs compared", ""]
    out += [
        f"- **{cell(r.label)}** (`{r.name}`): {cell(c.summary(r.results, r.parsed))}" for r in runs
    ]
    out += ["", f"The runs agree on {agree} of {len(rows)} claim levels' verdicts.", ""]
    out += ["| " + " | ".join(cell(x) for x in head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(cell(x) for x in row) + " |" for row in body]
    out += ["", "## Claims at a glance", ""]
    for r in runs:
        link = os.path.relpath((r.folder / r.claims_png()).resolve(), (base or Path()).resolve())
        out.append(f"![{cell(r.label)}: claims at a glance]({quote(Path(link).as_posix())})")
    return "\n".join(out) + "\n"


def _figure(run: Run) -> str:
    """A run's claims figure embedded as a PNG data URI, or a visible note when unreadable."""
    data, why = c.read_png(run.folder, run.claims_png())
    caption = f"{h.esc(run.label)}: claims at a glance"
    if data is None:
        body = f'<p class="missing">figure missing: {h.esc(run.claims_png())} ({h.esc(why)})</p>'
    else:
        uri = "data:image/png;base64," + base64.b64encode(data).decode("ascii")
        body = f'<img src="{uri}" alt="{caption}">'
    return f"<figure>{body}<figcaption>{caption}</figcaption></figure>"


def render_html(runs: Sequence[Run], rows: Sequence[Level]) -> str:
    """The comparison as one self-contained page (the report's style and CSP, figures inline)."""
    head = ["Claim", "Level", *(r.label for r in runs), "Verdicts"]
    body = []
    for lv in rows:
        tds = [f"<td>{h.esc(lv.title)}</td><td>{h.esc(lv.level)}</td>"]
        for cl in lv.cells:
            if cl is None:
                tds.append(f"<td>{DASH}</td>")
                continue
            lines = "".join(f"<br><small>{h.esc(e)}</small>" for e in effects(cl))
            extra = (
                f"<br><small>MDE {h.esc(mde(cl))}; P(replicates) {h.esc(replication(cl))}</small>"
            )
            if (weak := least_stable(cl)) != DASH:
                extra += f"<br><small>least stable: {h.esc(weak)}</small>"
            tds.append(f"<td>{h.badge(cl.verdict, verdict(cl))}{lines}{extra}</td>")
        tds.append(f'<td class="agreement">{h.esc(lv.agreement)}</td>')
        body.append("<tr>" + "".join(tds) + "</tr>")
    table = (
        "<table><thead><tr>" + "".join(f"<th>{h.esc(x)}</th>" for x in head) + "</tr></thead>"
        "<tbody>" + "".join(body) + "</tbody></table>"
    )
    agree = sum(lv.agreement == AGREE for lv in rows)
    runs_list = "".join(
        f"<li><b>{h.esc(r.label)}</b> (<code>{h.esc(r.name)}</code>): "
        f"{h.esc(c.summary(r.results, r.parsed))}</li>"
        for r in runs
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{h.CSP}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>poslens: study runs compared</title><style>{h.CSS}</style></head>\n<body><main>"
        f"<h1>poslens: study runs compared</h1><ul>{runs_list}</ul>"
        f"<p>The runs agree on {agree} of {len(rows)} claim levels' verdicts. Each cell: the "
        "verdict, each study model's effect (mean, one-sided 95% bounds), the minimum detectable "
        "effect and the probability that a rerun gives the same verdict, where the run has them."
        f"</p>{table}<h2>Claims at a glance</h2>"
        f'<div class="figures">{"".join(_figure(r) for r in runs)}</div>'
        "</main></body></html>\n"
    )


__all__ = [
    "AGREE",
    "DIFFER",
    "Level",
    "Run",
    "levels",
    "load_runs",
    "render_html",
    "render_markdown",
    "table_rows",
]
