"""The pretrained route tested on trained weights: a study's models exported to timm
(`poslens export`) and studied with --pretrained on their own task (`--data task:CHECKPOINT`)
give the native study's per-seed numbers, their in-situ controls included."""

from __future__ import annotations

import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import poslens
from poslens.errors import CheckpointError, DataError
from poslens.study import run_study
from tests.study.test_study import TINY_STUDY

if os.environ.get("POSLENS_FULL") != "1":
    pytest.importorskip("timm")


def _numbers(entry: dict[str, Any]) -> dict[str, float]:
    (run,) = entry["runs"]
    return {f"{e}.{k}": v for e, r in run["experiments"].items() for k, v in r["headline"].items()}


def test_an_exported_model_studied_as_pretrained_gives_the_native_numbers(tmp_path: Path) -> None:
    from poslens.models.timm_export import export_timm

    cfg = replace(TINY_STUDY, seeds=1, in_situ=True,
                  experiments=("depth_profile", "position_removal", "axis_map"))  # fmt: skip
    native = run_study(cfg, tmp_path / "native", progress=False, jobs=1)
    specs, names = [], {}
    for model in ("ape", "rope_axial"):
        ckpt = tmp_path / "native" / native["models"][model]["runs"][0]["checkpoint"]
        weights, _ = export_timm(poslens.load(ckpt), tmp_path / f"{model}.safetensors")
        timm_name = {"ape": "vit_tiny_patch16_224", "rope_axial": "vit_small_patch16_rope_224"}[
            model
        ]
        specs.append(f"timm:{timm_name}={weights}")
        names[model] = timm_name
    task = tmp_path / "native" / native["models"]["ape"]["runs"][0]["checkpoint"]
    pcfg = replace(cfg, models=(), pretrained=tuple(specs), images=f"task:{task}")
    studied = run_study(pcfg, tmp_path / "pretrained", progress=False, jobs=1)
    compared = 0
    for model, timm_name in names.items():
        for name, entry in native["models"].items():
            base, sep, edit = name.partition("~")
            if base != model:
                continue
            mine = _numbers(entry)
            theirs = _numbers(studied["models"][timm_name + sep + edit])
            assert mine.keys() == theirs.keys(), name
            for k, v in mine.items():
                if v is None or (isinstance(v, float) and math.isnan(v)):  # not measured: alike
                    assert theirs[k] is None or math.isnan(theirs[k]), (name, k)
                else:
                    assert theirs[k] == pytest.approx(v, rel=1e-5, abs=1e-6), (name, k)
                compared += 1
    assert compared > 100
    # analysis seed 1 reads another subset of the task's images (seed 0 reads the native ones):
    # accuracy, the same weights' number, now has a spread over analysis seeds
    two = run_study(replace(pcfg, seeds=2, in_situ=False, experiments=("position_removal",)),
                    tmp_path / "two", progress=False, jobs=1)  # fmt: skip
    acc = [r["experiments"]["position_removal"]["headline"]["intact.accuracy"]
           for r in two["models"][names["ape"]]["runs"]]  # fmt: skip
    assert acc[0] == _numbers(studied["models"][names["ape"]])["position_removal.intact.accuracy"]
    assert acc[1] != acc[0]
    # a task the model cannot read, or a folder that is no checkpoint: one-line errors
    other = replace(pcfg, pretrained=(specs[0],), images=f"task:{tmp_path}")
    with pytest.raises(CheckpointError, match="not a poslens checkpoint folder"):
        run_study(other, tmp_path / "bad", progress=False, jobs=1)
    wide = replace(TINY_STUDY, seeds=1, models=("ape",), experiments=("depth_profile",),
                   train_set=(*TINY_STUDY.train_set, "data.image_size=20"))  # fmt: skip
    res = run_study(wide, tmp_path / "wide", progress=False, jobs=1)
    wide_task = tmp_path / "wide" / res["models"]["ape"]["runs"][0]["checkpoint"]
    with pytest.raises(DataError, match="the task's images are 1x20x20"):
        run_study(replace(pcfg, pretrained=(specs[0],), images=f"task:{wide_task}"),
                  tmp_path / "bad2", progress=False, jobs=1)  # fmt: skip
