#!/usr/bin/env bash
# Set up .venv with the [timm] and [hf] extras (so the timm parity and datasets tests run) and run
# the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --timm
.venv/bin/ruff check src tests benchmarks examples
POSLENS_FULL=1 .venv/bin/python -m pytest "$@"
