"""The heads experiment's settings, the models it applies to, its rebuilding window and the
constants its verdict uses."""

from __future__ import annotations

from dataclasses import dataclass

from poslens._config import positive_float
from poslens.errors import ConfigError
from poslens.experiments.config import ExperimentConfig
from poslens.experiments.readout import needs_classifier
from poslens.models.vit import ViT

UNITS = ("head", "block_head")
WINDOWS = ("all", "row", "col")
SPECIALIZED = 0.5  # |spec| at or above this counts as axis-specialized in the verdict
Z = 2.0  # standard errors a verdict effect must clear
HELD_OUT_SEED = 12345  # the image split of the verdict's held-out check of the top rebuilder
ONE_SIDED_2SE = 0.02275  # P(N(0,1) > 2): expected share of false "rebuilders" under no effect
CARRYING_OFF = "carrying not measured (heads.carrying=false)"  # the result's note


@dataclass(frozen=True)
class Config(ExperimentConfig):
    window_k: int = -1  # last withheld block of the rebuilding window; -1: depth // 2 - 1
    units: tuple[str, ...] = UNITS  # granularities: head index in every block, one head of a block
    cumulative: tuple[int, ...] = (1, 2, 4, 8, 16)  # top-k sizes (those below the unit count)
    axis_windows: bool = True  # also rebuild after row-only and column-only windows
    min_explained: float = 0.05  # eta2_row + eta2_col below this shrinks spec towards 0
    rebuild_probes: bool = True  # probes at the output for every rebuilding readout (costly)
    # RPI-SSDC at the output for every rebuilding readout (a second forward pass each); False:
    # margins and accuracy only, all the rules read (ssdc_out is then NaN; the quick preset)
    rebuild_ssdc: bool = True
    # carrying: each unit masked alone in every block, read at the probe site (a clean and a
    # partial RPI pass per unit), then the cumulative top-k; False leaves both out (no rule
    # reads them)
    carrying: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if (
            not isinstance(self.window_k, int)
            or isinstance(self.window_k, bool)
            or self.window_k < -1
        ):
            raise ConfigError(
                f"analysis.window_k must be -1 (automatic) or a block index, got {self.window_k!r}"
            )
        units = tuple(self.units)
        if not units or any(u not in UNITS for u in units) or len(set(units)) != len(units):
            raise ConfigError(
                f"analysis.units must be distinct values of {', '.join(UNITS)}, got {self.units!r}"
            )
        if any(not isinstance(k, int) or isinstance(k, bool) or k < 1 for k in self.cumulative):
            raise ConfigError(
                f"analysis.cumulative must be positive integers, got {self.cumulative!r}"
            )
        for name in ("axis_windows", "rebuild_probes", "rebuild_ssdc", "carrying"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"analysis.{name} must be true or false, got {getattr(self, name)!r}"
                )
        positive_float("analysis.min_explained", self.min_explained)
        if self.min_explained > 1:
            raise ConfigError(
                f"analysis.min_explained must be at most 1, got {self.min_explained!r}"
            )


def applies(model: ViT) -> str | None:
    """Why the experiment cannot run on `model` (None: it can)."""
    if not (model.cfg.uses_rope or model.cfg.uses_additive_pos or model.cfg.uses_relpos):
        return f"posenc={model.cfg.posenc} has no position for heads to carry"
    return needs_classifier(model, "rebuilder and specialized heads are ranked by margin")


def window_last(model: ViT, cfg: Config) -> int | None:
    """Last withheld block k of the rebuilding window (None where rebuilding does not apply)."""
    depth = model.cfg.depth
    if not model.cfg.uses_rope or depth < 2:
        return None
    k = cfg.window_k if cfg.window_k >= 0 else depth // 2 - 1
    if k > depth - 2:
        raise ConfigError(
            f"analysis.window_k={k} leaves no later block to rebuild in: this model has blocks "
            f"0..{depth - 1}, so window_k can be at most {depth - 2}"
        )
    return k
