#!/usr/bin/env bash
# Build an offline wheelhouse for an air-gapped GPU machine that already has torch and transformers.
# Usage (on a machine with PyPI access):  bash scripts/build_wheelhouse.sh [DIR=.whl] [PYTHON_VERSION=3.12]
# Then on the GPU machine:                 bash scripts/install_wheelhouse.sh [DIR=.whl] [SITE=/tmp/site]
set -euo pipefail
DIR=${1:-.whl}
PYV=${2:-3.12}
DEEPSPEED_VERSION=${DEEPSPEED_VERSION:-0.19.8}
mkdir -p "$DIR"
# what a CUDA image with torch + transformers typically lacks: deepspeed's own needs and datasets'
PACKAGES="hjson pydantic pydantic-core annotated-types typing-inspection datasets multiprocess dill"
# the plots of eval_positions.py and --profile-memory
PACKAGES="$PACKAGES matplotlib contourpy cycler fonttools kiwisolver pillow pyparsing python-dateutil six"
# the CUDA-only tests (benchmarks/multi_gpu.sh x1-cuda-tests)
PACKAGES="$PACKAGES pytest pluggy iniconfig pygments"
# Gated DeltaNet kernels (Qwen3.5, Qwen3-Next): pure-Python Triton kernels
PACKAGES="$PACKAGES fla-core flash-linear-attention"
python -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$DIR" $PACKAGES
# deepspeed ships no wheel: take the source archive, built with DS_BUILD_OPS=0 on the target
python -m pip download --quiet --no-deps --no-binary=:all: -d "$DIR" "deepspeed==$DEEPSPEED_VERSION"
ls -1 "$DIR"
