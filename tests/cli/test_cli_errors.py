"""Bad input gives one line naming the problem on stderr, exit code 2, no traceback, no output."""

from __future__ import annotations

import contextlib
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import poslens
from poslens.cli import main
from poslens.io import load_tensors, save_tensors, write_json
from tests.conftest import TINY

TINY_SET = [
    "--set",
    "train.steps=2",
    "--set",
    "model.dim=32",
    "--set",
    "model.depth=1",
    "--set",
    "model.heads=2",
    "--no-progress",
]


def _checkpoint(folder: Path) -> Path:
    from poslens.models import ModelConfig, build_model

    cfg = ModelConfig(**TINY)  # type: ignore[arg-type]
    return poslens.save(build_model(cfg), folder)


def bad_cases(tmp: Path) -> list[tuple[list[str], str]]:
    """(argv, expected fragment of the message)."""
    cases: list[tuple[list[str], str]] = []

    def cfg(text: str, name: str) -> str:
        p = tmp / name
        p.write_text(text)
        return str(p)

    out = str(tmp / "out")
    cases += [
        (
            ["train", "--config", cfg('[model]\nposenc = "rope2d"\n', "a.toml"), "--out", out],
            "model.posenc must be one of",
        ),
        (
            ["train", "--config", cfg('[model]\ndim = "big"\n', "b.toml"), "--out", out],
            "model.dim must be int",
        ),
        (
            ["train", "--config", cfg("[data]\nimage_size = 30\n", "c.toml"), "--out", out],
            "model.image_size (30) is not divisible by model.patch_size (4)",
        ),
        (
            ["train", "--config", cfg("[model]\npatch_size = 5\n", "d.toml"), "--out", out],
            "not divisible",
        ),
        (
            ["train", "--config", cfg("[train]\nsteps = -2\n", "e.toml"), "--out", out],
            "train.steps",
        ),
        (["train", "--config", cfg("[model\n", "f.toml"), "--out", out], "not valid TOML"),
        (["train", "--config", str(tmp / "missing.toml"), "--out", out], "config file not found"),
        (
            ["train", "--preset", "ape", "--set", "model.heads=0", "--out", out],
            "model.heads must be a positive",
        ),
        (
            ["train", "--preset", "ape", "--set", "model.colour=1", "--out", out],
            "unknown field model.colour",
        ),
        (["train", "--preset", "rope5"], "invalid choice"),
        (["info", str(tmp / "nowhere")], "checkpoint not found"),
    ]
    ck = _checkpoint(tmp / "ck_trunc")
    data = (ck / "model.safetensors").read_bytes()
    (ck / "model.safetensors").write_bytes(data[: len(data) // 2])
    cases.append((["info", str(ck)], "could not be read"))
    ck = _checkpoint(tmp / "ck_pickle")
    (ck / "model.safetensors").write_bytes(pickle.dumps({"w": [1, 2, 3]}))
    cases.append((["info", str(ck)], "poslens never unpickles"))
    ck = _checkpoint(tmp / "ck_torchsave")
    torch.save({"w": torch.zeros(2)}, ck / "model.safetensors")
    cases.append((["info", str(ck)], "poslens never unpickles"))
    ck = _checkpoint(tmp / "ck_shape")
    sd = load_tensors(ck / "model.safetensors")
    sd["head.weight"] = torch.zeros(3, 3)
    save_tensors(ck / "model.safetensors", sd)
    cases.append((["info", str(ck)], "tensor head.weight has shape (3, 3)"))
    ck = _checkpoint(tmp / "ck_missing")
    sd.pop("head.weight")
    save_tensors(ck / "model.safetensors", sd)
    cases.append((["info", str(ck)], "is missing tensor head.weight"))
    ck = _checkpoint(tmp / "ck_json")
    (ck / "config.json").write_text("{not json")
    cases.append((["info", str(ck)], "not valid JSON"))
    ck = _checkpoint(tmp / "ck_cfg")
    (ck / "config.json").write_text('{"model": {"posenc": "nope"}}')
    cases.append((["info", str(ck)], "model.posenc must be one of"))
    return cases


def test_every_bad_input_is_one_line_exit_2_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv, fragment in bad_cases(tmp_path):
        with (
            pytest.raises(SystemExit) if "invalid choice" in fragment else contextlib.nullcontext()
        ):
            code = main(argv)
            assert code == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, (argv, err)
        assert fragment in err and err.startswith("poslens: error:"), (argv, err)
        assert "Traceback" not in err
        assert not (tmp_path / "out").exists(), argv


def test_real_entry_point_exit_code_and_single_line(tmp_path: Path) -> None:
    ck = _checkpoint(tmp_path / "ck")
    (ck / "model.safetensors").write_bytes(pickle.dumps(1))
    r = subprocess.run(
        [sys.executable, "-m", "poslens", "info", str(ck)], capture_output=True, text=True
    )
    assert r.returncode == 2
    assert (
        r.stderr.count("\n") == 1 and "never unpickles" in r.stderr and "Traceback" not in r.stderr
    )


def test_info_on_a_good_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", str(_checkpoint(tmp_path)), "--hooks"]) == 0
    out = capsys.readouterr().out
    assert "posenc=rope_axial" in out and "blocks.1.attn.hook_rotary" in out


def test_train_cli_prints_the_accuracy_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "train",
        "--preset",
        "ape",
        "--preset",
        "none",
        "--out",
        str(tmp_path),
        *TINY_SET,
        "--set",
        "data.image_size=16",
        "--set",
        "data.object_scale=0.32",
        "--set",
        "data.n_val=16",
        "--set",
        "data.n_test=16",
        "--set",
        "train.batch_size=8",
        "--set",
        "train.precision=fp32",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "ape" in out and "none" in out and "chance" in out
    assert (tmp_path / "ape" / "metrics.json").is_file() and (
        tmp_path / "none" / "model.safetensors"
    ).is_file()
    assert (tmp_path / "learning_curves.png").read_bytes()[:4] == b"\x89PNG"


def test_atomic_writes_get_the_usual_permissions(tmp_path: Path) -> None:
    """Files are written via mkstemp (0600); the result must follow the umask like open() does."""
    import os

    path = tmp_path / "a.json"
    write_json(path, {"a": 1})
    mask = os.umask(0)
    os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


class _ClosedPipe:
    """A stdout whose reader has gone (`poslens ... | head`): every write raises."""

    def write(self, s: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_closed_stdout_ends_quietly_with_sigpipe_s_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.conftest import tiny

    ck = poslens.save(tiny("ape"), tmp_path / "ck")
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    assert main(["info", str(ck)]) == 141
    monkeypatch.undo()
    assert "Traceback" not in capsys.readouterr().err
