"""docs/preregistration.md is generated from the rules: regenerating it from the committed
exploration gives the committed page, so a rule changed after the freeze shows up (with its
fingerprint); the committed exploration judges as the whole results.json did; the page's commit
precedes the confirmation's."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from poslens.study.claims import RULES
from poslens.study.config import CONFIRM_SEEDS, preset
from poslens.study.judge import evaluate_claims, level_fingerprint
from poslens.study.preregistration import outcomes, projected, render, results_table, slim
from tests.study.test_claims import calibrated

ROOT = Path(__file__).parents[2]
PAGE = ROOT / "docs" / "preregistration.md"
EXPLORATION = ROOT / "docs" / "exploration" / "results.json"
CONFIRMATION = ROOT / "docs" / "confirmation" / "results.json"


def test_the_page_is_what_the_rules_generate() -> None:
    if not EXPLORATION.is_file():
        pytest.skip("no exploration committed yet")
    assert PAGE.read_text() == render(json.loads(EXPLORATION.read_text())), (
        "docs/preregistration.md differs from the rules: regenerate it with "
        "`python -m poslens.study.preregistration > docs/preregistration.md` (a rule changed "
        "after a confirmation needs a new exploration and a fresh block of seeds)"
    )


def test_the_page_names_every_levels_fingerprint_and_the_confirmation() -> None:
    page = render({"models": calibrated()})
    for rule in RULES:
        fp = level_fingerprint(rule, preset("default"))
        assert fp == level_fingerprint(rule, preset("confirm"))
        assert f"`{fp}`" in page and f"### {rule.id}:" in page
    assert f"({CONFIRM_SEEDS} seeds)" in page and "poslens merge" in page


def test_the_committed_exploration_judges_as_the_whole_results() -> None:
    full = {"config": {}, "models": calibrated(), "figures": {"x": 1}}
    for m in full["models"].values():  # what a real results.json also holds per seed
        for r in m["runs"]:
            r["experiments"] = {e: {"headline": {"a": 1.0}} for e in r["experiments"]}
    small = slim(full)
    assert "figures" not in small
    cfg = preset("default")
    a = [c.to_dict() for c in evaluate_claims(full["models"], cfg, confirmations={})]
    b = [c.to_dict() for c in evaluate_claims(small["models"], cfg, confirmations={})]
    assert a == b


def test_a_projection_follows_the_exploration_and_the_planned_count() -> None:
    claims = {c.id: c for c in evaluate_claims(calibrated(), confirmations={})}
    rule = next(r for r in RULES if r.id == "position_matters.original")
    outcome, share = projected(rule, claims[rule.id], 20)
    assert outcome == "reproduces (specific)" and share > 0.9
    assert {t.role for t in outcomes(claims[rule.id])} == {"study", "positive", "negative"}


def test_the_preregistration_precedes_the_confirmation_in_history() -> None:
    if not CONFIRMATION.is_file():
        pytest.skip("no confirmation committed yet")
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")

    def first_commit(path: Path) -> str:
        out = subprocess.run([git, "log", "--diff-filter=A", "--format=%H", "--", str(path)],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
        return out[-1] if out else ""

    page, confirmation = first_commit(PAGE), first_commit(CONFIRMATION)
    if not page or not confirmation:
        pytest.skip("shallow history")
    ancestor = subprocess.run([git, "merge-base", "--is-ancestor", page, confirmation], cwd=ROOT)
    assert ancestor.returncode == 0 and page != confirmation


def test_the_confirmed_results_table_is_the_generated_one() -> None:
    """docs/study.md's table of confirmed results comes from the confirmation's results.json and
    the exploration judged by the frozen rules, never by hand."""
    if not CONFIRMATION.is_file():
        pytest.skip("no confirmation committed yet")
    table = results_table(json.loads(CONFIRMATION.read_text()),
                          json.loads(EXPLORATION.read_text()))  # fmt: skip
    assert table in (ROOT / "docs" / "study.md").read_text(), (
        "regenerate it: python -m poslens.study.preregistration table "
        "docs/confirmation/results.json docs/exploration/results.json"
    )


def test_the_results_table_reads_the_recorded_outcomes() -> None:
    results = {"config": {"seed_start": 100, "seeds": 5}, "environment": {"cpu": {"model": "X"}},
               "timings": {"total_seconds": 600},
               "claims": [c.to_dict() for c in evaluate_claims(calibrated(), confirmations={})]}  # fmt: skip
    table = results_table(results, {"models": calibrated(), "environment": {}})
    assert "| position_matters.original | reproduces (specific), " in table
    assert "The confirmation: seeds 100-104, X, 10 min of study." in table
