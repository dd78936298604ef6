"""The study report: `report.html` (self-contained) and `report.md`, rendered from results.json.

The renderer is generic: sections follow the experiments and headline keys the results hold.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from poslens.io import atomic_write
from poslens.report.html import render_html
from poslens.report.markdown import render_markdown

__all__ = ["render_html", "render_markdown", "write_report"]


def write_report(out_dir: Path, results: Mapping[str, Any]) -> list[Path]:
    """Render both reports from results (figure paths relative to out_dir) and write them
    atomically into out_dir; returns [report.html, report.md]. A ladder's results (schema
    poslens.ladder/1) get the ladder's report."""
    from poslens.report import ladder

    out_dir = Path(out_dir)
    is_ladder = results.get("schema") == ladder.SCHEMA
    html, markdown = (ladder.render_html, ladder.render_markdown) if is_ladder else (
        render_html, render_markdown)  # fmt: skip
    texts = {
        out_dir / "report.html": html(results, out_dir),
        out_dir / "report.md": markdown(results, out_dir),
    }
    for path, text in texts.items():
        atomic_write(path, lambda p, t=text: p.write_text(t, encoding="utf-8"))
    return list(texts)
