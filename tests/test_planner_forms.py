"""The planner's model forms: LoRA adapters, mixture of experts and sliding windows, the attention kernel and
head norms, Gated DeltaNet layers, where kept attention goes, the offset norms' kernel, the longest length with
partial offload, latent attention's FLOPs; each by hand on a tiny or real shape (test_planner.py: the core terms)."""
import dataclasses

from planner_tiny import H, HEADS, KV, LAYER_PARAMS, Q, TINY, TOTAL_PARAMS, V

from ulysses_train.constants import GIB
from ulysses_train.planner import ModelShape, PlanOptions, load_model_shape, max_length, plan


def test_lora_adapters_alone_carry_gradients_and_optimizer_states():
    """model.lora: the frozen base weights get no fp32 masters, Adam moments or gradients; the adapters do.
    By hand: 12 bytes of optimizer state per adapter parameter per GPU (1/world of them under ZeRO-3)."""
    full = plan("qwen3-8b", options=PlanOptions(seq_length=131072, sp=8, gpus_per_node=8))
    adapters = 43_646_976  # r=16 on every attention and MLP projection of Qwen3-8B (lora.lora_parameter_count)
    lora = plan("qwen3-8b", options=PlanOptions(seq_length=131072, sp=8, gpus_per_node=8, adapter_params=adapters))
    optimizer = lambda p: next(c for c in p.components if c.name.startswith("optimizer"))  # noqa: E731
    assert optimizer(lora).loss == 12 * (adapters // 8)
    assert optimizer(full).loss > 100 * optimizer(lora).loss
    assert lora.gpu_total < full.gpu_total - 10 * GIB  # ~16 GiB of optimizer and gradient partitions gone


def test_lora_parameter_count_of_qwen3_8b():
    from ulysses_train.model.lora import lora_parameter_count
    from ulysses_train.model.presets import qwen3_config

    # per layer r x (in + out): q 4096+4096, k 4096+1024, v 4096+1024, o 4096+4096, gate/up 4096+12288, down 12288+4096
    per_layer = 16 * (8192 + 5120 + 5120 + 8192 + 16384 * 3)
    assert lora_parameter_count(qwen3_config("qwen3-8b"), {"r": 16}) == 36 * per_layer == 43_646_976


def test_mixture_of_experts_and_windows_by_hand():
    """A tiny Qwen3-MoE (4 experts, top-2) and a tiny Gemma 3 (one windowed layer, one full): the planner's
    parameter counts against the model built, active parameters by hand (experts count k/E), the trainer's
    FLOP count (training/metrics.py) equal to the planner's, and windowed attention pairs by hand."""
    import torch
    from helpers import tiny_family_config
    from transformers import AutoModelForCausalLM

    from ulysses_train.planner.shapes import ModelShape
    from ulysses_train.model.flops import attended_pairs, attention_forward_flops, non_embedding_params

    config = tiny_family_config("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                head_dim=16)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    shape = ModelShape.from_hf_config(config)
    layer = model.model.layers[0]
    bank = sum(p.numel() for p in layer.mlp.experts.parameters())
    assert bank == 4 * 3 * 64 * 32  # gate_up (2 x 32 x 64) and down (64 x 32) per expert
    assert shape.total_params == sum(p.numel() for p in model.parameters())
    assert shape.layer_params == sum(p.numel() for p in layer.parameters())
    assert shape.active_layer_params == shape.layer_params - bank // 2
    assert shape.mlp_width == 2 * 32 and shape.mlp_params == sum(p.numel() for p in layer.mlp.parameters())
    # the planner and the trainer count the same active parameters (the trainer also counts the final norm's 64)
    assert non_embedding_params(model) - shape.matmul_params == 64
    gemma_norms = ModelShape.from_hf_config(tiny_family_config("gemma3_text"))
    assert not gemma_norms.llama_norms and gemma_norms.offset_norms  # Gemma's (1 + w) norms

    # windows: 10 tokens, window 4 -> 4*4/2 + 6*4 = 32 pairs (full: 50)
    assert attended_pairs(10, 4) == 32 and attended_pairs(10) == 50 and attended_pairs(3, 4) == 4.5
    gemma = ModelShape.from_hf_config(tiny_family_config("gemma3_text", head_dim=16, sliding_window=4,
                                                         layer_types=["sliding_attention", "full_attention"]))
    assert gemma.windows == (4, None) and gemma.norms_per_layer == 4
    assert attention_forward_flops(10, 64, 2, windows=[4, None]) == 4 * 64 * (32 + 50)
    assert attention_forward_flops(10, 64, 2) == 2 * 10**2 * 64 * 2  # unchanged for full attention


def test_attention_kernel_and_head_norms_by_hand():
    """FlashAttention 4's backward (flash_attn/cute/interface.py's allocations) against SDPA's (measured): under
    GQA fp32 dk/dv accumulators at the kv width instead of bf16 dk/dv expanded to every query head, and two fp32
    numbers per head instead of one. A model without per-head q/k norms (GPT-OSS) saves none of theirs."""
    from helpers import tiny_family_config

    s = 4096
    sdpa = {x.name: x for x in plan(TINY, options=PlanOptions(seq_length=s, gpus_per_node=1)).components}
    fa4 = {x.name: x for x in plan(TINY, options=PlanOptions(seq_length=s, gpus_per_node=1,
                                                             attention_kernel="fa4")).components}
    common = 2 * (Q + 2 * KV) + 4 * Q + 2 * Q  # dq dk dv, fp32 dq accumulator, output gradient
    assert sdpa["layer: attention backward"].attn == s * (common + 2 * 2 * Q + 4 * HEADS)
    assert fa4["layer: attention backward"].attn == s * (common + 2 * 4 * KV + 2 * 4 * HEADS)
    mha = dataclasses.replace(TINY, kv_heads=HEADS)  # no GQA: nothing expanded, nothing accumulated per kv head
    fa4_mha = {x.name: x for x in plan(mha, options=PlanOptions(seq_length=s, gpus_per_node=1,
                                                                attention_kernel="fa4")).components}
    assert fa4_mha["layer: attention backward"].attn == s * (2 * 3 * Q + 4 * Q + 2 * Q + 2 * 4 * HEADS)

    gpt_oss = ModelShape.from_hf_config(tiny_family_config("gpt_oss"))
    assert not gpt_oss.head_norms and load_model_shape("qwen3-4b").head_norms
    with_head_norms = dataclasses.replace(gpt_oss, head_norms=True)
    o = PlanOptions(seq_length=s, gpus_per_node=1, low_memory_rmsnorm=False)
    saved = lambda shape: {x.name: x for x in plan(shape, options=o).components}[  # noqa: E731
        "layer: recomputed saved tensors"].mlp
    assert saved(with_head_norms) - saved(gpt_oss) == s * (4 + 2) * (gpt_oss.q_width + gpt_oss.kv_width)


def test_gated_deltanet_layers_counted_and_charged_no_attention_pairs():
    """A tiny Qwen3.5 (a Gated DeltaNet layer, then a gated full-attention layer): the planner's parameter
    counts equal the model built; the FLOP count (one definition for the trainer and the planner) charges
    (query, key) pairs for the full-attention layer only; a plan and its time come out."""
    import torch
    from helpers import tiny_family_config
    from transformers import AutoModelForCausalLM

    from ulysses_train.planner.estimate import flops
    from ulysses_train.model.flops import attention_forward_flops, model_flops_per_sequence

    config = tiny_family_config("qwen3_5_text", head_dim=16, linear_num_key_heads=4, linear_num_value_heads=8,
                                linear_key_head_dim=16, linear_value_head_dim=8,
                                layer_types=["linear_attention", "full_attention"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    shape = ModelShape.from_hf_config(config)
    assert shape.total_params == sum(p.numel() for p in model.parameters())
    assert shape.layer_params == max(sum(p.numel() for p in layer.parameters()) for layer in model.model.layers)
    assert shape.kinds == ("gated_deltanet", "attention") and shape.windows == () and shape.flop_windows == [0, None]
    assert attention_forward_flops(10, 64, 2, windows=[0, None]) == 2 * 10**2 * 64  # one layer's 2·T²·d_attn
    assert model_flops_per_sequence(config, 1000, 10) == 6 * 1000 * 10 + 3 * 2 * 10**2 * 64
    options = PlanOptions(seq_length=4096, gpus_per_node=1)
    assert flops(shape, options, 0)[0] == 6 * shape.matmul_params * 4096 + 3 * 2 * 4096**2 * 64
    assert plan(shape, options=options).step_seconds > 0
    # the presets with the published shapes: 8 of Qwen3.5-9B's 32 layers attend, 16 of 27B's 64 (26.9B in its text
    # model); 35B-A3B is ~35B total, ~3B active
    nine = load_model_shape("Qwen/Qwen3.5-9B")
    assert nine.kinds.count("attention") == 8 and nine.kinds.count("gated_deltanet") == 24 and nine.heads == 16
    dense = load_model_shape("qwen3.5-27b")
    assert dense.kinds.count("attention") == 16 and dense.kinds.count("gated_deltanet") == 48 and dense.heads == 24
    assert 26.8e9 < dense.total_params < 27e9
    moe = load_model_shape("qwen3.5-35b-a3b")
    assert 34e9 < moe.total_params < 36e9 and 2.5e9 < moe.matmul_params < 3.5e9 and moe.experts == 256


def test_kept_attention_goes_to_layers_that_run_attention():
    """A hybrid's linear-attention layers have no attention kernel to keep: `keep_attention_fraction` is a share
    of the attention layers, in the trainer (recompute.py) and the planner alike. [linear x3, full] at 0.5 keeps
    the full layer only (spreading over all four layers kept layers 1 and 3, the first of them linear); the
    planner then recomputes no attention."""
    import torch
    from helpers import tiny_family_config
    from transformers import AutoModelForCausalLM

    from ulysses_train.model.loading import enable_gradient_checkpointing
    from ulysses_train.model.recompute import apply_checkpoint_levers, kept_attention_layers
    from ulysses_train.planner.estimate import flops

    assert kept_attention_layers(4, 0.5) == [1, 3]  # every layer attends: unchanged
    config = tiny_family_config("qwen3_5_text", head_dim=16, linear_num_key_heads=4, linear_num_value_heads=8,
                                linear_key_head_dim=16, linear_value_head_dim=8, num_hidden_layers=4,
                                layer_types=["linear_attention"] * 3 + ["full_attention"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.train()
    enable_gradient_checkpointing(model)
    apply_checkpoint_levers(model, keep_attention_fraction=0.5)
    assert model.checkpoint_levers_summary.startswith("attention kept in 1 of 4 layers")
    assert [i for i, layer in enumerate(model.model.layers) if "kept" in layer.checkpoint_levers] == [3]
    shape = ModelShape.from_hf_config(config)
    options = PlanOptions(seq_length=4096, gpus_per_node=1, keep_attention_fraction=0.5)
    assert shape.attention_layers == [3] and flops(shape, options, 1)[1] == 2 * 4 * shape.active_params_per_layer * 4096


def test_offset_norms_planned_as_the_kernel_that_runs():
    """Qwen3.5's (1 + w) norms: as Hugging Face's fp32 modules unless Liger's kernel runs them
    (offset_norm_kernel), which saves what the low-memory norm saves: the plan then equals the one of the same
    shape with Llama-style norms. Negative controls: without the kernel the plan differs; a Llama-style model
    ignores the option."""
    from helpers import tiny_family_config

    qwen35 = load_model_shape("qwen3.5-9b")  # real widths: the fp32 chain outweighs the fixed chunk buffers
    assert qwen35.offset_norms and not qwen35.llama_norms
    options = PlanOptions(seq_length=131072, gpus_per_node=1)
    as_llama = plan(dataclasses.replace(qwen35, llama_norms=True), options=options).gpu_allocated
    assert plan(qwen35, options=options.replace(offset_norm_kernel=True)).gpu_allocated == as_llama
    assert plan(qwen35, options=options).gpu_allocated > as_llama
    qwen3 = ModelShape.from_hf_config(tiny_family_config("qwen3"))
    assert not qwen3.offset_norms
    assert (plan(qwen3, options=options.replace(offset_norm_kernel=True)).gpu_allocated
            == plan(qwen3, options=options).gpu_allocated)


def test_longest_length_offloads_by_the_layer_where_host_and_gpu_both_bind():
    """Qwen3.5-9B on 8 x H200 with 560 GiB of host: the longest sequence offloads a share of the layers between
    two quarters (where one more offloaded layer would overfill the host), longer than any quarter reaches, and
    its plan fills both memories. Negative control: the quarters alone stop short of it."""
    from ulysses_train.planner.search import OFFLOAD_SHARES, longest_fitting

    asked = PlanOptions(seq_length=1 << 20, gpus_per_node=8, sp=8, attention_kernel="fa4",
                        mixer_kernels={"gated_deltanet": "flash_qla"},
                        offset_norm_kernel=True, gpu_memory_gib=139.8, host_memory_gib=560)
    best, options = longest_fitting("qwen3.5-9b", asked)
    layers = load_model_shape("qwen3.5-9b").layers
    share = options.activation_offload_fraction
    assert options.offload_activations and share not in OFFLOAD_SHARES and (share * layers).is_integer()
    quarters = max(max_length("qwen3.5-9b", options.replace(activation_offload_fraction=q)) for q in OFFLOAD_SHARES)
    assert best > quarters
    p = plan("qwen3.5-9b", options=options)
    assert p.fits and p.host_per_node > 0.98 * p.host_capacity and p.gpu_total > 0.98 * p.gpu_capacity


def test_latent_attention_flops_count_both_head_widths():
    """Kimi Linear's MLA layers: QK^T over heads of qk_nope + qk_rope (192) and PV over v heads (128), where the
    config's head_dim (64) is only the rotary part. Hand count for one full layer of T tokens: 2 FLOPs per
    multiply-add, T^2/2 pairs: 2 * T^2/2 * 32 * (192 + 128). Negative control: the head_dim width counts 2.5x less."""
    from helpers import tiny_family_config

    from ulysses_train.model.flops import attention_forward_flops, attention_width

    kimi = tiny_family_config("kimi_linear", num_attention_heads=32, head_dim=64, qk_nope_head_dim=128,
                              qk_rope_head_dim=64, v_head_dim=128)
    tokens = 1000
    assert attention_forward_flops(tokens, attention_width(kimi), 1) == 2 * tokens**2 / 2 * 32 * (192 + 128)
    assert attention_forward_flops(tokens, 32 * 64, 1) * 2.5 == attention_forward_flops(tokens, attention_width(kimi), 1)
    qwen3 = tiny_family_config("qwen3", num_attention_heads=4, head_dim=16)
    assert attention_width(qwen3) == 64


def test_a_tied_head_is_held_through_the_backward_only_across_gpus():
    """The tied head's copies in the layers' backward (estimate.tied_head_in_backward): 2 past the reuse distance
    (gradient, embedding gathered again), none on one GPU, none for an untied head or a frozen one (LoRA): the
    controls."""
    def held(shape, sp):
        o = PlanOptions(seq_length=1024, sp=sp, gpus_per_node=sp)
        return {c.name: c.mlp for c in plan(shape, options=o).components}.get("tied head in the layers' backward", 0)

    deeper = dataclasses.replace(TINY, layers=3, total_params=TOTAL_PARAMS + LAYER_PARAMS)
    assert held(deeper, 2) == 2 * 2 * V * H and held(TINY, 2) == 3 * 2 * V * H
    assert held(TINY, 1) == 0 and held(dataclasses.replace(TINY, tied=False), 2) == 0
    o = PlanOptions(seq_length=1024, sp=2, gpus_per_node=2, adapter_params=1000)  # LoRA: the head is frozen
    assert "tied head in the layers' backward" not in [c.name for c in plan(TINY, options=o).components]


def test_an_expert_layer_is_gathered_whole_and_its_fused_gradient_copied_to_fp32_under_sp():
    """A mixture of experts' block is a ZeRO-3 leaf, gathered whole past stage3_max_live_parameters
    (leaf_blocks.mlp_leaf_params), and under sp DeepSpeed casts each fused expert gradient to fp32 before its reduce
    (leaf_blocks.expert_reduce_copy): by hand 4 x 8 experts x 2 x 32 x 64 bytes for the gate/up tensor. Controls: no
    copy at sp=1, under LoRA or with the reduce in bf16; the layer's working set where the block is smaller."""
    block = 8 * 3 * 32 * H + 8 * H  # experts' gate, up and down, and the router
    moe = dataclasses.replace(TINY, experts=8, experts_per_token=2, expert_intermediate=32, mlp_block_params=block)

    def mlp_moment(sp, **fields):
        o = PlanOptions(**{"seq_length": 1024, "sp": sp, "gpus_per_node": 2, "max_live_parameters": 100, **fields})
        return {c.name: c.mlp for c in plan(moe, options=o).components}

    from ulysses_train.planner.leaf_blocks import expert_reduce_copy, leaf_block_backward

    sp2 = mlp_moment(2)
    assert sp2["weights gathered"] == 2 * block  # whole, though max_live_parameters is 100
    # LoRA: the frozen experts have no gradient, so neither their bf16 gradient nor its fp32 copy
    lora = PlanOptions(seq_length=1024, sp=2, gpus_per_node=2, adapter_params=1000)
    assert leaf_block_backward(moe, lora.replace(adapter_params=0))[0] == 2 * block + 4 * 8 * 2 * 32 * H
    assert leaf_block_backward(moe, lora)[0] == 0
    assert expert_reduce_copy(moe, PlanOptions(seq_length=1024, sp=1, gpus_per_node=2)) == 0
    assert expert_reduce_copy(moe, PlanOptions(seq_length=1024, sp=2, gpus_per_node=2)) == 4 * 8 * 2 * 32 * H
    assert expert_reduce_copy(moe, PlanOptions(seq_length=1024, sp=2, gpus_per_node=2, sp_reduce_cast_bytes=0)) == 0
    working = 2 * LAYER_PARAMS  # the layer and a prefetch bucket as large: more than the block here
    assert working > block and mlp_moment(2, max_live_parameters=10 ** 9)["weights gathered"] == 2 * working


def test_a_leaf_blocks_tiles_hold_its_largest_gradient_twice_and_its_gather_holds_it_twice():
    """Measured on DeepSeek-V3 and Kimi K2 expert layers (benchmarks/RESULTS.md), by hand here: from TiledMLP's
    second tile on, the largest gradient (the fused gate/up tensor, 8 x 2 x 32 x 64) is computed afresh beside the
    one kept (leaf_blocks.tile_gradient_accumulation); DeepSpeed's coalesced gather holds the block in a flat buffer
    beside the gathered parameters (gather_buffer). The MLP moment is the larger of the block's backward and its
    gather. Controls: one tile, no TiledMLP, LoRA (no gradients) add no second copy; a block too small to matter
    leaves the backward the larger."""
    from ulysses_train.planner.leaf_blocks import gather_buffer, tile_gradient_accumulation

    big = 10 ** 8  # a block far larger than the tiny shape's activations
    moe = dataclasses.replace(TINY, experts=8, experts_per_token=2, expert_intermediate=32, mlp_block_params=big)
    tiled = PlanOptions(seq_length=4096, sp=2, gpus_per_node=2, tiled_mlp=True)  # 2,048 local tokens: 32 tiles
    assert tile_gradient_accumulation(moe, tiled) == 2 * 8 * 2 * 32 * H
    for control in (tiled.replace(mlp_tiles=1), tiled.replace(tiled_mlp=False), tiled.replace(adapter_params=10)):
        assert tile_gradient_accumulation(moe, control) == 0
    assert gather_buffer(moe, tiled) == 2 * big
    lora = {c.name: c.mlp for c in plan(moe, options=tiled.replace(adapter_params=10)).components}
    assert lora["layer: MLP"] == 2 * big  # frozen experts: the gather is the moment's largest
    small = dataclasses.replace(moe, mlp_block_params=8 * 3 * 32 * H)
    full = {c.name: c.mlp for c in plan(small, options=tiled).components}
    assert full["layer: MLP"] > gather_buffer(small, tiled)


def test_a_norm_left_as_hugging_faces_module_is_planned_at_what_it_saves():
    """architecture.saved_bytes_per_channel runs a norm on the meta device under autograd's saved-tensor hooks: by
    hand Qwen3's RMSNorm saves its fp32 upcast and bf16 normalized rows (6 bytes a channel), Gemma 4's normalizes in
    fp32 before its scale (8: the upcast, saved by two ops, counted once) and its unscaled v norm keeps the upcast
    (4). The planner plans a shape's measured bytes (layer.norms_saved_per_token, attention_saved_per_token): by
    hand 2 norms x 8 + the two outputs the projections save, and 8 x (q + kv) + 4 x kv for the head norms.
    Controls: a module that saves nothing counts 0; Llama's 6 leaves the former rule (2 x (4 + 2b)) unchanged."""
    import torch
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from ulysses_train.model.architecture import saved_bytes_per_channel
    from ulysses_train.planner.layer import attention_saved_per_token, norms_saved_per_token

    measured = [saved_bytes_per_channel(norm.to("meta"), 16) for norm in
                (Qwen3RMSNorm(16), Gemma4RMSNorm(16), Gemma4RMSNorm(16, with_scale=False), torch.nn.Identity())]
    assert measured == [6, 8, 4, 0]
    hf = PlanOptions(seq_length=1024, gpus_per_node=1, low_memory_rmsnorm=False)
    gemma = dataclasses.replace(TINY, norm_saved=(8, 8, 4))
    assert norms_saved_per_token(TINY, hf) == 2 * (4 + 2 * 2) * H
    assert norms_saved_per_token(gemma, hf) == 2 * 8 * H + 2 * 2 * H
    assert attention_saved_per_token(gemma, hf) - attention_saved_per_token(TINY, hf) == (8 - 6) * (Q + KV) + 4 * KV


def test_attention_whose_heads_differ_by_layer_is_planned_at_its_worst_real_layer():
    """Gemma-4-31B's sliding layers have 16 KV heads of 256 and its global ones 4 of 512 (ModelShape
    .attention_layouts, read from the per-layer config); the plan, and the evaluation forward's, is the larger of
    the two layouts' plans. Control: the former single layout, the most KV heads with the widest head (16 of 512:
    no real layer), plans more."""
    m = load_model_shape("gemma-4-31b")
    assert m.attention_layouts == ((4, 512), (16, 256)) and load_model_shape("qwen3-8b").attention_layouts == ()
    o = PlanOptions(seq_length=262_144, sp=8, gpus_per_node=8, tiled_mlp=True, attention_kernel="fa4")
    each = [plan(dataclasses.replace(m, kv_heads=kv, head_dim=d, attention_layouts=()), options=o).gpu_allocated
            for kv, d in m.attention_layouts]
    assert plan(m, options=o).gpu_allocated == max(each)
    from ulysses_train.planner.forward_only import plan_forward

    forward = [plan_forward(dataclasses.replace(m, kv_heads=kv, head_dim=d, attention_layouts=()), options=o)
               for kv, d in m.attention_layouts]
    assert plan_forward(m, options=o).gpu_allocated == max(p.gpu_allocated for p in forward)
    mixed = dataclasses.replace(m, kv_heads=16, head_dim=512, attention_layouts=())
    assert plan(mixed, options=o).gpu_allocated > max(each)


def test_indexed_attention_flops_count_the_chosen_keys_and_the_indexers():
    """A tiny GLM-5 (4 heads of 8 + 8 / v 12, an indexer of 16 heads of 16 keeping 8 keys; layer 0 indexes, layer 1
    reuses its choice) over T tokens, by hand: each layer attends to min(k, position) keys, k^2/2 + (T - k) k pairs,
    2 FLOPs per multiply-add over QK^T and PV (4 x (16 + 12) x 2 per pair), x3 for the backward; the one indexer
    scores every earlier key, T^2/2 pairs of 16 x (16 + 1) multiply-adds, forward only. The planner's model figure
    is the trainer's, and its recompute holds both layers' attention and the indexer once more. Control: the count
    these layers had before (no pairs: window 0, no indexer) fails the hand count."""
    from helpers import tiny_family_config
    from test_indexed_attention import GLM_5

    from ulysses_train.model.flops import attention_width, model_flops, model_flops_per_sequence
    from ulysses_train.planner.estimate import flops
    from ulysses_train.planner.options import PlanOptions
    from ulysses_train.planner.shapes import ModelShape

    glm = tiny_family_config("glm_moe_dsa", **GLM_5)
    T, k = 1024, 8
    pairs = k**2 / 2 + (T - k) * k
    attention = 2 * 3 * (2 * pairs * 4 * (16 + 12))
    indexer = 2 * T**2 / 2 * 16 * 17
    assert model_flops_per_sequence(glm, 0, T) == attention + indexer
    shape = ModelShape.from_hf_config(glm)
    options = PlanOptions(seq_length=T, gpus_per_node=1)
    model, recompute = flops(shape, options, 0)
    assert model - 6 * shape.matmul_params * T == attention + indexer
    assert recompute - 2 * shape.layers * shape.active_params_per_layer * T == attention / 3 + indexer
    assert model_flops(0, T, attention_width(glm), 2, windows=[0, 0]) == 0 != attention + indexer
