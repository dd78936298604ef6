"""More malformed inputs across every command: one line naming the problem, exit 2, no traceback,
nothing written. Together with test_cli_errors.py this covers configs, checkpoints, images,
indices, hook names, model names and study options."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from PIL import Image

from poslens.cli import main
from poslens.io import save_tensors, write_json
from tests.conftest import TINY


def _checkpoint(folder: Path) -> Path:
    from poslens.data import DataConfig
    from poslens.models import ModelConfig, build_model

    cfg = ModelConfig(**{**TINY, "num_classes": 16})  # type: ignore[arg-type]
    data = DataConfig(image_size=16, object_scale=0.32, n_val=30, n_test=40)
    write_json(folder / "config.json", {"model": cfg.to_dict(), "data": data.__dict__})
    save_tensors(folder / "model.safetensors", build_model(cfg).state_dict())
    return folder


def _folder(root: Path, classes: dict[str, int], corrupt: bool = False) -> str:
    for name, n in classes.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            Image.new("L", (16, 16), color=40 * i).save(root / name / f"{i}.png")
    if corrupt:
        (root / next(iter(classes)) / "bad.png").write_bytes(b"\x89PNG not really")
    return str(root)


def cases(tmp: Path) -> list[tuple[list[str], str]]:
    """(argv, fragment of the expected message)."""
    out = str(tmp / "out")
    ck = str(_checkpoint(tmp / "ck"))
    (tmp / "empty").mkdir()
    train = ["train", "--preset", "rope_axial", "--out", out, "--set"]
    analyze = [
        "analyze",
        ck,
        "--out",
        out,
        "--no-progress",
        "--images",
        "20",
        "--probe-images",
        "10",
    ]
    return [
        # configs
        ([*train, "train.lr=-1"], "train.lr must be a positive"),
        ([*train, "train.steps=true"], "train.steps must be a positive integer, got True"),
        ([*train, "data.image_size=31"], "not divisible"),
        ([*train, "optimizer.lr=1"], "unknown config section [optimizer]"),
        ([*train, "model.dim=12", "--set", "model.heads=5"], "model"),
        # images
        ([*train, 'data.task="folder"', "--set", f'data.path="{tmp / "empty"}"'], "no class subfolders"),
        ([*train, 'data.task="folder"', "--set", f'data.path="{_folder(tmp / "one", {"a": 3})}"'], "only one class"),
        ([*train, 'data.task="folder"', "--set", f'data.path="{_folder(tmp / "bad", {"a": 3, "b": 3}, corrupt=True)}"'], "cannot read image"),
        ([*train, 'data.task="folder"', "--set", f'data.path="{tmp / "nowhere"}"'], "does not exist"),
        # indices and hook names
        ([*analyze, "--experiments", "depth_profile", "--probe-block", "9"], "site"),
        ([*analyze, "--experiments", "sae_causal", "--set", "sae_causal.sites=blocks.7.hook_resid_pre"], "analysis.sites"),
        (["sae", "train", ck, "--site", "blocks.0.hook_nope", "--out", out], "blocks.0.hook_nope"),
        ([*analyze, "--experiments", "heads", "--set", "heads.window_k=5"], "window_k"),
        # experiment options
        ([*analyze, "--experiments", "windows", "--set", "windows.prefix_ks=0,x"], "windows.prefix_ks must be int"),
        ([*analyze, "--experiments", "nope"], "unknown experiment 'nope'"),
        # study
        (["study", "--preset", "quick", "--models", "ape,vit9", "--out", out], "study.models"),
        (["study", "--preset", "quick", "--models", "ape,ape", "--out", out], "twice"),
        (["study", "--preset", "quick", "--seeds", "-1", "--out", out], "--seeds: study.seeds must be a positive integer, got -1"),
        (["study", "--preset", "huge", "--out", out], "invalid choice"),
        # issue 30: counts beyond the bound or the model, a given but empty list
        (["study", "--preset", "quick", "--seeds", "1001", "--out", out], "study.seeds 1,001 is more than the 1,000 seeds"),
        (["study", "--preset", "quick", "--models", " , ", "--out", out], "study.models must name at least one"),
        ([*analyze, "--experiments", "position_removal", "--set", "position_removal.n_planes=9"], "n_planes 9 is more than this model's 8 rotary planes"),
    ]  # fmt: skip


def test_more_bad_inputs_are_one_line_exit_2_and_write_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    all_cases = cases(tmp_path)
    assert len(all_cases) == 22  # 19 before issue 30
    for argv, fragment in all_cases:
        expect_exit = contextlib.nullcontext()
        if "invalid choice" in fragment:
            expect_exit = pytest.raises(SystemExit)  # type: ignore[assignment]
        with expect_exit:
            assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, (argv, err)
        assert fragment in err and err.startswith("poslens: error:"), (argv, err)
        assert "Traceback" not in err
        assert not (tmp_path / "out").exists(), argv
