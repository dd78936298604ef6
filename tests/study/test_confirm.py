"""The confirmation: the default's design (every level's fingerprint equal) on a block of seeds no
exploratory run trained, its own accuracy-gate reserves included; run in blocks that `poslens
merge` joins into the study over all their seeds, with every stage reused."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest

from poslens.cli import main
from poslens.errors import UserError
from poslens.study import run_study
from poslens.study.claims import RULES
from poslens.study.config import (
    CALIBRATION_MODELS,
    CONFIRM_SEEDS,
    CONFIRM_START,
    EXPLORED_SEEDS,
    STUDY_MODELS,
    preset,
)
from poslens.study.gate import reserve_seed
from poslens.study.judge import level_fingerprint
from poslens.study.merge import merge_blocks, merge_results, merged_config
from poslens.study.preregistration import slim
from tests.study.test_study import TINY_STUDY


def trained(seeds: range, retries: int) -> set[int]:
    """Every training seed a study of these seeds may use: its own and its gate's reserves."""
    return {reserve_seed(s, a) for s in seeds for a in range(retries + 1)}


def test_the_confirmation_is_the_defaults_design_on_fresh_seeds() -> None:
    default, confirm = preset("default"), preset("confirm")
    assert {r.id: level_fingerprint(r, confirm) for r in RULES} == {
        r.id: level_fingerprint(r, default) for r in RULES
    }
    assert set(confirm.models) == {*STUDY_MODELS, *CALIBRATION_MODELS}  # every control trained
    block = range(CONFIRM_START, CONFIRM_START + CONFIRM_SEEDS)
    explored = trained(EXPLORED_SEEDS, default.gate_retries)
    assert not trained(block, confirm.gate_retries) & explored
    assert block.stop <= 1000  # study seeds stay below the reserves (limits.COUNTS["seeds"])
    # a block of it, as `--seeds 105-109` runs one: the same design again
    part = preset("confirm", seed_start=105, seeds=5)
    assert level_fingerprint(RULES[0], part) == level_fingerprint(RULES[0], default)


def _block(tmp: Path, start: int) -> Path:
    out = tmp / f"block{start}"
    cfg = replace(TINY_STUDY, seeds=1, seed_start=start, experiments=("depth_profile",))
    run_study(cfg, out, progress=False)
    return out


def test_blocks_merge_into_the_study_over_all_their_seeds(tmp_path: Path) -> None:
    a, b = _block(tmp_path, 0), _block(tmp_path, 1)
    out = tmp_path / "merged"
    cfg = merge_blocks([b, a], out)
    assert (cfg.seed_start, cfg.seeds) == (0, 2)
    start = time.perf_counter()
    merged = run_study(cfg, out, progress=False)
    assert time.perf_counter() - start < 60  # nothing trained or analysed again
    whole = run_study(replace(TINY_STUDY, seeds=2, experiments=("depth_profile",)),
                      tmp_path / "whole", progress=False)  # fmt: skip
    for model in ("ape", "rope_axial"):
        got = [
            r["experiments"]["depth_profile"]["headline"] for r in merged["models"][model]["runs"]
        ]
        want = [
            r["experiments"]["depth_profile"]["headline"] for r in whole["models"][model]["runs"]
        ]
        assert got == want
    assert [c["verdict"] for c in merged["claims"]] == [c["verdict"] for c in whole["claims"]]
    # the command: a second merge into the same folder reuses it and says what it merged
    assert main(["merge", str(a), str(b), "--out", str(out), "--no-progress"]) == 0
    assert json.loads((out / "results.json").read_text())["config"]["seeds"] == 2
    # blocks kept as results alone (committed, slimmed, from other sessions): the same numbers
    kept = [(str(p), slim(json.loads((p / "results.json").read_text()))) for p in (b, a)]
    joined = merge_results(kept)
    assert (joined["config"]["seed_start"], joined["config"]["seeds"]) == (0, 2)
    for model, entry in joined["models"].items():  # the numbers the rules read, kept by slim
        for exp, keyed in entry["aggregate"].items():
            for k, stats in keyed.items():
                assert merged["models"][model]["aggregate"][exp][k]["values"] == stats["values"]
    assert [c["verdict"] for c in joined["claims"]] == [c["verdict"] for c in merged["claims"]]
    files = []
    for p, results in kept:
        files.append(tmp_path / f"{Path(p).name}.json")
        files[-1].write_text(json.dumps(results))
    assert main(["merge", *map(str, files), "--out", str(tmp_path / "from_results")]) == 0
    assert (tmp_path / "from_results" / "report.html").is_file()


def test_blocks_that_are_not_one_study_are_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = _block(tmp_path, 0)
    cfg = json.loads((a / "results.json").read_text())["config"]
    # a second block on the same seed, one leaving a gap, one of another study
    overlap, gap, other = (tmp_path / n for n in ("overlap", "gap", "other"))
    for folder, change in ((overlap, {}), (gap, {"seed_start": 2}), (other, {"n_images": 40})):
        folder.mkdir()
        (folder / "results.json").write_text(json.dumps({"config": cfg | change}))
    for blocks, why in (([a, overlap], "share seeds 0-0"), ([a, gap], "seeds 1-1 lie between"),
                        ([a, other], "its n_images differ"),
                        ([a, tmp_path / "none"], "holds no results.json")):  # fmt: skip
        with pytest.raises(UserError, match=why):
            merge_blocks(blocks, tmp_path / "out")
        assert not (tmp_path / "out").exists()
    assert main(["merge", str(a), str(gap), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lie between" in err and not (tmp_path / "out").exists()
    with pytest.raises(UserError, match="is one of the blocks"):
        merge_blocks([a], a)
    assert merged_config([(a, replace(TINY_STUDY, seeds=3))]).seeds == 3
