"""Training throughput: poslens ViT vs timm's VisionTransformer of the same shape, same run.

Reports images/s of one full training step (forward, backward, AdamW) in fp32 and bf16 autocast,
the ratio to timm, and the achieved matmul GFLOP/s against a matmul peak measured in this run.

    python benchmarks/train_throughput.py [--steps 20] [--batch 128]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch
import torch.nn.functional as F

from poslens.models import ModelConfig, build_model


def matmul_peak(dtype: torch.dtype, n: int = 2048, reps: int = 10) -> float:
    """GFLOP/s of a large square matmul: the practical peak of this machine for `dtype`."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(3):
        a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e9


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


def images_per_s(
    model: torch.nn.Module, cfg: ModelConfig, batch: int, steps: int, bf16: bool
) -> float:
    """Median-of-steps throughput of forward + backward + AdamW step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(batch, cfg.in_chans, cfg.image_size, cfg.image_size)
    y = torch.randint(0, cfg.num_classes, (batch,))
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    times = []
    for i in range(steps + 3):
        t = time.perf_counter()
        with ctx():
            loss = F.cross_entropy(model(x).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i >= 3:
            times.append(time.perf_counter() - t)
    times.sort()
    return batch / times[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=64, help="default: the training default")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    torch.manual_seed(0)
    peak = {"fp32": matmul_peak(torch.float32), "bf16": matmul_peak(torch.bfloat16)}
    rows = []
    for posenc in ("ape", "rope_axial"):
        cfg = ModelConfig(posenc=posenc)
        flops = build_model(cfg).flops_per_image(train=True)
        for prec in ("fp32", "bf16"):
            ours = images_per_s(
                build_model(cfg, seed=0).train(), cfg, args.batch, args.steps, prec == "bf16"
            )
            theirs = images_per_s(
                timm_vit(cfg).train(), cfg, args.batch, args.steps, prec == "bf16"
            )
            gflops = ours * flops / 1e9
            rows.append(
                {
                    "posenc": posenc,
                    "precision": prec,
                    "poslens_img_s": ours,
                    "timm_img_s": theirs,
                    "ratio": ours / theirs,
                    "gflop_s": gflops,
                    "peak_gflop_s": peak[prec],
                    "frac_of_peak": gflops / peak[prec],
                }
            )
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch}, "
        f"matmul peak fp32 {peak['fp32']:.0f} / bf16 {peak['bf16']:.0f} GFLOP/s"
    )
    print(
        "| model (poslens) | precision | poslens img/s | timm img/s (APE ViT) | ratio | GFLOP/s | % of peak |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['posenc']} | {r['precision']} | {r['poslens_img_s']:.0f} | {r['timm_img_s']:.0f} | "
            f"{r['ratio']:.2f}x | {r['gflop_s']:.0f} | {r['frac_of_peak']:.0%} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"peak": peak, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
