#!/usr/bin/env bash
# The YaRN story as retrieval heatmaps (scripts/eval_context.py): a small Qwen3 trained from scratch on passkey
# probes at length L, then scored at L, 2L and 4L (needle depths 0-100% by 10, SAMPLES sequences per cell):
#
#   1. benchmarks/yarn_probe_task.py --prepare writes a local byte-level BPE tokenizer (digits one token each) and
#      a small Qwen3 config (no download); the model (WIDTH below: hidden 128, 4 layers) trains from random weights
#      for STEPS steps of BATCH passkey sequences of L tokens, its trained length set to L
#      (max_position_embeddings = L, as benchmarks/yarn_demo.sh sets it);
#   2. eval_context.py on the exported model: RoPE as trained ("no_yarn": model.rope_scaling=none, --beyond-trained
#      to let it past L), then YaRN factor 4 with no further training ("yarn_zero_shot": rope_scaling auto for
#      the longest length 4L, so factor 4L / L = 4 at every length of that grid);
#   3. FT_STEPS steps at 4L with YaRN (data.seq_length = 4L, rope_scaling auto: factor 4, as train.py sets it)
#      from the model of step 1, then the same grid ("yarn_finetuned"); FT_STEPS=0 skips it.
# Writes OUT/<run>/retrieval.{json,csv} and retrieval_passkey.png for each run, OUT/yarn_heatmaps.png (the three
# heatmaps side by side), OUT/summary.md (mean exact-match accuracy over depths per length) and the logs;
# checkpoints and models under OUT/train and OUT/train_yarn_4l (not results: leave them out of a copy).
#
# Everything is seeded: two runs on the same CPU gave identical losses and heatmaps (other hardware may differ in
# the last bits, through other kernels).
# CPU (2 cores, one process, the defaults; measured: 18 minutes, 14 of them training at L; benchmarks/RESULTS.md):
#   DS_ACCELERATOR=cpu bash benchmarks/yarn_heatmaps.sh outputs/yarn_heatmaps
# GPU (one GPU, repo root; the same defaults; not run on a GPU yet):
#   bash benchmarks/yarn_heatmaps.sh outputs/yarn_heatmaps
# A longer L (e.g. L=1024 BATCH=16 SAMPLES=16) needs its own STEPS: how many this model needs there is not measured.
set -euo pipefail
export PYTHONPATH="$PWD:${PYTHONPATH:-}"   # the package from this checkout
OUT=${1:-outputs/yarn_heatmaps}
L=${L:-256}                   # training length (tokens); evaluation at L, 2L, 4L
STEPS=${STEPS:-4000}          # training steps at L
BATCH=${BATCH:-8}             # sequences per step at L (yarn_probe_task.py --batch: one [BATCH, L] micro-step)
FT_STEPS=${FT_STEPS:-200}     # YaRN fine-tuning steps at 4L (0: skip)
FT_BATCH=${FT_BATCH:-4}       # sequences per step at 4L
SAMPLES=${SAMPLES:-8}         # sequences (= passkey probes) per (length, depth) cell
DEPTHS=${DEPTHS:-0,10,...,100}
WIDTH=${WIDTH:-"hidden_size: 128, intermediate_size: 384, num_attention_heads: 4, num_key_value_heads: 2"}
L2=$((2 * L)); L4=$((4 * L))
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ "${DS_ACCELERATOR:-}" = cpu ]; then export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}; fi
python3 -c "import torch, transformers, deepspeed; print('torch', torch.__version__, 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')" | tee "$OUT/versions.txt"

RUN="python3 -m torch.distributed.run --standalone --nproc_per_node 1"
COMMON=(--tasks passkey --overwrite --set model.gradient_checkpointing=false --set data.tokenizer="$OUT/probe_model")
# scored in fp32 with SDPA, as the model trains here (eval_context's defaults: bfloat16, and fa4 where installed)
EVAL=(--lengths $L,$L2,$L4 --depths "$DEPTHS" --tasks passkey --samples $SAMPLES --set model.dtype=float32
      --set model.attn_implementation=sdpa)
quiet() { tr '\r' '\n' | grep --line-buffered -v -e Warning -e "^train: " -e "sequence .* done" -e "^ *$" || true; }
timed() { local name=$1 start; shift; start=$(date +%s); "$@"; echo "$name: $(( $(date +%s) - start )) s" | tee -a "$OUT/times.txt"; }
: > "$OUT/times.txt"

echo "== 1. tokenizer and config; train at L=$L for $STEPS steps of $BATCH sequences =="
python3 benchmarks/yarn_probe_task.py --prepare "$OUT/probe_model"
train_at_l() {
    $RUN benchmarks/yarn_probe_task.py "${COMMON[@]}" --batch $BATCH --set model.name_or_path="$OUT/probe_model" \
        --set model.random_init=true --set "model.config_overrides={max_position_embeddings: $L, $WIDTH}" \
        --set data.seq_length=$L --set train.steps=$STEPS --set train.log_every=250 --set train.output_dir="$OUT/train" \
        2>&1 | quiet > "$OUT/train.log"
}
timed train_at_l train_at_l
grep -e "^loss: " -e "step $STEPS " "$OUT/train.log" || tail -5 "$OUT/train.log"

evaluate() {  # name model [eval_context options]
    local name=$1 model=$2; shift 2
    $RUN scripts/eval_context.py --model "$model" "${EVAL[@]}" --name "$name" --out "$OUT/$name" "$@" \
        2>&1 | quiet | tee "$OUT/$name.log" | grep -e "retrieval accuracy" -e "^scoring" -e "error" || true
}
echo "== 2. evaluate at $L, $L2, $L4: RoPE as trained, then YaRN factor 4 without training =="
timed eval_no_yarn evaluate no_yarn "$OUT/train" --set model.rope_scaling=none --beyond-trained
timed eval_yarn_zero_shot evaluate yarn_zero_shot "$OUT/train" --set model.rope_scaling=auto

if [ "$FT_STEPS" -gt 0 ]; then
    echo "== 3. fine-tune $FT_STEPS steps of $FT_BATCH sequences at 4L=$L4 with YaRN, evaluate =="
    finetune() {
        $RUN benchmarks/yarn_probe_task.py "${COMMON[@]}" --batch $FT_BATCH --set model.name_or_path="$OUT/train/hf_model" \
            --set model.random_init=false --set model.rope_scaling=auto --set data.seq_length=$L4 \
            --set train.steps=$FT_STEPS --set train.log_every=50 --set train.seed=1 \
            --set train.output_dir="$OUT/train_yarn_4l" 2>&1 | quiet > "$OUT/train_yarn_4l.log"
    }
    timed finetune_4l finetune
    grep -e "^loss: " -e "YaRN" "$OUT/train_yarn_4l.log" | head -3 || tail -5 "$OUT/train_yarn_4l.log"
    timed eval_yarn_finetuned evaluate yarn_finetuned "$OUT/train_yarn_4l"
fi

python3 - "$OUT" "$L" "$STEPS" "$BATCH" "$FT_STEPS" "$FT_BATCH" <<'EOF' | tee "$OUT/summary.md"
import json, os, sys
out, L, steps, batch, ft, ft_batch = sys.argv[1], *map(int, sys.argv[2:])
names = [n for n in ("no_yarn", "yarn_zero_shot", "yarn_finetuned") if os.path.exists(f"{out}/{n}/retrieval.json")]
records = {n: json.load(open(f"{out}/{n}/retrieval.json")) for n in names}
lengths = records[names[0]]["lengths"]
print(f"Passkey exact-match accuracy, mean over depths (each cell: {records[names[0]]['samples']} probes per depth); "
      f"trained at L = {L} for {steps} steps x {batch} sequences (+{ft} x {ft_batch} YaRN steps at 4L for "
      f"yarn_finetuned).\n")
print("| run | RoPE | " + " | ".join(f"{n:,}" for n in lengths) + " |")
print("|---|---|" + "---|" * len(lengths))
for n, r in records.items():
    rope = r.get("rope_parameters", {})
    text = f"{rope.get('rope_type')} x{rope.get('factor'):g}" if rope.get("factor") else rope.get("rope_type")
    means = []
    for length in lengths:
        probes = [p for p in r["probes"] if p["length"] == length]
        exact = sum(p["exact"] for p in probes) / len(probes)
        tokens = sum(p["hits"] for p in probes) / sum(p["tokens"] for p in probes)
        means.append(f"{100 * exact:.0f}% ({100 * tokens:.0f}%)")
    print(f"| {n} | {text} | " + " | ".join(means) + " |")
print("\n(in brackets: answer tokens that are the argmax, of 8 per probe: a space and 7 digits)")
print("\nPer depth (rows) and length (columns), accuracy %:")
for n, r in records.items():
    print(f"\n{n}:")
    for depth in r["depths"]:
        row = [next(c["accuracy"] for c in r["cells"] if c["length"] == ln and c["depth"] == depth) for ln in lengths]
        print(f"  {depth:3d}%  " + "  ".join(f"{100 * a:4.0f}" for a in row))
try:
    from ulysses_train.diagnostics.plots import _pyplot
    import numpy as np
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 4.6), dpi=110, squeeze=False)
    for ax, (n, r) in zip(axes[0], records.items()):
        grid = np.array([[next(c["accuracy"] for c in r["cells"] if c["length"] == ln and c["depth"] == d)
                          for ln in lengths] for d in r["depths"]])
        ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for (i, j), v in np.ndenumerate(grid):
            ax.text(j, i, f"{100 * v:.0f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(lengths)), [str(x) for x in lengths])
        ax.set_yticks(range(len(r["depths"])), [f"{d}%" for d in r["depths"]])
        ax.axvline(sum(1 for x in lengths if x <= L) - 0.5, color="black", linestyle="--", linewidth=1.2)
        ax.set_title(n, fontsize=9)
        ax.set_xlabel("context length (tokens)")
    axes[0][0].set_ylabel("needle depth")
    fig.suptitle(f"passkey exact match (%), trained at {L} (dashed line)", fontsize=10)
    fig.tight_layout()
    fig.savefig(f"{out}/yarn_heatmaps.png")
except ImportError as err:
    print(f"\n(no combined PNG: {err})")
EOF
cat "$OUT/times.txt"
