#!/usr/bin/env bash
# The plan fuzz in full (issue 21, item 7): N random plans (default 200) with SEED (default: the
# UTC date, YYYYMMDD) over gpt-tiny, gpt-tiny-tied, moe-tiny, transformers Llama and Qwen3 on 4
# gloo ranks, each against one process or refused up front. Prints a line per plan, a summary
# and a repro per failure; exit status 1 on any MISMATCH / CRASH / HANG.
#   bash scripts/fuzz.sh                  # 200 plans, today's seed
#   bash scripts/fuzz.sh 30 20261126      # 30 plans of that seed
#   bash scripts/fuzz.sh 200 20261126 --only 17   # reproduce plan 17 of that seed
# See tests/fuzz/plans.py for the plan space, the tolerances and the verdicts.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec python3 tests/fuzz/plans.py "$@"
