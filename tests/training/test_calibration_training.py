"""The training options behind the calibration controls: where rotations are withheld
(train.rotary_windows), patches permuted at every step (train.permute_patches), and the presets."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from poslens.data import DataConfig
from poslens.errors import ConfigError
from poslens.interventions import rpi
from poslens.io import load_tensors
from poslens.models import ModelConfig, build_model, hooks
from poslens.training import train
from poslens.training.config import (
    RunConfig,
    TrainConfig,
    apply_overrides,
    held_out_windows,
    preset,
    rebuild_test_windows,
)
from poslens.training.train import (
    axis_planes,
    permuted_patches,
    step_seed,
    withheld_axis,
    withheld_blocks,
    withheld_rotations,
)
from tests.training.cli_args import tiny_run_config

SMALL = dict(image_size=24, patch_size=4, dim=32, depth=4, heads=4, num_classes=4)
STEPS = 2000


def rope(depth: int, data_seed: int = 0, train_seed: int = 0, **train_kw: object) -> RunConfig:
    model = ModelConfig(posenc="rope_axial", **(SMALL | {"depth": depth}))  # type: ignore[arg-type]
    return RunConfig(model, DataConfig(seed=data_seed), TrainConfig(seed=train_seed, **train_kw))  # type: ignore[arg-type]


def schedule(cfg: RunConfig, steps: int = STEPS) -> list[range]:
    return [withheld_blocks(cfg, s) for s in range(steps)]


def test_halves_schedule_is_the_first_releases() -> None:
    """Bit for bit the schedule rope_rebuild trained with before rotary_windows existed (depth 6,
    p = 1/3; - none, E blocks 0-2, L blocks 3-5), computed with that code."""
    expected = {
        0: "L-LEL-LLLLLELELEELL-LLLL----LE-E-L-EL-LELE-L-ELELEL---L--LLL",
        5: "ELE--LE-LEELE-LLLLEELLLEEEEEELLLLELE-LELE--EEE-LLEE-LL-L-LEE",
    }
    code = {range(0): "-", range(3): "E", range(3, 6): "L"}
    for data_seed, want in expected.items():
        cfg = rope(6, data_seed, rotary_dropout=1 / 3)
        assert "".join(code[r] for r in schedule(cfg, len(want))) == want


def test_held_out_windows_leave_out_the_test_windows() -> None:
    assert rebuild_test_windows(4) == (range(2), range(2, 4))
    assert held_out_windows(4) == ([range(1), range(3)], [range(1, 4), range(2, 4), range(3, 4)])
    assert held_out_windows(3) == ([range(2)], [range(1, 3), range(2, 3)])
    assert held_out_windows(2) == ([], [range(1, 2)])
    for depth in (4, 6):
        prefixes, suffixes = held_out_windows(depth)
        steps = schedule(rope(depth, rotary_dropout=1 / 3, rotary_windows="held_out"))
        # every allowed window is trained on, each about as often; the tested prefix never
        counts = {w: steps.count(w) for w in (*prefixes, *suffixes)}
        assert steps.count(range(0)) + sum(counts.values()) == STEPS
        for group in (prefixes, suffixes):
            for w in group:
                expect = STEPS / 3 / len(group)
                assert 0.75 * expect < counts[w] < 1.25 * expect, (depth, w, counts[w])
        assert rebuild_test_windows(depth)[0] not in set(steps)
        assert not any(len(w) == depth for w in steps)  # never every block at once


def test_late_windows_never_withhold_the_first_half() -> None:
    steps = schedule(rope(6, rotary_dropout=0.5, rotary_windows="late"))
    assert set(steps) == {range(0), range(3, 6)}
    assert 0.45 * STEPS < steps.count(range(3, 6)) < 0.55 * STEPS


@pytest.mark.parametrize("windows", ["halves", "held_out", "late"])
def test_schedules_depend_on_data_seed_and_step_alone(windows: str) -> None:
    kw = {"rotary_dropout": 1 / 3, "rotary_windows": windows}
    steps = schedule(rope(6, **kw), 300)  # type: ignore[arg-type]
    assert steps == schedule(rope(6, **kw), 300)  # type: ignore[arg-type]
    assert steps == schedule(rope(6, train_seed=7, **kw), 300)  # type: ignore[arg-type]
    assert steps != schedule(rope(6, data_seed=1, **kw), 300)  # type: ignore[arg-type]
    assert not any(schedule(rope(6, rotary_windows=windows), 50))  # p = 0: nothing withheld


def test_permuted_patches_are_rpis_permutation_fresh_at_every_step() -> None:
    cfg = RunConfig(
        ModelConfig(posenc="ape", ape_code="rowcol", in_chans=2, **SMALL),  # type: ignore[arg-type]
        train=TrainConfig(permute_patches=True),
    )  # two channels: the permutation moves each patch's channels together
    model = build_model(cfg.model, seed=0).eval()
    x = torch.randn(5, 2, 24, 24, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for step in (0, 1, 17):
            shuffled = permuted_patches(cfg, step, x)
            with rpi(model, seed=step_seed(cfg, step, stream=1)):
                expected = model(x)  # rpi at inference: the patch embeddings permuted
            torch.testing.assert_close(model(shuffled), expected, atol=1e-5, rtol=1e-5)
        assert (model(permuted_patches(cfg, 0, x)) - model(x)).abs().max() > 1e-3  # position used
    assert not torch.equal(permuted_patches(cfg, 0, x), permuted_patches(cfg, 1, x))
    assert torch.equal(permuted_patches(cfg, 3, x), permuted_patches(cfg, 3, x))
    off = RunConfig(cfg.model)
    assert permuted_patches(off, 0, x) is x


def test_training_with_permuted_patches(tmp_path: Path) -> None:
    """A position-free model trains to the same weights with or without the permutation (the
    permutation reaches nothing but position); a model with a position table does not."""

    def weights(posenc: str, permute: bool, **model_kw: str) -> dict[str, torch.Tensor]:
        cfg = tiny_run_config(posenc, 2, model_kw, permute_patches=permute, threads=1)
        out = tmp_path / f"{posenc}_{permute}"
        train(cfg, out, progress=False)
        return load_tensors(out / "model.safetensors")

    def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        return max(float((a[k] - b[k]).abs().max()) for k in a)

    assert max_diff(weights("none", True), weights("none", False)) < 1e-5
    rowcol = {"ape_code": "rowcol"}
    assert max_diff(weights("ape", True, **rowcol), weights("ape", False, **rowcol)) > 1e-4


def test_calibration_presets_parse_and_keep_old_configs_unchanged() -> None:
    rb, late, shuffled = preset("rope_rebuild"), preset("rope_late"), preset("ape_shuffled")
    assert (rb.model.rope_variant, rb.train.rotary_windows) == ("head_split", "held_out")
    assert rb.train.rotary_dropout == pytest.approx(1 / 3)
    assert (late.model.posenc, late.model.rope_variant, late.model.rope_blocks) == (
        "rope_axial", "standard", "all",
    )  # fmt: skip
    assert (late.train.rotary_dropout, late.train.rotary_windows) == (0.5, "late")
    assert (shuffled.model.posenc, shuffled.model.ape_code) == ("ape", "rowcol")
    assert shuffled.train.permute_patches and not preset("ape_rowcol").train.permute_patches
    for cfg in (rb, late, shuffled):  # [train] as a checkpoint's config.json holds it
        assert RunConfig.from_dict({"train": cfg.to_dict()["train"]}).train == cfg.train
    # at their defaults the new fields stay out of saved configs: the first release's keys
    first_release = {
        "steps", "batch_size", "lr", "weight_decay", "warmup_frac", "grad_clip", "precision",
        "eval_every", "eval_images", "ckpt_every", "seed", "threads",
    }  # fmt: skip
    assert set(preset("rope_axial").to_dict()["train"]) == first_release
    assert shuffled.to_dict()["train"]["permute_patches"] is True
    assert "rotary_windows" not in shuffled.to_dict()["train"]
    with pytest.raises(ConfigError, match="train.rotary_windows"):  # the study's small models
        apply_overrides(rb, ["model.depth=2"])


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match="train.rotary_windows"):
        TrainConfig(rotary_windows="middle")
    held_out = ["train.rotary_dropout=0.25", "train.rotary_windows=held_out"]
    with pytest.raises(ConfigError, match="train.rotary_windows.*model.depth >= 3"):
        apply_overrides(RunConfig(), [*held_out, "model.depth=2"])
    with pytest.raises(ConfigError, match="train.permute_patches"):
        RunConfig.from_dict({"train": {"permute_patches": 1}})
    with pytest.raises(ConfigError, match="train.rotary_windows"):
        RunConfig.from_dict({"train": {"rotary_windows": 2}})
    assert apply_overrides(RunConfig(), [*held_out, "model.depth=3"]).model.depth == 3


def test_axis_windows_keep_the_windows_and_draw_each_axis() -> None:
    """rotary_axes "each": the same windows as "all" (its own random stream), each window's
    planes all, row or column about a third of the time each, from (data seed, step) alone."""
    kw = {"rotary_dropout": 1 / 3, "rotary_windows": "held_out"}
    each = rope(4, rotary_axes="each", **kw)  # type: ignore[arg-type]
    assert schedule(each) == schedule(rope(4, **kw))  # type: ignore[arg-type]
    axes = [withheld_axis(each, s) for s in range(STEPS)]
    counts = {a: axes.count(a) for a in ("all", "row", "col")}
    assert sum(counts.values()) == STEPS and all(
        0.28 * STEPS < c < 0.39 * STEPS for c in counts.values()
    )
    assert axes == [withheld_axis(rope(4, train_seed=5, rotary_axes="each", **kw), s)  # type: ignore[arg-type]
                    for s in range(STEPS)]  # fmt: skip
    assert axes != [withheld_axis(rope(4, data_seed=1, rotary_axes="each", **kw), s)  # type: ignore[arg-type]
                    for s in range(STEPS)]  # fmt: skip
    assert {withheld_axis(rope(4, **kw), s) for s in range(50)} == {"all"}  # type: ignore[arg-type]


@pytest.mark.parametrize("variant", ["standard", "head_split"])
def test_an_axis_window_turns_off_that_axis_planes_alone(variant: str) -> None:
    """Inside withheld_rotations, a row (column) window's blocks rotate by the identity in the
    row (column) planes and as before in the others; the blocks outside it are untouched."""
    cfg = dataclasses.replace(
        rope(4, rotary_dropout=1 / 3, rotary_windows="held_out", rotary_axes="each"),
        model=ModelConfig(posenc="rope_axial", rope_variant=variant, **SMALL),  # type: ignore[arg-type]
    )
    model = build_model(cfg.model, seed=0).eval()
    planes = axis_planes(model)
    assert planes["row"].shape == (4, 4, 4) and not (planes["row"] & planes["col"]).any()
    assert (planes["row"] | planes["col"]).all()  # axial RoPE: every plane follows one axis
    names = [hooks.attn(b, "rotary") for b in range(4)]
    x = torch.randn(1, 1, 24, 24)
    _, intact = model.run_with_cache(x, names)
    seen = set()
    for step in range(200):
        blocks, axis = withheld_blocks(cfg, step), withheld_axis(cfg, step)
        if not blocks or axis in seen:
            continue
        seen.add(axis)
        with withheld_rotations(model, cfg, step, planes):
            _, got = model.run_with_cache(x, names)
        for b, name in enumerate(names):
            off = torch.ones_like(planes["row"][b]) if axis == "all" else planes[axis][b]
            off = off & (b in blocks)  # [H, P]
            cos, sin = got[name][0], got[name][1]  # [H, T, P]
            assert bool((cos[off[:, None].expand_as(cos)] == 1).all())
            assert bool((sin[off[:, None].expand_as(sin)] == 0).all())
            keep = ~off[:, None].expand_as(cos)
            assert torch.equal(got[name][:, keep], intact[name][:, keep])
    assert seen == {"all", "row", "col"}


def test_axis_windows_need_an_axial_rope_with_dropout() -> None:
    with pytest.raises(ConfigError, match="train.rotary_axes"):
        TrainConfig(rotary_axes="row")
    with pytest.raises(ConfigError, match="train.rotary_axes.*rotary_dropout"):
        TrainConfig(rotary_axes="each")
    with pytest.raises(ConfigError, match="train.rotary_axes.*axial RoPE"):
        RunConfig(
            ModelConfig(posenc="rope_mixed"),
            train=TrainConfig(rotary_dropout=0.3, rotary_axes="each"),
        )
    oblique = build_model(ModelConfig(posenc="rope_axial", rope_variant="oblique", **SMALL), seed=0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="train.rotary_axes='each' needs row planes"):
        axis_planes(oblique)
    assert "rotary_axes" not in preset("rope_late").to_dict()["train"]  # old configs unchanged
