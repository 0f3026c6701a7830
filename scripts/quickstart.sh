#!/usr/bin/env bash
# Set up, then run the main job on its default: parallelise the reference GPT on a 4-process
# CPU mesh, train, print the plan and parity against one process, write a dump to out/demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec python3 -m autopar demo "$@"
