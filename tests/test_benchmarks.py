"""The benchmark scripts stay in step with the package: each one imports (every poslens name it
uses exists) and answers --help. They are run by hand, so nothing else would notice a rename."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))


def test_there_are_benchmarks() -> None:
    assert len(SCRIPTS) >= 8


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_benchmark_imports_and_answers_help(script: Path) -> None:
    r = subprocess.run(
        [sys.executable, str(script), "--help"], cwd=ROOT, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    missing = re.search(r"ModuleNotFoundError: No module named '([\w.]+)'", r.stderr)
    if missing and not missing[1].startswith("poslens"):  # an optional extra (timm, sklearn)
        pytest.skip(f"needs {missing[1]}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "usage" in r.stdout.lower()
