#!/usr/bin/env bash
# GPU stages of the 2026 families (Gemma 4, the DeepSeek-V3 line; benchmarks/RESULTS.md). One H100 runs every stage.
# After the bundles (hybrid_bundle.sh install-a, fa4_bundle.sh stash / unpack):
#
#   bash benchmarks/families_gpu.sh gemma4-peak OUT   # Gemma-4-31B's 1-layer sp=8 rank at 262,144 tokens (the
#                                                     # records' levers), its GPU memory recorded: what holds the peak
#   bash benchmarks/families_gpu.sh equality OUT      # the bf16 gradient checks at 16,384 tokens, one GPU (sp=1),
#                                                     # every lever: Gemma-4-31B (4 layers: 3 sliding, 1 global) and
#                                                     # DeepSeek-V3 (4 layers: 3 dense, 1 of 16 experts)
#   bash benchmarks/families_gpu.sh mla OUT           # DeepSeek-V3 at 131,072 tokens (4 layers) and Kimi K2 with
#                                                     # LoRA at 262,144 (2 layers), emulated sp=8 ranks, beside the plan
#   bash benchmarks/families_gpu.sh rerun OUT         # what the twenty-fifth session left open: Gemma 4's check at
#                                                     # initializer_range 0.005 (logits back below the soft-cap; the
#                                                     # plain bf16 model still 136% off fp32: not informative),
#                                                     # DeepSeek-V3's expert layer with the sp reduce in bf16
#                                                     # (seq_parallel_communication_data_type), and the Kimi K2 LoRA
#                                                     # rank again (its out-of-memory row now says where it stopped)
#   bash benchmarks/families_gpu.sh gemma4-fp32 OUT   # Gemma-4-31B checked in fp32 against fp64 (2 layers, 4,096
#                                                     # tokens; fa4's reference kernel on the GPU, since FlashAttention
#                                                     # 4 takes no fp32: benchmarks/reference_kernels.py), and its
#                                                     # negative control (windows ignored). In bf16 the check is
#                                                     # uninformative at any random init tried (plain bf16 121-136% off)
#
# Each writes its rows and whole logs under OUT and prints one summary line per row.
set -uo pipefail
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
STAGE=${1:?gemma4-peak | equality | mla | rerun | gemma4-fp32}; OUT=${2:?output folder}
mkdir -p "$OUT"

row() {  # NAME ARGS...: one bench row, its log under OUT, then its peak beside the plan
    local name=$1; shift
    python3 scripts/bench.py --attn fa4 --steps 1 --json "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
    python3 -c 'import json, sys; r = json.load(open(sys.argv[1]))[0]; print(sys.argv[1], r["status"][:300],
        r.get("s_per_step"), "s", r.get("peak_gpu_gib"), "GiB", r.get("oom", ""))' "$OUT/$name.json" \
        || tail -5 "$OUT/$name.log"
    python3 benchmarks/row_plan.py "$OUT/$name.json" --json "$OUT/${name}_plan.json" 2>&1 | tail -2
}

equality() {  # NAME ARGS...: one bf16 gradient check, its report under OUT
    local name=$1; shift
    python3 benchmarks/gpu_equality.py --length 16384 --sp 1 --set attn_implementation=fa4 \
        --set keep_attention_fraction=1.0 --set tiled_mlp=true --offload-activations --workdir /tmp/equality \
        --json "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
    echo "$name: exit $?"; grep -E '^(loss|[0-9]+ gradients|sp=1)' "$OUT/$name.log"
}

case "$STAGE" in
  gemma4-peak)
    memory=/tmp/gemma4_memory
    row gemma4_31b_262k_1l_memory --model gemma-4-31b --layers 1 --lengths 262144 --emulate-sp 8 \
        --levers alluntiled --keep-fraction 1 --offload-fraction 0.5 --optimizer cpu --memory-profile "$memory"
    cp "$memory"/*_peak.json "$OUT"/
    python3 - "$OUT"/*_peak.json <<'PY'
import json, sys
peak = json.load(open(sys.argv[1]))
before = peak["alive_before_recording_gib"]
print(f"peak {peak['peak_gib']:.2f} GiB in {peak['phase']}; from before recording {before:.2f}")
for site in peak["by_site"][:14]:
    print(f"  {site['gib']:7.3f} GiB  {site['blocks']:4d} blocks  {site['site']}")
PY
    ;;
  equality)
    equality gemma4_31b_4l_equality --model gemma-4-31b --layers 4
    equality deepseek_v3_4l_equality --model deepseek-v3 --layers 4 --override n_routed_experts=16 ;;
  mla)
    row deepseek_v3_131k_4l --model deepseek-v3 --layers 4 --lengths 131072 --emulate-sp 8 --levers all \
        --optimizer cpu
    row kimi_k2_262k_2l_lora --model kimi-k2 --layers 2 --lengths 262144 --emulate-sp 8 --levers all \
        --optimizer gpu --set model.lora.r=16 ;;
  rerun)
    equality gemma4_31b_4l_equality_init0.005 --model gemma-4-31b --layers 4 --override initializer_range=0.005
    row deepseek_v3_131k_4l_bf16_reduce --model deepseek-v3 --layers 4 --lengths 131072 --emulate-sp 8 --levers all \
        --optimizer cpu --deepspeed-overrides '{"seq_parallel_communication_data_type": "bf16"}'
    row kimi_k2_262k_2l_lora --model kimi-k2 --layers 2 --lengths 262144 --emulate-sp 8 --levers all \
        --optimizer gpu --set model.lora.r=16 ;;
  gemma4-fp32)
    # 2 layers (1 sliding, 1 global) at 4,096 tokens: the fp64 exact answer's weights and gradients (39 GB) and the
    # reference kernel's tokens x tokens scores fit one H100; the window (1,024) still cuts every later query
    for mode in reference-kernel control-window; do
      name=gemma4_31b_2l_fp32_${mode}
      python3 benchmarks/gpu_equality.py --model gemma-4-31b --layers 2 --length 4096 --sp 1 --dtype float32 \
          --override initializer_range=0.005 --set attn_implementation=fa4 --"$mode" \
          --set keep_attention_fraction=1.0 --set tiled_mlp=true --offload-activations \
          --workdir /tmp/equality --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
      echo "$name: exit $?"; grep -E '^(loss|[0-9]+ gradients|sp=1|negative)' "$OUT/$name.log" || tail -5 "$OUT/$name.log"
    done ;;
  *) echo "unknown stage $STAGE" >&2; exit 2 ;;
esac
