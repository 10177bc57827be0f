#!/usr/bin/env bash
# The GPU-machine commands behind benchmarks/RESULTS.md's Qwen3.5 (Gated DeltaNet hybrid) rows and the retrieval
# probes' cost: one STAGE per device call, each sized for one 10-minute command, on one H200.
# What they need comes in bundles (benchmarks/hybrid_bundle.sh, benchmarks/fa4_bundle.sh), one call each, the
# machine kept warm between calls (it stays ~30 s):
#   call 1, carry .hya:            bash benchmarks/hybrid_gpu.sh setup-a OUT
#   call 2, carry .fa4a (and .tlc): bash benchmarks/hybrid_gpu.sh setup-fa4a OUT
#   call 3, carry .hyb .fa4b:      bash benchmarks/hybrid_gpu.sh step OUT        (installs the rest first)
#   or call 3, carry .hyb .fa4b:   bash benchmarks/hybrid_gpu.sh kernels OUT     (installs the rest first)
#   later calls, nothing carried:  bash benchmarks/hybrid_gpu.sh 128k OUT | ours OUT | peer OUT | 1m OUT | ...
#   (a stage that needs bundle b installs it when it is missing: carry .hyb on the first such call)
# The first step with and without warming, on a fresh machine: calls 1 and 2, then carry .hyb .fa4b: warm-compile;
# then warm-first, warm-262k, warm-a (its own empty caches), lora-longest (on warm-compile's caches). The caches
# warm-compile returns, kept as .kcq/ and carried with .fa4a in call 2, spare a later machine FlashQLA's compile.
# Stages:
#   mixers        one layer's mixer of Kimi Linear (KDA, MLA) and of OLMo-hybrid (Gated DeltaNet) against the
#                 planner's terms for it, 32,768 and 65,536 tokens (benchmarks/mixer_memory.py; ~1-3 min)
#   step          one Gated DeltaNet layer's memory (fla_check.py --memory-lengths), the bf16 gradient check of
#                 Qwen3.5-9B (4 layers: 3 linear + 1 full, 16,384 tokens, FA4, every lever, against the plain
#                 model). Its first run stopped both at 150 / 200 s (tilelang compiling its kernels on first use);
#                 they were measured in later calls on the warm machine, with the limits now set
#   kernels       the kernels as the trainer now picks them (fla's conv, FlashQLA's rule through fla when flash-qla
#                 is installed, fla's fused gated norm, Liger's (1 + w) RMSNorm): the bf16 gradient check of the
#                 whole model (TileLang compiles FlashQLA's kernels on first use: minutes), attention at Qwen3.5's
#                 head dim 256 (cuDNN and the default SDPA against FA4), and TileLang's kernel cache as a tar
#   ours          the side-by-side's our side: 131,072 tokens with a profiled step (--time-breakdown)
#   swiglu        Liger's SwiGLU (model/swiglu.py): the bf16 gradient check untiled, the 128K step profiled, and
#                 the 128K step at the peer's levers (every layer recomputed whole and offloaded, no TiledMLP)
#   lora-262k     LoRA rank 16 on every projection at 262,144 tokens, ours (`auto` levers) then the peer's
#   ours-262k     the same at 262,144 tokens
#   peer          the other side: benchmarks/peer_trl.py (TRL + Liger), PEER_LENGTHS (default 131,072), profiled
#   128k          Qwen3.5-9B full depth at 131,072 tokens on one GPU (auto levers, FA4; no optimizer step:
#                 AdamW's 9B states need 155 GiB of host memory, more than this machine's 125)
#   1m            Qwen3.5-9B at 1,048,576 tokens as an emulated rank of sp=8 with the levers the planner picks
#                 for full depth on 8 x H200 (`plan.py --model qwen3.5-9b --seq-length 1048576 --gpus-per-node 8
#                 --sp 8 --attention fa4 --auto-levers`: attention kept in every layer, no TiledMLP, no activation
#                 offload, AdamW on the GPU), FA4, at 4 and 8 layers: full depth is the 4-layer block's slope
#                 added back (benchmarks/emulated_depth.py)
#   1m-documents  the same with 8 documents of 131,072 tokens packed (variable-length attention, restarts); only
#                 its 4-layer point has been measured
#   longest-8gpu  the planner's longest Qwen3.5-9B sequence for 8 x H200 (560 GiB host) at 4 layers, one cold step:
#                 3,766,624 tokens as an emulated rank of sp=8 (~10 min)
#   warm-sp8      longest-8gpu's kernels at 65,536 tokens into the warmed caches (FlashQLA compiles an sp=8 rank's
#                 head count apart), returned as the caches' tar; an H100 (sm_90, as the H200) should serve
#   warm-sp8-h100, longest-8gpu-h100, lora-longest-h100   the same on an 80 GB H100 at its own planned longest
#                 lengths (3,834,696 tokens for 8 x H100 with 2 TiB host; LoRA 479,897 on one): three calls in a row
#   longest-1gpu  the same for one H200 (125 GiB host): 524,288 tokens (~2.5 min)
#   1m-ab         the 1M emulated 4-layer block profiled, with FlashQLA and without (~6 min)
#   lora-longest  LoRA's planned longest on one H200 at 4 layers (675,892 tokens; up to 10 min cold)
#   lora-longest-peer  the peer's LoRA at 327,680 tokens (up to 10 min cold)
#   ops-128k      the 128K step at 4 layers profiled with each kernel charged to its aten op and Python lines
#   olmo-mixer    mixer_memory.py for OLMo-hybrid's Gated DeltaNet alone, with Triton's cache kept (up to 9 min)
#   moe-128k      Qwen3.5-35B-A3B at 4 layers, 131,072 tokens, every lever, AdamW on the GPU
#   warm-a        time to the first step without warming: a cold bench step of the Qwen3.5 1-GPU config
#                 (configs/qwen3_5_9b_sessions_256k_1gpu.yaml) at 4 layers and 131,072 tokens on empty kernel caches
#                 (FlashQLA's TileLang kernels compile inside it: 400-470 s); one call of up to 10 min
#   warm-compile  scripts/warm_kernels.py for that config into empty caches (/tmp/kc_warm), timed (the same cold
#                 4-layer step, run by the warm command), and the caches as $OUT/kernel-cache-qwen3.5.tar.xz
#   warm-first    on those caches (the next call on the same machine, or carried to a fresh one): the 4-layer
#                 step again (time to the first step after warming), then full depth at 131,072 tokens, first step
#                 against second
#   warm-262k     the same at 262,144 tokens (full depth; no optimizer update: 9B AdamW states exceed the host)
#   warm-first-4l on an 80 GB H100, where full depth does not fit: 4 layers after warming, first step against
#                 second, at 131,072 and 262,144 tokens
#   warm-carried  a fresh machine on the caches warm-compile returned (.kcq, carried with .fa4a to setup-fa4a): the
#                 4-layer first step against the second
#   eval-cost     (not run yet: its time went to the eval-forward memory points of RESULTS.md) Qwen3-4B shapes
#                 at 131,072 tokens: one retrieval-probe grid (scripts/eval_context.py,
#                 --random-init) against a training step (scripts/bench.py), FA4
set -uo pipefail
STAGE=${1:?stage}; OUT=${2:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
fa4() { eval "$(bash benchmarks/fa4_bundle.sh unpack)"; }
env_site() { eval "$(bash benchmarks/hybrid_bundle.sh env)"; }
versions() {
  python3 -c "import torch, transformers, deepspeed, triton; import fla, tilelang; from importlib.metadata import version as v
print('torch', torch.__version__, 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__,
      'triton', triton.__version__, 'fla', v('fla-core'), 'tilelang', v('tilelang'), 'flash-attn-4', v('flash-attn-4'),
      torch.cuda.get_device_name())" 2>&1 | tail -1 | tee "$OUT/versions.txt"
}
# the bf16 gradient check of Qwen3.5-9B (4 layers: 3 linear + 1 full, 16,384 tokens, FA4, attention kept, offload)
# against the plain model: equality SECONDS TILED(true|false) JSON_NAME
equality() {
  timeout "$1" python3 -m torch.distributed.run --standalone --nproc_per_node 1 benchmarks/gpu_equality.py \
      --model qwen3.5-9b --layers 4 --length 16384 --sp 1 --set attn_implementation=fa4 --set keep_attention_fraction=1.0 \
      --set tiled_mlp="$2" --offload-activations --json "$OUT/$3" > "$OUT/equality.log" 2>&1
  grep -E "^loss|gradients,|PASS|FAIL|model changes|Error" "$OUT/equality.log" | cut -c1-400 | head -12
}
# bundle b (flash-qla, liger-kernel, peft, trl), once per warm machine (its .hyb and .fa4b carried on that call)
install_b() {
  ( env_site; python3 -c "import liger_kernel" ) 2>/dev/null && return 0
  bash benchmarks/hybrid_bundle.sh install-b > "$OUT/setup_b.log" 2>&1 || { cat "$OUT/setup_b.log"; exit 3; }
}
BENCH="python3 scripts/bench.py"
LORA="{r: 16, lora_alpha: 32, target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, in_proj_qkv, in_proj_z, in_proj_a, in_proj_b, out_proj]}"
# the kernel caches warm-compile filled (or setup-fa4a restored) when this machine has them, else the defaults
WARMED=(env); [ -d /tmp/kc_warm ] && WARMED=(env ULYSSES_TRAIN_KERNEL_CACHE=/tmp/kc_warm)
# the emulated sp=8 rank of the planner's longest 8 x H200 run (longest-8gpu), less its length
LONGEST_8GPU=(--model qwen3.5-9b --layers 4 --levers all --set model.keep_attention_fraction=0 --set model.tiled_mlp=true
    --set model.activation_offload_fraction=0.5625 --optimizer gpu --attn fa4 --steps 0 --emulate-sp 8)
# the same for 8 x H100 (`plan.py --model qwen3.5-9b --seq-length 1048576 --gpus-per-node 8 --sp 8 --gpu-gib 79.2
# --host-gib 2048 --attention fa4 --flash-qla --liger --auto-levers --max-length`: 3,834,696 tokens over every lever
# setting with every layer offloaded, AdamW on the host, TiledMLP, attention in 2 head chunks), and LoRA's longest on
# one H100 (the lora-longest plan with --gpu-gib 79.2: 479,897 tokens, every layer offloaded, TiledMLP)
LONGEST_8GPU_H100=(--model qwen3.5-9b --layers 4 --levers all --set model.keep_attention_fraction=0
    --set model.tiled_mlp=true --set model.activation_offload_fraction=1 --set model.attention_head_chunks=2
    --optimizer cpu --attn fa4 --steps 0 --emulate-sp 8)
LORA_LONGEST_H100=(--model qwen3.5-9b --layers 4 --levers all --set "model.lora=$LORA" --set model.keep_attention_fraction=0
    --set model.tiled_mlp=true --set model.activation_offload_fraction=1 --optimizer none --attn fa4 --steps 0)
AUTO=(--set model.keep_attention_fraction=auto --set model.tiled_mlp=auto --set model.activation_offload_fraction=auto)
case "$STAGE" in
  setup-a) bash benchmarks/hybrid_bundle.sh install-a > "$OUT/setup_a.log" 2>&1; tail -3 "$OUT/setup_a.log" ;;
  setup-fa4a)
    bash benchmarks/fa4_bundle.sh stash | tail -2
    # TileLang's kernel cache from an earlier `kernels` call (its tar kept as .tlc/, carried here with .fa4a):
    # FlashQLA's kernels then load instead of compiling for minutes
    [ -f .tlc/tilelang_cache.tar ] && tar -xf .tlc/tilelang_cache.tar -C ~ && echo "TileLang cache restored"
    # and Triton's from an `olmo-mixer` call (kept as .tlc/triton_cache.tar)
    [ -f .tlc/triton_cache.tar ] && tar -xf .tlc/triton_cache.tar -C ~ && echo "Triton cache restored"
    # or the caches warm-compile returned (kernel-cache-qwen3.5.tar.xz, kept as .kcq/): the stages below use them
    [ -f .kcq/kernel-cache-qwen3.5.tar.xz ] && mkdir -p /tmp/kc_warm \
        && xz -dc .kcq/kernel-cache-qwen3.5.tar.xz | tar -x -C /tmp/kc_warm && echo "kernel caches restored"; true ;;
  step)
    install_b; env_site; fa4; versions
    timeout 240 python3 benchmarks/fla_check.py --lengths "" --time-lengths "" --memory-lengths 131072 \
        --json "$OUT/fla_memory.json" > "$OUT/fla_memory.log" 2>&1; grep "memory" "$OUT/fla_memory.log" | cut -c1-300
    equality 330 true equality_qwen3.5-9b.json ;;
  kernels)
    install_b; env_site; fa4; versions
    equality 450 true equality_kernels.json
    timeout 120 python3 benchmarks/probe_attention.py --heads 16,4,256 --lengths 131072 --fa4 --backends cudnn,default \
        --json "$OUT/attention_hd256.json" > "$OUT/attention_hd256.log" 2>&1; grep -E "tflops|rror" "$OUT/attention_hd256.log"
    [ -d ~/.tilelang ] && tar -cf "$OUT/tilelang_cache.tar" -C ~ .tilelang && du -sh "$OUT/tilelang_cache.tar" ;;
  ours)
    install_b; env_site; fa4; versions
    $BENCH --model qwen3.5-9b --lengths 131072 --levers all "${AUTO[@]}" --optimizer none --attn fa4 --steps 2 \
        --time-breakdown --timeout 280 --json "$OUT/ours_128k.json" > "$OUT/ours_128k.log" 2>&1; tail -3 "$OUT/ours_128k.log"
    grep -m1 "model changes" "$OUT/ours_128k.log" | cut -c1-700 ;;
  swiglu)
    install_b; env_site; fa4; versions
    equality 240 false equality_swiglu.json
    $BENCH --model qwen3.5-9b --lengths 131072 --levers all "${AUTO[@]}" --optimizer none --attn fa4 --steps 2 \
        --time-breakdown --timeout 200 --json "$OUT/ours_128k.json" > "$OUT/ours_128k.log" 2>&1; tail -2 "$OUT/ours_128k.log"
    # the peer's levers: every layer recomputed whole (attention too) and offloaded, no TiledMLP
    $BENCH --model qwen3.5-9b --lengths 131072 --levers all --set model.keep_attention_fraction=0 \
        --set model.tiled_mlp=false --set model.activation_offload_fraction=1 --optimizer none --attn fa4 --steps 2 \
        --timeout 170 --json "$OUT/ours_128k_peer_levers.json" > "$OUT/ours_128k_peer_levers.log" 2>&1
    tail -2 "$OUT/ours_128k_peer_levers.log" ;;
  lora-262k)
    install_b; env_site; fa4; versions
    $BENCH --model qwen3.5-9b --lengths 262144 --levers all "${AUTO[@]}" --set "model.lora=$LORA" --optimizer none \
        --attn fa4 --steps 1 --timeout 230 --json "$OUT/ours_262k_lora.json" > "$OUT/ours_262k_lora.log" 2>&1
    tail -2 "$OUT/ours_262k_lora.log"
    timeout 330 python3 benchmarks/peer_trl.py --model qwen3.5-9b --lengths 262144 --steps 2 --lora \
        --json "$OUT/peer_262k_lora.json" > "$OUT/peer_262k_lora.log" 2>&1; tail -3 "$OUT/peer_262k_lora.log" ;;
  ours-262k)
    install_b; env_site; fa4; versions
    $BENCH --model qwen3.5-9b --lengths 262144 --levers all "${AUTO[@]}" --optimizer none --attn fa4 --steps 1 \
        --timeout 290 --json "$OUT/ours_262k.json" > "$OUT/ours_262k.log" 2>&1; tail -3 "$OUT/ours_262k.log" ;;
  peer)
    install_b; env_site; fa4; versions  # fa4: tilelang (FlashQLA, through fla) needs the FA4 bundle's apache-tvm-ffi
    timeout 560 python3 benchmarks/peer_trl.py --model qwen3.5-9b --lengths "${PEER_LENGTHS:-131072}" --steps 2 --profile \
        --json "$OUT/peer.json" > "$OUT/peer.log" 2>&1; tail -5 "$OUT/peer.log" ;;
  128k)
    install_b; env_site; fa4; versions
    $BENCH --model qwen3.5-9b --lengths 131072 --levers all "${AUTO[@]}" --optimizer none --attn fa4 --steps 2 \
        --timeout 330 --json "$OUT/qwen3.5-9b_128k_1gpu.json" > "$OUT/bench_128k.log" 2>&1; tail -4 "$OUT/bench_128k.log" ;;
  1m|1m-documents)
    install_b; env_site; fa4; versions
    docs=(); [ "$STAGE" = 1m-documents ] && docs=(--documents 8)
    for layers in 4 8; do
      $BENCH --model qwen3.5-9b --layers $layers --lengths 1048576 --levers keepattn --keep-fraction 1 --optimizer gpu \
          --set model.rmsnorm=torch --attn fa4 --steps 1 --emulate-sp 8 "${docs[@]}" --timeout 280 \
          --json "$OUT/qwen3.5-9b_1m_sp8_${layers}l${docs:+_docs}.json" > "$OUT/bench_1m_${layers}l.log" 2>&1
      tail -3 "$OUT/bench_1m_${layers}l.log"
    done ;;
  longest-8gpu)
    install_b; env_site; fa4; versions
    # the planner's longest sequences (`plan.py --model qwen3.5-9b --attention fa4 --flash-qla --liger --gpu-gib 139.8
    # --max-length`), at 4 layers (3 linear + 1 full: full depth is past one 10-minute command), one cold step.
    # 8 x H200 with 560 GiB host: 3,766,624 tokens as an emulated rank of sp=8, AdamW on the GPU (its first try, in
    # a call shared with longest-1gpu, did not finish its step in 330 s)
    "${WARMED[@]}" $BENCH "${LONGEST_8GPU[@]}" --lengths 3766624 --timeout 560 --json "$OUT/longest_8gpu_4l.json" \
        > "$OUT/longest_8gpu.log" 2>&1
    tail -3 "$OUT/longest_8gpu.log"
    [ -d ~/.tilelang ] && tar -cf "$OUT/tilelang_cache.tar" -C ~ .tilelang && du -sh "$OUT/tilelang_cache.tar"; true ;;
  warm-sp8)
    install_b; env_site; fa4; versions
    # longest-8gpu's kernels at a short length: FlashQLA's TileLang kernels take the heads as compile-time
    # constants, so an sp=8 rank (an eighth of the heads) compiles its own variants (minutes on a fresh machine).
    # Warmed here into the caches warm-compile filled (/tmp/kc_warm), returned as $OUT/kernel-cache-qwen3.5.tar.xz
    # for .kcq/, longest-8gpu then compiles only fla's Triton variants for its length
    mkdir -p /tmp/kc_warm
    ULYSSES_TRAIN_KERNEL_CACHE=/tmp/kc_warm /usr/bin/time -f "%e s wall" $BENCH "${LONGEST_8GPU[@]}" --lengths 65536 \
        --timeout 500 --json "$OUT/warm_sp8.json" > "$OUT/warm_sp8.log" 2>&1
    tail -2 "$OUT/warm_sp8.log"; du -sh /tmp/kc_warm/* 2>/dev/null
    tar -cf - -C /tmp/kc_warm . | xz -T0 -6 > "$OUT/kernel-cache-qwen3.5.tar.xz" && du -sh "$OUT/kernel-cache-qwen3.5.tar.xz" ;;
  warm-sp8-h100|longest-8gpu-h100|lora-longest-h100)
    install_b; env_site; fa4; versions; mkdir -p /tmp/kc_warm
    # on an 80 GB H100 (issue 59 item 3 where no H200 comes): warm-sp8-h100 compiles the sp=8 rank's kernels at
    # 65,536 tokens into /tmp/kc_warm (FlashQLA's TileLang kernels per head count), longest-8gpu-h100 then runs
    # the 3,834,696-token rank on those caches; lora-longest-h100 runs all heads (its own compile, inside its step)
    case "$STAGE" in
      warm-sp8-h100) name=warm_sp8_h100; args=("${LONGEST_8GPU_H100[@]}" --lengths 65536) ;;
      longest-8gpu-h100) name=longest_8gpu_h100_4l; args=("${LONGEST_8GPU_H100[@]}" --lengths 3834696) ;;
      lora-longest-h100) name=lora_longest_h100_4l; args=("${LORA_LONGEST_H100[@]}" --lengths 479897) ;;
    esac
    ULYSSES_TRAIN_KERNEL_CACHE=/tmp/kc_warm /usr/bin/time -f "%e s wall" $BENCH "${args[@]}" --timeout 560 \
        --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
    tail -2 "$OUT/$name.log"; python3 benchmarks/row_plan.py "$OUT/$name.json" 2>&1 | tail -2 ;;
  longest-1gpu)
    install_b; env_site; fa4; versions
    # one H200 with 125 GiB host: 524,288 tokens, no optimizer update (4 layers, one cold step, as above)
    $BENCH --model qwen3.5-9b --layers 4 --lengths 524288 --levers all --set model.keep_attention_fraction=0 \
        --set model.tiled_mlp=true --set model.activation_offload_fraction=0.9375 --optimizer none --attn fa4 \
        --steps 0 --timeout 200 --json "$OUT/longest_1gpu_4l.json" > "$OUT/longest_1gpu.log" 2>&1
    tail -3 "$OUT/longest_1gpu.log" ;;
  1m-ab)
    install_b; env_site; fa4; versions
    # the 1M emulated 4-layer block profiled, with FlashQLA (the default) and without it (fla's Triton kernels):
    # the twelfth session's block took 16.02 s where the eighth's took 13.54 (other kernels, another machine)
    for qla in 1 0; do
      FLA_FLASH_QLA=$qla $BENCH --model qwen3.5-9b --layers 4 --lengths 1048576 --levers keepattn --keep-fraction 1 \
          --optimizer gpu --set model.rmsnorm=torch --attn fa4 --steps 1 --emulate-sp 8 --time-breakdown --timeout 250 \
          --json "$OUT/qwen3.5-9b_1m_sp8_4l_qla$qla.json" > "$OUT/bench_1m_qla$qla.log" 2>&1
      tail -2 "$OUT/bench_1m_qla$qla.log"
    done ;;
  lora-longest)
    install_b; env_site; fa4; versions
    # LoRA's longest on one H200 (`plan.py --model qwen3.5-9b --gpus-per-node 1 --host-gib 125 --gpu-gib 139.8
    # --optimizer none --attention fa4 --flash-qla --liger --lora-rank 16 --lora-targets <the 12> --max-length`:
    # 675,892 tokens, offload 0.7188, TiledMLP) at 4 layers, one cold step: a call of its own (240 s was not
    # enough cold, fla's Triton kernels compiling; FlashQLA's TileLang kernels take ~400 s more on a fresh machine)
    "${WARMED[@]}" $BENCH --model qwen3.5-9b --layers 4 --lengths 675892 --levers all --set "model.lora=$LORA" \
        --set model.keep_attention_fraction=0 --set model.tiled_mlp=true --set model.activation_offload_fraction=0.7188 \
        --optimizer none --attn fa4 --steps 0 --timeout 560 --json "$OUT/lora_longest_4l.json" > "$OUT/lora_longest.log" 2>&1
    tail -2 "$OUT/lora_longest.log" ;;
  lora-longest-peer)
    install_b; env_site; fa4; versions
    # the peer's LoRA one step past 262,144 (full depth; 300 s was not enough cold)
    timeout 570 python3 benchmarks/peer_trl.py --model qwen3.5-9b --lengths 327680 --steps 1 --lora \
        --json "$OUT/peer_lora_327680.json" > "$OUT/peer_lora_327680.log" 2>&1; tail -3 "$OUT/peer_lora_327680.log" ;;
  ops-128k)
    install_b; env_site; fa4; versions
    # which aten ops and lines launch the 128K step's copies, concatenations and elementwise kernels: 4 layers at
    # the levers `auto` picks at full depth (attention kept, no TiledMLP, a quarter of the layers offloaded)
    $BENCH --model qwen3.5-9b --layers 4 --lengths 131072 --levers all --set model.keep_attention_fraction=1 \
        --set model.tiled_mlp=false --set model.activation_offload_fraction=0.25 --optimizer none --attn fa4 \
        --steps 1 --time-breakdown-ops --timeout 400 --json "$OUT/ops_128k_4l.json" > "$OUT/ops_128k.log" 2>&1
    tail -3 "$OUT/ops_128k.log" ;;
  olmo-mixer)
    install_b; env_site; fa4; versions
    # OLMo-hybrid's Gated DeltaNet alone (heads 96 / 192 wide: fla's Triton kernels, compiled and autotuned on first
    # use: 213 s for both lengths), with Triton's autotuning printed (where the time goes), then Triton's and
    # TileLang's caches as tars to carry next time. (Stacks dumped by faulthandler every 60 s, tried once, crashed
    # the process inside Triton's compile: no such watchdog here.)
    TRITON_PRINT_AUTOTUNING=1 timeout 520 python3 benchmarks/mixer_memory.py --lengths 32768,65536 \
        --mixers "olmo-hybrid GDN" --json "$OUT/mixer_memory_olmo.json" > "$OUT/mixer_memory_olmo.log" 2>&1
    grep -E "^(mixer|olmo|measuring)" "$OUT/mixer_memory_olmo.log" | tail -4
    [ -d ~/.triton/cache ] && tar -cf "$OUT/triton_cache.tar" -C ~ .triton/cache && du -sh "$OUT/triton_cache.tar"
    [ -d ~/.tilelang ] && tar -cf "$OUT/tilelang_cache.tar" -C ~ .tilelang && du -sh "$OUT/tilelang_cache.tar"; true ;;
  moe-128k)
    install_b; env_site; fa4; versions
    # Qwen3.5-35B-A3B at 4 layers (3 linear + 1 full), every lever, AdamW on the GPU: the families table's form
    $BENCH --model qwen3.5-35b-a3b --layers 4 --lengths 131072 --levers all --optimizer gpu --attn fa4 --steps 2 \
        --timeout 300 --json "$OUT/qwen3.5-35b-a3b_4l_128k.json" > "$OUT/moe_128k.log" 2>&1; tail -3 "$OUT/moe_128k.log" ;;
  eval-cost)
    env_site; fa4; versions
    python3 -c "from ulysses_train.model.presets import save_qwen3_config as s; s('qwen3-4b', '/tmp/qwen3-4b')"
    python3 benchmarks/yarn_probe_task.py --prepare /tmp/probe_tok > /dev/null 2>&1
    timeout 280 python3 -m torch.distributed.run --standalone --nproc_per_node 1 scripts/eval_context.py \
        --model /tmp/qwen3-4b --random-init --tokenizer /tmp/probe_tok --lengths 131072 --depths 0,25,50,75,100 \
        --tasks passkey,multikey --set model.attn_implementation=fa4 --out "$OUT/eval_4b_128k" > "$OUT/eval_cost.log" 2>&1
    tail -4 "$OUT/eval_cost.log"
    $BENCH --model qwen3-4b --lengths 131072 --levers all --attn fa4 --steps 2 --timeout 240 \
        --json "$OUT/qwen3-4b_128k_train.json" > "$OUT/bench_4b.log" 2>&1; tail -3 "$OUT/bench_4b.log" ;;
  mixers)
    env_site; fa4; versions
    timeout 400 python3 benchmarks/mixer_memory.py --lengths 32768,65536 --json "$OUT/mixer_memory.json" \
        > "$OUT/mixer_memory.log" 2>&1; grep -v -i warn "$OUT/mixer_memory.log" | tail -12 ;;
  warm-a|warm-compile|warm-first|warm-262k|warm-first-4l|warm-carried)
    install_b
    env_site; fa4; versions
    cfg=configs/qwen3_5_9b_sessions_256k_1gpu.yaml
    # every stage pins the levers full depth gets with no optimizer update on this machine (`plan.py --model
    # qwen3.5-9b --seq-length L --gpus-per-node 1 --offload-activations --attention fa4 --flash-qla --liger
    # --auto-levers --gpu-gib 139.8 --host-gib 125 --optimizer none`: attention kept, no TiledMLP, 25% offloaded at
    # 131,072, 100% at 262,144; the config's AdamW on the host fits nothing on a 125 GiB host), so the warmed step
    # and the measured ones compile the same kernel variants
    pin=(--set model.keep_attention_fraction=1 --set model.tiled_mlp=false --set model.activation_offload_fraction)
    at131k=(--set data.seq_length=131072 "${pin[@]}"=0.25); at262k=("${pin[@]}"=1.0)
    # one bench.py run of the Qwen3.5 1-GPU config on the kernel caches under $1 (every cache: Triton, TileLang,
    # FlashAttention 4's), its wall time and the row's step seconds and first-use costs (training/step_costs.py)
    on_caches() {
      local caches=$1 name=$2 limit=$3; shift 3
      ULYSSES_TRAIN_KERNEL_CACHE="$caches" /usr/bin/time -f "%e s wall" timeout "$limit" python3 scripts/bench.py \
          --config "$cfg" --model qwen3.5-9b --timeout "$limit" --json "$OUT/warm_$name.json" "$@" \
          > "$OUT/warm_$name.log" 2>&1
      tail -1 "$OUT/warm_$name.log"; grep -E "engine built|step [0-9]:" "$OUT/warm_$name.log" | cut -c1-120
      python3 -c "import json, sys; [print(c) for r in json.load(open(sys.argv[1])) for c in r.get('step_costs', [])]" \
          "$OUT/warm_$name.json" 2>/dev/null; }
    case "$STAGE" in
      warm-a)  # without warming: the cold first step at 4 layers on empty caches (compiles everything inside it)
        on_caches /tmp/kc_cold cold 590 --layers 4 --steps 0 "${at131k[@]}" ;;
      warm-compile)  # warm_kernels.py into empty caches, timed; the caches come back as a tar to carry
        ULYSSES_TRAIN_KERNEL_CACHE=/tmp/kc_warm /usr/bin/time -f "%e s wall" timeout 585 python3 \
            scripts/warm_kernels.py --config "$cfg" "${at131k[@]}" --timeout 575 \
            --tar /tmp/kc_warm.tar > "$OUT/warm_kernels.log" 2>&1
        grep -v -E "it/s|s/it" "$OUT/warm_kernels.log" | tail -14 | cut -c1-240
        du -sh /tmp/kc_warm/* 2>/dev/null
        [ -f /tmp/kc_warm.tar ] && xz -T0 -6 -c /tmp/kc_warm.tar > "$OUT/kernel-cache-qwen3.5.tar.xz" \
            && du -sh "$OUT/kernel-cache-qwen3.5.tar.xz"; true ;;
      warm-first)  # after warming: the 4-layer step (first against second), then full depth at 131,072 (the same)
        on_caches /tmp/kc_warm after 200 --layers 4 --optimizer none --steps 1 "${at131k[@]}"
        on_caches /tmp/kc_warm 131k 420 --optimizer none --steps 1 "${at131k[@]}" ;;
      warm-262k)  # after warming: full depth at 262,144 (its first step took 126.3 s and the second 66.3 s)
        on_caches /tmp/kc_warm 262k 580 --optimizer none --steps 1 "${at262k[@]}" ;;
      warm-first-4l)  # after warming, where full depth does not fit (an 80 GB H100): 4 layers, first step against
        # second, at 131,072 and at 262,144 tokens (the longer length's shapes were not warmed)
        on_caches /tmp/kc_warm 4l_131k 200 --layers 4 --optimizer none --steps 1 "${at131k[@]}"
        on_caches /tmp/kc_warm 4l_262k 300 --layers 4 --optimizer none --steps 1 "${at262k[@]}" ;;
      warm-carried)  # a fresh machine on the caches another one warmed (.kcq, restored by setup-fa4a): the 4-layer
        # first step against the second; both steps were also profiled once, by
        # `benchmarks/first_step_profile.py` (removed; it ran at commit 8c096a2, `git show 8c096a2:benchmarks/first_step_profile.py`)
        on_caches /tmp/kc_warm carried 200 --layers 4 --optimizer none --steps 1 "${at131k[@]}" ;;
    esac ;;
  *) echo "unknown stage $STAGE (see the header of $0)"; exit 2 ;;
esac
