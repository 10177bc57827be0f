"""What one decoder layer holds per local token while it is recomputed and run backward (HF Qwen3/Llama modules,
matched to the byte on an H200, layer by layer). `b` is the parameter dtype size, `h` hidden, `q = heads x
head_dim`, `kv = kv_heads x head_dim`."""
from __future__ import annotations

from ulysses_train.model.tiling import mlp_tile_count
from ulysses_train.planner.options import PlanOptions
from ulysses_train.planner.shapes import ModelShape


def kv_heads_after_all_to_all(m: ModelShape, sp: int) -> int:
    """KV heads per local token after Ulysses: each rank gets kv_heads/sp heads over the whole sequence, or one
    replicated head when sp exceeds the KV heads (DeepSpeed repeats them). Per local token that is
    max(kv_heads, sp) heads."""
    return max(m.kv_heads, sp) if sp > 1 else m.kv_heads


def kv_width_after_all_to_all(m: ModelShape, sp: int) -> int:
    """k's width per local token after Ulysses (kv_heads_after_all_to_all heads of head_dim)."""
    return kv_heads_after_all_to_all(m, sp) * m.head_dim


def v_width_after_all_to_all(m: ModelShape, sp: int) -> int:
    """v's width per local token after Ulysses: as k's, of the value head width (MLA's v_head_dim)."""
    return kv_heads_after_all_to_all(m, sp) * m.v_head_width


def hf_norm_saved(m: ModelShape, o: PlanOptions, which: int) -> int:
    """Bytes per channel a norm left as Hugging Face's module saves (ModelShape.norm_saved[which]: 0 a hidden-state
    norm, 1 a q/k head norm, 2 a v head norm), as measured at bf16; at another dtype Llama's form, the fp32 upcast
    and the normalized rows (4 + b)."""
    measured = m.norm_saved[which]
    return measured if o.dtype_bytes == 2 or not measured else 4 + o.dtype_bytes


def norms_saved_per_token(m: ModelShape, o: PlanOptions) -> int:
    """Bytes per local token the RMSNorms over the hidden state save (any layer kind): each what Hugging Face's
    module saves (hf_norm_saved: Llama's fp32 upcast and normalized rows, 4h + bh; Gemma's fp32 normalized rows,
    8h), and the two whose outputs the next projections save as their input (the mixer's and the MLP's input
    norms; Gemma's post-norms feed the residual, which saves nothing) their output, bh each; with the low-memory
    RMSNorm each keeps its bf16 input (for the input norm that is the checkpoint, counted there) and one fp32 scale
    per row, plus the output the next projections keep."""
    b, h = o.dtype_bytes, m.hidden
    if o.low_memory_rmsnorm:
        return b * h + 2 * b * h  # input norm: its output; post-attention norm: its input and output
    return m.norms_per_layer * hf_norm_saved(m, o, 0) * h + 2 * b * h


def layer_saved_per_token(m: ModelShape, o: PlanOptions) -> int:
    """Bytes per local token that one (re)computed attention layer saves for backward, apart from the MLP's
    intermediates: its two RMSNorms and its attention (attention_saved_per_token)."""
    return norms_saved_per_token(m, o) + attention_saved_per_token(m, o)


def attention_saved_per_token(m: ModelShape, o: PlanOptions) -> int:
    """Bytes per local token that one (re)computed attention mixer saves for backward beyond its input (HF
    Qwen3/Llama modules; matched to the byte on an H200, layer by layer):
    - the per-head q/k RMSNorms, where the model has them (Qwen3, Gemma 3): what Hugging Face's module saves
      (hf_norm_saved) of q and k (with the low-memory RMSNorm: normalized q and k, one fp32 scale per head), and
      a v norm's (Gemma 4's unscaled one: its fp32 upcast);
    - q, k, v as the attention kernel sees them (under sp: after the all-to-all, each rank holding the
      whole sequence for its share of heads), the kernel's output (query heads x the value head width) and its
      fp32 logsumexp;
    - under sp the o_proj input is a new tensor made by the reverse all-to-all (with sp=1 o_proj saves
      the kernel's output itself);
    - an output gate (Qwen3.5, Qwen3-Next: attention output x sigmoid(gate), the gate from q_proj): the sigmoid's
      output and the gated product, which o_proj saves;
    - multi-head latent attention's latent path (latent_saved_per_token).
    In head chunks (model.attention_head_chunks > 1: model/mixers/head_chunks.py) the layer saves q, k and v of its
    slice (k and v with KV heads repeated up to sp) and its output, which is o_proj's input: nothing in the
    whole-sequence layout."""
    b, q, kv, out = o.dtype_bytes, m.q_width, m.kv_width, m.attention_output_width
    if o.low_memory_rmsnorm:
        qk_norms = b * (q + kv) + 4 * (m.heads + m.kv_heads)
    else:
        qk_norms = hf_norm_saved(m, o, 1) * (q + kv)
    if not m.head_norms:
        qk_norms = 0
    qk_norms += hf_norm_saved(m, o, 2) * m.kv_heads * m.v_head_width
    attention = b * (q + kv_width_after_all_to_all(m, o.sp) + v_width_after_all_to_all(m, o.sp)) + b * out
    if o.attention_head_chunks > 1:  # q, k, v of the slice; the output is o_proj's input (head_chunks.py)
        o_proj_input = 0
    else:  # the kernel's output and logsumexp, and under sp o_proj's input made by the reverse all-to-all
        attention += 4 * m.heads
        o_proj_input = b * out if o.sp > 1 else 0
    gate = 2 * b * out if m.output_gate else 0
    expanded = b * (q + m.heads * m.v_head_width) if wide_heads_expanded(m, o) else 0
    return qk_norms + attention + expanded + o_proj_input + gate + latent_saved_per_token(m, o)


def wide_heads_expanded(m: ModelShape, o: PlanOptions) -> bool:
    """Whether a FlashAttention 4 run sends this attention to the wide-head path (model/fa4.py
    wide_head_attention: heads wider than FlashAttention 4 takes, Gemma 4's 512), which repeats the rank's KV heads
    to every query head before SDPA's memory-efficient kernel, which saves the repeated k and v. Planned as on
    Hopper (fa4.fa4_takes), the GPU where the path runs; grouped heads only (otherwise nothing is repeated)."""
    from ulysses_train.model.fa4 import fa4_takes

    hopper = (9, 0)
    return (o.attention_kernel == "fa4" and not fa4_takes(m.head_dim, m.v_head_width, hopper)
            and kv_heads_after_all_to_all(m, o.sp) < m.heads)


def latent_saved_per_token(m: ModelShape, o: PlanOptions) -> int:
    """Multi-head latent attention (transformers' KimiLinearAttention) beyond q, k and v: the latent's RMSNorm
    (Hugging Face's fp32 module: the fp32 upcast and one fp32 scale per row, the cast normalized rows, and the
    weighted output kv_b_proj saves) and, without sp, the keys' no-RoPE part of kv_b_proj's output ([k_nope | v] per
    head), which the kernel's v, a view of it, keeps alive (under sp v is the exchange's own tensor). 0 otherwise."""
    if not m.attention_latent:
        return 0
    b, (rank, key_part) = o.dtype_bytes, m.attention_latent
    kept = b * m.kv_heads * key_part if o.sp == 1 else 0
    return (4 + 2 * b) * rank + 4 + kept


def mlp_tiles(m: ModelShape, o: PlanOptions) -> int:
    """TiledMLP's tile count: the options' own, or the trainer's (model/tiling.py mlp_tile_count)."""
    return o.mlp_tiles or mlp_tile_count(o.seq_local, m.hidden)


def routed_copies_per_token(m: ModelShape, o: PlanOptions) -> float:
    """A mixture of experts' extra bytes per token: each token's state copied to its k experts and their k outputs
    before the weighted sum, plus the fp32 router probabilities. 0 for a dense MLP. Behind a latent projection
    (ModelShape.expert_width) the copies are latent-wide. Checked on CPU only (transformers' eager experts, saved-tensor
    hooks on a tiny Nemotron 3 Super block): the latent block saves 5 latent-wide tensors a token where the plain one
    saves 6 hidden-wide, within the narrowed copies; not measured on a GPU."""
    if not m.experts:
        return 0
    return 2 * m.experts_per_token * o.dtype_bytes * (m.expert_width or m.hidden) + 4 * m.experts


def mlp_intermediates(m: ModelShape, o: PlanOptions) -> tuple[int, int]:
    """(s x intermediate tensors an untiled MLP saves, those its backward adds at its peak). Hugging Face's
    `down(act(gate(x)) * up(x))`: gate, up, act(gate) and the product saved; the product's gradient and its two
    factors' in backward, while the product is freed: net 2 (measured). Liger's SiLU-and-multiply kernel
    (`o.swiglu_kernel`, dense MLPs: model/swiglu.py) saves gate and up only (the product still, for down_proj) and
    writes their gradients over them: 3 saved, 1 more (the product's gradient). An ungated `down(act(up(x)))`
    (Nemotron-H's relu²: ModelShape.gated_mlp False) saves up's output and act's (2), its backward adds their
    gradients while freeing neither (2)."""
    if not m.gated_mlp:
        return 2, 2
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
    b, q, out = o.dtype_bytes, m.q_width, m.attention_output_width
    k, v = kv_width_after_all_to_all(m, o.sp), v_width_after_all_to_all(m, o.sp)
    if o.attention_head_chunks > 1:  # the slice's dk, dv (dq is written over q) and the output gradient
        return b * (k + v + out) + chunk_backward_per_token(m, o)
    if wide_heads_expanded(m, o):  # SDPA's kernel on k and v repeated to every query head
        return kernel_backward_per_token(o.replace(attention_kernel="sdpa"), q, q, m.heads * m.v_head_width, out,
                                         m.heads, False)
    return kernel_backward_per_token(o, q, k, v, out, m.heads, kv_heads_after_all_to_all(m, o.sp) < m.heads)


def kernel_backward_per_token(o: PlanOptions, q: float, k: float, v: float, out: float, heads: float,
                              grouped: bool) -> float:
    """The attention kernel's backward for q, k, v and output gradient of these widths (all of a rank's heads, or
    one head chunk's), `grouped` when its query heads share KV heads: attention_backward_extra_per_token's
    terms."""
    b = o.dtype_bytes
    common = b * (q + k + v) + 4 * q + b * out
    if o.attention_kernel == "fa4":
        return common + (4 * (k + v) if grouped else 0) + 2 * 4 * heads
    return common + (b * (q + out) if grouped else 0) + 4 * heads


def head_chunk_divisors(m: ModelShape, o: PlanOptions) -> tuple[int, int]:
    """(what one head chunk divides q by, what it divides k and v by): the chunk count, and for KV heads the chunk
    count or the rank's KV heads where fewer (a chunk then reads a whole KV head: model/mixers/head_chunks.py)."""
    chunks = o.attention_head_chunks
    rank_kv = max(1, kv_heads_after_all_to_all(m, o.sp) // o.sp)
    return chunks, min(chunks, rank_kv)


def chunk_backward_per_token(m: ModelShape, o: PlanOptions) -> float:
    """One head chunk's turn in backward (head_chunks.HeadChunkedAttention), beyond the slice's gradients: its q, k
    and v of the slice (copies) and after the all-to-all; the recomputed output and its logsumexp; the output
    gradient's copy and its exchange; the kernel's backward of the chunk (a chunk of one query head per KV head is
    not grouped: no fp32 dk, dv accumulators)."""
    b, out, sp = o.dtype_bytes, m.attention_output_width, o.sp
    by_q, by_kv = head_chunk_divisors(m, o)
    q, k, v = m.q_width / by_q, kv_width_after_all_to_all(m, sp) / by_kv, v_width_after_all_to_all(m, sp) / by_kv
    heads = m.heads / by_q
    grouped = heads > kv_heads_after_all_to_all(m, sp) / by_kv
    exchanged = 2 * b * (q + k + v) + 3 * b * out / by_q + 4 * heads
    return exchanged + kernel_backward_per_token(o, q, k, v, 0, heads, grouped)


def attention_exchange_width(m: ModelShape, o: PlanOptions) -> float:
    """Channels per token of attention's largest all-to-all, whose send copy and receive buffer are held beside the
    kernel's buffers: DeepSpeed's wrapper exchanges q, k and v one by one (q the largest); MLA layers (value heads of
    their own width: model/mixers/attention_exchange.py) exchange the three in one message. In head chunks none:
    a chunk's exchanges run between the kernel's turns, and its turn (chunk_backward_per_token) holds more than its
    exchange (measured: a 5M-token rank of Qwen3-8B in 4 chunks, benchmarks/RESULTS.md)."""
    if o.attention_head_chunks > 1:
        return 0
    if not m.value_head_dim:
        return m.q_width
    return m.q_width + m.kv_width + m.kv_heads * m.v_head_width


def attention_exchange_traffic(m: ModelShape, o: PlanOptions) -> tuple[float, float]:
    """(channels per local token to the head layout, channels back) in one pass of attention's all-to-alls
    (planner/exchange_time.py): q, k and v (KV heads repeated where sp exceeds them), then the output. In head
    chunks each chunk sends its KV heads, so where the chunks share a rank's KV heads each chunk sends them again
    (head_chunk_divisors)."""
    kv = kv_width_after_all_to_all(m, o.sp) + v_width_after_all_to_all(m, o.sp)
    if o.attention_head_chunks > 1:
        kv *= o.attention_head_chunks / head_chunk_divisors(m, o)[1]
    return m.q_width + kv, m.attention_output_width


def attention_forward_per_token(m: ModelShape, o: PlanOptions) -> int:
    """Bytes per local token of a layer's attention forward at its kernel (planner/forward_only.py), beyond the
    residual stream:
    - the input norm's output, which the layer holds while its attention runs (the projections' input);
    - q, k, v of this rank's slice after the projections, head norms and RoPE (Hugging Face's attention keeps them
      until it returns);
    - under sp: q, k, v after the all-to-all, the whole sequence of this rank's heads (kv_width_after_all_to_all),
      and the position ids Ulysses all-gathers (int64, the whole sequence);
    - SDPA under GQA: k and v expanded to every query head (transformers' repeat_kv where SDPA cannot take the
      groups; FlashAttention 4 takes them as they are);
    - the kernel's output, its transposed copy and the fp32 logsumexp;
    - an output gate (Qwen3.5): q_proj's output is query and gate, and the gate (a view) keeps all of it alive
      through the kernel; its sigmoid and the gated product come once the kernel's tensors are freed.
    The all-to-all's send and receive buffers are a component of their own (forward_only.exchange_buffers). In head
    chunks: the slice's q, k, v, the output it fills, and one chunk's turn (chunk_forward_per_token)."""
    b, h, q, out = o.dtype_bytes, m.hidden, m.q_width, m.attention_output_width
    kv = m.kv_width + m.kv_heads * m.v_head_width
    gathered_kv = kv_width_after_all_to_all(m, o.sp) + v_width_after_all_to_all(m, o.sp)
    local = b * (q + kv) + (2 * b * q if m.output_gate else 0)
    grouped = kv_heads_after_all_to_all(m, o.sp) < m.heads
    if o.attention_head_chunks > 1:  # head_chunks.py: the whole output of the slice, one chunk's turn at a time
        return b * h + local + b * out + chunk_forward_per_token(m, o)
    gathered = b * (q + gathered_kv) + 8 * o.sp if o.sp > 1 else 0
    expanded = b * (q + out) if o.attention_kernel != "fa4" and grouped else 0
    return b * h + local + gathered + expanded + 2 * b * out + 4 * m.heads


def chunk_forward_per_token(m: ModelShape, o: PlanOptions) -> float:
    """One head chunk's turn in the forward (head_chunks.HeadChunkedAttention.forward): its q, k, v of the slice
    copied and after the all-to-all, SDPA's expansion of grouped KV heads, the kernel's output, its logsumexp and
    the output back in the slice's layout."""
    b, out, sp = o.dtype_bytes, m.attention_output_width, o.sp
    by_q, by_kv = head_chunk_divisors(m, o)
    q, k, v = m.q_width / by_q, kv_width_after_all_to_all(m, sp) / by_kv, v_width_after_all_to_all(m, sp) / by_kv
    heads = m.heads / by_q
    grouped = heads > kv_heads_after_all_to_all(m, sp) / by_kv
    expanded = b * (q + out / by_q) if o.attention_kernel != "fa4" and grouped else 0
    return 2 * b * (q + k + v) + expanded + 2 * b * out / by_q + 4 * heads
