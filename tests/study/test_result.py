"""ClaimResult: judge's typed claim, written to results.json and read back once by the report."""

from __future__ import annotations

import json
from typing import Any

import pytest

from poslens.errors import UserError
from poslens.io import jsonable
from poslens.report import render_markdown
from poslens.study.judge import evaluate_claims
from poslens.study.result import REQUIRED, ClaimResult, claims_of
from tests.study.test_claims import SEEDS, calibrated, models, removal


def _written(claims: list[ClaimResult]) -> list[dict[str, Any]]:
    """The claims as results.json holds them (NaN as null, tuples as lists, via JSON)."""
    return json.loads(json.dumps(jsonable([c.to_dict() for c in claims])))


@pytest.mark.parametrize("few_seeds", [False, True])
def test_a_written_claim_reads_back_and_writes_the_same(few_seeds: bool) -> None:
    """Every level, decided (calibrated numbers) or inconclusive with NaN bounds (one seed):
    from_dict(to_dict) is the same value, and to_dict(from_dict) the same JSON, key for key."""
    ms = models(ape=removal(0.95, 0.25, n=1)) if few_seeds else calibrated()
    written = _written(evaluate_claims(ms))
    assert len(written) > 1
    for d in written:
        c = ClaimResult.from_dict(d)
        assert c.to_dict() == d and list(c.to_dict()) == list(d)
        assert ClaimResult.from_dict(c.to_dict()) == c
    if few_seeds:  # the NaN bounds came back as null, and read as None
        matters = next(c for c in claims_of({"claims": written}) if c.primary.models)
        assert next(iter(matters.primary.models.values())).lower is None


def test_key_order_is_the_one_results_json_has_always_had() -> None:
    c = evaluate_claims(calibrated())[0].to_dict()
    assert list(c) == [
        "id", "claim", "level", "level_name", "title", "statement", "verdict", "qualifier",
        "summary", "scale", "evidence", "notes", "controls", "caveats", "models", "seeds",
        "measured", "threshold_source", "power", "replication", "primary", "calibration",
        "would_change", "reference",
    ]  # fmt: skip
    row = c["calibration"]["controls"][0]
    assert list(row) == ["model", "role", "design", "test", "detected", "enough_seeds",
                         "measured", "degenerate", "not_measured", "seeds_above_threshold",
                         "as_designed"]  # fmt: skip
    assert list(row["test"]) == ["n", "seeds", "mean", "ci", "lower", "upper", "p", "p_holm",
                                 "values", "missing", "gate", "detected"]  # fmt: skip
    assert row["test"]["n"] == SEEDS


@pytest.mark.parametrize("key", REQUIRED)
def test_a_claim_missing_a_required_key_is_one_line_naming_it(key: str) -> None:
    d = _written(evaluate_claims(calibrated()))[0]
    del d[key]
    with pytest.raises(UserError) as e:
        claims_of({"claims": [d]})
    msg = str(e.value)
    assert f"lacks the required key {key!r}" in msg and "\n" not in msg
    assert ("claim 0" if key == "id" else repr(d["id"])) in msg


def test_a_nested_missing_key_names_its_path() -> None:
    d = _written(evaluate_claims(calibrated()))[0]
    del d["calibration"]["controls"][1]["test"]["values"]
    with pytest.raises(UserError, match=r"calibration\.controls\[1\]\.test lacks the required "
                                        "key 'values'"):  # fmt: skip
        ClaimResult.from_dict(d)
    with pytest.raises(UserError, match="primary is not a JSON object"):
        ClaimResult.from_dict(_written(evaluate_claims(calibrated()))[0] | {"primary": [1]})


def test_older_claims_without_the_optional_keys_read_and_render() -> None:
    """Results written before thresholds named their source, before power, replication and
    qualifiers: parsed with those as None, left out (or null) again, and the report renders."""
    d = _written(evaluate_claims(calibrated()))[0]
    old = {k: v for k, v in d.items()
           if k not in ("threshold_source", "power", "replication", "qualifier")}  # fmt: skip
    c = ClaimResult.from_dict(old)
    assert c.threshold_source is None and c.power is None and c.qualifier is None
    assert "threshold_source" not in c.to_dict()
    assert c.to_dict() == old | {"qualifier": None, "power": None, "replication": None}
    md = render_markdown({"claims": [old]})
    assert "Threshold, power and replication" in md and c.title in md
