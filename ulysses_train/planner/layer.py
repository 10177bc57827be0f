"""What one decoder layer holds per local token while it is recomputed and run backward (HF Qwen3/Llama modules,
matched to the byte on an H200, layer by layer). `b` is the parameter dtype size, `h` hidden, `q = heads x
head_dim`, `kv = kv_heads x head_dim`."""
from __future__ import annotations

from ulysses_train.model.tiling import mlp_tile_count
from ulysses_train.planner.options import PlanOptions
from ulysses_train.planner.shapes import ModelShape


def kv_width_after_all_to_all(m: ModelShape, sp: int) -> int:
    """KV width per token after Ulysses: each rank gets kv_heads/sp heads over the whole sequence, or one
    replicated head when sp exceeds the KV heads (DeepSpeed repeats them). Per local token that is
    max(kv_heads, sp) heads."""
    return (max(m.kv_heads, sp) if sp > 1 else m.kv_heads) * m.head_dim


def norms_saved_per_token(m: ModelShape, o: PlanOptions) -> int:
    """Bytes per local token the two RMSNorms over the hidden state save (any layer kind): each keeps its fp32
    upcast (4h), its normalized output (bh) and its output (bh), which the next projections save as their input;
    with the low-memory RMSNorm each keeps its bf16 input (for the input norm that is the checkpoint, counted
    there) and one fp32 scale per row, plus the output the next projections keep."""
    b, h = o.dtype_bytes, m.hidden
    if o.low_memory_rmsnorm:
        return b * h + 2 * b * h  # input norm: its output; post-attention norm: its input and output
    return m.norms_per_layer * (4 + 2 * b) * h


def layer_saved_per_token(m: ModelShape, o: PlanOptions) -> int:
    """Bytes per local token that one (re)computed attention layer saves for backward, apart from the MLP's
    intermediates (HF Qwen3/Llama modules; matched to the byte on an H200, layer by layer):
    - the two RMSNorms (norms_saved_per_token);
    - the per-head q/k RMSNorms, where the model has them (Qwen3, Gemma 3): fp32 upcast and normalized q and k
      (with the low-memory RMSNorm: normalized q and k, one fp32 scale per head);
    - q, k, v as the attention kernel sees them (under sp: after the all-to-all, each rank holding the
      whole sequence for its share of heads), the kernel's output and its fp32 logsumexp;
    - under sp the o_proj input is a new tensor made by the reverse all-to-all (with sp=1 o_proj saves
      the kernel's output itself);
    - an output gate (Qwen3.5, Qwen3-Next: attention output x sigmoid(gate), the gate from q_proj): the sigmoid's
      output and the gated product, which o_proj saves."""
    b, q, kv = o.dtype_bytes, m.q_width, m.kv_width
    if o.low_memory_rmsnorm:
        qk_norms = b * (q + kv) + 4 * (m.heads + m.kv_heads)
    else:
        qk_norms = (4 + b) * (q + kv)
    if not m.head_norms:
        qk_norms = 0
    attention = b * (q + 2 * kv_width_after_all_to_all(m, o.sp)) + b * q + 4 * m.heads
    o_proj_input = b * q if o.sp > 1 else 0
    gate = 2 * b * q if m.output_gate else 0
    return norms_saved_per_token(m, o) + qk_norms + attention + o_proj_input + gate


def mlp_tiles(m: ModelShape, o: PlanOptions) -> int:
    """TiledMLP's tile count: the options' own, or the trainer's (model/tiling.py mlp_tile_count)."""
    return o.mlp_tiles or mlp_tile_count(o.seq_local, m.hidden)


def routed_copies_per_token(m: ModelShape, o: PlanOptions) -> float:
    """A mixture of experts' extra bytes per token: each token's hidden state copied to its k experts and their
    k outputs before the weighted sum, plus the fp32 router probabilities. 0 for a dense MLP."""
    return (2 * m.experts_per_token * o.dtype_bytes * m.hidden + 4 * m.experts) if m.experts else 0


def mlp_intermediates(m: ModelShape, o: PlanOptions) -> tuple[int, int]:
    """(s x intermediate tensors an untiled MLP saves, those its backward adds at its peak). Hugging Face's
    `down(act(gate(x)) * up(x))`: gate, up, act(gate) and the product saved; the product's gradient and its two
    factors' in backward, while the product is freed: net 2 (measured). Liger's SiLU-and-multiply kernel
    (`o.swiglu_kernel`, dense MLPs: model/swiglu.py) saves gate and up only (the product still, for down_proj) and
    writes their gradients over them: 3 saved, 1 more (the product's gradient)."""
    return (3, 1) if o.swiglu_kernel and not m.experts else (4, 2)


def mlp_saved_per_token(m: ModelShape, o: PlanOptions) -> float:
    """What the MLP keeps for backward per local token beyond its input (counted with the norm). Untiled, the
    s x intermediate tensors of mlp_intermediates (for a mixture of experts k of them per token,
    ModelShape.mlp_width, and the routed copies). TiledMLP saves only its input."""
    saved, _ = mlp_intermediates(m, o)
    return 0 if o.tiled_mlp else saved * o.dtype_bytes * m.mlp_width + routed_copies_per_token(m, o)


def mlp_backward_extra_per_token(m: ModelShape, o: PlanOptions) -> float:
    """Extra bytes per local token at the MLP's backward peak. Untiled: mlp_intermediates' backward tensors.
    Tiled: one tile's saved and backward intermediates spread over the sequence, plus the input gradient TiledMLP
    accumulates."""
    b, i = o.dtype_bytes, m.mlp_width
    saved, extra = mlp_intermediates(m, o)
    if o.tiled_mlp:
        return ((saved + extra) * b * i + 2 * routed_copies_per_token(m, o)) / mlp_tiles(m, o) + b * m.hidden
    return extra * b * i


def norm_backward_extra_per_token(m: ModelShape, o: PlanOptions) -> int:
    """HF's RMSNorm backward runs in fp32: at its peak ~4 fp32 copies of the input plus the input gradient
    (measured: 18 bytes x hidden per token in bf16). The low-memory one: the input gradient, plus fp32
    temporaries of one row chunk (`norm_backward_chunk_bytes`)."""
    if o.low_memory_rmsnorm:
        return o.dtype_bytes * m.hidden
    return (16 + o.dtype_bytes) * m.hidden


def norm_backward_chunk_bytes(o: PlanOptions) -> int:
    """The low-memory RMSNorm's fp32 temporaries in backward: about six tensors of one row chunk."""
    from ulysses_train.model.rmsnorm import CHUNK_ELEMENTS

    return 6 * 4 * CHUNK_ELEMENTS if o.low_memory_rmsnorm else 0


def attention_backward_extra_per_token(m: ModelShape, o: PlanOptions) -> int:
    """Extra bytes per local token at the attention kernel's backward: dq, dk, dv, the fp32 dq accumulator and
    the gradient of the attention output, plus, per kernel: SDPA (measured) keeps fp32 softmax row sums and,
    under GQA (fewer kv than query heads), expands dk and dv to every query head before the group sum;
    FlashAttention 4 (its interface's allocations) keeps two fp32 numbers per head (the scaled logsumexp, the
    output-gradient row sums) and, under GQA, accumulates dk and dv in fp32 at the kv heads' width."""
    b, q, kv = o.dtype_bytes, m.q_width, kv_width_after_all_to_all(m, o.sp)
    common = b * (q + 2 * kv) + 4 * q + b * q
    if o.attention_kernel == "fa4":
        return common + (2 * 4 * kv if kv < q else 0) + 2 * 4 * m.heads
    return common + (2 * b * q if kv < q else 0) + 4 * m.heads
