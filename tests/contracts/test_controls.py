"""The calibration models of the default study against the rules that read them: the rebuilding
positive control is never trained on the window its rules test, and every model a rule names is
trained by the default preset and runs the experiments that rule reads."""

from __future__ import annotations

from poslens.experiments import windows
from poslens.study.claims import RULES
from poslens.study.config import preset
from poslens.study.plan import run_config
from poslens.training.train import withheld_blocks

STEPS = 2000  # the default preset's longest schedule


def test_rope_rebuild_never_trains_on_the_window_its_rules_test() -> None:
    cfg = preset("default")
    rc = run_config(cfg, "rope_rebuild", seed=0)
    depth = rc.model.depth
    ks = [int(k) for k in cfg.analysis_sets["windows"]["prefix_ks"].split(",")]
    k = windows.rebuild_window(ks, depth)
    assert k is not None
    tested = tuple(range(k + 1))  # the early window withheld (its suffix is the reference)
    trained = {tuple(withheld_blocks(rc, step)) for step in range(STEPS)} - {()}
    assert trained, "rope_rebuild must be trained with rotations withheld somewhere"
    assert tested not in trained, f"rope_rebuild trained on the tested window {tested}"
    early = [w for w in trained if w[0] == 0]
    assert len(early) >= 2  # random early windows around the tested one, not one fixed one


def test_every_model_a_rule_reads_is_trained_and_runs_its_experiments() -> None:
    cfg = preset("default")
    for rule in RULES:
        for model in rule.models:
            assert model in cfg.models or model == "sincos", (rule.id, model)
            if model not in cfg.models:
                continue  # sincos: a positive control only where a study trains it
            for exp in rule.reads:
                only = cfg.only_models.get(exp)
                assert only is None or model in only, (rule.id, model, exp)
