"""`python -m poslens.report DIR`: rebuild DIR/report.html and DIR/report.md from DIR/results.json."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from poslens.errors import UserError


def main(argv: Sequence[str] | None = None) -> int:
    """Re-render the reports of one study folder; one-line error and exit 2 on bad input
    (no folder, unreadable, oversized, NaN or schema-breaking results.json, unwritable folder)."""
    from poslens.cli import _Parser
    from poslens.io import read_json
    from poslens.report import write_report
    from poslens.report.schema import check_results

    parser = _Parser(
        prog="python -m poslens.report",
        description="Rebuild report.html and report.md of a study folder from its results.json.",
    )
    parser.add_argument("dir", metavar="DIR", help="a `poslens study` output folder")
    args = parser.parse_args(argv)
    out_dir = Path(args.dir)
    try:
        if not out_dir.is_dir():
            raise UserError(f"{out_dir} is not a folder (give a poslens study output folder)")
        path = out_dir / "results.json"
        results = read_json(path, "results")  # size, depth and finite numbers bounded
        check_results(results, str(path))
        paths = write_report(out_dir, results)
    except UserError as e:
        print(f"poslens: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
