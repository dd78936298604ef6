"""Do the default study's verdicts replicate on a disjoint seed set?

Runs the default preset on seeds 0-4 and on seeds 5-9 (each from nothing into its own folder, or
reads two finished study folders with --runs A B), then prints each claim level's two verdicts,
whether they agree, and each run's replication estimate and minimum detectable effect. The
printed table is what docs/runs/2026-12-04-thresholds-power-replication.md records ("Replication
on a disjoint seed set"), with the CPU.

    PYTHONPATH=src python benchmarks/replication.py [--out DIR] [--seeds 5] [--preset default]
    PYTHONPATH=src python benchmarks/replication.py --runs runs/study runs/study_s5
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

from poslens.report.common import verdict_label
from poslens.report.compare import least_stable
from poslens.study import preset, run_study
from poslens.study.result import ClaimResult, claims_of


def _run(name: str, seeds: int, start: int, out: Path) -> dict[str, Any]:
    begin = time.perf_counter()
    res = run_study(preset(name, seeds=seeds, seed_start=start), out, progress=False)
    print(f"seeds {start}-{start + seeds - 1}: {time.perf_counter() - begin:.0f} s in {out}")
    return res


def table(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """One line per claim level: the two verdicts, agreement, replication, power and the least
    stable parts of each."""

    def seeds(r: dict[str, Any]) -> str:
        c = r["config"]
        first = c.get("seed_start", 0)
        return f"seeds {first}-{first + c['seeds'] - 1}"

    rows = [f"| level | {seeds(a)} | {seeds(b)} | agree | replication (each run) | "
            "minimum detectable effect (each run) | least stable (each run) |",
            "|---|---|---|---|---|---|---|"]  # fmt: skip
    by_id = {c.id: c for c in claims_of(b)}
    for ca in claims_of(a):
        cb = by_id.get(ca.id)
        if cb is None:
            continue
        la, lb = verdict_label(ca), verdict_label(cb)

        def rep(c: ClaimResult) -> str:
            r = c.replication or {}
            return "-" if r.get("probability") is None else f"{r['probability']:.0%}"

        def mde(c: ClaimResult) -> str:
            p = c.power or {}
            return "-" if p.get("mde") is None else f"{p['mde']:.3g}"

        rows.append(f"| {ca.id} | {la} | {lb} | {'yes' if la == lb else 'NO'} | "
                    f"{rep(ca)} / {rep(cb)} | {mde(ca)} / {mde(cb)} | "
                    f"{least_stable(ca)} / {least_stable(cb)} |")  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="default")
    ap.add_argument("--seeds", type=int, default=5, help="seeds per set (the sets are disjoint)")
    ap.add_argument("--out", type=Path, default=Path("runs/replication"))
    ap.add_argument("--runs", type=Path, nargs=2, metavar="DIR",
                    help="two finished study folders instead of running the preset twice")  # fmt: skip
    args = ap.parse_args()
    if args.runs:
        a, b = (json.loads((d / "results.json").read_text()) for d in args.runs)
    else:
        a = _run(args.preset, args.seeds, 0, args.out / "first")
        b = _run(args.preset, args.seeds, args.seeds, args.out / "second")
    print(f"CPU: {platform.processor() or platform.machine()}; "
          f"{a.get('environment', {}).get('cpu', '')}")  # fmt: skip
    print("\n".join(table(a, b)))
    agree = sum(line.split(" | ")[3] == "yes" for line in table(a, b)[2:])
    print(f"{agree} of {len(table(a, b)) - 2} levels agree")


if __name__ == "__main__":
    main()
