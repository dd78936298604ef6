"""DataConfig validation: every bad field raises ConfigError naming the field."""

from __future__ import annotations

import pytest

from poslens.data import TASKS, DataConfig, build_task
from poslens.data.relation import RelationTask
from poslens.errors import ConfigError, UserError


def test_defaults_are_valid_and_build_the_relation_task() -> None:
    cfg = DataConfig()
    assert cfg.task == "relation" and TASKS == ("relation", "animals", "folder")
    task = build_task(cfg)
    assert isinstance(task, RelationTask)
    assert (task.num_classes, task.in_chans, task.image_size) == (16, 1, 32)
    assert len(task.class_names) == 16 and task.class_names[0] == "cross/above"


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"image_size": -3}, "data.image_size"),
        ({"image_size": 8}, "data.image_size"),
        ({"image_size": 32.0}, "data.image_size"),
        ({"image_size": True}, "data.image_size"),
        ({"task": "mnist"}, "data.task"),
        ({"relation": "diagonal"}, "data.relation"),
        ({"n_content": 0}, "data.n_content"),
        ({"n_content": 9}, "data.n_content"),  # only 8 glyphs
        ({"task": "animals", "n_content": 11}, "data.n_content"),  # only 10 animals
        ({"background": "white"}, "data.background"),
        ({"n_val": 0}, "data.n_val"),
        ({"n_test": -1}, "data.n_test"),
        ({"seed": -1}, "data.seed"),
        ({"channels": 2}, "data.channels"),
        ({"task": "folder"}, "data.path"),
        ({"path": 3}, "data.path"),
        ({"object_scale": 0.0}, "data.object_scale"),
        ({"object_scale": 0.5}, "data.object_scale"),
        ({"object_scale": 0.1}, "data.object_scale"),  # 3.2 px objects: unreadable
        ({"contrast": float("nan")}, "data.contrast"),
        ({"margin": -1.0}, "data.margin"),
    ],
)
def test_bad_field_raises_config_error_naming_it(overrides: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field) as info:
        DataConfig(**overrides)
    assert isinstance(info.value, UserError)
    assert "\n" not in str(info.value)


def test_n_content_bound_depends_on_task() -> None:
    DataConfig(task="animals", n_content=10)  # 10 animals exist, only 8 glyphs
    DataConfig(task="folder", path="x", n_content=50)  # folder classes come from the folder
