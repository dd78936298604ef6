"""`poslens sae train`: trains, reports quality and positional latents, saves a loadable SAE."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import poslens
from poslens.cli import main
from poslens.data import DataConfig
from poslens.sae.io import load_sae
from tests.conftest import tiny

DATA = DataConfig(image_size=16, object_scale=0.32, n_val=40, n_test=16)


def _checkpoint(folder: Path) -> Path:
    m = tiny("ape", num_classes=16)
    return poslens.save(m, folder, DATA)


def test_sae_train_cli_writes_a_loadable_sae_and_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt, out = _checkpoint(tmp_path / "ckpt"), tmp_path / "sae"
    argv = ["sae", "train", str(ckpt), "--site", "blocks.1.hook_resid_pre", "--out", str(out)]
    assert main([*argv, "--images", "40", "--epochs", "2", "--k", "4", "--no-progress"]) == 0
    report = json.loads((out / "sae_report.json").read_text())
    assert report["site"] == "blocks.1.hook_resid_pre" and report["train_tokens"] == 40 * 16
    assert 0 <= report["quality"]["fvu"] < 1.5 and report["quality"]["l0"] <= 4
    assert set(report["positional_latents"]["counts"]) == {"row", "col", "cell", "mixed"}
    assert report["spliced"]["spliced_error"]["kl"] == pytest.approx(0, abs=1e-6)
    sae = load_sae(out)
    assert sae.site == "blocks.1.hook_resid_pre" and sae.k == 4
    assert (out / "positional_latents.png").is_file()
    assert "saved to" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [(["--site", "blocks.7.hook_resid_pre"], "not a hook"), (["--k", "999"], "sae.k")],
)
def test_sae_train_cli_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    ckpt, out = _checkpoint(tmp_path / "ckpt"), tmp_path / "sae"
    assert main(["sae", "train", str(ckpt), "--out", str(out), "--images", "20", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not out.exists()
