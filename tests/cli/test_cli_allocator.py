"""The CLI's allocator setting (poslens/allocator.py): big freed CPU blocks are reused instead of
page-faulted in again, the user's own choice wins, and the CLI makes the setting for itself.

The setting is process-wide, so each measurement runs in its own Python process."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from typing import Any

import pytest

from poslens import allocator
from poslens.cli import main

# Allocates, fills and frees a 64 MiB tensor 25 times; prints the minor page faults of the last
# 20. The first ones fault on any allocator: the heap grows until a freed block fits the next.
LOOP = """
import json, resource, sys, torch
from poslens.allocator import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else False
for _ in range(5):
    torch.empty(16 << 20).fill_(1.0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    torch.empty(16 << 20).fill_(1.0)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"kept": kept, "faults": faults}))
"""

# Mallocs, fills and frees 3 x 720 MiB twice (more than 2 GiB, mallopt's largest finite trim
# threshold), releases the free heap, and does it once more; prints each round's page faults.
# Raw malloc, not torch: torch's helper threads make the heap's layout vary from run to run.
ROUNDS = """
import ctypes, json, resource, sys
from poslens.allocator import keep_freed_memory, release_freed_memory
kept = keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
libc.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
def round_faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [libc.malloc(720 << 20) for _ in range(3)]
    for b in blocks:
        libc.memset(b, 1, 720 << 20)
    for b in blocks:
        libc.free(b)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
first, second = round_faults(), round_faults()
released = release_freed_memory()
print(json.dumps({"kept": kept, "faults": [first, second, round_faults()], "released": released}))
"""

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")


def _loop(mode: str, **env: str) -> dict[str, int | bool]:
    return _run(LOOP, mode, **env)


def _run(script: str, *args: str, **env: str) -> dict[str, Any]:
    """Run `script` in a fresh Python without the user's allocator settings; its JSON line."""
    clean = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "POSLENS_MALLOC")}
    out = subprocess.run(
        [sys.executable, "-c", script, *args],
        env=clean | env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


@glibc
def test_freed_blocks_are_reused_instead_of_faulted_in_again() -> None:
    default, kept = _loop("default"), _loop("keep")
    assert default["kept"] is False and kept["kept"] is True
    # glibc's default maps each block anew: at least one fault per block (one per 4 KiB page, or
    # per 2 MiB where the kernel backs it with transparent huge pages); kept, the block is reused
    # (now and then the heap moves and one block is faulted in again: 1 of 20 was seen)
    assert default["faults"] >= 20
    assert kept["faults"] * 4 < default["faults"]


@glibc
def test_the_heap_keeps_its_peak_until_released() -> None:
    result = _run(ROUNDS)
    first, second, after_release = result["faults"]
    assert result["kept"] is True and result["released"] is True
    assert first >= 3 * (720 << 20) // (2 << 20)  # the heap grew: faulted in once
    # kept: 2.1 GiB freed at once stays in the heap (a 2 GiB trim threshold gave it back and
    # faulted all of it in again: 552,928 faults); released: faulted in afresh
    assert second * 100 < first
    assert after_release * 2 > first


@glibc
@pytest.mark.parametrize(
    "env",
    [{"POSLENS_MALLOC": "default"}, {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1048576"}],
    ids=["opt-out", "user-tunables"],
)
def test_the_users_own_allocator_choice_is_kept(env: dict[str, str]) -> None:
    result = _loop("keep", **env)
    assert result["kept"] is False


def test_the_cli_makes_the_setting_for_its_own_process(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[bool] = []
    monkeypatch.setattr(allocator, "keep_freed_memory", lambda: calls.append(True) or True)
    assert main(["info", "no/such/checkpoint"]) == 2  # any command: the setting comes first
    assert calls == [True]
    assert "poslens: error:" in capsys.readouterr().err
