"""The scale ladder: rung configs, the ladder end to end on tiny rungs, its figures and errors."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import pytest

from poslens.cli import main
from poslens.errors import ConfigError, UserError
from poslens.study.claims import RULES
from poslens.study.ladder import (
    LADDER,
    SCHEMA,
    VIT_B,
    LadderConfig,
    Rung,
    ladder_preset,
    run_ladder,
)
from poslens.study.ladder_figures import claim_figure
from poslens.study.plan import experiment_configs, run_config
from tests.study.test_study import TINY_STUDY


def test_the_ladder_is_the_issue_s_ladder() -> None:
    """Grid 6 -> 10 -> 14 at width 32, a wider rung, depth 4 -> 8 -> 12 for RoPE, and the
    quadrant relation, each a real study config whose trained models have the rung's shape."""
    by = {r.name: r for r in LADDER}
    grid = sorted((r.grid, r.width, r.depth) for r in LADDER if "grid" in r.ladders)
    assert grid == [(6, 32, 4), (10, 32, 4), (14, 32, 4)]
    assert sorted(r.width for r in LADDER if "width" in r.ladders) == [32, 64]
    assert sorted(r.depth for r in LADDER if "depth" in r.ladders) == [4, 8, 12]
    assert [r.relation for r in LADDER if "task" in r.ladders] == ["sector", "quadrant"]
    cfg = ladder_preset()
    assert cfg.seeds >= 3
    for rung in LADDER:
        study = cfg.study_config(rung)
        assert study.seeds == cfg.seeds
        for m in study.models:
            rc = run_config(study, m, seed=0)
            # the model takes its image size from the task when it is built (FROM_DATA)
            assert rc.data.image_size == rung.grid * 4 and rc.model.patch_size == 4
            assert (rc.model.dim, rc.model.depth) == (rung.width, rung.depth)
            assert rc.data.relation == rung.relation
    # the depth rungs: rotary study models only, with the rebuild claim's trained controls
    assert cfg.study_config(by["d12"]).models == ("rope_axial", "rope_rebuild", "rope_late")
    assert cfg.study_config(by["g10"]).models == ("ape", "rope_axial")
    # the withheld window grows with depth as in the original (blocks 0..5 of 12)
    assert experiment_configs(cfg.study_config(by["d12"]))["windows"].prefix_ks == (0, 5)
    assert experiment_configs(cfg.study_config(by["d8"]))["windows"].prefix_ks == (0, 3)
    assert experiment_configs(cfg.study_config(by["g6"]))["windows"].prefix_ks == (0, 1)


def test_ladder_preset_picks_rungs_and_models() -> None:
    cfg = ladder_preset("g14, g6", models=("ape", "rope_axial", "rope_mixed"), seeds=5)
    assert [r.name for r in cfg.rungs] == ["g6", "g14"]  # ladder order
    assert cfg.study_config(cfg.rungs[1]).models == ("ape", "rope_axial", "rope_mixed")
    assert ladder_preset("d8", models=("rope_mixed",)).study_config(LADDER[4]).models[0] == (
        "rope_mixed"
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rungs": "g6,g99"}, "ladder rungs must be among"),
        ({"rungs": ","}, "ladder rungs must be among"),
        ({"rungs": "d8", "models": ("ape",)}, "leaves rung\\(s\\) d8 without a study model"),
        ({"seeds": 0}, "ladder.seeds"),
        ({"base": "paper"}, "ladder.base"),
        ({"models": ("vit",)}, "ladder.models"),
    ],
)
def test_bad_ladder_configs_name_the_field(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ladder_preset(**kwargs)


def test_a_rung_that_cannot_train_is_refused_before_any_work() -> None:
    # a 4 x 4 grid is 16 px: the relation task's glyphs would be under 5 px
    with pytest.raises(ConfigError, match="ladder rung g4: data.object_scale"):
        LadderConfig(rungs=(Rung("g4", 4),))
    with pytest.raises(ConfigError, match="rung 'x': relation"):
        Rung("x", 6, relation="diagonal")
    with pytest.raises(ConfigError, match="lists a rung twice"):
        LadderConfig(rungs=(LADDER[0], LADDER[0]))


# ------------------------------------------------------------------------- end to end

TINY_RUNGS = (
    Rung("a", 4, width=16, depth=3, ladders=("grid", "depth", "task")),
    Rung("b", 6, width=16, depth=3, ladders=("grid",)),
    Rung("c", 4, width=16, depth=4, ladders=("depth",), rotary_only=True),
    Rung("q", 4, width=16, depth=3, relation="quadrant", ladders=("task",)),
)
TINY_LADDER = LadderConfig(
    rungs=TINY_RUNGS,
    seeds=2,
    base="quick",
    in_situ=False,
    changes={
        "experiments": ("position_removal", "windows", "sae_causal"),
        "train_set": (*TINY_STUDY.train_set, "data.object_scale=0.32"),
        "analysis_set": TINY_STUDY.analysis_set,
        "n_images": 30,
        "probe_images": 30,
        "batch_size": 30,
    },
)


@pytest.fixture(scope="module")
def ladder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("ladder")
    return out, run_ladder(TINY_LADDER, out, progress=False, say=lambda _: None)


def test_every_rung_is_a_study_and_the_ladder_keeps_it(
    ladder: tuple[Path, dict[str, Any]],
) -> None:
    out, res = ladder
    assert res["schema"] == SCHEMA and res["vit_b"] == VIT_B
    assert json.loads((out / "results.json").read_text()) == res
    assert "NaN" not in (out / "results.json").read_text()
    assert [r["name"] for r in res["rungs"]] == ["a", "b", "c", "q"]
    for rung, spec in zip(res["rungs"], TINY_RUNGS, strict=True):
        own = json.loads((out / rung["folder"] / "results.json").read_text())
        assert (out / rung["report"]).is_file()
        assert rung["claims"] == own["claims"]  # the ladder keeps every rung's claims whole
        for m, e in own["models"].items():
            assert e["scale"]["grid"] == spec.grid and e["scale"]["dim"] == spec.width
            assert e["scale"]["depth"] == spec.depth
            assert rung["models"][m]["aggregate"] == e["aggregate"]
            training = rung["models"][m]["training"]
            if e.get("in_situ"):  # an edit of a trained model: its training is the model's
                assert training is None
            else:
                assert training["test_acc"] == [r["train"]["test_acc"] for r in e["runs"]]
                assert training["stopped_at"] == [r["train"]["stopped_at"] for r in e["runs"]]
                assert len(training["val_acc"]) == len(e["runs"]) == 2
        # the ladder's per-claim view reads the same numbers as the rung's own claims
        for cl, mine in zip(own["claims"], res["claims"], strict=True):
            view = mine["rungs"][rung["name"]]
            assert view["verdict"] == cl["verdict"]
            for m, t in cl["primary"]["models"].items():
                assert view["models"][m]["mean"] == t["mean"]
                assert view["models"][m]["values"] == t["values"]
    # the depth rung trains rotary models only; the quadrant rung the other relation
    assert set(res["rungs"][2]["models"]) == {"rope_axial"}
    q = json.loads((out / "rungs/q/runs/ape/seed0/position_removal.json").read_text())
    assert q  # the quadrant rung ran its experiments
    ckpt = next((out / "rungs/q/checkpoints").glob("ape_s0_*"))
    assert json.loads((ckpt / "config.json").read_text())["data"]["relation"] == "quadrant"
    assert [c["id"] for c in res["claims"]] == [r.id for r in RULES]


def test_predictions_read_each_rung_s_ape_model(ladder: tuple[Path, dict[str, Any]]) -> None:
    out, res = ladder
    share = next(p for p in res["predictions"] if p["id"] == "table_rowcol_share")
    for rung in ("a", "b", "q"):
        own = json.loads((out / f"rungs/{rung}/results.json").read_text())
        agg = own["models"]["ape"]["aggregate"]["position_removal"]["table.rowcol_share"]
        assert share["rungs"][rung] == agg
        assert all(0.0 <= v <= 1.0 for v in agg["values"])
    assert share["rungs"]["c"] is None  # no APE model on the depth rung


def test_csv_figures_and_report(ladder: tuple[Path, dict[str, Any]]) -> None:
    out, res = ladder
    rows = list(csv.DictReader(io.StringIO((out / "ladder.csv").read_text())))
    expected = sum(len(rc["models"]) + len(rc["controls"]) for cl in res["claims"]
                   for rc in cl["rungs"].values())  # fmt: skip
    assert len(rows) == expected > 0
    row = next(r for r in rows if r["rung"] == "b" and r["role"] == "study")
    assert (row["grid"], row["width"], row["depth"]) == ("6", "16", "3")
    claims = {c["claim"] for c in res["claims"]}
    figs = {f["claim"] for f in res["figures"]}
    assert claims <= figs and None in figs  # one per claim, and the predictions
    for f in res["figures"]:
        assert (out / f["png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (out / f["svg"]).is_file()
    page = (out / "report.html").read_text()
    md = (out / "report.md").read_text()
    for text in (page, md):
        assert all(f"rungs/{n}/report.html" in text for n in "abcq")
        assert "Claims along the ladder" in text and "G^2 / width" in text
        assert "Test accuracy per seed" in text
    ape_a = res["rungs"][0]["models"]["ape"]["training"]
    row = f"| a | ape | {', '.join(f'{100 * a:.1f}%' for a in ape_a['test_acc'])} |"
    assert row in md
    assert page.count("data:image/png;base64,") == len(res["figures"])


def test_results_follow_the_ladder_schema_and_report_rerenders(
    ladder: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    from poslens.report.schema import check_results, results_schema

    out, res = ladder
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(res, results_schema(SCHEMA))  # the reference validator
    check_results(res)  # poslens's own checker, which `poslens report` runs
    broken = {k: v for k, v in res.items() if k != "rungs"}
    with pytest.raises(UserError, match="poslens.ladder/1: the document lacks the required key"):
        check_results(broken)
    bad_rung = json.loads(json.dumps(res))
    bad_rung["rungs"][0]["relation"] = "diagonal"  # through allOf -> $defs/shape
    with pytest.raises(UserError, match="rungs\\[0\\].relation must be one of"):
        check_results(bad_rung)
    # `poslens report DIR` re-renders a ladder folder's own report from its results.json
    copy = tmp_path / "copy"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("rungs"))
    (copy / "report.html").unlink()
    assert main(["report", str(copy)]) == 0
    assert "Claims along the ladder" in (copy / "report.html").read_text()
    capsys.readouterr()


def test_the_cli_summary_has_a_line_per_claim_level(ladder: tuple[Path, dict[str, Any]]) -> None:
    from poslens.cli.study import ladder_summary

    _, res = ladder
    lines = ladder_summary(res).splitlines()
    assert len(lines) == 1 + len(res["claims"])
    assert lines[0].split()[-4:] == ["a", "b", "c", "q"]
    rebuild = next(line for line in lines if line.startswith("rope_rebuilds (sharper)"))
    mean = res["claims"][5]["rungs"]["c"]["models"]["rope_axial"]["mean"]
    assert res["claims"][5]["id"] == "rope_rebuilds.sharper"
    assert rebuild.split()[-2] == f"{mean:.2f}"  # rung c's rope_axial


def test_rerun_reuses_every_stage(ladder: tuple[Path, dict[str, Any]]) -> None:
    out, res = ladder
    again = run_ladder(TINY_LADDER, out, progress=False, say=lambda _: None)
    assert again["claims"] == res["claims"] and again["predictions"] == res["predictions"]
    for rung in again["rungs"]:
        own = json.loads((out / rung["folder"] / "results.json").read_text())
        assert all(s["reused"] for s in own["timings"]["stages"])


def _fake(effects: dict[str, float]) -> dict[str, Any]:
    """Ladder results with one claim level and rungs on the grid axis (effect per rung)."""
    rungs = [{"name": n, "grid": g, "width": 32, "depth": 4, "relation": "sector",
              "ladders": ["grid"], "models": {"ape": {}}, "g2_per_width": g * g / 32}
             for n, g in (("g6", 6), ("g10", 10))]  # fmt: skip
    test = {"n": 3, "mean": 0.0, "lower": -0.1, "upper": 0.1, "values": [0.0] * 3}
    rc = {n: {"models": {"ape": test | {"mean": e}}, "threshold": 0.1, "controls": [],
              "calibration": {"passed": n == "g6"}} for n, e in effects.items()}  # fmt: skip
    claim = {"claim": "c", "id": "c.original", "level": "original", "level_name": "orig",
             "title": "C", "descriptive": False, "rungs": rc,
             "reference": {"effect": 0.7, "comparable": True}}  # fmt: skip
    return {"rungs": rungs, "claims": [claim], "predictions": [], "vit_b": VIT_B}


def test_claim_figure_puts_each_rung_and_vit_b_where_they_belong() -> None:
    fig = claim_figure(_fake({"g6": 0.2, "g10": 0.4}), "c")
    assert fig is not None
    (ax,) = fig.axes
    points = {(round(float(x), 2), float(y)) for line in ax.lines if line.get_marker() == "o"
              for x, y in zip(line.get_xdata(), line.get_ydata(), strict=True)}  # fmt: skip
    assert points == {(6.0, 0.2), (10.0, 0.4)}
    fills = [line.get_markerfacecolor() for line in ax.lines if line.get_marker() == "o"]
    assert "white" in fills and len(set(fills)) == 2  # g10's controls did not pass: hollow
    (star,) = [line for line in ax.lines if line.get_marker() == "*"]
    assert list(star.get_xdata()) == [VIT_B["grid"]] and list(star.get_ydata()) == [0.7]


def test_cli_refuses_what_the_ladder_cannot_take(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cases = [
        (["--preset", "ladder", "--data", "animals"], "--data does not go with --preset ladder"),
        (["--preset", "ladder", "--rungs", "g7"], "ladder rungs must be among"),
        (["--rungs", "g6"], "--rungs goes with --preset ladder"),
        (["--preset", "ladder", "--rungs", "d12", "--models", "ape"], "without a study model"),
    ]
    for args, match in cases:
        out = tmp_path / "out"
        assert main(["study", *args, "--out", str(out), "--no-progress"]) == 2
        err = capsys.readouterr().err.strip()
        assert match in err and "\n" not in err and "Traceback" not in err
        assert not out.exists()  # refused before any write


@pytest.mark.parametrize("grid", [6, 10, 14])
def test_rowcol_chance_is_the_share_of_random_cells(grid: int) -> None:
    """The chance level beside the APE table's share: a table of independent random cells."""
    import torch

    from poslens.metrics.stats import row_col_share
    from poslens.study.ladder import rowcol_chance

    gen = torch.Generator().manual_seed(grid)
    shares = [row_col_share(torch.randn(grid, grid, 64, generator=gen))["rowcol_share"]
              for _ in range(20)]  # fmt: skip
    assert abs(sum(shares) / len(shares) - rowcol_chance(grid)) < 0.01
