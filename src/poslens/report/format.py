"""Plain-text formatting both reports share: numbers, values, durations, slugs."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from poslens.study.verdicts import VERDICTS

NONE = "—"  # shown for null / absent values
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MAX_LIST = 12  # longer lists are cut in cells, with the count shown


def fmt_num(x: float | int) -> str:
    """Three significant digits, no exponent between 1e-3 and 1e6, trailing zeros dropped."""
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if not math.isfinite(x):
        return str(x)
    if x == 0:
        return "0"
    mag = abs(x)
    if mag < 1e-3 or mag >= 1e6:
        return f"{x:.3g}"
    decimals = max(0, 2 - math.floor(math.log10(mag)))
    text = f"{round(x, decimals):.{decimals}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def fmt_value(v: Any) -> str:
    """Any JSON value as one short line of text (null as a dash, lists joined, dicts as JSON)."""
    if v is None:
        return NONE
    if isinstance(v, bool | int | float):
        return fmt_num(v)
    if isinstance(v, str):
        return v
    if isinstance(v, list | tuple):
        items = [fmt_value(i) for i in v[:MAX_LIST]]
        if len(v) > MAX_LIST:
            items.append(f"… ({len(v)} in all)")
        return ", ".join(items)
    return json.dumps(v, sort_keys=True)


def fmt_duration(seconds: float | None) -> str:
    """Wall time for people: '42 s', '18 min 20 s', '2 h 05 min'."""
    if seconds is None or not math.isfinite(seconds):
        return NONE
    s = round(seconds)
    if s < 60:
        return f"{fmt_num(seconds)} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {(s % 3600) // 60:02d} min"


def slug(text: str) -> str:
    """A string safe inside an HTML id or URL fragment (letters, digits, '-', '_')."""
    return re.sub(r"[^A-Za-z0-9_-]+", "-", str(text)).strip("-") or "x"


def verdict_class(verdict: str | None) -> str:
    """CSS class suffix for a verdict; unknown verdicts get a neutral one."""
    return slug(verdict) if verdict in VERDICTS else "other"
