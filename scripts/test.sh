#!/usr/bin/env bash
# Set up .venv with the [timm] and [hf] extras (so the timm parity and datasets tests run) and run
# the whole test suite: one single-threaded pytest-xdist worker per core (POSLENS_TEST_WORKERS,
# default 2), each test file on one worker so its module fixtures are built once.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --timm
.venv/bin/ruff check src tests benchmarks examples
.venv/bin/ruff format --check src tests benchmarks examples
POSLENS_FULL=1 .venv/bin/python -m pytest -n "${POSLENS_TEST_WORKERS:-2}" --dist loadfile "$@"
