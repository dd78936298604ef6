"""Edits of SAE codes (codes [B, T, F] -> new codes) and the splice that applies them: which
latents are zeroed, mean-ablated or resampled, and the matched random control sets."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from poslens.experiments.conditions import Condition
from poslens.sae.metrics import splice
from poslens.sae.model import TopKSAE

Edit = Callable[[torch.Tensor], torch.Tensor]


def spliced(sae: TopKSAE, edit: Edit | None = None, with_error: bool = False) -> Condition:
    """The SAE spliced in at its site (at the residual for a normalised site), codes edited,
    optionally with the error term (x + D(z') - D(z): only the edited latents move)."""
    return lambda m: splice(m, sae, with_error=with_error, edit=edit)


def zero(latents: np.ndarray) -> Edit:
    idx = torch.as_tensor(latents, dtype=torch.long)

    def edit(codes: torch.Tensor) -> torch.Tensor:
        out = codes.clone()
        out[..., idx] = 0
        return out

    return edit


def set_to(latents: np.ndarray, values_F: torch.Tensor) -> Edit:
    """Mean ablation: the latents take fixed values (their mean code)."""
    idx = torch.as_tensor(latents, dtype=torch.long)

    def edit(codes: torch.Tensor) -> torch.Tensor:
        out = codes.clone()
        out[..., idx] = values_F[idx].to(out)
        return out

    return edit


def resample(latents: np.ndarray, how: str, seed: int) -> Edit:
    """The latents' values taken from the same position of another image ("other_image": the
    batch rolled by one) or from another position of the same image ("other_position": a fixed
    random permutation of the patch positions)."""
    idx = torch.as_tensor(latents, dtype=torch.long)

    def edit(codes: torch.Tensor) -> torch.Tensor:  # [B, T, F]
        out = codes.clone()
        if how == "other_image":
            donor = codes.roll(1, dims=0)
        else:
            perm = torch.randperm(codes.shape[1], generator=torch.Generator().manual_seed(seed + 1))
            donor = codes[:, perm]
        out[..., idx] = donor[..., idx]
        return out

    return edit


def matched_random(
    codes_NTF: np.ndarray, targets: np.ndarray, pool: np.ndarray, seed: int
) -> np.ndarray:
    """One latent of `pool` per latent of `targets`, matched on firing rate and mean activation
    (mass): each picks at random among its 3 nearest unused ones (fewer when the pool runs out)."""
    flat = codes_NTF.reshape(-1, codes_NTF.shape[-1])
    rate, mass = (flat > 0).mean(0), flat.mean(0)
    feats = np.stack([np.log(rate + 1e-6), np.log(mass + 1e-9)], axis=1)
    rng = np.random.default_rng(seed)
    chosen: list[int] = []
    for lat in targets:
        free = np.setdiff1d(pool, chosen)
        if not len(free):
            break
        near = free[np.argsort(np.linalg.norm(feats[free] - feats[lat], axis=1))[:3]]
        chosen.append(int(rng.choice(near)))
    return np.array(chosen, dtype=int)


__all__ = ["Edit", "matched_random", "resample", "set_to", "spliced", "zero"]
