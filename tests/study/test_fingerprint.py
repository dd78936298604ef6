"""Each claim level's design fingerprint: it changes with the level's own threshold, controls,
effect, models and experiments, and with nothing of another level's; it does not change with the
seed count, the first seed, which controls a run trains, or the rule's wording."""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import pytest

from poslens.study import judge
from poslens.study.claims import RULES, Control, Rule
from poslens.study.claims.split import rope_alignment_effect
from poslens.study.config import STUDY_MODELS, preset
from poslens.study.fingerprint import DESIGN_FIELDS, WORDING_FIELDS
from poslens.study.judge import evaluate_claims, level_fingerprint
from tests.study.test_claims import calibrated

DEFAULT = preset("default")


def prints(cfg=DEFAULT, rules=RULES) -> dict[str, str]:
    return {r.id: level_fingerprint(r, cfg) for r in rules}


def changed(a: dict[str, str], b: dict[str, str]) -> set[str]:
    return {k for k in a if a[k] != b[k]}


def test_every_rule_field_is_design_or_wording() -> None:
    """A new field of Rule is design unless declared wording; the wording fields exist."""
    names = {f.name for f in dataclasses.fields(Rule)}
    assert set(DESIGN_FIELDS) | set(WORDING_FIELDS) == names
    assert not set(DESIGN_FIELDS) & set(WORDING_FIELDS)
    assert {"threshold", "effect", "controls", "study", "needs"} <= set(DESIGN_FIELDS)


def test_fingerprints_are_distinct_and_stable() -> None:
    fp = prints()
    assert len(set(fp.values())) == len(RULES)
    assert fp == prints()  # the same design, the same fingerprint
    assert all(len(x) == 16 and int(x, 16) >= 0 for x in fp.values())


@pytest.mark.parametrize("which", range(len(RULES)))
@pytest.mark.parametrize("change", ["threshold", "control", "effect", "study"])
def test_a_change_to_one_level_changes_its_fingerprint_alone(which: int, change: str) -> None:
    rule = RULES[which]
    if change == "threshold":
        new = replace(rule, threshold=rule.threshold + 0.01)
    elif change == "control":
        new = replace(rule, controls=(*rule.controls, Control("rope_late", "negative", "x")))
    elif change == "effect":
        new = replace(rule, effect=rope_alignment_effect if rule.effect is not rope_alignment_effect
                      else RULES[0].effect)  # fmt: skip
    else:
        new = replace(rule, study=(*rule.study, "rope_oblique"))
    rules = tuple(new if r is rule else r for r in RULES)
    assert changed(prints(), prints(rules=rules)) == {rule.id}


def test_wording_seeds_and_trained_controls_leave_fingerprints_alone() -> None:
    base = prints()
    worded = tuple(replace(r, statement=r.statement + " (reworded)", threshold_source="x",
                           title="t", would_change="w") for r in RULES)  # fmt: skip
    assert prints(rules=worded) == base
    # more seeds, another first seed, only the study models trained (controls left to the
    # confirmation): the same design
    other = replace(DEFAULT, seeds=20, seed_start=300, models=STUDY_MODELS)
    assert prints(other) == base


def test_a_model_or_experiment_config_changes_the_levels_that_read_it() -> None:
    base = prints()
    late = replace(DEFAULT, train_set=(*DEFAULT.train_set, "rope_late:train.steps=1000"))
    assert changed(base, prints(late)) == {r.id for r in RULES if "rope_late" in r.models}
    heads = replace(DEFAULT, analysis_set=(*DEFAULT.analysis_set, "heads.draws=3"))
    assert changed(base, prints(heads)) == {r.id for r in RULES if "heads" in r.reads}
    assert changed(base, prints(replace(DEFAULT, n_images=200))) == set(base)


def test_results_carry_each_levels_fingerprint(monkeypatch: pytest.MonkeyPatch) -> None:
    claims = {c.id: c for c in evaluate_claims(calibrated(), DEFAULT)}
    assert {i: c.fingerprint for i, c in claims.items()} == prints()
    assert claims[RULES[0].id].to_dict()["fingerprint"] == prints()[RULES[0].id]
    assert all(c.fingerprint is None for c in evaluate_claims(calibrated()))  # no config: none
    # the judge's own path: a threshold changed on one level moves that level's alone
    moved = replace(RULES[2], threshold=RULES[2].threshold + 0.05)
    monkeypatch.setattr(judge, "RULES", tuple(moved if r is RULES[2] else r for r in RULES))
    again = {c.id: c.fingerprint for c in evaluate_claims(calibrated(), DEFAULT)}
    assert changed({i: c.fingerprint for i, c in claims.items()}, again) == {RULES[2].id}
