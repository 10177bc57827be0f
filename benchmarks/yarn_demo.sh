#!/usr/bin/env bash
# Loss by position past the training length, with and without YaRN: an honest substitute for the same curve
# of a pretrained Qwen3-4B (no pretrained weights can be downloaded here).
#
#   1. train the demo model (tiny Qwen3, demo.py) from scratch at length L on needle retrieval in which
#      every answer needs its needle (benchmarks/yarn_demo_task.py: the embedded demo's answers can be
#      copied), with its trained length set to L (max_position_embeddings = L); evaluations during
#      training at L and 4L;
#   2. evaluate the exported model at 4L on needle probes (a needle near the start, one question per
#      sequence at a position spread over 0..4L; only the answer is scored, chance = ln 8): RoPE as trained
#      ("no_yarn"), and YaRN factor 4 with no further training ("yarn_zero_shot");
#   3. fine-tune FT_STEPS steps at 4L with YaRN (factor 4, as train.py sets it for data.seq_length = 4L) and
#      evaluate that model too ("yarn_finetuned"); FT_STEPS=0 skips it.
#   4. record GPU memory through one training step of a wider demo model at 32K tokens (--profile-memory:
#      OUT/profile/memory/*.pickle for pytorch.org/memory_viz, *.png with the phases); PROFILE=0 skips it.
# Writes OUT/eval/loss_by_position.{png,csv,json}, one JSON per run, OUT/summary.md (a table of the numbers)
# and OUT/train*/eval/ (loss by position during training). Without matplotlib the PNGs are skipped with a
# message; draw them anywhere later:  python -m ulysses_train.diagnostics.plots loss OUT/eval no_yarn=OUT/eval/no_yarn.json ...
#
# On the GPU machine (repo root, .whl/ carried):
#   bash benchmarks/yarn_demo.sh OUT_DIR
# Measured on one H200 with the defaults: steps 1-2 about 6 minutes (training 0.08-0.13 s/step), step 3's
# training 1.5 minutes, and its evaluation no longer fitted a 10-minute command; under such a limit run
# FT_STEPS=0 PROFILE=0 first, then the rest. Keep OUT_DIR outside a folder with a file-count limit: the
# runs write checkpoints there.
# CPU smoke run of the whole flow (2 processes, sp=2; minutes; learns nothing in so few steps):
#   DS_ACCELERATOR=cpu NPROC=2 SP=2 BATCH=1 L=192 STEPS=40 FT_STEPS=6 SEQS=32 EVAL_SEQS=8 PROFILE=0 \
#       bash benchmarks/yarn_demo.sh /tmp/yarn_demo
set -euo pipefail
export PYTHONPATH="$PWD:${PYTHONPATH:-}"   # the package from this checkout (not pip-installed on the GPU machine)
OUT=${1:-outputs/yarn_demo}
L=${L:-512}                   # training length (tokens); evaluation at 4L
STEPS=${STEPS:-1500}          # training steps at L
BATCH=${BATCH:-16}            # sequences per step (packed as a batch; needs SP=1, else 1)
FT_STEPS=${FT_STEPS:-200}     # YaRN fine-tuning steps at 4L (0: skip)
NPROC=${NPROC:-1}             # processes (GPUs)
SP=${SP:-1}                   # sequence-parallel size
SEQS=${SEQS:-512}             # probe sequences (= scored answers) per evaluation
EVAL_SEQS=${EVAL_SEQS:-64}    # probe sequences per length for the evaluations during training
# the demo's Qwen3 at hidden 128 (head_dim 32) leaves the plateau at chance in ~500 steps in CPU trials;
# at hidden 64 it stayed there for 1000-2000 steps
WIDTH=${WIDTH:-"hidden_size: 128, intermediate_size: 384, head_dim: 32"}
L4=$((4 * L))
BUCKET=${BUCKET:-$((L4 / 16))}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} TOKENIZERS_PARALLELISM=false
if [ "${DS_ACCELERATOR:-}" = cpu ]; then export OMP_NUM_THREADS=1; fi
if ! python3 -c "import deepspeed" 2>/dev/null && [ -d .whl ]; then
    eval "$(bash scripts/install_wheelhouse.sh .whl /tmp/site | tail -1)"
fi
python3 -c "import torch, transformers, deepspeed; print('torch', torch.__version__, 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')" | tee "$OUT/versions.txt"
python3 -c "import matplotlib" 2>/dev/null || echo "note: matplotlib missing, PNGs will be skipped (JSON/CSV still written)"

RUN="python3 -m torch.distributed.run --standalone --nproc_per_node $NPROC"
SPSET=(--set parallel.sequence_parallel_size=$SP)
# training builds the demo config (demo.py), so its trained length is set here; evaluation reads the
# exported config.json, which already says max_position_embeddings = L (and YaRN after step 3)
MODEL=(--set "model.config_overrides={max_position_embeddings: $L, $WIDTH}" "${SPSET[@]}")
EVAL=("${SPSET[@]}" --lengths $L4 --bucket $BUCKET --num-sequences $SEQS)
quiet() { tr '\r' '\n' | grep -v -e Warning -e "return func" -e "^train: " -e "sequence .* done" -e "^ *$" || true; }
started=$(date +%s)

echo "== 1. train at L=$L for $STEPS steps =="
$RUN benchmarks/yarn_demo_task.py --batch $BATCH "${MODEL[@]}" --overwrite --set data.seq_length=$L --set train.steps=$STEPS \
    --set train.log_every=100 --set train.output_dir="$OUT/train" --set train.eval_every=$((STEPS / 2)) \
    --set "train.eval_lengths=[$L, $L4]" --set train.eval_bucket=$BUCKET --set train.eval_sequences=$EVAL_SEQS \
    2>&1 | quiet | tee "$OUT/train.log" | tail -12

echo "== 2. evaluate at 4L=$L4: RoPE as trained, then YaRN factor 4 without training =="
$RUN scripts/eval_positions.py --checkpoint-or-model "$OUT/train" "${EVAL[@]}" \
    --set model.rope_scaling=none --name no_yarn --out "$OUT/eval" 2>&1 | quiet | tail -4
$RUN scripts/eval_positions.py --checkpoint-or-model "$OUT/train" "${EVAL[@]}" \
    --set model.rope_scaling=yarn --name yarn_zero_shot --compare no_yarn="$OUT/eval/no_yarn.json" \
    --out "$OUT/eval" 2>&1 | quiet | tail -4

if [ "$FT_STEPS" -gt 0 ]; then
    echo "== 3. fine-tune $FT_STEPS steps at 4L=$L4 with YaRN, evaluate =="
    $RUN benchmarks/yarn_demo_task.py --batch $BATCH "${MODEL[@]}" --overwrite --set model.name_or_path="$OUT/train/hf_model" \
        --set model.random_init=false --set data.seq_length=$L4 --set train.steps=$FT_STEPS --set train.log_every=50 \
        --set train.output_dir="$OUT/train_yarn_4l" --set train.eval_every=$FT_STEPS --set "train.eval_lengths=[$L4]" \
        --set train.eval_bucket=$BUCKET --set train.eval_sequences=$EVAL_SEQS \
        2>&1 | quiet | tee "$OUT/train_yarn_4l.log" | tail -8
    $RUN scripts/eval_positions.py --checkpoint-or-model "$OUT/train_yarn_4l" "${EVAL[@]}" \
        --name yarn_finetuned --compare no_yarn="$OUT/eval/no_yarn.json" \
        --compare yarn_zero_shot="$OUT/eval/yarn_zero_shot.json" --out "$OUT/eval" \
        2>&1 | quiet | tail -4
fi

if [ "${PROFILE:-1}" = 1 ]; then
    echo "== 4. memory through one training step (--profile-memory), a wider demo model at 32K tokens =="
    $RUN benchmarks/yarn_demo_task.py "${SPSET[@]}" --overwrite --profile-memory --set data.seq_length=32768 --set model.dtype=bfloat16 \
        --set "model.config_overrides={max_position_embeddings: 32768, hidden_size: 1024, intermediate_size: 3072, num_hidden_layers: 8, num_attention_heads: 8, num_key_value_heads: 4, head_dim: 128}" \
        --set train.steps=2 --set train.export_hf=false --set train.output_dir="$OUT/profile" 2>&1 | quiet | tail -4
    ls -1 "$OUT/profile/memory" 2>/dev/null || true
fi

python3 - "$OUT" "$L" "$STEPS" "$FT_STEPS" "$(( $(date +%s) - started ))" <<'EOF' | tee "$OUT/summary.md"
import json, os, sys
from ulysses_train.diagnostics.evaluation import PositionLoss
out, L, steps, ft, seconds = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
print(f"Needle-probe answer loss (nats) at 4L = {4 * L:,}; trained at L = {L:,} for {steps} steps"
      f" (+{ft} YaRN steps at 4L for yarn_finetuned); {seconds} s in all.\n")
print("| run | RoPE | positions < L | L..2L | 2L..4L | last quarter | all | unigram entropy of answers | chance |")
print("|---|---|---|---|---|---|---|---|---|")
fmt = lambda v: "n/a" if v is None else f"{v:.3f}"
for name in ("no_yarn", "yarn_zero_shot", "yarn_finetuned"):
    path = os.path.join(out, "eval", f"{name}.json")
    if not os.path.exists(path):
        continue
    record = json.load(open(path))
    r = PositionLoss.from_dict(record["results"][0])
    rope = record.get("rope_parameters", {})
    rope_text = f"{rope.get('rope_type')} x{rope.get('factor')}" if rope.get("factor") else rope.get("rope_type")
    chance = next(iter(record.get("references", {}).values()), None)
    print(f"| {name} | {rope_text} | {fmt(r.mean_over(0, L))} | {fmt(r.mean_over(L, 2 * L))} | "
          f"{fmt(r.mean_over(2 * L, 4 * L))} | {fmt(r.mean_over(3 * L, 4 * L))} | {fmt(r.overall)} | "
          f"{r.unigram_entropy:.3f} | {fmt(chance)} |")
lines = [l for l in open(os.path.join(out, "train.log")) if l.startswith("loss: mean of first")]
if lines:
    print(f"\ntraining at L: {lines[-1].strip()}")
EOF
ls -1 "$OUT/eval"
