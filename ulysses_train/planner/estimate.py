"""The estimate: every holder of memory of one training step, and the FLOPs of one sequence.

How the peak is found. A training step has four moments that can hold the peak on a GPU:
- `loss`: the end of the forward, while the loss runs over the last hidden state (the lm_head weight is
  gathered, logits exist chunk by chunk or in full);
- `mlp`: the backward of the first decoder layer to be recomputed, at its MLP (the recomputed layer's
  saved tensors plus the MLP's intermediates and their gradients);
- `norm`: the same layer's post-attention RMSNorm backward, whose fp32 gradient chain holds ~4 fp32
  copies of its input (the peak once TiledMLP has shrunk the MLP);
- `attn`: the same layer's attention backward (kernel gradients and workspaces, all-to-all buffers).
Every component says how many bytes it holds at each moment; the GPU peak is the largest column sum.
Under ZeRO-3 every checkpoint is still alive at the first recomputed layer, so that layer is the worst.
Without ZeRO (`zero_stage=0`, plain PyTorch as in the plain Hugging Face baseline,
benchmarks/results/plain_hf_baseline_h200.jsonl) gradients are not
partitioned, and backward trades one checkpoint for one layer of gradients per layer: the peak is at
the first or the last recomputed layer, whichever holds more.

Sizes: `b` is the parameter dtype size (2 for bf16); `s` is the tokens on one GPU (`seq_length / sp`);
`h` hidden, `I` intermediate, `q = heads * head_dim`, `kv = kv_heads * head_dim`, `V` vocabulary,
`N` parameters, `W` world size. Everything is bytes; tables print GiB (2**30).

`gpu_allocated` is what `torch.cuda.max_memory_allocated()` would report (what that baseline and the
benchmarks record); `gpu_total` adds the CUDA context, NCCL and cuBLAS workspaces that live outside
torch's allocator, and is what must fit the card.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ulysses_train.constants import GIB, REUSE_DISTANCE_LAYERS
from ulysses_train.model.recompute import kept_attention_layers, offloaded_layer_count
from ulysses_train.model.mixers import sp_problems
from ulysses_train.planner.exchange_time import exchange_seconds
from ulysses_train.planner.hyper_connections import head_saved_per_token, streams_of
from ulysses_train.planner.hyper_connections import layer_moments as hc_layer_moments
from ulysses_train.planner.hyper_connections import saved_per_token as hc_saved_per_token
from ulysses_train.planner.leaf_blocks import leaf_block_backward, mlp_leaf_params
from ulysses_train.planner.layer import (hf_norm_saved, mlp_backward_extra_per_token, mlp_saved_per_token, mlp_tiles,
                                         norm_backward_chunk_bytes, norm_backward_extra_per_token,
                                         norms_saved_per_token)
from ulysses_train.planner.mixer_terms import MIXER_TERMS, NO_MIXER, kinds_of
from ulysses_train.planner.options import PlanOptions, kernel_fields
from ulysses_train.planner.result import Component, MemoryPlan
from ulysses_train.planner.shapes import ModelShape, load_model_shape, reduced_depth_shape
from ulysses_train.model.flops import attention_forward_flops, indexer_forward_flops, model_flops

CUDA_CONTEXT_BYTES = 2 * GIB
"""CUDA context (~0.5 GiB), NCCL communicators and cuBLAS workspaces: on the card but outside torch's
allocator, so not in max_memory_allocated. The one global overhead constant of the GPU side."""
HOST_PROCESS_BYTES = 5 * GIB
"""Host memory of one training process before any offload: Python, torch, CUDA and NCCL libraries,
DeepSpeed, the tokenized sample."""


def plan(model, seq_length: int | None = None, options: PlanOptions | None = None, **kwargs) -> MemoryPlan:
    """Predict memory and time. Either `plan(model, options)` or `plan(model, seq_length, sp=8, ...)` with
    any PlanOptions field as a keyword. `model`: anything `load_model_shape` accepts."""
    m = load_model_shape(model)
    if options is None:
        options = PlanOptions(seq_length=seq_length, **kwargs)
    elif seq_length is not None or kwargs:
        options = options.replace(**({"seq_length": seq_length} if seq_length else {}), **kwargs)
    return estimate(m, options)


def plan_for_record(record: dict) -> MemoryPlan:
    """The plan of one measured point of benchmarks/planner_validation.jsonl: `model` plus any PlanOptions
    fields; other keys (measured_peak_gib, oom, source, ...) are ignored. Compare `gpu_allocated` with
    measured_peak_gib (both are what torch's allocator saw)."""
    names = {f.name for f in dataclasses.fields(PlanOptions)}
    layers = record.get("num_hidden_layers")  # a reduced-depth measurement: same widths, fewer layers
    model = reduced_depth_shape(record["model"], layers) if layers else load_model_shape(record["model"])
    return plan(model, options=PlanOptions(**{k: v for k, v in kernel_fields(record).items() if k in names}))


def estimate(m: ModelShape, o: PlanOptions) -> MemoryPlan:
    """The plan of one shape and options, section by section, in the order the table prints them. Where the
    attention's KV heads and head width differ by layer (ModelShape.attention_layouts) each layout is planned as
    the model's and the larger plan kept: its worst layer."""
    if m.attention_layouts:
        return max((estimate(shape, o) for shape in m.per_layout()), key=lambda p: p.gpu_allocated)
    if not (m.llama_norms or m.offset_norms and o.offset_norm_kernel):  # other norms stay Hugging Face's modules
        o = o.replace(low_memory_rmsnorm=False)
    ckpt = checkpoints(m, o)
    parts = weights(m, o) + tied_head_in_backward(m, o) + optimizer_states(m, o)
    parts += gradients_and_checkpoints(m, o, ckpt) if o.zero_stage == 3 else unpartitioned_backward(m, o, ckpt)
    parts += [loss(m, o)] + worst_layer_transients(m, o) + communication_and_overheads(m, o)
    model, recompute = flops(m, o, ckpt.kept_layers)
    return MemoryPlan(m, o, parts, model, recompute, head_notes(m, o), exchange_seconds(m, o))


def _everywhere(name: str, nbytes: int, why: str, host: int = 0) -> Component:
    """The same bytes at every moment of the step."""
    return Component(name, nbytes, nbytes, nbytes, nbytes, host, why)


def _layer(name: str, mlp=0, norm=0, attn=0, why: str = "") -> Component:
    """Bytes held only while a recomputed layer runs backward."""
    return Component(name, 0, int(mlp), int(norm), int(attn), 0, why)


def _per_rank(m: ModelShape, o: PlanOptions) -> int:
    """Parameters whose gradients and optimizer states one GPU holds: those that train (the LoRA adapters when
    there are any, else all), 1/world of them under ZeRO-3, all otherwise."""
    trained = o.adapter_params or m.total_params
    return trained // o.world if o.zero_stage == 3 else trained


# ---------------------------------------------------------------- weights and optimizer


def weights(m: ModelShape, o: PlanOptions) -> list[Component]:
    b, N = o.dtype_bytes, m.total_params + o.adapter_params
    if o.zero_stage != 3:
        return [_everywhere("weights (not partitioned)", b * N, "every GPU holds all parameters")]
    working = min(o.max_live_parameters, m.layer_params + min(o.prefetch_bucket_size, m.layer_params))
    mlp = max(working, mlp_leaf_params(m, o))
    return [_everywhere("weights (ZeRO-3 partition)", b * N // o.world, "each GPU keeps 1/world of the parameters"),
            Component("weights gathered", loss=b * m.lm_head_params, mlp=b * mlp, norm=b * working,
                      attn=b * working, why="loss: the whole lm_head, gathered once for all chunks; "
                                            "layers: the layer being computed plus the prefetch bucket"
                                            + ("; the MLP: its whole block, a ZeRO-3 leaf" if mlp > working else ""))]


def tied_head_in_backward(m: ModelShape, o: PlanOptions) -> list[Component]:
    """A head tied to the embedding, under ZeRO-3 over several GPUs, through the layers' backward (measured: the
    allocator's history of Gemma-4-31B's 1-layer sp=8 rank, benchmarks/RESULTS.md): the head's gradient from the
    loss, whole, waits in autograd for the embedding's share (one parameter used twice is accumulated once both
    are in); ZeRO-3 gathers the embedding again, by prefetch, while the first layer runs backward; and where the
    layers hold fewer parameters than ZeRO-3's reuse distance (constants.REUSE_DISTANCE_LAYERS) the
    loss's gathered head is never released in between. On one GPU the partition is the whole parameter and the
    rows (Qwen3-4B, Gemma 3 and Gemma 4) match without these; untied heads' rows under sp match without a
    prefetched embedding. Under LoRA the head is frozen: no gradient, and no backward through the embedding."""
    if not m.tied or o.zero_stage != 3 or o.world == 1 or o.adapter_params:  # LoRA: the head is frozen
        return []
    head = o.dtype_bytes * m.lm_head_params
    copies = 2 + (1 if m.layers <= REUSE_DISTANCE_LAYERS else 0)
    why = "the head's gradient waiting for the embedding's, the embedding gathered again for its backward"
    return [_layer("tied head in the layers' backward", copies * head, copies * head, copies * head,
                   why + (", the loss's gathered head kept (fewer layers than the reuse distance)"
                          if copies == 3 else ""))]


def optimizer_states(m: ModelShape, o: PlanOptions) -> list[Component]:
    """fp32 master weights and Adam's m and v: 12 bytes per parameter of this GPU's partition
    (PlanOptions.optimizer_state_bytes). On the host, torch's AdamW step (PlanOptions.torch_adam) also holds two
    fp32 temporaries of the sub-group it updates (sqrt(v), then the denominator: torch/optim/adam.py's single-tensor
    step, which CPU tensors take; measured by tests/test_planner_terms.py)."""
    if not o.include_optimizer:
        return []
    opt = o.optimizer_state_bytes * _per_rank(m, o)
    name = "optimizer (fp32 master, Adam m, v)" if o.optimizer_state_bytes > 4 else "optimizer (fp32 master only)"
    if not o.offload_optimizer:
        return [_everywhere(name, opt, f"{o.optimizer_state_bytes} bytes per parameter, partitioned")]
    parts = [Component(name, host=opt, why="on the host (offload_optimizer)")]
    if o.torch_adam and o.optimizer_state_bytes > 4:
        parts.append(Component("optimizer step's temporaries", host=8 * min(_per_rank(m, o), o.sub_group_size),
                               why="torch's AdamW on the host: two fp32 copies of one sub-group during its step"))
    return parts


# ---------------------------------------------------------------- checkpointed activations and gradients


@dataclass(frozen=True)
class Checkpoints:
    """What the layers keep between their forward and their backward (bytes per GPU; host per GPU process)."""

    kept_layers: int
    """Layers whose attention output (and logsumexp) is kept, so their recompute skips the kernel."""
    offloaded: int
    """Layers whose checkpoints wait on the host: the first ones, never the last."""
    per_layer: int
    """One layer's checkpoint (its input), or everything it saves without checkpointing."""
    stored: int
    """All layers' checkpoints, wherever they are."""
    host: int
    on_gpu: int
    """The checkpoints that stay on the GPU."""
    resident: int
    """Offloaded checkpoints back on the GPU while recomputed or prefetched."""
    why: str


def checkpoint_layers(m: ModelShape, o: PlanOptions) -> tuple[list[int], int]:
    """(the layers that keep their attention output, how many layers offload their checkpoints: the first
    ones): the trainer's own rules (model/recompute.py), so the plan counts the layers the run will pick."""
    kept = (kept_attention_layers(m.layers, o.keep_attention_fraction, m.attention_layers)
            if o.gradient_checkpointing else [])
    offloaded = offloaded_layer_count(m.layers, o.activation_offload_fraction) if o.offload_activations else 0
    return kept, offloaded


def checkpoints(m: ModelShape, o: PlanOptions) -> Checkpoints:
    """Checkpointed: one s x hidden layer input per layer, plus the attention output (and logsumexp) of kept
    layers; without checkpointing every layer keeps all it saves. Offloaded: the checkpoints of the first
    layers (checkpoint_layers: never the last, which backward needs first) on the host, the rest on the GPU.
    Backward starts at the last layer with `offload_buffers` checkpoints on the GPU (the recomputed layer and
    the prefetched one), so offloaded ones come back to the GPU only where fewer layers than that stay."""
    b, s, h, L = o.dtype_bytes, o.seq_local, m.hidden, m.layers
    kept, offloaded = checkpoint_layers(m, o)
    if o.gradient_checkpointing:
        per_layer, kept_each = s * h * b * streams_of(m), s * (b * m.attention_output_width + 4 * m.heads)
        why = "one s x hidden layer input per layer" + (f" ({streams_of(m)} streams)" if streams_of(m) > 1 else "")
        if kept:
            why += f", plus attention output + logsumexp of {len(kept)} kept layers"
    else:
        per_layer = s * (mean_layer_saved_per_token(m, o) + m.mlp_layer_share * mlp_saved_per_token(m, o)
                         + hc_saved_per_token(m, b))
        kept_each = 0
        why = "no checkpointing: every layer keeps all its saved tensors"
    stored = L * per_layer + len(kept) * kept_each
    host = offloaded * per_layer + sum(1 for i in kept if i < offloaded) * kept_each
    fetched = min(offloaded, max(0, o.offload_buffers - (L - offloaded)))
    if o.offload_activations:
        why += f"; on the host for the first {offloaded} of {L} layers, {fetched} back while recomputed/prefetched"
    return Checkpoints(len(kept), offloaded, per_layer, stored, host, stored - host, fetched * per_layer, why)


def mean_layer_saved_per_token(m: ModelShape, o: PlanOptions) -> float:
    """A layer's saved tensors (without its MLP's) averaged over the layers: hybrids mix kinds."""
    kinds = kinds_of(m)
    if len(kinds) == 1:
        return mixer_saved_per_token(m, o, kinds[0])
    return sum(m.layer_kinds.count(kind) * mixer_saved_per_token(m, o, kind) for kind in kinds) / m.layers


def gradients_and_checkpoints(m: ModelShape, o: PlanOptions, ckpt: Checkpoints) -> list[Component]:
    """ZeRO-3: this GPU's partition of the reduced gradients, plus the optimizer's fp32 copy of one sub-group
    (of the whole partition when the optimizer runs on the host); every checkpoint alive at the peak."""
    per_rank = _per_rank(m, o)
    fp32_grads = 4 * (min(per_rank, o.sub_group_size) if not o.offload_optimizer else per_rank)
    grads = o.dtype_bytes * per_rank + (fp32_grads if o.include_optimizer else 0)
    if o.offload_optimizer:
        gradients = Component("gradients (bf16 + fp32 partitions)", host=grads,
                              why="reduced gradient partitions on the host (pinned)")
    else:
        gradients = _everywhere("gradients (bf16 + fp32 partitions)", grads,
                                "partition of the reduced gradients, plus the optimizer's fp32 copy of one sub-group")
    return [gradients, _everywhere("checkpointed activations", ckpt.on_gpu + ckpt.resident, ckpt.why, host=ckpt.host)]


def unpartitioned_backward(m: ModelShape, o: PlanOptions, ckpt: Checkpoints) -> list[Component]:
    """Without ZeRO backward frees one layer's checkpoint as it creates that layer's gradients: the peak is at
    the first recomputed layer (all checkpoints, one layer of gradients) or the last (one checkpoint, all
    layer gradients), whichever is larger. The lm_head gradient exists from the loss's backward on."""
    L, b = m.layers, o.dtype_bytes
    layer_grads = b * m.layer_params
    ckpt_first = ckpt.on_gpu + ckpt.resident  # every checkpoint the GPU holds when backward starts
    ckpt_last = ckpt.stored // L  # layer 0's own, left on the GPU or fetched back
    first, last = ckpt_first + layer_grads, ckpt_last + L * layer_grads
    held, grads_layers = (ckpt_first, layer_grads) if first >= last else (ckpt_last, L * layer_grads)
    grads_layers += b * m.lm_head_params
    return [_layer("gradients (not partitioned)", grads_layers, grads_layers, grads_layers,
                   "full-size gradients, created layer by layer during backward"),
            Component("checkpointed activations", ckpt.on_gpu + ckpt.resident, held, held, held, ckpt.host,
                      ckpt.why + "; freed one per layer in backward")]


# ---------------------------------------------------------------- the loss and one layer's backward


def loss(m: ModelShape, o: PlanOptions) -> Component:
    """The end of the forward: the final norm's output and saved tensors, then the logits."""
    b, s, h, V = o.dtype_bytes, o.seq_local, m.hidden, m.vocab
    final = s * (2 * b if o.low_memory_rmsnorm else hf_norm_saved(m, o, 0) + b) * h + s * head_saved_per_token(m)
    if not o.chunked_loss:
        return Component("loss (full logits)", loss=final + s * V * (2 * b + 8),
                         why="s x vocab logits, their fp32 log-softmax, its fp32 gradient and the cast "
                             "gradient, plus the final norm's tensors")
    rows = min(o.loss_chunk_rows, s)
    forward = 4 * V * h + rows * V * (2 * b + 4) + s * h * b
    backward = 8 * V * h + 2 * s * h * b + (0 if o.zero_stage == 3 else b * V * h)
    return Component("loss (chunked, fused)", loss=final + max(forward, backward),
                     why="fp32 lm_head gradient accumulator (and its scaled copy in backward), one chunk "
                         "of logits, the hidden-state gradient, the final norm's tensors")


LAYER_MOMENTS = ("mlp", "norm", "attn")


def worst_layer_transients(m: ModelShape, o: PlanOptions) -> list[Component]:
    """The recomputed layer that holds most: a hybrid's linear layers and its attention layers save and free
    different tensors, and the step's peak is at whichever kind's backward holds more."""
    candidates = [layer_transients(m, o, kind) for kind in kinds_of(m)]
    return max(candidates, key=lambda parts: max(sum(p.at(t) for p in parts) for t in LAYER_MOMENTS))


def mixer_saved_per_token(m: ModelShape, o: PlanOptions, kind: str) -> float:
    """What one recomputed layer of this kind saves per local token, apart from the MLP's intermediates: its two
    RMSNorms and its mixer (mixer_terms.MIXER_TERMS)."""
    return norms_saved_per_token(m, o) + MIXER_TERMS[kind].saved(m, o)


def layer_transients(m: ModelShape, o: PlanOptions, kind: str = "attention") -> list[Component]:
    """One layer's recompute and backward: the first recomputed layer of this planner kind (ModelShape.kinds), at
    its three moments; `attn` is the mixer's backward."""
    b, s, h = o.dtype_bytes, o.seq_local, m.hidden
    parts = []
    post_norm = s * (2 * b if o.low_memory_rmsnorm else hf_norm_saved(m, o, 0) + b) * h  # post-attention norm
    if o.gradient_checkpointing:
        saved = s * mixer_saved_per_token(m, o, kind)
        parts.append(_layer(MIXER_TERMS[kind].saved_name, saved, saved - s * b * h,
                            saved - post_norm,
                            "norms, the mixer's saved tensors (after all-to-all); the MLP input is freed before the "
                            "norm backward, the whole post-attention norm before the mixer's"))
        mlp_saved = s * mlp_saved_per_token(m, o) if has_mlp(m, kind) else 0
    else:
        mlp_saved = 0  # already in the activations every layer keeps
    incoming = s * h * b * streams_of(m)  # gradient arriving at the layer's output (the residual streams)
    parts.append(_layer("layer: incoming gradient", incoming, incoming, incoming))
    if streams_of(m) > 1:
        moments = {moment: s * per_token for moment, per_token in hc_layer_moments(m, b).items()}
        parts.append(_layer("layer: hyper-connections", why="fp32 streams each hyper-connection saved, the "
                            "streams' gradient (planner/hyper_connections.py)", **moments))
    # a ZeRO-3 leaf block (TiledMLP's, any mixture of experts'): its gradients, or its gather (leaf_blocks.py)
    mlp_grads, gather = leaf_block_backward(m, o)
    mlp_moment = max(mlp_saved + s * mlp_backward_extra_per_token(m, o) + mlp_grads, gather) if has_mlp(m, kind) else 0
    parts.append(_layer("layer: MLP", mlp_moment,
                        why=(f"TiledMLP, {mlp_tiles(m, o)} tiles" + (" (MLP weight gradients kept until the last "
                                                                      "tile)" if mlp_grads else ""))
                        if o.tiled_mlp else "4 saved s x intermediate tensors, net +2 in backward"))
    parts.append(_layer("layer: RMSNorm backward",
                        norm=s * norm_backward_extra_per_token(m, o) + norm_backward_chunk_bytes(o),
                        why="input gradient and fp32 row-chunk temporaries (low-memory norm)" if o.low_memory_rmsnorm
                        else "fp32 gradient chain of the post-attention norm (Hugging Face's module)"))
    return parts + mixer_backward(m, o, kind)


def has_mlp(m: ModelShape, kind: str) -> bool:
    """Whether a layer of this kind has an MLP or experts block: every layer, but with separate blocks (Nemotron-H)
    only the layers without a token mixer."""
    return not m.separate_blocks or kind == NO_MIXER


def mixer_backward(m: ModelShape, o: PlanOptions, kind: str) -> list[Component]:
    """The mixer's backward (mixer_terms.MIXER_TERMS: the attention kernel, fla's gated delta rule, ...) and its
    largest exchange's buffers."""
    terms = MIXER_TERMS[kind]
    return [_layer(terms.backward_name, attn=o.seq_local * terms.backward(m, o), why=terms.backward_why)
            ] + exchange_buffers(m, o, kind)


def exchange_buffers(m: ModelShape, o: PlanOptions, kind: str) -> list[Component]:
    """Under sp, the all-to-all's send copy and receive buffer of this kind's largest exchange (q for attention;
    q, k, v, a, b for a Gated DeltaNet); none without sp."""
    if o.sp == 1:
        return []
    width = MIXER_TERMS[kind].exchange_width(m, o)
    return [_layer("all-to-all buffers", attn=2 * o.seq_local * o.dtype_bytes * width,
                   why="send copy and receive buffer of the largest exchange")]


def communication_and_overheads(m: ModelShape, o: PlanOptions) -> list[Component]:
    parts = []
    if o.zero_stage == 3:
        parts.append(_everywhere("ZeRO reduce bucket", o.dtype_bytes * o.reduce_bucket_size,
                                 "contiguous gradient bucket, allocated at start"))
    parts.append(Component("cuda context (outside allocator)", *(CUDA_CONTEXT_BYTES,) * 4,
                           why="context, NCCL, cuBLAS workspaces", outside_allocator=True))
    parts.append(Component("host process", host=HOST_PROCESS_BYTES, why="python, libraries, sample"))
    return parts


# ---------------------------------------------------------------- FLOPs and notes


def flops(m: ModelShape, o: PlanOptions, kept_layers: int) -> tuple[float, float]:
    """(model FLOPs, recompute FLOPs) of one whole sequence, over its sp GPUs. Model FLOPs are the trainer's
    figure (model/flops.py model_flops: 6*N*T + 3 * causal attention forward + the indexers' forward). Recompute:
    each checkpointed layer's forward (attention where not kept; indexed layers' attention and indexer always),
    TiledMLP's tile forwards, and in head chunks attention's forward once more."""
    T, L, h = o.padded_length, m.layers, m.hidden
    windows = m.flop_windows
    attention_forward = attention_forward_flops(T, m.attention_flop_width, L, windows=windows)
    indexed_forward = attention_forward_flops(T, m.attention_flop_width, L, windows=m.indexed_flop_windows)
    indexers = indexer_forward_flops(T, m.indexers)
    recompute = 0.0
    if o.gradient_checkpointing:
        attending = len(m.attention_layers) if m.attention_layers is not None else L
        plain = attention_forward - indexed_forward
        recomputed_attention = plain * (attending - kept_layers) / attending if attending else 0.0
        recompute += 2 * L * m.active_params_per_layer * T + recomputed_attention  # none: a hybrid's prefix
        recompute += indexed_forward + indexers  # indexed layers are never kept: their attention and indexer rerun
    if o.attention_head_chunks > 1:  # each chunk's forward runs again in its backward (head_chunks.py)
        recompute += attention_forward
    if o.tiled_mlp:
        matrices = 3 if m.gated_mlp else 2  # TiledMLP's backward re-runs each tile's forward
        recompute += 2 * matrices * h * m.mlp_width * L * m.mlp_layer_share * T
    return model_flops(m.matmul_params, T, m.attention_flop_width, L, windows=windows, indexers=m.indexers), recompute


def head_notes(m: ModelShape, o: PlanOptions) -> list[str]:
    """Why Ulysses cannot split this model's heads over sp, one note per mixer (model/mixers sp_problems: the
    trainer's rule); the plan is still made."""
    return [f"{problem}; Ulysses cannot split it." for problem in sp_problems(m, o.sp)]
