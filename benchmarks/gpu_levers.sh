#!/usr/bin/env bash
# One device-machine command: install the offline wheelhouse, probe SDPA backends, bench lever sets.
# Usage on the GPU machine (repo root, .whl/ carried):  bash benchmarks/gpu_levers.sh OUT_DIR LENGTHS LEVERS [STEPS]
set -uo pipefail
export PYTHONPATH="$PWD:${PYTHONPATH:-}"   # the package from this checkout (not pip-installed on the GPU machine)
OUT_DIR=${1:-out}; LENGTHS=${2:-131072}; LEVERS=${3:-chunked,all}; STEPS=${4:-1}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
eval "$(bash scripts/install_wheelhouse.sh .whl /tmp/site | tail -1)"
python3 -c "import torch, transformers, deepspeed; print('torch', torch.__version__, 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__, torch.cuda.get_device_name())" | tee "$OUT_DIR/versions.txt"
if [ "${PROBE:-1}" = 1 ]; then
    python3 benchmarks/probe_attention.py --lengths 131072 --json "$OUT_DIR/attention.json" 2>&1 | tail -20
fi
python3 scripts/bench.py --model "${MODEL:-qwen3-4b}" --lengths "$LENGTHS" --levers "$LEVERS" --steps "$STEPS" \
    --timeout "${POINT_TIMEOUT:-300}" --json "$OUT_DIR/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT_DIR/bench.log" | tail -30
if [ -n "${FULL_DEPTH_LEVERS:-}" ]; then
    python3 scripts/bench.py --model "${MODEL:-qwen3-4b}" --lengths "${FULL_DEPTH_LENGTHS:-131072}" \
        --levers "$FULL_DEPTH_LEVERS" --steps "${FULL_DEPTH_STEPS:-1}" --timeout "${POINT_TIMEOUT:-300}" --json "$OUT_DIR/bench_full.json" \
        2>&1 | tee "$OUT_DIR/bench_full.log" | tail -8
fi
