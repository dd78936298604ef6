"""train.stop_acc: early stopping at a validation-accuracy target."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import poslens
from poslens.api import checkpoint_status
from poslens.errors import CheckpointError, ConfigError
from poslens.io import load_tensors, read_metadata
from poslens.training import RunConfig, TrainConfig, apply_overrides, preset, train
from poslens.training.train import stop_step
from tests.training.cli_args import tiny_run_config

from .test_train import _interrupt_after


def run_cfg(posenc: str = "ape", steps: int = 12, **train_kw: Any) -> RunConfig:
    kw = {"eval_every": 3, "ckpt_every": 6, **train_kw}
    return tiny_run_config(posenc, steps, model_kw={"image_size": 16}, **kw)


def test_stop_acc_is_left_out_of_saved_configs_at_their_default() -> None:
    """Configs (and the study's checkpoint hashes) written before the fields existed stay the same."""
    d = RunConfig().to_dict()
    assert "stop_acc" not in d["train"]
    assert set(d["train"]) == {
        "steps", "batch_size", "lr", "weight_decay", "warmup_frac", "grad_clip", "precision",
        "eval_every", "eval_images", "ckpt_every", "seed", "threads",
    }  # fmt: skip
    cfg = apply_overrides(preset("ape"), ["train.stop_acc=0.9"])
    d = cfg.to_dict()
    assert d["train"]["stop_acc"] == 0.9
    assert RunConfig.from_dict({"train": d["train"]}).train == cfg.train
    with pytest.raises(ConfigError, match="train.stop_acc"):
        TrainConfig(stop_acc=1.5)
    with pytest.raises(ConfigError, match="train.stop_acc"):
        TrainConfig(stop_acc=float("nan"))


def test_min_steps_is_checked_and_left_out_at_its_default() -> None:
    """train.min_steps: saved only when set (old checkpoint hashes stay), named in every error."""
    cfg = apply_overrides(preset("ape"), ["train.stop_acc=0.9", "train.min_steps=40"])
    d = cfg.to_dict()
    assert d["train"]["min_steps"] == 40
    assert RunConfig.from_dict({"train": d["train"]}).train == cfg.train
    plain = apply_overrides(preset("ape"), ["train.stop_acc=0.9"]).to_dict()
    assert "min_steps" not in plain["train"]
    with pytest.raises(ConfigError, match=r"train.min_steps must be at most train.steps \(10\)"):
        TrainConfig(steps=10, stop_acc=0.9, min_steps=11)
    with pytest.raises(ConfigError, match="train.min_steps=5 needs train.stop_acc > 0"):
        TrainConfig(steps=10, min_steps=5)
    with pytest.raises(ConfigError, match="train.min_steps"):
        TrainConfig(steps=10, stop_acc=0.9, min_steps=-1)


def test_stop_step_needs_consecutive_evaluations_at_target() -> None:
    h = [{"step": s, "val_acc": a} for s, a in ((3, 0.95), (6, 0.5), (9, 0.92), (12, 0.9))]
    assert stop_step(h, TrainConfig(steps=12, stop_acc=0.9)) == 12  # 3 alone: 6 broke the run
    assert stop_step(h, TrainConfig(steps=12, stop_acc=0.93)) is None
    assert stop_step(h, TrainConfig(steps=12)) is None  # off


def test_stop_step_waits_for_min_steps() -> None:
    """With min_steps the stop is the first evaluation at or after it that closes the run of
    evaluations at target (the run may begin before min_steps); below target there is none."""
    h = [{"step": s, "val_acc": 0.95} for s in (3, 6, 9, 12)]

    def at(min_steps: int, acc: float = 0.9) -> int | None:
        return stop_step(h, TrainConfig(steps=12, stop_acc=acc, min_steps=min_steps))

    assert [at(m) for m in (0, 6, 7, 9, 12)] == [6, 6, 9, 9, 12]
    assert at(12, acc=0.96) is None
    dip = [*h[:3], {"step": 12, "val_acc": 0.5}]
    assert stop_step(dip, TrainConfig(steps=12, stop_acc=0.9, min_steps=12)) is None


def test_early_stop_ends_at_the_step_and_keeps_the_weights_of_that_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that stops at step 6 (two evaluations at target, every 3 steps) holds exactly the
    weights the full 12-step run had at step 6 (the schedule still spans 12 steps), records where
    it stopped, and a --resume of it trains no further."""
    t = importlib.import_module("poslens.training.train")
    real_evaluate = t.evaluate
    cfg = run_cfg(steps=12, stop_acc=0.5)
    full = run_cfg(steps=12)
    _interrupt_after(full, tmp_path / "full", stop_at=6)  # full run's resume state at step 6
    at6 = load_tensors(tmp_path / "full" / "train_state.safetensors")

    def evaluate(*a: Any, **k: Any) -> dict[str, float]:
        out = real_evaluate(*a, **k)
        return {**out, "acc": 1.0}  # every evaluation at target

    monkeypatch.setattr(t, "evaluate", evaluate)
    m = train(cfg, tmp_path / "stop", progress=False)
    assert m["stopped_at"] == 6 and m["steps"] == 12
    assert [h["step"] for h in m["history"]] == [3, 6]
    state = load_tensors(tmp_path / "stop" / "train_state.safetensors")
    assert read_metadata(tmp_path / "stop" / "train_state.safetensors")["step"] == "6"
    for k, v in at6.items():
        assert torch.equal(v, state[k]), k
    again = train(cfg, tmp_path / "stop", resume=True, progress=False)
    assert again["stopped_at"] == 6 and len(again["history"]) == 2
    on_disk = json.loads((tmp_path / "stop" / "metrics.json").read_text())
    assert on_disk["stopped_at"] == 6
    # a stopped run is finished at the step it stopped at: it loads, and its status says so
    assert checkpoint_status(tmp_path / "stop").to_dict() == {
        "finished": True, "step": 6, "steps": 12,
    }  # fmt: skip
    assert poslens.load(tmp_path / "stop").cfg == cfg.model
    # ... but weights of another step under that metrics.json are refused
    on_disk["stopped_at"] = 9
    (tmp_path / "stop" / "metrics.json").write_text(json.dumps(on_disk))
    with pytest.raises(CheckpointError, match="at step 6 but the run was finished at step 9"):
        poslens.load(tmp_path / "stop")


def test_without_reaching_the_target_all_steps_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = importlib.import_module("poslens.training.train")
    real_evaluate = t.evaluate
    accs = iter([0.95, 0.1, 0.95, 0.1])  # never two in a row

    def evaluate(*a: Any, **k: Any) -> dict[str, float]:
        out = real_evaluate(*a, **k)
        return {**out, "acc": next(accs, out["acc"])}

    monkeypatch.setattr(t, "evaluate", evaluate)
    m = train(run_cfg(steps=12, stop_acc=0.9), tmp_path, progress=False)
    assert m["stopped_at"] is None and [h["step"] for h in m["history"]] == [3, 6, 9, 12]
    assert "stopped_at" not in train(run_cfg(steps=3), tmp_path / "off", progress=False)


def test_min_steps_trains_the_whole_budget_and_records_the_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """min_steps = steps with every evaluation at target: all 12 steps run (the weights of the run
    without a target), and the run records that it met the target at its last step; a resume
    trains no further."""
    t = importlib.import_module("poslens.training.train")
    real_evaluate = t.evaluate
    full = train(run_cfg(steps=12), tmp_path / "full", progress=False)

    def evaluate(*a: Any, **k: Any) -> dict[str, float]:
        return {**real_evaluate(*a, **k), "acc": 1.0}

    monkeypatch.setattr(t, "evaluate", evaluate)
    cfg = run_cfg(steps=12, stop_acc=0.5, min_steps=12)
    m = train(cfg, tmp_path / "min", progress=False)
    assert m["stopped_at"] == 12 and [h["step"] for h in m["history"]] == [3, 6, 9, 12]
    a = load_tensors(tmp_path / "full" / "model.safetensors")
    b = load_tensors(tmp_path / "min" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert m["test"]["acc"] == full["test"]["acc"]
    assert checkpoint_status(tmp_path / "min").to_dict() == {
        "finished": True, "step": 12, "steps": 12,
    }  # fmt: skip
    again = train(cfg, tmp_path / "min", resume=True, progress=False)
    assert again["stopped_at"] == 12 and len(again["history"]) == 4
    # min_steps 7: the evaluations at 3 and 6 are at target, but the stop waits for step 9
    assert train(run_cfg(steps=12, stop_acc=0.5, min_steps=7), tmp_path / "s7",
                 progress=False)["stopped_at"] == 9  # fmt: skip
    # the last step is evaluated (and can close the run) even off the eval_every grid
    odd = train(run_cfg(steps=12, eval_every=5, stop_acc=0.5, min_steps=12), tmp_path / "odd",
                progress=False)  # fmt: skip
    assert odd["stopped_at"] == 12 and [h["step"] for h in odd["history"]] == [5, 10, 12]
