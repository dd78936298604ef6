"""CPU memory reuse: let glibc's malloc keep big freed blocks instead of unmapping them.

By default glibc maps every block over 32 MiB fresh from the kernel and unmaps it on free, so a
loop that allocates big CPU tensors (the per-head outputs of a full cache are 58 MB per block at
batch 8 on ViT-B; depth_profile's stacked activations) page-faults and zeroes that memory again on
every batch. Measured on a ViT-B depth_profile run: 9.1M page faults and 22 s of kernel time out
of 96 s, against 1.0M and 4 s out of 83 s with the blocks kept (docs/design.md, "The CLI keeps
big freed CPU blocks").

The heap then never shrinks by itself: a process keeps its peak for reuse. A full cache of ViT-B
at batch 32 frees 6 GB per forward; mallopt's largest finite trim threshold (2 GiB) handed it
back and page-faulted it in again every time. `release_freed_memory()` hands the free part back,
e.g. in a notebook.

The setting is process-wide, so the library never makes it on import: the CLI makes it for its
own processes, a notebook may call `keep_freed_memory()`. Users who chose their allocator
(GLIBC_TUNABLES, a preloaded jemalloc or tcmalloc) or set POSLENS_MALLOC=default keep theirs.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any

MMAP_THRESHOLD = 1 << 30  # blocks up to 1 GiB come from the reusable heap
TRIM_THRESHOLD = -1  # never give heap memory back by itself (mallopt(3): -1 disables trimming)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameter numbers (malloc.h)
_kept = False  # whether this process made the setting (worker processes then make it too)


def kept() -> bool:
    """Whether `keep_freed_memory()` made its setting in this process."""
    return _kept


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; True if the setting was made.

    A no-op (False) off Linux/glibc, when the user set GLIBC_TUNABLES's malloc tunables or
    preloaded another allocator, or when POSLENS_MALLOC=default.
    """
    if not sys.platform.startswith("linux") or os.environ.get("POSLENS_MALLOC") == "default":
        return False
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "") or "malloc" in os.environ.get(
        "LD_PRELOAD", ""
    ):
        return False
    mallopt = _glibc("mallopt", ctypes.c_int, ctypes.c_int)
    if mallopt is None:
        return False
    global _kept
    _kept = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    return _kept


def release_freed_memory() -> bool:
    """Hand the heap's free memory back to the kernel now (glibc's malloc_trim); True if any was.

    For a notebook after `keep_freed_memory()`: the heap keeps its peak otherwise.
    """
    malloc_trim = _glibc("malloc_trim", ctypes.c_size_t)
    return malloc_trim is not None and bool(malloc_trim(0))


def _glibc(name: str, *argtypes: type) -> Any:
    """glibc's function `name` (returning a C int), or None off Linux/glibc (musl has no mallopt)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL("libc.so.6"), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn
