"""Fuzzed config files through the CLI (issue 51): malformed TOML run configs (`poslens train
--config`) and checkpoint config.json files (`poslens info`) end in exit 2 with one line naming
the problem, or are accepted; never a traceback. In-process through poslens.cli.main, with
training itself replaced by a stub (a config that parses is all these tests need to know)."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poslens.cli import main
from poslens.data import DataConfig
from poslens.models import ModelConfig, build_model
from poslens.training.config import TrainConfig
from poslens.training.train import train as _  # noqa: F401  (the module the stub replaces in)
from tests.conftest import TINY

FIELDS = {
    "model": [f.name for f in dataclasses.fields(ModelConfig)],
    "data": [f.name for f in dataclasses.fields(DataConfig)],
    "train": [f.name for f in dataclasses.fields(TrainConfig)],
}

scalars = st.one_of(
    st.integers(-(2**70), 2**70),
    st.integers(-3, 300),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(max_size=6),
    st.sampled_from(["ape", "rope_axial", "relation", "folder", "cls", "auto", "fp32", "hub"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=2)
    ),
    max_leaves=6,
)


@st.composite
def sections(draw: st.DrawFn, name: str) -> Any:
    """A section: usually a table of real and unknown field names, sometimes not a table."""
    keys = draw(st.lists(st.sampled_from([*FIELDS[name], "bogus"]), unique=True, max_size=4))
    table = {k: draw(values) for k in keys}
    return draw(st.one_of(st.just(table), values))


@st.composite
def documents(draw: st.DrawFn) -> dict[str, Any]:
    names = draw(st.lists(st.sampled_from([*FIELDS, "preset", "optimizer"]), unique=True))
    doc = {}
    for name in names:
        doc[name] = draw(sections(name) if name in FIELDS else values)
    return doc


def toml(value: Any) -> str:
    """A value as TOML text (inline tables and arrays)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return (
            "nan"
            if math.isnan(value)
            else ("inf" if value > 0 else "-inf")
            if math.isinf(value)
            else repr(value)
        )
    if isinstance(value, int | str):
        return json.dumps(value) if isinstance(value, str) else str(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml(v) for v in value) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {toml(v)}" for k, v in value.items()) + "}"


class Reached(Exception):
    """Raised by the training stub: the config parsed and training would start."""


def _one_line_or_accepted(code: int, err: str, accepted: int) -> None:
    if code == accepted:
        return
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("poslens: error:"), err
    assert "Traceback" not in err


def test_toml_run_configs_fail_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def stub(*args: object, **kwargs: object) -> None:
        raise Reached

    monkeypatch.setattr(sys.modules["poslens.training.train"], "train", stub)
    path, out = tmp_path / "run.toml", str(tmp_path / "out")
    # the cases of issue 51 first: a section that is not a table, a preset that is not a name
    for text, fragment in (
        ("model = 5", "[model] must be a table of fields, got int 5"),
        ("train = [1, 2]", "[train] must be a table"),
        ('data = "x"', "[data] must be a table"),
        ("model = false", "[model] must be a table"),
        ("preset = 3", "preset in"),
    ):
        path.write_text(text)
        assert main(["train", "--config", str(path), "--out", out, "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and fragment in err, err

    @settings(max_examples=150, deadline=None)
    @given(documents())
    def check(doc: dict[str, Any]) -> None:
        path.write_text("".join(f"{json.dumps(k)} = {toml(v)}\n" for k, v in doc.items()))
        try:
            code = main(["train", "--config", str(path), "--out", out, "--no-progress"])
        except Reached:
            code = 0
        _one_line_or_accepted(code, capsys.readouterr().err, 0)

    check()


def test_checkpoint_config_json_fails_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """config.json beside real weights, its sections and fields replaced by fuzzed values."""
    from poslens.io import save_tensors

    ck = tmp_path / "ck"
    cfg = ModelConfig(**TINY)  # type: ignore[arg-type]
    save_tensors(ck / "model.safetensors", build_model(cfg).state_dict())
    good = {
        "model": cfg.to_dict(),
        "data": dataclasses.asdict(DataConfig(image_size=16, object_scale=0.32)),
    }

    @settings(max_examples=150, deadline=None)
    @given(
        st.one_of(
            documents(),
            st.builds(
                lambda f, v: {**good, "model": {**good["model"], f: v}},
                st.sampled_from(FIELDS["model"]),
                values,
            ),
        )
    )
    def check(doc: dict[str, Any]) -> None:
        try:
            text = json.dumps(doc)
        except ValueError:
            return
        (ck / "config.json").write_text(text)
        _one_line_or_accepted(main(["info", str(ck)]), capsys.readouterr().err, 0)

    check()
