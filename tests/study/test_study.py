"""The study end to end on tiny models: layout, schema, resume, determinism, claims, errors."""

from __future__ import annotations

import json
import math
import re
import shutil
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poslens._config import ANALYSIS_PRECISIONS
from poslens.cli import main
from poslens.errors import ConfigError
from poslens.report.schema import check_results, results_schema, schema_error
from poslens.study import StudyConfig, preset, run_study
from poslens.study.aggregate import aggregate, mean_se
from poslens.study.claims import RULES
from poslens.study.result import ClaimResult, claims_of

TINY_STUDY = StudyConfig(
    preset="quick",
    models=("ape", "rope_axial"),
    seeds=2,
    in_situ=False,  # tests/study/test_in_situ_study.py runs them
    experiments=("depth_profile", "position_removal", "axis_map", "windows", "heads", "sae_causal"),
    train_set=(
        "model.dim=16", "model.depth=2", "model.heads=2", "train.steps=6", "train.batch_size=16",
        "train.eval_every=3", "train.eval_images=20", "train.ckpt_every=3", "data.n_val=80",
        "data.n_test=40", "data.image_size=16", "data.object_scale=0.32",
    ),
    analysis_set=(
        "windows.axis_windows=false", "windows.probe_curves=false", "position_removal.n_planes=1",
        "position_removal.draws=2", "sae_causal.sites=blocks.0.hook_resid_pre",
        "sae_causal.train_images=40", "sae_causal.epochs=1", "sae_causal.k=4",
        "sae_causal.doses=2", "sae_causal.draws=1", "heads.units=head", "heads.cumulative=1",
        "heads.axis_windows=false", "heads.rebuild_probes=false", "heads.draws=1",
    ),
    n_images=30,
    probe_images=30,
    batch_size=30,
)  # fmt: skip


def _schema() -> dict[str, Any]:
    return json.loads(resources.files("poslens.study").joinpath("schema.json").read_text())


def _strip(results: dict[str, Any]) -> dict[str, Any]:
    """results.json without what may change between identical runs (times)."""
    return {k: v for k, v in results.items() if k not in ("created", "timings")}


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("study")
    return out, run_study(TINY_STUDY, out, progress=False)


def test_layout_and_schema(study: tuple[Path, dict[str, Any]]) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    out, res = study
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk == res
    jsonschema.validate(on_disk, _schema())
    assert "NaN" not in (out / "results.json").read_text()
    for m in ("ape", "rope_axial"):
        runs = res["models"][m]["runs"]
        assert [r["seed"] for r in runs] == [0, 1]
        for r in runs:
            assert (out / r["checkpoint"] / "model.safetensors").is_file()
            for exp in r["experiments"].values():
                assert all((out / f).is_file() for f in exp["files"])
                assert {Path(f).suffix for f in exp["files"]} >= {".json", ".png", ".svg"}
    # axis_map needs rotary planes: skipped for APE with its reason, run for RoPE
    assert "axis_map" in res["models"]["ape"]["runs"][0]["skipped"]
    assert "axis_map" in res["models"]["rope_axial"]["runs"][0]["experiments"]
    for fig in res["figures"]:
        assert (out / fig["png"]).is_file() and (out / fig["svg"]).is_file()
    assert [c["id"] for c in res["claims"]] == [r.id for r in RULES]  # both levels, in order
    assert {c["claim"] for c in res["claims"]} == {
        "ape_explicit_features", "rope_planes_split", "rope_rebuilds", "heads_rebuild",
        "position_matters",
    }  # fmt: skip
    for c in res["claims"]:  # every verdict names the scale it describes
        assert all(sc == {"dim": 16, "depth": 2, "heads": 2, "grid": 4}
                   for sc in c["scale"].values()), c["scale"]  # fmt: skip
    assert (out / "report.html").is_file() and (out / "report.md").is_file()


# What a user can ask of a study that lands in results.json's config: every preset, trained or
# pretrained models, and the values that mean "auto" (batch_size 0, precision "auto", ...).
study_changes = st.fixed_dictionaries(
    {
        "preset": st.sampled_from(["quick", "default", "paper"]),
        "batch_size": st.one_of(st.just(0), st.integers(1, 10_000)),
        "seeds": st.integers(1, 5),
        "ssdc_images": st.sampled_from([0, 10]),
        "device": st.sampled_from(["cpu", "cuda", "cuda:1"]),
    },
    optional={
        "precision": st.sampled_from(ANALYSIS_PRECISIONS),
        "pretrained": st.just(("timm:vit_small_patch16_224=hub",)),
        "in_situ": st.booleans(),
    },
)


def test_claims_read_back_from_results_json_and_write_the_same(
    study: tuple[Path, dict[str, Any]],
) -> None:
    """Each claim of a real study's results.json parses into a ClaimResult that writes it back
    unchanged, and the in-memory results keep judge's key order."""
    out, res = study
    written = json.loads((out / "results.json").read_text())["claims"]
    parsed = claims_of({"claims": written})
    assert [c.id for c in parsed] == [r.id for r in RULES]
    for c, d, mine in zip(parsed, written, res["claims"], strict=True):
        assert c.to_dict() == d
        assert ClaimResult.from_dict(c.to_dict()) == c
        assert list(c.to_dict()) == list(mine)


def _study_config(changes: dict[str, Any]) -> tuple[StudyConfig, str]:
    changes = dict(changes)
    name, device = changes.pop("preset"), changes.pop("device")
    if changes.get("pretrained"):
        changes["images"] = "/data/images"
    return preset(name, **changes), device


def test_every_study_config_follows_the_results_schema(
    study: tuple[Path, dict[str, Any]],
) -> None:
    """Round trip: the config section a study writes for any preset, model set and auto value is
    accepted by the study's own schema, inside a whole results.json (issue 51: batch_size 0)."""
    from poslens.study.run import results_config

    schema = results_schema()

    @settings(max_examples=60, deadline=None)
    @given(study_changes)
    def check(changes: dict[str, Any]) -> None:
        cfg, device = _study_config(changes)
        doc = {**study[1], "config": results_config(cfg, device)}
        assert schema_error(doc["config"], schema["properties"]["config"], schema) is None
        check_results(doc)

    check()


def test_a_study_with_auto_values_rebuilds_its_report(
    study: tuple[Path, dict[str, Any]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`poslens report` on a study written with the quick preset's auto batch size (0) and auto
    precision: exit 0 and a report, as after `poslens study --preset quick`."""
    from poslens.study.run import results_config

    # the CLI's allocator setting would outlive this test and change the next study's
    # environment.malloc (the rerun tests compare it)
    monkeypatch.setattr("poslens.allocator.keep_freed_memory", lambda: None)

    out = tmp_path / "s"
    shutil.copytree(study[0], out)
    cfg = preset("quick", precision="auto")
    assert cfg.batch_size == 0  # the quick preset's auto batch size
    doc = {**study[1], "config": results_config(cfg, "cpu")}
    (out / "results.json").write_text(json.dumps(doc))
    (out / "report.html").unlink()
    assert main(["report", str(out)]) == 0, capsys.readouterr().err
    assert (out / "report.html").is_file()
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(doc, _schema())


def test_aggregate_matches_the_per_seed_headlines(study: tuple[Path, dict[str, Any]]) -> None:
    _, res = study
    rope = res["models"]["rope_axial"]
    per_seed = [r["experiments"]["depth_profile"]["headline"]["accuracy"] for r in rope["runs"]]
    agg = rope["aggregate"]["depth_profile"]["accuracy"]
    assert agg["values"] == per_seed and agg["n"] == 2
    assert agg["mean"] == pytest.approx(sum(per_seed) / 2)
    assert agg["se"] == pytest.approx(abs(per_seed[0] - per_seed[1]) / 2)
    # the two seeds are different models (different weights, so different numbers)
    ssdc = [r["experiments"]["depth_profile"]["headline"]["ssdc_rpi@out"] for r in rope["runs"]]
    assert ssdc[0] != ssdc[1]


def test_a_later_seed_set_runs_each_seed_as_the_full_study_does(
    study: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """seed_start picks the seeds: seed 1 alone (a replication's seed set) trains and analyses
    exactly as seed 1 of the two-seed study, so disjoint seed sets are comparable runs."""
    _, res = study
    later = run_study(replace(TINY_STUDY, seeds=1, seed_start=1, experiments=("depth_profile",)),
                      tmp_path, progress=False)  # fmt: skip
    assert later["config"]["seed_start"] == 1 and later["config"]["seeds"] == 1
    for model in ("ape", "rope_axial"):
        (run,) = later["models"][model]["runs"]
        full = res["models"][model]["runs"][1]
        assert run["seed"] == full["seed"] == 1
        assert (
            run["experiments"]["depth_profile"]["headline"]
            == (full["experiments"]["depth_profile"]["headline"])
        )


def test_seed_flags_name_a_count_or_a_range() -> None:
    from poslens.cli.study import study_seeds
    from poslens.errors import UserError

    assert study_seeds("5", None) == {"seeds": 5}
    assert study_seeds("5-9", None) == {"seed_start": 5, "seeds": 5}
    assert study_seeds("3", 5) == {"seed_start": 5, "seeds": 3}
    assert study_seeds(None, 2) == {"seed_start": 2}
    for bad, start in (("x", None), ("9-5", None), ("5-9", 3), ("1-2-3", None)):
        with pytest.raises(UserError, match="--seeds"):
            study_seeds(bad, start)
    with pytest.raises(ConfigError, match="study.seed_start"):
        replace(TINY_STUDY, seed_start=-1)


def test_rerun_reuses_everything_and_is_identical(
    study: tuple[Path, dict[str, Any]], capfd: pytest.CaptureFixture[str]
) -> None:
    out, res = study
    again = run_study(TINY_STUDY, out, progress=True)
    assert all(s["reused"] for s in again["timings"]["stages"])
    assert _strip(again) == _strip(res)
    shown = capfd.readouterr().err  # the progress display: stage, model, seed, ETA
    assert "[28/28] sae_causal rope_axial seed 1: reused" in shown
    assert "ETA" in shown and "28/28" in shown


def test_compare_prints_both_runs_levels(
    study: tuple[Path, dict[str, Any]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`poslens compare` of this study and a copy with one level's verdict and effect edited."""
    # the CLI's allocator setting would outlive this test and change the next study's
    # environment.malloc (the rerun tests compare it)
    monkeypatch.setattr("poslens.allocator.keep_freed_memory", lambda: None)
    out, res = study
    other = tmp_path / "rerun"
    (other / "figures").mkdir(parents=True)
    shutil.copy(out / "figures" / "claims.png", other / "figures")
    edited = json.loads(json.dumps(res))
    changed = next(c for c in edited["claims"] if c["verdict"] != "supported")
    changed["verdict"], changed["qualifier"] = "supported", None
    model = next(iter(changed["primary"]["models"]))
    changed["primary"]["models"][model] |= {"mean": 0.987, "lower": 0.876, "upper": 1.23}
    (other / "results.json").write_text(json.dumps(edited))
    assert main(["compare", str(out), str(other), "--out", str(tmp_path / "cmp")]) == 0
    printed = capsys.readouterr().out
    assert all(re.search(rf"{c['claim']} +│ {c['level']}", printed) for c in res["claims"])
    assert f"{model} 0.987 [0.876, 1.23]" in printed
    n = len(res["claims"])
    assert f"the runs agree on {n - 1} of {n} claim levels' verdicts" in printed
    md = (tmp_path / "cmp" / "compare.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| ") and "|---" not in line]
    assert len(rows) == 1 + n  # both runs' levels, one row each
    assert sum(r.endswith("| differ |") for r in rows) == 1
    html = (tmp_path / "cmp" / "compare.html").read_text()
    assert html.count("data:image/png;base64,") == 2


def test_models_stopped_early_are_used_and_reused(tmp_path: Path) -> None:
    """As in the default preset, training stops at a validation target (train.stop_acc): the
    study analyses the stopped models, records where they stopped, and a rerun reuses them."""
    cfg = replace(
        TINY_STUDY,
        models=("ape",),
        experiments=("depth_profile",),
        train_set=(
            *TINY_STUDY.train_set,
            "train.steps=9",
            "train.eval_images=80",  # the whole val set: every class is in it, so even a
            # model that always answers one class scores above the 1% target
            "train.stop_acc=0.01",
        ),
    )
    res = run_study(cfg, tmp_path, progress=False)
    for r in res["models"]["ape"]["runs"]:
        metrics = json.loads((tmp_path / r["checkpoint"] / "metrics.json").read_text())
        assert metrics["stopped_at"] == 6 and metrics["steps"] == 9, metrics  # evaluations at 3, 6
        assert "depth_profile" in r["experiments"]
    again = run_study(cfg, tmp_path, progress=False)
    assert all(s["reused"] for s in again["timings"]["stages"])
    assert _strip(again) == _strip(res)


def test_interrupted_stage_is_redone_and_others_kept(
    study: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """A stage without its completion marker (killed mid-way) runs again; finished ones do not."""
    import shutil

    out, res = study
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    (copy / "runs" / "rope_axial" / "seed1" / "windows.stage.json").unlink()
    (copy / "results.json").unlink()
    again = run_study(TINY_STUDY, copy, progress=False)
    redone = [
        (s["stage"], s["model"], s["seed"]) for s in again["timings"]["stages"] if not s["reused"]
    ]
    assert redone == [("windows", "rope_axial", 1)]
    assert _strip(again) == _strip(res)  # same seed, same config, same machine: same numbers


def test_same_config_in_a_fresh_folder_gives_identical_results(
    study: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    _, res = study
    cfg = replace(TINY_STUDY, models=("rope_axial",), experiments=("depth_profile",), seeds=2)
    a = run_study(cfg, tmp_path / "a", progress=False, threads=1)
    b = run_study(cfg, tmp_path / "b", progress=False, threads=1, jobs=2)  # two processes
    assert b["environment"]["jobs"] == 2
    strip_env = lambda r: {k: v for k, v in _strip(r).items() if k != "environment"}  # noqa: E731
    assert strip_env(a) == strip_env(b)
    assert not any(s["reused"] for s in b["timings"]["stages"])
    # and it equals the big study's seed-0 numbers for the same model and config
    assert (
        a["models"]["rope_axial"]["runs"][0]["experiments"]["depth_profile"]
        == res["models"]["rope_axial"]["runs"][0]["experiments"]["depth_profile"]
    )


def test_changed_training_config_trains_a_new_checkpoint(
    study: tuple[Path, dict[str, Any]],
) -> None:
    out, _ = study
    cfg = replace(TINY_STUDY, models=("ape",), seeds=1, experiments=("depth_profile",),
                  train_set=(*TINY_STUDY.train_set, "train.lr=0.002"))  # fmt: skip
    res = run_study(cfg, out / "sub", progress=False)
    first = res["timings"]["stages"][0]
    assert first["stage"] == "train" and not first["reused"]


def test_changed_training_config_in_the_same_folder_redoes_its_experiments(
    study: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """Experiment stages are keyed on the checkpoint too: a retrained model is re-analysed."""
    import shutil

    out, _ = study
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    cfg = replace(TINY_STUDY, models=("ape",), seeds=1, experiments=("depth_profile",),
                  train_set=(*TINY_STUDY.train_set, "train.lr=0.002"))  # fmt: skip
    res = run_study(cfg, copy, progress=False)
    assert [(s["stage"], s["reused"]) for s in res["timings"]["stages"]] == [
        ("train", False), ("depth_profile", False)
    ]  # fmt: skip


def test_only_restricts_an_experiment_to_some_models(tmp_path: Path) -> None:
    cfg = replace(TINY_STUDY, seeds=1, experiments=("depth_profile",),
                  only=("depth_profile=rope_axial",))  # fmt: skip
    res = run_study(cfg, tmp_path, progress=False)
    assert "depth_profile" in res["models"]["ape"]["runs"][0]["skipped"]
    assert "depth_profile" in res["models"]["rope_axial"]["runs"][0]["experiments"]
    with pytest.raises(ConfigError, match="study.only"):
        replace(TINY_STUDY, only=("windows",))
    with pytest.raises(ConfigError, match="study.only"):
        replace(TINY_STUDY, only=("components=ape",))  # not one of the study's experiments


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match="study.models"):
        StudyConfig(models=("ape", "rope9"))
    with pytest.raises(ConfigError, match="study.models"):
        StudyConfig(models=("ape", "ape"))
    with pytest.raises(ConfigError, match="study.seeds"):
        StudyConfig(seeds=0)
    with pytest.raises(ConfigError, match="study.experiments"):
        StudyConfig(experiments=("depth_profile", "nope"))
    with pytest.raises(ConfigError, match="study.probe_images"):
        StudyConfig(n_images=10, probe_images=20)
    with pytest.raises(ConfigError, match="study.preset"):
        preset("huge")
    for name in ("quick", "default", "paper"):
        assert preset(name).preset == name


def test_cli_bad_input_is_one_line_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    for argv, message in (
        (["--models", "ape,rope9"], "study.models"),
        (["--seeds", "0"], "study.seeds"),
        (["--data", "mnist"], "data.task"),
    ):
        assert main(["study", "--preset", "quick", "--out", str(out), *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0] and "Traceback" not in err[0]
    assert not out.exists()


def test_mean_se_and_missing_values() -> None:
    s = mean_se([1.0, 2.0, 4.0])
    assert s["mean"] == pytest.approx(7 / 3)
    assert s["se"] == pytest.approx(
        math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2 / 3)
    )
    one = mean_se([0.5, None])
    assert one == {"mean": 0.5, "se": None, "n": 1, "values": [0.5, None]}
    runs = [{"experiments": {"e": {"headline": {"a": 1.0}}}}, {"experiments": {}}]
    assert aggregate(runs, ["e", "f"]) == {
        "e": {"a": {"mean": 1.0, "se": None, "n": 1, "values": [1.0]}}
    }


def test_train_set_items_can_target_one_encoding() -> None:
    from poslens.study.plan import checkpoint_dir, run_config

    cfg = StudyConfig(train_set=("model.dim=64", "train.steps=1200", "ape:train.steps=2000"))
    ape, rope = run_config(cfg, "ape", 0), run_config(cfg, "rope_axial", 0)
    assert (ape.train.steps, rope.train.steps) == (2000, 1200)
    assert ape.model.dim == rope.model.dim == 64 and run_config(cfg, "ape", 1).train.seed == 1
    # the checkpoint key follows the config: seeds, steps and threads-independence
    out = Path("/x")
    assert checkpoint_dir(out, "ape", 0, ape) != checkpoint_dir(
        out, "ape", 0, run_config(cfg, "ape", 1)
    )
    assert checkpoint_dir(out, "ape", 0, ape) == checkpoint_dir(
        out, "ape", 0, run_config(cfg, "ape", 0, threads=1)
    )


def test_without_a_terminal_each_finished_stage_is_one_log_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """stderr is not a terminal under pytest, as in CI or nohup: the study writes one line per
    finished stage (stage, model, seed, seconds, ETA) instead of a progress bar or nothing."""
    cfg = replace(TINY_STUDY, models=("ape", "rope_axial"), seeds=1,
                  experiments=("depth_profile", "axis_map"))  # fmt: skip
    run_study(cfg, tmp_path / "out", progress=True, jobs=1)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("poslens: [")]
    assert [ln.split("]")[0] for ln in lines] == [f"poslens: [{i}/6" for i in range(1, 7)]
    assert lines[0].startswith("poslens: [1/6] train ape seed 0: ")
    assert all(re.search(r": (\d+\.\d s|reused|skipped); ETA (\d+ s|\?)$", ln) for ln in lines)
    # an experiment that does not apply to a model (rotary planes in APE) says so
    assert [ln for ln in lines if "skipped" in ln] == [
        next(ln for ln in lines if "axis_map ape seed 0" in ln)
    ]
    assert lines[-1].endswith("ETA 0 s")


def test_a_model_with_its_own_seed_count_runs_those_seeds_and_its_controls_follow(
    study: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """study.model_seeds gives one model more (or fewer) seeds than the rest: its seeds train and
    analyse exactly as the same seeds of a study that runs them all, its in-situ controls follow
    its count, results.json and the report say so, and bad entries are one-line ConfigErrors."""
    from poslens.report.common import summary
    from poslens.study.plan import make_plan

    _, res = study
    cfg = replace(
        TINY_STUDY, seeds=1, model_seeds=("rope_axial=2",), experiments=("depth_profile",)
    )
    assert cfg.seeds_of("rope_axial") == (0, 1) and cfg.seeds_of("ape") == (0,) and cfg.n_runs == 3
    out = run_study(cfg, tmp_path / "own", progress=False)
    check_results(out)
    assert out["config"]["model_seeds"] == ["rope_axial=2"]
    assert [r["seed"] for r in out["models"]["rope_axial"]["runs"]] == [0, 1]
    assert [r["seed"] for r in out["models"]["ape"]["runs"]] == [0]
    for model, seed in (("rope_axial", 0), ("rope_axial", 1), ("ape", 0)):
        run = next(r for r in out["models"][model]["runs"] if r["seed"] == seed)
        full = res["models"][model]["runs"][seed]
        assert (
            run["experiments"]["depth_profile"]["headline"]
            == (full["experiments"]["depth_profile"]["headline"])
        )
    assert out["models"]["rope_axial"]["aggregate"]["depth_profile"]["ssdc_rpi@out"]["n"] == 2
    assert "with 1 seed each (rope_axial 2 seeds)" in summary(out, claims_of(out))
    # in-situ controls run their model's seeds
    plan = make_plan(replace(preset("default"), model_seeds=("rope_axial=7", "ape=3")), tmp_path)
    seeds: dict[str, list[int]] = {}
    for r in plan.runs:
        seeds.setdefault(r.model, []).append(r.seed)
    assert seeds["rope_axial"] == seeds["rope_axial~heads_axis_split"] == list(range(7))
    assert seeds["ape"] == seeds["ape~table_rowcol"] == [0, 1, 2]
    assert seeds["rope_late"] == seeds["ape_cell"] == list(range(5))
    assert make_plan(cfg, tmp_path / "jobs", jobs=100).jobs == 3  # capped by the runs: 1 + 2
    for bad in (("rope_axial",), ("vit=3",), ("rope_axial=0",), ("rope_axial=x",),
                ("rope_axial=2", "rope_axial=3")):  # fmt: skip
        with pytest.raises(ConfigError, match="study.model_seeds"):
            replace(TINY_STUDY, model_seeds=bad)
    code = main(["study", "--preset", "ladder", "--model-seeds", "ape=3", "--out",
                 str(tmp_path / "ladder")])  # fmt: skip
    assert code != 0 and "--model-seeds does not go with --preset ladder" in capsys.readouterr().err
    code = main(["study", "--models", "ape", "--model-seeds", "rope_axial=3", "--out",
                 str(tmp_path / "bad")])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code != 0 and err.count("\n") == 0 and "study.model_seeds" in err
    assert not (tmp_path / "bad").exists()
