"""The study on pretrained timm models (random weights, saved offline): no training, a load stage,
analysis seeds, schema, reuse, claims and report; bad sources are one-line errors."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from poslens.errors import CheckpointError, ConfigError, DataError
from poslens.study import StudyConfig, preset, run_study
from poslens.study.judge import PRETRAINED_CAVEAT
from poslens.study.plan import Stage
from tests.conftest import shrink_timm

if os.environ.get("POSLENS_FULL") == "1":
    import timm
else:
    timm = pytest.importorskip("timm")

APE, ROPE = "vit_small_patch16_224", "vit_small_patch16_rope_224"
SMALL = dict(depth=2, img_size=64, num_classes=5, embed_dim=64, num_heads=2)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    """An image folder (5 classes x 16 images) and random weights for an APE and a RoPE model."""
    root = tmp_path_factory.mktemp("pretrained")
    rng = np.random.default_rng(0)
    for k in range(5):
        (root / "images" / str(k)).mkdir(parents=True)
        for i in range(16):
            pixels = rng.integers(0, 256, (72, 80, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / "images" / str(k) / f"{i}.png")
    weights = {}
    for name in (APE, ROPE):
        torch.manual_seed(0)
        tm = timm.create_model(name, pretrained=False, **SMALL)
        weights[name] = root / f"{name}.safetensors"
        save_file({k: v.contiguous() for k, v in tm.state_dict().items()}, str(weights[name]))
    return root / "images", weights


@pytest.fixture(autouse=True)
def small_timm(monkeypatch: pytest.MonkeyPatch) -> None:
    shrink_timm(monkeypatch, **SMALL)


def _cfg(images: Path, weights: dict[str, Path], **changes: Any) -> StudyConfig:
    cfg = preset(
        "quick",
        pretrained=tuple(f"timm:{n}={w}" for n, w in weights.items()),
        images=str(images),
        seeds=2,
        experiments=("depth_profile", "position_removal", "axis_map", "sae_causal"),
        analysis_set=(
            "position_removal.n_planes=2", "position_removal.draws=1", "sae_causal.sites=probe",
            "sae_causal.train_images=40", "sae_causal.epochs=1", "sae_causal.k=4",
            "sae_causal.doses=2", "sae_causal.draws=1",
        ),
        n_images=40,
        probe_images=40,
        ssdc_images=30,
        batch_size=20,
        only=("sae_causal=ape",),
    )  # fmt: skip
    return replace(cfg, **changes)


@pytest.fixture(scope="module")
def study(
    sources: tuple[Path, dict[str, Path]], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, Any]]:
    with pytest.MonkeyPatch.context() as mp:  # module scope: the autouse fixture is per test
        shrink_timm(mp, **SMALL)
        out = tmp_path_factory.mktemp("study")
        return out, run_study(_cfg(*sources), out, progress=False, jobs=1)


def test_pretrained_study_layout_schema_and_claims(study: tuple[Path, dict[str, Any]]) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    out, res = study
    schema = json.loads(resources.files("poslens.study").joinpath("schema.json").read_text())
    jsonschema.validate(json.loads((out / "results.json").read_text()), schema)
    # each model and its in-situ controls (those whose edit fits its encoding)
    in_situ = {APE: ("table_rowcol", "table_cell", "position_shuffled"),
               ROPE: ("heads_axis_split", "freqs_oblique", "position_shuffled")}  # fmt: skip
    assert set(res["models"]) == {APE, ROPE} | {f"{m}~{e}" for m, es in in_situ.items() for e in es}
    assert res["models"][APE]["posenc"] == "ape"
    assert res["models"][ROPE]["posenc"] == "rope_axial"
    for name, entry in res["models"].items():
        assert [r["seed"] for r in entry["runs"]] == [0, 1]
        base, _, edit = name.partition("~")
        for r in entry["runs"]:
            assert r["train"] is None and r["checkpoint"] == f"timm:{base}"
            assert r["pretrained"].get("in_situ") == (edit or None)
            assert r["pretrained"]["chance"] == pytest.approx(0.2)
            assert 0 <= r["pretrained"]["test_acc"] <= 1 and r["pretrained"]["n_images"] == 40
    assert not (out / "checkpoints").exists()  # nothing is trained
    # each pretrained model converted once, by the parent, for every run of it to load
    assert sorted(f.name.rsplit("_", 1)[0] for f in (out / "converted").iterdir()) == [APE, ROPE]
    stages = [(s["stage"], s["model"], s["seed"]) for s in res["timings"]["stages"]]
    assert stages[:4] == [("load", APE, 0), ("depth_profile", APE, 0),
                          ("position_removal", APE, 0), ("axis_map", APE, 0)]  # fmt: skip
    # the axis map needs rotary planes; the converted naver RoPE model has them (as in timm)
    assert "axis_map" in res["models"][APE]["runs"][0]["skipped"]
    assert "axis_map" in res["models"][ROPE]["runs"][0]["experiments"]
    # the SAE test on the APE model only ("sae_causal=ape" names the encoding), at the probe block
    assert "sae_causal" in res["models"][ROPE]["runs"][0]["skipped"]
    sae = json.loads((out / "runs" / APE / "seed0" / "sae_causal.json").read_text())
    (site,) = sae["sae_sites"]
    assert site.endswith("hook_normalized") and sae["config"]["sites"] == ["probe"]
    assert sae["config"]["ssdc_images"] == 30
    # analysis seeds: the same weights, another image subset and draws -> other numbers
    accs = [r["experiments"]["depth_profile"]["headline"]["ssdc_rpi@out"]
            for r in res["models"][ROPE]["runs"]]  # fmt: skip
    assert accs[0] != accs[1]
    for claim in res["claims"]:
        assert PRETRAINED_CAVEAT in claim["caveats"]
        assert not any("default task" in c for c in claim["caveats"])
    report = (out / "report.html").read_text()
    assert "Pretrained models" in report and f"timm:{APE}" in report


def test_the_load_stage_measures_the_baseline_its_experiments_read(
    sources: tuple[Path, dict[str, Path]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pretrained run's accuracy is read from the intact baseline that its first experiment
    reads, measured by the load stage into the run's cache: the same number as a plain pass,
    and that experiment finds it there (no pass of its own); a control whose position_removal
    runs unprobed (position_shuffled) measures accuracy in a plain pass."""
    from poslens.experiments import readout
    from poslens.experiments.config import resolved
    from poslens.study.plan import make_plan
    from poslens.study.stages import Source, baseline_stage, load_stage

    plan = make_plan(_cfg(*sources), tmp_path)
    runs = {(r.model, r.seed): r for r in plan.runs}
    run = runs[ROPE, 0]
    cache: readout.ReferenceCache = {}
    assert run.stages[0].config is not None
    rec = load_stage(Source.of(run), run.stages[0].config, "cpu", run.stages[1:], cache)
    plain = load_stage(Source.of(run), run.stages[0].config, "cpu")
    assert rec["test_acc"] == plain["test_acc"]
    model, data = Source.of(run).load("cpu")
    first = baseline_stage(run.stages[1:], model)
    assert first is not None and first.kind == "depth_profile" and first.config is not None
    calls: list[int] = []
    monkeypatch.setattr(readout, "measure", lambda *a, **k: calls.append(1))  # type: ignore[func-returns-value]
    cfg = resolved(first.config, model)
    x, y = readout.eval_images(data, cfg)
    base = readout.baseline(model, x, y, cfg, range(model.cfg.depth + 1), cache, clean_ssdc=True)
    assert not calls and base.ssdc_clean is not None and base.accuracy == rec["test_acc"]
    shuffled = runs[f"{ROPE}~position_shuffled", 0]
    m, _ = Source.of(shuffled).load("cpu")
    assert baseline_stage(shuffled.stages[1:], m) is None


def test_pretrained_study_rerun_reuses_every_stage(
    study: tuple[Path, dict[str, Any]], sources: tuple[Path, dict[str, Path]]
) -> None:
    out, res = study
    again = run_study(_cfg(*sources), out, progress=False, jobs=1)
    assert all(s["reused"] for s in again["timings"]["stages"])
    strip = lambda r: {k: v for k, v in r.items() if k not in ("created", "timings")}  # noqa: E731
    assert strip(again) == strip(res)


def test_new_weights_redo_every_stage(
    study: tuple[Path, dict[str, Any]], sources: tuple[Path, dict[str, Path]], tmp_path: Path
) -> None:
    """Stages are keyed on the weights file: other weights under the same name are not reused."""
    import shutil

    out, _ = study
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    images = sources[0]
    torch.manual_seed(1)
    tm = timm.create_model(ROPE, pretrained=False, **SMALL)
    other = tmp_path / "other.safetensors"
    save_file({k: v.contiguous() for k, v in tm.state_dict().items()}, str(other))
    cfg = _cfg(images, {ROPE: other}, seeds=1, experiments=("depth_profile",), only=())
    res = run_study(cfg, copy, progress=False, jobs=1)
    assert not any(s["reused"] for s in res["timings"]["stages"])


def test_pretrained_config_errors(sources: tuple[Path, dict[str, Path]], tmp_path: Path) -> None:
    images, weights = sources
    with pytest.raises(ConfigError, match="study.pretrained"):
        StudyConfig(pretrained=("vit_base_patch16_224",), images=str(images))
    with pytest.raises(ConfigError, match="study.pretrained"):
        StudyConfig(pretrained=(f"timm:{APE}=a", f"timm:{APE}=b"), images=str(images))
    with pytest.raises(ConfigError, match="study.images"):
        StudyConfig(pretrained=(f"timm:{APE}=a",))
    with pytest.raises(ConfigError, match="study.images"):
        StudyConfig(images=str(images))
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match="not found"):
        run_study(_cfg(images, {APE: tmp_path / "missing.safetensors"}), out, progress=False)
    with pytest.raises(DataError, match="does not exist"):
        run_study(_cfg(tmp_path / "nowhere", weights), out, progress=False)
    assert not out.exists()


def test_paper_preset_for_pretrained_models_is_the_original_protocol() -> None:
    cfg = preset("paper", pretrained=(f"timm:{APE}=hub",), images="imagenet/val")
    assert (cfg.n_images, cfg.probe_images, cfg.ssdc_images, cfg.seeds) == (5000, 1000, 1000, 3)
    # the APE claims read the early site (claims.ape.SITE) and the table site (USE_SITE): SAEs
    # must sit at both
    from poslens.study.claims.ape import SITE, USE_SITE

    sites = {"sae_causal.sites=early,probe,table"}
    assert {"sae_causal.expansion=5", "sae_causal.k=64"} | sites <= set(cfg.analysis_set)
    for name, kw in (("quick", {}), ("default", {}), ("paper", {}),
                     ("quick", {"pretrained": (f"timm:{APE}=hub",), "images": "imagenet/val"})):  # fmt: skip
        sae = preset(name, **kw).analysis_sets.get("sae_causal", {})
        assert {SITE, USE_SITE} <= set(sae.get("sites", "").split(",")), (name, kw)
        # the fast presets read each SAE edit with the fixed probes alone (what the APE rules
        # read), the default only the row and column edits at the table site; the original
        # protocol refits the probes and runs every edit everywhere
        assert sae.get("refit", "true") == str(name == "paper").lower(), (name, kw)
        assert sae.get("rowcol_sites", "") == (USE_SITE if name == "default" else ""), (name, kw)
    assert cfg.model_keys == (APE,)
    sae = Stage("sae_causal", APE, 0, 1.0, only=cfg.only_models["sae_causal"])
    assert sae.skipped_for("ape") is False  # SAEs on the APE model only
    rope = Stage("sae_causal", "vit_base_patch16_rope_224", 0, 1.0, only=sae.only)
    assert rope.skipped_for("rope_axial") is True


def test_cli_study_on_a_pretrained_model(
    sources: tuple[Path, dict[str, Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`poslens study --pretrained timm:NAME=W --data DIR`: the quick preset end to end."""
    from poslens.cli import main

    _, weights = sources
    images = tmp_path / "images"  # the quick preset evaluates 100 test images: 200 in all
    rng = np.random.default_rng(1)
    for k in range(5):
        (images / str(k)).mkdir(parents=True)
        for i in range(40):
            Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(
                images / str(k) / f"{i}.png"
            )
    out = tmp_path / "out"
    argv = ["study", "--preset", "quick", "--pretrained", f"timm:{ROPE}={weights[ROPE]}",
            "--data", str(images), "--out", str(out), "--no-progress", "--jobs", "1"]  # fmt: skip
    assert main(argv) == 0
    res = json.loads((out / "results.json").read_text())
    assert [m for m in res["models"] if "~" not in m] == [ROPE]
    assert res["config"]["images"] == str(images)
    assert "results in" in capsys.readouterr().out
    for extra, message in (
        (["--models", "ape"], "--pretrained replaces them"),
        (["--seeds", "0"], "study.seeds"),
    ):
        assert main([*argv[:-2], *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0]
    bad = tmp_path / "bad"
    assert main(["study", "--pretrained", f"timm:{ROPE}=nowhere.safetensors", "--data",
                 str(images), "--out", str(bad)]) == 2  # fmt: skip
    assert "not found" in capsys.readouterr().err and not bad.exists()
    assert main(["study", "--pretrained", f"timm:{ROPE}={weights[ROPE]}", "--out", str(bad)]) == 2
    assert "--data" in capsys.readouterr().err and not bad.exists()


def test_rebuild_fine_tune_controls_on_a_pretrained_rope_model(
    sources: tuple[Path, dict[str, Path]], tmp_path: Path
) -> None:
    """study.finetune_steps: the RoPE model's weights fine-tuned two ways on the study's val
    images, as controls of the rebuild claim; steps and learning rate in results.json, the tuned
    weights kept in the run folder and reused; without it, the claim says how it is calibrated."""
    from poslens.study.stages import TUNED_FILE

    images, weights = sources
    cfg = _cfg(images, {ROPE: weights[ROPE]}, seeds=1, experiments=("windows",), only=(),
               analysis_set=("windows.prefix_ks=0", "windows.axis_windows=false",
                             "windows.probe_curves=false"),
               finetune_steps=4, finetune_lr=3e-4, finetune_batch=8)  # fmt: skip
    out = tmp_path / "out"
    res = run_study(cfg, out, progress=False, jobs=1)
    tuned = {f"{ROPE}~finetune_held_out": "held_out", f"{ROPE}~finetune_late": "late"}
    assert set(tuned) <= set(res["models"])
    for name, windows in tuned.items():
        assert res["models"][name]["in_situ"]["edit"] == f"finetune_{windows}"
        (run,) = res["models"][name]["runs"]
        ft = run["pretrained"]["finetune"]
        assert (ft["windows"], ft["steps"], ft["lr"], ft["batch_size"]) == (windows, 4, 3e-4, 8)
        assert ft["images"] == 40 and "windows" in run["experiments"]
        assert (out / "runs" / name / "seed0" / TUNED_FILE).is_file()
    for claim in (c for c in res["claims"] if c["claim"] == "rope_rebuilds"):
        rows = {r["model"]: r["role"] for r in claim["calibration"]["controls"]}
        assert rows == {
            f"{ROPE}~finetune_held_out": "positive",
            f"{ROPE}~finetune_late": "negative",
        }
    # the same command again: every stage reused, the fine-tune not redone
    stamp = (out / "runs" / f"{ROPE}~finetune_late" / "seed0" / TUNED_FILE).stat().st_mtime_ns
    again = run_study(cfg, out, progress=False, jobs=1)
    assert all(s["reused"] for s in again["timings"]["stages"])
    assert (
        out / "runs" / f"{ROPE}~finetune_late" / "seed0" / TUNED_FILE
    ).stat().st_mtime_ns == stamp
    # without fine-tunes: no such controls, and the verdict says what could calibrate it
    plain = run_study(replace(cfg, finetune_steps=0), tmp_path / "plain", progress=False, jobs=1)
    assert not any("finetune" in m for m in plain["models"])
    rebuild = next(c for c in plain["claims"] if c["id"] == "rope_rebuilds.original")
    assert "--rebuild-finetune" in json.dumps(rebuild)
    with pytest.raises(ConfigError, match="study.finetune_steps"):
        replace(preset("default"), finetune_steps=5)


def test_cli_rebuild_finetune_needs_pretrained_models(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from poslens.cli import main

    assert main(["study", "--rebuild-finetune", "5", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--rebuild-finetune goes with --pretrained" in err[0]
    assert not (tmp_path / "o").exists()


def test_cli_fine_tune_options_reach_the_study_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import poslens.study
    from poslens.cli import main

    seen: list[tuple[int, float, int]] = []

    def fake_run_study(cfg, out, **kw):  # type: ignore[no-untyped-def]
        seen.append((cfg.finetune_steps, cfg.finetune_lr, cfg.finetune_batch))
        return {"claims": [], "timings": {"total_seconds": 0.0}}

    monkeypatch.setattr(poslens.study, "run_study", fake_run_study)
    base = ["study", "--pretrained", f"timm:{ROPE}=w.safetensors", "--data", "imgs", "--no-progress",
            "--out", str(tmp_path / "s")]  # fmt: skip
    assert main(base) == 0
    assert main([*base, "--rebuild-finetune", "300", "--finetune-lr", "3e-5",
                 "--finetune-batch", "16"]) == 0  # fmt: skip
    assert seen == [(0, 1e-4, 32), (300, 3e-5, 16)]


def test_prepared_models_match_a_conversion_and_are_converted_once(
    sources: tuple[Path, dict[str, Path]], tmp_path: Path
) -> None:
    """The study's parent converts each pretrained model once into OUT/converted/: a worker's
    model from that folder has the converted model's weights and outputs, its images are read
    with the same preprocessing; a rerun reuses the folder, replaced weights convert again."""
    from poslens.study.plan import make_plan
    from poslens.study.prepared import PREPROCESS_FILE, prepare
    from poslens.study.stages import Source

    cfg = _cfg(*sources)
    plan = make_plan(cfg, tmp_path)
    folders = prepare(tmp_path, cfg.pretrained_models, cfg.images)
    assert set(folders) == {APE, ROPE}
    for run in [r for r in plan.runs if r.seed == 1 and not r.edit]:
        prepared = Source.of(run, out=tmp_path)
        assert prepared.prepared == folders[run.model]
        (m1, t1), (m2, t2) = prepared.load("cpu"), Source.of(run).load("cpu")
        s1, s2 = m1.state_dict(), m2.state_dict()
        assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)
        (x1, y1), (x2, y2) = t1.split("test"), t2.split("test")
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
        with torch.no_grad():
            assert torch.equal(m1(x1[:4]), m2(x2[:4]))
    marker = folders[ROPE] / PREPROCESS_FILE
    before = marker.stat().st_mtime_ns
    assert (
        prepare(tmp_path, cfg.pretrained_models, cfg.images) == folders
        and marker.stat().st_mtime_ns == before
    )
    weights = sources[1][ROPE]
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1))
    again = prepare(tmp_path, cfg.pretrained_models, cfg.images)
    assert again[ROPE] != folders[ROPE] and (again[ROPE] / PREPROCESS_FILE).is_file()
    assert again[APE] == folders[APE]


def test_a_worker_reads_a_prepared_model_without_timm(
    sources: tuple[Path, dict[str, Path]], tmp_path: Path
) -> None:
    """What a study worker does with a prepared model (load it, read its images, run a stage)
    never imports timm: the 0.2 GB a worker saves (issue 47)."""
    import subprocess
    import sys

    from poslens.study.config import Pretrained
    from poslens.study.prepared import prepare

    images, weights = sources
    pretrained = (Pretrained(ROPE, f"timm:{ROPE}", str(weights[ROPE])),)
    (folder,) = prepare(tmp_path, pretrained, str(images)).values()
    script = f"""
import sys
sys.modules["timm"] = None  # any import of timm now fails
import torch
from poslens.study.stages import Source
src = Source(spec="timm:{ROPE}", weights={str(weights[ROPE])!r}, images={str(images)!r},
             edit="heads_axis_split", prepared=__import__("pathlib").Path({str(folder)!r}))
model, task = src.load("cpu")
x, y = task.split("test")
with torch.no_grad():
    print(tuple(model(x[:2]).shape), src.not_applied)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["(2,", "5)", "None"]


def test_study_workers_load_the_prepared_models_and_never_convert(
    sources: tuple[Path, dict[str, Path]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every run of a pretrained study reads the model its parent converted into
    OUT/converted/: converting in a run (study.stages.converted) would fail this study."""
    from poslens.study import stages

    def no_conversion(*args: object) -> None:
        raise AssertionError("a run converted its pretrained model again")

    monkeypatch.setattr(stages, "converted", no_conversion)
    cfg = _cfg(*sources, seeds=1, experiments=("depth_profile",), only=(), in_situ=False)
    res = run_study(cfg, tmp_path, progress=False, jobs=1)
    assert set(res["models"]) == {APE, ROPE}
