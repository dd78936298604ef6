"""The claims-at-a-glance figure: one panel per claim level, each study model's and control's
effect at its mean with its one-sided bounds, the level's threshold and the original's value;
and the study's SAE figure, which reads the keys sae_causal writes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from poslens.experiments.sae_causal import result as sae
from poslens.study.claims import RULES
from poslens.study.figures import claims_at_a_glance, sae_causal
from poslens.study.judge import evaluate_claims
from tests.study.test_claims import calibrated


def test_one_panel_per_level_with_threshold_bounds_and_the_original() -> None:
    claims = evaluate_claims(calibrated())
    fig = claims_at_a_glance(claims)
    assert fig is not None
    axes = fig.axes
    assert len(axes) == len(RULES)
    for ax, c in zip(axes, claims, strict=True):
        title = ax.get_title(loc="left")
        assert c.title in title and c.verdict in title
        labels = [t.get_text() for t in ax.get_yticklabels()]
        names = [*c.primary.models, *(f"{k.model} ({k.role})" for k in c.calibration.controls)]
        assert labels == names
        vlines = [ln.get_xdata()[0] for ln in ax.get_lines() if len(set(ln.get_xdata())) == 1
                  and ln.get_linestyle() in ("--", ":")]  # fmt: skip
        if c.verdict != "descriptive":
            assert c.primary.threshold in vlines
        ref = c.reference
        if ref.comparable:
            assert ref.effect is not None
            assert any(math.isclose(x, ref.effect) for x in vlines), c.id
        # each measured row: an interval from its one-sided lower to upper bound
        tests = [
            *c.primary.models.values(),
            *(k.test for k in c.calibration.controls),
        ]
        spans = [tuple(ln.get_xdata()) for ln in ax.get_lines() if len(ln.get_xdata()) == 2]
        for t in tests:
            assert any(np.allclose(s, (t.lower, t.upper)) for s in spans)


def test_nothing_to_draw_without_claims() -> None:
    assert claims_at_a_glance([]) is None


def test_the_study_sae_figure_reads_the_site_probe_keys() -> None:
    k = sae.key
    agg = {k("early", sae.ROWCOL_ZEROED, sae.FIXED_DROP_SITE): {"mean": 0.5, "se": 0.1},
           k("early", sae.MATCHED_ROWCOL, sae.FIXED_DROP_SITE): {"mean": 0.05, "se": 0.01}}  # fmt: skip
    fig = sae_causal({"ape": agg})
    assert fig is not None
    heights = sorted(p.get_height() for p in fig.axes[0].patches)
    assert heights == pytest.approx([5.0, 50.0])
    assert sae_causal({"ape": {}}) is None
