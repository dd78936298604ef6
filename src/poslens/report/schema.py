"""Check results.json against its JSON schema (poslens/study/schema.json) without extra packages.

Supports the keywords the schemas use: $ref to #/$defs, allOf, type, const, enum, required,
properties, additionalProperties, items, minItems, minimum and pattern. The first violation is
reported as one line naming its key path, so a hand-edited or foreign results.json is refused
before the report renders it.
"""

from __future__ import annotations

import json
import re
from functools import cache
from importlib import resources
from typing import Any

from poslens.errors import UserError
from poslens.report.ladder import SCHEMA as LADDER_SCHEMA
from poslens.study.schema import SCHEMA

_TYPES: dict[str, Any] = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "null": type(None),
}


# results.json schemas by their `schema` value: a study's, and a ladder's (`--preset ladder`)
SCHEMA_FILES = {SCHEMA: "schema.json", LADDER_SCHEMA: "ladder_schema.json"}


@cache
def results_schema(name: str = SCHEMA) -> dict[str, Any]:
    """A results.json schema shipped with poslens (a study's by default)."""
    text = resources.files("poslens.study").joinpath(SCHEMA_FILES[name]).read_text()
    schema: dict[str, Any] = json.loads(text)
    return schema


def _is(value: Any, kind: str) -> bool:
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer()
        )
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, _TYPES[kind])


def _kind(value: Any) -> str:
    for name in ("null", "boolean", "integer", "number", "string", "array", "object"):
        if _is(value, name):
            return name
    return type(value).__name__


def schema_error(
    value: Any, schema: dict[str, Any], root: dict[str, Any], at: str = ""
) -> str | None:
    """The first place where `value` breaks `schema`, as 'KEY.PATH: what is wrong'; else None."""
    where = at or "the document"
    if "$ref" in schema:
        ref = schema["$ref"]
        if not ref.startswith("#/$defs/"):
            raise ValueError(f"unsupported $ref {ref}")
        return schema_error(value, root["$defs"][ref[len("#/$defs/") :]], root, at)
    for sub in schema.get("allOf", []):
        err = schema_error(value, sub, root, at)
        if err is not None:
            return err
    if "const" in schema and value != schema["const"]:
        return f"{where} must be {schema['const']!r}, got {_short(value)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where} must be one of {', '.join(map(str, schema['enum']))}, got {_short(value)}"
    if "type" in schema:
        kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_is(value, k) for k in kinds):
            return f"{where} must be {' or '.join(kinds)}, got {_kind(value)}"
    if isinstance(value, dict):
        for key in schema.get("required", []):
            if key not in value:
                return f"{where} lacks the required key {key!r}"
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for key, sub in value.items():
            path = f"{at}.{key}" if at else str(key)
            if key in props:
                err = schema_error(sub, props[key], root, path)
            elif extra is False:
                err = f"{path} is not a known key"
            elif isinstance(extra, dict):
                err = schema_error(sub, extra, root, path)
            else:
                err = None
            if err is not None:
                return err
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            return f"{where} needs at least {schema['minItems']} items, got {len(value)}"
        if "items" in schema:
            for i, item in enumerate(value):
                err = schema_error(item, schema["items"], root, f"{at}[{i}]")
                if err is not None:
                    return err
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    if is_number and "minimum" in schema and value < schema["minimum"]:
        return f"{where} must be at least {schema['minimum']}, got {value}"
    if isinstance(value, str) and "pattern" in schema and not re.search(schema["pattern"], value):
        return f"{where} must match {schema['pattern']}, got {_short(value)}"
    return None


def check_results(results: Any, source: str = "results.json") -> None:
    """UserError naming the first schema violation of a results document (checked against the
    schema it names, a study's where it names none that poslens knows)."""
    name = results.get("schema") if isinstance(results, dict) else None
    schema = results_schema(name if name in SCHEMA_FILES else SCHEMA)
    err = schema_error(results, schema, schema)
    if err is not None:
        raise UserError(f"{source} does not follow the results schema {schema['$id']}: {err}")


def _short(value: Any, limit: int = 40) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
