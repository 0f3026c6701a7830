#!/usr/bin/env bash
# Set up (with the dev extra), then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
exec python3 -m pytest tests -q --durations=10 "$@"   # and the 10 slowest tests
