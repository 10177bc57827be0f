#!/usr/bin/env bash
# The GPU-machine commands behind benchmarks/RESULTS.md (correctness in bf16, speed, memory and scaling on 1, 2, 4
# and 8 GPUs): one STAGE per device call (each sized for one 10-minute command).
# The scripts they call are tested on CPU (tests/). RESULTS.md names the stage behind each result it reports.
# Not yet run: x1-384k-share, x2-emulate-validate, and the x2/x4/x8 scaling and length stages.
# Usage on the GPU machine (repo root, .whl/ carried):
#   bash benchmarks/multi_gpu.sh STAGE OUT_DIR
# Stages (device kind in brackets):
#   x2-equality   [nvidia-h200-x2]  sp=2 vs the plain model, Qwen3-0.6B shapes, 16K tokens, bf16; + negative control
#   x2-equality-levers [nvidia-h200-x2]  the same with every lever on (activation offload on CUDA streams, TiledMLP,
#                                   attention kept in every layer): sp=2, and sp=1 on one GPU
#   x1-equality-levers [any H200]   its sp=1 half only (x2-equality-levers-sp2: its sp=2 half only)
#   x2-norm-ab    [nvidia-h200-x2]  x2-equality-levers-sp2, then full depth at 128K with each RMSNorm kernel (one per
#                                   GPU, at once), a 12-layer A/B of the two, and the profiled 12-layer step
#   x2-bench      [nvidia-h200-x2]  Qwen3-4B shapes, 12 layers, 64K/128K/256K: 1 GPU vs sp=2 (all levers), all-to-all share
#                   (the same points split to fit 10-minute commands: x2-bench1, x2-bench1-256k, x2-bench2)
#   x2-bisect     [nvidia-h200-x2]  which part of the sp path moves bf16 gradients off (2 layers, 8K tokens): 1 GPU,
#                                   sp=2, and sp=2 with one lever or setting changed at a time
#   x1-bisect     [nvidia-h200-x2]  one GPU, 2 layers, 8K tokens: loaded weights, nll loss, no checkpointing, fp32,
#                                   shorter sequence (two runs at a time, one per GPU)
#   x1-cuda-tests [any H200]        the tests that only run on CUDA (offload's side streams and pinned buffers)
#   x1-layout-check [any H200]      after a change of structure: x1-cuda-tests, x1-equality-levers and a 12-layer 128K
#                                   step with every lever (SDPA), in one command (~7 minutes)
#   x1-torchnorm  [any H200]        model.rmsnorm: torch (fused CUDA RMSNorm): a 12-layer 128K step against the chunked
#                                   norm, and the bf16 gradient check
#   x1-packed     [any H200]        document packing: the FA4 CUDA tests (variable-length kernel included) and a Qwen3-4B
#                                   full-depth 128K step, 16 documents vs one sequence (after `fa4_bundle.sh stash`)
#   x1-defaults   [any H200]        after `fa4_bundle.sh stash`: Qwen3-4B 128K as the shipped 1-GPU config runs it (auto
#                                   levers) against the best hand-set levers, three timed steps each
#   x1-defaults-profile [any H200]  x1-defaults' first point, one timed step, and one more under torch.profiler
#   x1-defaults-ab [any H200]       x1-defaults' first point as shipped and with SETS (run-config overrides)
#   x1-defaults-256k [any H200]     the same config at its own 262,144 tokens (auto levers), one timed step
#   x2-fa4        [nvidia-h200-x2]  after a call `bash benchmarks/fa4_bundle.sh stash` (carry .fa4a), at once: model.attn_implementation=fa4, full depth 128K on GPU 0; its
#                                   CUDA test, bf16 gradient check (sp=1, every lever), 12-layer A/B vs SDPA on GPU 1
#   x2-fa4-steady [nvidia-h200-x2]  the same way: full depth 128K, fa4, three timed steps, with and without TiledMLP
#   x2-fa4-sp2    [nvidia-h200-x2]  the same way: the bf16 gradient check at sp=2 with fa4 and every lever
#   x1-mfu        [any H200]        Qwen3-4B, 12 layers, 128K, warm step, HF norm and low-memory norm, with
#                                   the profiled step's device time by kind of work (where the 45% MFU target is lost;
#                                   at full depth the profiled step did not finish within 290 s)
#   x1-full128k   [any H200]        Qwen3-4B full depth, 128K, all levers (low-memory norm), warm step
#   x1-384k       [nvidia-h200-x2]  Qwen3-4B full depth, 393,216 tokens, one GPU, one cold step; needs the
#                                   ~195 GiB of host memory that the 2-GPU machine has (the 1-GPU one has 125)
#   x2-384k-torchnorm [nvidia-h200-x2] x1-384k on GPU 0 and x1-torchnorm + x1-cuda-tests on GPU 1 at once (START: the
#                                   command's start, date +%s, so the 384K point ends inside a 10-minute command)
#   x1-384k-share [any H200]        the same on the 1-GPU host's 125 GiB: 0.6 of the layers offloaded, the rest on the
#                                   GPU (planner: 75.4 GiB GPU, 113.7 GiB host), attention recomputed. ~480 s of
#                                   compute at the 256K run's rate, so it only fits a 10-minute command on a fast machine
#   x1-emulate-validate [any H200]  an emulated sp=2 rank (scripts/bench.py --emulate-sp 2, parallel/emulate.py) of the
#                                   x2-bench points (Qwen3-4B widths, 12 layers, 64K/128K/256K, the RMSNorm those runs had),
#                                   and with WITH_1GPU=1 the 1-GPU points at 64K/128K again, to compare sessions (~6 minutes)
#   x2-emulate-validate [nvidia-h200-x2]  the emulation's check on one host: real sp=2 (--comm-share), the emulated
#                                   sp=2 rank and 1 GPU, Qwen3-4B widths, 12 layers, 64K/128K/256K (~9 minutes)
#   x1-emulate-1m [any H200]        after `fa4_bundle.sh stash`: emulated ranks at 1,048,576 tokens, FA4, every lever,
#                                   attention recomputed, AdamW on the host: Qwen3-8B sp=8 and Qwen3-4B sp=4, each at 1
#                                   and 2 layers (full depth = the per-layer slope added back; ~8 minutes)
#   x1-emulate-longest [any H200]   after `fa4_bundle.sh stash`: the longest Qwen3-8B sequence the planner fitted on one
#                                   8 x H200 node (560 GiB host; AdamW on the host, every lever, attention recomputed:
#                                   LENGTH, default 1,433,144 tokens, its limit before it counted the host AdamW step's
#                                   temporaries; 1,209,928 since) as emulated sp=8 ranks at 1 and 2 layers (~4 minutes)
#   x1-families   [any H200]        after `fa4_bundle.sh stash`: the model families at real widths and reduced depth,
#                                   131,072 tokens, every lever, FA4, AdamW on the GPU: Qwen3-30B-A3B (4 layers),
#                                   GPT-OSS-20B (4: two windowed, two full), Gemma 3 12B (6: five windowed, one full)
#   x1-families-grads [any H200]    the same way: each family's bf16 gradient check at sp=1 against the plain model
#                                   (2 layers; GPT-OSS 4,096 tokens against transformers' eager attention, which has
#                                   the sinks; Qwen3-30B-A3B 8,192 and Gemma 3 16,384 against SDPA, whose fp32 math
#                                   kernel holds all scores); FAMILIES: a subset (model:length:attn)
#   x1-fa4-tests  [any H200]        after `fa4_bundle.sh stash`: tests/test_fa4.py on CUDA (windows, sinks, documents)
#   x1-emulate-scaling [any H200]   the same way: Qwen3-8B shapes, full depth, 131,072 tokens, emulated sp = 2, 4, 8,
#                                   --optimizer none as the x8-scaling stage (~7 minutes)
#   x2-scaling1   [any H200]        Qwen3-8B shapes, 131,072 tokens, one GPU (the base of the scaling stages)
#   x2-scaling    [nvidia-h200-x2]  the same on one GPU and with sp=2 (planner: ~61 s and ~30.5 s)
#   x4-scaling    [nvidia-h200-x4]  Qwen3-8B shapes, 131,072 tokens, sp = 2 and 4
#   x4-512k       [nvidia-h200-x4]  Qwen3-4B shapes, full depth, 524,288 tokens, sp=4, one cold step
#   x4-1m         [nvidia-h200-x4]  Qwen3-4B shapes, 8 layers, 1,048,576 tokens, sp=4 (add the planner's per-layer terms)
#   x8-1m         [nvidia-h200-x8]  Qwen3-8B shapes, full depth, 1,048,576 tokens, sp=8, one cold step
#   x8-scaling    [nvidia-h200-x8]  Qwen3-8B shapes, 131,072 tokens, sp = 2, 4, 8
# Scaling points use --optimizer none (forward, backward and the ZeRO-3 gradient reduction; no Adam step),
# so a 1-GPU point of an 8B model fits and the counts compare the same work. Long single steps use the
# optimizer on the host (--optimizer cpu), as a real run at that length would.
set -uo pipefail
STAGE=${1:?stage}; OUT=${2:-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}"   # the package from this checkout (not pip-installed on the GPU machine)
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
if [ -d /tmp/site/deepspeed ]; then export PYTHONPATH=/tmp/site:${PYTHONPATH:-} PATH=/tmp/site/bin:$PATH   # warm machine
elif ! python3 -c "import deepspeed" 2>/dev/null; then eval "$(bash scripts/install_wheelhouse.sh .whl /tmp/site | tail -1)"; fi
python3 -c "import torch, transformers, deepspeed; print('torch', torch.__version__, 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__, torch.cuda.device_count(), 'x', torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
BENCH="python3 scripts/bench.py"
case "$STAGE" in
  x2-equality)
    RUN="python3 -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/gpu_equality.py --model qwen3-0.6b --length 16384 --sp 2"
    timeout 280 $RUN --json "$OUT/equality_sp2.json" 2>&1 | grep -E "^loss|gradients,|PASS|FAIL|^  " | tee "$OUT/equality.log"
    timeout 280 $RUN --control --json "$OUT/equality_control.json" 2>&1 | grep -E "^loss|gradients,|PASS|FAIL" | tee -a "$OUT/equality.log" ;;
  x2-bench)
    $BENCH --model qwen3-4b --layers 12 --lengths 65536,131072,262144 --levers all --steps 1 --timeout 150 \
        --json "$OUT/bench_1gpu.json" 2>&1 | tail -6
    $BENCH --model qwen3-4b --layers 12 --lengths 65536,131072,262144 --levers all --steps 1 --sp 2 --nproc 2 --comm-share \
        --timeout 150 --json "$OUT/bench_sp2.json" 2>&1 | tail -6 ;;
  x2-bisect)
    mkdir -p /tmp/bisect; rm -f /tmp/bisect/*.json
    eq() {  # NAME NPROC ARGS...: one gpu_equality run, its verdict lines to the log
      local name=$1 n=$2; shift 2
      echo "== $name"
      timeout 150 python3 -m torch.distributed.run --standalone --nproc_per_node "$n" benchmarks/gpu_equality.py \
          --model qwen3-0.6b --layers 2 --length 8192 --json "/tmp/bisect/$name.json" "$@" 2>&1 | grep -E "^loss|gradients,|PASS|FAIL"
    }
    {
      eq sp1_1gpu 1 --sp 1
      eq sp2 2 --sp 2
      eq sp2_torch_sdpa_order 2 --sp 2 --torch-sdpa-order
      eq sp2_hf_rmsnorm 2 --sp 2 --set rmsnorm=hf
      eq sp2_no_tiled_mlp 2 --sp 2 --set tiled_mlp=false
      eq sp2_no_overlap_comm 2 --sp 2 --zero overlap_comm=false
      eq sp1_1gpu_torch_sdpa_order 1 --sp 1 --torch-sdpa-order
    } 2>&1 | tee "$OUT/bisect.log"
    python3 -c "import json,glob,os; json.dump({os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob('/tmp/bisect/*.json'))}, open('$OUT/bisect.json','w'), indent=1)" ;;
  x1-bisect)
    mkdir -p /tmp/bisect; rm -f /tmp/bisect/*.json
    eq1() {  # NAME GPU ARGS...: one single-GPU gpu_equality run, its verdict lines to /tmp/bisect/NAME.log
      local name=$1 gpu=$2; shift 2
      CUDA_VISIBLE_DEVICES=$gpu timeout 200 python3 -m torch.distributed.run --standalone --nproc_per_node 1 \
          benchmarks/gpu_equality.py --model qwen3-0.6b --layers 2 --sp 1 --workdir "/tmp/geq_$name" \
          --json "/tmp/bisect/$name.json" "$@" 2>&1 | grep -E "^loss|gradients,|PASS|FAIL|loaded" > "/tmp/bisect/$name.log"
    }
    eq1 default 0 --length 8192 & eq1 nll_loss 1 --length 8192 --loss nll & wait
    eq1 no_checkpointing 0 --length 8192 --set gradient_checkpointing=false & eq1 fp32 1 --length 8192 --dtype float32 & wait
    eq1 len1024 0 --length 1024 & eq1 fp32_len1024 1 --length 1024 --dtype float32 & wait
    for f in /tmp/bisect/*.log; do echo "== $f"; cat "$f"; done | tee "$OUT/bisect1.log"
    python3 -c "import json,glob,os; json.dump({os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob('/tmp/bisect/*.json'))}, open('$OUT/bisect1.json','w'), indent=1)" ;;
  x1-layout-check)
    for stage in x1-cuda-tests x1-equality-levers; do bash "$0" $stage "$OUT"; done
    $BENCH --model qwen3-4b --layers 12 --lengths 131072 --levers all --steps 2 --timeout 240 \
        --json "$OUT/layout_check_12_layers_128k.json" 2>&1 | tail -3 ;;
  x1-cuda-tests)
    PYTHONPATH=.:$PYTHONPATH python3 -m pytest -q -p no:cacheprovider tests/test_levers.py -k cuda 2>&1 | tail -15 | tee "$OUT/cuda_tests.log" ;;
  x1-torchnorm)
    $BENCH --model qwen3-4b --layers 12 --lengths 131072 --levers allchunkednorm,alltorchnorm --steps 1 --timeout 200 \
        --json "$OUT/torchnorm_12_layers.json" 2>&1 | tail -4
    timeout 200 python3 -m torch.distributed.run --standalone --nproc_per_node 1 benchmarks/gpu_equality.py \
        --model qwen3-0.6b --length 16384 --sp 1 --set rmsnorm=torch --json "$OUT/equality_torchnorm.json" \
        2>&1 | grep -E "^loss|gradients,|PASS|FAIL" | tee "$OUT/equality_torchnorm.log" ;;
  x1-mfu)
    $BENCH --model qwen3-4b --layers 12 --lengths 131072 --levers allhfnorm,all --steps 1 --time-breakdown --timeout 240 \
        --json "$OUT/mfu_128k_12_layers.json" 2>&1 | tail -8 ;;
  x1-full128k)
    $BENCH --model qwen3-4b --lengths 131072 --levers all --steps 1 --timeout 400 \
        --json "$OUT/full_depth_128k.json" 2>&1 | tail -4 ;;
  x2-equality-levers|x1-equality-levers|x2-equality-levers-sp2)
    LEVERS="--set keep_attention_fraction=1.0 --set tiled_mlp=true --offload-activations"
    SIZES="2 1"; [ "$STAGE" = x1-equality-levers ] && SIZES=1; [ "$STAGE" = x2-equality-levers-sp2 ] && SIZES=2
    for n in $SIZES; do
      timeout 280 python3 -m torch.distributed.run --standalone --nproc_per_node $n benchmarks/gpu_equality.py \
          --model qwen3-0.6b --length 16384 --sp $n $LEVERS --json "$OUT/equality_levers_sp$n.json" 2>&1 \
          | grep -E "^loss|gradients,|PASS|FAIL|loaded" | tee -a "$OUT/equality_levers.log"
    done ;;
  x2-bench1)
    $BENCH --model qwen3-4b --layers 12 --lengths 65536,131072 --levers all,allhfnorm --steps 1 --timeout 150 \
        --json "$OUT/bench_1gpu.json" 2>&1 | tail -8 ;;
  x2-bench1-256k)
    $BENCH --model qwen3-4b --layers 12 --lengths 262144 --levers all --steps 1 --timeout 240 \
        --json "$OUT/bench_1gpu_256k.json" 2>&1 | tail -4 ;;
  x2-bench2)
    $BENCH --model qwen3-4b --layers 12 --lengths 65536,131072,262144 --levers all --steps 1 --sp 2 --nproc 2 --comm-share \
        --timeout 200 --json "$OUT/bench_sp2.json" 2>&1 | tail -6 ;;
  x1-384k)  # KEEP (share of layers whose attention is kept; host memory bounds it), TIMEOUT: optional
    $BENCH --model qwen3-4b --lengths 393216 --levers all --keep-fraction "${KEEP:-0.5}" --optimizer cpu --steps 0 \
        --timeout "${TIMEOUT:-585}" --json "$OUT/full_depth_384k.json" 2>&1 | tail -4 ;;
  x2-384k-torchnorm)
    # x1-384k on GPU 0 (attention kept in half the layers if the host has the memory, a quarter or none if not),
    # and x1-torchnorm then x1-cuda-tests on GPU 1, at once; the GPU-1 results packed into one file
    AVAIL=$(awk '/MemAvailable/ {print int($2 / 1048576)}' /proc/meminfo)
    KEEP=0; [ "$AVAIL" -ge 200 ] && KEEP=0.25; [ "$AVAIL" -ge 235 ] && KEEP=0.5
    echo "host memory available ${AVAIL} GiB: keep fraction $KEEP at 384K" | tee "$OUT/gpu0.log"
    SPENT=$(( $(date +%s) - ${START:-$(date +%s)} ))
    CUDA_VISIBLE_DEVICES=0 KEEP=$KEEP TIMEOUT=$(( 570 - SPENT )) bash "$0" x1-384k "$OUT" >> "$OUT/gpu0.log" 2>&1 &
    ( CUDA_VISIBLE_DEVICES=1 bash "$0" x1-torchnorm /tmp/gpu1; CUDA_VISIBLE_DEVICES=1 bash "$0" x1-cuda-tests /tmp/gpu1
      tar -czf "$OUT/gpu1.tgz" -C /tmp gpu1 ) > "$OUT/gpu1.log" 2>&1 &
    wait ;;
  x1-384k-share)
    $BENCH --model qwen3-4b --lengths 393216 --levers all --keep-fraction 0 --offload-fraction 0.6 --optimizer cpu \
        --steps 0 --timeout 590 --json "$OUT/full_depth_384k_share.json" 2>&1 | tail -4 ;;
  x1-packed)
    # call 2 after `bash benchmarks/fa4_bundle.sh stash` (carry .fa4a), carrying .whl and .fa4b: document packing on
    # one H200. The FA4 CUDA tests (varlen included), then Qwen3-4B full depth at 131,072 tokens, one sequence vs
    # 16 documents, every lever with attention kept in every layer (~7 minutes)
    eval "$(bash benchmarks/fa4_bundle.sh unpack)"
    python3 -c "import flash_attn.cute" || exit 3
    PYTHONPATH=.:$PYTHONPATH python3 -m pytest -q -p no:cacheprovider tests/test_fa4.py 2>&1 | tail -3
    $BENCH --model qwen3-4b --lengths 131072 --levers all --attn fa4 --documents 0,16 --steps 2 --timeout 330 \
        --json "$OUT/packed_4b_128k.json" 2>&1 | tail -4 ;;
  x1-defaults)
    # call 2 after `bash benchmarks/fa4_bundle.sh stash` (carry .fa4a), carrying .whl and .fa4b: the fast path by
    # default. Qwen3-4B full depth at 131,072 tokens exactly as configs/qwen3_4b_256k_1gpu.yaml runs it (auto
    # levers chosen by the planner, its DeepSpeed JSON, AdamW on the GPU, FA4 by attn auto), three timed steps;
    # then the best hand-set levers (every lever, attention kept in every layer), three timed steps (~8 minutes)
    eval "$(bash benchmarks/fa4_bundle.sh unpack)"
    python3 -c "import flash_attn.cute" || exit 3
    $BENCH --config configs/qwen3_4b_256k_1gpu.yaml --model qwen3-4b --lengths 131072 --steps 3 --timeout 270 \
        --json "$OUT/defaults_4b_128k.json" 2>&1 | tail -3
    $BENCH --model qwen3-4b --lengths 131072 --levers all --attn fa4 --steps 3 --timeout 270 \
        --json "$OUT/handset_4b_128k.json" 2>&1 | tail -3 ;;
  x1-defaults-profile)
    # the same way as x1-defaults (FA4 unpacked on the warm machine): its first point, one timed step, then one
    # more under torch.profiler (device time by kind of kernel, the costliest kernels; ~4 minutes)
    eval "$(bash benchmarks/fa4_bundle.sh unpack)"
    python3 -c "import flash_attn.cute" || exit 3
    $BENCH --config configs/qwen3_4b_256k_1gpu.yaml --model qwen3-4b --lengths 131072 --steps 1 --time-breakdown \
        --timeout 400 --json "$OUT/defaults_4b_128k_profile.json" 2>&1 | tail -3 ;;
  x1-defaults-ab)
    # the same way: the x1-defaults point as shipped and with SETS (run-config overrides, e.g.
    # "loss.chunk_rows=1024"), three timed steps each (~8 minutes)
    eval "$(bash benchmarks/fa4_bundle.sh unpack)"
    python3 -c "import flash_attn.cute" || exit 3
    $BENCH --config configs/qwen3_4b_256k_1gpu.yaml --model qwen3-4b --lengths 131072 --steps 3 --timeout 270 \
        --json "$OUT/defaults_4b_128k.json" 2>&1 | tail -3
    $BENCH --config configs/qwen3_4b_256k_1gpu.yaml --model qwen3-4b --lengths 131072 --steps 3 --timeout 270 \
        $(for s in ${SETS:?}; do printf -- '--set %s ' "$s"; done) --json "$OUT/defaults_4b_128k_changed.json" 2>&1 | tail -3 ;;
  x1-defaults-256k)
    # the same way (FA4 unpacked on the warm machine): configs/qwen3_4b_256k_1gpu.yaml at its own 262,144 tokens,
    # auto levers, one timed step after the warm-up (~6 minutes)
    eval "$(bash benchmarks/fa4_bundle.sh unpack)"
    $BENCH --config configs/qwen3_4b_256k_1gpu.yaml --model qwen3-4b --steps 1 --timeout 540 \
        --json "$OUT/defaults_4b_256k.json" 2>&1 | tail -3 ;;
  x2-fa4)
    # call 2 (carry .whl and .fa4b, the machine still warm): FlashAttention 4 as the model's attention. GPU 0:
    # full depth at 128K (the MFU target's point); GPU 1: its CUDA test, the bf16 gradient check at sp=1 with
    # every lever, and a 12-layer 128K A/B against SDPA (cuDNN), two timed steps each
    eval "$(bash benchmarks/fa4_bundle.sh unpack)"
    python3 -c "import flash_attn.cute, torch; print('flash_attn.cute ok on', torch.cuda.get_device_name())" || exit 3
    ( CUDA_VISIBLE_DEVICES=0 $BENCH --model qwen3-4b --lengths 131072 --levers all --attn fa4 --steps 1 --timeout 330 \
          --json "$OUT/full_depth_128k_fa4.json" 2>&1 | tail -3 ) > "$OUT/gpu0.log" 2>&1 &
    ( export CUDA_VISIBLE_DEVICES=1
      PYTHONPATH=.:$PYTHONPATH python3 -m pytest -q -p no:cacheprovider tests/test_fa4.py 2>&1 | tail -3
      timeout 200 python3 -m torch.distributed.run --standalone --nproc_per_node 1 benchmarks/gpu_equality.py \
          --model qwen3-0.6b --length 16384 --sp 1 --set attn_implementation=fa4 --set keep_attention_fraction=1.0 \
          --set tiled_mlp=true --offload-activations --json "$OUT/equality_fa4_sp1.json" 2>&1 \
          | grep -E "^loss|gradients,|PASS|FAIL"
      $BENCH --model qwen3-4b --layers 12 --lengths 131072 --levers all --attn sdpa,fa4 --steps 2 --timeout 150 \
          --json "$OUT/fa4_12_layers_128k.json" 2>&1 | tail -4 ) > "$OUT/gpu1.log" 2>&1 &
    wait; cat "$OUT/gpu0.log" "$OUT/gpu1.log" ;;
  x2-fa4-steady)
    # after `bash benchmarks/fa4_bundle.sh stash`, like x2-fa4: full depth at 128K with FlashAttention 4, three
    # timed steps after the warm-up (ZeRO-3 prefetches only once its trace of a step is complete), with
    # TiledMLP (GPU 0) and without (GPU 1: no extra MLP forward, more memory)
    eval "$(bash benchmarks/fa4_bundle.sh unpack)"
    ( CUDA_VISIBLE_DEVICES=0 $BENCH --model qwen3-4b --lengths 131072 --levers all --attn fa4 --steps 3 --timeout 500 \
          --json "$OUT/full_depth_128k_fa4_steady.json" 2>&1 | tail -3 ) > "$OUT/gpu0.log" 2>&1 &
    ( CUDA_VISIBLE_DEVICES=1 $BENCH --model qwen3-4b --lengths 131072 --levers alluntiled --attn fa4 --steps 3 \
          --timeout 500 --json "$OUT/full_depth_128k_fa4_untiled.json" 2>&1 | tail -3 ) > "$OUT/gpu1.log" 2>&1 &
    wait; cat "$OUT/gpu0.log" "$OUT/gpu1.log" ;;
  x2-fa4-sp2)
    # after `bash benchmarks/fa4_bundle.sh stash`: the bf16 gradient check at sp=2 (Ulysses over NCCL) with
    # FlashAttention 4 and every lever, against the plain model on SDPA
    eval "$(bash benchmarks/fa4_bundle.sh unpack)"
    timeout 300 python3 -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/gpu_equality.py \
        --model qwen3-0.6b --length 16384 --sp 2 --set attn_implementation=fa4 --set keep_attention_fraction=1.0 \
        --set tiled_mlp=true --offload-activations --json "$OUT/equality_fa4_sp2.json" 2>&1 \
        | grep -E "^loss|gradients,|PASS|FAIL|loaded|Error" ;;
  x2-norm-ab)
    # the sp=2 half of x2-equality-levers, then two GPUs at once: full depth at 128K with each norm kernel
    # (warm step; same conditions on both GPUs), a 12-layer A/B with two timed steps, and the profiled step
    bash "$0" x2-equality-levers-sp2 "$OUT"
    ( CUDA_VISIBLE_DEVICES=0 $BENCH --model qwen3-4b --lengths 131072 --levers alltorchnorm --steps 1 --timeout 260 \
          --json "$OUT/full_depth_128k_torchnorm.json" 2>&1 | tail -2
      CUDA_VISIBLE_DEVICES=0 $BENCH --model qwen3-4b --layers 12 --lengths 131072 --levers allchunkednorm,alltorchnorm --steps 2 \
          --timeout 120 --json "$OUT/torchnorm_12_layers.json" 2>&1 | tail -3 ) > "$OUT/gpu0.log" 2>&1 &
    ( CUDA_VISIBLE_DEVICES=1 $BENCH --model qwen3-4b --lengths 131072 --levers allchunkednorm --steps 1 --timeout 260 \
          --json "$OUT/full_depth_128k_chunked.json" 2>&1 | tail -2
      CUDA_VISIBLE_DEVICES=1 $BENCH --model qwen3-4b --layers 12 --lengths 131072 --levers alltorchnorm --steps 1 \
          --time-breakdown --timeout 150 --json "$OUT/mfu_128k_torchnorm.json" 2>&1 | tail -8 ) > "$OUT/gpu1.log" 2>&1 &
    wait; cat "$OUT/gpu0.log" "$OUT/gpu1.log" ;;
  x1-emulate-validate)
    $BENCH --model qwen3-4b --layers 12 --lengths 65536,131072,262144 --levers allchunkednorm --steps 1 --emulate-sp 2 \
        --timeout 150 --json "$OUT/emulated_sp2.json" 2>&1 | tail -8
    [ -n "${WITH_1GPU:-}" ] && $BENCH --model qwen3-4b --layers 12 --lengths 65536,131072 --levers allchunkednorm \
        --steps 1 --timeout 150 --json "$OUT/bench_1gpu_again.json" 2>&1 | tail -3 ;;
  x2-emulate-validate)
    $BENCH --model qwen3-4b --layers 12 --lengths 65536,131072,262144 --levers allchunkednorm --steps 1 --sp 2 --nproc 2 \
        --comm-share --timeout 150 --json "$OUT/real_sp2.json" 2>&1 | tail -5
    $BENCH --model qwen3-4b --layers 12 --lengths 65536,131072,262144 --levers allchunkednorm --steps 1 --emulate-sp 2 \
        --timeout 150 --json "$OUT/emulated_sp2.json" 2>&1 | tail -8
    $BENCH --model qwen3-4b --layers 12 --lengths 65536,131072 --levers allchunkednorm --steps 1 --timeout 150 \
        --json "$OUT/bench_1gpu.json" 2>&1 | tail -3 ;;
  x1-emulate-1m)
    eval "$(bash benchmarks/fa4_bundle.sh unpack)"
    python3 -c "import flash_attn.cute" || exit 3
    for layers in 1 2; do
      $BENCH --model qwen3-8b --layers $layers --lengths 1048576 --levers all --keep-fraction 0 --optimizer cpu \
          --attn fa4 --steps 1 --emulate-sp 8 --timeout 200 --json "$OUT/emulated_8b_1m_sp8_${layers}l.json" 2>&1 | tail -2
    done
    for layers in 1 2; do
      $BENCH --model qwen3-4b --layers $layers --lengths 1048576 --levers all --keep-fraction 0 --optimizer cpu \
          --attn fa4 --steps 1 --emulate-sp 4 --timeout 200 --json "$OUT/emulated_4b_1m_sp4_${layers}l.json" 2>&1 | tail -2
    done ;;
  x1-families)
    eval "$(bash benchmarks/fa4_bundle.sh unpack)"
    python3 -c "import flash_attn.cute" || exit 3
    for spec in qwen3-30b-a3b:4 gpt-oss-20b:4 gemma-3-12b:6; do
      $BENCH --model ${spec%:*} --layers ${spec#*:} --lengths 131072 --levers all --attn fa4 --steps 2 --timeout 200 \
          --json "$OUT/family_${spec%:*}_128k.json" 2>&1 | tail -1
    done ;;
  x1-families-grads)
    eval "$(bash benchmarks/fa4_bundle.sh unpack)"
    for spec in ${FAMILIES:-qwen3-30b-a3b:8192:sdpa gpt-oss-20b:4096:eager gemma-3-12b:16384:sdpa}; do
      IFS=: read -r model length reference <<< "$spec"
      timeout 170 python3 -m torch.distributed.run --standalone --nproc_per_node 1 benchmarks/gpu_equality.py \
          --model $model --layers 2 --length $length --sp 1 --reference-attn $reference --set attn_implementation=fa4 \
          --set keep_attention_fraction=1.0 --set tiled_mlp=true --offload-activations \
          --json "$OUT/equality_${model}.json" 2>&1 | grep -E "^loss|gradients,|PASS|FAIL|Error" | tee -a "$OUT/equality_families.log"
    done ;;
  x1-fa4-tests)
    eval "$(bash benchmarks/fa4_bundle.sh unpack)"
    python3 -c "import flash_attn.cute" || exit 3
    PYTHONPATH=.:$PYTHONPATH python3 -m pytest -q -p no:cacheprovider tests/test_fa4.py 2>&1 | tail -4 | tee "$OUT/fa4_tests.log" ;;
  x1-emulate-longest)
    eval "$(bash benchmarks/fa4_bundle.sh unpack)"
    python3 -c "import flash_attn.cute" || exit 3
    for layers in 1 2; do
      $BENCH --model qwen3-8b --layers $layers --lengths ${LENGTH:-1433144} --levers all --keep-fraction 0 --optimizer cpu \
          --attn fa4 --steps 1 --emulate-sp 8 --timeout 240 --json "$OUT/emulated_8b_longest_sp8_${layers}l.json" 2>&1 | tail -2
    done ;;
  x1-emulate-scaling)
    eval "$(bash benchmarks/fa4_bundle.sh unpack)"
    for n in ${SPS:-2 4 8}; do
      $BENCH --model qwen3-8b --lengths 131072 --levers all --optimizer none --attn fa4 --steps 1 --emulate-sp $n \
          --timeout 200 --json "$OUT/emulated_8b_128k_sp$n.json" 2>&1 | tail -2
    done ;;
  x2-scaling1)
    $BENCH --model qwen3-8b --lengths 131072 --levers all --optimizer none --steps 1 --timeout 560 \
        --json "$OUT/scaling_8b_1gpu.json" 2>&1 | tail -4 ;;
  x2-scaling)
    $BENCH --model qwen3-8b --lengths 131072 --levers all --optimizer none --steps 1 --timeout 330 \
        --json "$OUT/scaling_8b_1gpu.json" 2>&1 | tail -3
    $BENCH --model qwen3-8b --lengths 131072 --levers all --optimizer none --steps 1 --sp 2 --nproc 2 --comm-share \
        --timeout 250 --json "$OUT/scaling_8b_sp2.json" 2>&1 | tail -3 ;;
  x4-scaling)
    for n in 2 4; do
      $BENCH --model qwen3-8b --lengths 131072 --levers all --optimizer none --steps 1 --sp $n --nproc $n \
          --timeout 280 --json "$OUT/scaling_8b_sp$n.json" 2>&1 | tail -3
    done ;;
  x4-512k)
    $BENCH --model qwen3-4b --lengths 524288 --levers all --keep-fraction 0 --optimizer cpu --steps 0 --sp 4 --nproc 4 \
        --timeout 580 --json "$OUT/qwen3_4b_512k_sp4.json" 2>&1 | tail -3 ;;
  x4-1m)
    $BENCH --model qwen3-4b --layers 8 --lengths 1048576 --levers all --keep-fraction 0 --optimizer cpu --steps 0 \
        --sp 4 --nproc 4 --timeout 580 --json "$OUT/qwen3_4b_1m_sp4_8layers.json" 2>&1 | tail -3
    python3 scripts/plan.py --model qwen3-4b --seq-length 1048576 --gpus-per-node 4 --sp 4 --offload-activations \
        --offload-optimizer --tiled-mlp --host-gib 512 --gpu-gib 139 --no-story | tee "$OUT/plan_4b_1m_sp4.txt" | tail -4 ;;
  x8-1m)
    $BENCH --model qwen3-8b --lengths 1048576 --levers all --keep-fraction 0 --optimizer cpu --steps 0 --sp 8 --nproc 8 \
        --timeout 590 --json "$OUT/qwen3_8b_1m_sp8.json" 2>&1 | tail -3 ;;
  x8-scaling)
    for n in 2 4 8; do
      $BENCH --model qwen3-8b --lengths 131072 --levers all --optimizer none --steps 1 --sp $n --nproc $n \
          --timeout 190 --json "$OUT/scaling_8b_sp$n.json" 2>&1 | tail -3
    done ;;
  *) echo "unknown stage $STAGE (see the header of $0)"; exit 2 ;;
esac
