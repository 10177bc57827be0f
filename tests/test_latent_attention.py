"""The multi-head latent attention families (MLA: DeepSeek-V3, whose model type Kimi K2 and Moonlight share, and
LongCat-Flash) through
the core exactness test: one step on gloo processes equals the plain single-process Hugging Face model (loss, every
gradient, the parameters after SGD).

A tiny DeepSeek-V3 as published in shape: q through its low-rank projection and norm (q_lora_rank), k and v expanded
from the kv latent (kv_lora_rank) and its norm, q/k heads of qk_nope + qk_rope (8 + 8) and v heads of their own width
(12), RoPE on the rope part (interleaved, as released) with DeepSeek's YaRN and its mscale in the softmax scale, a
dense first layer, then a sigmoid grouped top-k router with its correction bias, routed scaling and a shared expert.
Under sp its attention exchanges q, k and v of their own widths (mixers/attention.py latent_attention); DeepSpeed's
wrapper refuses them. Sequences of 200 and 181 tokens (sp=4: slices of 50 and 46 with padding), packed documents with
1-token documents on slice edges, every lever. Negative controls: the MLA layer attending within each rank's slice,
and each rank's positions starting at 0 (the rope part rotated by the slice's positions): each differs."""
import pytest
from helpers import assert_step_matches, reference_step, save_tiny_model, tiny_family_config, worst_relative_error
from test_mamba2_families import EDGE_DOCUMENTS
from test_model_families import LEVERS, LR, family_step, uneven_samples
from test_packed_step import packed_samples, packed_step, reference_by_document

DEEPSEEK_V3 = dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
                   num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                   moe_intermediate_size=32, first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5,
                   norm_topk_prob=True, rope_interleave=True,
                   rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                                    "mscale_all_dim": 1.0, "original_max_position_embeddings": 1024,
                                    "beta_fast": 32.0, "beta_slow": 1.0})
"""As released: as many KV heads as query heads (the latent expands to every head), YaRN with mscale_all_dim (the
softmax scale grows with the factor); 4 experts in 2 groups, the top group chosen first."""
LONGCAT_FLASH = dict(num_layers=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, head_dim=8,
                     v_head_dim=12, num_key_value_heads=4, ffn_hidden_size=64, expert_ffn_hidden_size=32,
                     n_routed_experts=4, zero_expert_num=2, moe_topk=2, routed_scaling_factor=2.0)
"""A tiny LongCat-Flash: each decoder layer two MLA attentions and two dense MLPs around a shortcut-connected mixture
of experts whose softmax router may pick zero experts (the token passes through); its MLA scales the q and kv latents
(`mla_scale_q_lora`, `mla_scale_kv_lora`)."""
MIMO_V2_FLASH = dict(layer_types=["sliding_attention", "full_attention"], num_key_value_heads=1, head_dim=16,
                     v_head_dim=12, sliding_window=8, n_routed_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=32, mlp_layer_types=["dense", "sparse"])
"""A tiny MiMo-V2-Flash: q/k heads of 16 and v heads of 12, one KV head in the full layer and two (with attention sinks)
in the sliding one, a dense layer then experts; FlashAttention 4's form for the window and the sinks."""
LATENT_FAMILIES = {"deepseek_v3": DEEPSEEK_V3, "longcat_flash": LONGCAT_FLASH, "mimo_v2_flash": MIMO_V2_FLASH}
"""The attention families whose heads DeepSpeed's wrapper cannot take, exchanged by their own all-to-all (Gemma 4's:
tests/test_gemma4.py)."""
FA4 = ("--set", "model.attn_implementation=fa4")


@pytest.fixture(scope="module")
def latent_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("latent")
    return {family: save_tiny_model(str(root / family), config=tiny_family_config(family, **shape))
            for family, shape in LATENT_FAMILIES.items()}


@pytest.mark.parametrize("family,nproc,sp,levers,chunks", [
    ("deepseek_v3", 2, 2, True, 1), ("deepseek_v3", 4, 4, False, 1), ("deepseek_v3", 4, 2, False, 2),
    ("longcat_flash", 4, 4, True, 1), ("longcat_flash", 4, 2, False, 1), ("mimo_v2_flash", 4, 4, True, 1),
    ("mimo_v2_flash", 4, 2, False, 1)],
    ids=["deepseek_v3-sp2-levers", "deepseek_v3-sp4-uneven", "deepseek_v3-sp2xdp2-head-chunks",
         "longcat_flash-sp4-uneven-levers", "longcat_flash-sp2xdp2", "mimo_v2_flash-sp4-uneven-levers",
         "mimo_v2_flash-sp2xdp2"])
def test_latent_attention_step_equals_single_process(tmp_path, latent_models, family, nproc, sp, levers, chunks):
    """DeepSeek-V3 at sp=2 x dp=2 runs in 2 head chunks (model/mixers/head_chunks.py: its 2 KV heads a rank split
    between them, q/k and v of their own widths)."""
    extra = (*(LEVERS if levers else ()), *(FA4 if family == "mimo_v2_flash" else ()),
             "--set", f"model.attention_head_chunks={chunks}")
    samples, result = family_step(tmp_path, latent_models[family], nproc, sp, extra, offload=levers,
                                  samples=uneven_samples(nproc // sp))
    reference_attn = "eager" if family == "mimo_v2_flash" else "sdpa"  # transformers' MiMo-V2-Flash has no SDPA path
    reference = reference_step(latent_models[family], samples, LR, attn=reference_attn)
    loss_error, grad_error = assert_step_matches(result, *reference)
    print(f"{family} sp={sp} x dp={nproc // sp}{' levers' if levers else ''} in {chunks} head chunk(s): loss rel err "
          f"{loss_error:.1e}, worst grad rel err {grad_error:.1e}")


@pytest.mark.parametrize("nproc,sp,levers", [(4, 4, True), (4, 2, False)], ids=["sp4-levers", "sp2xdp2"])
def test_packed_latent_attention_step_equals_each_document_run_alone(tmp_path, latent_models, nproc, sp, levers):
    """Packed documents run FlashAttention 4's form (its reference kernel on CPU), which takes q/k and v heads of
    different widths as the kernel does DeepSeek's 192/128 on Hopper."""
    samples = packed_samples(EDGE_DOCUMENTS, seed=5, labelled=0.7)
    result = packed_step(tmp_path, latent_models["deepseek_v3"], nproc, sp, samples, levers=levers)
    loss_error, grad_error = assert_step_matches(result, *reference_by_document(latent_models["deepseek_v3"], samples))
    print(f"deepseek_v3 packed sp={sp}: loss rel err {loss_error:.1e}, worst grad rel err {grad_error:.1e}")


@pytest.mark.parametrize("control", ["--own-exchange-on-local-slice", "--positions-of-the-slice"])
def test_negative_controls_latent_attention_differs(tmp_path, latent_models, control):
    """The check above catches MLA layers that attend within each rank's slice (sequence parallelism that does not
    exchange their q, k and v) and a rope part rotated by each slice's own positions."""
    model_dir = latent_models["deepseek_v3"]
    samples, result = family_step(tmp_path, model_dir, 2, 2, (control,), samples=uneven_samples(1))
    loss, grads, _, _ = reference_step(model_dir, samples, LR)
    err, name = worst_relative_error(result["grads"], grads)
    print(f"deepseek_v3 {control}: loss {result['loss']:.6f} vs {loss:.6f}, worst grad rel err {err:.2e} ({name})")
    assert err > 1e-3, (control, err, name)


def test_mtp_layers_stored_as_extra_decoder_layers_are_named_not_refused(tmp_path):
    """DeepSeek-V3's and GLM-4.5's releases store their multi-token-prediction layer as `model.layers.L` (L: the
    layer count); transformers ignores only the released index (61, 92), so a pruned or tiny model's was refused as
    "the checkpoint does not match the model". Now a layer the config names (num_nextn_predict_layers) loads at any
    index and is said not trained. Controls: the same tensors without num_nextn_predict_layers, and one past the
    named layers, are refused."""
    import torch
    from test_model_families import add_tensors

    from ulysses_train.config import ConfigError, ModelConfig
    from ulysses_train.model.loading import build_causal_lm, load_model_config

    mtp = {"model.layers.2.eh_proj.weight": torch.ones(2), "model.layers.2.enorm.weight": torch.ones(2)}
    cases = {"named": (1, mtp), "not named": (0, mtp), "past the named": (1, {"model.layers.3.eh_proj.weight":
                                                                               torch.ones(2)})}
    for case, (layers, tensors) in cases.items():
        config = tiny_family_config("deepseek_v3", **DEEPSEEK_V3, num_nextn_predict_layers=layers)
        folder = add_tensors(save_tiny_model(str(tmp_path / case.replace(" ", "_")), config=config), tensors)
        model_cfg = ModelConfig(name_or_path=folder, dtype="float32")
        if case == "named":
            model, _ = build_causal_lm(load_model_config(model_cfg), model_cfg, "sdpa", None)
            assert "2 multi-token-prediction layers 2 (num_nextn_predict_layers=1" in \
                model.checkpoint_tensors_not_trained, model.checkpoint_tensors_not_trained
        else:
            with pytest.raises(ConfigError, match=r"\d of the checkpoint's tensors are not used by the model"):
                build_causal_lm(load_model_config(model_cfg), model_cfg, "sdpa", None)
