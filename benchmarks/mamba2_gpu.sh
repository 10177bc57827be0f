#!/usr/bin/env bash
# The GPU-machine commands behind benchmarks/RESULTS.md's Mamba2 rows (Nemotron 3 Nano 30B-A3B): one STAGE per
# device call on one H200, the machine kept warm between calls (it stays ~30 s). What the offline image lacks
# comes as wheels, built here with PyPI:
#   bash benchmarks/mamba2_gpu.sh build     # .m2b/ (~10 MiB): DeepSpeed (sdist), fla, pydantic, hjson
#   bash benchmarks/fa4_bundle.sh build      # .fa4a/ .fa4b/: FlashAttention 4, for the 1M step's attention
# Calls (a real cluster runs `pip install "ulysses-train[gpu]"` instead of the bundles):
#   call 1, carry .m2b .fa4a:  bash benchmarks/mamba2_gpu.sh nano-128k OUT
#   call 2, carry .fa4b:       bash benchmarks/mamba2_gpu.sh nano-1m OUT
#   call 3:                    bash benchmarks/mamba2_gpu.sh packed OUT
# (a stage installs .m2b when the machine lacks it: carry .m2b on any call that may land on a fresh machine)
# Each stage leaves fla's Triton kernels and their autotuning choices as OUT/triton-cache.tar.xz; copy it into
# .kc/ and carry .kc on a later call, so a fresh machine does not compile them again.
# Stages:
#   nano-128k  Nano's first 7 layers (Mamba2 and experts 3 each, one attention: the kinds of its repeating block
#              EMEMEM*) at 131,072 tokens on one GPU, every lever but TiledMLP (attention kept, every layer's
#              checkpoint offloaded), AdamW on the GPU, SDPA (cuDNN), two timed steps after one; its peak against
#              the plan (row_plan.py: 127.3 GiB planned). fla's Triton kernels compile and autotune on first use:
#              most of 300 s on a fresh machine. No TiledMLP as measured (2026-12-05): transformers 5.17 records no
#              router_logits for Nemotron-H, and TiledMLP refused its expert blocks until router_of's fallback
#   nano-1m    1,048,576 tokens as an emulated rank of sp=8 at 4, 7 and 14 layers, with the levers the planner
#              picks for full depth on 8 x H200 (`plan.py --model nemotron-3-nano-30b-a3b --seq-length 1048576
#              --gpus-per-node 8 --sp 8 --mamba2-chunk-gla --offload-activations --attention fa4 --auto-levers`:
#              attention kept in every layer, no TiledMLP, every layer offloaded; 58.9 s predicted at 400 TFLOP/s),
#              AdamW on the GPU, FA4, model.rope_scaling none (NoPE attention: nothing to scale past 262,144);
#              full depth from the three (emulated_depth.py: seconds per layer kind)
#   packed     mamba2_check.py at 4,096 tokens: the bf16 gradient check, one sequence and 5 packed documents
#              (FORMS=packed: the packed row alone, the one not yet measured; its varlen kernels compile first)
set -uo pipefail
STAGE=${1:?stage}; OUT=${2:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
SITE=/tmp/site
NANO=nemotron-3-nano-30b-a3b
export TRITON_CACHE_DIR=/tmp/triton-cache TRITON_CACHE_AUTOTUNING=1
keep_triton_cache() {  # the compiled kernels back to the caller (a returned file holds at most 16 MiB)
  tar -C "$TRITON_CACHE_DIR" -cf - . 2>/dev/null | xz -T0 -6 > "$OUT/triton-cache.tar.xz"
  ls -la "$OUT/triton-cache.tar.xz"
}
install() {  # .m2b into $SITE, once per machine; then FA4 when its parts are here
  if [ -f .kc/triton-cache.tar.xz ] && [ ! -d "$TRITON_CACHE_DIR" ]; then
    mkdir -p "$TRITON_CACHE_DIR" && xz -dc .kc/triton-cache.tar.xz | tar -x -C "$TRITON_CACHE_DIR"
  fi
  if [ ! -d "$SITE/deepspeed" ]; then
    [ -d .m2b ] || { echo "fresh machine: carry .m2b (bash benchmarks/mamba2_gpu.sh build)"; exit 3; }
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .m2b/*.whl > "$OUT/setup.log" 2>&1
    build=$(mktemp -d) && tar -xzf .m2b/deepspeed-*.tar.gz -C "$build"
    (cd "$build"/deepspeed-* && DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation \
        --target "$SITE" .) >> "$OUT/setup.log" 2>&1 || { tail -5 "$OUT/setup.log"; exit 3; }
  fi
  export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH} PATH=$SITE/bin:$PATH
  [ -d .fa4a ] && bash benchmarks/fa4_bundle.sh stash > /dev/null
  if [ -d .fa4b ] || [ -d /tmp/fa4site/flash_attn ]; then
    fa4_env=$(bash benchmarks/fa4_bundle.sh unpack)  # an export, or an error where part a was not stashed here
    case "$fa4_env" in export*) eval "$fa4_env" ;; *) echo "FA4's first part is not on this machine" ;; esac
  fi
  python3 -c "import torch, transformers, deepspeed, triton; from importlib.metadata import version as v
print('torch', torch.__version__, 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__,
      'triton', triton.__version__, 'fla', v('fla-core'), torch.cuda.get_device_name())" 2>&1 | tail -1 \
      | tee "$OUT/versions.txt"
}
case "$STAGE" in
  build)
    rm -rf .m2b && mkdir -p .m2b
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d .m2b fla-core==0.6.0 flash-linear-attention==0.6.0 hjson pydantic pydantic-core \
        annotated-types typing-inspection
    python3 -m pip download --quiet --no-deps --no-binary=:all: -d .m2b deepspeed==0.19.8
    grep -qx '/.m2b/' .git/info/exclude 2>/dev/null || echo '/.m2b/' >> .git/info/exclude
    du -sh .m2b ;;
  nano-128k)
    install
    python3 scripts/bench.py --model $NANO --layers 7 --lengths 131072 --levers all --keep-fraction 1 \
        --set model.tiled_mlp=false --attn sdpa --optimizer gpu --steps 2 --timeout 540 \
        --json "$OUT/nano_7l_128k.json" > "$OUT/nano_128k.log" 2>&1
    tail -3 "$OUT/nano_128k.log"
    python3 benchmarks/row_plan.py "$OUT/nano_7l_128k.json" --json "$OUT/nano_7l_128k_plan.json"
    keep_triton_cache ;;
  nano-1m)
    install
    attn=fa4  # SDPA where FA4's second part could not be unpacked (the machine went back between the calls)
    python3 -c "import flash_attn.cute" 2>/dev/null || { attn=sdpa; echo "FA4 missing: SDPA instead"; }
    for layers in 4 7 14; do
      python3 scripts/bench.py --model $NANO --layers $layers --lengths 1048576 --levers all \
          --set model.keep_attention_fraction=1 --set model.rope_scaling=none --set model.tiled_mlp=false \
          --set model.activation_offload_fraction=1 --optimizer gpu --attn $attn --steps 1 --emulate-sp 8 \
          --timeout 190 \
          --json "$OUT/nano_1m_sp8_${layers}l.json" > "$OUT/nano_1m_${layers}l.log" 2>&1
      tail -1 "$OUT/nano_1m_${layers}l.log"
    done
    python3 benchmarks/row_plan.py "$OUT"/nano_1m_sp8_*l.json
    python3 benchmarks/emulated_depth.py "$OUT"/nano_1m_sp8_{4,7,14}l.json --json "$OUT/nano_1m_sp8_full.json"
    keep_triton_cache ;;
  packed)
    install
    timeout 500 python3 benchmarks/mamba2_check.py --lengths 4096 --forms "${FORMS:-single,packed}" \
        --json "$OUT/mamba2_check_4096.json" > "$OUT/mamba2_check.log" 2>&1
    grep -vi warn "$OUT/mamba2_check.log" | tail -4; keep_triton_cache ;;
  *) echo "unknown stage $STAGE (see the header of $0)"; exit 2 ;;
esac
