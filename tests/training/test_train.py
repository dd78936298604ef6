from __future__ import annotations

import importlib
import itertools
import json
from pathlib import Path

import pytest
import torch

import poslens
from poslens.errors import CheckpointError, ConfigError
from poslens.io import load_tensors
from poslens.training import RunConfig, apply_overrides, load_config, preset, train
from poslens.training.train import lr_at
from tests.training.cli_args import tiny_run_config


def tiny_run(steps: int = 6, **train_kw: object) -> RunConfig:
    return tiny_run_config("rope_axial", steps, **{"eval_every": 3, "ckpt_every": 2, **train_kw})


def test_training_writes_a_loadable_checkpoint_and_metrics(tmp_path: Path) -> None:
    m = train(tiny_run(), tmp_path, progress=False)
    assert set(m) >= {"train", "val", "test", "chance", "steps_to_90", "history", "precision"}
    assert m["chance"] == 1 / 16 and [h["step"] for h in m["history"]] == [3, 6]
    on_disk = json.loads((tmp_path / "metrics.json").read_text())
    assert on_disk["test"] == m["test"]
    model = poslens.load(tmp_path)
    assert not model.training and model.cfg.image_size == 16 and model.cfg.num_classes == 16
    assert not list(tmp_path.glob(".*.tmp"))  # no temporary files left behind


def test_same_seed_same_weights_and_resume_is_exact(tmp_path: Path) -> None:
    cfg = tiny_run(steps=6)
    train(cfg, tmp_path / "a", progress=False)
    train(cfg, tmp_path / "b", progress=False)  # a second, identical run
    b_state = load_tensors(tmp_path / "b" / "model.safetensors")
    a_state = load_tensors(tmp_path / "a" / "model.safetensors")
    for k in a_state:
        assert torch.equal(a_state[k], b_state[k]), k
    _interrupt_after(cfg, tmp_path / "c", stop_at=4)  # killed after its step-4 checkpoint
    train(cfg, tmp_path / "c", resume=True, progress=False)
    c_state = load_tensors(tmp_path / "c" / "model.safetensors")
    for k in a_state:
        assert torch.equal(a_state[k], c_state[k]), k
    assert json.loads((tmp_path / "c" / "metrics.json").read_text())["resumed_from"] == 4


def _interrupt_after(cfg: RunConfig, out: Path, stop_at: int) -> None:
    """Train until the checkpoint at `stop_at`, then die as a kill would (no final files)."""
    t = importlib.import_module("poslens.training.train")  # the module, not the function

    real = t.save_checkpoint

    def save_then_die(out_: Path, model, opt, cfg_, step: int, history: list) -> None:  # type: ignore[no-untyped-def]
        real(out_, model, opt, cfg_, step, history)
        if step == stop_at:
            raise KeyboardInterrupt

    t.save_checkpoint = save_then_die  # type: ignore[assignment]
    try:
        with pytest.raises(KeyboardInterrupt):
            train(cfg, out, progress=False)
    finally:
        t.save_checkpoint = real
    assert not (out / "metrics.json").exists()


def test_existing_run_needs_resume(tmp_path: Path) -> None:
    train(tiny_run(steps=2), tmp_path, progress=False)
    with pytest.raises(CheckpointError, match="--resume"):
        train(tiny_run(steps=2), tmp_path, progress=False)
    with pytest.raises(CheckpointError, match="differs"):
        _interrupt_after(tiny_run(steps=4), tmp_path / "x", stop_at=2)
        train(tiny_run(steps=4, lr=1e-4), tmp_path / "x", resume=True, progress=False)


def test_lr_schedule_warms_up_then_decays_to_zero() -> None:
    lrs = [lr_at(s, 100, 1.0, 0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(lrs[9:]))
    assert lrs[-1] < 0.01


def test_presets_and_overrides() -> None:
    assert preset("rope_mixed").model.posenc == "rope_mixed"
    cfg = apply_overrides(
        preset("ape"), ["train.steps=10", "model.depth=2", "data.relation=quadrant"]
    )
    assert (cfg.train.steps, cfg.model.depth, cfg.data.relation, cfg.model.posenc) == (
        10,
        2,
        "quadrant",
        "ape",
    )
    with pytest.raises(ConfigError, match="unknown preset"):
        preset("rope2d")
    with pytest.raises(ConfigError, match="train.steps must be int"):
        apply_overrides(preset("ape"), ["train.steps=ten"])
    with pytest.raises(ConfigError, match="model.num_classes is taken from the data"):
        apply_overrides(preset("ape"), ["model.num_classes=3"])


def test_toml_config(tmp_path: Path) -> None:
    p = tmp_path / "run.toml"
    p.write_text('preset = "sincos"\n[train]\nsteps = 7\nlr = 1\n[model]\ndepth = 3\n')
    cfg = load_config(p)
    assert (cfg.model.posenc, cfg.model.depth, cfg.train.steps, cfg.train.lr) == (
        "sincos",
        3,
        7,
        1.0,
    )
    p.write_text("[train]\nsteps = -1\n")
    with pytest.raises(ConfigError, match="train.steps must be a positive integer"):
        load_config(p)
    p.write_text("[trian]\nsteps = 1\n")
    with pytest.raises(ConfigError, match=r"unknown config section \[trian\]"):
        load_config(p)
