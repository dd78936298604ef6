"""Probe a checkpoint's residual stream for patch position, block by block.

    python examples/probe_residual.py CHECKPOINT [--images 200]

Caches the patch tokens of the residual stream entering every block and leaving the last one
(one forward pass, `run_with_cache`), fits linear exact-cell, row and column probes at each
depth (poslens.metrics.probes: 60/20/20 image split, L2 chosen on validation) and prints their
test accuracy beside chance. The same probes fitted on shuffled labels are the control: they
should sit at chance.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import torch

import poslens
from poslens.metrics.probes import TARGETS, fit_position_probes
from poslens.models import hooks


def residual_sites(model: poslens.ViT) -> list[str]:
    """The residual stream entering each block, then leaving the last one."""
    depth = model.cfg.depth
    return [hooks.resid_pre(b) for b in range(depth)] + [hooks.resid_post(depth - 1)]


def by_target(values: Sequence[float]) -> dict[str, float]:
    return {t: float(v) for t, v in zip(TARGETS, values, strict=True)}


@torch.no_grad()
def probe_by_depth(model: poslens.ViT, images: torch.Tensor, seed: int = 0) -> dict[str, Any]:
    """Probe test accuracy per site and target, the shuffled-label control's, and chance."""
    sites = residual_sites(model)
    _, cache = model.run_with_cache(images, sites)
    p = model.cfg.num_prefix  # CLS / register tokens carry no grid position
    feats = torch.stack([cache[s][:, p:].float() for s in sites])  # [sites, images, tokens, D]
    gh, gw = model.grid_of(images[:1])
    probes = fit_position_probes(feats, gh, gw, seed=seed)
    control = fit_position_probes(feats, gh, gw, seed=seed, shuffle_labels=True)
    return {
        "sites": sites,
        "accuracy": {s: by_target(probes.test_acc[i]) for i, s in enumerate(sites)},
        "control": {s: by_target(control.test_acc[i]) for i, s in enumerate(sites)},
        "chance": by_target(probes.chance),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="a poslens checkpoint folder")
    parser.add_argument("--images", type=int, default=200, help="test images probed")
    args = parser.parse_args(argv)

    model = poslens.load(args.checkpoint)
    images, _ = poslens.load_task(args.checkpoint).split("test")
    out = probe_by_depth(model, images[: args.images])
    chance = out["chance"]
    print(f"position probes on {args.checkpoint} ({model.cfg.posenc}), test accuracy")
    print(f"{'site':<26}" + "".join(f"{t:>8}" for t in TARGETS) + "   (shuffled-label control)")
    for s in out["sites"]:
        acc, ctl = out["accuracy"][s], out["control"][s]
        print(
            f"{s:<26}"
            + "".join(f"{acc[t]:8.3f}" for t in TARGETS)
            + "   "
            + " ".join(f"{ctl[t]:.3f}" for t in TARGETS)
        )
    print(f"{'chance':<26}" + "".join(f"{chance[t]:8.3f}" for t in TARGETS))
    return out


if __name__ == "__main__":
    main()
