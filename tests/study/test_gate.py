"""The accuracy gate (study/gate.py): a seed that never reached train.stop_acc is retrained from
reserve seeds, its experiments and in-situ controls read the replacement, the report says so,
and a rerun reuses every attempt."""

from __future__ import annotations

import json
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from poslens.cli import main
from poslens.errors import ConfigError
from poslens.report.markdown import render_markdown
from poslens.study import StudyConfig, preset, run_study
from poslens.study.gate import RESERVE, reserve_seed
from tests.study.test_study import TINY_STUDY

# ape cannot reach 99% validation accuracy in 6 steps: its seed fails the gate at every attempt;
# rope_axial's target of 1% is reached at once (every class is in the whole val set, so even a
# model that answers one class scores above it), so it passes the gate untouched
GATED = replace(
    TINY_STUDY,
    seeds=1,
    in_situ=True,
    experiments=("position_removal",),
    train_set=(
        *TINY_STUDY.train_set,
        "train.eval_images=80",
        "ape:train.stop_acc=0.99",
        "rope_axial:train.stop_acc=0.01",
    ),
    gate_retries=2,
)


def _strip(results: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in results.items() if k not in ("created", "timings")}


@pytest.fixture(scope="module")
def gated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("gate")
    return out, run_study(GATED, out, progress=False)


def test_a_failing_seed_is_retried_from_reserve_seeds_and_reported(
    gated: tuple[Path, dict[str, Any]],
) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    out, res = gated
    schema = json.loads(resources.files("poslens.study").joinpath("schema.json").read_text())
    jsonschema.validate(res, schema)
    assert [reserve_seed(0, a) for a in (1, 2)] == [RESERVE, 2 * RESERVE] == [1000, 2000]
    (run,) = res["models"]["ape"]["runs"]
    gate = run["gate"]
    assert gate["slot"] == 0 and gate["tried"] == [0, 1000, 2000] and gate["passed"] is False
    assert gate["why"].count("did not reach stop_acc 0.99") == 3, gate["why"]
    assert run["seed"] == 2000 and "_s2000_" in run["checkpoint"]
    for seed in (0, 1000, 2000):  # every attempt trained into its own checkpoint folder
        (ckpt,) = (out / "checkpoints").glob(f"ape_s{seed}_*")
        metrics = json.loads((ckpt / "metrics.json").read_text())
        assert metrics["stopped_at"] is None and metrics["val"]["acc"] < 0.99
    # the kept attempt's weights are the ones measured: its accuracy is in the run's summary
    kept = json.loads((out / run["checkpoint"] / "metrics.json").read_text())
    assert run["train"]["val_acc"] == kept["val"]["acc"]
    assert "position_removal" in run["experiments"]
    report = render_markdown(res, out)
    assert "ape seed 0 failed the gate in every attempt, seed 2000 kept (tried 0, 1000, 2000)" in (
        report
    )
    html = (out / "report.html").read_text()
    assert "<h4>Accuracy gate</h4><ul><li>ape seed 0 failed the gate in every attempt" in html


def test_a_passing_seed_is_untouched(gated: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """rope_axial reached its target: no gate record, and the same results as without a gate."""
    _, res = gated
    (run,) = res["models"]["rope_axial"]["runs"]
    assert "gate" not in run and run["seed"] == 0 and run["train"]["stopped_at"] is not None
    plain = run_study(replace(GATED, models=("rope_axial",), gate_retries=0), tmp_path,
                      progress=False)  # fmt: skip
    for name, model in plain["models"].items():
        assert res["models"][name] == model, name


def test_a_seed_that_trains_its_whole_budget_is_still_gated(tmp_path: Path) -> None:
    """train.min_steps = train.steps (the default study's rope_rebuild): the seed trains every
    step and passes the gate on the target it holds at the end; ape's 99% still fails it."""
    cfg = replace(GATED, gate_retries=1, train_set=(*GATED.train_set, "train.min_steps=6"))
    res = run_study(cfg, tmp_path, progress=False)
    (rope,) = res["models"]["rope_axial"]["runs"]
    assert "gate" not in rope and rope["train"]["stopped_at"] == 6
    (ape,) = res["models"]["ape"]["runs"]
    assert ape["gate"]["tried"] == [0, 1000] and ape["gate"]["passed"] is False
    assert ape["train"]["stopped_at"] is None


def test_the_default_rebuilding_positive_trains_its_whole_budget_under_the_gate() -> None:
    from poslens.study.config import CALIBRATION_MODELS, STUDY_MODELS
    from poslens.study.ladder import ladder_preset
    from poslens.study.plan import run_config

    for cfg in (preset("default"), *(ladder_preset(r).study_config(ladder_preset(r).rungs[0])
                                     for r in ("d8", "d12"))):  # fmt: skip
        rebuild = run_config(cfg, "rope_rebuild", 0).train
        assert rebuild.min_steps == rebuild.steps == 2000 and rebuild.stop_acc == 0.9
        for model in (*STUDY_MODELS, *CALIBRATION_MODELS):
            if model != "rope_rebuild":
                assert run_config(cfg, model, 0).train.min_steps == 0, model


def test_a_rerun_reuses_the_replacements(gated: tuple[Path, dict[str, Any]]) -> None:
    out, res = gated
    again = run_study(GATED, out, progress=False)
    assert all(s["reused"] for s in again["timings"]["stages"])
    assert _strip(again) == _strip(res)


def test_in_situ_controls_of_a_replaced_seed_read_its_replacement(
    gated: tuple[Path, dict[str, Any]],
) -> None:
    _, res = gated
    (run,) = res["models"]["ape"]["runs"]
    controls = [m for m, e in res["models"].items() if (e.get("in_situ") or {}).get("of") == "ape"]
    assert controls  # ape's table edits and the shuffled-position control
    for name in controls:
        (c,) = res["models"][name]["runs"]
        assert c["checkpoint"] == run["checkpoint"] and c["seed"] == 2000, name
        assert c["gate"] == run["gate"]
        assert c["experiments"]["position_removal"]["headline"], name
    report = render_markdown(res)
    assert sum("failed the gate" in line for line in report.splitlines()) == 1  # one per slot


def test_a_replacement_that_passes_takes_the_slot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only seed 0's training is judged a failure (the gate's verdict forced, the training and
    everything downstream real): seed 1000 takes slot 0, seed 1 keeps its own, and the same
    study in a fresh folder gives the same results."""
    from poslens.study import gate

    real = gate.failure

    def failure(run: Any) -> str | None:
        return "seed 0 forced to fail" if run.run_config.train.seed == 0 else real(run)

    monkeypatch.setattr(gate, "failure", failure)
    cfg = replace(GATED, models=("ape",), seeds=2, in_situ=False, experiments=("depth_profile",),
                  train_set=(*TINY_STUDY.train_set, "train.stop_acc=0.0"))  # fmt: skip
    res = run_study(cfg, tmp_path / "a", progress=False)
    first, second = res["models"]["ape"]["runs"]
    assert first["gate"] == {"slot": 0, "tried": [0, 1000], "passed": True,
                             "why": "seed 0 forced to fail"}  # fmt: skip
    assert first["seed"] == 1000 and "_s1000_" in first["checkpoint"]
    assert "gate" not in second and second["seed"] == 1 and "_s1_" in second["checkpoint"]
    assert "- ape seed 0 retrained as seed 1000 (tried 0, 1000): seed 0 forced to fail" in (
        render_markdown(res).splitlines()
    )
    assert _strip(run_study(cfg, tmp_path / "b", progress=False)) == _strip(res)


def test_gate_retries_is_validated_and_set_by_the_presets(tmp_path: Path, capsys: Any) -> None:
    with pytest.raises(ConfigError, match="study.gate_retries must be a whole number"):
        StudyConfig(gate_retries=-1)
    with pytest.raises(ConfigError, match="study.gate_retries must be a whole number"):
        StudyConfig(gate_retries=True)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="study.gate_retries goes with trained models"):
        StudyConfig(pretrained=("timm:vit_small_patch16_224=hub",), images="x", gate_retries=1)
    assert preset("quick").gate_retries == 0
    assert preset("default").gate_retries == preset("paper").gate_retries == 2
    assert preset("default", pretrained=("timm:vit_small_patch16_224=hub",),
                  images="x").gate_retries == 0  # fmt: skip
    assert StudyConfig().gate_retries == 0
    from poslens.study.ladder import ladder_preset

    ladder = ladder_preset("g6")
    assert ladder.study_config(ladder.rungs[0]).gate_retries == 2  # the default preset's
    ladder = ladder_preset("g6", changes={"gate_retries": 0})
    assert ladder.study_config(ladder.rungs[0]).gate_retries == 0
    with pytest.raises(ConfigError, match="ladder rung g6: study.gate_retries"):
        ladder_preset("g6", changes={"gate_retries": 99})
    out = tmp_path / "cli"
    with pytest.raises(SystemExit) as exited:  # refused by the parser, naming its option
        main(["study", "--preset", "quick", "--gate-retries", "-1", "--out", str(out)])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--gate-retries" in err, err
    assert main(["study", "--preset", "quick", "--gate-retries", "10", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "study.gate_retries" in err, err
    assert not out.exists()
