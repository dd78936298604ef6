"""In-situ controls in the study: which edits each model gets, run on the model's own checkpoint
(no training of their own), judged as controls of the rules that name them; and, on a trained
model that was never trained for it, the rules see a planted mechanism and stay quiet about a
removed one."""

from __future__ import annotations

import json
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

import poslens
from poslens.experiments import position_removal as pr
from poslens.experiments.analyze import analyze
from poslens.experiments.sae_causal import result as sae
from poslens.interventions import in_situ
from poslens.study import preset, run_study
from poslens.study.claims import View
from poslens.study.claims.position import position_effect
from poslens.study.claims.split import rope_split_effect
from poslens.study.plan import experiment_configs, make_plan
from tests.experiments.test_sae_causal import TINY_TRAIN
from tests.study.test_study import TINY_STUDY


def test_each_study_model_gets_the_edits_its_rules_name(tmp_path: Path) -> None:
    cfg = preset("default")
    plan = make_plan(cfg, tmp_path)
    base = {(r.model, r.seed): r for r in plan.runs if not r.edit}
    edits = {m: {r.edit: tuple(s.kind for s in r.stages[1:]) for r in plan.runs
                 if r.edit and r.base == m and r.seed == 0} for m in cfg.models}  # fmt: skip
    assert edits["ape"] == {"table_rowcol": ("position_removal", "sae_causal"),
                            "table_cell": ("position_removal", "sae_causal"),
                            "position_shuffled": ("position_removal",)}  # fmt: skip
    assert edits["rope_axial"] == {"heads_axis_split": ("position_removal", "axis_map"),
                                   "freqs_oblique": ("position_removal", "axis_map"),
                                   "position_shuffled": ("position_removal",)}  # fmt: skip
    assert edits["rope_mixed"] == {"position_shuffled": ("position_removal",)}
    assert all(not e for m, e in edits.items() if m not in ("ape", "rope_axial", "rope_mixed"))
    for r in plan.runs:
        if r.edit:  # the base's checkpoint, a reused "train" stage of no weight, then its reads
            b = base[r.base, r.seed]
            assert r.checkpoint == b.checkpoint and r.model == in_situ.model_name(r.base, r.edit)
            assert r.stages[0].kind == "train" and r.stages[0].weight == 0
            assert all(s.only is None for s in r.stages[1:])
            # of position_removal only the condition kinds its rules read (Needs.removal), no
            # condition's RPI pass: no rule judging a control reads one (Passes.rpi), and
            # no probes where its rules read accuracy alone (Passes.probes)
            removal = {(s.config.kinds, s.config.rpi, s.config.probes) for s in r.stages
                       if s.kind == "position_removal"}  # fmt: skip
            want = {"table_rowcol": ("table",), "table_cell": ("table",),
                    "heads_axis_split": ("axis", "random_axis"),
                    "freqs_oblique": ("axis", "random_axis"), "position_shuffled": ()}[r.edit]  # fmt: skip
            assert removal == {(want, False, r.edit != "position_shuffled")}
            # nothing probed under RPI: no rule judging these edits reads an RPI number (Passes.rpi_probes)
            assert all(not s.config.rpi_probes for s in r.stages[1:])
        else:
            assert all(s.config.rpi_probes for s in r.stages[1:])
            assert all((s.config.kinds, s.config.rpi, s.config.probes)
                       == (pr.Config().kinds, True, True)
                       for s in r.stages if s.kind == "position_removal")  # fmt: skip
    assert not any(r.edit for r in make_plan(replace(cfg, in_situ=False), tmp_path).runs)


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("in_situ")
    cfg = replace(TINY_STUDY, in_situ=True, seeds=1, experiments=("position_removal", "axis_map"))
    return out, run_study(cfg, out, progress=False)


def test_in_situ_runs_read_the_base_checkpoint_and_are_judged_as_controls(
    study: tuple[Path, dict[str, Any]],
) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    out, res = study
    schema = json.loads(resources.files("poslens.study").joinpath("schema.json").read_text())
    jsonschema.validate(res, schema)
    assert len(list((out / "checkpoints").iterdir())) == 2  # ape and rope_axial, nothing more
    # the APE edits' rules read sae_causal, which this study does not run: no APE edit
    assert set(res["models"]) == {"ape", "rope_axial", "ape~position_shuffled",
                                  "rope_axial~heads_axis_split", "rope_axial~freqs_oblique",
                                  "rope_axial~position_shuffled"}  # fmt: skip
    for name, entry in res["models"].items():
        base, _, edit = name.partition("~")
        assert entry.get("in_situ") == ({"of": base, "edit": edit, "role": in_situ.get(edit).role}
                                        if edit else None)  # fmt: skip
        (run,) = entry["runs"]
        assert run["checkpoint"] == res["models"][base]["runs"][0]["checkpoint"]
    split = next(c for c in res["claims"] if c["id"] == "rope_planes_split.original")
    rows = {c["model"]: c for c in split["calibration"]["controls"]}
    assert rows["rope_axial~heads_axis_split"]["role"] == "positive"
    assert rows["rope_axial~freqs_oblique"]["role"] == "negative"
    assert rows["rope_axial~freqs_oblique"]["design"].startswith("in situ: ")
    # the in-situ runs of the training stage took no training
    trains = [s for s in res["timings"]["stages"] if s["stage"] == "train" and "~" in s["model"]]
    assert trains and all(s["reused"] and s["seconds"] == 0 for s in trains)
    summary = (out / "report.md").read_text()
    assert "trained and analysed 2 models (ape, rope_axial) and 4 in-situ controls" in summary


# the tiny quadrant-task model of tests/experiments, with four heads (two per axis when split)
TRAIN = (*TINY_TRAIN, "model.heads=4")


def _view(model: poslens.ViT, data: Any, exps: tuple[str, ...], tmp: Path) -> View:
    """The rules' view of one model's headlines (one seed), as the study builds it."""
    cfg = replace(preset("default"), n_images=200, probe_images=100)
    ec = experiment_configs(cfg)
    rec = analyze(model, data, list(exps), [ec[e] for e in exps], tmp, formats=())
    agg = {e: {k: {"values": [v]} for k, v in r["headline"].items()} for e, r in rec.items()}
    return View("m", {"posenc": model.cfg.posenc, "aggregate": agg,
                      "runs": [{"experiments": {e: {} for e in exps}}]})  # fmt: skip


def test_rules_see_a_planted_split_and_not_a_removed_one_in_a_model_never_trained_for_it(
    tmp_path: Path,
) -> None:
    """A trained RoPE-Axial model under heads_axis_split (each head one axis) shows the split:
    the other axis kept beyond random planes; under freqs_oblique (planes on the diagonals, split
    by their pre-edit axes) removing either half costs both axes, below random planes. Shuffling
    position across positions leaves the model nothing that removing position could take."""
    from poslens.training.config import apply_overrides
    from poslens.training.config import preset as run_preset
    from poslens.training.train import train

    metrics = train(apply_overrides(run_preset("rope_axial"), list(TRAIN)), tmp_path / "m",
                    progress=False)  # fmt: skip
    assert metrics["test"]["acc"] > 0.6  # chance 0.25: the model reads position
    model, data = poslens.load(tmp_path / "m"), poslens.load_task(tmp_path / "m")
    exps = ("position_removal", "axis_map")
    effect = {}
    for edit in ("heads_axis_split", "freqs_oblique"):
        (v,) = rope_split_effect(_view(in_situ.edited(model, edit), data, exps, tmp_path)).values
        effect[edit] = v
    assert effect["heads_axis_split"] > 0.05 and effect["freqs_oblique"] < 0.0, effect
    intact = position_effect(_view(model, data, ("position_removal",), tmp_path)).values[0]
    shuffled = in_situ.edited(model, "position_shuffled")
    (after,) = position_effect(_view(shuffled, data, ("position_removal",), tmp_path)).values
    assert intact > 0.3 and abs(after) < 0.1, (intact, after)


def test_cli_no_in_situ_leaves_them_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import poslens.study
    from poslens.cli import main

    seen: list[bool] = []

    def fake_run_study(cfg, out, **kw):  # type: ignore[no-untyped-def]
        seen.append(cfg.in_situ)
        return {"claims": [], "timings": {"total_seconds": 0.0}}

    monkeypatch.setattr(poslens.study, "run_study", fake_run_study)
    for extra in ([], ["--no-in-situ"]):
        main(["study", "--preset", "quick", "--no-progress", "--out", str(tmp_path / "s"), *extra])
    assert seen == [True, False]


def test_the_ape_sharper_rule_sees_a_used_row_column_code_and_not_an_unusable_one(
    tmp_path: Path,
) -> None:
    """Trained on the quadrant task, a planted row + column table the model reads (ape_rowcol)
    loses accuracy when its row and column latents carry another position, beyond their own from
    another image; the same table trained with its patches permuted (ape_shuffled: the features
    are there, unusable) does not. Both SAEs find row and column latents, so the negative's
    near-0 is measured, not empty."""
    from poslens.study.claims.ape import USE_SITE, ape_downstream_effect
    from poslens.training.config import apply_overrides
    from poslens.training.config import preset as run_preset
    from poslens.training.train import train

    effect, found = {}, {}
    for name in ("ape_rowcol", "ape_shuffled"):
        train(apply_overrides(run_preset(name), list(TINY_TRAIN)), tmp_path / name, progress=False)
        model, data = poslens.load(tmp_path / name), poslens.load_task(tmp_path / name)
        ec = experiment_configs(replace(preset("default"), n_images=200, probe_images=100))
        # the default's SAE at the table site alone (its early site's three SAEs: not read here)
        cfg = replace(ec["sae_causal"], sites=("table",), draw_sites=(), sae_draws=1)
        rec = analyze(model, data, ["sae_causal"], [cfg], tmp_path, formats=())
        v = View("m", {"posenc": "ape", "runs": [{"experiments": {"sae_causal": {}}}],
                       "aggregate": {"sae_causal": {k: {"values": [x]} for k, x in
                                                    rec["sae_causal"]["headline"].items()}}})  # fmt: skip
        (effect[name],) = ape_downstream_effect(v).values
        found[name] = sum(v.values(sae.latents_key(USE_SITE, k))[0] for k in ("row", "col"))
    assert all(n > 0 for n in found.values()), found
    # one seed on 200 images (accuracy SE about 0.03): 0.20 against 0.04 here
    assert effect["ape_rowcol"] > effect["ape_shuffled"] + 0.1, effect
    assert abs(effect["ape_shuffled"]) < 0.1, effect
