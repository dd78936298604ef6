"""report.html and report.md from a synthetic study folder with real PNG figures."""

from __future__ import annotations

import base64
import re
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from poslens.report import render_html, render_markdown, write_report
from poslens.report.__main__ import main as report_main
from poslens.report.common import (
    claim_rows,
    claims_of,
    fmt_duration,
    fmt_num,
    order_keys,
    verdict_label,
)
from tests.report.synthetic import MISSING_PNG, make_study, make_valid_study


class Page(HTMLParser):
    """Collects what the tests look at: ids in document order, img srcs, every src/href, and the
    text of each verdict badge."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.ids: list[str] = []
        self.imgs: list[str] = []
        self.urls: list[str] = []
        self.tags: list[str] = []
        self.badges: list[tuple[str, str]] = []
        self._badge: str | None = None
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self.tags.append(tag)
        if a.get("id"):
            self.ids.append(a["id"] or "")
        for key in ("src", "href"):
            if a.get(key) is not None:
                self.urls.append(a[key] or "")
        if tag == "img":
            self.imgs.append(a.get("src") or "")
        cls = a.get("class") or ""
        if "verdict" in cls.split():
            self._badge = cls

    def handle_data(self, data: str) -> None:
        if self._badge is not None:
            self.badges.append((self._badge, data))
            self._badge = None


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """One synthetic study folder (figures drawn once for the module)."""
    out = tmp_path_factory.mktemp("study")
    return out, make_study(out)


def section(html: str, sid: str) -> str:
    """The HTML of one <section id=sid>."""
    m = re.search(rf'<section id="{re.escape(sid)}">(.*?)</section>', html, re.S)
    assert m, f"no section {sid}"
    return m.group(1)


def test_numbers_have_three_significant_digits() -> None:
    cases = {
        0.99123: "0.991",
        0.5: "0.5",
        1100.0: "1100",
        150.24: "150",
        12.345: "12.3",
        0.000123: "0.000123",
        -0.0456: "-0.0456",
        1234567.0: "1.23e+06",
        0.0: "0",
        1200: "1200",
        True: "yes",
    }
    assert {x: fmt_num(x) for x in cases} == cases
    assert fmt_duration(1100.0) == "18 min 20 s"
    assert fmt_duration(42.0) == "42 s"
    assert fmt_duration(7300) == "2 h 01 min"


def test_chance_rows_follow_their_metric_and_no_key_is_lost() -> None:
    keys = [
        "acc_chance",
        "x",
        "chance_acc",
        "acc",
        "acc_chance_chance",
        "y_chance",
        "s.b_chance",
        "s.b",
    ]
    out = order_keys(keys)
    assert sorted(out) == sorted(keys)
    assert out == [
        "x",
        "acc",
        "acc_chance",
        "acc_chance_chance",
        "chance_acc",
        "y_chance",
        "s.b",
        "s.b_chance",
    ]
    # the study's own naming: chance_<target> beside probe_<target> (the shortest key ending so)
    keys = ["accuracy", "chance_col", "chance_row", "control_probe_col", "probe_col", "probe_row"]
    assert order_keys(keys) == [
        "accuracy",
        "control_probe_col",
        "probe_col",
        "chance_col",
        "probe_row",
        "chance_row",
    ]


def test_html_is_self_contained(study: tuple[Path, dict[str, Any]]) -> None:
    out, results = study
    html = render_html(results, out)
    page = Page(html)
    assert 'src="http' not in html and "<link" not in html
    assert "script" not in page.tags, "the report must run no scripts"
    assert "@import" not in html and "url(" not in html
    for url in page.urls:  # only embedded images, in-page anchors and files next to the page
        assert url.startswith(("data:image/png;base64,", "#")) or not re.match(
            r"^[a-z]+:|//", url
        ), url
    assert "Content-Security-Policy" in html and "default-src 'none'" in html


def test_every_figure_is_embedded_as_its_png(study: tuple[Path, dict[str, Any]]) -> None:
    out, results = study
    page = Page(render_html(results, out))
    embedded = [base64.b64decode(s.split(",", 1)[1]) for s in page.imgs]
    present = [f for f in results["figures"] if f["png"] != MISSING_PNG]
    assert len(embedded) == len(present)
    for fig in present:
        assert (out / fig["png"]).read_bytes() in embedded, fig["png"]


def test_text_from_results_is_escaped(study: tuple[Path, dict[str, Any]]) -> None:
    out, results = study
    html = render_html(results, out)
    assert "<script>" not in html and "<b>bold?</b>" not in html
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; | pipe" in html
    md = render_markdown(results, out)
    assert "<script>" not in md and "<b>" not in md
    assert "&lt;script&gt;alert('x')&lt;/script&gt; &amp; \\| pipe" in md  # the table cell


def test_sections_come_in_order_with_every_verdict(study: tuple[Path, dict[str, Any]]) -> None:
    out, results = study
    page = Page(render_html(results, out))
    order = ["claims", "setup", *(f"exp-{e}" for e in results["config"]["experiments"]), "timings"]
    positions = [page.ids.index(i) for i in order]
    assert positions == sorted(positions)
    claims = section(render_html(results, out), "claims")
    for cl in results["claims"]:
        assert f'id="claim-{cl["id"]}"' in claims
    slug = {
        "supported": "supported",
        "not supported": "not-supported",
        "inconclusive": "inconclusive",
    }
    for cl in claims_of(results):
        # badge colour class and its visible text (the verdict, with its qualifier where it has
        # one) agree, in the table and in the claim's details
        assert page.badges.count((f"verdict v-{slug[cl.verdict]}", verdict_label(cl))) == 2


def test_claims_open_with_the_claims_figure_and_two_levels(
    study: tuple[Path, dict[str, Any]],
) -> None:
    """The claims-at-a-glance figure is the first thing in the Claims section (before the
    table), never an experiment section of its own; a claim's title heads its first level only."""
    out, results = study
    html = render_html(results, out)
    claims = section(html, "claims")
    assert claims.index("<img") < claims.index('<table class="claims"')
    assert "Claims at a glance" in claims and 'id="exp-claims"' not in html
    md = render_markdown(results, out)
    assert md.index("](figures/claims.png)") < md.index("| Claim | Level |")
    two = [dict(results["claims"][0], claim="x", level="original",
                level_name="the original's observation"),
           dict(results["claims"][0], claim="x", id="x.sharper", level="sharper",
                level_name="the sharper test", statement="what the model uses")]  # fmt: skip
    rows = claim_rows(claims_of({"claims": two}))
    assert rows[0][1][0] == two[0]["title"] and rows[1][1][0] == ""
    assert rows[1][1][1] == "the sharper test: what the model uses"


def test_headline_tables_show_mean_se_and_seeds(study: tuple[Path, dict[str, Any]]) -> None:
    out, results = study
    html = render_html(results, out)
    depth = section(html, "exp-depth_profile")
    assert "0.991 ± 0.001 (2 seeds)" in depth and "0.975 ± 0.001 (2 seeds)" in depth
    assert '<small class="seeds">0.99, 0.992</small>' in depth
    rows = re.findall(r"<tr[^>]*><th>([^<]+)</th>", depth.split("<tbody>", 1)[1])
    assert rows == [  # key order (whatever order the dicts hold), each chance row after its metric
        "accuracy",
        "by_site.block0",
        "by_site.out",
        "probe_acc_row",
        "probe_acc_row_chance",
        "ssdc_rpi_out",
    ]
    assert '<tr class="chance"><th>probe_acc_row_chance</th>' in depth
    # an experiment only some models ran has only their column; its skip reason is shown
    axis = section(html, "exp-axis_map")
    assert "<th>rope_axial</th>" in axis and "<th>ape</th>" not in axis
    assert "model has no rotary encoding (all seeds)" in axis
    # no aggregate: per-seed values, never an invented mean
    removal = section(html, "exp-position_removal")
    assert "no aggregate (2 runs)" in removal and "seed 0: 0.42; seed 1: 0.42" in removal
    setup = section(html, "setup")
    train = setup[setup.index('<table class="training">') :]
    head = re.findall(r"<th>([^<]*)</th>", train.split("</thead>")[0])
    known = ["Test acc", "Val acc", "Train acc", "Chance", "Steps", "Steps to 90%", "Train time"]
    assert head == ["Model", "Seed", *known, "lr_final", "Checkpoint"]
    row = re.findall(r"<td[^>]*>([^<]*)</td>", train.split("<tr>")[3])  # ape, seed 1
    assert row == [
        "ape",
        "1",
        "0.992",
        "0.982",
        "1",
        "0.5",
        "1200",
        "—",
        "150 s",
        "—",
        "checkpoints/ape_s1_ab12cd34ef56",
    ]


def test_markdown_has_claims_table_and_image_links(study: tuple[Path, dict[str, Any]]) -> None:
    out, results = study
    md = render_markdown(results, out)
    lines = md.splitlines()
    head = lines.index(
        "| Claim | Level | Verdict | The original | Summary | Measured seeds per model "
        "| Threshold, power, replication |"
    )
    assert lines[head + 1] == "|---|---|---|---|---|---|---|"
    for i, cl in enumerate(results["claims"]):
        row = lines[head + 2 + i]
        label = cl["verdict"] + (f" ({cl['qualifier']})" if cl.get("qualifier") else "")
        assert row.startswith(f"| {cl['title']} | ")
        assert f" | **{label}** | " in row
        assert row.count(" | ") == 6, "an unescaped pipe would add a column"
    assert "**inconclusive (no power)**" in md and "| rope_axial 2 of 3 |" in md
    for fig in results["figures"]:
        if fig["png"] != MISSING_PNG:
            assert f"]({fig['png']})" in md
    assert "| accuracy | 0.991 ± 0.001 (2 seeds) — 0.99, 0.992 |" in md
    assert f"**figure missing: {MISSING_PNG} (file not found)**" in md
    sections = [ln for ln in lines if ln.startswith("## ")]
    assert sections == [
        "## Claims",
        "## Calibration",
        "## Setup",
        "## depth_profile",
        "## windows",
        "## axis_map",
        "## position_removal",
        "## Timings",
    ]


def test_unreadable_figures_get_a_visible_note(tmp_path: Path) -> None:
    results = make_study(tmp_path)
    (tmp_path / "figures" / "text.png").write_text("not an image")
    results["figures"] += [
        {"title": "t", "png": "figures/text.png", "experiment": "windows", "model": None},
        {"title": "o", "png": "../outside.png", "experiment": "windows", "model": None},
        {"title": "n", "png": None, "experiment": "windows", "model": None},
    ]
    (tmp_path.parent / "outside.png").write_bytes(
        (tmp_path / results["figures"][0]["png"]).read_bytes()
    )
    html = render_html(results, tmp_path)
    assert f'<p class="missing">figure missing: {MISSING_PNG} (file not found)</p>' in html
    windows = section(html, "exp-windows")
    assert "figure missing: figures/text.png (not a PNG file)" in windows
    assert "figure missing: ../outside.png (path is outside the output folder)" in windows
    assert "figure missing:  (no PNG path given)" in windows
    assert len(Page(windows).imgs) == 2  # the two real ones only


def test_write_report_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    results = make_study(tmp_path)
    before = set(tmp_path.rglob("*"))
    paths = write_report(tmp_path, results)
    assert paths == [tmp_path / "report.html", tmp_path / "report.md"]
    assert set(tmp_path.rglob("*")) - before == set(paths), "temporary files were left behind"
    assert paths[0].read_text(encoding="utf-8") == render_html(results, tmp_path)
    assert paths[1].read_text(encoding="utf-8") == render_markdown(results, tmp_path)
    # a write that dies half-way keeps the previous report whole and leaves no temp file
    old = paths[0].read_bytes()

    def half_then_fail(self: Path, text: str, **kw: Any) -> None:
        with open(self, "w", **kw) as f:
            f.write(text[: len(text) // 2])
        raise OSError("disk full")

    monkeypatch.setattr(Path, "write_text", half_then_fail)
    results["claims"][0]["summary"] = "changed"
    from poslens.errors import OutputError

    with pytest.raises(OutputError, match="disk full"):  # one line for the user, not OSError
        write_report(tmp_path, results)
    monkeypatch.undo()
    assert paths[0].read_bytes() == old
    assert set(tmp_path.rglob("*")) - before == set(paths)


def test_rebuild_from_results_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    results = make_valid_study(tmp_path)
    (tmp_path / "results.json").write_text(json.dumps(results))
    assert report_main([str(tmp_path)]) == 0
    assert (tmp_path / "report.html").read_text(encoding="utf-8") == render_html(results, tmp_path)
    assert report_main([str(tmp_path / "nowhere")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert report_main([str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("poslens: error: results not found") and err.count("\n") == 1


def test_schema_check_agrees_with_jsonschema(tmp_path: Path) -> None:
    """The built-in checker accepts what jsonschema accepts and refuses what it refuses, on the
    valid synthetic study and on single mutations of it."""
    import copy

    jsonschema = pytest.importorskip("jsonschema")
    from poslens.report.schema import results_schema, schema_error

    schema = results_schema()
    valid = make_valid_study(tmp_path)
    mutations: list[tuple[str, Any]] = [
        ("config.seeds", "two"),
        ("config.preset", "huge"),
        ("config.models", []),
        ("schema", "poslens.study/0"),
        ("models.ape.runs.0.config_hash", "XYZ"),
        ("models.ape.runs.0.seed", -1),
        ("models.ape.aggregate.windows.window_acc.n", 1.5),
        ("claims.0.verdict", "maybe"),
        ("figures.0.model", 3),
        ("timings.stages.0.reused", "yes"),
        ("models.ape.posenc", None),
        ("environment", []),
    ]
    assert schema_error(valid, schema, schema) is None
    jsonschema.validate(valid, schema)
    for dotted, value in mutations:
        doc = copy.deepcopy(valid)
        *parents, last = dotted.split(".")
        node: Any = doc
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[int(last) if isinstance(node, list) else last] = value
        ours = schema_error(doc, schema, schema)
        assert ours is not None, dotted
        assert dotted.rsplit(".", 1)[0].split(".")[0] in ours, (dotted, ours)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(doc, schema)
    for key in ("claims", "models", "config"):
        doc = copy.deepcopy(valid)
        del doc[key]
        assert f"lacks the required key {key!r}" in str(schema_error(doc, schema, schema))


def test_empty_results_still_render(tmp_path: Path) -> None:
    html = render_html({}, tmp_path)
    assert 'id="claims"' in html and "No claims were evaluated" in html
    assert "# poslens study report" in render_markdown({})


def test_summary_says_when_stages_were_reused() -> None:
    from poslens.report.common import summary

    res = {"config": {"seeds": 1}, "timings": {"total_seconds": 3.0, "stages": [
        {"stage": "train", "reused": True}, {"stage": "depth_profile", "reused": False}]}}  # fmt: skip
    assert "(1 of 2 stages reused from an earlier run)" in summary(res, [])
    res["timings"]["stages"][0]["reused"] = False
    assert "reused" not in summary(res, [])


def _reversed_dicts(obj: Any) -> Any:
    """The same JSON value with every object's keys in reverse order."""
    if isinstance(obj, dict):
        return {k: _reversed_dicts(obj[k]) for k in reversed(list(obj))}
    if isinstance(obj, list):
        return [_reversed_dicts(v) for v in obj]
    return obj


def test_reports_do_not_depend_on_key_order(tmp_path: Path) -> None:
    """A fresh study holds its headlines in code order, a resumed one reads them back from
    key-sorted JSON, and a rebuild reads results.json: all must render byte-identical reports."""
    import json

    results = make_valid_study(tmp_path)
    variants = [
        _reversed_dicts(results),
        json.loads(json.dumps(results, sort_keys=True)),
    ]
    md, html = render_markdown(results, tmp_path), render_html(results, tmp_path)
    for other in variants:
        assert render_markdown(other, tmp_path) == md
        assert render_html(other, tmp_path) == html
    assert md.index("| probe_acc_row |") < md.index("| probe_acc_row_chance |")  # chance after
