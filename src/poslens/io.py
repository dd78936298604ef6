"""Safe, atomic file I/O: safetensors and JSON only, never pickle."""

from __future__ import annotations

import contextlib
import contextvars
import errno
import json
import math
import os
import re
import stat
import struct
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes

from poslens.errors import CheckpointError, OutputError

# Hostile-file bounds. poslens writes configs of a few KB and results.json of a few MB; a file far
# beyond these is refused before it is parsed (a 254 MB config.json took minutes to reject).
MAX_CONFIG_BYTES = 1 << 20  # config.json, TOML run configs, cfg.json, stage records
MAX_JSON_BYTES = 64 << 20  # results.json, metrics.json and other JSON written by poslens
MAX_JSON_DEPTH = 64  # nesting of objects and arrays; poslens's own files stay below 10
MAX_HEADER_BYTES = 100_000_000  # a safetensors header (the safetensors library's own limit)

# Paths written by atomic_write inside `removed_on_error()` blocks (innermost block last).
_WRITTEN: contextvars.ContextVar[tuple[list[Path], ...]] = contextvars.ContextVar(
    "poslens_written", default=()
)


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Write via a temporary file in the same folder, then rename: readers never see half a file.

    An OSError (full disk, read-only folder, a file where a folder should be) becomes a one-line
    OutputError; the temporary file is removed and `path` keeps its previous content.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
    except OSError as e:
        raise _output_error(path, e) from None
    try:
        write(Path(tmp))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual permissions
        _replace(Path(tmp), path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise _output_error(path, e) from None
        raise
    for paths in _WRITTEN.get():
        paths.append(path)


def _replace(tmp: Path, path: Path) -> None:
    """The atomic rename that publishes a finished write (one place, so tests can fail it)."""
    os.replace(tmp, path)


def _output_error(path: Path, e: OSError) -> OutputError:
    reason = e.strerror or str(e) or type(e).__name__
    return OutputError(f"could not write {path} ({reason}); nothing was marked finished")


@contextlib.contextmanager
def removed_on_error(
    folder: Path | None = None, patterns: Sequence[str] = ()
) -> Iterator[list[Path]]:
    """Files written by atomic_write inside the block are deleted if the block raises, so a
    failed write (e.g. a full disk) never leaves half an output set that a rerun would trust;
    so are the files in `folder` matching `patterns` (the set's earlier version, which would
    otherwise be left mixed with the new one)."""
    paths: list[Path] = []
    token = _WRITTEN.set((*_WRITTEN.get(), paths))
    try:
        yield paths
    except BaseException:
        stale = [p for pat in patterns for p in folder.glob(pat)] if folder is not None else []
        for p in [*paths, *stale]:
            with contextlib.suppress(OSError):
                p.unlink(missing_ok=True)
        raise
    finally:
        _WRITTEN.reset(token)


# What atomic_write's temporary files are named: "." + the target's name + "." + mkstemp's eight
# random characters + ".tmp". A kill -9 between mkstemp and the rename leaves one behind.
TEMP_NAME = re.compile(r"\..+\.[a-z0-9_]{8}\.tmp")


def sweep_temp_files(root: Path, subfolders: Sequence[str] = ()) -> list[Path]:
    """Remove the temporary files atomic_write left (named as TEMP_NAME) directly in `root` and
    anywhere under its `subfolders`; returns them. Only for a folder this process owns: call it
    while holding its lock (`locked`), so no live write's temporary file is taken."""
    folders = [(root, False), *((root / s, True) for s in subfolders)]
    removed = []
    for top, recursive in folders:
        for folder, dirs, files in os.walk(top):  # never follows a link
            removed += [Path(folder, f) for f in files if TEMP_NAME.fullmatch(f)]
            if not recursive:
                dirs.clear()
    for p in removed:
        with contextlib.suppress(OSError):
            p.unlink()
    return removed


LOCK = ".lock"


@contextlib.contextmanager
def locked(out: Path, command: str) -> Iterator[None]:
    """Hold `out`/.lock while `poslens COMMAND` writes there: a second study or train on `out` is
    refused in one line naming the holder. An flock ends with its process, however that ends, so
    a killed run leaves no stale lock. At the end the lock file is removed while still held (so no
    one can take it in between), and so is the folder when this call created it and nothing else
    was written there: a command refused before its first write leaves no trace, and a finished
    checkpoint folder can be copied without a lock file in it. The temporary files a killed
    write left directly in `out` are removed once the lock is held (sweep_temp_files)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield
        return
    created = not os.path.lexists(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise OutputError(f"--out {out} cannot be used ({e.strerror or e})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid, _, holder = os.pread(fd, 80, 0).decode(errors="replace").strip().partition(" ")
            raise OutputError(
                f"--out {out} is in use by another poslens {holder or 'study'} (pid {pid or '?'}); "
                "wait for it to end or choose another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {command}\n".encode(), 0)
        sweep_temp_files(out)  # the holder owns the folder: a killed run's leftovers go
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                (out / LOCK).unlink()
                if created:
                    out.rmdir()  # only when empty
    finally:
        os.close(fd)


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


def not_a_file(path: Path) -> str | None:
    """Why `path` is not a regular file that can be read, as a phrase ("not found", "is a
    folder", "is a FIFO", ...); None when it is one. Links are followed, and named when broken."""
    try:
        mode = path.stat().st_mode
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "is a symbolic link loop"
        if os.path.lexists(path):
            return "is a broken symbolic link" if path.is_symlink() else f"cannot be read ({e})"
        return "not found"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "is a folder, not a file"
    kind = (
        "a FIFO (named pipe)"
        if stat.S_ISFIFO(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "a device"
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
        else "not a regular file"
    )
    link = " (through a symbolic link)" if path.is_symlink() else ""
    return f"is {kind}{link}, not a regular file"


def _file_error(path: Path, why: str, what: str = "file") -> CheckpointError:
    return CheckpointError(f"{what} not found: {path}" if why == "not found" else f"{path} {why}")


def read_json(path: Path, what: str = "file", max_bytes: int = MAX_JSON_BYTES) -> Any:
    """Parse a JSON file within size and nesting bounds, with finite numbers only; a one-line
    CheckpointError names what is wrong (missing, too large, too deep, invalid, NaN at a key)."""
    try:
        why = not_a_file(path)
        if why is not None:
            raise _file_error(path, why, what)
        size = path.stat().st_size
        if size > max_bytes:
            raise CheckpointError(
                f"{what} {path} is {size:,} bytes, more than the {max_bytes:,} a {what} may have"
            )
        text = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{what} {path} could not be read ({e.strerror or e})") from None
    return parse_json(text, f"{what} {path}")


def parse_json(text: str | bytes, where: str) -> Any:
    """json.loads with the nesting bound and finite numbers only (RecursionError, NaN and
    Infinity become one-line CheckpointErrors naming `where`)."""
    try:
        obj = json.loads(text)
    except RecursionError:
        raise CheckpointError(f"{where} is nested more than {MAX_JSON_DEPTH} levels deep") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, digits limit, bad UTF-8
        reason = str(e).splitlines()[0]
        if "integer string conversion" in reason:  # Python's advice does not apply to a user
            reason = (
                f"a number has more than {sys.get_int_max_str_digits():,} digits; poslens "
                "integers are below 2**63"
            )
        raise CheckpointError(f"{where} is not valid JSON ({reason})") from None
    check_plain(obj, where)
    return obj


def check_plain(obj: Any, where: str, finite: bool = True) -> None:
    """Refuse nesting deeper than MAX_JSON_DEPTH and (if `finite`) non-finite numbers, naming the
    first key path (iterative: a hostile document cannot exhaust the stack)."""
    stack: list[tuple[Any, str, int]] = [(obj, "", 0)]
    while stack:
        value, key, depth = stack.pop()
        if isinstance(value, dict | list):
            if depth >= MAX_JSON_DEPTH:
                raise CheckpointError(f"{where} is nested more than {MAX_JSON_DEPTH} levels deep")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for k, v in items:
                sub = f"{key}.{k}" if isinstance(value, dict) else f"{key}[{k}]"
                stack.append((v, sub.lstrip("."), depth + 1))
        elif finite and isinstance(value, float) and not math.isfinite(value):
            raise CheckpointError(
                f"{where}: {key or 'the value'} is {value}; numbers must be finite"
            )


def save_tensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    """Atomically save tensors as safetensors (contiguous CPU copies); the same tensors and
    metadata give the same bytes in every process (see `_sorted_header`)."""
    flat = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    data = safetensors_bytes(flat, metadata=metadata)
    header, body = _sorted_header(data)

    def write(p: Path) -> None:
        with open(p, "wb") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            f.write(body)

    atomic_write(path, write)


def _sorted_header(data: bytes) -> tuple[bytes, memoryview]:
    """The header of safetensors bytes re-serialised with sorted keys (the library writes the
    metadata from a hash map, whose order changes from process to process), padded with spaces
    to 8 bytes as the library does, and the unchanged tensor bytes after it."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return text, memoryview(data)[8 + n :]


def check_safetensors(path: Path) -> None:
    """Refuse anything that is not a well-formed safetensors header before any parsing."""
    why = not_a_file(path)
    if why is not None:
        raise _file_error(path, why)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(9)
    looks_safetensors = (
        len(head) == 9 and head[8:9] == b"{" and 8 + struct.unpack("<Q", head[:8])[0] <= size
    )  # checked first: a header of 128 bytes (mod 256) also starts with pickle's 0x80
    if not looks_safetensors and (head[:2] == b"PK" or head[:1] == b"\x80"):
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
    if n > MAX_HEADER_BYTES:
        raise CheckpointError(
            f"{path} declares a {n:,}-byte safetensors header, more than the "
            f"{MAX_HEADER_BYTES:,} allowed"
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
    check_safetensors(path)  # bounds the header size before anything is read
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        try:
            header = parse_json(f.read(n), f"the safetensors header of {path}")
        except CheckpointError:
            raise CheckpointError(f"{path} has a corrupt safetensors header") from None
    meta = (header.get("__metadata__") or {}) if isinstance(header, dict) else None
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CheckpointError(f"{path} has a corrupt safetensors header (metadata)")
    return meta


def check_float_weights(tensors: dict[str, torch.Tensor], source: str) -> None:
    """Refuse weights stored as integers or booleans (int32 weights would load as silently cast
    floats): the first such tensor is named."""
    for k, v in tensors.items():
        if not v.is_floating_point():
            raise CheckpointError(
                f"{source}: tensor {k} is {str(v.dtype).removeprefix('torch.')}; weights must be "
                "floating point (float32, float16, bfloat16 or float64)"
            )


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
    check_float_weights({k: v for k, v in state.items() if expected[k].is_floating_point()}, source)
    for k, v in state.items():
        if v.shape != expected[k].shape:
            raise CheckpointError(
                f"{source}: tensor {k} has shape {tuple(v.shape)}, the model needs "
                f"{tuple(expected[k].shape)}"
            )
