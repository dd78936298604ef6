"""Calibration models: mechanisms planted (or removed) by construction do what they claim."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from poslens.errors import ConfigError
from poslens.interventions import axis_map, rotary_mask
from poslens.metrics.stats import row_col_share
from poslens.models import ModelConfig, build_model
from poslens.training.config import PRESETS, RunConfig, TrainConfig, preset
from poslens.training.train import make_optimizer, withheld_blocks

SMALL = dict(image_size=24, patch_size=4, dim=32, depth=4, heads=4, num_classes=4)


def table(code: str, dim: int = 32) -> torch.Tensor:
    kw = SMALL | {"dim": dim}
    m = build_model(ModelConfig(posenc="ape", ape_code=code, **kw), seed=0)  # type: ignore[arg-type]
    return m.pos_embed.detach()[0].reshape(6, 6, -1)


def test_planted_codes_have_the_planted_structure_and_are_frozen() -> None:
    rowcol, cell = table("rowcol"), table("cell")
    assert row_col_share(rowcol)["rowcol_share"] == pytest.approx(1.0, abs=1e-9)  # additive
    assert row_col_share(cell)["rowcol_share"] < 0.45  # about 2 (G - 1) / (G^2 - 1) = 0.29
    flat = table("cell", dim=48).reshape(36, -1)  # 36 cells fit in 48 dimensions: orthogonal
    gram = flat @ flat.T
    assert (gram - torch.diag(torch.diagonal(gram))).abs().max() < 1e-4  # one direction per cell
    assert rowcol.std().item() == pytest.approx(0.3, rel=0.2)  # the learned table's init scale
    m = build_model(ModelConfig(posenc="ape", ape_code="cell", **SMALL), seed=0)  # type: ignore[arg-type]
    assert not m.pos_embed.requires_grad
    cfg = RunConfig(model=m.cfg)
    in_opt = {
        id(p) for g in make_optimizer(m.named_parameters(), cfg).param_groups for p in g["params"]
    }
    assert id(m.pos_embed) not in in_opt
    learned = build_model(ModelConfig(posenc="ape", **SMALL), seed=0)  # type: ignore[arg-type]
    assert (
        learned.pos_embed.requires_grad
        and row_col_share(learned.pos_embed[0].detach().reshape(6, 6, -1))["rowcol_share"] < 0.45
    )


def test_rotary_variants_remove_or_plant_the_axis_split() -> None:
    def amap(**kw: str) -> object:
        return axis_map(build_model(ModelConfig(posenc="rope_axial", **SMALL, **kw), seed=0))  # type: ignore[arg-type]

    assert amap().counts() == {"row": 32, "col": 32, "mixed": 0, "none": 0}  # 4 x 4 x 4 planes
    assert amap(rope_variant="oblique").counts() == {"row": 0, "col": 0, "mixed": 64, "none": 0}
    split = amap(rope_variant="head_split").axis  # [depth, H, P]: every head follows one axis
    for h in range(4):
        assert set(split[:, h].ravel()) == {"col" if h % 2 == 0 else "row"}
    early = amap(rope_blocks="first_half").axis
    assert set(early[2:].ravel()) == {"none"} and "none" not in set(early[:2].ravel())


def test_first_half_rotation_equals_masking_the_later_blocks() -> None:
    x = torch.randn(3, 1, 24, 24, generator=torch.Generator().manual_seed(0))
    full = build_model(ModelConfig(posenc="rope_axial", **SMALL), seed=0).eval()  # type: ignore[arg-type]
    early = build_model(
        ModelConfig(posenc="rope_axial", rope_blocks="first_half", **SMALL), seed=0
    ).eval()  # type: ignore[arg-type]
    with torch.no_grad(), rotary_mask(full, blocks=range(2, 4)):
        masked = full(x)
    with torch.no_grad():
        torch.testing.assert_close(early(x), masked, atol=0, rtol=0)


def test_calibration_presets_and_config_checks() -> None:
    assert {"ape_rowcol", "ape_cell", "rope_oblique", "rope_rebuild", "rope_early"} <= set(PRESETS)
    rb = preset("rope_rebuild")
    assert rb.model.rope_variant == "head_split" and rb.train.rotary_dropout == pytest.approx(1 / 3)
    # fields added later stay out of to_dict at their default: old checkpoint hashes hold
    assert "ape_code" not in preset("ape").to_dict()["model"]
    assert "rotary_dropout" not in preset("ape").to_dict()["train"]
    assert preset("ape").to_dict()["train"]["lr"] == preset("ape").train.lr
    with pytest.raises(ConfigError, match="model.ape_code"):
        ModelConfig(posenc="sincos", ape_code="cell")
    with pytest.raises(ConfigError, match="model.rope_variant"):
        ModelConfig(posenc="rope_mixed", rope_variant="oblique")
    with pytest.raises(ConfigError, match="train.rotary_dropout"):
        TrainConfig(rotary_dropout=0.6)


def test_rotary_dropout_schedule_is_shared_by_seeds_and_resumable() -> None:
    # rotary_windows "halves", depth 6: the halves are blocks 0-2 and 3-5
    cfg = RunConfig(preset("rope_rebuild").model, train=TrainConfig(rotary_dropout=1 / 3))
    steps = [withheld_blocks(cfg, s) for s in range(600)]
    early, late = steps.count(range(3)), steps.count(range(3, 6))
    assert early + late + steps.count(range(0)) == 600  # one half, the other, or none
    assert 150 < early < 250 and 150 < late < 250
    other_seed = RunConfig(cfg.model, cfg.data, dataclasses.replace(cfg.train, seed=7))
    assert steps == [withheld_blocks(other_seed, s) for s in range(600)]  # data seed decides
    assert not any(withheld_blocks(preset("rope_axial"), s) for s in range(50))
