"""SAEConfig: what a TopK sparse autoencoder is trained on and how, validated when constructed."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from poslens._config import bounded_steps, from_dict, positive_float, positive_int
from poslens.errors import ConfigError
from poslens.models import hooks


@dataclass(frozen=True)
class SAEConfig:
    """A TopK SAE (Gao et al. 2024) on one hook site; defaults suit d_in of 32-768 and ~1e5-1e6 tokens.

    lr None scales with the width as in Gao et al. (Fig. 3) and dictionary_learning:
    2e-4 / sqrt(d_sae / 2**14), i.e. 1.1e-3 at d_sae=512. aux_k None is d_in // 2 (their B.1).
    dead_tokens is far below their 10M tokens because runs here see ~1e5-1e6 tokens; at the
    defaults a latent firing uniformly fires every d_sae / k = 4 * d_in / 16 tokens.
    whiten: fit an exact affine whitening (x - mean) @ M on the training activations, train in
    that space and map reconstructions back with M^-1, so errors and FVU are reported in the
    original space. MSE on the raw stream is dominated by a few high-variance content directions
    and can ignore low-variance position (NOTES.md, "Sparse autoencoders"): variance is not
    importance. Whitening gives every direction equal weight in the loss.
    """

    site: str = hooks.normalized(1)  # hook name the activations come from
    expansion: int = 4  # d_sae = expansion * d_in
    k: int = 16  # active latents per token
    lr: float | None = None  # Adam learning rate; None: 2e-4 / sqrt(d_sae / 2**14)
    batch: int = 1024  # tokens per step
    epochs: int = 5  # passes over the activations (ignored when steps is set)
    steps: int | None = None  # optimiser steps; None: epochs * ceil(tokens / batch)
    warmup_steps: int = 0  # linear lr warmup
    decay_frac: float = 0.2  # final fraction of steps over which the lr decays linearly to 0
    seed: int = 0  # seeds the initialisation and the batch order
    aux_k: int | None = None  # dead latents used by the AuxK loss; None: d_in // 2
    aux_coef: float = 1 / 32  # weight of the AuxK loss
    dead_tokens: int = 100_000  # a latent is dead after this many tokens without firing
    include_prefix: bool = False  # also train on (and splice) CLS/register tokens
    whiten: bool = False  # train on exactly whitened activations (see above)
    log_every: int = 50  # steps per history entry

    def __post_init__(self) -> None:
        if not isinstance(self.site, str) or not self.site:
            raise ConfigError(f"sae.site must be a hook name, got {self.site!r}")
        for name in ("expansion", "k", "batch", "epochs", "dead_tokens", "log_every"):
            positive_int(f"sae.{name}", getattr(self, name))
        positive_int("sae.seed", self.seed, allow_zero=True)
        positive_int("sae.warmup_steps", self.warmup_steps, allow_zero=True)
        for name in ("steps", "aux_k"):
            if getattr(self, name) is not None:
                positive_int(f"sae.{name}", getattr(self, name))
        for name in ("steps", "epochs"):
            if getattr(self, name) is not None:
                bounded_steps(f"sae.{name}", getattr(self, name))
        if self.lr is not None:
            positive_float("sae.lr", self.lr)
        positive_float("sae.aux_coef", self.aux_coef, allow_zero=True)
        positive_float("sae.decay_frac", self.decay_frac, allow_zero=True)
        if self.decay_frac > 1:
            raise ConfigError(f"sae.decay_frac must be in [0, 1], got {self.decay_frac!r}")
        for name in ("include_prefix", "whiten"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"sae.{name} must be true or false, got {getattr(self, name)!r}")

    def d_sae(self, d_in: int) -> int:
        """Dictionary size for inputs of width d_in (ConfigError if k does not fit)."""
        d_sae = self.expansion * d_in
        if self.k >= d_sae:
            raise ConfigError(f"sae.k={self.k} must be below d_sae={d_sae} (expansion x d_in)")
        return d_sae

    def lr_for(self, d_sae: int) -> float:
        """The learning rate: cfg.lr, or Gao et al.'s 1/sqrt(width) scaling."""
        return self.lr if self.lr is not None else 2e-4 / (d_sae / 2**14) ** 0.5

    def aux_k_for(self, d_in: int) -> int:
        return self.aux_k if self.aux_k is not None else max(1, d_in // 2)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> SAEConfig:
        """Parse a dict of fields (e.g. cfg.json's "poslens" table); unknown fields are named."""
        return from_dict(cls, d, "sae")
