"""`poslens analyze --precision`: bf16 / fp16 autocast gives readouts close to fp32, is recorded
in every result JSON, and a precision torch cannot run is one clear error."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import poslens
from poslens.cli import main
from poslens.data import DataConfig
from poslens.errors import ConfigError, UserError
from poslens.experiments.config import ExperimentConfig
from poslens.precision import autocast
from tests.conftest import tiny

DATA = DataConfig(image_size=16, object_scale=0.32, n_val=16, n_test=40)
# Measured on this model (bf16 / fp16 against fp32): accuracy 0 / 0, mean margin 6e-4 / 3e-6,
# SSDC 1.9e-3 / 2.9e-4, probe test accuracy 0.047 / 0.016 (6 / 2 of 128 test tokens: the
# untrained model's probes sit near chance, where a token flips easily), effective rank 0.9% /
# 0.14% relative, attention statistics 3e-5 / 4e-6. The tolerances leave about 2x headroom.
SSDC_TOL, MARGIN_TOL, PROBE_TOL, ACC_TOL, RANK_TOL, ATTN_TOL = 0.01, 0.01, 0.1, 0.05, 0.03, 1e-3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    m = tiny("rope_axial", num_classes=16)
    folder = tmp_path_factory.mktemp("ckpt")
    return poslens.save(m, folder, DATA)


@pytest.fixture(scope="module")
def fp32_out(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fp32")
    assert _analyze(checkpoint, out) == 0
    return out


def _analyze(ckpt: Path, out: Path, *extra: str) -> int:
    argv = ["analyze", str(ckpt), "--out", str(out), "--images", "40", "--probe-images", "40"]
    argv += ["--batch-size", "16", "--no-progress", "--experiments", "depth_profile,heads"]
    argv += ["--set", "heads.cumulative=1", "--set", "heads.draws=1"]
    return main([*argv, "--set", "heads.axis_windows=false", *extra])


def _close(a: object, b: object, tol: float) -> None:
    np.testing.assert_allclose(np.asarray(a, float), np.asarray(b, float), atol=tol, rtol=0)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_analyze_is_close_to_fp32(
    checkpoint: Path, fp32_out: Path, tmp_path: Path, precision: str
) -> None:
    assert _analyze(checkpoint, tmp_path / precision, "--precision", precision) == 0
    full = json.loads((fp32_out / "depth_profile.json").read_text())
    low = json.loads((tmp_path / precision / "depth_profile.json").read_text())
    assert full["config"]["precision"] == "fp32" and low["config"]["precision"] == precision
    summary = json.loads((tmp_path / precision / "analysis.json").read_text())
    assert summary["analysis"]["precision"] == precision
    assert summary["experiments"]["heads"]["config"]["precision"] == precision
    assert abs(full["accuracy"] - low["accuracy"]) <= ACC_TOL
    assert abs(full["margin"] - low["margin"]) <= MARGIN_TOL
    assert full["margin"] != low["margin"]  # autocast did act
    for key in ("clean", "clean_norm", "rpi", "rpi_norm", "control_rpi"):
        _close(full["ssdc"][key], low["ssdc"][key], SSDC_TOL)
    _close(full["probes"]["test_acc"], low["probes"]["test_acc"], PROBE_TOL)
    np.testing.assert_allclose(low["effective_rank"], full["effective_rank"], rtol=RANK_TOL)
    heads_full = json.loads((fp32_out / "heads.json").read_text())
    heads_low = json.loads((tmp_path / precision / "heads.json").read_text())
    assert heads_low["config"]["precision"] == precision
    for key in ("eta2_row", "eta2_col", "mean_abs_drow", "mean_abs_dcol", "patch_mass"):
        _close(heads_full["attention"][key], heads_low["attention"][key], ATTN_TOL)


def test_fp32_is_the_default_and_runs_no_autocast() -> None:
    assert ExperimentConfig().precision == "fp32"
    ctx = autocast(tiny(), "fp32")
    assert not isinstance(ctx, torch.autocast)


def test_bad_precision_is_a_config_or_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="analysis.precision"):
        ExperimentConfig(precision="fp8")
    with pytest.raises(SystemExit) as e:
        main(["analyze", "ckpt", "--out", "o", "--precision", "fp64"])
    assert e.value.code == 2
    assert "--precision" in capsys.readouterr().err


def test_a_precision_torch_cannot_run_is_one_user_error(
    checkpoint: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Where autocast silently stays in float32 (an unsupported dtype only warns), say so."""

    real = torch.autocast

    def disabled(device_type: str, dtype: torch.dtype) -> torch.autocast:
        return real(device_type, dtype=dtype, enabled=False)

    monkeypatch.setattr(torch, "autocast", disabled)
    with pytest.raises(UserError, match="fp16 is not supported on cpu"):
        autocast(tiny(), "fp16")
    assert _analyze(checkpoint, tmp_path / "out", "--precision", "fp16") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "fp16 is not supported" in err
    assert not (tmp_path / "out").exists()


def test_study_train_precision_sets_every_model_s_training_precision(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`poslens study --train-precision bf16` trains every model (encoding-prefixed items too)
    in bf16; the presets stay fp32; it is refused where nothing is trained."""
    from poslens.cli.study import with_train_precision
    from poslens.study import preset
    from poslens.study.plan import run_config

    base = preset("default")
    for model in ("ape", "rope_axial", "ape_shuffled"):
        assert run_config(base, model, 0).train.precision == "fp32"
        assert run_config(with_train_precision(base, "bf16"), model, 0).train.precision == "bf16"
    for argv, what in (
        (["--pretrained", "timm:vit_tiny_patch16_224=w.safetensors", "--data", str(tmp_path)],
         "--pretrained trains none"),
        (["--preset", "ladder"], "--train-precision does not go with --preset ladder"),
    ):  # fmt: skip
        out = tmp_path / "out"
        code = main(["study", *argv, "--train-precision", "bf16", "--out", str(out)])
        assert code != 0 and what in capsys.readouterr().err and not out.exists()
