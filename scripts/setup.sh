#!/usr/bin/env bash
# Install autopar (editable) and what it needs, never replacing an installed torch.
# Usage: bash scripts/setup.sh [dev]    ("dev" adds pytest and transformers)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
    # pip takes a local CPU wheel where the machine has one (CI's Python 3.11); elsewhere PyPI's
    # default Linux build, which carries CUDA libraries (several GB) and runs on a CPU as well
    echo "[setup] no torch found: installing torch==2.13.0 first"
    "$PY" -m pip install -q "torch==2.13.0"
fi
TORCH_VERSION=$("$PY" -c "import torch; print(torch.__version__.split('+')[0])")
CONSTRAINTS=$(mktemp)
echo "torch==${TORCH_VERSION}" > "$CONSTRAINTS"
EXTRA=""
[ "${1:-}" = "dev" ] && EXTRA="[dev]"
if ! "$PY" -c "import autopar, rich, sympy, networkx, scipy" 2>/dev/null || [ -n "$EXTRA" ]; then
    echo "[setup] installing autopar${EXTRA} (torch pinned to ${TORCH_VERSION})"
    "$PY" -m pip install -q -c "$CONSTRAINTS" -e ".${EXTRA}"
fi
rm -f "$CONSTRAINTS"
