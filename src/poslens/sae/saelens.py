"""The SAE kinds poslens reads from a SAELens folder (cfg.json + sae_weights.safetensors) and
how it runs those that are not its own TopK.

SAELens 6 names the kind in cfg.json's `architecture`. poslens runs `topk` (its own kind),
`standard` (ReLU: codes = relu(pre)) and `jumprelu` (codes = relu(pre) where pre > threshold,
the `threshold` tensor [d_sae]), with pre = (x - b_dec) @ W_enc + b_enc, or x @ W_enc + b_enc
when cfg.json says apply_b_dec_to_input false; reconstructions are codes @ W_dec + b_dec, as in
SAELens' encode / decode. Anything else (gated, transcoders, a `standard` SAE whose pre-6
cfg.json names another activation_fn, rescale_acts_by_decoder_norm, run-time normalisations
other than poslens' stored whitening, hook_z reshaping, one attention head) is refused with a
one-line CheckpointError naming what it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from poslens.errors import CheckpointError
from poslens.sae.model import TopKSAE

TOPK, STANDARD, JUMPRELU = "topk", "standard", "jumprelu"
ARCHITECTURES = (TOPK, STANDARD, JUMPRELU)
# tensors an architecture stores beside W_enc, b_enc, W_dec and b_dec
EXTRA_TENSORS = {TOPK: (), STANDARD: (), JUMPRELU: ("threshold",)}
NONE, WHITENING = "none", "covariance_whitening"  # normalize_activations poslens applies


@dataclass(frozen=True)
class Kind:
    """What cfg.json says about how the SAE encodes (checked by kind_of)."""

    architecture: str
    apply_b_dec_to_input: bool
    whitened: bool

    @property
    def own(self) -> bool:
        """Whether poslens' TopKSAE runs it as it is (TopK, b_dec subtracted from the input)."""
        return self.architecture == TOPK and self.apply_b_dec_to_input


def kind_of(cfg: dict[str, Any], where: Path) -> Kind:
    """The SAE kind cfg.json describes; CheckpointError naming the kind if poslens cannot run it."""
    arch = cfg.get("architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{where}: SAE architecture {arch!r} is not supported (poslens reads "
            f"{', '.join(ARCHITECTURES)})"
        )
    act = cfg.get("activation_fn")  # SAELens configs before 6.0 name the activation
    if arch == STANDARD and act not in (None, "relu"):
        raise CheckpointError(
            f"{where}: a standard SAE with activation_fn {act!r} is not supported (only relu)"
        )
    if cfg.get("rescale_acts_by_decoder_norm"):
        raise CheckpointError(
            f"{where}: a {arch} SAE with rescale_acts_by_decoder_norm is not supported"
        )
    norm = cfg.get("normalize_activations", NONE)
    if norm not in (NONE, WHITENING):
        raise CheckpointError(
            f"{where}: a {arch} SAE with normalize_activations {norm!r} is not supported "
            f"(only {NONE!r}, or poslens' stored {WHITENING!r})"
        )
    reshape = cfg.get("reshape_activations", NONE)
    if reshape != NONE:
        raise CheckpointError(
            f"{where}: a {arch} SAE with reshape_activations {reshape!r} is not supported"
        )
    meta = cfg.get("metadata") if isinstance(cfg.get("metadata"), dict) else {}
    head = cfg.get("hook_head_index", meta.get("hook_head_index"))
    if head is not None:
        raise CheckpointError(
            f"{where}: a {arch} SAE on one attention head ({head}) is not supported"
        )
    b_dec_in = cfg.get("apply_b_dec_to_input")
    b_dec_in = True if b_dec_in is None else b_dec_in  # SAELens' default
    if not isinstance(b_dec_in, bool):
        raise CheckpointError(
            f"{where}: apply_b_dec_to_input must be true or false, got {b_dec_in!r}"
        )
    return Kind(str(arch), b_dec_in, norm == WHITENING)


class SAELensSAE(TopKSAE):
    """A SAELens TopK, standard (ReLU) or JumpReLU SAE run by poslens: TopKSAE's weights, site
    and splicing, with SAELens' encoder. k is the TopK's k, 0 for the kinds without a fixed one."""

    def __init__(
        self,
        d_in: int,
        d_sae: int,
        kind: Kind,
        k: int = 0,
        site: str = "",
        include_prefix: bool = False,
    ) -> None:
        super().__init__(d_in, d_sae, k, site=site, include_prefix=include_prefix)
        self.architecture = kind.architecture
        self.apply_b_dec_to_input = kind.apply_b_dec_to_input
        self.register_buffer("threshold", torch.zeros(d_sae))

    def pre_acts(self, xs_BD: torch.Tensor) -> torch.Tensor:
        if self.apply_b_dec_to_input:
            return super().pre_acts(xs_BD)
        return torch.addmm(self.b_enc, xs_BD, self.W_enc)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        if self.architecture == TOPK:
            return super().encode(x)
        pre_BF = self.pre_acts(self.to_sae_space(x.reshape(-1, self.d_in)))
        codes_BF = pre_BF.relu()
        if self.architecture == JUMPRELU:
            codes_BF = codes_BF * (pre_BF > self.threshold)
        return codes_BF.reshape(*x.shape[:-1], self.d_sae)


__all__ = [
    "ARCHITECTURES",
    "EXTRA_TENSORS",
    "JUMPRELU",
    "STANDARD",
    "TOPK",
    "Kind",
    "SAELensSAE",
    "kind_of",
]
