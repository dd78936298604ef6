"""batch_size 0: the analysis batch chosen from the model and the device (limits.auto_batch_size):
the same on any CPU, following free memory on a GPU, and exactly an explicit batch's numbers."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from poslens import limits
from poslens.data import DataConfig, build_task
from poslens.experiments import registry
from poslens.experiments.analyze import analyze
from poslens.experiments.config import resolved
from poslens.models.config import ModelConfig
from tests.conftest import tiny


def vit(dim: int, depth: int, heads: int, image: int = 224) -> ModelConfig:
    return ModelConfig(dim=dim, depth=depth, heads=heads, image_size=image, patch_size=16,
                       num_classes=1000, posenc="ape")  # fmt: skip


def test_the_cpu_batch_fills_its_fixed_budget_and_no_more() -> None:
    for cfg, low, high in ((vit(384, 12, 6), 6, 16), (vit(768, 12, 12), 3, 8)):
        b = limits.auto_batch_size(cfg, "cpu")
        assert low <= b <= high
        budget = limits.CPU_BATCH_BYTES
        assert (
            limits.analysis_batch_bytes(cfg, b) <= budget < limits.analysis_batch_bytes(cfg, b + 1)
        )
    small = tiny("ape").cfg  # the study's small models: the old fixed batch
    assert limits.auto_batch_size(small, "cpu") == limits.MAX_AUTO_BATCH


def test_a_gpu_batch_follows_its_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = vit(768, 12, 12)
    free = {"bytes": 8 * 2**30}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 80 * 2**30))
    big = limits.auto_batch_size(cfg, "cuda")
    free["bytes"] = 2**30
    small = limits.auto_batch_size(cfg, "cuda")
    per = limits.analysis_batch_bytes(cfg, 1)
    assert big == min(limits.MAX_AUTO_BATCH, int(0.5 * 8 * 2**30 // per)) > small >= 1
    free["bytes"] = 0
    assert limits.auto_batch_size(cfg, "cuda") == 1


def test_batch_zero_is_resolved_recorded_and_gives_an_explicit_batchs_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = build_task(DataConfig(image_size=16, object_scale=0.32, n_val=20, n_test=40))
    model = tiny("rope_axial", num_classes=task.num_classes)
    monkeypatch.setattr(limits, "CPU_BATCH_BYTES", 3 * limits.analysis_batch_bytes(model.cfg, 1))
    assert resolved(registry.get("depth_profile").Config(), model).batch_size == 3
    cfg = registry.get("depth_profile").Config(n_images=40, probe_images=20)
    auto = analyze(model, task, ["depth_profile"], [cfg], tmp_path / "a", formats=())
    fixed = dataclasses.replace(cfg, batch_size=3)
    explicit = analyze(model, task, ["depth_profile"], [fixed], tmp_path / "b", formats=())
    assert auto["depth_profile"]["config"]["batch_size"] == 3
    assert auto["depth_profile"]["headline"] == explicit["depth_profile"]["headline"]
    other = analyze(model, task, ["depth_profile"], [dataclasses.replace(cfg, batch_size=40)],
                    tmp_path / "c", formats=())  # fmt: skip
    assert other["depth_profile"]["config"]["batch_size"] == 40


def test_an_experiment_run_directly_resolves_the_batch_itself() -> None:
    """A notebook calls an experiment's run() with its Config's default batch (0) and no
    `analyze`: run() resolves it, instead of slicing images by a batch of 0."""
    from poslens.experiments import position_removal

    task = build_task(DataConfig(image_size=16, object_scale=0.32, n_val=20, n_test=40))
    model = tiny("rope_axial", num_classes=task.num_classes)
    cfg = position_removal.Config(n_images=40, probe_images=20, n_planes=(2,), draws=1)
    assert cfg.batch_size == 0
    res = position_removal.run(model, task, cfg)
    assert res.n_images == 40 and res.conditions
