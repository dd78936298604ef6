"""Calibration belongs to the design: a run whose level has a confirmed fingerprint reads the
confirmation's calibration (its controls, fixed) and tests its study models among themselves; the
confirmation itself, and a run of another design, calibrate themselves; a run's own control that
contradicts the confirmation is flagged; confirmed.json is the record of the committed
confirmation."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from poslens.study.claims import RULES
from poslens.study.config import preset
from poslens.study.confirmed import RECORD, Confirmed, load, record
from poslens.study.judge import evaluate_claims, level_fingerprint
from poslens.study.verdicts import INCONCLUSIVE, NOT_SPECIFIC, REPRODUCES, SUPPORTED
from tests.study.test_claims import calibrated, entry, heads, merge, split, windows

ROOT = Path(__file__).parents[2]
CONFIRM = preset("default", seeds=5, seed_start=100)
RUN = preset("default", seeds=5)


def _results(cfg: Any, models: dict[str, Any]) -> dict[str, Any]:
    claims = evaluate_claims(models, cfg, confirmations={})
    return {"config": cfg.to_dict(), "claims": [c.to_dict() for c in claims]}


@pytest.fixture(scope="module")
def confirmed() -> dict[str, Confirmed]:
    """The constructed numbers judged as a confirmation on seeds 100-104, recorded."""
    path_free = record(_results(CONFIRM, calibrated()))
    return {fp: Confirmed.from_dict(d) for fp, d in path_free["levels"].items()}


def study_only() -> dict[str, Any]:
    """The study models of calibrated(), no control model trained (in-situ ones neither)."""
    return {m: e for m, e in calibrated().items() if m in ("ape", "rope_axial", "rope_mixed")}


def test_a_run_of_a_confirmed_design_reads_its_calibration(confirmed: dict[str, Any]) -> None:
    assert len(confirmed) == len(RULES)
    alone = {c.id: c for c in evaluate_claims(study_only(), RUN, confirmations={})}
    read = {c.id: c for c in evaluate_claims(study_only(), RUN, confirmations=confirmed)}
    for rule in RULES:
        if rule.descriptive:
            continue
        # without its controls a run cannot calibrate itself; with the confirmation it decides
        assert alone[rule.id].verdict == INCONCLUSIVE, rule.id
        c = read[rule.id]
        assert c.verdict == (REPRODUCES if rule.level == "original" else SUPPORTED), c.summary
        assert c.confirmation is not None and c.confirmation["seeds"] == [100, 104]
        assert "Calibrated by the confirmation of this design" in c.summary
        # this run trained no control: it shows only the nulls built inside its own models
        assert all(", " in row.model for row in c.calibration.controls), rule.id
        assert c.to_dict()["confirmation"]["text"].startswith(c.confirmation["verdict"])
        # the study models were tested among themselves: Holm over them alone
        if len(c.primary.models) == 1:
            (t,) = c.primary.models.values()
            assert t.p_holm == pytest.approx(t.p), rule.id
    # the specificity of an original level is the confirmation's
    late = calibrated()
    late["rope_late"] = entry("rope_axial", merge(windows(0.5, 0.0), heads(-0.1, 0.0, 0.0)))
    loud = record(_results(CONFIRM, late))["levels"]
    conf = {fp: Confirmed.from_dict(d) for fp, d in loud.items()}
    c = next(c for c in evaluate_claims(study_only(), RUN, confirmations=conf)
             if c.id == "rope_rebuilds.original")  # fmt: skip
    assert (c.verdict, c.qualifier) == (REPRODUCES, NOT_SPECIFIC)
    assert "rope_late (confirmed)" in c.summary


def test_the_confirmation_and_other_designs_calibrate_themselves(
    confirmed: dict[str, Any],
) -> None:
    # the confirmation's own seeds (or a part of them) never read it
    own = evaluate_claims(study_only(), replace(CONFIRM, seeds=2), confirmations=confirmed)
    assert all(c.confirmation is None for c in own)
    # another design (more images): another fingerprint, no confirmation
    other = evaluate_claims(study_only(), replace(RUN, n_images=200), confirmations=confirmed)
    assert all(c.confirmation is None for c in other)


def test_a_control_that_contradicts_the_confirmation_is_flagged(
    confirmed: dict[str, Any],
) -> None:
    ms = calibrated()
    ms["rope_rebuild"] = entry("rope_axial", merge(split(0.9, 0.3), windows(0.2, 0.0),
                                                   heads(0.3, 0.0, 0.8)))  # fmt: skip
    claims = {c.id: c for c in evaluate_claims(ms, RUN, confirmations=confirmed)}
    c = claims["rope_rebuilds.original"]
    assert c.verdict == REPRODUCES  # the confirmation's calibration still decides
    (flag,) = [x for x in c.caveats if x.startswith("Contradicts the confirmation")]
    assert "rope_rebuild (positive) reads 0.20" in flag
    assert not any(x.startswith("Contradicts") for x in claims["position_matters.original"].caveats)


def test_the_packaged_record_is_the_committed_confirmations() -> None:
    committed = ROOT / "docs" / "confirmation" / "results.json"
    data = json.loads(RECORD.read_text())
    if committed.is_file():
        assert data == record(json.loads(committed.read_text()))
    else:  # no confirmation yet: every level calibrates itself
        assert data["levels"] == {} and load() == {}


def test_the_default_trains_every_control_its_confirmation_does_not_establish() -> None:
    """A level of the default's design reads its calibration from the confirmation once that is
    recorded; until then (or for a level it did not confirm) the default trains its controls."""
    cfg = preset("default")
    confirmed = load()
    for rule in RULES:
        if rule.descriptive or level_fingerprint(rule, cfg) in confirmed:
            continue
        trained = [c.model for c in rule.controls if not c.in_situ and c.model != "*"
                   and not c.optional]  # fmt: skip
        assert set(trained) <= set(cfg.models), rule.id
