"""Wall time of `poslens study` per stage, for the quick and default presets.

Runs each preset from nothing into a fresh folder (so every checkpoint is trained), then reads
the stage timings from its results.json and prints the seconds per stage kind (training, each
experiment, the report) summed over models and seeds, with the total. There is no alternative
tool to compare with; the budgets are the yardstick: quick <= 2 min, default <= 12 min (issue
47; 20 min before it) on an idle 2-core machine of either CPU kind (the CPU model and its vector
extensions are printed).

With `--train-precisions fp32,bf16` each preset runs once per training precision (the first is
the reference, `poslens study --train-precision`) and a table prints each stage's seconds per
precision and their ratio to the reference, with the verdicts side by side.

    PYTHONPATH=src python benchmarks/study_time.py [--presets quick,default] [--out DIR]
        [--jobs 0] [--threads 0] [--train-precisions fp32,bf16] [--json timings.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from poslens.cli.study import with_train_precision
from poslens.study import preset, run_study
from poslens.study.result import claims_of

BUDGET = {"quick": 120.0, "default": 720.0}


def time_preset(
    name: str, out: Path, threads: int, jobs: int, train_precision: str | None = None
) -> dict[str, object]:
    cfg = preset(name)
    if train_precision is not None:
        cfg = with_train_precision(cfg, train_precision)
    start = time.perf_counter()
    res = run_study(cfg, out, progress=False, threads=threads, jobs=jobs)
    wall = time.perf_counter() - start
    per_kind: dict[str, float] = defaultdict(float)
    for s in res["timings"]["stages"]:
        per_kind[s["stage"]] += s["seconds"]
    return {
        "preset": name,
        "train_precision": train_precision,
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
    ap.add_argument(
        "--train-precisions",
        help="e.g. fp32,bf16: run each preset once per training precision and print ratios to "
        "the first (default: the presets' own precision, once)",
    )
    ap.add_argument("--json", help="also write the timings here")
    args = ap.parse_args()
    parent = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="poslens-study-"))
    precisions = args.train_precisions.split(",") if args.train_precisions else [None]
    rows = []
    for name in args.presets.split(","):
        same = []
        for p in precisions:
            out = parent / (name if p is None else f"{name}-{p}")
            if out.exists() and any(out.iterdir()):
                raise SystemExit(f"{out} is not empty: the benchmark times a study from nothing")
            rows.append(time_preset(name, out, args.threads, args.jobs, p))
            same.append(rows[-1])
            report(rows[-1])
        if len(same) > 1:
            ratios(same)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


def ratios(rows: list[dict[str, object]]) -> None:
    """Each stage's seconds per training precision and the ratio to the first (the reference)."""
    ref = rows[0]
    names = [str(r["train_precision"]) for r in rows]
    print(f"\n{ref['preset']}: seconds per stage, and the ratio to {names[0]}")
    print(
        "| stage | "
        + " | ".join(names)
        + " | "
        + " | ".join(f"{n} / {names[0]}" for n in names[1:])
        + " |"
    )
    print("|---" * (2 * len(rows)) + "|")
    stages = list(dict.fromkeys(k for r in rows for k in r["stages"]))  # type: ignore[union-attr]
    for key in [*stages, "wall"]:
        secs = [float(r["wall_seconds"] if key == "wall" else r["stages"].get(key, 0.0))  # type: ignore[union-attr,arg-type]
                for r in rows]  # fmt: skip
        ratio = [f"{x / secs[0]:.2f}x" if secs[0] else "-" for x in secs[1:]]
        print(
            f"| {key} | " + " | ".join(f"{x:.0f}" for x in secs) + " | " + " | ".join(ratio) + " |"
        )
    for cid, verdict in ref["claims"].items():  # type: ignore[union-attr]
        others = [r["claims"].get(cid) for r in rows[1:]]  # type: ignore[union-attr]
        same = "same" if all(o == verdict for o in others) else "DIFFERS"
        print(f"  {cid}: {verdict} / " + " / ".join(map(str, others)) + f" ({same})")


def report(r: dict[str, object]) -> None:
    """One study's timings, as printed since the benchmark's first version."""
    p = r["train_precision"]
    name = r["preset"] if p is None else f"{r['preset']} ({p} training)"
    cpu = r["cpu"]
    print(f"\n{name}: {r['wall_seconds']:.0f} s wall (budget {r['budget_seconds']:.0f} s)")
    print(f"  CPU {cpu['model']} ({', '.join(cpu['extensions'])})")  # type: ignore[index]
    print(f"  runs (training + experiments)  {r['runs_wall_seconds']:8.1f} s wall")
    print(f"  aggregate, figures, report     {r['aggregate_figures_report_seconds']:8.1f} s wall")
    print(f"  per stage, summed over models and seeds ({r['jobs']} runs at a time):")
    for stage, sec in r["stages"].items():  # type: ignore[union-attr]
        print(f"    {stage:<28} {sec:8.1f} s")
    print("  claims: " + ", ".join(f"{k}={v}" for k, v in r["claims"].items()))  # type: ignore[union-attr]


if __name__ == "__main__":
    main()
