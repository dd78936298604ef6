"""SSDC: poslens' streaming `SSDC` vs the keep-every-matrix implementation a user would write.

Naive: per batch, the cosine matrices [B, T, T] (one batched matmul), appended to a list; at the
end torch.cat, mean over images, scipy.stats.spearmanr on the upper triangle vs -D. Streaming:
`poslens.metrics.SSDC(gh, gw, dtype)`, which keeps one float64 [T, T] running sum. Both run at
the same precision (float64, poslens' default, and float32) on the same features: a smooth
random function of grid position plus per-image noise, pre-generated so that only the metric is
timed (best of --repeats runs).

Memory: each (case, implementation, precision) runs in a fresh subprocess that generates the
features, warms up, resets the kernel's peak-RSS counter (writes 5 to /proc/self/clear_refs) and
reports peak RSS (VmHWM) minus RSS before the metric. This counts torch, numpy and allocator
overhead alike (tracemalloc would miss torch). "kept" is the analytic size of what the metric
holds until the end: the list of [B, T, T] matrices, or the [T, T] sum.

    PYTHONPATH=src python benchmarks/ssdc.py [--threads 2] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from scipy.stats import spearmanr

from poslens.metrics import SSDC, manhattan_distance

# name, grid side, width D, images N, batch B
CASES = [
    ("small (8x8, D=128)", 8, 128, 2000, 100),
    ("ViT-B-like (14x14, D=768)", 14, 768, 1000, 100),
]
DTYPES = {"float64": torch.float64, "float32": torch.float32}


def features(g: int, d: int, n: int, batch: int, seed: int = 0) -> list[torch.Tensor]:
    """Float32 patch tokens [B, g*g, d] per batch: 0.3 * smooth f(row, col) + unit noise."""
    gen = torch.Generator().manual_seed(seed)
    rc = torch.stack(torch.meshgrid(torch.arange(g), torch.arange(g), indexing="ij"), -1)
    freq = torch.randn(2, d, generator=gen) * 0.35  # low frequencies: neighbours look alike
    phase = torch.rand(d, generator=gen) * 2 * torch.pi
    signal = torch.cos(rc.reshape(-1, 2).float() @ freq + phase) * 2**0.5  # [T, d], unit power
    return [0.3 * signal + torch.randn(batch, g * g, d, generator=gen) for _ in range(n // batch)]


def naive(batches: list[torch.Tensor], g: int, dtype: torch.dtype) -> float:
    sims = []
    for x in batches:
        u = F.normalize(x.to(dtype), dim=-1)
        sims.append(u @ u.transpose(1, 2))
    sim = torch.cat(sims).mean(0).double().numpy()
    iu = np.triu_indices(g * g, k=1)
    return float(spearmanr(sim[iu], -manhattan_distance(g, g)[iu]).statistic)


def streaming(batches: list[torch.Tensor], g: int, dtype: torch.dtype) -> float:
    m = SSDC(g, g, dtype=dtype)
    for x in batches:
        m.update(x)
    return m.value()


def rss_kib() -> dict[str, int]:
    s = open("/proc/self/status").read()
    return {k: int(re.search(rf"{k}:\s+(\d+)", s).group(1)) for k in ("VmRSS", "VmHWM")}


def child(case: int, impl: str, dtype: str, repeats: int) -> dict[str, float]:
    """Run one implementation once for memory, then `repeats` more times for time."""
    _, g, d, n, b = CASES[case]
    fn, dt = {"naive": naive, "streaming": streaming}[impl], DTYPES[dtype]
    batches = features(g, d, n, b)
    fn(batches[:1], g, dt)  # warm-up: thread pool, allocator, scipy import paths
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = rss_kib()["VmRSS"]
    value = fn(batches, g, dt)
    peak = rss_kib()["VmHWM"] - before
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn(batches, g, dt)
        times.append(time.perf_counter() - t)
    item = 8 if dtype == "float64" else 4
    kept = n * (g * g) ** 2 * item if impl == "naive" else (g * g) ** 2 * 8
    return {"value": value, "time_s": min(times), "peak_mib": peak / 1024, "kept_mib": kept / 2**20}


def mem_ratio(naive_mib: float, streaming_mib: float) -> str:
    """Streaming peaks under 1 MiB (reused warm-up pages) are floored at 1 MiB: a lower bound."""
    return f">={naive_mib:.0f}x" if streaming_mib < 1 else f"{naive_mib / streaming_mib:.1f}x"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)  # case impl dtype
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        case, impl, dtype = args.child
        print(json.dumps(child(int(case), impl, dtype, args.repeats)))
        return
    rows = []
    for case, (name, g, d, n, b) in enumerate(CASES):
        for dtype in DTYPES:
            r = {"case": name, "T": g * g, "D": d, "N": n, "batch": b, "dtype": dtype}
            for impl in ("streaming", "naive"):
                cmd = [sys.executable, __file__, "--child", str(case), impl, dtype]
                cmd += ["--threads", str(args.threads), "--repeats", str(args.repeats)]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                r[impl] = json.loads(out.strip().splitlines()[-1])
            rows.append(r)
    print(f"torch {torch.__version__}, {args.threads} threads, best of {args.repeats} runs")
    print(
        "| case | precision | streaming s | naive s | time naive/streaming | streaming peak MiB "
        "| naive peak MiB | peak naive/streaming | naive kept MiB | SSDC streaming | |naive - streaming| |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        s, v = r["streaming"], r["naive"]
        print(
            f"| {r['case']}, N={r['N']} | {r['dtype']} | {s['time_s']:.3f} | {v['time_s']:.3f} | "
            f"{v['time_s'] / s['time_s']:.2f}x | {s['peak_mib']:.1f} | {v['peak_mib']:.1f} | "
            f"{mem_ratio(v['peak_mib'], s['peak_mib'])} | {v['kept_mib']:.0f} | "
            f"{s['value']:.12f} | {abs(v['value'] - s['value']):.1e} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
