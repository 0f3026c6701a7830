#!/usr/bin/env bash
# Set up (with the dev extra), then run the whole test suite.
# Two pytest-xdist workers: every tests/dist test on one (in order: a 4-process gloo world at a
# time is all 2 cores can carry), the single-process tests on the other meanwhile (conftest.py's
# xdist_group). Without pytest-xdist the suite runs in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
workers=()
# (pytest >= 9.2 names nodes by `_id`, which xdist 3.8's --dist loadgroup does not set: groups
# would be ignored and two worlds run at once; setup.sh's dev extra pins pytest below 9.2)
python3 -c "import xdist, pytest, sys; sys.exit(tuple(map(int, pytest.__version__.split('.')[:2])) >= (9, 2))" \
    2>/dev/null && workers=(-n "${AUTOPAR_TEST_WORKERS:-2}" --dist loadgroup)
exec python3 -m pytest tests -q --durations=10 "${workers[@]}" "$@"   # and the 10 slowest tests
