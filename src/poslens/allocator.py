"""CPU memory reuse: let glibc's malloc keep big freed blocks instead of unmapping them.

By default glibc maps every block over 32 MiB fresh from the kernel and unmaps it on free, so a
loop that allocates big CPU tensors (the per-head outputs of a full cache are 58 MB per block at
batch 8 on ViT-B; depth_profile's stacked activations) page-faults and zeroes that memory again on
every batch. Measured on a ViT-B depth_profile run: 9.1M page faults and 22 s of kernel time out
of 96 s, against 1.0M and 4 s out of 83 s with the blocks kept (README, "Design decisions").

The setting is process-wide, so the library never makes it on import: the CLI makes it for its
own processes, a notebook may call `keep_freed_memory()`. Users who chose their allocator
(GLIBC_TUNABLES, a preloaded jemalloc or tcmalloc) or set POSLENS_MALLOC=default keep theirs.
"""

from __future__ import annotations

import ctypes
import os
import sys

MMAP_THRESHOLD = 1 << 30  # blocks up to 1 GiB come from the reusable heap
TRIM_THRESHOLD = 2**31 - 1  # the heap gives memory back only when 2 GiB of it is free (the
# largest value mallopt takes: its argument is a C int)
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
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # musl and others: no glibc mallopt
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    global _kept
    _kept = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    return _kept
