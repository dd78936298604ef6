#!/usr/bin/env bash
# Create .venv with poslens installed in editable mode.
#   bash scripts/setup.sh          core: torch 2.13.0 (CPU build), enough to train and analyse
#   bash scripts/setup.sh --timm   adds timm (needs torchvision: torch 2.14.1 + torchvision 0.29.1)
#                                  and datasets (the [hf] extra: Hugging Face dataset directories)
#                                  and submitit (the [slurm] extra: study --executor slurm)
#                                  and transformers (the [transformers] extra: hf:DIR parity tests)
#                                  and sae-lens (the [saelens] extra: SAELens interoperability tests)
# On these machines both torch releases lie on local disk; elsewhere pip fetches them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${POSLENS_VENV:-.venv}
want_timm=0
[ "${1:-}" = "--timm" ] && want_timm=1

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip -q --disable-pip-version-check "$@"; }
have() { "$VENV/bin/python" -c "import $1" >/dev/null 2>&1; }

if [ $want_timm = 1 ]; then
  # torchvision must come from the same release pair as torch, installed in one command, before timm
  if ! have torchvision; then pip install torch==2.14.1 torchvision==0.29.1; fi
  pip install -e '.[timm,hf,slurm,transformers,saelens,dev,animals]'
else
  if ! have torch; then pip install torch==2.13.0; fi
  pip install -e '.[dev,animals]'
fi
"$VENV/bin/python" -c "import torch, poslens; print(f'poslens {poslens.__version__} ready in $VENV (torch {torch.__version__})')"
