"""Experiments on tiny models: exact identities (floor = no-position model, full window = floor,
full patch = recovery 1), condition construction, recovery arithmetic, outputs and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import poslens
from poslens.cli import main
from poslens.data import DataConfig, Task, build_task
from poslens.errors import ConfigError, UserError
from poslens.experiments import axis_map as axis_map_exp
from poslens.experiments import components, depth_profile, get, position_removal, windows
from poslens.experiments.conditions import floor_condition
from poslens.experiments.config import ExperimentConfig
from poslens.experiments.output import save
from poslens.experiments.readout import Readout, choose_probe_site, measure
from poslens.interventions import axis_map
from poslens.metrics.probes import ProbeResult
from poslens.models import ViT
from tests.conftest import tiny

DATA = DataConfig(image_size=16, object_scale=0.32, n_val=16, n_test=60)
CFG = ExperimentConfig(n_images=40, probe_images=20, batch_size=40, draws=1)


@pytest.fixture(scope="module")
def task() -> Task:
    return build_task(DATA)


def model(posenc: str = "rope_axial", **kw: object) -> ViT:
    return tiny(posenc, num_classes=16, **kw)


def _same_readout(a: Readout, b: Readout) -> None:
    np.testing.assert_array_equal(a.correct, b.correct)
    np.testing.assert_allclose(a.margin, b.margin, atol=1e-5)
    np.testing.assert_allclose(a.ssdc_rpi, b.ssdc_rpi, atol=1e-6)
    np.testing.assert_allclose(a.ssdc_rpi_norm, b.ssdc_rpi_norm, atol=1e-6)
    assert a.probes is not None and b.probes is not None
    np.testing.assert_allclose(a.probes.test_acc, b.probes.test_acc, atol=1e-9)


@pytest.mark.parametrize("posenc", ["rope_axial", "rope_mixed", "ape", "rope_axial_ape", "relpos"])
def test_floor_equals_the_model_without_position(task: Task, posenc: str) -> None:
    m = model(posenc)
    none = model("none")
    missing, _ = none.load_state_dict(m.state_dict(), strict=False)
    assert not missing
    x, y = task.split("test")
    x, y = x[:40], y[:40]
    floor = measure(m, x, y, CFG, floor_condition(m), probe_sites=[0, 2])
    plain = measure(none, x, y, CFG, probe_sites=[0, 2])
    _same_readout(floor, plain)
    intact = measure(m, x, y, CFG, probe_sites=[0, 2])
    assert not np.allclose(intact.margin, floor.margin)  # the floor did change the model


def test_ssdc_images_limits_ssdc_only(task: Task) -> None:
    """ssdc_images=k: SSDC (clean and under RPI) is that of the first k images, batches split
    across the boundary; accuracy, margins and probes still read all the images."""
    m = model()
    x, y = task.split("test")
    x, y = x[:40], y[:40]
    cfg = ExperimentConfig(n_images=40, probe_images=20, batch_size=15, ssdc_images=25)
    part = measure(m, x, y, cfg, probe_sites=[1], clean_ssdc=True)
    first = measure(m, x[:25], y[:25], CFG, probe_sites=[1], clean_ssdc=True)
    every = measure(m, x, y, CFG, probe_sites=[1], clean_ssdc=True)
    for field in ("ssdc_rpi", "ssdc_rpi_norm", "ssdc_clean", "ssdc_clean_norm"):
        np.testing.assert_allclose(getattr(part, field), getattr(first, field), atol=1e-9)
        assert not np.allclose(getattr(part, field), getattr(every, field))
    np.testing.assert_array_equal(part.correct, every.correct)
    np.testing.assert_allclose(part.margin, every.margin, atol=1e-5)
    assert part.probes is not None and every.probes is not None
    np.testing.assert_allclose(part.probes.test_acc, every.probes.test_acc, atol=1e-9)


def test_prefix_window_over_every_block_equals_the_floor(task: Task) -> None:
    m = model()
    cfg = windows.Config(**{**CFG.__dict__, "prefix_ks": (1,), "axis_windows": False})
    res = windows.run(m, task, cfg)
    full = next(w for w in res.windows if w.result.name == "prefix_1")
    assert full.blocks == [0, 1]
    np.testing.assert_allclose(full.result.ssdc_rpi, res.floor["ssdc_rpi"], atol=1e-9)
    assert full.result.margin == pytest.approx(res.floor["margin"], abs=1e-6)
    assert full.result.accuracy == res.floor["accuracy"]
    assert full.onset is None and full.blocks_to_half is None  # nothing after the window
    kinds = {w.kind for w in res.windows}
    assert kinds == {"prefix", "suffix", "middle"}


def test_windows_axis_and_random_controls_have_matching_sizes(task: Task) -> None:
    m = model()
    cfg = windows.Config(**{**CFG.__dict__, "prefix_ks": (0,), "probe_curves": False})
    conds = windows.conditions(m, cfg)
    names = [c[0] for c in conds]
    assert {"prefix_0", "suffix_1", "row_prefix_0", "col_prefix_0", "random_prefix_0/0"} <= set(
        names
    )
    with pytest.raises(ConfigError, match="prefix_ks"):
        windows.conditions(m, windows.Config(prefix_ks=(5,)))


def test_recovery_onset_and_half() -> None:
    base = np.array([0.0, 0.2, 0.5, 0.8, 0.9])
    floor = np.zeros(5)
    cond = np.array([0.0, 0.0, 0.05, 0.5, 0.8])  # window = blocks 0..1
    onset, half = windows.recovery(cond, base, floor, last=1)
    assert onset == 3  # 0.05 < 0.1 * 0.9 at site 2; 0.5 at site 3
    assert half == 1  # site 3 has 0.5 >= 0.8 / 2, one site after the first free site (2)
    assert windows.recovery(floor, base, floor, last=1) == (None, None)


def test_patching_every_block_recovers_everything(task: Task) -> None:
    m = model()
    x, y = task.split("test")
    res = components.run_patching(m, x[:40], y[:40], components.Config(**CFG.__dict__))
    for row in res.rows:
        if row["site"] == "resid" and row["donor"] == "aligned" and row["block"] in ("all", 0):
            assert row["recovery_margin"] == pytest.approx(1.0, abs=1e-5)
            assert row["margin"] == pytest.approx(res.clean["margin"], abs=1e-5)
    other = next(r for r in res.rows if r["block"] == "all" and r["donor"] == "other_image")
    assert other["margin"] != pytest.approx(res.clean["margin"])  # the control is not the clean run
    assert {r["donor"] for r in res.rows} == set(components.DONORS)


def test_component_windows_partition_the_depth() -> None:
    for depth in (1, 2, 3, 6, 12):
        parts = components.thirds(depth)
        assert [b for part in parts.values() for b in part] == list(range(depth))
    assert components.thirds(6) == {"early": [0, 1], "middle": [2, 3], "late": [4, 5]}


def test_removal_conditions_per_encoding() -> None:
    cfg = position_removal.Config(n_planes=(2, 4), draws=2)
    names = [c[0] for c in position_removal.conditions(model("ape"), cfg)]
    assert names == ["ape_zero", "ape_permute", "table_rowcol", "table_cell"]
    names = [c[0] for c in position_removal.conditions(model("sincos"), cfg)]
    assert names == ["ape_zero", "ape_permute"]  # a fixed table: nothing learned to split
    rope = model()
    names = [c[0] for c in position_removal.conditions(rope, cfg)]
    assert names[:2] == ["axis_row", "axis_col"]
    assert {"top_2", "top_4", "random_2/0", "random_2/1", "random_4/1"} <= set(names)
    # the none model runs too (the negative control of "position matters"): no conditions,
    # the floor is the model itself
    assert position_removal.applies(model("none")) is None
    assert position_removal.conditions(model("none"), position_removal.Config()) == []


def test_top_frequency_planes_take_half_per_axis_and_the_fastest() -> None:
    m = model()  # head_dim 16: 8 planes, 4 per axis
    amap = axis_map(m)
    mask = position_removal.top_frequency_mask(m, 4).numpy()
    for b, h in np.ndindex(mask.shape[:2]):
        for axis in ("row", "col"):
            on_axis = amap.axis[b, h] == axis
            chosen = mask[b, h] & on_axis
            assert chosen.sum() == 2
            assert amap.freq[b, h][chosen].min() >= amap.freq[b, h][on_axis & ~mask[b, h]].max()
    r0, r1 = (position_removal.random_mask(m, 3, seed=s) for s in (0, 1))
    assert (r0.sum(-1) == 3).all() and not torch.equal(r0, r1)


def test_position_removal_end_to_end_and_outputs(task: Task, tmp_path: Path) -> None:
    m = model()
    res = position_removal.run(
        m, task, position_removal.Config(**{**CFG.__dict__, "n_planes": (2,)})
    )
    by_name = {c.name: c for c in res.conditions}
    assert {"axis_row", "axis_col", "top_2", "random_2/0"} <= set(by_name)
    assert res.floor.retention["accuracy"] == pytest.approx(0.0) or np.isnan(
        res.floor.retention["accuracy"]
    )
    assert 0 <= res.probe_site <= m.cfg.depth
    assert by_name["axis_row"].probe is not None and by_name["axis_row"].probe.shape == (3,)
    files = save(res, tmp_path, position_removal.plot)
    assert {f.name for f in files} == {
        "position_removal.json",
        "position_removal_conditions.csv",
        "position_removal.png",
    }
    text = (tmp_path / "position_removal.json").read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    rows = (tmp_path / "position_removal_conditions.csv").read_text().splitlines()
    assert len(rows) == 1 + 1 + len(res.conditions)  # header, floor, conditions


def test_depth_profile_and_axis_map(task: Task, tmp_path: Path) -> None:
    m = model()
    res = depth_profile.run(m, task, CFG)
    assert res.sites == ["0", "1", "out"]
    assert res.probes.test_acc.shape == res.control.test_acc.shape == (3, 3)
    assert res.ssdc_clean.shape == res.ssdc_rpi.shape == res.effective_rank.shape == (3,)
    save(res, tmp_path, depth_profile.plot)
    assert (tmp_path / "depth_profile_probes.csv").is_file()
    amap = axis_map_exp.run(m)
    assert amap.counts == {"row": 2 * 2 * 4, "col": 2 * 2 * 4, "mixed": 0, "none": 0}
    assert len(amap.tables()["planes"]) == 2 * 2 * 8
    assert axis_map_exp.applies(model("ape")) is not None


def test_probe_site_prefers_the_highest_ssdc_among_tied_probes() -> None:
    acc = np.ones((3, 3))
    probes = ProbeResult(acc, acc, acc, (1 / 16, 1 / 4, 1 / 4), (6, 2, 2))
    r = Readout(
        correct=np.ones(4, bool),
        margin=np.ones(4),
        ssdc_rpi=np.array([0.2, 0.7, 0.5]),
        ssdc_rpi_norm=np.zeros(3),
        ssdc_clean=None,
        ssdc_clean_norm=None,
        probes=probes,
        probe_sites=(0, 1, 2),
    )
    assert choose_probe_site(r) == 1


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n_images": 5}, "n_images"),
        ({"probe_images": 5}, "probe_images"),
        ({"n_images": 20, "probe_images": 30}, "probe_images"),
        ({"split": "train"}, "split"),
        ({"probe_block": -2}, "probe_block"),
        ({"ssdc_images": 5}, "ssdc_images"),
        ({"n_images": 20, "probe_images": 10, "ssdc_images": 30}, "ssdc_images"),
    ],
)
def test_config_errors_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        ExperimentConfig(**kwargs)


def test_unknown_experiment_and_bad_site(task: Task) -> None:
    with pytest.raises(UserError, match="unknown experiment"):
        get("nope")
    with pytest.raises(UserError, match="site 9"):
        x, y = task.split("test")
        measure(
            model(), x[:10], y[:10], ExperimentConfig(n_images=10, probe_images=10), probe_sites=[9]
        )


def _checkpoint(folder: Path) -> Path:
    m = model()
    return poslens.save(m, folder, DATA)


def test_analyze_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = _checkpoint(tmp_path / "ckpt")
    out = tmp_path / "out"
    argv = ["analyze", str(ckpt), "--out", str(out), "--images", "20", "--probe-images", "10"]
    assert main([*argv, "--experiments", "depth_profile,axis_map", "--no-progress"]) == 0
    summary = json.loads((out / "analysis.json").read_text())
    assert set(summary["experiments"]) == {"depth_profile", "axis_map"}
    assert (out / "depth_profile.png").is_file() and (out / "axis_map_planes.csv").is_file()
    assert "depth_profile" in capsys.readouterr().out

    bad = tmp_path / "bad"
    assert main([*argv[:2], "--out", str(bad), "--experiments", "depth_profile,nope"]) == 2
    assert main([*argv[:2], "--out", str(bad), "--images", "3"]) == 2
    assert "--images must be at least 10" in capsys.readouterr().err
    for item, message in (
        ("depth_profile.colour=1", "unknown field depth_profile.colour"),
        ("depth_profile.draws=many", "depth_profile.draws must be int"),
        ("windows.draws=2", "experiment 'windows' is not selected"),
        ("depth_profile", "EXPERIMENT.FIELD=VALUE"),
    ):
        argv_bad = [*argv[:2], "--out", str(bad), "--experiments", "depth_profile"]
        assert main([*argv_bad, "--set", item]) == 2
        assert message in capsys.readouterr().err
    assert not bad.exists()
    # --set reaches the experiment's config (recorded in analysis.json)
    argv_set = [*argv, "--experiments", "axis_map", "--no-progress", "--set", "axis_map.draws=5"]
    assert main([*argv_set[:3], str(tmp_path / "set"), *argv_set[4:]]) == 0
    summary = json.loads((tmp_path / "set" / "analysis.json").read_text())
    assert summary["experiments"]["axis_map"]["config"]["draws"] == 5


def test_random_planes_at_one_axis_count_run_whatever_n_planes_lists() -> None:
    """The split rule compares each axis with as many random planes per head as one axis has
    (16 at ViT-B's head dim 64): position_removal runs that count even when n_planes lacks it."""
    m = tiny("rope_axial", dim=64, heads=2)  # head dim 32: 8 planes per axis
    names = [c[0] for c in position_removal.conditions(m, position_removal.Config(n_planes=(2,)))]
    assert "random_8/0" in names and "random_2/0" in names
    assert not any(n.startswith("random_4") for n in names)


def test_random_planes_are_drawn_among_the_planes_that_rotate() -> None:
    """Removing a plane that does not turn removes nothing, so random planes come only from the
    rotating ones (as many as there are); with every plane rotating the draw is unchanged."""
    from poslens.experiments.conditions import random_mask
    from poslens.interventions import in_situ
    from poslens.interventions.rotary import axis_map

    m = tiny("rope_axial", heads=4)
    every = torch.ones(m.cfg.depth, 4, m.cfg.head_dim // 2, dtype=torch.bool)
    assert torch.equal(random_mask(m, 2, seed=5, among=every), random_mask(m, 2, seed=5))
    split = in_situ.edited(m, "heads_axis_split")  # half of every head's planes stopped
    turning = torch.as_tensor(axis_map(split).axis != "none")
    for n in (1, 2, 3):
        mask = random_mask(split, n, seed=5, among=turning)
        assert not (mask & ~turning).any()
        assert (mask.sum(-1) == torch.minimum(torch.tensor(n), turning.sum(-1))).all()


def test_every_suffix_false_keeps_only_the_suffixes_the_compensation_reads() -> None:
    """windows.every_suffix=false: of the suffix windows only k+1..end for each prefix window k
    (its compensation's control) and no middle window; the windows kept are the full run's."""
    from poslens.experiments import windows as w

    model = tiny("rope_axial", depth=4)
    full = [c[0] for c in w.conditions(model, w.Config(axis_windows=False))]
    some = [c[0] for c in w.conditions(model, w.Config(axis_windows=False, prefix_ks=(0, 2),
                                                       every_suffix=False))]  # fmt: skip
    assert some == ["prefix_0", "prefix_2", "suffix_1", "suffix_3"]
    assert set(some) <= set(full) and any(n.startswith("middle") for n in full)
    last = [c[0] for c in w.conditions(model, w.Config(axis_windows=False, prefix_ks=(3,),
                                                       every_suffix=False))]  # fmt: skip
    assert last == ["prefix_3"]  # the whole depth withheld: no later blocks, no suffix
