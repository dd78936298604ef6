"""The schema name is defined once in study/schema.py: schema.json's `$id` and its `schema`
constant must name the same schema, or a results.json the study writes would be refused."""

from __future__ import annotations

import json
from importlib import resources

from poslens.study.schema import SCHEMA


def test_schema_json_names_the_schema_the_study_writes() -> None:
    schema = json.loads(resources.files("poslens.study").joinpath("schema.json").read_text())
    assert schema["$id"] == SCHEMA
    assert schema["properties"]["schema"]["const"] == SCHEMA
