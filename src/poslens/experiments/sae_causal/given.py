"""SAEs given to the causal test instead of trained there (`poslens analyze --sae DIR`): poslens
SAE folders or SAELens TopK, standard (ReLU) and JumpReLU ones (sae.io.load_sae), one per site,
each checked against the model before any work."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from poslens.data import Task
from poslens.errors import CheckpointError, ConfigError, UserError
from poslens.models.vit import ViT
from poslens.sae.io import load_sae
from poslens.sae.model import TopKSAE

SITES_FIELD = "sites"


def read_saes(folders: Sequence[str]) -> dict[str, TopKSAE]:
    """The SAE in each folder by the hook it reads (cfg.json's hook_name or metadata.hook_name);
    CheckpointError for a folder without a hook, UserError for two SAEs on one hook."""
    saes: dict[str, TopKSAE] = {}
    for folder in folders:
        sae = load_sae(folder)
        if not sae.site:
            raise CheckpointError(
                f"--sae {folder}: cfg.json names no hook (hook_name or metadata.hook_name)"
            )
        if sae.site in saes:
            raise UserError(f"--sae {folder}: another SAE already reads {sae.site}")
        saes[sae.site] = sae
    return saes


def with_sites(
    saes: Mapping[str, TopKSAE], names: Sequence[str], sets: dict[str, dict[str, str]]
) -> dict[str, dict[str, str]]:
    """`--set` overrides with sae_causal's sites set to the given SAEs' hooks, unless they were
    set (then each SAE's hook must be among them, checked when the sites are resolved)."""
    if not saes:
        return sets
    if "sae_causal" not in names:
        raise UserError("--sae is read by the sae_causal experiment, which is not selected")
    own = dict(sets.get("sae_causal", {}))
    own.setdefault(SITES_FIELD, ",".join(saes))
    return {**sets, "sae_causal": own}


@torch.no_grad()
def fit_model(saes: Mapping[str, TopKSAE], model: ViT, data: Task) -> dict[str, TopKSAE]:
    """The SAEs on the model's device, after checking that each reads a hook of the model whose
    activations are its d_in wide (one validation image through the model)."""
    names = set(model.hook_names())
    for site in saes:
        if site not in names:
            raise ConfigError(
                f"--sae: {site!r} is not a hook of this model (`poslens info --hooks` lists them)"
            )
    device = model.head.weight.device
    if saes:
        cache = model.cache_until(data.split("val")[0][:1].to(device), list(saes))
        for site, sae in saes.items():
            width = cache[site].shape[-1]
            if width != sae.d_in:
                raise ConfigError(f"--sae: the SAE at {site} reads d_in={sae.d_in}, the model's "
                                  f"activations there are {width} wide")  # fmt: skip
    return {site: sae.to(device) for site, sae in saes.items()}


def check_sites(saes: Mapping[str, TopKSAE], sites: Sequence[str]) -> None:
    """ConfigError if a given SAE's hook is not among the resolved sites (it would go unused)."""
    unused = [s for s in saes if s not in sites]
    if unused:
        raise ConfigError(
            f"analysis.sites resolves to {', '.join(sites)}; the SAE given for "
            f"{', '.join(unused)} would go unused (add its hook to sae_causal.sites)"
        )


__all__ = ["check_sites", "fit_model", "read_saes", "with_sites"]
