"""Smaller hostile inputs of issue 51: an unknown option is named, a rerun of train removes a
killed write's temporary files, oversized images are refused in one line, and entries of an
image folder that are not images are counted in its summary (one warning line), never skipped
without a word."""

from __future__ import annotations

import os
import struct
import warnings
import zlib
from pathlib import Path

import pytest
from PIL import Image

from poslens.cli import main
from poslens.data import DataConfig, build_task
from poslens.errors import DataError, DataWarning
from poslens.io import TEMP_NAME
from tests.cli.test_hostile_inputs import SETS, TRAIN


def _run(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse usage errors exit through SystemExit
        return int(e.code or 0)


@pytest.mark.parametrize(
    "argv",
    [["--frob"], ["train", "--frob"], ["sae", "--frob"], ["sae", "train", "--frob=3"],
     ["study", "--frob", "--preset", "quick"], ["info", "--frob"]],
)  # fmt: skip
def test_an_unknown_option_is_named(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Before issue 51 `poslens --frob` said only that a command was required."""
    assert _run(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unrecognized arguments: --frob" in err, err


def test_train_rerun_removes_a_killed_writes_temporary_files(tmp_path: Path) -> None:
    """A kill -9 while config.json was written leaves its temporary file; the rerun (without
    --resume: nothing was finished) removes it, as the study does."""
    out = tmp_path / "run"
    out.mkdir()
    left = [out / ".config.json.k1ll3d00.tmp", out / ".learning_curves.png.abcdefgh.tmp"]
    for p in left:
        p.write_bytes(b"half")
        assert TEMP_NAME.fullmatch(p.name)
    assert main(["train", "--preset", "rope_axial", "--out", str(out), *TRAIN]) == 0
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def _png_header(path: Path, width: int, height: int) -> None:
    """A PNG that declares width x height pixels and holds none (what a decoder reads first)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b""))


def _folder(root: Path, n: int = 5) -> Path:
    for name in ("a", "b"):
        (root / name).mkdir(parents=True)
        for i in range(n):
            Image.new("L", (16, 16), color=40 * i).save(root / name / f"{i}.png")
    return root


def _folder_train(root: Path, out: Path) -> list[str]:
    sets = [s for s in SETS if not s.startswith(("data.n_", "data.object"))]
    sets += ['data.task="folder"', f'data.path="{root}"']
    return ["train", "--preset", "rope_axial", "--out", str(out), "--no-progress",
            *(a for s in sets for a in ("--set", s))]  # fmt: skip


@pytest.mark.parametrize(("size", "fragment"), [
    (12_000, "12000 x 12000 is 144,000,000 pixels, more than the 89,478,485"),
    (20_000, "more than twice the 89,478,485 pixels"),
])  # fmt: skip
def test_an_oversized_image_is_refused_in_one_line(
    tmp_path: Path, size: int, fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before issue 51 a 12000 x 12000 PNG printed Pillow's DecompressionBombWarning and a raw
    `warnings.warn(` line; now one line naming the image, and nothing decoded."""
    root = _folder(tmp_path / "images")
    _png_header(root / "a" / "big.png", size, size)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning of any kind escapes the refusal
        with pytest.raises(DataError, match=f"big.png: .*{fragment.replace('(', '.')}"):
            build_task(DataConfig(task="folder", path=str(root), image_size=16))
    assert main(_folder_train(root, tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err and "warn" not in err, err


def test_entries_that_are_not_images_are_counted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A folder and a symbolic link loop named like images, a FIFO and a text file: skipped, and
    said so in the folder's summary (a DataWarning; one `poslens: warning:` line on the CLI)."""
    root = _folder(tmp_path / "images")
    (root / "a" / "9.png").mkdir()
    (root / "b" / "loop.png").symlink_to(root / "b" / "loop.png")
    os.mkfifo(root / "b" / "fifo.jpg")  # decoding it would hang
    (root / "b" / "notes.txt").write_text("not an image")
    (root / "b" / ".DS_Store").write_text("hidden entries are not counted")
    with pytest.warns(DataWarning) as record:
        task = build_task(DataConfig(task="folder", path=str(root), image_size=16))
    assert len(task.files) == 10 and len(record) == 1
    assert task.summary == (
        f"image folder {root}: 10 images in 2 classes; skipped 4 entries (a/9.png is a folder, "
        "not a file, and 3 more)"
    )
    assert [(p.name, why) for p, why in task.skipped] == [
        ("9.png", "is a folder, not a file"),
        ("fifo.jpg", "is a FIFO (named pipe), not a regular file"),
        ("loop.png", "is a symbolic link loop"),
        ("notes.txt", "is not an image file"),
    ]
    assert main(_folder_train(root, tmp_path / "out")) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"poslens: warning: {task.summary}"]
    for p in (root / "a" / "9.png", root / "b" / "loop.png", root / "b" / "fifo.jpg"):
        p.rmdir() if p.is_dir() else p.unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a file of another kind alone is counted, not warned
        task = build_task(DataConfig(task="folder", path=str(root), image_size=16))
    assert task.summary.endswith("skipped 1 entry (b/notes.txt is not an image file)")


def test_any_warning_in_a_command_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A library's warning (Pillow's, torch's) during a command: one `poslens: warning:` line
    naming its kind, without Python's second line (the source of the warnings.warn call)."""
    import poslens.cli.parser

    def warns(_args: object) -> int:
        warnings.warn("something\n  odd", UserWarning, stacklevel=1)
        return 0

    monkeypatch.setattr(poslens.cli.parser, "cmd_report", warns)
    assert main(["report", "anywhere"]) == 0
    assert capsys.readouterr().err == "poslens: warning: something odd (UserWarning)\n"
