"""Every preset (model/presets.py) through `build_engine` in one process (ZeRO-3, CPU, random init), each from its
published config fields only: the config class and fields transformers builds from the release's config.json, made
smaller by overriding only fields the release sets (no field added that the release does not have, as a helper
that gives every family an `intermediate_size` would). Prints one `built <name> <layer params>` line per preset.
Launched by tests/test_model_families.py (WORLD_SIZE=1, gloo)."""
import sys

from ulysses_train.model.presets import FAMILY_PRESETS, QWEN3_SHAPES, known_name, preset_config, qwen3_config_kwargs

SMALLER = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=32,
               num_experts=4, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
               num_attention_heads=4, num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=16, linear_value_head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
               mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=2, n_routed_experts=4,
               moe_shared_expert_intermediate_size=32, shared_intermediate_size=32, mamba_n_heads=8, mamba_d_head=16,
               mamba_d_state=16, mamba_chunk_size=16, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
               qk_rope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1, num_layers=2, ffn_hidden_size=128,
               expert_ffn_hidden_size=32, zero_expert_num=2, moe_topk=2, global_head_dim=32,
               num_global_key_value_heads=1, hidden_size_per_layer_input=8, vocab_size_per_layer_input=1024)
"""Test sizes, applied to the fields a preset's release sets (and only those). MLA's widths shrink together (its
`head_dim` is the rope part); LongCat-Flash counts its layers in `num_layers`."""


def published_fields(name: str) -> dict:
    key = known_name(name)
    return qwen3_config_kwargs(key) if key in QWEN3_SHAPES else FAMILY_PRESETS[key][2]


def reduced_fields(name: str) -> dict:
    """The overrides that make a preset test-sized: the fields it publishes, smaller, and as many layers as one
    period of its layer pattern (Qwen3.5: 3 linear + 1 full; Gemma 3: 5 windowed + 1 full; else 2); with layers that
    read earlier layers' keys and values (Gemma 4 E4B), two periods, the second one reading the first's."""
    fields = published_fields(name)
    pattern = fields.get("layer_types") or []
    period = next((i + 1 for i, kind in enumerate(pattern) if kind == "full_attention"), 2)
    smaller = {key: value for key, value in SMALLER.items() if fields.get(key, 0) != 0}  # 0 stays (a NoPE MLA)
    if "kv_lora_rank" in fields:  # MLA expands its latent to every head: as many KV heads as query heads
        smaller["num_key_value_heads"] = smaller["num_attention_heads"]
    if fields.get("num_kv_shared_layers"):
        return dict(num_hidden_layers=2 * period, **smaller, num_kv_shared_layers=period)
    return dict(num_hidden_layers=max(period, 2), **smaller)


def reduced_preset(name: str, **overrides):
    """The preset's config at test size (reduced_fields), `overrides` on top."""
    return preset_config(name, **{**reduced_fields(name), **overrides})


def main(names):
    import torch

    from ulysses_train.config import load_config
    from ulysses_train.model.architecture import decoder_of
    from ulysses_train.model.mixers import has_sliding_windows
    from ulysses_train.training.step import build_engine, resolve_run

    for name in names:
        config = reduced_preset(name)
        attn = "fa4" if has_sliding_windows(config) else "sdpa"  # windows need a kernel that takes them
        cfg = load_config(None, ["model.name_or_path=unused", "model.random_init=true", "model.dtype=float32",
                                 f"model.attn_implementation={attn}", "data.seq_length=64"])
        engine = build_engine(resolve_run(cfg, config), optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1))
        layers = decoder_of(engine.deepspeed.module.causal_lm).layers
        print(f"built {name} {max(sum(p.ds_numel for p in layer.parameters()) for layer in layers)}", flush=True)
        del engine


if __name__ == "__main__":
    main(sys.argv[1:])
