"""Model configs with the real shapes, built locally (no hub access), for planning, tests and benchmarks.

`qwen3_config("qwen3-8b")` returns a `transformers.Qwen3Config` with the published shapes of
Qwen/Qwen3-8B (hidden, intermediate, layers, heads, head_dim, vocabulary, tied or not, RoPE theta,
trained length); `save_qwen3_config("qwen3-8b", folder)` writes it as a Hugging Face folder with
`config.json`, so anything that takes `model.name_or_path` can use it with `random_init: true`.

    python -c "from ulysses_train.model.presets import save_qwen3_config as s; s('qwen3-4b', 'outputs/qwen3-4b')"

Beyond Qwen3 (FAMILY_PRESETS): Qwen3-30B-A3B (mixture of experts), GPT-OSS-20B (windowed and full layers,
attention sinks, experts), Gemma 3 12B's text model (five windowed layers to one full) and Qwen3.5-9B /
Qwen3.5-27B / Qwen3.5-35B-A3B's text models (Gated DeltaNet and gated attention), OLMo-hybrid 7B (Gated DeltaNet
and full attention without positions) and Kimi-Linear-48B-A3B (Kimi Delta Attention, MLA and experts), Nemotron-H 8B and Nemotron 3 Nano 30B-A3B (Mamba2,
relu² MLPs or experts, and attention without positions), through
`preset_config` / `save_preset_config`, which take every name here.
"""
from __future__ import annotations

import os
import re

from ulysses_train.config import ConfigError

# name -> (hidden, intermediate, layers, query heads, kv heads, tied embeddings); all have head_dim 128,
# vocabulary 151,936, rope_theta 1e6 and 40,960 trained positions (the shipped config.json values).
QWEN3_SHAPES = {
    "qwen3-0.6b": (1024, 3072, 28, 16, 8, True),
    "qwen3-4b": (2560, 9728, 36, 32, 8, True),
    "qwen3-8b": (4096, 12288, 36, 32, 8, False),
}
HUB_NAMES = {"qwen3-0.6b": "Qwen/Qwen3-0.6B", "qwen3-4b": "Qwen/Qwen3-4B", "qwen3-8b": "Qwen/Qwen3-8B"}
QWEN3_MODEL_TYPE = "qwen3"
"""The model type of QWEN3_SHAPES (the planner reads their fields as this type without importing transformers)."""


_QWEN3_5_ROPE = dict(rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                                       "mrope_section": [11, 11, 10], "mrope_interleaved": True})
_QWEN3_5 = dict(head_dim=256, linear_conv_kernel_dim=4, linear_num_key_heads=16, linear_key_head_dim=128,
                linear_value_head_dim=128, attn_output_gate=True, vocab_size=248320, tie_word_embeddings=False,
                max_position_embeddings=262144, rms_norm_eps=1e-6, eos_token_id=248044, **_QWEN3_5_ROPE)
"""What Qwen3.5's published text configs share (9B, 27B, 35B-A3B)."""


NEMOTRON_H_PATTERN = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
"""Nemotron-H's `hybrid_override_pattern` letters as transformers' `layers_block_type` names (its config reads
`layer_types` as that list): Mamba2, mixture of experts, attention without positions, relu² MLP. The presets write
their layers with it, and the config.json check reads a release's pattern with it (mixers.check_raw_layer_types)."""


def _nemotron_h_layers(pattern: str) -> list:
    """The layer list of a Nemotron-H `hybrid_override_pattern` as released (one letter a layer)."""
    return [NEMOTRON_H_PATTERN[letter] for letter in pattern]


_NEMOTRON_H = dict(mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4, expand=2, use_conv_bias=True,
                   mamba_proj_bias=False, mamba_hidden_act="silu", mlp_hidden_act="relu2", mlp_bias=False,
                   attention_bias=False, head_dim=128, vocab_size=131072, tie_word_embeddings=False,
                   layer_norm_epsilon=1e-5, residual_in_fp32=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
"""What Nemotron-H's published configs share (8B, Nemotron 3 Nano 30B-A3B)."""


def _deepseek_yarn(factor: float, theta: float, beta_fast: float) -> dict:
    """The `rope_scaling` of the DeepSeek-V3 line's config.json files (YaRN from 4,096 positions, mscale 1) in
    transformers' rope_parameters."""
    return dict(rope_parameters={"rope_type": "yarn", "rope_theta": theta, "factor": factor, "beta_fast": beta_fast,
                                 "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                 "original_max_position_embeddings": 4096})


_MLA = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, head_dim=64, v_head_dim=128,
            tie_word_embeddings=False, hidden_act="silu")
"""The MLA widths the DeepSeek-V3 line shares (q/k heads 128 + 64, v heads 128, a kv latent of 512; `head_dim` is
the rope part, as the releases write it)."""
_DEEPSEEK_V3 = dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
                    q_lora_rank=1536, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3,
                    norm_topk_prob=True, rms_norm_eps=1e-6, **_MLA)


def _qwen3_5_layers(blocks: int) -> list:
    """Qwen3.5's layer pattern: `blocks` x (three Gated DeltaNet layers, then one gated full-attention layer)."""
    return (["linear_attention"] * 3 + ["full_attention"]) * blocks


def _granite_4_h_layers(attention_at: tuple, layers: int = 40) -> list:
    """Granite 4.0-H's `layer_types` as transformers writes them (its config.json says "mamba" and "attention", the
    legacy names transformers rewrites): Mamba2 layers with attention at the given indices."""
    return ["full_attention" if i in attention_at else "linear_attention" for i in range(layers)]


_GRANITE_4_H = dict(num_hidden_layers=40, layer_types=_granite_4_h_layers((5, 15, 25, 35)), mamba_d_state=128,
                    mamba_n_groups=1, mamba_d_head=64, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256,
                    mamba_conv_bias=True, mamba_proj_bias=False, position_embedding_type="nope", vocab_size=100352,
                    tie_word_embeddings=True, max_position_embeddings=131072)
"""What Granite 4.0-H's published configs share (Small, Tiny): 40 layers, attention at 6, 16, 26 and 36 counting from
1, every layer with experts and a shared MLP, Mamba2 with one group, no positions (NoPE). The multipliers
(embedding, attention, residual, logits scaling) are transformers' defaults here, not confirmed against the
releases: they set no shape, and a hub checkpoint brings its own."""

FAMILY_PRESETS = {
    "qwen3-30b-a3b": ("qwen3_moe", "Qwen/Qwen3-30B-A3B", dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936, tie_word_embeddings=False,
        max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6, router_aux_loss_coef=0.001,
        bos_token_id=151643, eos_token_id=151645)),
    "gpt-oss-20b": ("gpt_oss", "openai/gpt-oss-20b", dict(
        hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, vocab_size=201088,
        sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 12, attention_bias=True,
        tie_word_embeddings=False, max_position_embeddings=131072, rope_theta=150000.0, rms_norm_eps=1e-5,
        swiglu_limit=7.0, router_aux_loss_coef=0.9, pad_token_id=199999, eos_token_id=200002,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                      "original_max_position_embeddings": 4096, "truncate": False})),
    "gemma-3-12b": ("gemma3_text", "google/gemma-3-12b-pt", dict(
        hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, vocab_size=262208, sliding_window=1024,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 8, query_pre_attn_scalar=256,
        max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=True)),
    "qwen3.5-9b": ("qwen3_5_text", "Qwen/Qwen3.5-9B", dict(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
        num_key_value_heads=4, layer_types=_qwen3_5_layers(8), linear_num_value_heads=32, **_QWEN3_5)),
    "qwen3.5-27b": ("qwen3_5_text", "Qwen/Qwen3.5-27B", dict(
        hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
        num_key_value_heads=4, layer_types=_qwen3_5_layers(16), linear_num_value_heads=48, **_QWEN3_5)),
    "qwen3.5-35b-a3b": ("qwen3_5_moe_text", "Qwen/Qwen3.5-35B-A3B", dict(
        hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
        layer_types=_qwen3_5_layers(10), linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, **_QWEN3_5)),
    "olmo-hybrid-7b": ("olmo_hybrid", "allenai/Olmo-Hybrid-7B", dict(
        hidden_size=3840, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=30,
        num_key_value_heads=30, layer_types=_qwen3_5_layers(8), linear_num_key_heads=30, linear_num_value_heads=30,
        linear_key_head_dim=96, linear_value_head_dim=192, linear_conv_kernel_dim=4, linear_allow_neg_eigval=True,
        vocab_size=100352, tie_word_embeddings=False, max_position_embeddings=65536, rope_parameters=None,
        rope_theta=None, rms_norm_eps=1e-6, pad_token_id=100277, eos_token_id=100257)),
    "kimi-linear-48b-a3b": ("kimi_linear", "moonshotai/Kimi-Linear-48B-A3B-Instruct", dict(
        hidden_size=2304, intermediate_size=9216, moe_intermediate_size=1024, num_hidden_layers=27,
        num_attention_heads=32, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, num_experts=256, num_experts_per_tok=8, num_shared_experts=1, routed_scaling_factor=2.446,
        moe_renormalize=True, num_expert_group=1, topk_group=1, linear_num_heads=32, linear_head_dim=128,
        linear_conv_kernel_dim=4, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6
        + ["linear_attention"] * 2 + ["full_attention"], vocab_size=163840, tie_word_embeddings=False,
        model_max_length=1048576, rms_norm_eps=1e-5, bos_token_id=163584, eos_token_id=163586,
        pad_token_id=163839)),
    "nemotron-3-nano-30b-a3b": ("nemotron_h", "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", dict(
        hidden_size=2688, intermediate_size=1856, num_attention_heads=32, num_key_value_heads=2,
        layer_types=_nemotron_h_layers("MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"), mamba_num_heads=64,
        chunk_size=128, n_routed_experts=128, num_experts_per_tok=6, moe_intermediate_size=1856,
        moe_shared_expert_intermediate_size=3712, n_shared_experts=1, routed_scaling_factor=2.5, n_group=1,
        topk_group=1, norm_topk_prob=True, max_position_embeddings=262144, rope_theta=10000, **_NEMOTRON_H)),
    "nemotron-h-8b": ("nemotron_h", "nvidia/Nemotron-H-8B-Base-8K", dict(
        hidden_size=4096, intermediate_size=21504, num_attention_heads=32, num_key_value_heads=8,
        layer_types=_nemotron_h_layers("M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"), mamba_num_heads=128,
        chunk_size=256, max_position_embeddings=8192, **_NEMOTRON_H)),
    "deepseek-v3": ("deepseek_v3", "deepseek-ai/DeepSeek-V3", dict(
        num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, vocab_size=129280, max_position_embeddings=163840, bos_token_id=0,
        eos_token_id=1, **_DEEPSEEK_V3, **_deepseek_yarn(40.0, 10000.0, 32.0))),
    "kimi-k2": ("deepseek_v3", "moonshotai/Kimi-K2-Instruct-0905", dict(
        num_attention_heads=64, num_key_value_heads=64, n_routed_experts=384, n_group=1, topk_group=1,
        routed_scaling_factor=2.827, vocab_size=163840, max_position_embeddings=262144, bos_token_id=163584,
        eos_token_id=163585, **{**_DEEPSEEK_V3, "first_k_dense_replace": 1}, **_deepseek_yarn(64.0, 50000.0, 1.0))),
    "moonlight-16b-a3b": ("deepseek_v3", "moonshotai/Moonlight-16B-A3B-Instruct", dict(
        hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408, num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, n_routed_experts=64, n_shared_experts=2,
        num_experts_per_tok=6, n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.446,
        norm_topk_prob=True, vocab_size=163840, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0}, **_MLA)),
    "longcat-flash": ("longcat_flash", "meituan-longcat/LongCat-Flash-Chat", dict(
        hidden_size=6144, num_layers=28, num_attention_heads=64, num_key_value_heads=64, ffn_hidden_size=12288,
        expert_ffn_hidden_size=2048, n_routed_experts=512, zero_expert_num=256, moe_topk=12, q_lora_rank=1536,
        routed_scaling_factor=6.0, vocab_size=131072, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0}, **_MLA)),
    "deepseek-v3.2": ("deepseek_v32", "deepseek-ai/DeepSeek-V3.2", dict(
        num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, vocab_size=129280, max_position_embeddings=163840, bos_token_id=0,
        eos_token_id=1, index_n_heads=64, index_head_dim=128, index_topk=2048, **_DEEPSEEK_V3,
        **_deepseek_yarn(40.0, 10000.0, 32.0))),
    "glm-5.2": ("glm_moe_dsa", "zai-org/GLM-5.2", dict(
        hidden_size=6144, intermediate_size=12288, moe_intermediate_size=2048, num_hidden_layers=78,
        num_attention_heads=64, num_key_value_heads=64, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192,
        qk_rope_head_dim=64, v_head_dim=256, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
        n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=3,
        index_n_heads=32, index_head_dim=128, index_topk=2048,
        index_topk_freq=4, index_skip_topk_offset=3,  # the indexer runs in layers 0, 1, 2, 6, 10, ..., 74
        vocab_size=154880, tie_word_embeddings=False, max_position_embeddings=1048576, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 8_000_000.0})),
    "hy4-preview": ("hy_v4", "tencent/Hy4-preview", dict(  # transformers 5.25's HYV4Config defaults, which name it
        hidden_size=2816, intermediate_size=6912, moe_intermediate_size=768, num_hidden_layers=34,
        num_attention_heads=32, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64,
        v_head_dim=256, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, routed_scaling_factor=2.827,
        index_n_heads=16, index_head_dim=128, index_topk=2048, hc_mult=4, hc_magnitude=2.0, vocab_size=120832,
        max_position_embeddings=262144, rms_norm_eps=1e-5, pad_token_id=120002, bos_token_id=120000,
        eos_token_id=120025, mlp_layer_types=None,  # one dense layer, then experts
        indexer_types=None,  # the indexer in layers 0, 1, 5, 9, ...: transformers' default for any depth
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "dots3-note": ("dots3_note_text", "dots-studio/dots3-note-prev", dict(  # transformers 5.25's Dots3NoteTextConfig
        hidden_size=5120, intermediate_size=13824, moe_intermediate_size=1536, num_hidden_layers=46,  # defaults
        num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1024, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, head_dim=256, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, shared_experts_intermediate_size=1536, index_n_heads=64, index_head_dim=128,
        index_topk=2048, sliding_window=512, vocab_size=152064, max_position_embeddings=524288, rms_norm_eps=1e-5,
        pad_token_id=151659, bos_token_id=151643, eos_token_id=151668, tie_word_embeddings=False,
        layer_types=None, mlp_layer_types=None,  # indexed layers 0, 1, 5, 9, ..., sliding between; dense first
        rope_parameters=None)),  # indexed layers 80,000,000, sliding 50,000 (64 heads, q/k 192 + 64, latent 1024)
    "glm-5.3-flash": ("glm5_next_text", "zai-org/GLM-5.3-Flash", dict(  # transformers 5.25's Glm5NextTextConfig
        hidden_size=4096, intermediate_size=12288, moe_intermediate_size=2048, num_hidden_layers=45,  # defaults
        num_attention_heads=64, num_key_value_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=256,
        qk_rope_head_dim=0, v_head_dim=256, head_dim=0, n_routed_experts=288, n_shared_experts=1,
        num_experts_per_tok=8, routed_scaling_factor=2.5, index_n_heads=32, index_head_dim=128, index_topk=2048,
        index_kpool=16, linear_num_heads=64, linear_head_dim=128, linear_conv_kernel_dim=4, hc_mult=4,
        vocab_size=154880, max_position_embeddings=1048576, rms_norm_eps=1e-5, pad_token_id=154820,
        tie_word_embeddings=False, layer_types=None, indexer_types=None, mlp_layer_types=None)),  # KDA but every
    # fourth layer (indexed NoPE MLA), each indexed layer its own indexer, three dense layers first
    "llama-4-scout": ("llama4_text", "meta-llama/Llama-4-Scout-17B-16E", dict(  # transformers 5.25's Llama4TextConfig
        hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384, num_hidden_layers=48,  # defaults
        num_attention_heads=40, num_key_value_heads=8, head_dim=128, num_local_experts=16, num_experts_per_tok=1,
        vocab_size=202048, max_position_embeddings=131072, attention_chunk_size=8192, use_qk_norm=True,
        attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1, rms_norm_eps=1e-5, bos_token_id=1,
        eos_token_id=2, pad_token_id=None, tie_word_embeddings=False, no_rope_layers=None, layer_types=None,
        moe_layers=None)),  # every fourth layer without RoPE (full attention, tuned queries), the rest chunked
    "gemma-4-31b": ("gemma4_text", "google/gemma-4-31B-it", dict(
        hidden_size=5376, intermediate_size=21504, num_hidden_layers=60, num_attention_heads=32,
        num_key_value_heads=16, head_dim=256, global_head_dim=512, num_global_key_value_heads=4,
        attention_k_eq_v=True, sliding_window=1024, final_logit_softcapping=30.0, vocab_size=262144,
        tie_word_embeddings=True, max_position_embeddings=262144, hidden_size_per_layer_input=0,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 10)),
    "gemma-4-26b-a4b": ("gemma4_text", "google/gemma-4-26B-A4B-it", dict(
        hidden_size=2816, intermediate_size=2112, num_hidden_layers=30, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, global_head_dim=512, num_global_key_value_heads=2,
        attention_k_eq_v=True, sliding_window=1024, final_logit_softcapping=30.0, vocab_size=262144,
        tie_word_embeddings=True, max_position_embeddings=262144, hidden_size_per_layer_input=0,
        enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=704,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 5)),
    "gemma-4-e4b": ("gemma4_text", "google/gemma-4-E4B-it", dict(
        hidden_size=2560, intermediate_size=10240, num_hidden_layers=42, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, global_head_dim=512, sliding_window=512, final_logit_softcapping=30.0,
        vocab_size=262144, tie_word_embeddings=True, max_position_embeddings=131072,
        hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144, num_kv_shared_layers=18,
        use_double_wide_mlp=False, layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 7)),
    "granite-4.0-h-small": ("granitemoehybrid", "ibm-granite/granite-4.0-h-small", dict(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=768,
        shared_intermediate_size=1536, num_local_experts=72, num_experts_per_tok=10, mamba_n_heads=128,
        **_GRANITE_4_H)),
    "granite-4.0-h-tiny": ("granitemoehybrid", "ibm-granite/granite-4.0-h-tiny", dict(
        hidden_size=1536, num_attention_heads=12, num_key_value_heads=4, intermediate_size=512,
        shared_intermediate_size=1024, num_local_experts=64, num_experts_per_tok=6, mamba_n_heads=48,
        **_GRANITE_4_H)),
}
"""name -> (transformers model type, hub name, config fields): the shipped config.json values that set shapes
(Gemma 3 12B: the text model of the multimodal release, its RoPE scaling left at the default; Qwen3.5: the text
model of the image-text releases, Gated DeltaNet layers three of every four; OLMo-hybrid 7B: the same layer pattern,
its Gated DeltaNet with separate projections and beta doubled, full attention without RoPE: rope_theta null, NoPE;
Kimi Linear: its `linear_attn_config` in transformers' fields, the MLA layers at 4, 8, ..., 24 and 27 counting
from 1; Nemotron-H: `hybrid_override_pattern` as transformers' layer list, its attention without positions (NoPE: the
Nano release's rope_theta 10000 is read by no layer), `mtp` layers absent from both releases).

Nemotron values and what was not confirmed: Nano's are its config.json as copied into public test fixtures
(transformers 4.55.4 wrote it; `time_step_limit` absent, so transformers' (0, inf) default). Nemotron-H 8B's come from
a public copy of its config.json (TensorRT-LLM's test fixture: chunk_size 256, `attention_head_dim` 128, which
transformers 5.25 reads as its default head_dim 128) and NVIDIA's Megatron-Bridge page (52 layers, 4096 hidden, 21504
FFN, 32 query / 8 key-value heads, 128 Mamba heads of 64); neither was read from the hub itself, and the 8B's
time_step_* and chunk_size could not be checked against the hub file.

The MLA line (model type `deepseek_v3` for DeepSeek-V3, Kimi K2 and Moonlight; `longcat_flash`): DeepSeek-V3's
config.json as published (61 layers, 3 dense, 256 experts in 8 groups, YaRN 40 from 4,096); Kimi K2 is the
Instruct-0905 release (its config.json says model_type `kimi_k2` with remote code mapping to DeepSeek-V3's classes;
64 heads, 384 experts, one dense layer, YaRN 64 from 4,096 = 262,144 positions, rope_theta 50,000), from a public
inspection report of its config.json; Moonlight-16B-A3B's and LongCat-Flash's (the transformers config defaults,
which are the Chat release's) were not read from the hub itself. The multi-token-prediction layers
(`num_nextn_predict_layers`) are not built by transformers and not trained.

The indexed line (DeepSeek Sparse Attention): DeepSeek-V3.2 is DeepSeek-V3's config.json with the indexer's fields
(64 heads of 128, top 2,048), from public copies of its config.json; GLM-5.2 (1,048,576 positions, rope_theta
8,000,000, 78 layers of which the indexer runs in 0, 1, 2 and every fourth from 6 and the others reuse its choice:
`index_topk_freq` 4, `index_skip_topk_offset` 3) from public excerpts of its config.json (inference engines' test
fixtures); neither was read from the hub itself. Their multi-token-prediction layer is not built by transformers and
not trained.

Gemma 4 31B: the text model of the image-text release, from public descriptions of its config (60 layers, five sliding
of 1,024 to one global, sliding heads 256 wide with 16 KV heads, global heads 512 wide with 4 KV heads whose keys are
their values, soft-cap 30, tied embeddings, no per-layer inputs), its RoPE transformers' Gemma 4 default (sliding
theta 10,000; global proportional, a quarter rotated, theta 1,000,000); not read from the hub itself. Gemma 4 26B-A4B
and E4B: the values of Google's MaxText model configs (gemma4-26b.yml, gemma4-e4b.yml), in transformers' names:
26B-A4B has 30 layers of 2,816, a dense MLP of 2,112 beside 128 experts of 704 (top 8), global layers of 2 KV heads
whose keys are their values; E4B has 42 layers of 2,560, per-layer inputs of 256, the last 18 layers reading
earlier layers' keys and values, windows of 512 and 128K positions. Their layer patterns are transformers' default
five sliding to one global (the 26B's 25 + 5 as published; E4B's not confirmed)."""


PRESETS = (*QWEN3_SHAPES, *FAMILY_PRESETS)
PRESET_FAMILIES = tuple(sorted({re.split(r"-\d", key)[0] for key in PRESETS}))
"""What our preset names start with before their size ("qwen3", "qwen3.5", "gpt-oss", "gemma")."""


def looks_like_a_preset(name: str) -> bool:
    """Whether `name` reads as a preset we do not have ("qwen3.5-99b", "gpt-oss-120b"): a bare name (no `org/`)
    starting with a preset family. The hub names these families' releases `org/name`, so such a name is a
    mistyped or unknown preset, and asking the hub for it only ends in a connection or not-found error."""
    return "/" not in name and not known_name(name) and name.strip().lower().startswith(PRESET_FAMILIES)


def known_name(name: str) -> str | None:
    """The local key for `name` ("qwen3-8b", "Qwen3-8B" or "Qwen/Qwen3-8B", "gpt-oss-20b", a FAMILY_PRESETS hub name
    such as "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"), or None if it is not one of ours."""
    by_hub = {hub.lower(): key for key, (_, hub, _) in FAMILY_PRESETS.items()}  # hub names unlike their key
    if name.strip().lower() in by_hub:
        return by_hub[name.strip().lower()]
    key = name.strip().lower().split("/")[-1]
    key = key.removesuffix("-pt")
    return key if key in QWEN3_SHAPES or key in FAMILY_PRESETS else None


def preset_config(name: str, **overrides):
    """The transformers config of any preset (QWEN3_SHAPES or FAMILY_PRESETS); `overrides` set on top."""
    key = known_name(name)
    if key in QWEN3_SHAPES:
        return qwen3_config(key, **overrides)
    if key is None:
        raise ValueError(f"unknown model {name!r}; local shapes exist for {', '.join(PRESETS)}.")
    from transformers import AutoConfig, __version__
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type, hub, fields = FAMILY_PRESETS[key]
    if model_type not in CONFIG_MAPPING:
        raise ConfigError(f"preset {key!r} ({hub}) is a {model_type!r} model, which transformers {__version__} does "
                          f"not know. Fix: pip install -U transformers (5.24 builds it).")
    fields = {**fields, **overrides}
    if "num_hidden_layers" in overrides and fields.get("layer_types") and "layer_types" not in overrides:
        fields["layer_types"] = fields["layer_types"][:overrides["num_hidden_layers"]]  # the first layers' pattern
    config = AutoConfig.for_model(model_type, **fields)
    config.name_or_path = hub
    return config


def save_preset_config(name: str, folder: str, **overrides) -> str:
    """Write `preset_config(name, **overrides)` to `folder/config.json`; returns the folder."""
    os.makedirs(folder, exist_ok=True)
    preset_config(name, **overrides).save_pretrained(folder)
    return folder


def qwen3_config_kwargs(name: str) -> dict:
    """The `Qwen3Config` keyword arguments of `name` (plain data: the planner reads them without transformers)."""
    key = known_name(name)
    if key not in QWEN3_SHAPES:
        raise ValueError(f"unknown model {name!r}; local shapes exist for {', '.join(QWEN3_SHAPES)}.")
    hidden, intermediate, layers, heads, kv_heads, tied = QWEN3_SHAPES[key]
    return dict(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=128, vocab_size=151936,
        tie_word_embeddings=tied, max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        max_window_layers=layers, attention_bias=False, hidden_act="silu",
        bos_token_id=151643, eos_token_id=151645,
    )


def qwen3_config(name: str, **overrides):
    """A `Qwen3Config` with the real shapes of `name` (see QWEN3_SHAPES); `overrides` are set on top."""
    from transformers import Qwen3Config

    config = Qwen3Config(**{**qwen3_config_kwargs(name), **overrides})
    config.name_or_path = HUB_NAMES[known_name(name)]
    return config


def save_qwen3_config(name: str, folder: str, **overrides) -> str:
    """Write `qwen3_config(name, **overrides)` to `folder/config.json`; returns the folder."""
    return save_preset_config(name, folder, **overrides)
