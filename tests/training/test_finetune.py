"""The rebuild claim's fine-tune controls (training.finetune): the windows each schedule withholds,
a fine-tune that learns, config errors that name the field, and on a trained model never trained
for it the held-out fine-tune compensating more than the late one."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

import poslens
from poslens.errors import ConfigError
from poslens.training.config import held_out_windows, rebuild_test_windows
from poslens.training.finetune import FineTune, finetune
from poslens.training.train import withheld_window


@pytest.mark.parametrize("depth", [2, 4, 12])
def test_late_withholds_only_late_blocks_and_held_out_never_the_tested_window(depth: int) -> None:
    tested, _ = rebuild_test_windows(depth)
    prefixes, suffixes = held_out_windows(depth)
    late = {withheld_window("late", 0.5, depth, s) for s in range(400)}
    assert late == {range(0), range(depth // 2, depth)}
    held = {withheld_window("held_out", 0.5, depth, s) for s in range(400)}
    assert tested not in held and range(0) not in held  # p = 0.5: a window at every step
    assert held == set(prefixes) | set(suffixes)


def _tiny_rope() -> poslens.ViT:
    from poslens.models.config import ModelConfig
    from poslens.models.vit import build_model

    cfg = ModelConfig(posenc="rope_axial", image_size=16, patch_size=4, in_chans=1, dim=32,
                      depth=4, heads=2, num_classes=3)  # fmt: skip
    return build_model(cfg, seed=0)


def test_a_fine_tune_learns_and_says_what_it_did() -> None:
    model = _tiny_rope()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 1, 16, 16, generator=g)
    y = (x[:, 0, :8].mean(dim=(1, 2)) > 0).long() + (x[:, 0, :, :8].mean(dim=(1, 2)) > 0).long()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    done = finetune(model, x, y, FineTune("held_out", steps=60, lr=3e-3, batch_size=32))
    assert done["steps"] == 60 and done["lr"] == 3e-3 and done["windows"] == "held_out"
    assert done["images"] == 96 and 15 < done["withheld_steps"] < 45  # p = 1/2 of 60 steps
    assert done["loss_last"] < done["loss_first"]
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    again = _tiny_rope()
    assert finetune(again, x, y, FineTune("held_out", 60, 3e-3, 32))["loss_last"] == pytest.approx(
        done["loss_last"], abs=0
    )  # seeded: batches and windows are the same


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"windows": "early"}, "finetune.windows"),
        ({"steps": 0}, "finetune.steps"),
        ({"lr": 0.0}, "finetune.lr"),
        ({"batch_size": 0}, "finetune.batch_size"),
        ({"p": 1.5}, "finetune.p"),
    ],
)
def test_fine_tune_config_errors_name_the_field(change: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        replace(FineTune("late", 10), **change)


def test_the_held_out_fine_tune_compensates_more_than_the_late_one(tmp_path: Path) -> None:
    """On a trained 4-block RoPE-Axial model (never trained with rotations withheld): fine-tuned
    with held-out windows (never the tested prefix) it compensates more after the tested window
    than fine-tuned as long with late windows only, read by the rebuild rule's own effects."""
    from poslens.study.claims.rebuild import rebuild_effect, rebuild_retention_effect
    from poslens.training.config import apply_overrides
    from poslens.training.config import preset as run_preset
    from poslens.training.train import train
    from tests.experiments.test_sae_causal import TINY_TRAIN
    from tests.study.test_in_situ_study import _view

    rc = apply_overrides(run_preset("rope_axial"), [*TINY_TRAIN, "model.depth=4"])
    assert train(rc, tmp_path / "m", progress=False)["test"]["acc"] > 0.6
    data = poslens.load_task(tmp_path / "m")
    x, y = data.split("val")
    effects = {}
    for windows in ("held_out", "late"):
        model = poslens.load(tmp_path / "m")
        finetune(model, x, y, FineTune(windows, steps=150, lr=2e-3, batch_size=64))
        v = _view(model, data, ("windows",), tmp_path / windows)
        effects[windows] = (rebuild_effect(v).values[0], rebuild_retention_effect(v).values[0])
    assert effects["held_out"][0] > effects["late"][0], effects
