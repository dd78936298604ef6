"""The optional timm import, shared by model conversion and pretrained preprocessing."""

from __future__ import annotations

from typing import Any

from poslens.errors import UserError


def import_timm() -> Any:
    """The timm module, or a one-line UserError saying how to install it."""
    try:
        import timm
    except ImportError:
        raise UserError(
            "timm: model specs need the timm package (pip install 'poslens[timm]')"
        ) from None
    return timm
