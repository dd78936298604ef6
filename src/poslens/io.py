"""Safe, atomic file I/O: safetensors and JSON only, never pickle."""

from __future__ import annotations

import json
import math
import os
import struct
import tempfile
from collections.abc import Callable
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from poslens.errors import CheckpointError


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Write via a temporary file in the same folder, then rename: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual permissions
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def jsonable(obj: Any) -> Any:
    """Plain JSON values from numpy arrays and numbers, objects with `to_dict()`, dataclasses,
    dicts and sequences (NaN and infinities become None)."""
    if hasattr(obj, "to_dict") and not isinstance(obj, type):
        return jsonable(obj.to_dict())
    if is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: jsonable(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return jsonable(obj.tolist())
    if isinstance(obj, (np.floating, float)):
        v = float(obj)
        return v if math.isfinite(v) else None
    if isinstance(obj, (np.integer, np.bool_)):
        return obj.item()
    return obj


def write_json(path: Path, obj: Any) -> None:
    """Atomically write pretty, key-sorted JSON (stable bytes for the same content)."""
    text = json.dumps(obj, indent=2, sort_keys=True) + "\n"
    atomic_write(path, lambda p: p.write_text(text))


def read_json(path: Path, what: str = "file") -> Any:
    if not path.is_file():
        raise CheckpointError(f"{what} not found: {path}")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{what} {path} is not valid JSON ({e})") from None


def save_tensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    """Atomically save tensors as safetensors (contiguous CPU copies)."""
    flat = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    atomic_write(path, lambda p: save_file(flat, str(p), metadata=metadata))


def check_safetensors(path: Path) -> None:
    """Refuse anything that is not a well-formed safetensors header before any parsing."""
    if not path.is_file():
        raise CheckpointError(f"file not found: {path}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(9)
    if head[:2] == b"PK" or head[:1] == b"\x80":
        raise CheckpointError(
            f"{path} is a pickle/torch.save file, not safetensors; poslens never unpickles files"
        )
    if len(head) < 9:
        raise CheckpointError(
            f"{path} is truncated or empty ({size} bytes), not a safetensors file"
        )
    (n,) = struct.unpack("<Q", head[:8])
    if head[8:9] != b"{" or 8 + n > size:
        raise CheckpointError(
            f"{path} is not a valid safetensors file (corrupt or truncated header)"
        )


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Load a safetensors file onto the CPU; one-line CheckpointError if it is bad."""
    check_safetensors(path)
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(
            f"{path} could not be read as safetensors ({str(e).splitlines()[0]})"
        ) from None


def read_metadata(path: Path) -> dict[str, str]:
    """The string metadata stored in a safetensors header."""
    check_safetensors(path)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        try:
            header = json.loads(f.read(n))
        except json.JSONDecodeError:
            raise CheckpointError(f"{path} has a corrupt safetensors header") from None
    return header.get("__metadata__", {}) or {}


def check_state_dict(
    state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], source: str
) -> None:
    """Refuse weights that do not fit a model: missing, unexpected or mis-shaped tensors."""
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing:
        raise CheckpointError(f"{source} is missing tensor {missing[0]} ({len(missing)} missing)")
    if extra:
        raise CheckpointError(f"{source} has unexpected tensor {extra[0]} ({len(extra)} extra)")
    for k, v in state.items():
        if v.shape != expected[k].shape:
            raise CheckpointError(
                f"{source}: tensor {k} has shape {tuple(v.shape)}, the model needs "
                f"{tuple(expected[k].shape)}"
            )
