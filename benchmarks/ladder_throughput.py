"""Training throughput along the scale ladder: every rung's training step, poslens against timm's
ViT of the same shape and encoding, and S seeds as one ensemble against S sequential runs.

The rungs (issue 29; patch 4, 4 heads, batch 64, fp32): g6, g10, g14 (a 6, 10, 14 patch grid:
24, 40, 56 px) at width 32 and depth 4; g14_w64 (grid 14, width 64); d8 and d12 (grid 6, width
32, depth 8 and 12). Per rung and thread count it reports images/s of one poslens model (what
sequential runs achieve), of timm's ViT with the same encoding (for rope_axial timm's naver-style
RoPE ViT, Eva with rotary attention; for ape its VisionTransformer), of timm's APE ViT, and of an
S-seed ensemble (all seeds counted), the ratios poslens / timm and ensemble / sequential, and
each one's share of the fp32 matmul peak (images/s x the model's flops_per_image(train=True), the
whole model's matmul FLOPs, over a large matmul's GFLOP/s measured in this run at the same thread
count). The step and the interleaved rounds are train_throughput.py's (median round, range over
rounds).

    python benchmarks/ladder_throughput.py [--rungs g6,g10,g14,g14_w64,d8,d12] [--seeds 5]
        [--threads 1,2] [--models rope_axial]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from poslens.allocator import keep_freed_memory
from poslens.models import ModelConfig
from train_throughput import CLOCKS, DTYPES, bench_config, matmul_peak

# rung name -> (image size in px, width, depth); patch 4, so the grid is image / 4
RUNGS = {
    "g6": (24, 32, 4),
    "g10": (40, 32, 4),
    "g14": (56, 32, 4),
    "g14_w64": (56, 64, 4),
    "d8": (24, 32, 8),
    "d12": (24, 32, 12),
}


def rung_config(rung: str, posenc: str) -> ModelConfig:
    """The model of a ladder rung (4 heads, patch 4, the other fields the defaults)."""
    image, dim, depth = RUNGS[rung]
    return ModelConfig(posenc=posenc, image_size=image, patch_size=4, dim=dim, depth=depth, heads=4)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rungs", default=",".join(RUNGS), help=f"of {', '.join(RUNGS)} (default all)")
    p.add_argument("--models", default="rope_axial", help="encodings (default rope_axial)")
    p.add_argument("--seeds", type=int, default=5, help="ensemble size S (default 5)")
    p.add_argument("--threads", default="1,2", help="thread counts (default 1,2)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per candidate and round")
    p.add_argument("--batch", type=int, default=64, help="default: the ladder's")
    p.add_argument("--clock", choices=tuple(CLOCKS), default="wall", help="as train_throughput.py")
    p.add_argument("--json", help="also write the results here")
    p.add_argument(
        "--no-cls-exit",
        action="store_true",
        help="the single poslens model without its CLS exit (ViT.train_cls_exit)",
    )
    args = p.parse_args()
    rungs = args.rungs.split(",")
    if unknown := [r for r in rungs if r not in RUNGS]:
        p.error(f"unknown rung {unknown[0]!r}; the rungs are {', '.join(RUNGS)}")
    clock = CLOCKS[args.clock]
    keep_freed_memory()  # as the CLI does for its training processes
    torch.manual_seed(0)
    rows: list[dict[str, Any]] = []
    peaks: dict[int, float] = {}
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        peaks[threads] = peak = matmul_peak(DTYPES["fp32"], clock)
        for posenc in args.models.split(","):
            for rung in rungs:
                cfg = rung_config(rung, posenc)
                runs = bench_config(
                    cfg,
                    args.batch,
                    "fp32",
                    [args.seeds],
                    args.rounds,
                    args.steps,
                    clock,
                    cls_exit=not args.no_cls_exit,
                )
                by = {r["run"]: r for r in runs}
                one, timm, ens = by["poslens"], by["timm"], by[f"ensemble{args.seeds}"]
                # a rotary model's like-for-like baseline: timm's RoPE ViT; else its APE ViT
                same = by.get("timm rope", timm)
                rows.append({
                    "threads": threads, "posenc": posenc, "rung": rung, "image": cfg.image_size,
                    "dim": cfg.dim, "depth": cfg.depth, "seeds": args.seeds, "peak_gflop_s": peak,
                    **{f"{k}_{name}": r[k] for name, r in (("poslens", one), ("timm", timm),
                       ("timm_same", same), ("ensemble", ens))
                       for k in ("img_s", "img_s_range", "gflop_s")},
                    "vs_timm": one["img_s"] / timm["img_s"],
                    "vs_timm_same": one["img_s"] / same["img_s"],
                    "ensemble_vs_timm_same": ens["img_s"] / same["img_s"],
                    "ensemble_vs_sequential": ens["img_s"] / one["img_s"],
                })  # fmt: skip
                print(f"measured {threads} thread(s) {posenc} {rung}", flush=True)
    print(f"torch {torch.__version__}, fp32, batch {args.batch}, ensemble of {args.seeds}, "
          f"{args.clock} clock; fp32 matmul peak GFLOP/s: "
          + ", ".join(f"{t} thread(s) {v:.0f}" for t, v in peaks.items()))  # fmt: skip
    print("| threads | model | rung | poslens img/s | timm, same encoding, img/s | poslens / "
          "timm | timm APE ViT img/s | poslens / timm APE | "
          f"ensemble of {args.seeds} img/s | ensemble / sequential | ensemble / timm | "
          "% of fp32 peak: poslens, timm, ensemble |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        share = ", ".join(f"{r[f'gflop_s_{n}'] / r['peak_gflop_s']:.0%}"
                          for n in ("poslens", "timm_same", "ensemble"))  # fmt: skip
        print(f"| {r['threads']} | {r['posenc']} | {r['rung']} | {_rate(r, 'poslens')} | "
              f"{_rate(r, 'timm_same')} | {r['vs_timm_same']:.2f}x | {_rate(r, 'timm')} | "
              f"{r['vs_timm']:.2f}x | {_rate(r, 'ensemble')} | "
              f"{r['ensemble_vs_sequential']:.2f}x | {r['ensemble_vs_timm_same']:.2f}x | "
              f"{share} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"clock": args.clock, "peaks": peaks, "rows": rows}, f, indent=2)


def _rate(row: dict[str, Any], name: str) -> str:
    """'median (low-high)' images/s of one candidate."""
    lo, hi = row[f"img_s_range_{name}"]
    return f"{row[f'img_s_{name}']:,.0f} ({lo:,.0f}-{hi:,.0f})"


if __name__ == "__main__":
    main()
