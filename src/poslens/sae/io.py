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
the SAE was trained with, or null). load_sae also reads folders SAELens wrote: TopK, standard
(ReLU) and JumpReLU SAEs (sae/saelens.py says which and refuses the rest by name).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from poslens.errors import CheckpointError, ConfigError
from poslens.io import (
    MAX_CONFIG_BYTES,
    check_float_weights,
    load_tensors,
    read_json,
    save_tensors,
    write_json,
)
from poslens.sae.config import SAEConfig
from poslens.sae.model import TopKSAE, Whitening
from poslens.sae.saelens import ARCHITECTURES, EXTRA_TENSORS, TOPK, SAELensSAE, kind_of

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
    arch = getattr(sae, "architecture", TOPK)
    tensors.update({name: getattr(sae, name).detach() for name in EXTRA_TENSORS[arch]})
    if sae.whitening is not None:
        w = sae.whitening
        tensors.update(zip(WHITENING_KEYS, (w.mean_D, w.M_DD, w.M_inv_DD), strict=True))
    save_tensors(out / WEIGHTS, tensors)
    write_json(
        out / CFG,
        {
            "architecture": arch,
            "d_in": sae.d_in,
            "d_sae": sae.d_sae,
            **({"k": sae.k} if arch == TOPK else {}),
            "dtype": "float32",
            "device": "cpu",
            "apply_b_dec_to_input": getattr(sae, "apply_b_dec_to_input", True),
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
    """Read a folder written by save_sae, or a SAELens TopK, standard (ReLU) or JumpReLU SAE
    (sae.saelens); CheckpointError, naming the kind, if it is bad or of a kind poslens cannot run."""
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"SAE folder not found: {folder}")
    cfg = read_sae_config(folder / CFG)
    kind = cfg["kind"]
    d_in, d_sae = cfg["d_in"], cfg["d_sae"]
    tensors = load_tensors(folder / WEIGHTS)
    shapes = {"W_enc": (d_in, d_sae), "b_enc": (d_sae,), "W_dec": (d_sae, d_in), "b_dec": (d_in,)}
    shapes.update({name: (d_sae,) for name in EXTRA_TENSORS[kind.architecture]})
    whitened = kind.whitened
    if whitened:
        shapes.update({"whitening_mean": (d_in,)})
        shapes.update({k_: (d_in, d_in) for k_ in WHITENING_KEYS[1:]})
    for name, shape in shapes.items():
        if name not in tensors:
            raise CheckpointError(f"{folder / WEIGHTS} has no tensor {name!r}")
        check_float_weights({name: tensors[name]}, str(folder / WEIGHTS))
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(
                f"{folder / WEIGHTS}: {name} has shape {tuple(tensors[name].shape)}, "
                f"cfg.json says {shape}"
            )
    meta = cfg.get("metadata") or {}
    site = cfg.get("hook_name") or meta.get("hook_name") or ""
    prefix = bool(cfg.get("include_prefix"))
    if kind.own:
        sae = TopKSAE(d_in, d_sae, cfg["k"], site=site, include_prefix=prefix)
    else:
        sae = SAELensSAE(d_in, d_sae, kind, cfg.get("k", 0), site=site, include_prefix=prefix)
    with torch.no_grad():
        for name in ("W_enc", "b_enc", "W_dec", "b_dec", *EXTRA_TENSORS[kind.architecture]):
            getattr(sae, name).copy_(tensors[name])
    if whitened:
        sae.whitening = Whitening(*(tensors[k_].float() for k_ in WHITENING_KEYS))
    return sae.eval()


# cfg.json values poslens can load: SAELens' float dtypes, and the activation normalisations
# and reshapes it implements (others would be silently ignored)
FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")
NORMALIZATIONS = ("none", "covariance_whitening")


def read_sae_config(path: Path) -> dict[str, Any]:
    """cfg.json of an SAE folder, checked field by field (the one place that reads it): an
    architecture poslens runs (sae.saelens), d_in, d_sae (and a TopK's k) whole numbers with
    1 <= k <= d_sae, a float dtype, known flags, poslens_config a valid SAEConfig (returned
    parsed), and under "kind" the sae.saelens.Kind it describes; one-line CheckpointErrors naming
    the file and the field. Integral floats (16.0) become ints."""
    from poslens._config import MAX_INT, short_repr

    cfg = read_json(path, "SAE config", MAX_CONFIG_BYTES)
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(cfg).__name__}")
    arch = cfg.get("architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{path}: SAE architecture {short_repr(arch)} is not supported (poslens reads "
            f"{', '.join(ARCHITECTURES)})"
        )
    out = dict(cfg)
    for name in ("d_in", "d_sae", "k") if arch == TOPK else ("d_in", "d_sae"):
        if name not in cfg:
            raise CheckpointError(f"{path} lacks the field {name}")
        v = cfg[name]
        whole = (isinstance(v, int) and not isinstance(v, bool)) or (
            isinstance(v, float) and v.is_integer()
        )
        if not whole or not 1 <= v <= MAX_INT:
            raise CheckpointError(
                f"{path}: {name} must be a positive whole number, got {short_repr(v)}"
            )
        out[name] = int(v)
    if out.get("k", 0) > out["d_sae"]:
        raise CheckpointError(
            f"{path}: k ({out['k']}) must be at most d_sae ({out['d_sae']}), the SAE's latents"
        )
    dtype = cfg.get("dtype", "float32")
    if not isinstance(dtype, str) or dtype.removeprefix("torch.") not in FLOAT_DTYPES:
        raise CheckpointError(
            f"{path}: dtype must be one of {', '.join(FLOAT_DTYPES)}, got {short_repr(dtype)}"
        )
    for name, choices in (
        ("normalize_activations", NORMALIZATIONS),
        ("reshape_activations", ("none",)),
    ):
        if cfg.get(name, "none") not in choices:
            raise CheckpointError(
                f"{path}: {name} must be one of {', '.join(choices)} (what poslens implements), "
                f"got {short_repr(cfg.get(name))}"
            )
    for name in ("apply_b_dec_to_input", "rescale_acts_by_decoder_norm", "include_prefix"):
        if name in cfg and not isinstance(cfg[name], bool | None):
            raise CheckpointError(
                f"{path}: {name} must be true or false, got {short_repr(cfg[name])}"
            )
    out["kind"] = kind_of(cfg, path)  # rescaling, other activations, one head: refused by name
    meta = cfg.get("metadata")
    if meta is not None and not isinstance(meta, dict):
        raise CheckpointError(f"{path}: metadata must be an object, got {short_repr(meta)}")
    for where, site in (
        ("hook_name", cfg.get("hook_name")),
        ("metadata.hook_name", (meta or {}).get("hook_name")),
    ):
        if site is not None and not isinstance(site, str):
            raise CheckpointError(f"{path}: {where} must be a hook name, got {short_repr(site)}")
    stored = cfg.get("poslens_config")
    try:  # the SAEConfig it was trained with (None: saved without one)
        out["poslens_config"] = None if stored is None else SAEConfig.from_dict(stored)
    except ConfigError as e:
        raise CheckpointError(f"{path}: poslens_config: {e}") from None
    return out


def load_sae_config(path: str | Path) -> SAEConfig | None:
    """The SAEConfig stored beside a saved SAE (None if it was saved without one)."""
    stored: SAEConfig | None = read_sae_config(Path(path) / CFG)["poslens_config"]
    return stored
