"""The contract between experiments and claims: every key a rule reads exists in the headline of
the experiment that emits it. Each rule's experiments run on a tiny model of the family the rule
judges, their headlines aggregate exactly as the study aggregates them, and the rule's effect is
computed through a View that records every key it asked for and did not find. A condition
renamed in an experiment (but not in the key builder the rule calls) fails here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from poslens.data import DataConfig, build_task
from poslens.errors import ConfigError
from poslens.experiments import position_removal, registry
from poslens.experiments.analyze import analyze
from poslens.experiments.keys import Key
from poslens.interventions import in_situ
from poslens.models.vit import ViT
from poslens.study.aggregate import aggregate
from poslens.study.claims import RULES, View
from poslens.study.claims.base import Needs
from poslens.study.plan import narrowed
from poslens.study.verdicts import VERDICTS
from tests.conftest import tiny

DATA = DataConfig(image_size=16, object_scale=0.32, n_val=30, n_test=60)
SIZES = dict(n_images=60, probe_images=40, batch_size=60)
SETTINGS = {  # small but complete: every condition a rule compares with is run
    "sae_causal": dict(
        sites=("early", "table"), train_images=60, epochs=2, k=8, doses=(2,), draws=1
    ),
    "windows": dict(axis_windows=False, probe_curves=False, draws=1),
    "heads": dict(units=("block_head",), cumulative=(1,), rebuild_probes=False, draws=1),
    "position_removal": dict(draws=1),
}


def models() -> dict[str, ViT]:
    """One untrained model per family: APE with a planted row + column code (so the SAE finds
    row and column latents), axial RoPE with four heads of 4 planes per axis, and a relative
    position bias (relpos: the rules of family "any" read it)."""
    return {
        "ape": tiny("ape", num_classes=16, ape_code="rowcol", ape_init_std=1.0),
        "rope_axial": tiny("rope_axial", num_classes=16, dim=64, heads=4, depth=3),
        "relpos": tiny("relpos", num_classes=16),
    }


def measured_views(folder: Path, needs: Needs | None = None) -> dict[str, View]:
    """Each test model's rules' experiments run and aggregated as the study does; `needs`: the
    experiments it reads narrowed to it as the plan narrows an in-situ control's
    (study.plan.narrowed: position_removal's condition kinds and passes, rpi_probes)."""
    task = build_task(DATA)
    out = {}
    for key, model in models().items():
        rules = [r for r in RULES if r.applies_to(model.cfg.family)]
        names = list(dict.fromkeys(e for rule in rules for e in rule.reads))
        settings = {n: dict(SETTINGS.get(n, {})) for n in names}
        cfgs = {n: registry.get(n).Config(**SIZES, **settings[n]) for n in names}
        if needs is not None:
            cfgs |= {n: narrowed(cfgs[n], n, needs) for n in names if n in needs.reads}
        records = analyze(model, task, names, list(cfgs.values()), folder / key, formats=())
        runs = [{"experiments": {n: r for n, r in records.items() if "skipped" not in r}}]
        entry = {"posenc": model.cfg.posenc, "aggregate": aggregate(runs, names), "runs": runs}
        out[key] = View(key, json.loads(json.dumps(entry, default=str)))
    return out


@pytest.fixture(scope="module")
def views(tmp_path_factory: pytest.TempPathFactory) -> dict[str, View]:
    return measured_views(tmp_path_factory.mktemp("views"))


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.id)
def test_every_key_a_rule_reads_is_in_the_real_headline(rule, views: dict[str, View]) -> None:
    judged = [v for v in views.values() if rule.applies_to(v.family)]
    assert judged, f"no test model of family {rule.family}"
    for v in judged:
        v.missing.clear()
        effect = rule.effect(v)
        assert v.missing == set(), f"{rule.id} on {v.model} read keys no headline has"
        assert len(effect.values) == 1  # one seed: one value (NaN allowed, with its reason)
        # its secondary numbers and any null built inside a model read real keys too
        for what, values in rule.notes(v):
            assert len(values) == 1, what
        for control in rule.controls:
            if control.effect is not None:
                assert len(control.effect(v).values) == 1
        assert v.missing == set(), f"{rule.id}'s notes or nulls on {v.model} read missing keys"


def test_a_renamed_condition_breaks_the_contract(views: dict[str, View]) -> None:
    """The check is not vacuous: rename one condition in the aggregate and the rule notices."""
    v = views["rope_axial"]
    numbers = v.numbers[position_removal.NAME]
    for k in [k for k in numbers if k.condition == "axis_row"]:
        numbers[Key(k.experiment, "row_axis", k.number)] = numbers.pop(k)
    v.missing.clear()
    next(r for r in RULES if r.id == "rope_planes_split.original").effect(v)
    missing = position_removal.key("axis_row", "retention_probe_fixed_col")
    assert missing in v.missing
    assert {k.experiment for k in v.missing} == {position_removal.NAME}


def test_keys_round_trip_through_json_text() -> None:
    """Key.parse(experiment, text) gives back every part of a Key (its number has no dot, so the
    last dot splits it, dotted site names included), and a Key pickles (worker processes return headlines keyed by Keys)."""
    import pickle

    from poslens.experiments.heads import result as heads
    from poslens.experiments.sae_causal import result as sae

    keys = [
        position_removal.key("axis_row", "accuracy"), position_removal.AXES_PRE_ROTATION,
        sae.key("blocks.1.ln1.hook_normalized", "rowcol_zeroed+error", "d_margin"),
        sae.latents_key("early", "row"), heads.held_out_key("head", heads.EXCESS),
        heads.consistency_key(heads.AXIS_PREFERENCE_RELATIVE, "head"),
    ]  # fmt: skip
    for k in keys:
        back = Key.parse(k.experiment, k.text)
        assert (back.experiment, back.condition, back.number) == (
            k.experiment,
            k.condition,
            k.number,
        )
        again = pickle.loads(pickle.dumps(k))
        assert repr(again) == repr(k) and again == k.text
    assert Key.parse("windows", "intact.accuracy") == "intact.accuracy"
    with pytest.raises(ConfigError, match="Key.number"):
        Key("windows", "intact", "acc.uracy")
    with pytest.raises(ConfigError, match="Key.experiment"):
        Key("Windows!", "intact", "accuracy")


def test_verdict_names_are_the_schemas() -> None:
    schema = json.loads((Path(__file__).parents[2] / "src/poslens/study/schema.json").read_text())
    assert schema["properties"]["claims"]["items"] == {"$ref": "#/$defs/claim"}
    assert tuple(schema["$defs"]["claim"]["properties"]["verdict"]["enum"]) == VERDICTS


def test_precision_names_are_the_schemas() -> None:
    from poslens._config import ANALYSIS_PRECISIONS

    schema = json.loads((Path(__file__).parents[2] / "src/poslens/study/schema.json").read_text())
    config = schema["properties"]["config"]["properties"]
    assert tuple(config["precision"]["enum"]) == ANALYSIS_PRECISIONS


@pytest.mark.parametrize(
    "rule",
    [r for r in RULES if any(not in_situ.get(e).finetune for e in r.edits)],
    ids=lambda r: r.id,
)
def test_an_in_situ_controls_narrowed_experiments_have_every_key_its_rules_read(
    rule, tmp_path: Path, views: dict[str, View]
) -> None:
    """An in-situ control runs only what the rules judging it need (Rule.needs): of
    position_removal only their condition kinds, its conditions' RPI pass only where one reads
    it, probed only where one reads a probe, and nothing probed under RPI where none reads an
    RPI number (Passes): with exactly this rule's needs, its effect and notes find every key,
    with the full run's values."""
    from poslens.experiments.position_removal import KINDS

    assert set(rule.needs.removal) <= set(KINDS)
    assert not rule.needs.removal or "position_removal" in rule.reads
    for key, v in measured_views(tmp_path, rule.needs).items():
        if not rule.applies_to(v.family):
            continue
        v.missing.clear()
        got = [rule.effect(v).values, *(vals for _what, vals in rule.notes(v))]
        assert v.missing == set(), f"{rule.id} on {v.model}: narrowed to {rule.needs}"
        full = [rule.effect(views[key]).values, *(vals for _w, vals in rule.notes(views[key]))]
        assert json.dumps(got) == json.dumps(full), f"{rule.id} on {v.model}: values moved"


def test_every_key_the_ladder_predicts_from_is_in_the_real_headline(
    views: dict[str, View],
) -> None:
    """The ladder's predictions read headline Keys too (study/ladder.py PREDICTIONS)."""
    from poslens.study.ladder import PREDICTIONS

    for pid, _, model, key in PREDICTIONS:
        numbers = views[model].numbers
        assert key.experiment in numbers, f"{pid}: {key.experiment} did not run on {model}"
        assert key in numbers[key.experiment], f"{pid}: {key!r} is in no headline"
