"""`poslens compare RUN_A RUN_B [...]`: several study runs' claims side by side, printed as a
table and optionally written as Markdown and a self-contained HTML page (report/compare.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from poslens.errors import UserError

WIDTH = 160  # the table's width when stdout is not a terminal (a log, a pipe)
HTML, MARKDOWN = "compare.html", "compare.md"  # the files --out DIR gets


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """The `compare` subcommand's arguments."""
    p = sub.add_parser(
        "compare",
        help="several study runs' claims side by side: verdicts, effects, bounds, MDE, agreement",
        description="Compare the claims of two or more `poslens study` folders: per claim level, "
        "each run's verdict, each study model's effect with its one-sided 95%% bounds, the "
        "minimum detectable effect where the run has it, and whether the runs agree.",
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="`poslens study` output folders")
    p.add_argument("--md", metavar="FILE", help="also write the comparison as Markdown")
    p.add_argument(
        "--html", metavar="FILE", help="also write a self-contained HTML page with the figures"
    )
    p.add_argument("--out", metavar="DIR", help=f"write {HTML} and {MARKDOWN} into DIR")
    p.set_defaults(fn=cmd_compare)


def cmd_compare(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from poslens.io import atomic_write
    from poslens.limits import check_output_dir, check_output_file
    from poslens.report import compare as cmp

    if len(args.runs) < 2:
        raise UserError(f"compare needs at least two study folders, got {len(args.runs)}")
    if args.out is not None:  # every output checked before the first is written
        check_output_dir(args.out)
    for flag, path in (("--html", args.html), ("--md", args.md)):
        if path is not None:
            check_output_file(path, flag)
    runs = cmp.load_runs(args.runs)
    rows = cmp.levels(runs)
    table = Table(title="poslens: study runs compared", show_lines=True)
    for name in ("Claim", "Level", *(r.label for r in runs), "Verdicts"):
        table.add_column(name, overflow="fold")
    for lv in rows:
        cells = []
        for cl in lv.cells:
            lines = [cmp.verdict(cl), *cmp.effects(cl)]
            if cl is not None:
                lines.append(f"MDE {cmp.mde(cl)}, P(replicates) {cmp.replication(cl)}")
                if (weak := cmp.least_stable(cl)) != cmp.DASH:
                    lines.append(f"least stable: {weak}")
            cells.append("\n".join(lines))
        table.add_row(lv.claim, lv.level, *cells, lv.agreement)
    console = Console(width=None if sys.stdout.isatty() else WIDTH, highlight=False)
    console.print(table)
    agree = sum(lv.agreement == cmp.AGREE for lv in rows)
    print(f"the runs agree on {agree} of {len(rows)} claim levels' verdicts")

    texts: dict[Path, str] = {}
    if args.out is not None:
        texts[Path(args.out) / HTML] = cmp.render_html(runs, rows)
        texts[Path(args.out) / MARKDOWN] = cmp.render_markdown(runs, rows, Path(args.out))
    if args.html is not None:
        texts[Path(args.html)] = cmp.render_html(runs, rows)
    if args.md is not None:
        texts[Path(args.md)] = cmp.render_markdown(runs, rows, Path(args.md).parent)
    for path, text in texts.items():
        atomic_write(path, lambda p, t=text: p.write_text(t, encoding="utf-8"))
        print(path)
    return 0


__all__ = ["add_parser", "cmd_compare"]
