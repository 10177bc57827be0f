#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite on CPU: real gloo processes, no GPU needed.
# Usage: bash scripts/test.sh [pytest args]
# The test files run on TEST_WORKERS pytest-xdist workers (default 2), each file whole on one worker (its module
# fixtures, which launch processes once for many checks, then run once); TEST_WORKERS=0 runs in this process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
python -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadfile "$@"
