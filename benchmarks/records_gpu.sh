#!/usr/bin/env bash
# GPU stages of the 8 x H100 records (benchmarks/RESULTS.md): emulated ranks (scripts/bench.py --emulate-sp) at
# two depths each, then their full-depth predictions (benchmarks/emulated_depth.py). One H100 runs every stage.
# After the bundles (hybrid_bundle.sh install-a, fa4_bundle.sh stash / unpack):
#
#   bash benchmarks/records_gpu.sh moe1m OUT       # Qwen3-30B-A3B at 1M, sp=8, the planner's levers, AdamW on the host
#   bash benchmarks/records_gpu.sh 2m OUT          # Qwen3-8B at 2M on 2 nodes (sp=16), the planner's levers, AdamW
#   bash benchmarks/records_gpu.sh 4m OUT          # Qwen3-8B at 4M on 4 nodes (sp=32), the same
#   bash benchmarks/records_gpu.sh gemma4 OUT      # Gemma-4-31B at 262,144 tokens, sp=8, at 1, 5, 6 and 7 layers
#
# Each writes the bench rows, the logs and the prediction under OUT and prints one line per row.
set -uo pipefail
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
STAGE=${1:?moe1m | 2m | 4m | gemma4}; OUT=${2:?output folder}
mkdir -p "$OUT"

point() {  # NAME LAYERS ARGS...: one emulated bench row; its whole log under OUT, its summary printed
    local name=$1 layers=$2; shift 2
    python3 scripts/bench.py --layers "$layers" --attn fa4 --json "$OUT/$name.json" "$@" \
        > "$OUT/$name.log" 2>&1
    python3 - "$OUT/$name.json" <<'PY' || tail -5 "$OUT/$name.log"
import json, sys
r = json.load(open(sys.argv[1]))[0]
e = r.get("emulated", {})
print(sys.argv[1].rsplit("/", 1)[-1], r.get("status"), "layers", r.get("layers"), "s/step", r.get("s_per_step"),
      "GPU GiB", r.get("peak_gpu_gib"), "host GiB", r.get("peak_host_gib"), "ulysses s", e.get("ulysses_all_to_all_s"))
PY
}

depth() {  # NAME ROWS...: the full-depth prediction
    local name=$1; shift
    python3 benchmarks/emulated_depth.py "$@" --json "$OUT/$name.json" 2>&1 | tail -2
}

case "$STAGE" in
  moe1m)
    common=(--model qwen3-30b-a3b --lengths 1048576 --emulate-sp 8 --levers all --keep-fraction 1 --offload-fraction 0.5
            --optimizer cpu --steps 1)
    point moe_1m_2l 2 "${common[@]}" --time-breakdown
    point moe_1m_4l 4 "${common[@]}"
    depth moe_1m_full "$OUT/moe_1m_2l.json" "$OUT/moe_1m_4l.json" ;;
  2m|4m)
    tokens=$(( ${STAGE%m} * 1048576 )); sp=$(( ${STAGE%m} * 8 ))
    common=(--model qwen3-8b --lengths "$tokens" --emulate-sp "$sp" --emulate-gpus-per-node 8 --levers all
            --keep-fraction 1 --offload-fraction 0.5 --optimizer gpu --steps "${STEPS:-1}")
    point "qwen3_8b_${STAGE}_1l" 1 "${common[@]}"
    point "qwen3_8b_${STAGE}_2l" 2 "${common[@]}"
    depth "qwen3_8b_${STAGE}_full" "$OUT/qwen3_8b_${STAGE}_1l.json" "$OUT/qwen3_8b_${STAGE}_2l.json" ;;
  gemma4)
    # the planner's levers for 8 x 80 GB (plan.py --auto-levers --offload-activations --offload-optimizer): attention
    # kept, TiledMLP off, half the layers offloaded, AdamW on the host
    common=(--model gemma-4-31b --lengths 262144 --emulate-sp 8 --levers alluntiled --keep-fraction 1
            --offload-fraction 0.5 --optimizer cpu --steps "${STEPS:-1}")
    # transformers makes the last layer global: 1, 5 and 6 layers hold one global layer each, 7 layers two (5 + 2),
    # the depth that separates the global layer's seconds from the fixed part; 6 layers profiled
    for layers in 1 5 7; do point "gemma4_31b_262k_${layers}l" "$layers" "${common[@]}"; done
    point gemma4_31b_262k_6l 6 "${common[@]}" --time-breakdown
    depth gemma4_31b_262k_full "$OUT"/gemma4_31b_262k_{1,5,6,7}l.json ;;
  *) echo "unknown stage $STAGE" >&2; exit 2 ;;
esac
