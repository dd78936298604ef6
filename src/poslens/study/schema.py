"""The name of a study's results.json schema, defined once: the `schema` value study.run writes
and the `$id` of study/schema.json, the file the report checks results against."""

from __future__ import annotations

SCHEMA = "poslens.study/2"

__all__ = ["SCHEMA"]
