"""What the planner reads off a model's config and off the model built on the meta device: parameter counts,
head widths, what its norms save, its experts (planner/shapes.py assembles them into a ModelShape)."""
from __future__ import annotations

from ulysses_train.model.architecture import attention_heads_of, decoder_of, layer_configs
from ulysses_train.families import llama_layout


def attention_head_dims(text_config) -> tuple[int, int]:
    """(q/k head width, value head width where it differs, else 0). Multi-head latent attention (Kimi Linear) has
    q/k heads of qk_nope + qk_rope and v heads of v_head_dim (its `head_dim` is only the rotary part). Where the
    width differs by layer (Gemma 4's global layers) the widest layer's; the planner then plans each layer's own
    layout (ModelShape.attention_layouts)."""
    c = text_config
    if getattr(c, "qk_nope_head_dim", None) and getattr(c, "v_head_dim", None):
        return c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
    return max(attention_heads_of(layer)[2] for layer in layer_configs(c)), 0


def count_parameters(text_config) -> tuple[int, int]:
    """(parameters of one decoder layer (the largest, where layers differ), all parameters).

    The families whose records give a `llama_layout` (Llama, Mistral, Qwen2, Qwen3) by formula, which is instant;
    anything else by building the model on the meta device (exact for any architecture, no memory, a few seconds)."""
    c = text_config
    layout = llama_layout(c.model_type)
    if layout is None:  # e.g. Qwen3.5-MoE has no intermediate_size: its model counts
        counted = counts_on_meta(c)
        return counted["layer_params"], counted["total_params"]
    h, i, v = c.hidden_size, c.intermediate_size, c.vocab_size
    d = getattr(c, "head_dim", None) or h // c.num_attention_heads
    q, kv = c.num_attention_heads * d, (getattr(c, "num_key_value_heads", None) or c.num_attention_heads) * d
    attn = h * q + 2 * h * kv + q * h
    if layout.qkv_bias:
        attn += q + 2 * kv  # q/k/v biases, no o_proj bias
    elif getattr(c, "attention_bias", False):
        attn += q + 2 * kv + h
    mlp = 3 * h * i + ((2 * i + h) if getattr(c, "mlp_bias", False) else 0)
    norms = 2 * h + (2 * d if layout.head_norms else 0)  # two Llama-style RMSNorms, and any on q and k heads
    layer = attn + mlp + norms
    tied = bool(getattr(c, "tie_word_embeddings", False))
    return layer, c.num_hidden_layers * layer + v * h * (1 if tied else 2) + h


def counts_on_meta(text_config) -> dict:
    """ModelShape's counted fields from the model built on the meta device: parameters (layer_params the largest
    layer); for a mixture of experts its experts, active parameters per layer on average (an `experts` bank
    counts k/E) and the largest MLP block; the norms over the hidden state in a layer and whether they are all
    Llama-style (per-head q/k norms not counted there: `head_norms` says whether the layer has them)."""
    from ulysses_train.model.architecture import (LLAMA_STYLE_RMSNORMS, OFFSET_RMSNORMS, causal_lm_on_meta,
                                                  experts_per_token, feed_forward_blocks)

    model = causal_lm_on_meta(text_config)
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    layers = decoder_of(model).layers
    norms = [m for m in layers[0].modules() if "Norm" in type(m).__name__
             and getattr(getattr(m, "weight", None), "numel", lambda: 0)() == text_config.hidden_size]
    counted = dict(layer_params=max(count(layer) for layer in layers), total_params=count(model),
                   norm_saved=norms_saved_bytes(layers, norms),
                   norms_per_layer=len(norms), llama_norms=all(type(m).__name__ in LLAMA_STYLE_RMSNORMS for m in norms),
                   offset_norms=bool(norms) and all(type(m).__name__ in OFFSET_RMSNORMS for m in norms),
                   head_norms=any(name.endswith(("q_norm", "k_norm")) for layer in layers
                                  for name, _ in layer.named_modules()),
                   output_gate=any(name.endswith("self_attn.q_proj") and module.out_features == 2 * text_config
                                   .num_attention_heads * attention_head_dims(text_config)[0] for layer in layers
                                   for name, module in layer.named_modules()))
    counted.update(hc_saved=hyper_connection_saved(layers, text_config))
    blocks = [feed_forward_blocks(layer) for layer in layers]  # [] in Nemotron-H's Mamba2 / attention layers
    counted.update(gated_mlp=not any(ungated(module) for layer_blocks in blocks for block in layer_blocks
                                     for module in block.modules()),
                   mlp_block_params=max(sum(count(block) for block in layer_blocks) for layer_blocks in blocks))
    experts, top_k = experts_per_token(text_config)
    if experts:
        banks = [sum(count(block.experts) for block in layer_blocks if hasattr(block, "experts"))
                 for layer_blocks in blocks]
        active = sum(count(layer) - bank * (experts - top_k) // experts for layer, bank in zip(layers, banks))
        counted.update(experts=experts, experts_per_token=top_k, active_layer_params=active // len(layers),
                       expert_intermediate=getattr(text_config, "moe_intermediate_size", None)
                       or text_config.intermediate_size,
                       shared_expert_intermediate=shared_expert_width(text_config))
    return counted


def hyper_connection_saved(layers, text_config) -> float:
    """ModelShape.hc_saved: bytes per token one hyper-connection module saves for backward beyond its bf16 input
    streams (architecture.saved_bytes_per_row on the first module named ...HyperConnection: HY-V4's fp32 copy of
    the streams, GLM-5.3-Flash's two and its Sinkhorn iterations); 0 without hyper-connected streams."""
    from ulysses_train.model.architecture import saved_bytes_per_row

    found = next((module for layer in layers for module in layer.modules()
                  if type(module).__name__.endswith("HyperConnection")), None)
    if found is None:
        return 0
    streams, hidden = text_config.hc_mult, text_config.hidden_size
    return saved_bytes_per_row(found, (streams, hidden)) - 2 * streams * hidden


def norms_saved_bytes(layers, hidden_norms) -> tuple:
    """ModelShape.norm_saved of a model built on the meta device: the first hidden-state norm's, q (or k) head
    norm's and v head norm's saved bytes per channel (architecture.saved_bytes_per_channel; Llama's 6 where there
    is no such norm, 0 for an absent v norm)."""
    from ulysses_train.model.architecture import saved_bytes_per_channel

    def first(suffixes, default):
        found = next((module for layer in layers for name, module in layer.named_modules()
                      if name.endswith(suffixes)), None)
        if found is None:
            return default
        weight = getattr(found, "weight", None)  # an unscaled norm (no weight) takes any width
        return saved_bytes_per_channel(found, weight.shape[-1] if weight is not None else 64)

    hidden = saved_bytes_per_channel(hidden_norms[0], hidden_norms[0].weight.shape[-1]) if hidden_norms else 6
    return hidden, first(("q_norm", "k_norm"), 6), first(("v_norm",), 0)


def ungated(module) -> bool:
    """An MLP or experts bank computing down(act(up(x))) without a gate (Nemotron-H's relu² MLPs and experts)."""
    return hasattr(module, "up_proj") and not hasattr(module, "gate_proj") and not hasattr(module, "gate_up_proj")


def shared_expert_width(text_config) -> int:
    """The intermediate width of the shared expert(s) every token runs beside its routed ones: Qwen3.5-MoE's and
    Qwen3-Next's `shared_expert_intermediate_size`, Kimi Linear's `num_shared_experts` experts of
    moe_intermediate_size (one MLP that wide), Nemotron-H's `moe_shared_expert_intermediate_size` (transformers
    builds one MLP that wide whatever `n_shared_experts` says), GraniteMoeShared's and Granite 4.0-H's
    `shared_intermediate_size` (their `shared_mlp`); 0 without."""
    c = text_config
    for key in ("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size", "shared_intermediate_size"):
        if getattr(c, key, None):
            return getattr(c, key)
    return (getattr(c, "num_shared_experts", None) or 0) * (getattr(c, "moe_intermediate_size", None) or 0)
