"""`python -m poslens.report DIR`: rebuild DIR/report.html and DIR/report.md from DIR/results.json."""

from __future__ import annotations

import sys
from pathlib import Path

from poslens.errors import UserError
from poslens.io import read_json
from poslens.report import write_report


def main(argv: list[str] | None = None) -> int:
    """Re-render the reports of one study folder; one-line error and exit 2 on bad input."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m poslens.report DIR", file=sys.stderr)
        return 2
    out_dir = Path(args[0])
    try:
        results = read_json(out_dir / "results.json", "results")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not isinstance(results, dict):
        print(f"error: {out_dir / 'results.json'} does not hold a JSON object", file=sys.stderr)
        return 2
    for path in write_report(out_dir, results):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
