"""The SAE causal test with and without refitting probes on every edit, on the same checkpoints.

The default study's SAE test (`sae_causal` under `preset("default")`'s settings: two sites, three
SAEs at the early one, k = 8) runs twice per checkpoint in one process: with `sae_causal.refit`
true (the probes refitted on every edit, clean and under RPI: the path before) and false (each
edit read by the intact model's fixed probes alone: the default's path). It prints the seconds of
each, their ratio, and how many of the result's numbers are identical between the two: every
number but the refitted probes' must be (the refitted ones are not measured without refits).

Run it on a default study's APE checkpoints (`checkpoints/ape_s*_*`), on an otherwise idle
machine; --threads 1 matches the study's two tasks at a time on 2 cores.

    PYTHONPATH=src python benchmarks/sae_refit.py --checkpoint RUN/checkpoints/ape_s0_... \\
        [--checkpoint ...] [--threads 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from dataclasses import replace
from typing import Any

import torch

import poslens
from poslens.experiments import sae_causal
from poslens.io import jsonable
from poslens.study import preset
from poslens.study.plan import experiment_configs


def flat(x: Any, path: str = "") -> dict[str, Any]:
    """Every leaf of a JSON-ready result by its path."""
    if isinstance(x, dict):
        return {k: v for key, val in x.items() for k, v in flat(val, f"{path}/{key}").items()}
    if isinstance(x, list | tuple):
        return {k: v for i, val in enumerate(x) for k, v in flat(val, f"{path}[{i}]").items()}
    return {path: x}


# a refitted probe's number: a condition's probe / probe_rpi, their retentions (probe_exact,
# probe_rpi_row, ...), the probe tables' refit / refit_rpi kinds, refit_drop_* and the config flag
REFITTED = re.compile(r"probe|probe_rpi|probe(_rpi)?_(exact|row|col)|refit\w*")


def refitted(path: str) -> bool:
    """Whether `path` names a number of a refitted probe (a whole segment, so that probe_fixed
    and its retentions never count as one)."""
    return any(REFITTED.fullmatch(seg) for seg in re.split(r"[/\[\]]", path) if seg)


def same(a: Any, b: Any) -> bool:
    nan = isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
    return a == b or nan


def run_one(path: str) -> dict[str, Any]:
    cfg = experiment_configs(preset("default"))[sae_causal.NAME]
    assert isinstance(cfg, sae_causal.Config)
    model, task = poslens.load(path).eval(), poslens.load_task(path)
    out: dict[str, Any] = {"checkpoint": path}
    leaves = {}
    for refit in (True, False):
        start = time.perf_counter()
        res = sae_causal.run(model, task, replace(cfg, refit=refit))
        out[f"seconds_refit_{str(refit).lower()}"] = round(time.perf_counter() - start, 2)
        leaves[refit] = flat(jsonable(res.to_dict()))
    out["ratio"] = round(out["seconds_refit_true"] / out["seconds_refit_false"], 2)
    before, after = leaves[True], leaves[False]
    changed = [k for k in before if not (k in after and same(before[k], after[k]))]
    out["numbers_identical"] = len(before) - len(changed)
    out["numbers_refit_only"] = sum(refitted(k) for k in changed)
    # anything else that changed or went missing is a bug of the fixed-probes-only path
    out["other_numbers_changed"] = [k for k in changed if not refitted(k)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", action="append", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [run_one(p) for p in args.checkpoint]
    print(f"{'checkpoint':<48} {'refit s':>8} {'fixed only s':>12} {'ratio':>6} {'same':>6}")
    for r in rows:
        name = r["checkpoint"].rstrip("/").rsplit("/", 1)[-1]
        print(f"{name:<48} {r['seconds_refit_true']:>8.2f} {r['seconds_refit_false']:>12.2f} "
              f"{r['ratio']:>5.2f}x {r['numbers_identical']:>6}")  # fmt: skip
        if r["other_numbers_changed"]:
            print(f"  CHANGED beyond the refitted probes: {r['other_numbers_changed'][:5]}")
    total = sum(r["seconds_refit_true"] for r in rows) / sum(r["seconds_refit_false"] for r in rows)
    print(f"all: {total:.2f}x faster without refits (threads {args.threads}, {torch.__version__})")
    if args.json:
        with open(args.json, "w") as f:
            doc = {"rows": rows, "ratio": round(total, 2), "threads": args.threads}
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
