"""The README's Python API example runs as written after the README's first command
(`poslens study --out runs/study`), on a folder laid out as that study lays out its checkpoints."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import poslens
from poslens.data import build_task
from poslens.models.vit import build_model
from poslens.study import preset
from poslens.study.plan import checkpoint_dir, run_config
from poslens.training.train import model_config_for

README = Path(__file__).resolve().parents[1] / "README.md"


def _api_example() -> str:
    """The first ```python block under the README's "## Python API" heading."""
    text = README.read_text()
    section = text[text.index("## Python API") :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "the README's Python API section has no python block"
    return match.group(1)


def test_the_first_command_is_the_default_study_into_runs_study() -> None:
    first = README.read_text().split("```bash", 1)[1].split("```", 1)[0]
    assert "poslens study --out runs/study" in first  # what the fake folder below stands for


def test_readme_python_example_runs_on_the_default_studys_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Where and what `poslens study --out runs/study` (the default preset) saves for rope_axial,
    # seed 0: the same folder name and run config, untrained weights (training takes minutes).
    rc = run_config(preset("default"), "rope_axial", 0)
    folder = checkpoint_dir(Path("runs/study"), "rope_axial", 0, rc)
    rc = model_config_for(rc, build_task(rc.data))
    monkeypatch.chdir(tmp_path)
    poslens.save(build_model(rc.model, seed=0), folder, data=rc.data)
    scope: dict[str, object] = {}
    exec(compile(_api_example(), str(README), "exec"), scope)  # our own README
    model, x = scope["model"], scope["x"]
    assert isinstance(model, poslens.ViT) and isinstance(x, torch.Tensor)
    # the model runs on the grid it was trained for (DataConfig() would have made 32 px images)
    assert x.shape[-1] == model.cfg.image_size == rc.data.image_size
    masked = scope["masked"]
    assert isinstance(masked, torch.Tensor) and masked.shape == (64, model.cfg.num_classes)
