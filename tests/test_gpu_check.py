"""benchmarks/gpu_check.py cannot rot where no GPU is: its dry run (every section at tiny sizes
on the CPU) writes the JSON and the table with every section's figures; a section over its
budget is stopped and said in one line; without CUDA the real run says so and goes on."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

if os.environ.get("POSLENS_FULL") != "1":
    pytest.importorskip("timm")  # the pretrained section's ViT-Bs (CI installs it)


def gpu_check() -> ModuleType:
    """The script as a module (once); its sections run as child processes of its main()."""
    if "gpu_check" in sys.modules:
        return sys.modules["gpu_check"]
    path = ROOT / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dry(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], str]:
    out = tmp_path_factory.mktemp("gpu_check")
    assert gpu_check().main(["--dry-run", "--out", str(out)]) == 0
    return out, json.loads((out / "gpu_check.json").read_text()), (out / "gpu_check.md").read_text()


def test_the_dry_run_runs_every_section(dry: tuple[Path, dict[str, Any], str]) -> None:
    out, doc, md = dry
    assert doc["schema"] == "poslens.gpu_check/1" and doc["dry_run"] and doc["device"] == "cpu"
    secs = doc["sections"]
    assert [row[0] for row in doc["table"] if row[1] == "status"] == [
        "tests",
        "train",
        "pretrained",
        "confirm",
    ]  # the table in the order they ran
    assert {n: s["status"] for n, s in secs.items()} == dict.fromkeys(secs, "ok"), secs
    # the gpu-marked tests, run on the CPU
    assert secs["tests"]["passed"] >= 10 and secs["tests"]["failed"] == 0
    assert secs["tests"]["skipped"] == 0
    # every ensemble size of every model, on both devices
    train = secs["train"]
    assert [(r["posenc"], r["seeds"]) for r in train["rows"]] == [
        ("rope_axial", 1),
        ("rope_axial", 2),
    ]
    assert all(r["gpu_ms"] > 0 and r["cpu_ms"] > 0 for r in train["rows"])
    assert train["data_ms_per_batch"] > 0
    # each experiment that applies to each pretrained model, timed from the study's stage lines
    timed = {(r["model"], r["experiment"]) for r in secs["pretrained"]["experiments_timed"]}
    ape, rope = "vit_base_patch16_224", "vit_base_patch16_rope_224"
    assert timed == {(ape, "depth_profile"), (ape, "sae_causal"), (rope, "depth_profile"),
                     (rope, "axis_map")}  # fmt: skip
    assert all(r["images_per_s"] > 0 for r in secs["pretrained"]["experiments_timed"])
    assert set(secs["pretrained"]["load_seconds"]) == {ape, rope}
    confirm = secs["confirm"]
    assert confirm["seed_start"] == 100 and confirm["stages_done"] == confirm["stages_total"] > 0
    assert confirm["seeds_per_minute"] > 0 and not confirm.get("projected")
    # one table: a status row per section, then its figures
    assert md.count("| status | ok |") == 4
    for fragment in ("pytest -m gpu on cpu", "rope_axial step, 2 seeds", "images/s",
                     "seeds per minute", "20-seed confirmation"):  # fmt: skip
        assert fragment in md, fragment
    assert not (out / "work" / "pretrained").exists()  # the study folders are removed


def test_a_section_over_its_budget_is_stopped_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--dry-run", "--out", str(tmp_path), "--sections", "confirm", "--section-budget",
            "confirm=1"]  # fmt: skip
    assert gpu_check().main(args) == 0
    sec = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]["confirm"]
    assert sec["status"] == "stopped" and sec["reason"] == "stopped at its 1 s budget"
    line = "gpu_check: confirm: stopped"
    assert [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(line)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_the_real_run_says_so_and_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert gpu_check().main(["--out", str(tmp_path), "--sections", "tests,train"]) == 0
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    for sec in doc["sections"].values():
        assert sec["status"] == "skipped" and "CUDA" in sec["reason"]
    said = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("gpu_check: ")]
    assert len([ln for ln in said if "skipped" in ln]) == 2
