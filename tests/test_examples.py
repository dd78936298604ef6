"""The scripts in examples/ run on tiny checkpoints saved here, and what they print and return
says what they claim: probes find a planted position code, rotary masks move the output and
leave the model as it was, and SAE edits move the probe of the axis they edit."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import poslens
from poslens.data import DataConfig
from poslens.sae.io import save_sae
from tests.conftest import tiny

ROOT = Path(__file__).resolve().parents[1]
DATA = DataConfig(image_size=16, object_scale=0.32, n_val=40, n_test=30)


def example(name: str) -> dict[str, Any]:
    """The example script's module globals (its main() not run)."""
    return runpy.run_path(str(ROOT / "examples" / f"{name}.py"), run_name=f"example_{name}")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An APE model whose table is a planted row + column code, and an axial-RoPE model whose
    queries and keys are scaled up so that attention, and so the output, depends on rotation."""
    root = tmp_path_factory.mktemp("examples")
    ape = tiny("ape", num_classes=16, ape_code="rowcol", ape_init_std=1.0)
    rope = tiny("rope_axial", num_classes=16)
    with torch.no_grad():
        for block in rope.blocks:
            block.attn.qkv.weight[: 2 * rope.cfg.dim] *= 8
    return {
        "ape": poslens.save(ape, root / "ape", DATA),
        "rope": poslens.save(rope, root / "rope", DATA),
    }


def test_probe_residual_finds_the_planted_code(
    checkpoints: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    out = example("probe_residual")["main"]([str(checkpoints["ape"]), "--images", "30"])
    printed = capsys.readouterr().out
    sites = ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_pre", "blocks.1.hook_resid_post"]
    assert out["sites"] == sites and all(s in printed for s in sites)
    assert out["chance"] == {"exact": 1 / 16, "row": 1 / 4, "col": 1 / 4}
    first = out["accuracy"][sites[0]]
    assert first["row"] > 0.9 and first["col"] > 0.9  # the table adds row + column codes
    assert all(out["control"][s]["row"] < 0.5 for s in sites)  # shuffled labels: near chance
    assert f"{first['row']:8.3f}" in printed


def test_mask_rotary_planes_moves_the_output_and_restores_the_model(
    checkpoints: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    mod = example("mask_rotary_planes")
    out = mod["main"]([str(checkpoints["rope"])])
    printed = capsys.readouterr().out
    assert out["counts"] == {"row": 16, "col": 16, "mixed": 0, "none": 0}
    conds = out["conditions"]
    assert list(conds) == [
        "intact", "row planes off", "column planes off", "random planes off", "all planes off"
    ]  # fmt: skip
    assert conds["intact"]["kl"] == 0 and all(conds[c]["kl"] > 1e-5 for c in list(conds)[1:])
    assert "{'row': 16, 'col': 16, 'mixed': 0, 'none': 0}" in printed
    assert printed.count("KL from intact") == 5
    model = poslens.load(checkpoints["rope"])
    x, y = poslens.load_task(checkpoints["rope"]).split("test")
    before = model(x)
    again = mod["masked_accuracy"](model, x, y, [1])  # block 1 alone
    assert torch.equal(model(x), before)  # every mask undone on leaving its `with`
    assert 0 < again["conditions"]["all planes off"]["kl"]


def test_sae_row_col_latents_edit_their_own_axis(
    checkpoints: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt, mod = str(checkpoints["ape"]), example("sae_row_col_latents")
    out = mod["main"]([ckpt, "--images", "30"])
    printed = capsys.readouterr().out
    assert "SAE at blocks.1.hook_resid_pre: positional latents" in printed
    assert len(out["col"]) > 0 and out["kinds"]["col"] == len(out["col"])
    conds = out["conditions"]
    intact, spliced = conds["intact"], conds["SAE spliced, no edit"]
    # with the error term and no edit the splice is the identity
    assert spliced == pytest.approx(intact, abs=1e-6)
    col = conds["column latents zeroed"]
    assert col["col"] < intact["col"]  # zeroing the column latents costs the column probe
    assert intact["row"] - col["row"] < intact["col"] - col["col"]  # more than the row probe
    for name in conds:
        assert name in printed
    # the same with a given SAE folder (--sae): the SAE is read, not trained
    model = poslens.load(ckpt)
    sae = mod["fit_sae"](model, poslens.load_task(ckpt).split("val")[0], "blocks.0.hook_resid_pre")
    save_sae(sae, tmp_path / "sae")
    given = mod["main"]([ckpt, "--images", "30", "--sae", str(tmp_path / "sae")])
    assert "SAE at blocks.0.hook_resid_pre" in capsys.readouterr().out
    assert given["conditions"]["intact"] == intact


def test_an_example_runs_as_a_script(checkpoints: dict[str, Path]) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "mask_rotary_planes.py"),
         str(checkpoints["rope"]), "--blocks", "0", "--images", "10"],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "blocks [0]" in done.stdout and "all planes off" in done.stdout
