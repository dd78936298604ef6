"""Prefix attention blocked: exactly the patch -> prefix attention is cut, and only while active."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from poslens.data import DataConfig, Task, build_task
from poslens.errors import UserError
from poslens.experiments import prefix_attention
from poslens.experiments.conditions import floor_condition
from poslens.experiments.config import ExperimentConfig
from poslens.experiments.output import save
from poslens.experiments.prefix_attention import block_prefix_attention, prefix_mass
from poslens.metrics import correct_class_margin, paired_diff
from tests.conftest import tiny

DATA = DataConfig(image_size=16, object_scale=5 / 16, margin=2.0, n_val=8, n_test=40, n_content=1)
CFG = ExperimentConfig(n_images=40, probe_images=20, batch_size=40)


@pytest.fixture(scope="module")
def data() -> Task:
    return build_task(DATA)


def _patterns(model, images: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    names = [f"blocks.{b}.attn.hook_pattern" for b in range(model.cfg.depth)]
    with torch.no_grad():
        logits, cache = model.run_with_cache(images, names)
    return logits, [cache[n] for n in names]


def _no_hooks(model) -> bool:
    return not any(model.get_submodule(n).active for n in model.hook_names())


def test_patch_queries_cannot_read_prefix_keys(images: torch.Tensor) -> None:
    model = tiny("rope_axial", num_registers=1)  # CLS + 1 register
    p = model.cfg.num_prefix
    assert p == 2
    _, intact = _patterns(model, images)
    with block_prefix_attention(model):
        _, blocked = _patterns(model, images)
    for b, pat in enumerate(blocked):
        assert (pat[:, :, p:, :p] == 0).all(), f"block {b}"
        assert (pat[:, :, p:, p:] > 0).all()
        torch.testing.assert_close(pat.sum(-1), torch.ones_like(pat.sum(-1)))
        assert (intact[b][:, :, p:, :p] > 0).all()  # there was something to block
    # Prefix queries are untouched: in block 0 (same input) their rows are identical.
    torch.testing.assert_close(blocked[0][:, :, :p], intact[0][:, :, :p], rtol=0, atol=0)


def test_blocks_argument_limits_the_blocking(images: torch.Tensor) -> None:
    model = tiny("ape")
    _, intact = _patterns(model, images)
    with block_prefix_attention(model, blocks=[1]):
        _, blocked = _patterns(model, images)
    torch.testing.assert_close(blocked[0], intact[0], rtol=0, atol=0)
    assert (blocked[1][:, :, 1:, :1] == 0).all()
    torch.testing.assert_close(blocked[1][:, :, :1], intact[1][:, :, :1], rtol=0, atol=0)
    with pytest.raises(UserError, match="block 5 out of range"), block_prefix_attention(model, [5]):
        pass


def test_cls_pooled_logits_ignore_blocking_in_the_last_block(images: torch.Tensor) -> None:
    """The CLS query is never blocked, and patch outputs of the last block reach no one."""
    model = tiny("rope_axial")
    with torch.no_grad():
        intact = model(images)
        with block_prefix_attention(model, blocks=[model.cfg.depth - 1]):
            last = model(images)
        with block_prefix_attention(model, blocks=[0]):
            first = model(images)
    torch.testing.assert_close(last, intact, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(first, intact, rtol=0, atol=1e-6)  # block 0 patches feed the CLS


def test_hooks_are_removed_after_the_block_also_on_error(images: torch.Tensor) -> None:
    model = tiny("rope_axial")
    with torch.no_grad():
        intact = model(images)
        with block_prefix_attention(model):
            assert not _no_hooks(model)
        assert _no_hooks(model)
        with pytest.raises(RuntimeError, match="boom"), block_prefix_attention(model):
            raise RuntimeError("boom")
        assert _no_hooks(model)
        torch.testing.assert_close(model(images), intact, rtol=0, atol=0)


def test_model_without_prefix_gets_a_reason(data: Task) -> None:
    model = tiny("rope_axial", cls_token=False, pool="mean", num_classes=4)
    reason = prefix_attention.applies(model)
    assert reason is not None and "no prefix tokens" in reason
    assert prefix_attention.applies(tiny("rope_axial")) is None
    assert (
        prefix_attention.applies(tiny("rope_axial", cls_token=False, pool="mean", num_registers=2))
        is None
    )
    with pytest.raises(UserError, match="no prefix tokens"), block_prefix_attention(model):
        pass
    with pytest.raises(UserError, match="does not apply: model has no prefix tokens"):
        prefix_attention.run(model, data, CFG)


def test_run_matches_direct_evaluation(data: Task) -> None:
    model = tiny("ape", num_classes=4, num_registers=1)
    result = prefix_attention.run(model, data, CFG)
    x, y = data.split("test")
    x, y = x[:40], y[:40]
    with torch.no_grad():
        intact = correct_class_margin(model(x), y).double().numpy()
        with block_prefix_attention(model):
            logits = model(x)
        with floor_condition(model)(model):
            floor = correct_class_margin(model(x), y).double().numpy()
            with block_prefix_attention(model):
                floor_blocked = correct_class_margin(model(x), y).double().numpy()
    blocked = correct_class_margin(logits, y).double().numpy()
    assert result.blocked.accuracy == (logits.argmax(-1) == y).double().mean().item()
    assert result.blocked.margin == pytest.approx(blocked.mean(), rel=1e-5)
    assert result.blocked.d_margin.mean == pytest.approx(
        paired_diff(blocked, intact).mean, rel=1e-4
    )
    control = result.floor_blocked_vs_floor["margin"]
    assert control.mean == pytest.approx((floor_blocked - floor).mean(), rel=1e-4, abs=1e-7)
    assert control.n == 40
    # Probes at every site for all three readouts; intact attention to the prefix is a fraction.
    assert set(result.probes) == {"intact", "blocked", "floor_blocked"}
    assert all(p.test_acc.shape == (3, 3) for p in result.probes.values())
    assert result.attention_to_prefix.shape == (2, 2)
    assert ((result.attention_to_prefix > 0) & (result.attention_to_prefix < 1)).all()
    with block_prefix_attention(model):
        np.testing.assert_array_equal(prefix_mass(model, x, 40), np.zeros((2, 2)))


def test_fixed_probe_block_still_probes_every_site(data: Task) -> None:
    model = tiny("rope_axial", num_classes=4)
    result = prefix_attention.run(model, data, dataclasses.replace(CFG, probe_block=1))
    assert result.probe_site == 1
    assert all(p.test_acc.shape == (3, 3) for p in result.probes.values())


def test_save_writes_json_csv_and_png(data: Task, tmp_path: Path) -> None:
    result = prefix_attention.run(tiny("rope_axial", num_classes=4), data, CFG)
    written = save(result, tmp_path, prefix_attention.plot)
    assert {p.name for p in written} == {
        "prefix_attention.json",
        "prefix_attention_conditions.csv",
        "prefix_attention_probes.csv",
        "prefix_attention_attention.csv",
        "prefix_attention.png",
    }

    def reject(value: str) -> None:
        raise AssertionError(f"JSON holds the non-standard literal {value}")

    doc = json.loads((tmp_path / "prefix_attention.json").read_text(), parse_constant=reject)
    assert doc["blocked"]["name"] == "blocked" and doc["num_prefix"] == 1
    assert len(doc["probes"]["blocked"]["test_acc"]) == len(result.sites)
    with open(tmp_path / "prefix_attention_conditions.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["condition"] for r in rows] == ["floor", "blocked", "floor_blocked"]
    assert "d_margin_vs_floor_se" in rows[-1]
    with open(tmp_path / "prefix_attention_probes.csv") as f:
        assert len(list(csv.DictReader(f))) == 3 * len(result.sites) * 3
    assert (tmp_path / "prefix_attention.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
