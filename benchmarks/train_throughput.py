"""Training throughput: poslens ViT vs timm's VisionTransformer of the same shape, and S seeds
trained as one ensemble vs S sequential runs, same run.

One training step is forward, backward, gradient-norm clipping (per model) and AdamW, at the
default study's model size (width 32, depth 4, 4 heads, 24x24 images, patch 4, batch 64). For
APE and RoPE-Axial, in fp32 and bf16 autocast, at one thread and at all threads, it reports
images/s of one poslens model (what S sequential runs achieve), of timm's APE ViT (and, for
RoPE-Axial, timm's naver-style RoPE ViT of the same shape), and of an S-seed ensemble
(`poslens.training.ensemble`) counted over all its seeds (S x batch images per step), with the
ratio to sequential runs and the achieved GFLOP/s (images/s x the model's
flops_per_image(train=True)) as a share of a large matmul's GFLOP/s measured in this run at the
same thread count. A precision this CPU does not run natively is skipped with a note (bf16
without AVX512-BF16/AMX crawls). Candidates are measured in interleaved rounds; the table gives
the median round and the range over rounds, since other processes may share the cores.

    python benchmarks/train_throughput.py [--seeds 2,5] [--precisions fp32,bf16] [--threads 1,0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from poslens.allocator import keep_freed_memory
from poslens.models import ModelConfig, build_model
from poslens.models.ensemble import StackedViT
from poslens.models.timm_export import timm_kwargs
from poslens.precision import autocast, native_bf16
from poslens.training.config import RunConfig, TrainConfig
from poslens.training.ensemble import train_step
from poslens.training.train import make_optimizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
Clock = Callable[[], float]


def matmul_peak(dtype: torch.dtype, clock: Clock, n: int = 2048, reps: int = 5) -> float:
    """GFLOP/s of a large square matmul, best of 3: the practical peak for `dtype` right now."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = 0.0
    for _ in range(3):
        t = clock()
        for _ in range(reps):
            a @ b
        best = max(best, 2 * n**3 * reps / (clock() - t) / 1e9)
    return best


def timm_vit(cfg: ModelConfig) -> torch.nn.Module:
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(
        img_size=cfg.image_size,
        patch_size=cfg.patch_size,
        in_chans=cfg.in_chans,
        num_classes=cfg.num_classes,
        embed_dim=cfg.dim,
        depth=cfg.depth,
        num_heads=cfg.heads,
        mlp_ratio=cfg.mlp_ratio,
        no_embed_class=True,
        global_pool="token",
    )


def timm_rope_vit(cfg: ModelConfig) -> torch.nn.Module | None:
    """timm's naver-style RoPE ViT (Eva with rotary attention) of a rope_axial config's shape:
    the like-for-like alternative for a rotary model (None for any other encoding)."""
    if cfg.posenc != "rope_axial":
        return None
    from timm.models.eva import Eva

    return Eva(**timm_kwargs(cfg))


Step = Callable[[], None]


def single_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, precision: str) -> Step:
    """One training step of one model, as train() takes it."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        with autocast(x.device, precision):
            loss = F.cross_entropy(model(x).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step


def ensemble_step(
    cfg: ModelConfig,
    seeds: int,
    x: torch.Tensor,
    y: torch.Tensor,
    precision: str,
    compile: bool,
    device: str = "cpu",
) -> Step:
    """One training step of an ensemble of `seeds` members, as train_ensemble() takes it, on
    `device` (where x and y must be; benchmarks/gpu_check.py times it on a GPU)."""
    model = StackedViT([build_model(cfg, seed=s) for s in range(seeds)]).to(device)
    opt = make_optimizer(model.named_stacked(), RunConfig(train=TrainConfig()), member_dims=1)
    if compile:
        model.compile()

    def step() -> None:
        train_step(model, opt, x, y, 1e-3, precision, 1.0)

    return step


def measure(
    candidates: dict[str, Step], rounds: int, steps: int, clock: Clock
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Seconds per step of each candidate in each round (rounds interleave the candidates), and
    the seconds of each one's first step (torch.compile compiles then)."""
    first = {}
    for name, step in candidates.items():  # warm up: allocator, caches, oneDNN primitives
        t = time.perf_counter()  # wall: compiling runs in worker processes
        step()
        first[name] = time.perf_counter() - t
        step()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, step in candidates.items():
            t = clock()
            for _ in range(steps):
                step()
            times[name].append((clock() - t) / steps)
    return times, first


def bench_config(
    cfg: ModelConfig,
    batch: int,
    precision: str,
    seeds: list[int],
    rounds: int,
    steps: int,
    clock: Clock,
    timm: bool = True,
    compile: bool = False,
    cls_exit: bool = True,
) -> list[dict[str, Any]]:
    """One row per candidate (poslens; unless `timm` is off, timm's APE ViT and for rope_axial its
    RoPE ViT; an ensemble per size in `seeds`, also compiled with `compile`) of one model config
    at one precision, measured together (the single poslens model without its CLS exit unless
    `cls_exit`):
    run, seeds, img_s (median round, all seeds), img_s_range, gflop_s, first_step_s."""
    flops = build_model(cfg).flops_per_image(train=True)
    x = torch.randn(batch, cfg.in_chans, cfg.image_size, cfg.image_size)
    y = torch.randint(0, cfg.num_classes, (batch,))
    single = build_model(cfg, seed=0)
    single.train_cls_exit = cls_exit  # the plain training step's CLS exit (on by default)
    candidates = {"poslens": single_step(single, x, y, precision)}
    if timm:
        candidates["timm"] = single_step(timm_vit(cfg), x, y, precision)
        if (rope := timm_rope_vit(cfg)) is not None:
            candidates["timm rope"] = single_step(rope, x, y, precision)
    for s in seeds:
        for comp in (False, True) if compile else (False,):
            name = f"ensemble{s}" + (" compiled" if comp else "")
            candidates[name] = ensemble_step(cfg, s, x, y, precision, comp)
    times, first = measure(candidates, rounds, steps, clock)
    rows: list[dict[str, Any]] = []
    for name, ts in times.items():
        ens = name.startswith("ensemble")
        members = int(name.split()[0].removeprefix("ensemble")) if ens else 1
        # images/s over all seeds: what S sequential runs are compared by
        rates = sorted(members * batch / t for t in ts)
        median = statistics.median(rates)
        rows.append({
            "run": name, "seeds": members, "img_s": median, "img_s_range": [rates[0], rates[-1]],
            "gflop_s": median * flops / 1e9, "first_step_s": first[name],
        })  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="5", help="ensemble sizes, comma-separated (default 5)")
    p.add_argument("--precisions", default="fp32,bf16", help="fp32, bf16 or both (default)")
    p.add_argument("--models", default="ape,rope_axial", help="encodings (default ape,rope_axial)")
    p.add_argument("--threads", default="1,0", help="thread counts to run at; 0: all (default 1,0)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument(
        "--clock",
        choices=tuple(CLOCKS),
        default="wall",
        help="wall (default), or cpu: this process's CPU seconds, which other processes on the "
        "cores do not inflate; at 1 thread the work per second of a core of one's own, at more "
        "threads it also counts the threads' waiting",
    )
    p.add_argument("--steps", type=int, default=3, help="timed steps per candidate and round")
    p.add_argument("--batch", type=int, default=64, help="default: the training default")
    p.add_argument("--dim", type=int, default=32, help="default: the default study's width")
    p.add_argument("--depth", type=int, default=4, help="default: the default study's depth")
    p.add_argument("--image", type=int, default=24, help="image size (default: the study's)")
    p.add_argument("--no-timm", action="store_true", help="leave out timm's ViT")
    p.add_argument("--compile", action="store_true", help="also each ensemble under torch.compile")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    clock = CLOCKS[args.clock]
    keep_freed_memory()  # as the CLI does for its training processes
    all_threads = torch.get_num_threads()
    seeds = [int(s) for s in args.seeds.split(",")]
    precisions = args.precisions.split(",")
    if "bf16" in precisions and not native_bf16(torch.device("cpu")):
        print("note: skipping bf16: this CPU has no native bf16 (no AVX512-BF16 or AMX)")
        precisions.remove("bf16")
    torch.manual_seed(0)
    rows, peaks = [], {}
    for threads in [int(t) or all_threads for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for prec in precisions:
            peaks[threads, prec] = matmul_peak(DTYPES[prec], clock)
        for posenc in args.models.split(","):
            cfg = ModelConfig(posenc=posenc, dim=args.dim, depth=args.depth, image_size=args.image)
            for prec in precisions:
                for r in bench_config(cfg, args.batch, prec, seeds, args.rounds, args.steps, clock,
                                      timm=not args.no_timm, compile=args.compile):  # fmt: skip
                    peak = peaks[threads, prec]
                    rows.append({
                        "threads": threads, "posenc": posenc, "precision": prec, **r,
                        "peak_gflop_s": peak, "frac_of_peak": r["gflop_s"] / peak,
                    })  # fmt: skip
    seq = {
        (r["threads"], r["posenc"], r["precision"]): r["img_s"]
        for r in rows
        if r["run"] == "poslens"
    }
    print(f"torch {torch.__version__}, batch {args.batch}, width {args.dim}, depth {args.depth}, {args.image} px, {args.clock} clock; "
          "matmul peak GFLOP/s: "
          + ", ".join(f"{p} {t} thread(s) {v:.0f}" for (t, p), v in peaks.items()))  # fmt: skip
    print("| threads | model | precision | run | img/s, all seeds (range) | vs sequential | "
          "GFLOP/s | % of peak |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = r["img_s"] / seq[r["threads"], r["posenc"], r["precision"]]
        lo, hi = r["img_s_range"]
        run = {
            "poslens": "poslens (sequential)",
            "timm": "timm APE ViT",
            "timm rope": "timm RoPE ViT (Eva)",
        }.get(r["run"], f"ensemble of {r['seeds']}")
        if r["run"].endswith("compiled"):
            run += f", compiled (first step {r['first_step_s']:.0f} s)"
        print(f"| {r['threads']} | {r['posenc']} | {r['precision']} | {run} | "
              f"{r['img_s']:.0f} ({lo:.0f}-{hi:.0f}) | {ratio:.2f}x | "
              f"{r['gflop_s']:.0f} | {r['frac_of_peak']:.0%} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"clock": args.clock, "peaks": {f"{p}@{t}": v for (t, p), v in peaks.items()}, "rows": rows},
                      f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
