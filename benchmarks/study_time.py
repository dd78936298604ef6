"""Wall time of `poslens study` per stage, for the quick and default presets.

Runs each preset from nothing into a fresh folder (so every checkpoint is trained), then reads
the stage timings from its results.json and prints the seconds per stage kind (training, each
experiment, the report) summed over models and seeds, with the total. There is no alternative
tool to compare with; the budgets are the yardstick: quick <= 2 min, default <= 20 min on an
idle 2-core machine of either CPU kind (the CPU model and its vector extensions are printed).

    PYTHONPATH=src python benchmarks/study_time.py [--presets quick,default] [--out DIR]
        [--jobs 0] [--threads 0] [--json timings.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from poslens.study import preset, run_study
from poslens.study.result import claims_of

BUDGET = {"quick": 120.0, "default": 1200.0}


def time_preset(name: str, out: Path, threads: int, jobs: int) -> dict[str, object]:
    start = time.perf_counter()
    res = run_study(preset(name), out, progress=False, threads=threads, jobs=jobs)
    wall = time.perf_counter() - start
    per_kind: dict[str, float] = defaultdict(float)
    for s in res["timings"]["stages"]:
        per_kind[s["stage"]] += s["seconds"]
    return {
        "preset": name,
        "wall_seconds": round(wall, 1),
        "jobs": res["environment"]["jobs"],
        "cpu": res["environment"]["cpu"],
        "runs_wall_seconds": res["timings"]["runs_seconds"],
        "aggregate_figures_report_seconds": round(wall - res["timings"]["runs_seconds"], 1),
        "budget_seconds": BUDGET.get(name),
        "stages": {k: round(v, 1) for k, v in per_kind.items()},
        "claims": {c.id: c.verdict for c in claims_of(res)},
        "out": str(out),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="quick,default")
    ap.add_argument("--out", help="parent folder for the studies (default: a temporary one)")
    ap.add_argument(
        "--jobs", type=int, default=0, help="parallel runs (0: one per core, as the CLI)"
    )
    ap.add_argument(
        "--threads", type=int, default=0, help="torch threads per job (0: cores / jobs)"
    )
    ap.add_argument("--json", help="also write the timings here")
    args = ap.parse_args()
    parent = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="poslens-study-"))
    rows = []
    for name in args.presets.split(","):
        out = parent / name
        if out.exists() and any(out.iterdir()):
            raise SystemExit(f"{out} is not empty: the benchmark times a study from nothing")
        rows.append(time_preset(name, out, args.threads, args.jobs))
        r = rows[-1]
        cpu = r["cpu"]
        print(f"\n{name}: {r['wall_seconds']:.0f} s wall (budget {r['budget_seconds']:.0f} s)")
        print(f"  CPU {cpu['model']} ({', '.join(cpu['extensions'])})")  # type: ignore[index]
        print(f"  runs (training + experiments)  {r['runs_wall_seconds']:8.1f} s wall")
        print(
            f"  aggregate, figures, report     {r['aggregate_figures_report_seconds']:8.1f} s wall"
        )
        print(f"  per stage, summed over models and seeds ({r['jobs']} runs at a time):")
        for stage, sec in r["stages"].items():  # type: ignore[union-attr]
            print(f"    {stage:<28} {sec:8.1f} s")
        print("  claims: " + ", ".join(f"{k}={v}" for k, v in r["claims"].items()))  # type: ignore[union-attr]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
