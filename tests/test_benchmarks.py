"""The benchmark scripts stay in step with the package: each one imports (every poslens name it
uses exists) and answers --help. They are run by hand, so nothing else would notice a rename.
All of them run in one child process (each as `__main__`, as `python SCRIPT --help` runs it):
a process per script spent most of a minute importing torch again and again."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))

# for each script: its exit code, what it printed, and the module it missed (if any)
DRIVER = r"""
import contextlib, io, json, os, runpy, sys, traceback
out = {}
sys.path.insert(0, os.path.dirname(sys.argv[1]))  # as python SCRIPT does: its siblings import
for path in sys.argv[1:]:
    buf, err = io.StringIO(), io.StringIO()
    code, missing = 0, None
    sys.argv = [path, "--help"]
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except ModuleNotFoundError as e:
            code, missing = 1, e.name
            traceback.print_exc()
        except BaseException:
            code = 1
            traceback.print_exc()
    out[path] = {"code": code, "stdout": buf.getvalue(), "stderr": err.getvalue()[-2000:],
                 "missing": missing}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def answers() -> dict[str, dict[str, object]]:
    r = subprocess.run(
        [sys.executable, "-c", DRIVER, *map(str, SCRIPTS)], cwd=ROOT, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def test_there_are_benchmarks() -> None:
    assert len(SCRIPTS) >= 8


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_benchmark_imports_and_answers_help(
    script: Path, answers: dict[str, dict[str, object]]
) -> None:
    a = answers[str(script)]
    missing = a["missing"]
    if isinstance(missing, str) and not missing.startswith("poslens"):  # an optional extra
        pytest.skip(f"needs {missing}")
    assert a["code"] == 0, a["stderr"]
    assert "usage" in str(a["stdout"]).lower()
