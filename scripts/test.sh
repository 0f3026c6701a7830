#!/usr/bin/env bash
# Set up (with the dev extra), then run the whole test suite.
# Two pytest processes side by side: tests/dist and tests/fuzz (gloo worlds, one at a time: a
# 4-process world is all 2 cores can carry; the fuzz trains AUTOPAR_FUZZ_PLANS random plans, its
# seed the UTC date) and the single-process tests (tests/unit, tests/bad_inputs, and the few dist
# worlds that mostly wait on a timeout or a killed job), whose report is printed after the dist one. Not pytest-xdist: its workers run I/O threads, and a world forked
# from a threaded process can inherit a held lock (a rank hung at start-up, seen once in CI).
# Each report lists its 10 (unit: 5) slowest tests, then the seconds and CPU-seconds per test module
# (CPU-s: the pytest process and the ranks and subprocesses it reaped; the figure to compare on a
# shared machine). AUTOPAR_TEST_PROFILE=dir profiles every rank of every world (tests/conftest.py;
# read with `python tests/profile_report.py dir`).
# With arguments, one plain run: `bash scripts/test.sh tests/unit -k capture`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
# Python keeps compiled bytecode of autopar and the tests (__pycache__, git-ignored) even where the
# environment asks it not to: the suite starts many cold processes (torchrun ranks, CLI runs), each
# of which would compile autopar's 130 modules again (0.2 CPU-s a process, measured).
unset PYTHONDONTWRITEBYTECODE
if [ $# -gt 0 ]; then
    exec python3 -m pytest -q --durations=10 "$@"
fi
export AUTOPAR_TEST_MODULE_TIMES=1  # each report ends with the seconds per test module (tests/conftest.py)
# The worlds that mostly wait (a rank stuck or dead on purpose until a timeout names it; a torchrun
# job killed and resumed) run in the single-process half: waiting there leaves both cores to the
# dist half's worlds, which are the suite's longer half (measured: the single-process half ended
# ~3 min before it). They run first there, so that their ranks fork from a process no unit test
# has yet started a thread in (a fork can inherit a held lock: see above).
waiting="tests/dist/test_mesh_timeout.py tests/dist/test_collective_timeouts.py tests/dist/test_collectives.py
         tests/dist/test_checkpoint_faults.py"
log=$(mktemp)
# shellcheck disable=SC2086
python3 -m pytest $waiting tests/unit tests/bad_inputs -q --durations=5 -p no:cacheprovider >"$log" 2>&1 &
single=$!
set +e
# First the dist modules whose pytest process works alone for long stretches (the zoo captures and
# trains each row's reference on one core, the fuzz one-process references): while the
# single-process half still runs beside them, not at the end when one core would idle.
# shellcheck disable=SC2046,SC2086
AUTOPAR_TEST_FIRST="tests/dist/test_zoo.py tests/fuzz/test_fuzz_plans.py" \
python3 -m pytest tests/dist tests/fuzz $(printf -- '--ignore=%s ' $waiting) -q --durations=10   # and the 10 slowest tests
dist_rc=$?
wait "$single"
single_rc=$?
set -e
echo "--- tests/unit and tests/bad_inputs (ran beside tests/dist): ---"
cat "$log"
rm -f "$log"
[ "$dist_rc" -eq 0 ] && [ "$single_rc" -eq 0 ]
