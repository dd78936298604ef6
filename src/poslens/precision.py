"""Forward-pass precision: bf16 / fp16 under torch.autocast, or plain float32.

One place for training (`train.precision`, "auto" picks bf16 where it is native) and analysis
(`analysis.precision`); fp32 adds no context at all, so fp32 results are the plain model's.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from poslens.errors import UserError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def native_bf16(device: torch.device) -> bool:
    """True when bf16 matmuls run natively (AMX/AVX512-BF16 on CPU, Ampere+ on CUDA)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_precision(precision: str, device: torch.device) -> str:
    """ "auto" -> bf16 where the device runs it natively, else fp32; anything else unchanged."""
    if precision == "auto":
        return "bf16" if native_bf16(device) else "fp32"
    return precision


def _unsupported(device_type: str, precision: str) -> str | None:
    """Why torch cannot autocast to `precision` on this device type (None: it can)."""
    dtype = DTYPES[precision]
    try:
        with torch.autocast(device_type, dtype=dtype):  # a disabled autocast only warns
            probe = torch.ones(2, 2, device=device_type)
            if (probe @ probe).dtype != dtype:
                return "autocast stayed in float32"
    except (RuntimeError, ValueError, AssertionError) as e:
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    return None


def autocast(
    where: torch.device | str | torch.nn.Module, precision: str
) -> contextlib.AbstractContextManager[Any]:
    """Forward passes on a device (or a model's device) in `precision` ("fp32", "bf16", "fp16",
    or "auto": bf16 where native, else fp32); UserError when torch cannot run it there."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if isinstance(where, torch.nn.Module):
        where = next(where.parameters()).device
    precision = resolve_precision(precision, torch.device(where))
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision not in DTYPES:
        raise UserError(
            f"precision must be one of fp32, {', '.join(DTYPES)}, auto; got {precision!r}"
        )
    device_type = torch.device(where).type
    problem = _unsupported(device_type, precision)
    if problem is not None:
        raise UserError(
            f"--precision {precision} is not supported on {device_type} by torch "
            f"{torch.__version__} ({problem}); use fp32 or another precision"
        )
    return torch.autocast(device_type, dtype=DTYPES[precision])


def full_precision(device: torch.device | str) -> contextlib.AbstractContextManager[Any]:
    """Plain float32 again inside an autocast region (e.g. probe fits between two passes)."""
    return torch.autocast(torch.device(device).type, enabled=False)


__all__ = ["autocast", "full_precision", "native_bf16", "resolve_precision"]
