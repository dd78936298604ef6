"""Seeds trained as one ensemble equal the separate `train()` runs, checkpoint like them, and a
killed ensemble resumes to the uninterrupted result."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import poslens
from poslens.api import checkpoint_status
from poslens.cli import main
from poslens.errors import CheckpointError, ConfigError
from poslens.io import load_tensors
from poslens.models import build_model
from poslens.models.ensemble import StackedViT
from poslens.training import RunConfig, train
from poslens.training import ensemble as ens
from poslens.training.ensemble import clip_grad_norms, train_ensemble
from poslens.training.train import make_optimizer
from tests.training.cli_args import tiny_run_config

FILES = {"config.json", "model.safetensors", "train_state.safetensors", "metrics.json"}
TIMINGS = {"train_seconds", "train_images_per_s"}
# Largest weight difference measured between a member and its separate run after these 8 steps
# (fp32, one thread): 4.3e-6 (rope_mixed), 1.7e-6 (ape). Adam turns rounding-level gradient
# differences into parameter differences of that size (the same single run on 2 threads instead
# of 1 moves the weights by 1.1e-5). Clipping all members by one global norm moved them by
# 1.4e-4 to 2.1e-3, no clipping by 2e-3 or more, weight decay on every parameter by 2.5e-4, the
# learning rate of the next step by 1e-3.
WEIGHT_TOL = 2e-5


def run_cfg(
    posenc: str, seed: int, steps: int = 8, model_kw: dict[str, Any] | None = None, **train_kw: Any
) -> RunConfig:
    # grad_clip small enough that every member is clipped, each by its own norm
    kw = {"eval_every": 4, "ckpt_every": 4, "grad_clip": 0.05, "seed": seed, **train_kw}
    return tiny_run_config(posenc, steps, model_kw, **kw)


def max_diff(a: Path, b: Path, name: str = "model.safetensors") -> float:
    ta, tb = load_tensors(a / name), load_tensors(b / name)
    assert ta.keys() == tb.keys()
    return max(float((ta[k] - tb[k]).abs().max()) for k in ta)


@pytest.mark.parametrize(
    ("posenc", "seeds"), [("rope_mixed", [0, 1, 2]), ("ape", [3, 7]), ("relpos", [0, 1])]
)
def test_members_equal_separate_runs(tmp_path: Path, posenc: str, seeds: list[int]) -> None:
    cfgs = [run_cfg(posenc, s) for s in seeds]
    outs = [tmp_path / f"ens{s}" for s in seeds]
    got = train_ensemble(cfgs, outs)
    for cfg, out, m in zip(cfgs, outs, got, strict=True):
        ref = train(cfg, tmp_path / f"single{cfg.train.seed}", progress=False)
        single = tmp_path / f"single{cfg.train.seed}"
        assert {p.name for p in out.iterdir()} == FILES
        assert max_diff(single, out) < WEIGHT_TOL
        assert max_diff(single, out, "train_state.safetensors") < WEIGHT_TOL  # moments too
        assert (out / "config.json").read_text() == (single / "config.json").read_text()
        assert json.loads((out / "metrics.json").read_text()) == m and m.pop("ensemble") == len(
            cfgs
        )
        assert m.keys() == ref.keys()
        for key in ref.keys() - TIMINGS:
            if key == "history":
                for h, r in zip(m[key], ref[key], strict=True):
                    assert (h["step"], h["val_acc"]) == (r["step"], r["val_acc"])
                    assert h["val_loss"] == pytest.approx(r["val_loss"], rel=1e-5)
                    assert h["train_loss"] == pytest.approx(r["train_loss"], rel=1e-5)
            elif key in ("train", "val", "test"):
                assert m[key]["acc"] == ref[key]["acc"]
                assert m[key]["loss"] == pytest.approx(ref[key]["loss"], rel=1e-5)
            else:
                assert m[key] == ref[key], key
        assert poslens.load(out).cfg == poslens.load(single).cfg


def test_calibration_models_train_as_ensembles_like_separate_runs(tmp_path: Path) -> None:
    """The rebuilding control (head-split planes, rotations withheld early on half the steps),
    a planted, frozen APE code, and that code with the patches permuted at every step: the
    ensemble withholds the same steps (and, with rotary_axes "each", the same planes), keeps the
    code frozen and permutes the patches as separate runs do."""
    axes = {"rotary_dropout": 0.5, "rotary_axes": "each"}
    for name, posenc, model_kw, train_kw in (
        ("rebuild", "rope_axial", {"rope_variant": "head_split"}, {"rotary_dropout": 0.5}),
        ("axes", "rope_axial", {"rope_variant": "head_split"}, axes),
        ("axes_standard", "rope_axial", {}, axes),
        ("cell", "ape", {"ape_code": "cell"}, {}),
        ("shuffled", "ape", {"ape_code": "rowcol"}, {"permute_patches": True}),
    ):
        cfgs = [run_cfg(posenc, s, model_kw=model_kw, **train_kw) for s in (0, 1)]
        outs = [tmp_path / f"{name}_ens{s}" for s in (0, 1)]
        train_ensemble(cfgs, outs)
        for cfg, out in zip(cfgs, outs, strict=True):
            single = tmp_path / f"{name}_single{cfg.train.seed}"
            train(cfg, single, progress=False)
            assert max_diff(single, out) < WEIGHT_TOL
        if name == "cell":
            init = build_model(
                dataclasses.replace(cfgs[0].model, num_classes=16, image_size=16), seed=0
            )
            torch.testing.assert_close(load_tensors(outs[0] / "model.safetensors")["pos_embed"],
                                       init.pos_embed.detach(), atol=0, rtol=0)  # fmt: skip
    # dropping the rotations matters: without them the same seeds train to other weights
    plain = [run_cfg("rope_axial", 0, model_kw={"rope_variant": "head_split"})]
    train_ensemble(plain, [tmp_path / "plain"])
    assert max_diff(tmp_path / "plain", tmp_path / "rebuild_ens0") > 1e-3
    # and which planes a window withholds matters too
    assert max_diff(tmp_path / "axes_ens0", tmp_path / "rebuild_ens0") > 1e-3


def test_a_member_does_not_depend_on_its_companions(tmp_path: Path) -> None:
    """The same seed alone or among others: bit for bit the same model (so a resumed ensemble
    may let members catch up alone)."""
    train_ensemble([run_cfg("rope_axial", s, steps=4) for s in (0, 1, 2)],
                   [tmp_path / f"a{s}" for s in (0, 1, 2)])  # fmt: skip
    train_ensemble([run_cfg("rope_axial", 1, steps=4)], [tmp_path / "b1"])
    assert max_diff(tmp_path / "a1", tmp_path / "b1") == 0


def _kill_during_save(
    cfgs: list[RunConfig], outs: list[Path], step: int, members_saved: int
) -> None:
    """Train until `members_saved` members have written their step-`step` checkpoint, then die
    as a kill would (no further files)."""
    real = ens.write_checkpoint
    written = []

    def save_then_die(out: Path, cfg: RunConfig, step_: int, *rest: Any) -> None:
        real(out, cfg, step_, *rest)
        written.append(step_)
        if written.count(step) == members_saved:
            raise KeyboardInterrupt

    ens.write_checkpoint = save_then_die  # type: ignore[assignment]
    try:
        with pytest.raises(KeyboardInterrupt):
            train_ensemble(cfgs, outs)
    finally:
        ens.write_checkpoint = real


@pytest.mark.parametrize("members_saved", [3, 1])
def test_killed_ensemble_resumes_to_the_uninterrupted_result(
    tmp_path: Path, members_saved: int
) -> None:
    """Killed after all members saved step 4, or between the first member's step-4 checkpoint
    and the others' (which then hold step 2 and catch up alone)."""
    cfgs = [run_cfg("rope_axial", s, steps=8, ckpt_every=2) for s in (0, 1, 2)]
    ref = train_ensemble(cfgs, [tmp_path / f"ref{s}" for s in (0, 1, 2)])
    outs = [tmp_path / f"run{s}" for s in (0, 1, 2)]
    _kill_during_save(cfgs, outs, step=4, members_saved=members_saved)
    assert not any((o / "metrics.json").exists() for o in outs)
    with pytest.raises(CheckpointError, match="--resume"):
        train_ensemble(cfgs, outs)
    got = train_ensemble(cfgs, outs, resume=True)
    for s, m, r in zip((0, 1, 2), got, ref, strict=True):
        assert max_diff(tmp_path / f"ref{s}", outs[s]) == 0
        assert max_diff(tmp_path / f"ref{s}", outs[s], "train_state.safetensors") == 0
        assert m["history"] == r["history"] and m["test"] == r["test"]
    assert [m["resumed_from"] for m in got] == ([4, 4, 4] if members_saved == 3 else [4, 2, 2])


def test_clip_grad_norms_clips_each_member_by_its_own_norm() -> None:
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(3, 5, 4, generator=g), torch.randn(3, 7, generator=g) * 0.1]
    grads[0][1] *= 0.01  # member 1's norm stays below the threshold
    stacked = [torch.nn.Parameter(torch.zeros_like(t)) for t in grads]
    for p, t in zip(stacked, grads, strict=True):
        p.grad = t.clone()
    clip_grad_norms(stacked, max_norm=1.0)
    for s in range(3):
        alone = [torch.nn.Parameter(torch.zeros_like(t[s])) for t in grads]
        for p, t in zip(alone, grads, strict=True):
            p.grad = t[s].clone()
        torch.nn.utils.clip_grad_norm_(alone, 1.0)
        for a, p in zip(alone, stacked, strict=True):
            torch.testing.assert_close(p.grad[s], a.grad, rtol=1e-6, atol=0)


def test_weight_decay_groups_are_the_single_models() -> None:
    """AdamW decays the same parameters of a stacked model as of one ViT (matrices only)."""
    cfg = run_cfg("rope_mixed_ape", 0)
    models = [build_model(dataclasses.replace(cfg.model, num_registers=1), seed=s) for s in (0, 1)]
    stacked = StackedViT(models)
    names = {id(p): n for n, p in stacked.named_stacked()}
    ours = make_optimizer(stacked.named_stacked(), cfg, member_dims=1).param_groups
    theirs = make_optimizer(models[0].named_parameters(), cfg).param_groups
    one = {id(p): n for n, p in models[0].named_parameters()}
    for a, b in zip(ours, theirs, strict=True):
        assert a["weight_decay"] == b["weight_decay"]
        assert [names[id(p)] for p in a["params"]] == [one[id(p)] for p in b["params"]]


def test_an_ensemble_is_one_config_with_several_seeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = run_cfg("ape", 0), run_cfg("ape", 1, lr=0.01)
    with pytest.raises(ConfigError, match="train.seed only"):
        train_ensemble([a, b], [tmp_path / "a", tmp_path / "b"])
    with pytest.raises(ConfigError, match="distinct output folders"):
        train_ensemble([a, run_cfg("ape", 1)], [tmp_path / "a", tmp_path / "a"])
    with pytest.raises(ConfigError, match="one output folder per config"):
        train_ensemble([a], [])
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="torchrun"):
        train_ensemble([a], [tmp_path / "a"])


def test_cli_seeds_trains_one_folder_per_seed(tmp_path: Path) -> None:
    sets = ["model.dim=16", "model.depth=1", "model.heads=2", "train.steps=3",
            "train.batch_size=8", "train.eval_every=3", "train.eval_images=8", "data.n_val=16",
            "data.n_test=16", "data.image_size=16", "data.object_scale=0.32",
            "train.threads=1", 'train.precision="fp32"']  # fmt: skip
    argv = ["train", "--preset", "ape", "--out", str(tmp_path), "--no-progress"]
    argv += [a for s in sets for a in ("--set", s)]
    assert main([*argv, "--seeds", "2,0"]) == 0
    for k in (0, 2):
        metrics = json.loads((tmp_path / f"seed{k}" / "metrics.json").read_text())
        assert metrics["ensemble"] == 2
        assert json.loads((tmp_path / f"seed{k}" / "config.json").read_text())["train"]["seed"] == k
    assert main([*argv, "--seeds", "1,1"]) == 2
    assert main([*argv, "--seeds", "one"]) == 2


@pytest.mark.skipif(shutil.which("c++") is None, reason="torch.compile needs a C++ compiler")
def test_compiled_ensemble_equals_separate_runs_up_to_rounding(tmp_path: Path) -> None:
    """torch.compile fuses kernels, so rounding differs more: measured 1.0e-5 after 8 steps (the
    wrong-clipping or wrong-schedule bugs above move weights by 1.4e-4 or more). Depth 1: on a
    cold inductor cache the test takes 32 s (43 s at depth 2); later runs reuse the cache."""
    cfgs = [run_cfg("rope_mixed", s) for s in (0, 1)]
    cfgs = [dataclasses.replace(c, model=dataclasses.replace(c.model, depth=1)) for c in cfgs]
    outs = [tmp_path / f"ens{s}" for s in (0, 1)]
    got = train_ensemble(cfgs, outs, compile=True)
    for cfg, out, m in zip(cfgs, outs, got, strict=True):
        single = tmp_path / f"single{cfg.train.seed}"
        ref = train(cfg, single, progress=False)
        assert max_diff(single, out) < 5e-5
        assert [h["val_acc"] for h in m["history"]] == [h["val_acc"] for h in ref["history"]]


def test_early_stopped_members_equal_their_separate_runs(tmp_path: Path) -> None:
    """train.stop_acc in an ensemble: a member that reaches the target at two consecutive
    evaluations is evaluated, checkpointed and finished at that step, as train() stops it."""
    cfgs = [run_cfg("rope_axial", s, steps=16, stop_acc=0.01) for s in (0, 1)]
    outs = [tmp_path / f"ens{s}" for s in (0, 1)]
    got = train_ensemble(cfgs, outs)
    for cfg, out, m in zip(cfgs, outs, got, strict=True):
        single = tmp_path / f"single{cfg.train.seed}"
        ref = train(cfg, single, progress=False)
        assert ref["stopped_at"] == m["stopped_at"] == 8  # evaluations at 4 and 8 pass 1%
        assert max_diff(single, out) < WEIGHT_TOL
        assert [h["step"] for h in m["history"]] == [h["step"] for h in ref["history"]] == [4, 8]
        assert m["test"]["acc"] == ref["test"]["acc"] and m["train"]["acc"] == ref["train"]["acc"]
    # a resumed ensemble whose members have finished trains nothing more
    again = train_ensemble(cfgs, outs, resume=True)
    assert [a["stopped_at"] for a in again] == [8, 8]


def test_min_steps_members_stop_where_their_separate_runs_do(tmp_path: Path) -> None:
    """train.min_steps in an ensemble: members at target from step 4 on stop at 12, not 8, and
    equal their separate runs."""
    cfgs = [run_cfg("rope_axial", s, steps=16, stop_acc=0.01, min_steps=12) for s in (0, 1)]
    outs = [tmp_path / f"ens{s}" for s in (0, 1)]
    got = train_ensemble(cfgs, outs)
    for cfg, out, m in zip(cfgs, outs, got, strict=True):
        single = tmp_path / f"single{cfg.train.seed}"
        ref = train(cfg, single, progress=False)
        assert ref["stopped_at"] == m["stopped_at"] == 12
        assert max_diff(single, out) < WEIGHT_TOL
        assert [h["step"] for h in m["history"]] == [4, 8, 12]


def test_members_stopping_at_different_steps_leave_the_stack_unchanged(tmp_path: Path) -> None:
    """Seed 0 reaches 12% at the evaluations of steps 8 and 12 and stops at 12; seeds 1 and 2
    never do and train on in a restacked, smaller ensemble: all three equal their separate runs."""
    cfgs = [run_cfg("rope_axial", s, steps=24, stop_acc=0.12) for s in (0, 1, 2)]
    outs = [tmp_path / f"ens{s}" for s in (0, 1, 2)]
    got = train_ensemble(cfgs, outs)
    assert [m["stopped_at"] for m in got] == [12, None, None]
    for cfg, out, m in zip(cfgs, outs, got, strict=True):
        single = tmp_path / f"single{cfg.train.seed}"
        ref = train(cfg, single, progress=False)
        assert ref["stopped_at"] == m["stopped_at"]
        assert max_diff(single, out) < WEIGHT_TOL
        assert max_diff(single, out, "train_state.safetensors") < WEIGHT_TOL
        # the stopped member is scored in a stack of its own: the same scores as alone
        for split in ("train", "val", "test"):
            assert m[split]["acc"] == ref[split]["acc"], split
            assert m[split]["loss"] == pytest.approx(ref[split]["loss"], rel=1e-5), split
    # every member loads, the stopped one at the step it stopped at
    assert [checkpoint_status(o).step for o in outs] == [12, 24, 24]
    assert all(poslens.load(o).cfg.posenc == "rope_axial" for o in outs)
