#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite on CPU: real gloo processes, no GPU needed.
# Usage: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
python -m pytest -q "$@"
