"""Mask a RoPE checkpoint's rotary planes by axis and read the accuracy.

    python examples/mask_rotary_planes.py CHECKPOINT [--blocks 0,1] [--images 500]

`axis_map` measures which coordinate each rotation plane follows from the rotation tables the
model uses; `rotary_mask` turns planes into identities (no rotation) inside a `with` block and
restores the model on exit. Prints the test accuracy and the output's KL divergence from the
intact model with the row planes off, with the column planes off, with as many random planes off
as there are row planes, and with every plane off, in the chosen blocks (default all).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

import poslens
from poslens.interventions import axis_map, rotary_mask


@torch.no_grad()
def logits_of(model: poslens.ViT, x: torch.Tensor, batch: int = 256) -> torch.Tensor:
    return torch.cat([model(x[i : i + batch]) for i in range(0, len(x), batch)]).float()


def masked_accuracy(
    model: poslens.ViT, x: torch.Tensor, y: torch.Tensor, blocks: Sequence[int], seed: int = 0
) -> dict[str, Any]:
    """Per condition: accuracy and KL(intact || masked) of the output; the axis map's counts."""
    amap = axis_map(model)  # [depth, heads, planes] arrays; axis is "row", "col", "mixed", "none"
    row, col = amap.row_mask, amap.col_mask  # bool [depth, heads, planes]
    rng = np.random.default_rng(seed)
    random = np.zeros_like(row)
    for b in range(row.shape[0]):  # as many random planes as row planes, in each block and head
        for h in range(row.shape[1]):
            random[b, h, rng.choice(row.shape[2], int(row[b, h].sum()), replace=False)] = True
    conditions = {
        "row planes off": row,
        "column planes off": col,
        "random planes off": random,
        "all planes off": None,
    }
    intact = logits_of(model, x).log_softmax(-1)
    out = {"intact": {"accuracy": float((intact.argmax(-1) == y).float().mean()), "kl": 0.0}}
    for name, planes in conditions.items():
        with rotary_mask(model, planes=planes, blocks=blocks):
            masked = logits_of(model, x).log_softmax(-1)
        kl = (intact.exp() * (intact - masked)).sum(-1).mean()
        out[name] = {"accuracy": float((masked.argmax(-1) == y).float().mean()), "kl": float(kl)}
    return {"counts": amap.counts(), "conditions": out}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="a poslens RoPE checkpoint folder")
    parser.add_argument("--blocks", help="comma-separated blocks to mask (default all)")
    parser.add_argument("--images", type=int, default=500, help="test images")
    args = parser.parse_args(argv)

    model = poslens.load(args.checkpoint)
    x, y = poslens.load_task(args.checkpoint).split("test")
    x, y = x[: args.images], y[: args.images]
    blocks = range(model.cfg.depth) if not args.blocks else [int(b) for b in args.blocks.split(",")]
    out = masked_accuracy(model, x, y, list(blocks))
    print(f"{model.cfg.posenc}: rotary planes by axis {out['counts']}; blocks {list(blocks)}")
    for name, r in out["conditions"].items():
        print(f"{name:<20} accuracy {r['accuracy']:.3f}  KL from intact {r['kl']:.3g}")
    return out


if __name__ == "__main__":
    main()
