"""`poslens report`: re-render a study's reports from its results.json."""

from __future__ import annotations

import argparse
from pathlib import Path

from poslens.errors import UserError


def cmd_report(args: argparse.Namespace) -> int:
    """Re-render report.html and report.md of one study folder from its results.json, after
    checking it (size, depth, finite numbers, the schema)."""
    from poslens.io import read_json
    from poslens.report import write_report
    from poslens.report.schema import check_results

    out_dir = Path(args.dir)
    if not out_dir.is_dir():
        raise UserError(f"{out_dir} is not a folder (give a poslens study output folder)")
    path = out_dir / "results.json"
    results = read_json(path, "results")  # size, depth and finite numbers bounded
    check_results(results, str(path))
    for p in write_report(out_dir, results):  # a study's or a ladder's report
        print(p)
    return 0
