"""Attention on CPU: the explicit softmax(q k^T / sqrt(dh)) v that poslens writes out against
torch's fused F.scaled_dot_product_attention, same inputs, same run.

poslens takes the fused kernel whenever nobody hooks the scores or the pattern and, on CPU, when
autograd does not record the call (inference, analysis); training keeps the explicit path. This
benchmark is the measurement behind that rule: forward only under torch.no_grad, and forward plus
backward, in fp32 and bf16, for the default study model's shape (analysis batch 250, training
batch 64) and ViT-B/16 at 224 px (batch 8). Times are the minimum over repeats, the two paths
interleaved; the ratio is fused / explicit (below 1: the fused kernel is faster).

    python benchmarks/attention_cpu.py [--threads 1] [--repeats 25]

--slices instead measures the CPU training kernels (poslens.models.attention): forward plus
backward in fp32 at the scale ladder's attention shapes (batch 64, 4 heads; grid 6, 8, 10, 14;
head dim 8, 16 and 32), the formula written out over the whole batch against batch slices of
0.25 to 4 MB of scores and against the fused kernel, time of each over the whole batch's, with
freed memory kept as training keeps it (poslens.allocator).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from poslens.allocator import keep_freed_memory
from poslens.models import attention

Attn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """What poslens' Attention computes when the pattern is read or autograd records on CPU."""
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)  # [B, H, T, T]
    return scores.softmax(dim=-1) @ v


def fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v)


def case(
    shape: tuple[int, int, int, int], dtype: torch.dtype, grad: bool, repeats: int
) -> dict[str, object]:
    """Minimum seconds of each path on q, k, v [B, H, T, dh] laid out as the model's qkv split."""
    B, H, T, dh = shape
    torch.manual_seed(0)
    qkv = torch.randn(B, T, 3 * H * dh, dtype=dtype, requires_grad=grad)
    q, k, v = qkv.reshape(B, T, 3, H, dh).permute(2, 0, 3, 1, 4)  # views, as in the model
    paths: dict[str, Attn] = {"explicit": explicit, "fused": fused}
    best = dict.fromkeys(paths, float("inf"))
    for r in range(repeats + 2):  # the first two rounds warm up
        for name in list(paths)[r % 2 :] + list(paths)[: r % 2]:
            t = time.perf_counter()
            if grad:
                paths[name](q, k, v).sum().backward()
            else:
                with torch.no_grad():
                    paths[name](q, k, v)
            if r >= 2:
                best[name] = min(best[name], time.perf_counter() - t)
    return {
        "shape_BHTdh": list(shape),
        "dtype": str(dtype).removeprefix("torch."),
        "pass": "forward+backward" if grad else "forward, no_grad",
        "ms": {k: round(v * 1e3, 2) for k, v in best.items()},
        "fused_over_explicit": round(best["fused"] / best["explicit"], 2),
        "poslens_takes": "explicit" if grad else "fused",
    }


def sliced_case(shape: tuple[int, int, int, int], budgets: list[int], repeats: int) -> dict:
    """Minimum seconds of forward plus backward (fp32) of the written-out attention over the
    whole batch and in slices of each budget (bytes of scores), as the model's qkv views."""
    B, H, T, dh = shape
    torch.manual_seed(0)
    qkv = torch.randn(B, T, 3 * H * dh, requires_grad=True)
    q, k, v = qkv.reshape(B, T, 3, H, dh).permute(2, 0, 3, 1, 4)
    runs: dict[str, int | None] = {"whole": 2**62, **{f"{b / 2**20:g} MB": b for b in budgets}}
    runs["fused"] = None
    best = dict.fromkeys(runs, float("inf"))
    before = attention.SLICE_BYTES
    try:
        for r in range(repeats + 2):  # the first two rounds warm up
            for name, budget in runs.items():
                t = time.perf_counter()
                if budget is None:
                    F.scaled_dot_product_attention(q, k, v).sum().backward()
                else:
                    attention.SLICE_BYTES = budget
                    attention.sliced_attention(q, k, v, dh**-0.5).sum().backward()
                if r >= 2:
                    best[name] = min(best[name], time.perf_counter() - t)
    finally:
        attention.SLICE_BYTES = before
    return {
        "shape_BHTdh": list(shape),
        "rows_per_slice": {
            n: attention.slice_rows(B, H, T, T, b) for n, b in runs.items() if b is not None
        },
        "ms": {k: round(v * 1e3, 2) for k, v in best.items()},
        "over_whole": {k: round(v / best["whole"], 2) for k, v in best.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=25)
    p.add_argument("--slices", action="store_true", help="the sliced training kernel instead")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), min of {args.repeats}")
    if args.slices:
        keep_freed_memory()  # as training does
        budgets = [2**18, 2**19, 2**20, 2**21, 2**22]
        for grid in (6, 8, 10, 14):
            for dh in (8, 16, 32):
                shape = (64, 4, grid * grid + 1, dh)
                print(json.dumps(sliced_case(shape, budgets, args.repeats)))
        return
    shapes = {
        "default model, analysis batch": ((250, 4, 65, 32), (False,)),
        "default model, training batch": ((64, 4, 65, 32), (False, True)),
        "ViT-B/16 224 px": ((8, 12, 197, 64), (False, True)),
    }
    for label, (shape, grads) in shapes.items():
        for dtype in (torch.float32, torch.bfloat16):
            for grad in grads:
                print(json.dumps({"case": label, **case(shape, dtype, grad, args.repeats)}))


if __name__ == "__main__":
    main()
