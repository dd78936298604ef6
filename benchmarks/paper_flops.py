"""The paper preset's forward FLOPs on pretrained ViT-B/16s at 224 px: counted, not run.

`poslens study --preset paper --pretrained timm:vit_base_patch16_224=... --pretrained
timm:vit_base_patch16_rope_224=...` (5,000 evaluation images, 1,000 for the probes and SSDC, every
experiment, the in-situ controls, 3 analysis seeds) is a GPU job. This script counts what it
would compute without running it at that size: every run and stage of the study's own plan runs
on a stand-in with a ViT-B's depth, width and heads (random weights) but 32 px images (a 2 x 2
patch grid) and 1/100 of every image count; a hook on every block records the tokens it sees,
and each block call is costed at 224 px (the grid's side x 7: 14 x 14 patches + CLS) and 100x
the images. Matmul FLOPs per block as ViT.flops_per_image: 2 T (4 D^2 + 2 D H) + 4 T^2 D, plus
the patch embedding and the classifier per image through the model.

What depends on the weights is the stand-in's: the probe site (heads' carrying skips block-head
units at or after it) and the axis map. The count is printed per model, control and
experiment, with the total and its time at a stated sustained rate.

    python benchmarks/paper_flops.py [--seeds 3] [--tflops 400]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

from poslens.data import DataConfig, build_task
from poslens.experiments import sae_causal
from poslens.experiments.analyze import analyze
from poslens.interventions import in_situ
from poslens.models.config import ModelConfig
from poslens.models.vit import ViT, build_model
from poslens.study.config import preset
from poslens.study.plan import make_plan

SCALE = 100  # the stand-in's image counts are the preset's / SCALE
SIDE = 7  # the stand-in's 2 x 2 grid -> a ViT-B's 14 x 14 at 224 px
MODELS = {  # the original's two ViT-B/16s, as poslens reads them
    "vit_base_patch16_224": "ape",
    "vit_base_patch16_rope_224": "rope_axial",
}


def block_flops(tokens: int, dim: int, hidden: int) -> float:
    """Matmul FLOPs of one block on one image of `tokens` tokens."""
    return 2 * tokens * (4 * dim * dim + 2 * dim * hidden) + 4 * tokens * tokens * dim


def stand_in(posenc: str, num_classes: int) -> ViT:
    """A ViT-B/16's shape (depth 12, width 768, 12 heads) at 32 px, random weights."""
    cfg = ModelConfig(image_size=32, patch_size=16, in_chans=1, num_classes=num_classes, dim=768,
                      depth=12, heads=12, posenc=posenc, rope_theta=100.0)  # fmt: skip
    return build_model(cfg, seed=0).eval()


def scaled(cfg: object) -> object:
    """An experiment config with every image count / SCALE."""
    changes = {}
    for name in ("n_images", "probe_images", "ssdc_images", "train_images"):
        if hasattr(cfg, name) and getattr(cfg, name):
            changes[name] = max(1, getattr(cfg, name) // SCALE)
    return dataclasses.replace(cfg, **changes)  # type: ignore[type-var]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3, help="analysis seeds (the paper preset's 3)")
    ap.add_argument("--tflops", type=float, default=400.0,
                    help="sustained bf16 TFLOP/s to convert to time (an H100 reaches 400-600)")  # fmt: skip
    args = ap.parse_args()
    torch.set_num_threads(1)
    sae_causal.config.SELECTION_IMAGES //= SCALE  # type: ignore[attr-defined]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "images").mkdir()
        pretrained = []
        for name in MODELS:
            (root / f"{name}.safetensors").touch()
            pretrained.append(f"timm:{name}={root / name}.safetensors")
        cfg = preset("paper", pretrained=tuple(pretrained), images=str(root / "images"), seeds=1)
        plan = make_plan(cfg, root / "out")
        n = cfg.n_images // SCALE
        task = build_task(DataConfig(image_size=32, n_val=4 * n, n_test=n))
        seen: list[tuple[int, int, bool]] = []  # (images, tokens, block 0?) per block call
        per: dict[str, float] = defaultdict(float)
        passes: dict[str, int] = defaultdict(int)
        for run in plan.runs:
            model = stand_in(MODELS[run.base], task.num_classes)
            if run.edit:
                if not in_situ.get(run.edit).applies(model.cfg):
                    continue
                in_situ.apply(model, run.edit)
            for b, block in enumerate(model.blocks):
                block.register_forward_pre_hook(
                    lambda m, i, b=b: seen.append((i[0].shape[0], i[0].shape[1], b == 0))
                )
            for stage in run.stages:
                seen.clear()
                if stage.kind == "load":
                    x, _ = task.split("test")
                    with torch.no_grad():
                        model(x[:n])
                else:
                    assert stage.config is not None
                    analyze(model, task, [stage.kind], [scaled(stage.config)], root / "a",
                            formats=())  # fmt: skip
                flops = 0.0
                for images, tokens, first in seen:
                    grid = math.isqrt(tokens - model.cfg.num_prefix)
                    real = model.cfg.num_prefix + (grid * SIDE) ** 2
                    flops += images * SCALE * block_flops(real, 768, 3072)
                    if first:  # the patch embedding and the classifier, once per image
                        flops += images * SCALE * (2 * (real - 1) * 768 * 768 + 2 * 768 * 1000)
                key = f"{run.model} {stage.kind}"
                per[key] += flops * args.seeds
                passes[key] += sum(i for i, _, _ in seen) * SCALE // model.cfg.depth * args.seeds
    total = sum(per.values())
    print(f"paper preset, {args.seeds} analysis seeds, ViT-B/16 at 224 px: forward matmul FLOPs")
    print("| run | stage | PFLOP | image-passes (block calls / depth) |")
    print("|---|---|---|---|")
    for key, f in sorted(per.items(), key=lambda kv: -kv[1]):
        m, stage = key.rsplit(" ", 1)
        print(f"| {m} | {stage} | {f / 1e15:.2f} | {passes[key]:,} |")
    print(f"| **total** | | **{total / 1e15:.1f}** | |")
    print(f"at a sustained {args.tflops:.0f} TFLOP/s: {total / (args.tflops * 1e12) / 3600:.1f} h")


if __name__ == "__main__":
    main()
