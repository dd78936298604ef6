"""Training configuration, the run bundle (model + data + train), presets and TOML loading."""

from __future__ import annotations

import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from poslens._config import (
    MAX_THREADS,
    bounded_steps,
    from_dict,
    one_of,
    positive_float,
    positive_int,
    short_repr,
)
from poslens.data import DataConfig
from poslens.errors import ConfigError
from poslens.io import MAX_CONFIG_BYTES
from poslens.models.config import POSENCS, ROPE_KIND, ModelConfig

PRECISIONS = ("auto", "fp32", "bf16")
# Where train.rotary_dropout withholds rotations (TrainConfig.rotary_windows, train.withheld_blocks)
ROTARY_WINDOWS = ("halves", "held_out", "late")
# Which planes a withheld window turns off (TrainConfig.rotary_axes, train.withheld_axis): "all"
# every plane; "each" all planes, the row planes or the column planes, one drawn per window.
ROTARY_AXES = ("all", "each")
WINDOW_AXES = ("all", "row", "col")  # what "each" draws from
# TrainConfig fields added after the first release, with the default that RunConfig.to_dict leaves
# out, so that saved configs (and the study's checkpoint hashes) written before them stay the same.
LATER_TRAIN_FIELDS: dict[str, Any] = {
    "stop_acc": 0.0,
    "rotary_dropout": 0.0,
    "rotary_windows": "halves",
    "rotary_axes": "all",
    "permute_patches": False,
    "min_steps": 0,
}
# Early stopping: the run stops once this many consecutive evaluations reach train.stop_acc.
STOP_EVALS = 2
# Model fields that always come from the data task, so the two can never disagree.
FROM_DATA = ("image_size", "in_chans", "num_classes")


@dataclass(frozen=True)
class TrainConfig:
    """Optimiser and schedule: AdamW, linear warmup then cosine decay to zero."""

    # Defaults from learning-curve sweeps on the default relation task (docs/training.md, "How the defaults were chosen"):
    # lr 1e-3 beat 3e-3 for RoPE-Axial (95% vs 77% val accuracy at step 300) and, with
    # ape_init_std 0.3, for APE; APE reached 90% only at the end of a 1,500-step schedule,
    # RoPE-Axial by step 300, so the default leaves APE room.
    steps: int = 2000
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.05
    warmup_frac: float = 0.05
    grad_clip: float = 1.0
    precision: str = "auto"  # "auto": bf16 autocast where the CPU/GPU has native bf16, else fp32
    eval_every: int = 100
    eval_images: int = 1000  # images of the val split scored at each periodic evaluation
    ckpt_every: int = 250
    seed: int = 0
    threads: int = 0  # torch intra-op threads; 0 = all cores
    # Probability per step that rotations are withheld in an early window of the blocks, and (as
    # much again) in a late one, for the whole batch, drawn from (data seed, step): trains a RoPE
    # model whose later blocks take over position when the early ones lose it (rope_rebuild).
    rotary_dropout: float = 0.0
    # Which windows rotary_dropout withholds: "halves" the first half (0..depth//2-1) or the
    # second (depth//2..depth-1); "held_out" a random prefix 0..j other than the first half (the
    # window the rebuild claim tests) or a random suffix j..depth-1 (held_out_windows)
    # (rebuild_test_windows), so a model trained this way is tested on a window it never saw;
    # "late" the second half only (the later blocks do without their rotations, but never see
    # early rotations withheld).
    rotary_windows: str = "halves"
    # Which planes each withheld window turns off: "all", or "each" (all planes, only the row
    # planes or only the column planes, drawn uniformly per windowed step from (data seed,
    # step)): trains later heads to rebuild the axis an early window took away, the axis-following
    # rebuilding the heads claim looks for (axial frequencies only: see RunConfig).
    rotary_axes: str = "all"
    # Permute the patch tokens at every step with a fresh random permutation drawn from
    # (data seed, step), before any position is added (random permutation at inference, applied
    # in training): position is present in the model but unusable for the task.
    permute_patches: bool = False
    # Early stopping: stop once the periodic validation accuracy (eval_every, on eval_images) is
    # at least stop_acc at STOP_EVALS consecutive evaluations; 0 trains all `steps`. The schedule
    # still spans `steps`; metrics.json records the step it stopped at ("stopped_at").
    stop_acc: float = 0.0
    # Early stopping waits for this step: a run with stop_acc stops at the first evaluation at or
    # after min_steps that closes the STOP_EVALS at target, so min_steps = steps trains the whole
    # budget and still records whether the target was reached (the study's accuracy gate reads it).
    min_steps: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "eval_every", "eval_images", "ckpt_every"):
            positive_int(f"train.{name}", getattr(self, name))
        bounded_steps("train.steps", self.steps)
        positive_int("train.seed", self.seed, allow_zero=True)
        positive_int("train.threads", self.threads, allow_zero=True)
        if self.threads > MAX_THREADS:
            raise ConfigError(f"train.threads must be at most {MAX_THREADS}, got {self.threads}")
        positive_float("train.lr", self.lr)
        for name in ("weight_decay", "grad_clip"):
            positive_float(f"train.{name}", getattr(self, name), allow_zero=True)
        if not 0 <= self.rotary_dropout <= 0.5:
            raise ConfigError(
                f"train.rotary_dropout must be in [0, 0.5] (each half of the blocks), got "
                f"{self.rotary_dropout!r}"
            )
        if not 0 <= self.warmup_frac < 1:
            raise ConfigError(f"train.warmup_frac must be in [0, 1), got {self.warmup_frac!r}")
        one_of("train.precision", self.precision, PRECISIONS)
        one_of("train.rotary_windows", self.rotary_windows, ROTARY_WINDOWS)
        one_of("train.rotary_axes", self.rotary_axes, ROTARY_AXES)
        if self.rotary_axes != "all" and not self.rotary_dropout:
            raise ConfigError(
                f"train.rotary_axes={self.rotary_axes!r} needs train.rotary_dropout > 0 (it says "
                f"which planes the withheld windows turn off)"
            )
        v = self.stop_acc
        if not (isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v <= 1):
            raise ConfigError(f"train.stop_acc must be in [0, 1], got {self.stop_acc!r}")
        positive_int("train.min_steps", self.min_steps, allow_zero=True)
        if self.min_steps > self.steps:
            raise ConfigError(
                f"train.min_steps must be at most train.steps ({self.steps}), got {self.min_steps}"
            )
        if self.min_steps and not self.stop_acc:
            raise ConfigError(
                f"train.min_steps={self.min_steps} needs train.stop_acc > 0 (it delays early "
                f"stopping, which stop_acc turns on)"
            )

    def to_dict(self) -> dict[str, Any]:
        """The fields; those added after the first release only when not at their default."""
        d = asdict(self)
        for name, default in LATER_TRAIN_FIELDS.items():
            if d[name] == default:
                del d[name]
        return d


def rebuild_test_windows(depth: int) -> tuple[range, range]:
    """The windows the rebuild claim reads: rotations withheld in the prefix 0..depth//2-1 (the
    condition tested) and in the suffix depth//2..depth-1 (what the later blocks add anyway, the
    reference it is compared with). rotary_windows "held_out" never trains on the prefix."""
    return range(depth // 2), range(depth // 2, depth)


def held_out_windows(depth: int) -> tuple[list[range], list[range]]:
    """The prefixes 0..j and the suffixes j..depth-1 that rotary_windows "held_out" withholds:
    every prefix short of all the blocks except the tested one (rebuild_test_windows), and every
    suffix short of all the blocks (depth 4: prefixes 0..0 and 0..2; suffixes 1..3, 2..3, 3..3).
    Training on the suffixes makes either part of the model suffice, the redundancy the positive
    control plants; the early window it is then tested on was never trained. No prefix is left
    below depth 3."""
    test_prefix, _ = rebuild_test_windows(depth)
    prefixes = [range(j + 1) for j in range(depth - 1) if range(j + 1) != test_prefix]
    suffixes = [range(j, depth) for j in range(1, depth)]
    return prefixes, suffixes


@dataclass(frozen=True)
class RunConfig:
    """Everything that defines a trained model: its shape, its data and how it was trained."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        if self.train.rotary_windows == "held_out" and not all(held_out_windows(self.model.depth)):
            raise ConfigError(
                f"train.rotary_windows='held_out' needs model.depth >= 3 (a prefix and a suffix "
                f"window other than the two halves the study tests on), got depth "
                f"{self.model.depth}"
            )
        if self.train.rotary_axes != "all" and ROPE_KIND.get(self.model.posenc) != "axial":
            raise ConfigError(
                f"train.rotary_axes={self.train.rotary_axes!r} needs an axial RoPE model.posenc "
                f"(fixed frequencies, each plane following one axis), got {self.model.posenc!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.to_dict(),
            "data": asdict(self.data),
            "train": self.train.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: Any, base: RunConfig | None = None) -> RunConfig:
        """Parse {model:, data:, train:} tables over `base` (defaults if None)."""
        if not isinstance(d, dict):
            raise ConfigError("a run config must be a table with [model], [data] and [train]")
        unknown = sorted(set(d) - {"model", "data", "train"})
        if unknown:
            raise ConfigError(f"unknown config section [{unknown[0]}] (known: model, data, train)")
        base = base or cls()
        for name in ("model", "data", "train"):  # each section a table before any field is read
            if not isinstance(d.get(name, {}), dict):
                got = d[name]
                raise ConfigError(
                    f"[{name}] must be a table of fields, got {type(got).__name__} "
                    f"{short_repr(got)}"
                )
        model_d = dict(d.get("model", {}))
        for key in FROM_DATA:
            if key in model_d:
                raise ConfigError(
                    f"model.{key} is taken from the data; set it in [data] or remove it"
                )
        parts = {}
        for name, klass in (("model", ModelConfig), ("data", DataConfig), ("train", TrainConfig)):
            section = model_d if name == "model" else d.get(name, {})
            parts[name] = from_dict(klass, {**asdict(getattr(base, name)), **section}, name)
        return cls(**parts)


# Calibration models (METHODS.md, "Calibration"): a mechanism planted by construction, so that an
# instrument can show it detects it (or stays quiet where it is absent). name -> model fields.
CALIBRATION: dict[str, dict[str, dict[str, Any]]] = {
    # additive row + column code, frozen: row/column features present by design
    "ape_rowcol": {"model": {"posenc": "ape", "ape_code": "rowcol"}},
    # one direction per cell, frozen: positional features, but no row/column ones
    "ape_cell": {"model": {"posenc": "ape", "ape_code": "cell"}},
    # axial planes turned 45 degrees: no plane follows one axis
    "rope_oblique": {"model": {"posenc": "rope_axial", "rope_variant": "oblique"}},
    # positive control for rebuilding: heads of one axis each, trained with rotations withheld in
    # a random early window (0..j) a third of the time and a random late one (j..end) a third of
    # the time, never the early window the study tests (rebuild_test_windows): either part of the
    # model suffices, so later (axis-specialised) heads take over position when it is withheld
    # early, on a window they were not trained on
    "rope_rebuild": {
        "model": {"posenc": "rope_axial", "rope_variant": "head_split"},
        "train": {"rotary_dropout": 1 / 3, "rotary_windows": "held_out"},
    },
    # rotations in the first half of the blocks only: later blocks cannot rebuild through them
    "rope_early": {"model": {"posenc": "rope_axial", "rope_blocks": "first_half"}},
    # negative control for rebuilding: every block rotates, so the later blocks carry a
    # measurable position signal, and half the steps train them without their own rotations; but
    # early rotations are never withheld, so nothing trains them to compensate for an early window
    "rope_late": {
        "model": {"posenc": "rope_axial"},
        "train": {"rotary_dropout": 0.5, "rotary_windows": "late"},
    },
    # negative control for position mattering: the planted, frozen row + column table of
    # ape_rowcol (row/column features present by design), but the patches are permuted at every
    # training step, so position is unusable: zeroing those features or removing position should
    # cost no accuracy (the model can read the glyph, not the arrangement: about 25% on relation)
    "ape_shuffled": {
        "model": {"posenc": "ape", "ape_code": "rowcol"},
        "train": {"permute_patches": True},
    },
}
PRESETS = (*POSENCS, *CALIBRATION)


def preset(name: str) -> RunConfig:
    """The default small config of a named model (`poslens train --preset NAME`): an encoding
    (ape, sincos, rope_axial, rope_mixed, rope_axial_ape, rope_mixed_ape, none) or a calibration
    model with a planted mechanism (CALIBRATION)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    parts = CALIBRATION.get(name, {"model": {"posenc": name}})
    return RunConfig(
        model=ModelConfig(**parts["model"]), train=TrainConfig(**parts.get("train", {}))
    )


def load_config(path: str | Path) -> RunConfig:
    """Read a TOML run config; fields not given keep the defaults."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    size = p.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"config file {p} is {size:,} bytes, more than the {MAX_CONFIG_BYTES:,} a config may have"
        )
    d = _parse_toml(p.read_bytes(), f"config file {p}")
    name = d.pop("preset", None)
    if name is not None and not isinstance(name, str):
        raise ConfigError(f"preset in {p} must be a preset name, got {short_repr(name)}")
    base = preset(name) if name is not None else None
    return RunConfig.from_dict(d, base)


def apply_overrides(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """Apply `section.field=value` overrides (value parsed as TOML, else taken as a string)."""
    d: dict[str, dict[str, Any]] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        section, dot, fname = key.strip().partition(".")
        if not sep or not dot or not fname:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        try:
            value = _parse_toml(f"v = {raw.strip()}".encode(), f"--set {key.strip()}", False)["v"]
        except ConfigError as e:
            if "not valid TOML" not in str(e):
                raise
            value = raw.strip()
        d.setdefault(section, {})[fname] = value
    return RunConfig.from_dict(d, cfg)


def _parse_toml(data: bytes, where: str, finite: bool = True) -> dict[str, Any]:
    """tomllib within poslens's bounds: nesting (tomllib recurses, so a deep file would end in
    RecursionError) and, if `finite`, finite numbers; one-line ConfigErrors naming `where`.
    (An override leaves the finite check to the config field, whose error names the field.)"""
    from poslens.errors import CheckpointError
    from poslens.io import MAX_JSON_DEPTH, check_plain

    try:
        d = tomllib.loads(data.decode("utf-8"))
    except RecursionError:
        raise ConfigError(f"{where} is nested more than {MAX_JSON_DEPTH} levels deep") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{where} is not valid TOML ({str(e).splitlines()[0]})") from None
    try:
        check_plain(d, where, finite)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    return d
