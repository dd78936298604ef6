"""poslens.save writes what poslens.load and load_task read back, tied by the model fingerprint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import poslens
from poslens.data import DataConfig
from poslens.errors import CheckpointError
from poslens.io import write_json
from tests.conftest import tiny

DATA = DataConfig(image_size=16, object_scale=0.32, n_val=20, n_test=20)


def test_save_then_load_gives_the_same_model_and_task(tmp_path: Path) -> None:
    m = tiny("rope_mixed", num_classes=16)
    folder = poslens.save(m, tmp_path / "ckpt", DATA)
    back = poslens.load(folder)
    assert back.cfg == m.cfg
    x = torch.randn(2, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(back(x), m(x), atol=0, rtol=0)
    assert poslens.load_task(folder).cfg == DATA
    assert not list(folder.glob(".*.tmp"))  # atomic writes leave nothing behind


def test_a_saved_checkpoint_refuses_a_config_that_lies_about_it(tmp_path: Path) -> None:
    folder = poslens.save(tiny("rope_axial"), tmp_path / "ckpt")
    cfg = tiny("rope_axial").cfg.to_dict() | {"rope_layout": "half"}
    write_json(folder / "config.json", {"model": cfg})
    with pytest.raises(CheckpointError, match="rope_layout"):
        poslens.load(folder)
