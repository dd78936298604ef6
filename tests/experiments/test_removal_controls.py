"""position_removal's controls on tiny models: the table edit (row + column part alone, cell
residual alone) and the oblique model's axis conditions by pre-rotation axis."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from poslens.data import DataConfig, Task, build_task
from poslens.errors import ConfigError
from poslens.experiments import position_removal as pr
from poslens.experiments.config import Passes
from poslens.experiments.output import condition_numbers
from poslens.interventions import axis_map
from poslens.io import jsonable
from poslens.models import ViT
from tests.conftest import tiny

DATA = DataConfig(image_size=16, object_scale=0.32, n_val=16, n_test=60)
CFG = pr.Config(n_images=40, probe_images=20, batch_size=40, draws=1, n_planes=(2,))


@pytest.fixture(scope="module")
def task() -> Task:
    return build_task(DATA)


def model(posenc: str, **kw: object) -> ViT:
    return tiny(posenc, num_classes=16, **kw)


def test_additive_table_keeps_the_model_under_its_row_col_part(task: Task) -> None:
    m = model("ape", ape_code="rowcol")  # planted r[row] + c[col]: exactly additive
    res = pr.run(m, task, CFG)
    by_name = {c.name: c for c in res.conditions}
    assert pr.TABLE_CELL not in by_name and "cell part is zero" in res.skipped[pr.TABLE_CELL]
    rowcol = by_name[pr.TABLE_ROWCOL]
    assert rowcol.accuracy == res.baseline["accuracy"]
    assert rowcol.margin == pytest.approx(res.baseline["margin"], abs=1e-5)
    d = jsonable(res.to_dict())
    h = pr.headline(d)
    assert h[pr.TABLE_ROWCOL_SHARE] == pytest.approx(1.0, abs=1e-9)
    # the skipped condition has every number ape_zero has, each NaN (never 0)
    ape = next(c for c in d["conditions"] if c["name"] == pr.APE_ZERO)
    cell_keys = set(condition_numbers(pr.TABLE_CELL, ape))
    assert cell_keys and cell_keys <= h.keys() and all(math.isnan(h[k]) for k in cell_keys)
    assert not math.isnan(h[pr.key(pr.TABLE_ROWCOL, "accuracy")])
    assert pr.AXES_PRE_ROTATION not in h  # no rotary planes


def test_learned_table_runs_both_parts_with_every_measure(task: Task) -> None:
    m = model("ape")
    res = pr.run(m, task, CFG)
    assert res.skipped == {}
    h = pr.headline(jsonable(res.to_dict()))
    for name in (pr.TABLE_ROWCOL, pr.TABLE_CELL):
        ours = {k.partition(".")[2] for k in h if k.startswith(f"{name}.")}
        assert ours == {k.partition(".")[2] for k in h if k.startswith(f"{pr.APE_ZERO}.")}
    assert 0 < h[pr.TABLE_ROWCOL_SHARE] < 1
    assert h[pr.table_key("row_share")] + h[pr.table_key("col_share")] == pytest.approx(
        h[pr.TABLE_ROWCOL_SHARE]
    )


def _masks(m: ViT, cfg: pr.Config) -> dict[str, torch.Tensor]:
    """Each rotary condition's effective mask [depth, H, P] (rotary_mask yields it)."""
    out = {}
    for name, cond, meta in pr.conditions(m, cfg):
        if meta["kind"] in ("axis", "random"):
            with cond(m) as mask:
                out[name] = mask
    return out


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_oblique_axis_conditions_take_each_planes_pre_rotation_axis(layout: str) -> None:
    m = model("rope_axial", rope_variant="oblique", rope_layout=layout)  # 8 planes per head
    assert axis_map(m).counts()["mixed"] == 2 * 2 * 8  # the angles follow no axis
    masks = _masks(m, CFG)
    row, col = masks[pr.axis_condition("row")], masks[pr.axis_condition("col")]
    assert (row.sum(-1) == 4).all() and (col.sum(-1) == 4).all()  # half of every head's planes
    assert not (row & col).any()
    # before the turn planes [0, P/2) followed the column (posenc._axial): those are turned to
    # the main diagonal, the row planes to the other one
    direction = axis_map(m).direction_deg
    np.testing.assert_allclose(direction[col.numpy()], 45.0, atol=1e-6)
    np.testing.assert_allclose(direction[row.numpy()], 135.0, atol=1e-6)
    rnd = masks[f"{pr.random_condition(4)}/0"]  # one axis's count per head, though n_planes=(2,)
    assert (rnd.sum(-1) == 4).all()


def test_axis_source_is_recorded_in_the_headline(task: Task) -> None:
    cfg = pr.Config(**{**CFG.__dict__, "n_planes": (4,)})  # one axis's count: no other n
    for variant, pre in (("oblique", 1.0), ("standard", 0.0)):
        m = model("rope_axial", rope_variant=variant)
        h = pr.headline(jsonable(pr.run(m, task, cfg).to_dict()))
        assert h[pr.AXES_PRE_ROTATION] == pre and h[pr.AXIS_PLANES_PER_HEAD] == 4.0
        for axis in ("row", "col"):
            assert math.isfinite(h[pr.key(pr.axis_condition(axis), "accuracy")])
        assert math.isfinite(h[pr.key(pr.random_condition(4), "accuracy")])


def test_kinds_narrow_the_conditions_and_keep_the_rest_as_they_were() -> None:
    """position_removal.kinds runs only the kinds named (an in-situ control's narrowing): the
    conditions kept are the full run's, in its order; random_axis keeps only one axis's count
    of random planes; () leaves the reference alone; an unknown kind is refused by name."""

    rope = tiny("rope_axial", num_classes=4, dim=64, heads=4, depth=2)
    ape = tiny("ape", num_classes=4)
    full = {m: [c[0] for c in pr.conditions(m, pr.Config(draws=2))] for m in (rope, ape)}
    per = pr.axis_planes_per_head(rope, pr.plane_axes(rope)[0])
    assert any(n.startswith("top_") for n in full[rope]) and "ape_zero" in full[ape]
    split = [c[0] for c in pr.conditions(rope, pr.Config(draws=2, kinds=("axis", "random_axis")))]
    assert split == ["axis_row", "axis_col", f"random_{per}/0", f"random_{per}/1"]
    assert split == [n for n in full[rope] if n in split]  # same names, same order
    table = [c[0] for c in pr.conditions(ape, pr.Config(kinds=("table",)))]
    assert table == ["table_rowcol", "table_cell"]
    assert pr.conditions(rope, pr.Config(kinds=())) == [] == pr.conditions(ape, pr.Config(kinds=()))
    with pytest.raises(ConfigError, match="position_removal.kinds"):
        pr.Config(kinds=("axes",))


def test_unprobed_removal_reads_the_same_accuracy_in_one_pass_per_condition(
    task: Task, monkeypatch: pytest.MonkeyPatch
) -> None:
    """probes=false (an in-situ control whose rules read accuracy alone): every accuracy and
    margin as the probed run has them, from one clean pass each, with no probe fitted and
    every probe and SSDC number NaN, never 0; the figure still draws."""
    from poslens.experiments import readout

    m = model("rope_axial", dim=64, heads=4, depth=2)
    probed = pr.run(m, task, CFG)
    calls: list[tuple[int, bool]] = []
    measure = readout.measure

    def counted(*a: object, **kw: object) -> readout.Readout:
        passes = kw.get("passes", Passes())
        assert isinstance(passes, Passes)
        calls.append((len(kw.get("probe_sites", ())), passes.under_rpi))
        return measure(*a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(pr, "measure", counted)
    bare = pr.run(m, task, pr.Config(**{**CFG.__dict__, "probes": False}))
    assert calls and all(c == (0, False) for c in calls)  # no probe site, no RPI pass
    assert len(calls) == 2 + len(bare.conditions)  # intact, floor, each condition once
    h, hb = (pr.headline(jsonable(r.to_dict())) for r in (probed, bare))
    accuracy = [k for k in h if k.endswith(".accuracy") or k.endswith(".margin")]
    assert accuracy and all(hb[k] == pytest.approx(h[k], abs=1e-6) for k in accuracy)
    numbers = [k for k in h if "probe" in k or "ssdc" in k or k.startswith("chance")]
    assert numbers and all(hb[k] is None or math.isnan(hb[k]) for k in numbers if k in hb)
    pr.plot(bare)
    with pytest.raises(ConfigError, match="position_removal.probes"):
        pr.Config(probes="no")  # type: ignore[arg-type]
