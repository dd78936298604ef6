"""Find the row and column latents of an SAE on a checkpoint's residual stream and patch them.

    python examples/sae_row_col_latents.py CHECKPOINT [--site HOOK] [--sae DIR] [--images 200]

Trains a TopK SAE at the site (or loads one with --sae: a poslens SAE folder, or a SAELens
TopK / standard / JumpReLU one), finds its positional latents (position's share of each latent's
variance, then row / column / cell kinds), and splices the SAE back in with the error term, so
only the edited latents move: the row latents zeroed, the column latents zeroed, and the row
latents patched from the vertically mirrored patch of the same image. Each is read as the
model's accuracy and the intact model's row and column probes at the output.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

import poslens
from poslens.metrics.probes import TARGETS, fit_probes
from poslens.models import hooks
from poslens.sae import SAEConfig, splice, train_sae
from poslens.sae.io import load_sae
from poslens.sae.latents import find_positional_latents
from poslens.sae.model import TopKSAE
from poslens.sae.pipeline import patch_codes
from poslens.sae.store import ActivationStore

Edit = Callable[[torch.Tensor], torch.Tensor]  # codes [images, tokens, latents] -> new codes


def zeroed(latents: np.ndarray) -> Edit:
    def edit(codes: torch.Tensor) -> torch.Tensor:
        out = codes.clone()
        out[..., torch.as_tensor(latents, dtype=torch.long)] = 0
        return out

    return edit


def mirrored_rows(latents: np.ndarray, gh: int, gw: int) -> Edit:
    """The latents take their values from the patch in the mirrored row, same column."""

    def edit(codes: torch.Tensor) -> torch.Tensor:
        idx = torch.as_tensor(latents, dtype=torch.long)
        donor = codes.unflatten(1, (gh, gw)).flip(1).flatten(1, 2)
        out = codes.clone()
        out[..., idx] = donor[..., idx]
        return out

    return edit


@torch.no_grad()
def read(model: poslens.ViT, x: torch.Tensor, y: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Accuracy and the output's patch tokens [1, images, tokens, D]."""
    logits, cache = model.run_with_cache(x, [hooks.FINAL_NORM])
    acc = float((logits.argmax(-1) == y).float().mean())
    return acc, cache[hooks.FINAL_NORM][None, :, model.cfg.num_prefix :].float()


def fit_sae(model: poslens.ViT, images: torch.Tensor, site: str) -> TopKSAE:
    store = ActivationStore.from_model(model, images, site)
    return train_sae(store, SAEConfig(site=site, k=8, expansion=4, epochs=5))[0]


def patch_latents(
    model: poslens.ViT, sae: TopKSAE, x: torch.Tensor, y: torch.Tensor
) -> dict[str, Any]:
    """The positional latents by kind, then accuracy and output probes per edit."""
    gh, gw = model.grid_of(x[:1])
    pl = find_positional_latents(patch_codes(model, sae, x), gh, gw)
    row, col = pl.of_kind("row"), pl.of_kind("col")
    acc, feats = read(model, x, y)
    probes = fit_probes(feats, gh, gw)  # fitted on the intact model, read under every edit
    edits: dict[str, Edit | None] = {"SAE spliced, no edit": None}
    if len(row):
        edits |= {
            "row latents zeroed": zeroed(row),
            "row latents mirrored": mirrored_rows(row, gh, gw),
        }
    if len(col):
        edits["column latents zeroed"] = zeroed(col)

    def scores(acc: float, feats: torch.Tensor) -> dict[str, float]:
        probe_acc = probes.score(feats)[0]  # exact, row, col at the output
        return {"accuracy": acc, **{t: float(a) for t, a in zip(TARGETS, probe_acc, strict=True)}}

    out = {"intact": scores(acc, feats)}
    for name, edit in edits.items():
        with splice(model, sae, with_error=True, edit=edit):
            acc, feats = read(model, x, y)
        out[name] = scores(acc, feats)
    return {"kinds": pl.counts, "row": row.tolist(), "col": col.tolist(), "conditions": out}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="a poslens checkpoint folder")
    parser.add_argument(
        "--site", help="hook name (default: the residual entering the middle block)"
    )
    parser.add_argument("--sae", help="an SAE folder to use instead of training one")
    parser.add_argument("--images", type=int, default=200, help="test images read")
    args = parser.parse_args(argv)

    model = poslens.load(args.checkpoint)
    task = poslens.load_task(args.checkpoint)
    x, y = (t[: args.images] for t in task.split("test"))
    if args.sae:
        sae = load_sae(args.sae)
    else:
        site = args.site or hooks.resid_pre(model.cfg.depth // 2)
        sae = fit_sae(model, task.split("val")[0], site)
    out = patch_latents(model, sae, x, y)
    print(f"SAE at {sae.site}: positional latents {out['kinds']}")
    print(f"{'condition':<24}{'accuracy':>9}{'row probe':>11}{'col probe':>11}")
    for name, r in out["conditions"].items():
        print(f"{name:<24}{r['accuracy']:9.3f}{r['row']:11.3f}{r['col']:11.3f}")
    return out


if __name__ == "__main__":
    main()
