"""Forward time of a converted timm ViT in poslens against timm's own forward, same weights, same
inputs, same run: plain, with every hook cached (run_with_cache), with every hook but the per-head
outputs cached, and under a rotary mask.

The timm model gets random weights (pretrained=False, no download); they are saved to a temporary
safetensors file and loaded with poslens.load("timm:NAME", weights=...), the user's path. Each
repeat times every variant once, in an order rotated by one per repeat (so drift and the
allocator state left by the previous variant hit all alike); medians are reported.

Ratios to timm: of the median times, and the quartiles of the per-repeat (paired) ratios. Two
clocks: wall time, and CPU time of this process (user + kernel), which other jobs on a shared
machine inflate less (they still share caches and memory bandwidth). Kernel time and minor page
faults are reported too: the per-head outputs `attn.hook_result` are [B, T, H, D], H times the
residual stream per block, and they are most of what a full cache costs on CPU: writing and
summing them, and the kernel's page faults for their fresh memory (see docs/benchmarks.md, "Pretrained forward pass").

Each configuration runs twice, in its own process: with the allocator setting the CLI makes for
itself (poslens.keep_freed_memory: big freed blocks are reused), and with glibc's default, which
maps every block over 32 MiB fresh and page-faults it in again on every forward.

    python benchmarks/pretrained_forward.py [--models vit_base_patch16_224,...] [--batch 8]
        [--threads 1] [--repeats 10] [--malloc both|keep_freed|default]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

import poslens
from poslens.interventions import rotary_mask


def timed(fn: Callable[[], object]) -> tuple[float, float, float, int]:
    """(wall s, CPU s, kernel s, minor page faults) of one call, freeing what it returns."""
    r0, w0, c0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), time.process_time()
    fn()  # the result (a cache) is dropped inside the timed region, as a caller's loop would
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return wall, cpu, r1.ru_stime - r0.ru_stime, r1.ru_minflt - r0.ru_minflt


def paired(variant: list[tuple[float, ...]], timm: list[tuple[float, ...]]) -> list[float]:
    """[25th percentile, median, 75th percentile] of the per-repeat wall-time ratio: each repeat
    times the variant and timm within seconds of each other, so slow drift cancels in the ratio."""
    q1, med, q3 = statistics.quantiles(
        [v[0] / t[0] for v, t in zip(variant, timm, strict=True)], n=4
    )
    return [round(q1, 3), round(med, 3), round(q3, 3)]


def cache_mib(cache: dict[str, torch.Tensor]) -> float:
    """Memory held by a cache, counting each storage once (q, k, v share the qkv buffer)."""
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in cache.values()
    }
    return sum(storages.values()) / 2**20


def bench(name: str, batch: int, repeats: int, warmup: int) -> dict[str, object]:
    import timm

    torch.manual_seed(0)
    tm = timm.create_model(name, pretrained=False).eval()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "w.safetensors"
        save_file({k: v.contiguous() for k, v in tm.state_dict().items()}, str(path))
        model = poslens.load(f"timm:{name}", weights=path)
    size = model.cfg.image_size
    x = torch.randn(batch, 3, size, size)
    every_hook = model.hook_names()
    no_result = [n for n in every_hook if not n.endswith("attn.hook_result")]

    def masked() -> object:
        with rotary_mask(model):  # all planes of every block and head: position removed
            return model(x)

    variants: dict[str, Callable[[], object]] = {
        "timm": lambda: tm(x),
        "poslens": lambda: model(x),
        "full_cache": lambda: model.run_with_cache(x, every_hook),
        "cache_no_result": lambda: model.run_with_cache(x, no_result),
    }
    if model.rotary is not None:
        variants["rotary_mask"] = masked
    names = list(variants)
    runs: dict[str, list[tuple[float, float, float, int]]] = {k: [] for k in names}
    with torch.no_grad():
        diff = (model(x) - tm(x)).abs().max().item()
        mib = {
            "full_cache": cache_mib(model.run_with_cache(x, every_hook)[1]),
            "cache_no_result": cache_mib(model.run_with_cache(x, no_result)[1]),
        }
        for _ in range(warmup):
            for fn in variants.values():
                fn()
        for r in range(repeats):
            for k in names[r % len(names) :] + names[: r % len(names)]:
                runs[k].append(timed(variants[k]))
    wall, cpu, kernel, faults = (
        {k: statistics.median(v[i] for v in runs[k]) for k in names} for i in range(4)
    )
    return {
        "model": name,
        "posenc": model.cfg.posenc,
        "batch": batch,
        "malloc": "keep_freed" if poslens.allocator.kept() else "default",
        "hooks_cached": {"full_cache": len(every_hook), "cache_no_result": len(no_result)},
        "cache_mib": {k: round(v) for k, v in mib.items()},
        "max_logit_diff": diff,
        "seconds": {k: round(v, 4) for k, v in wall.items()},
        "ratio_to_timm": {k: round(v / wall["timm"], 3) for k, v in wall.items() if k != "timm"},
        "paired_ratio_to_timm": {k: paired(runs[k], runs["timm"]) for k in names if k != "timm"},
        "cpu_seconds": {k: round(v, 4) for k, v in cpu.items()},
        "cpu_ratio_to_timm": {k: round(v / cpu["timm"], 3) for k, v in cpu.items() if k != "timm"},
        "kernel_seconds": {k: round(v, 3) for k, v in kernel.items()},
        "minor_faults": {k: int(v) for k, v in faults.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="vit_base_patch16_224,vit_base_patch16_rope_224")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--malloc",
        choices=("both", "keep_freed", "default"),
        default="both",
        help="keep_freed: the CLI's allocator setting (poslens.keep_freed_memory); default: glibc "
        "as found; both: each in its own process (the setting is process-wide)",
    )
    args = p.parse_args()
    if args.malloc == "both":
        for mode in ("keep_freed", "default"):  # argparse keeps the last --malloc given
            subprocess.run(
                [sys.executable, __file__, *sys.argv[1:], f"--malloc={mode}"], check=True
            )
        return
    if args.malloc == "keep_freed" and not poslens.keep_freed_memory():
        sys.exit("keep_freed_memory() made no setting here (not glibc, or the user's own choice)")
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), batch {args.batch}, "
        f"malloc {args.malloc}"
    )
    print(
        "full_cache: every hook; cache_no_result: every hook but attn.hook_result (per-head "
        "outputs [B, T, H, D], TransformerLens's use_attn_result)"
    )
    for name in args.models.split(","):
        print(json.dumps(bench(name.strip(), args.batch, args.repeats, args.warmup)))


if __name__ == "__main__":
    main()
