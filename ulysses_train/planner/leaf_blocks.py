"""A ZeRO-3 leaf MLP block in the planner: TiledMLP's block and every mixture of experts' (model/tiling.py makes
them leaves), which DeepSpeed gathers whole and whose gradients it reduces when the block's backward ends. Each term
was found in an allocator history of an emulated sp=8 rank on one H200 (benchmarks/RESULTS.md, DeepSeek-V3 and
Kimi K2 expert layers)."""
from __future__ import annotations

from ulysses_train.planner.layer import mlp_tiles
from ulysses_train.planner.options import PlanOptions
from ulysses_train.planner.shapes import ModelShape


def mlp_leaf_params(m: ModelShape, o: PlanOptions) -> int:
    """Parameters of an MLP block that ZeRO-3 gathers whole, whatever stage3_max_live_parameters says: TiledMLP's
    and every mixture of experts' block is a ZeRO-3 leaf module (model/tiling.py), whose parameters DeepSpeed
    fetches all at once. A DeepSeek-V3 expert layer's 11.3B parameters (21 GiB). 0 for other MLPs."""
    return m.mlp_params if o.zero_stage == 3 and (o.tiled_mlp or m.experts) else 0


def largest_block_param(m: ModelShape) -> int:
    """The MLP block's largest parameter: a mixture of experts' fused gate and up projections (every expert's in
    one tensor, transformers' `gate_up_proj`), else one dense projection (hidden x intermediate)."""
    if m.experts:
        return m.experts * (2 if m.gated_mlp else 1) * m.expert_intermediate * m.hidden
    return m.hidden * m.intermediate


def expert_reduce_copy(m: ModelShape, o: PlanOptions) -> int:
    """Under sp DeepSpeed reduces gradients in fp32 (`seq_parallel_communication_data_type`, its default, replaces
    `communication_data_type` whenever sp > 1) and casts each gradient of a reduce whole: for a mixture of experts
    that is a fused expert tensor (measured: DeepSeek-V3's `gate_up_proj`, 7.5B elements, a 28 GiB request at the
    end of its layer's backward). o.sp_reduce_cast_bytes per element (0 where the JSON sets the reduce to the
    training dtype). 0 without experts, sp, ZeRO-3 or expert gradients (LoRA)."""
    if not (m.experts and o.sp > 1 and o.zero_stage == 3) or o.adapter_params:
        return 0
    return o.sp_reduce_cast_bytes * largest_block_param(m)


def tile_gradient_accumulation(m: ModelShape, o: PlanOptions) -> int:
    """TiledMLP runs a block's backward one tile at a time (DeepSpeed's TiledMLP.backward): from the second tile on,
    autograd computes each parameter's gradient afresh and adds it to the one kept, so the largest parameter's
    gradient exists twice (measured: DeepSeek-V3's expert layer held its 21 GiB of gradients and 14 GiB more, its
    `gate_up_proj` gradient again, at 131,072 tokens in 3 tiles). 0 with one tile or no block gradients (LoRA)."""
    if not mlp_leaf_params(m, o) or not o.tiled_mlp or mlp_tiles(m, o) < 2 or o.adapter_params:
        return 0
    return o.dtype_bytes * largest_block_param(m)


def gather_buffer(m: ModelShape, o: PlanOptions) -> int:
    """DeepSpeed's coalesced all-gather of a leaf block writes every partition into one flat buffer, then copies
    each parameter out of it (partition_parameters.py `_all_gather_dtype`, `wait`): while the block is gathered
    its bytes exist twice (measured: Kimi K2's expert layer, 31.6 GiB in the flat buffer beside 32.3 GiB gathered,
    the rank's peak). The planner's "weights gathered" counts the parameters; this is the buffer."""
    return o.dtype_bytes * mlp_leaf_params(m, o)


def merged_adapter_weights(m: ModelShape, o: PlanOptions) -> int:
    """LoRA on fused expert tensors (PlanOptions.lora_merged_params): PEFT's parametrization builds each merged
    weight W + B @ A whole in the block's forward (every tile's, under TiledMLP), kept for its backward, which makes
    a gradient of the merged weight as large: all of the layer's merged tensors and the first one backward reaches
    (the down projection: total - largest), or the largest and its own gradient, whichever is more, which for a
    gated block is 2 x total - largest (measured: Kimi K2's expert layer, 31.5 GiB merged and 11.8 GiB of its
    gradients at the peak)."""
    if not o.lora_merged_params or not m.experts:
        return 0
    total, largest = o.lora_merged_params
    return o.dtype_bytes * max(2 * total - largest, 2 * largest)


def leaf_block_backward(m: ModelShape, o: PlanOptions) -> tuple[int, int]:
    """(bytes a leaf block's backward adds to its MLP moment: its weight gradients, kept until the last tile,
    the accumulation's second copy and the fp32 reduce copy, or under LoRA the merged adapted weights; bytes its
    gather adds, at the start of the same layer's recompute, before the block's activations and gradients exist).
    Under LoRA the block's own weights are frozen: no gradients."""
    grads = 0 if o.adapter_params else o.dtype_bytes * mlp_leaf_params(m, o)
    grads += tile_gradient_accumulation(m, o) + expert_reduce_copy(m, o) + merged_adapter_weights(m, o)
    return grads, gather_buffer(m, o)
