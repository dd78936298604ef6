"""What the rules need (claims.Needs) and what the plan runs of it for an in-situ control: the
union of the needs of the rules judging it, and the stage configs derived from that union."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from poslens.experiments.config import NOTHING, Passes
from poslens.interventions import in_situ
from poslens.study import plan as plan_module
from poslens.study import preset
from poslens.study.claims import RULES
from poslens.study.claims.base import ACCURACY, CLEAN, NEEDS_NOTHING, UNDER_RPI, Needs, union
from poslens.study.config import StudyConfig
from poslens.study.plan import make_plan

TABLE, AXES = ("table",), ("axis", "random_axis")
UNDER_RPI_NEEDS = Needs(("windows",), passes=UNDER_RPI)


def test_needs_union_reads_what_either_reads() -> None:
    a = Needs(("sae_causal",))
    b = Needs(("position_removal", "sae_causal"), removal=("axis",), passes=ACCURACY)
    c = Needs(("position_removal",), removal=("table", "axis"), passes=Passes(False, True, False))
    ab = a | b
    assert ab.reads == ("sae_causal", "position_removal")  # first seen first, once each
    assert ab.removal == ("axis",)
    assert ab.passes == CLEAN  # clean probes (a) or nothing (b)
    abc = union([a, b, c])
    assert abc == ab | c and abc.removal == ("axis", "table")
    assert abc.passes == Passes(probes=True, rpi=True, rpi_probes=False)
    assert (a | UNDER_RPI_NEEDS).passes == Passes()
    assert union([]) == NEEDS_NOTHING and union([b]) == b and NEEDS_NOTHING | b == b
    assert ACCURACY == NOTHING == Passes(False, False, False)


def test_rules_declare_their_needs_in_one_value() -> None:
    """Each rule's needs name its primary experiment first; removal kinds only where it reads
    position_removal."""
    for rule in RULES:
        assert isinstance(rule.needs, Needs) and rule.experiment == rule.needs.reads[0]
        assert rule.reads == rule.needs.reads
        assert not rule.needs.removal or "position_removal" in rule.reads


# Each in-situ control's stages as the plan had them before Needs (computed on e61433d from the
# five Rule fields): (experiment, rpi_probes[, position_removal kinds, rpi, probes]) in order.
BEFORE = {
    "table_rowcol": (("position_removal", False, TABLE, False, True), ("sae_causal", False)),
    "table_cell": (("position_removal", False, TABLE, False, True), ("sae_causal", False)),
    "heads_axis_split": (("position_removal", False, AXES, False, True), ("axis_map", False)),
    "freqs_oblique": (("position_removal", False, AXES, False, True), ("axis_map", False)),
    "position_shuffled": (("position_removal", False, (), False, False),),
    "finetune_held_out": (("windows", True), ("heads", True)),
    "finetune_late": (("windows", True), ("heads", True)),
}
TRAINED = {
    "ape": ("table_rowcol", "table_cell", "position_shuffled"),
    "rope_axial": ("heads_axis_split", "freqs_oblique", "position_shuffled"),
    "rope_mixed": ("position_shuffled",),
}
RUN_PRETRAINED = ("table_rowcol", "table_cell", "heads_axis_split", "freqs_oblique",
                  "position_shuffled", "finetune_held_out", "finetune_late")  # fmt: skip


Table = dict[tuple[str, str], set[tuple[tuple[object, ...], ...]]]


def in_situ_table(cfg: StudyConfig, tmp_path: Path) -> Table:
    """(base model, edit) -> its in-situ runs' stages, as in BEFORE (one entry per seed)."""
    out: Table = {}
    for r in make_plan(cfg, tmp_path).runs:
        if not r.edit:
            continue
        rows = []
        for s in r.stages[1:]:
            c = s.config
            assert c is not None
            extra = (c.kinds, c.rpi, c.probes) if s.kind == "position_removal" else ()
            rows.append((s.kind, c.rpi_probes, *extra))
        out.setdefault((r.base, r.edit), set()).add(tuple(rows))
    return out


@pytest.mark.parametrize("name", ["default", "quick", "paper"])
def test_in_situ_stage_configs_from_needs_are_as_before_trained(name: str, tmp_path: Path) -> None:
    cfg = preset(name)
    want = {(m, e): {BEFORE[e]} for m, edits in TRAINED.items() if m in cfg.models for e in edits}
    assert in_situ_table(cfg, tmp_path) == want


@pytest.mark.parametrize("name", ["default", "quick"])
def test_in_situ_stage_configs_from_needs_are_as_before_pretrained(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pretrained model gets every edit (fine-tunes on request): their stages as before."""
    monkeypatch.setattr(plan_module, "check_sources", lambda *a, **k: None)
    cfg = replace(preset(name, pretrained=("timm:vit_small_patch16_rope_224=hub",), images="i"),
                  finetune_steps=5)  # fmt: skip
    want = {("vit_small_patch16_rope_224", e): {BEFORE[e]} for e in RUN_PRETRAINED}
    assert in_situ_table(cfg, tmp_path) == want
    plain = in_situ_table(replace(cfg, finetune_steps=0), tmp_path)
    assert {e for _m, e in plain} == set(RUN_PRETRAINED) - {"finetune_held_out", "finetune_late"}


def test_a_control_judged_by_a_rule_reading_under_rpi_is_probed_under_rpi_if_the_study_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rpi_probes is the union over every rule judging a control, and only narrows the
    study's own setting: with analysis.rpi_probes=false no control is probed under RPI."""
    monkeypatch.setattr(plan_module, "check_sources", lambda *a, **k: None)
    src = ("timm:vit_small_patch16_rope_224=hub",)
    lean = ("windows.rpi_probes=false", "heads.rpi_probes=false")
    for sets, want in (((), True), (lean, False)):
        cfg = replace(preset("quick", pretrained=src, images="i", analysis_set=sets),
                      finetune_steps=5)  # fmt: skip
        tuned = [
            r for r in make_plan(cfg, tmp_path).runs if r.edit and in_situ.get(r.edit).finetune
        ]
        assert tuned and all(s.config.rpi_probes is want for r in tuned for s in r.stages[1:])


@pytest.mark.parametrize(
    "name,pretrained",
    [("quick", False), ("default", False), ("paper", False), ("quick", True), ("paper", True)],
)
def test_every_preset_puts_an_sae_where_the_ape_claims_read(name: str, pretrained: bool) -> None:
    """The APE rules read the SAE at the site role claims.ape.SITE; a preset whose sae_causal
    sites lack that role would leave both APE levels unmeasured on every run."""
    from poslens.experiments.sae_causal.config import Config as SAEConfig
    from poslens.study.claims.ape import SITE

    extra = {"pretrained": ("timm:vit_base_patch16_224=hub",), "images": "x"} if pretrained else {}
    cfg = preset(name, **extra)
    sites = [s.split("=", 1)[1] for s in cfg.analysis_set if s.startswith("sae_causal.sites=")]
    assert SITE in (sites[-1].split(",") if sites else SAEConfig().sites)
