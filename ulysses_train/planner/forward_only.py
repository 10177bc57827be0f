"""The evaluation forward: what one GPU holds while the trainer's engine scores a sequence under `torch.no_grad`.

Why its own estimate: evaluation (scripts/eval_context.py, the run config's `eval` probes, the loss by position) runs
the decoder forward only, through the same engine as training (ZeRO-3, Ulysses, TiledMLP when the levers have it),
then the head over the last hidden states chunk by chunk (diagnostics/probe_scoring.py, evaluation.py). A training
step's plan bounds it, but by a wide margin (checkpoints of every layer, gradients, optimizer states); this one counts
the forward itself, so the preflight check judges an evaluation by what it holds, and the report can put the planned
peak next to the measured one.

What a forward does not hold: checkpoints (nothing is saved for a backward under no_grad, checkpointing included),
gradients, optimizer states (the eval engine is built without an optimizer: DeepSpeed's parameter-only ZeRO-3,
which allocates no gradient bucket). What it holds, at four moments, written in the same four columns as a training
step's `Component`s (result.py) so the weights and overheads are shared with estimate.py:
- `loss` column: the head scoring the last hidden states (lm_head gathered once, one chunk of rows x vocab logits);
- `attn` column: a layer's attention forward (q, k, v of the slice, under sp the whole sequence of this rank's
  heads after the all-to-all, the kernel's output, the all-to-all buffers), or a Gated DeltaNet's where larger;
- `norm` column: a layer's post-attention RMSNorm forward (its fp32 temporaries);
- `mlp` column: a layer's MLP forward (its intermediates, or one TiledMLP tile's).
No layer keeps anything for later, so every layer's moments are the same and one layer's are the forward's.

A bound, not a measurement: tensors alive at nearby instants of one moment are summed (the kernel's output and the
all-to-all buffers that carry it back, the MLP's four intermediates of which three coexist), so the estimate errs
toward counting: on one H200 (Qwen3-4B, sp=1, 32K and 128K tokens, TiledMLP on and off: benchmarks/results/
eval_forward_memory_h200.jsonl) the plan was 5 to 12% above torch's measured peak. A hybrid's layer moments are those
of whichever mixer holds more (attention, or a Gated DeltaNet: planner/linear_layer.py's widths).

`during_training=True` is the same forward run between training steps (the `eval` section: probes on the training
engine), where the optimizer states, gradient partitions and the reduce bucket stay on the GPU.
"""
from __future__ import annotations

import dataclasses

from ulysses_train.constants import GIB
from ulysses_train.planner.exchange_time import exchange_seconds
from ulysses_train.planner.estimate import (Checkpoints, communication_and_overheads, exchange_buffers, flops,
                                            gradients_and_checkpoints, head_notes, optimizer_states, weights)
from ulysses_train.planner.layer import mlp_saved_per_token, mlp_tiles
from ulysses_train.planner.mixer_terms import MIXER_TERMS, kinds_of
from ulysses_train.planner.options import PlanError, PlanOptions
from ulysses_train.planner.result import PHASES, Component, MemoryPlan
from ulysses_train.planner.shapes import ModelShape, load_model_shape

MOMENTS = {"loss": "the head scoring the last hidden states", "mlp": "a layer's MLP forward",
           "norm": "a layer's post-attention RMSNorm forward", "attn": "a layer's attention (or other mixer) forward"}
"""The forward's moments, by the Component column that holds each (module docstring)."""
COLUMNS = {"loss": "head", "mlp": "mlp fwd", "norm": "norm fwd", "attn": "attn fwd"}
ROTARY_TABLES = 2
"""cos and sin tables the decoder computes once per forward: up to two sets (Gemma 3 keeps a local and a global)."""
NO_CHECKPOINTS = Checkpoints(kept_layers=0, offloaded=0, per_layer=0, stored=0, host=0, on_gpu=0, resident=0,
                             why="none: a forward under no_grad saves nothing for a backward")


def plan_forward(model, seq_length: int | None = None, options: PlanOptions | None = None,
                 during_training: bool = False, **kwargs) -> "ForwardPlan":
    """The evaluation forward's plan: `plan_forward(model, options)` or `plan_forward(model, seq_length, sp=8, ...)`
    with any PlanOptions field as a keyword (as estimate.plan). `options.loss_chunk_rows` is the head's chunk of
    scored rows (eval_context.py --chunk-rows, or the run's loss.chunk_rows for probes during training)."""
    m = load_model_shape(model)
    if options is None:
        options = PlanOptions(seq_length=seq_length, **kwargs)
    elif seq_length is not None or kwargs:
        options = options.replace(**({"seq_length": seq_length} if seq_length else {}), **kwargs)
    return estimate_forward(m, options, during_training)


def estimate_forward(m: ModelShape, o: PlanOptions, during_training: bool = False) -> "ForwardPlan":
    """Every holder of memory of the forward, moment by moment (module docstring), and its FLOPs; a model whose
    attention layout differs by layer at its worst layer's (ModelShape.per_layout)."""
    if m.attention_layouts:
        return max((estimate_forward(shape, o, during_training) for shape in m.per_layout()),
                   key=lambda p: p.gpu_allocated)
    parts = weights(m, o)
    if during_training:  # the training engine's persistent state stays on the GPU between steps
        parts += optimizer_states(m, o)
        parts += gradients_and_checkpoints(m, o, NO_CHECKPOINTS) if o.zero_stage == 3 else []
    parts += forward_activations(m, o) + [head_scoring(m, o)]
    # without an optimizer DeepSpeed builds no reduce bucket; the CUDA context is as in training
    parts += communication_and_overheads(m, o if during_training else o.replace(reduce_bucket_size=0))
    forward_flops = flops(m, o, 0)[0] / 3  # model FLOPs count 6*N*T + 3 x attention forward: a forward is a third
    return ForwardPlan(m, o, parts, forward_flops, 0.0, head_notes(m, o), exchange_seconds(m, o, forward_only=True),
                       during_training=during_training)


# ---------------------------------------------------------------- one layer's forward, per local token


def mixer_forward_per_token(m: ModelShape, o: PlanOptions) -> float:
    """The larger of a layer's mixers' forwards (mixer_terms.MIXER_TERMS: attention, planner/layer.py; in a hybrid
    its linear layers', linear_layer.py or kda_layer.py, when they hold more)."""
    return max(MIXER_TERMS[kind].forward(m, o) for kind in kinds_of(m))


def largest_exchange_buffers(m: ModelShape, o: PlanOptions) -> list[Component]:
    """Under sp, the all-to-all's send copy and receive buffer of the largest exchange (estimate.exchange_buffers),
    of each layer kind the model has (the larger one)."""
    buffers = [c for kind in kinds_of(m) for c in exchange_buffers(m, o, kind)]
    return [max(buffers, key=lambda c: c.attn)] if buffers else []


def norm_forward_per_token(m: ModelShape, o: PlanOptions) -> int:
    """Bytes per local token of the post-attention RMSNorm forward, beyond the residual stream: the tensor being
    normed where it is not the residual (Gemma 3 norms the attention output before adding it), the fp32 upcast
    and the fp32 normalized rows (the low-memory norm's forward and Hugging Face's both make them), the cast and
    the weighted output."""
    b, h = o.dtype_bytes, m.hidden
    return b * h + 2 * 4 * h + 2 * b * h


def expert_mask_per_token(m: ModelShape) -> int:
    """A mixture of experts' routing in Hugging Face's experts loop: the one-hot expert mask of each token's k
    choices over E + 1 classes, int64. 0 for a dense MLP."""
    return 8 * m.experts_per_token * (m.experts + 1) if m.experts else 0


def mlp_forward_per_token(m: ModelShape, o: PlanOptions) -> float:
    """Bytes per local token of a layer's MLP forward, beyond the residual stream: its input (the post-attention
    norm's output) and output, and between them the intermediates of `down(act(gate(x)) * up(x))`, which are
    what an untiled MLP saves for backward (layer.mlp_saved_per_token: four of them, three coexist, plus a mixture of
    experts' routed copies) and the routing mask. TiledMLP runs one tile of those at a time, and holds the output
    tiles, their concatenation, and the input padded to a multiple of the tiles."""
    b, h = o.dtype_bytes, m.hidden
    intermediates = mlp_saved_per_token(m, o.replace(tiled_mlp=False)) + expert_mask_per_token(m)
    if o.tiled_mlp:
        return b * h + intermediates / mlp_tiles(m, o) + 3 * b * h
    return b * h + intermediates + b * h


def forward_activations(m: ModelShape, o: PlanOptions) -> list[Component]:
    """The forward's tensors over the sequence slice (`s` local tokens), moment by moment."""
    b, s, h = o.dtype_bytes, o.seq_local, m.hidden
    inputs, kinds = s * (3 * 8 + ROTARY_TABLES * 2 * b * m.head_dim), kinds_of(m)
    residual = s * b * h
    return [Component("inputs and rotary tables", inputs, inputs, inputs, inputs,
                      why="int64 input ids, position ids and labels of the slice; cos and sin"),
            Component("residual stream", mlp=residual, norm=residual, attn=residual,
                      why="the layer's input, added to its attention and MLP outputs"),
            Component("layer: mixer forward" if len(kinds) > 1 else f"layer: {kinds[0]} forward",
                      attn=int(s * mixer_forward_per_token(m, o)),
                      why="; or ".join(MIXER_TERMS[kind].forward_why for kind in kinds)
                          + (": the larger" if len(kinds) > 1 else "")),
            Component("layer: RMSNorm forward", norm=s * norm_forward_per_token(m, o),
                      why="fp32 upcast and normalized rows, the cast, the output"),
            Component("layer: MLP forward", mlp=int(s * mlp_forward_per_token(m, o)),
                      why=(f"TiledMLP, one of {mlp_tiles(m, o)} tiles at a time" if o.tiled_mlp
                           else "the intermediates of the whole slice") + ", input and output")
            ] + largest_exchange_buffers(m, o)


def head_scoring(m: ModelShape, o: PlanOptions) -> Component:
    """The head over the last hidden states, as probe_scoring.answer_token_scores and evaluation.per_token_nll run
    it: the last hidden states and the copy of the labelled rows (every row at worst), fp64 log-prob and hit per
    row, and one chunk of `loss_chunk_rows` rows x vocab logits: the matmul's output in the dtype, its fp32 copy,
    the logit scale / soft-cap's result and the log-softmax (never the whole seq x vocab; the lm_head weight,
    gathered once, is in `weights gathered`)."""
    b, s, h, V = o.dtype_bytes, o.seq_local, m.hidden, m.vocab
    rows = min(o.loss_chunk_rows, s)
    return Component("head: scoring (chunked)", loss=2 * s * b * h + 16 * s + rows * V * (b + 12),
                     why=f"last hidden states and their labelled rows, {rows} rows x vocab of logits at a time")


# ---------------------------------------------------------------- the plan and the check


@dataclasses.dataclass
class ForwardPlan(MemoryPlan):
    """A forward's plan: MemoryPlan's totals (peak, fit, host) over forward components, `model_flops` the
    forward's FLOPs (so `step_seconds` is one forward's time); its own table, summary and moment names."""

    during_training: bool = False

    def summary(self) -> str:
        o = self.options
        return (f"evaluation forward: GPU {self.gpu_total / GIB:.1f} / {o.gpu_memory_gib:g} GiB per GPU (peak during "
                f"{MOMENTS[self.peak_phase]}; {self.gpu_allocated / GIB:.1f} GiB allocated by torch), "
                f"~{self.step_seconds:.1f} s per sequence")

    def table(self) -> str:
        """Every component at each moment of the forward (GiB), the totals and the summary."""
        o, m = self.options, self.model
        lines = [f"{m.name} evaluation forward{' (between training steps)' if self.during_training else ''}: seq "
                 f"{o.padded_length:,} tokens, sp={o.sp}, {o.world} GPU(s), {o.seq_local:,} tokens per GPU, "
                 f"TiledMLP {'on' if o.tiled_mlp else 'off'}, head chunk {min(o.loss_chunk_rows, o.seq_local):,} rows",
                 "", f"{'component':<36}" + "".join(f"{COLUMNS[p]:>10}" for p in PHASES) + "  (GiB)"]
        for c in self.components:
            if any(c.at(p) for p in PHASES):
                lines.append(f"{c.name:<36}" + "".join(f"{c.at(p) / GIB:>10.2f}" for p in PHASES))
        lines.append(f"{'total per GPU':<36}" + "".join(f"{self.gpu_at(p) / GIB:>10.2f}" for p in PHASES))
        return "\n".join(lines + ["", self.summary()] + [f"note: {n}" for n in self.notes])

    def to_dict(self) -> dict:
        out = super().to_dict()
        out.update(during_training=self.during_training, peak_moment=MOMENTS[self.peak_phase],
                   forward_flops=self.model_flops, forward_seconds=self.step_seconds)
        return out


def forward_fix(p: ForwardPlan) -> str:
    """The cheapest change that makes the forward fit, ranked as the training fixes are (search.LEVER_COST: more
    sp, then TiledMLP, then both); "" if none does."""
    from ulysses_train.planner.search import LEVER_COST, valid_sp

    m, o = p.model, p.options
    tries = sorted((LEVER_COST["sp"] * (sp != o.sp) + LEVER_COST["tiled_mlp"] * (tiled != o.tiled_mlp), sp, tiled)
                   for sp in valid_sp(m, o) if sp >= o.sp for tiled in {o.tiled_mlp, True})
    for _, sp, tiled in tries:
        if (sp, tiled) != (o.sp, o.tiled_mlp) and estimate_forward(m, o.replace(sp=sp, tiled_mlp=tiled),
                                                                   p.during_training).fits:
            return " + ".join(([f"sp={sp} (parallel.sequence_parallel_size={sp})"] if sp != o.sp else [])
                              + (["TiledMLP (model.tiled_mlp=true)"] if tiled != o.tiled_mlp else []))
    return ""


def check_forward_fits(p: ForwardPlan) -> None:
    """None if the forward fits this GPU; otherwise PlanError naming the moment, the largest parts and a fix."""
    if p.gpu_total <= p.gpu_capacity:
        return
    o, phase = p.options, p.peak_phase
    top = sorted(p.components, key=lambda c: c.at(phase), reverse=True)[:3]
    fix = forward_fix(p)
    raise PlanError(f"{p.model.name}: evaluating {o.padded_length:,} tokens (sp={o.sp}, {o.world} GPUs) needs "
                    f"{p.gpu_total / GIB:.1f} GiB per GPU (during {MOMENTS[phase]}) but {o.gpu_memory_gib:g} GiB are "
                    f"available. Largest parts: " + ", ".join(f"{c.name} {c.at(phase) / GIB:.1f} GiB" for c in top)
                    + ". " + (f"Cheapest change that fits: {fix}." if fix else
                              "Evaluate shorter lengths, or on more GPUs."))
