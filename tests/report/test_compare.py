"""`poslens compare` on synthetic study folders: the side-by-side table in the terminal, Markdown
and HTML, the agreement per level, fields only newer runs have, and one-line refusals."""

from __future__ import annotations

import base64
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from poslens.cli import main
from poslens.report.compare import AGREE, DIFFER, levels, load_runs
from poslens.study.schema import SCHEMA
from tests.report.synthetic import EVIL, make_valid_study


def write(folder: Path, results: dict[str, Any]) -> Path:
    (folder / "results.json").write_text(json.dumps(results))
    return folder


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Run a (synthetic, schema-valid) and run b: its copy with the first level's verdict changed,
    a new effect on the second, and the power and replication records newer runs carry."""
    a = tmp_path_factory.mktemp("runs") / "laptop"
    a.mkdir()
    results = make_valid_study(a)
    write(a, results)
    b = a.parent / "gpu"
    shutil.copytree(a, b)
    edited = json.loads(json.dumps(results))
    first, second = edited["claims"][0], edited["claims"][1]
    assert first["verdict"] != "not supported"
    first["verdict"], first["qualifier"] = "not supported", None
    model = next(iter(second["primary"]["models"]))
    second["primary"]["models"][model] |= {"mean": 0.73, "lower": 0.61, "upper": 0.85}
    second["qualifier"] = "fragile"
    second["power"] = {"mde": 0.125, "seeds": 5, "seeds_needed": 9, "text": "needs 9 seeds"}
    # the parts a fragile verdict turns on: two below the stable share (least first in the
    # output), one above it, and a malformed entry an older or edited file might hold
    parts = [{"model": model, "role": "study", "observed": "detected", "share": 0.97},
             {"model": "ctl_b", "role": "negative", "observed": "not detected", "share": 0.81},
             {"model": "ctl_a", "role": "positive", "observed": "detected", "share": 0.55},
             {"model": "broken"}]  # fmt: skip
    second["replication"] = {"probability": 0.64, "stable": False, "seeds_for_stable": 12,
                             "threshold": 0.9, "parts": parts,
                             "text": "a rerun agrees 64% of the time"}  # fmt: skip
    write(b, edited)
    return a, b


def test_levels_agree_or_differ_by_verdict(pair: tuple[Path, Path]) -> None:
    runs = load_runs([str(p) for p in pair])
    assert [r.label for r in runs] == ["laptop", "gpu"]
    rows = levels(runs)
    assert len(rows) == len(runs[0].results["claims"])
    # the second level reads fragile in run b only: the same verdict word, another verdict
    assert [lv.agreement for lv in rows] == [DIFFER, DIFFER, AGREE]
    # a run that lacks a level differs from one that has it
    short = dict(runs[1].results) | {"claims": runs[1].results["claims"][1:]}
    runs[1] = type(runs[1])(runs[1].name, runs[1].folder, short, "gpu")
    assert levels(runs)[0].agreement == DIFFER and levels(runs)[0].cells[1] is None


def test_terminal_markdown_and_html(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = pair
    md, page = tmp_path / "notes" / "cmp.md", tmp_path / "cmp.html"
    assert main(["compare", str(a), str(b), "--md", str(md), "--html", str(page)]) == 0
    out = capsys.readouterr().out
    claims = json.loads((a / "results.json").read_text())["claims"]
    for text in ("laptop", "gpu", "differ", "agree", "0.73 [0.61, 0.85]", "MDE 0.125"):
        assert text in out
    assert all(cl["claim"] in out for cl in claims)  # every level of both runs is printed
    assert "the runs agree on 1 of 3 claim levels' verdicts" in out
    assert "(fragile)" in out  # the qualifier newer runs may give, shown with the verdict
    # what the fragile verdict turns on, least stable first; the stable part is not named
    assert "least stable: positive ctl_a 55%; negative ctl_b 81%" in out
    assert out.count("least stable:") == 1

    text = md.read_text()
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(claims)  # the header and one row per level
    first = table[1].split(" | ")
    assert first[-1].rstrip(" |") == "differ" and "not supported" in first
    second = table[2]
    assert "0.125" in second and "0.64" in second and second.endswith("| differ |")
    assert "| positive ctl_a 55%; negative ctl_b 81% | differ |" in second
    assert "| - | - | - |" in table[3]  # neither run has power or replication there: dashes
    # the figures are linked relative to the Markdown file
    link = os.path.relpath(a.resolve() / "figures" / "claims.png", md.parent.resolve())
    assert f"![laptop: claims at a glance]({link})" in text

    html = page.read_text()
    assert "Content-Security-Policy" in html and "<script>" not in html
    assert EVIL not in html  # text from results.json is escaped
    png = base64.b64encode((a / "figures" / "claims.png").read_bytes()).decode("ascii")
    assert html.count(f"data:image/png;base64,{png}") == 2  # each run's own (identical) figure
    assert html.count('class="agreement">differ<') == 2
    assert html.count('class="agreement">agree<') == 1
    assert html.count("least stable: positive ctl_a 55%; negative ctl_b 81%") == 1


def test_out_writes_both_files_and_a_missing_figure_is_noted(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = pair
    c = tmp_path / "nofig"
    shutil.copytree(b, c)
    (c / "figures" / "claims.png").unlink()
    assert main(["compare", str(a), str(b), str(c), "--out", str(tmp_path / "cmp")]) == 0
    html = (tmp_path / "cmp" / "compare.html").read_text()
    assert "figure missing: figures/claims.png (file not found)" in html
    assert (tmp_path / "cmp" / "compare.md").read_text().count("claims at a glance") == 3
    assert "| differ |" in (tmp_path / "cmp" / "compare.md").read_text()


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("one run", "compare needs at least two study folders, got 1"),
        ("not a folder", "is not a folder"),
        ("no results", "is not a study folder: it has no results.json"),
        ("bad json", "not valid JSON"),
        (
            "other schema",
            "other has results schema 'poslens.ladder/1', ",
        ),
        ("other schema", "laptop 'poslens.study/2': compare takes runs of one schema"),
        ("both foreign", "compare reads study results (poslens.study/2)"),
        ("no claims", "has no list of claims"),
    ],
)
def test_bad_runs_are_one_line_errors(
    pair: tuple[Path, Path], case: str, message: str, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    a, _ = pair
    other = tmp_path / "other"
    other.mkdir()
    results = json.loads((a / "results.json").read_text())
    runs = [str(a), str(other)]
    if case == "one run":
        runs = [str(a)]
    elif case == "not a folder":
        runs[1] = str(tmp_path / "nowhere")
    elif case == "bad json":
        (other / "results.json").write_text("{not json")
    elif case == "other schema":
        write(other, results | {"schema": "poslens.ladder/1"})
    elif case == "both foreign":
        write(other, results | {"schema": "poslens.ladder/1"})
        runs = [str(other), str(other)]
    elif case == "no claims":
        write(other, results | {"claims": {"not": "a list"}})
    assert main(["compare", *runs, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_the_schema_constant_is_the_studys() -> None:
    assert (
        SCHEMA
        == json.loads((Path(__file__).parents[2] / "src/poslens/study/schema.json").read_text())[
            "properties"
        ]["schema"]["const"]
    )
