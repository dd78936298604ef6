"""The shared reference: a study run measures the intact reference once for all its experiments
and every experiment's files are byte-identical to separate runs; the cache misses on a changed
weight or setting, hits across the settings no reference reads, and hands out copies;
depth_profile's split readout equals the one readout it replaced."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import poslens
from poslens.data import DataConfig, build_task
from poslens.experiments import depth_profile, readout
from poslens.experiments.analyze import analyze
from poslens.experiments.config import ExperimentConfig
from poslens.experiments.readout import ReferenceCache, baseline, eval_images, reference
from poslens.experiments.readout import references as reference_module
from poslens.study.plan import make_plan
from poslens.study.stages import run_one
from tests.conftest import tiny
from tests.study.test_study import TINY_STUDY

SHARING = ("depth_profile", "position_removal", "windows", "heads", "sae_causal")
# the tiny study of the study tests, on one model and seed; draws differ between experiments (no
# reference reads them): the reference is still shared
STUDY = replace(TINY_STUDY, models=("rope_axial",), seeds=1, experiments=SHARING)


def count_measures(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the readouts `reference` and `baseline` measure (they call measure as
    readout/references.py imports it; the experiments' own conditions go through their imported
    name and are not counted)."""
    calls: list[int] = []
    real = readout.measure

    def counted(*args: Any, **kw: Any) -> readout.Readout:
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(reference_module, "measure", counted)
    return calls


def test_a_study_run_measures_the_reference_once_and_changes_no_number(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (run,) = make_plan(STUDY, tmp_path / "study").runs
    calls = count_measures(monkeypatch)
    entry, _ = run_one(run, tmp_path / "study", "cpu", 1)
    assert len(calls) == 2  # the baseline and the floor, for all five experiments
    assert sorted(entry["experiments"]) == sorted(SHARING)

    # each experiment alone (one analyze call each, as the study ran them before the cache)
    assert run.checkpoint is not None
    del calls[:]
    run_dir = tmp_path / "study" / "runs" / "rope_axial" / "seed0"
    for st in run.stages[1:]:
        model, data = poslens.load(run.checkpoint), poslens.load_task(run.checkpoint)
        records = analyze(model, data, [st.kind], [st.config], tmp_path / "alone", formats=())
        alone = records[st.kind]
        assert alone["headline"] == entry["experiments"][st.kind]["headline"]
        for f in alone["files"]:  # the JSON and CSVs
            assert f.read_bytes() == (run_dir / f.name).read_bytes(), f.name
    assert len(calls) == 3 * 2 + 2  # three references, two baselines: each measured again


DATA = DataConfig(image_size=16, object_scale=0.32, n_val=16, n_test=40)
CFG = ExperimentConfig(n_images=40, probe_images=20, batch_size=40, draws=1)


def test_the_cache_keys_on_what_the_reference_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny("rope_axial", num_classes=16)
    x, y = eval_images(build_task(DATA), CFG)
    calls = count_measures(monkeypatch)
    cache: ReferenceCache = {}
    rng = torch.get_rng_state()
    first = reference(model, x, y, CFG, cache=cache)
    # no global RNG drawn: skipping a reference leaves every later draw of an experiment as it was
    assert torch.equal(torch.get_rng_state(), rng)
    assert len(calls) == 2
    first.base.margin[:] = 0.0  # a consumer's change does not reach the next one
    again = reference(model, x.clone(), y.clone(), replace(CFG, draws=3), [2], cache=cache)
    assert len(calls) == 2  # the same images, a field no reference reads, a site it probes anyway
    assert not np.all(again.base.margin == 0.0)
    np.testing.assert_array_equal(again.base.correct, first.base.correct)
    base = baseline(model, x, y, CFG, list(range(model.cfg.depth + 1)), cache=cache)
    assert len(calls) == 2
    np.testing.assert_array_equal(base.margin, again.base.margin)

    reference(model, x, y, replace(CFG, seed=1), cache=cache)  # another RPI permutation
    assert len(calls) == 4
    reference(model, x.flip(0), y.flip(0), CFG, cache=cache)  # other images (same set)
    assert len(calls) == 6
    with torch.no_grad():
        model.head.bias[0] += 1e-3  # other weights
    reference(model, x, y, CFG, cache=cache)
    assert len(calls) == 8


def test_depth_profile_reads_the_baseline_and_clean_ssdc_as_one_readout_did(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """depth_profile takes the (shareable) baseline with clean SSDC read in its clean pass, or in
    a clean pass of its own where the baseline was measured before: every number equals the
    single probed readout with clean SSDC."""
    model = tiny("rope_axial", num_classes=16)
    task = build_task(DATA)
    x, y = eval_images(task, CFG)
    one = readout.measure(model, x, y, CFG, probe_sites=range(3), clean_ssdc=True)
    assert one.probes is not None
    # first in its run (it measures the baseline, and leaves it in the cache without clean SSDC,
    # as every other consumer reads it), and after another experiment measured the baseline
    fresh: ReferenceCache = {}
    measured: ReferenceCache = {}
    baseline(model, x, y, CFG, range(3), cache=measured)
    for references in (fresh, measured):
        res = depth_profile.run(model, task, CFG, references=references)
        for field in ("ssdc_clean", "ssdc_clean_norm", "ssdc_rpi", "ssdc_rpi_norm"):
            np.testing.assert_array_equal(getattr(res, field), getattr(one, field))
        np.testing.assert_array_equal(res.probes.test_acc, one.probes.test_acc)
        assert (res.accuracy, res.margin) == (one.accuracy, float(one.margin.mean()))
    (key,) = (k for k in fresh if k[0] == "baseline")  # and one kept with clean SSDC
    cached = fresh[key]
    assert isinstance(cached, readout.Readout) and cached.ssdc_clean is None
    calls = count_measures(monkeypatch)
    again = baseline(model, x, y, CFG, range(3), cache=fresh, clean_ssdc=True)
    assert not calls and again.ssdc_clean is not None  # asked again: no pass at all
    np.testing.assert_array_equal(again.ssdc_clean, one.ssdc_clean)
    np.testing.assert_array_equal(cached.ssdc_rpi, one.ssdc_rpi)


def test_a_reference_without_rpi_probes_picks_the_same_site_and_reads_the_same_clean_probes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """rpi_probes=false (an in-situ control whose rules read no RPI number): the same probe site
    (its RPI-SSDC tie-break is still measured), the same clean probes and fixed clean readouts,
    no probe under RPI and no RPI pass for the floor (its RPI-SSDC NaN, never 0); the cache
    keeps the two apart."""
    from poslens.experiments import position_removal as pr

    model = tiny("rope_axial", num_classes=16)
    task = build_task(DATA)
    x, y = eval_images(task, CFG)
    lean = replace(CFG, rpi_probes=False)
    cache: ReferenceCache = {}
    full, bare = (reference(model, x, y, c, cache=cache) for c in (CFG, lean))
    assert len(cache) == 4  # a baseline and a reference each
    assert bare.probe_site == full.probe_site
    np.testing.assert_array_equal(bare.base.ssdc_rpi, full.base.ssdc_rpi)
    assert bare.base.probes is not None and full.base.probes is not None
    np.testing.assert_array_equal(bare.base.probes.test_acc, full.base.probes.test_acc)
    assert bare.base.probes_rpi is None and bare.fixed.rpi is None
    assert np.isnan(bare.floor.ssdc_rpi).all() and bare.floor.fixed_rpi is None
    assert bare.floor.fixed is not None and full.floor.fixed is not None
    np.testing.assert_array_equal(bare.floor.fixed, full.floor.fixed)
    cfg = pr.Config(**{**CFG.__dict__, "n_planes": (2,)})
    res = {c.rpi_probes: pr.run(model, task, c) for c in (cfg, replace(cfg, rpi_probes=False))}
    for a, b in zip(res[True].conditions, res[False].conditions, strict=True):
        # nothing probed under RPI: the conditions' RPI passes read RPI-SSDC alone
        assert a.name == b.name and b.probe_fixed_rpi is None and b.probe_rpi is None
        assert a.probe_rpi is not None
        np.testing.assert_array_equal(a.ssdc_rpi, b.ssdc_rpi)
        np.testing.assert_array_equal(a.probe_fixed, b.probe_fixed)
        np.testing.assert_array_equal(
            a.retention["probe_fixed_row"], b.retention["probe_fixed_row"]
        )
