"""Save and load a TopK SAE as a folder laid out like SAELens: sae_weights.safetensors + cfg.json.

sae_weights.safetensors holds W_enc [d_in, d_sae], b_enc [d_sae], W_dec [d_sae, d_in] and
b_dec [d_in] (float32), the SAELens names and shapes. A whitened SAE also stores its map as
whitening_mean [d_in], whitening_matrix and whitening_inverse_matrix [d_in, d_in] (SAELens'
ActivationWhitening fields): z = (x - mean) @ matrix feeds the SAE and x_hat = z_hat @ inverse
+ mean comes out. SAELens itself rejects those extra keys (strict load); to hand a whitened SAE to
it, fold the map into the weights first (SAELens' SAE.fold_activation_whitening). The training
bookkeeping (tokens since each latent fired) is not saved: measure dead latents on held-out data.

cfg.json fields read by SAELens: architecture ("topk"), d_in, d_sae, k, dtype, device,
apply_b_dec_to_input (true), normalize_activations ("none", or "covariance_whitening" when
whitened), reshape_activations ("none"), rescale_acts_by_decoder_norm (false), hook_name (also in
metadata.hook_name, where SAELens 6 keeps it) and metadata. poslens' own fields:
include_prefix (whether CLS/register tokens were encoded) and poslens_config (the SAEConfig
the SAE was trained with, or null).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from poslens.errors import CheckpointError
from poslens.io import MAX_CONFIG_BYTES, load_tensors, read_json, save_tensors, write_json
from poslens.sae.config import SAEConfig
from poslens.sae.model import TopKSAE, Whitening

WEIGHTS, CFG = "sae_weights.safetensors", "cfg.json"
WHITENING_KEYS = ("whitening_mean", "whitening_matrix", "whitening_inverse_matrix")


def save_sae(
    sae: TopKSAE,
    out_dir: str | Path,
    cfg: SAEConfig | None = None,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Write the SAE to out_dir (created); each file atomically. Returns the folder."""
    out = Path(out_dir)
    tensors = {name: getattr(sae, name).detach() for name in ("W_enc", "b_enc", "W_dec", "b_dec")}
    if sae.whitening is not None:
        w = sae.whitening
        tensors.update(zip(WHITENING_KEYS, (w.mean_D, w.M_DD, w.M_inv_DD), strict=True))
    save_tensors(out / WEIGHTS, tensors)
    write_json(
        out / CFG,
        {
            "architecture": "topk",
            "d_in": sae.d_in,
            "d_sae": sae.d_sae,
            "k": sae.k,
            "dtype": "float32",
            "device": "cpu",
            "apply_b_dec_to_input": True,
            "normalize_activations": "none" if sae.whitening is None else "covariance_whitening",
            "reshape_activations": "none",
            "rescale_acts_by_decoder_norm": False,
            "hook_name": sae.site,
            "metadata": {"hook_name": sae.site, **(metadata or {})},
            "include_prefix": sae.include_prefix,
            "poslens_config": None if cfg is None else cfg.to_dict(),
        },
    )
    return out


def load_sae(path: str | Path) -> TopKSAE:
    """Read a folder written by save_sae (or a SAELens TopK SAE); CheckpointError if it is bad."""
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"SAE folder not found: {folder}")
    cfg = read_json(folder / CFG, "SAE config", MAX_CONFIG_BYTES)
    if not isinstance(cfg, dict) or cfg.get("architecture") != "topk":
        got = cfg.get("architecture") if isinstance(cfg, dict) else type(cfg).__name__
        raise CheckpointError(f"{folder / CFG}: architecture must be 'topk', got {got!r}")
    try:
        d_in, d_sae, k = (int(cfg[f]) for f in ("d_in", "d_sae", "k"))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{folder / CFG} lacks a valid d_in, d_sae or k ({e})") from None
    if cfg.get("rescale_acts_by_decoder_norm") or cfg.get("apply_b_dec_to_input") is False:
        raise CheckpointError(f"{folder / CFG}: only plain TopK SAEs (b_dec applied) are supported")
    tensors = load_tensors(folder / WEIGHTS)
    shapes = {"W_enc": (d_in, d_sae), "b_enc": (d_sae,), "W_dec": (d_sae, d_in), "b_dec": (d_in,)}
    whitened = cfg.get("normalize_activations") == "covariance_whitening"
    if whitened:
        shapes.update({"whitening_mean": (d_in,)})
        shapes.update({k_: (d_in, d_in) for k_ in WHITENING_KEYS[1:]})
    for name, shape in shapes.items():
        if name not in tensors:
            raise CheckpointError(f"{folder / WEIGHTS} has no tensor {name!r}")
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(
                f"{folder / WEIGHTS}: {name} has shape {tuple(tensors[name].shape)}, "
                f"cfg.json says {shape}"
            )
    meta = cfg.get("metadata") if isinstance(cfg.get("metadata"), dict) else {}
    site = cfg.get("hook_name") or meta.get("hook_name") or ""
    sae = TopKSAE(d_in, d_sae, k, site=str(site), include_prefix=bool(cfg.get("include_prefix")))
    with torch.no_grad():
        for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
            getattr(sae, name).copy_(tensors[name])
    if whitened:
        sae.whitening = Whitening(*(tensors[k_] for k_ in WHITENING_KEYS))
    return sae.eval()


def load_sae_config(path: str | Path) -> SAEConfig | None:
    """The SAEConfig stored beside a saved SAE (None if it was saved without one)."""
    cfg = read_json(Path(path) / CFG, "SAE config", MAX_CONFIG_BYTES)
    stored = cfg.get("poslens_config") if isinstance(cfg, dict) else None
    return None if stored is None else SAEConfig.from_dict(stored)
