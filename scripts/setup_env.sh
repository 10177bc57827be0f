#!/usr/bin/env bash
# Install ulysses-train and what its tests need into the current Python, from scratch if necessary.
# Usage: bash scripts/setup_env.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python -c "import torch" 2>/dev/null; then
    # a machine without torch: take the CPU-friendly pinned build (users with a CUDA torch keep theirs)
    python -m pip install --quiet "torch==2.13.0"
fi
# DS_BUILD_OPS=0: DeepSpeed compiles its ops on first use instead of at install time
DS_BUILD_OPS=0 python -m pip install --quiet -e ".[test]"
