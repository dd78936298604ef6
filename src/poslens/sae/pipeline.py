"""Train an SAE on a checkpoint's activations and describe it: quality and positional latents.

Training tokens come from fresh training images (the task's generator, never the evaluation
sets); quality (held-out FVU, L0, dead fraction, cosine; accuracy, margin and KL with the
reconstruction spliced in, with and without the error term) and the positional latents are
measured on the validation split. Writes the SAE (safetensors + cfg.json), `sae_report.json`
and `positional_latents.png` into one folder.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure

from poslens import distributed
from poslens.data import Task
from poslens.errors import ConfigError
from poslens.io import atomic_write, jsonable, removed_on_error, write_json
from poslens.models.vit import ViT
from poslens.sae.config import SAEConfig
from poslens.sae.io import CFG, WEIGHTS, save_sae
from poslens.sae.latents import PositionalLatents, find_positional_latents
from poslens.sae.metrics import evaluate, spliced_quality
from poslens.sae.model import TopKSAE
from poslens.sae.store import ActivationStore
from poslens.sae.train import train_sae

CODES_BATCH_IMAGES = 256  # images per forward pass in patch_codes


def training_images(task: Task, n: int, batch: int = 256) -> torch.Tensor:
    """n fresh training images [n, C, H, W] (the same ones for the same task seed)."""
    chunks = [
        task.train_batch(step, min(batch, n - step * batch))[0]
        for step in range((n + batch - 1) // batch)
    ]
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)  # no copy of a single batch


@torch.no_grad()
def patch_codes(
    model: ViT, sae: TopKSAE, images: torch.Tensor, batch: int = CODES_BATCH_IMAGES
) -> np.ndarray:
    """SAE codes [N, gh*gw, F] of the patch tokens at the SAE's site, written batch by batch into
    one array (no per-batch pieces joined afterwards: one copy of the codes fewer)."""
    p = model.cfg.num_prefix
    out: np.ndarray | None = None
    for i in range(0, len(images), batch):
        cache = model.cache_until(images[i : i + batch].to(model.head.weight.device), [sae.site])
        codes = sae.encode(cache[sae.site][:, p:].float()).cpu().numpy()  # [B, T, F]
        cache = None
        if out is None:
            out = np.empty((len(images), *codes.shape[1:]), dtype=codes.dtype)
        out[i : i + len(codes)] = codes
    if out is None:
        raise ValueError("patch_codes needs at least one image")
    return out


def latent_maps_figure(pl: PositionalLatents, max_maps: int = 24) -> Figure:
    """The G x G mean-activation maps of the positional latents, row latents first (by their row),
    then column latents (by their column), then cell and mixed ones."""
    order = sorted(
        range(len(pl.latents)),
        key=lambda i: (
            ("row", "col", "cell", "mixed").index(str(pl.kind[i])),
            int(pl.maps[i].mean(1).argmax())
            if pl.kind[i] == "row"
            else int(pl.maps[i].mean(0).argmax()),
        ),
    )[:max_maps]
    cols = min(8, max(len(order), 1))
    rows = max(1, (len(order) + cols - 1) // cols)
    fig = Figure(figsize=(1.5 * cols, 1.6 * rows + 0.4), layout="constrained")
    axes = np.atleast_1d(fig.subplots(rows, cols)).ravel()
    for ax in axes:
        ax.set_axis_off()
    for ax, i in zip(axes, order, strict=False):
        ax.imshow(pl.maps[i], cmap="magma")
        ax.set_title(f"#{pl.latents[i]} {pl.kind[i]}", fontsize=7)
    fig.suptitle(f"positional latents: {pl.counts}", fontsize=9)
    return fig


@torch.no_grad()
def check_token_site(model: ViT, site: str, field: str = "sae.site") -> None:
    """An SAE reads token activations [B, T, D] (T = prefix + patches, D = model.dim): refuse a
    hook of any other shape (attention patterns [B, H, T, T], rotary tables, per-head q/k/v,
    patch-only embeddings) in one line, by running two blank images through the model."""
    if site not in model.hook_names():
        raise ConfigError(
            f"{field} {site!r} is not a hook of this model (see poslens info --hooks)"
        )
    cfg = model.cfg
    x = torch.zeros(
        2, cfg.in_chans, cfg.image_size, cfg.image_size, device=model.head.weight.device
    )
    _, cache = model.run_with_cache(x, site)
    shape, tokens = tuple(cache[site].shape), cfg.num_prefix + cfg.grid**2
    if shape != (2, tokens, cfg.dim):
        raise ConfigError(
            f"{field} {site!r} holds activations of shape {list(shape)} for 2 images, not the "
            f"token activations [B, {tokens}, {cfg.dim}] an SAE reads; pick a residual, norm or "
            "block output hook such as blocks.0.hook_resid_pre"
        )


def train_on_checkpoint(
    model: ViT,
    task: Task,
    cfg: SAEConfig,
    out: Path,
    n_images: int = 1000,
    eval_images: int = 300,
    progress: bool = False,
    record: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train, evaluate, find positional latents, save everything to `out`; returns the report.

    Under torchrun every rank calls this: activations are extracted sharded and the SAE trained
    data-parallel (ActivationStore.from_model, train_sae); rank 0 alone evaluates and writes,
    then hands every rank its report. A CUDA model moves to this rank's GPU (cuda:LOCAL_RANK).
    `record` (e.g. the checkpoint's unfinished state) is stored in the report as it is. A failed
    write removes what was written, so the folder never holds an SAE without its report.
    """
    check_token_site(model, cfg.site)
    dev = model.head.weight.device
    if dev.type == "cuda" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dev = distributed.device_for("cuda")
        torch.cuda.set_device(dev)
        model.to(dev)
    rank, world = distributed.init(dev)
    model.eval()
    store = ActivationStore.from_model(
        model, training_images(task, n_images), cfg.site, cfg.include_prefix
    )
    sae, history = train_sae(store, cfg, progress=progress and rank == 0, device=dev)
    x_val, y_val = task.split("val")
    x_val, y_val = x_val[:eval_images], y_val[:eval_images]
    held_out = ActivationStore.from_model(model, x_val, cfg.site, cfg.include_prefix)
    report: dict[str, Any] | None = None
    if rank == 0:
        gh, gw = model.grid_of(x_val[:1])
        positional = find_positional_latents(patch_codes(model, sae, x_val), gh, gw)
        report = {
            "site": cfg.site,
            "config": cfg.to_dict(),
            "train_tokens": len(store),
            "eval_tokens": len(held_out),
            "quality": evaluate(sae, held_out),
            "spliced": spliced_quality(model, sae, x_val, y_val),
            "positional_latents": positional.to_dict(),
            "history": history,
        }
        if world > 1:
            report["processes"] = world
        report |= record or {}
        fig = latent_maps_figure(positional)
        with removed_on_error(out, (WEIGHTS, CFG, "positional_latents.png", "sae_report.json")):
            save_sae(sae, out, cfg, metadata={"posenc": model.cfg.posenc})
            atomic_write(
                out / "positional_latents.png", lambda p: fig.savefig(p, format="png", dpi=120)
            )
            write_json(out / "sae_report.json", jsonable(report))  # last: the set is complete
    return distributed.broadcast_object(report)
