#!/usr/bin/env bash
# Set up (with the dev extra), then run the whole test suite.
# Two pytest processes side by side: tests/dist and tests/fuzz (gloo worlds, one at a time: a
# 4-process world is all 2 cores can carry; the fuzz trains AUTOPAR_FUZZ_PLANS random plans, its
# seed the UTC date) and the single-process tests (tests/unit, tests/bad_inputs), whose report
# is printed after the dist one. Not pytest-xdist: its workers run I/O threads, and a world forked
# from a threaded process can inherit a held lock (a rank hung at start-up, seen once in CI).
# Each report lists its 10 (unit: 5) slowest tests, then the seconds and CPU-seconds per test module
# (CPU-s: the pytest process and the ranks and subprocesses it reaped; the figure to compare on a
# shared machine). AUTOPAR_TEST_PROFILE=dir profiles every rank of every world (tests/conftest.py;
# read with `python tests/profile_report.py dir`).
# With arguments, one plain run: `bash scripts/test.sh tests/unit -k capture`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
if [ $# -gt 0 ]; then
    exec python3 -m pytest -q --durations=10 "$@"
fi
export AUTOPAR_TEST_MODULE_TIMES=1  # each report ends with the seconds per test module (tests/conftest.py)
log=$(mktemp)
python3 -m pytest tests/unit tests/bad_inputs -q --durations=5 -p no:cacheprovider >"$log" 2>&1 &
single=$!
set +e
python3 -m pytest tests/dist tests/fuzz -q --durations=10   # and the 10 slowest tests
dist_rc=$?
wait "$single"
single_rc=$?
set -e
echo "--- tests/unit and tests/bad_inputs (ran beside tests/dist): ---"
cat "$log"
rm -f "$log"
[ "$dist_rc" -eq 0 ] && [ "$single_rc" -eq 0 ]
