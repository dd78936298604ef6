"""`python -m poslens.report DIR`: the same as `poslens report DIR` (rebuild DIR/report.html and
DIR/report.md from DIR/results.json); an entry point, like poslens/__main__.py."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """`poslens report` with these arguments: one-line error and exit 2 on bad input."""
    from poslens.cli import main as cli_main

    return cli_main(["report", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
