"""axis_map's statistics at initialisation: rebuilt from the training seed for learned
frequencies, the model's own for fixed ones, NaN (never 0) where the seed is unknown."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import poslens
from poslens.checkpoint import write_checkpoint
from poslens.experiments import axis_map as am
from poslens.experiments.output import save
from poslens.io import jsonable
from poslens.models import ModelConfig, ViT, build_model
from poslens.training.config import RunConfig, TrainConfig
from tests.conftest import TINY

MIXED = ModelConfig(**{**TINY, "posenc": "rope_mixed"})  # type: ignore[arg-type]


def headline(model: ViT) -> dict[str, float | None]:
    return am.headline(jsonable(am.run(model).to_dict()))


def align_to_the_axes(model: ViT) -> None:
    """What training might do: every learned frequency vector turned onto its nearer axis."""
    with torch.no_grad():
        f = model.rotary.freqs  # [depth, H, P, 2] (fx, fy)
        along_x = f[..., 0].abs() >= f[..., 1].abs()
        f[..., 1][along_x] = 0.0
        f[..., 0][~along_x] = 0.0


def test_a_fresh_model_is_its_own_initialisation() -> None:
    h = headline(build_model(MIXED, seed=3))
    assert h[am.FRACTION_ALIGNED_INIT] == h[am.FRACTION_ALIGNED]
    assert h[am.MEAN_ALIGNMENT_INIT] == h[am.MEAN_ALIGNMENT]
    assert h[am.MEAN_ALIGNMENT] < 0.9  # random directions: not aligned by chance


def test_the_init_is_rebuilt_from_the_seed_not_read_from_the_trained_planes() -> None:
    fresh = {s: headline(build_model(MIXED, seed=s)) for s in (3, 4)}
    assert fresh[3][am.MEAN_ALIGNMENT] != fresh[4][am.MEAN_ALIGNMENT]  # the seed matters
    trained = build_model(MIXED, seed=3)
    align_to_the_axes(trained)
    h = headline(trained)
    assert h[am.FRACTION_ALIGNED] == 1.0 and h[am.MEAN_ALIGNMENT] == pytest.approx(1.0)
    assert h[am.FRACTION_ALIGNED_INIT] == fresh[3][am.FRACTION_ALIGNED]
    assert h[am.MEAN_ALIGNMENT_INIT] == fresh[3][am.MEAN_ALIGNMENT]


def test_a_trained_checkpoint_gives_its_training_seed(tmp_path: Path) -> None:
    """The checkpoint's config.json, as training writes it, carries train.seed to the model."""
    trained = build_model(MIXED, seed=7)
    align_to_the_axes(trained)
    cfg = RunConfig(model=MIXED, train=TrainConfig(seed=7))
    write_checkpoint(tmp_path, cfg, 1, [], trained.state_dict(), {})
    loaded = poslens.load(tmp_path, allow_unfinished=True)
    assert loaded.init_seed == 7
    h = headline(loaded)
    assert h[am.FRACTION_ALIGNED] == 1.0
    assert h[am.MEAN_ALIGNMENT_INIT] == headline(build_model(MIXED, seed=7))[am.MEAN_ALIGNMENT]


def test_fixed_frequencies_are_their_init_and_an_unknown_seed_is_nan(tmp_path: Path) -> None:
    axial = ViT(ModelConfig(**{**TINY, "posenc": "rope_axial", "rope_variant": "oblique"}))  # type: ignore[arg-type]
    assert axial.init_seed is None
    h = headline(axial)
    assert h[am.FRACTION_ALIGNED_INIT] == h[am.FRACTION_ALIGNED] == 0.0  # oblique: none aligned
    assert h[am.MEAN_ALIGNMENT_INIT] == h[am.MEAN_ALIGNMENT]
    unknown = ViT(MIXED)  # as a converted model is built: no seed
    res = am.run(unknown)
    assert res.init is None and "no training seed" in res.init_from
    h = am.headline(jsonable(res.to_dict()))
    assert math.isnan(h[am.FRACTION_ALIGNED_INIT]) and math.isnan(h[am.MEAN_ALIGNMENT_INIT])
    save(res, tmp_path, am.plot)
    doc = json.loads((tmp_path / "axis_map.json").read_text())
    assert doc["init"] is None and doc["init_from"] == res.init_from


def test_rebuilt_init_is_where_training_started(tmp_path: Path) -> None:
    """A real (two-step) training run: the rebuilt frequencies are the trained ones minus two
    small steps, and another seed's are not (training builds the model with train.seed)."""
    from poslens.training import train
    from tests.training.cli_args import tiny_run_config

    train(tiny_run_config("rope_mixed", 2, seed=5, lr=1e-3), tmp_path, progress=False)
    trained = poslens.load(tmp_path)
    assert trained.init_seed == 5
    rebuilt = build_model(trained.cfg, seed=5).rotary.freqs.detach()
    other = build_model(trained.cfg, seed=6).rotary.freqs.detach()
    moved = (trained.rotary.freqs.detach() - rebuilt).abs().max()
    assert 0 < moved < 0.01 < (other - rebuilt).abs().max()
