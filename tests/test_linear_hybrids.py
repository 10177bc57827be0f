"""The linear-attention hybrids through the core exactness test: one step on gloo processes (sp, sp x dp) equals
the plain single-process Hugging Face model (loss, every gradient, parameters after SGD). Qwen3.5, Qwen3.5-MoE and
Qwen3-Next: a Gated DeltaNet layer (model/mixers/gated_deltanet.py: the whole sequence of each rank's heads after an
all-to-all) and a gated attention layer; the MoE ones with their router loss; a hub-layout (image-text) Qwen3.5
checkpoint. OLMo-hybrid: the same mixer with separate projections, beta doubled (`allow_neg_eigval`) and
full-attention layers without positions (NoPE), its preset and its released checkpoint layout (split q/k/v convs).
Kimi Linear: a Kimi Delta Attention layer (model/mixers/kimi_delta.py), an MLA layer (q/k and v heads of different
widths, exchanged by the same module) and experts without a router loss. Negative controls: the Gated DeltaNet or
Kimi Delta Attention layer run on each rank's slice, its conv restarting at every slice, or OLMo-hybrid's beta not
doubled, differs. (test_model_families.py: the dense, windowed and MoE families, and the shared step.)"""
import pytest
import torch
from helpers import (GATED_DELTANET, HYBRID_MOE, KIMI_LINEAR, LINEAR_HYBRIDS, OLMO_HYBRID, TINY_SHAPE,
                     assert_step_matches, make_samples, reference_step, save_tiny_model, tiny_family_config,
                     worst_relative_error)
from test_model_families import LEVERS, LR, family_step, uneven_samples

@pytest.fixture(scope="module")
def linear_hybrid_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("linear_hybrids")
    return {family: save_tiny_model(str(root / family), config=tiny_family_config(family, **shape))
            for family, shape in LINEAR_HYBRIDS.items()}


@pytest.mark.parametrize("family,nproc,sp,levers", [
    ("qwen3_5_text", 2, 2, True), ("qwen3_5_text", 4, 4, False), ("qwen3_5_text", 4, 2, False),
    ("olmo_hybrid", 4, 4, False), ("olmo_hybrid", 4, 2, False),  # its sp2 with levers: packed (test_packed_step)
], ids=["sp2-levers", "sp4", "sp2xdp2", "olmo_hybrid-sp4", "olmo_hybrid-sp2xdp2"])
def test_gated_deltanet_step_equals_single_process(tmp_path, linear_hybrid_models, family, nproc, sp, levers):
    """Qwen3.5 (Gated DeltaNet + gated attention) and OLMo-hybrid (Gated DeltaNet + NoPE attention): 100-token
    sequences (two chunks of the delta rule's scan; sp=4 slices of 25 tokens, so the conv's 3-token history and the
    recurrence cross every slice boundary)."""
    extra = LEVERS if levers else ()
    samples = make_samples(nproc // sp, 100, vocab=256, masked_prefix=12)
    model_dir = linear_hybrid_models[family]
    samples, result = family_step(tmp_path, model_dir, nproc, sp, extra, offload=levers, samples=samples)
    loss_error, grad_error = assert_step_matches(result, *reference_step(model_dir, samples, LR))
    print(f"{family} sp={sp} x dp={nproc // sp}{' levers' if levers else ''}: loss rel err {loss_error:.1e}, "
          f"worst grad rel err {grad_error:.1e}")


@pytest.mark.parametrize("family,control", [
    ("qwen3_5_text", ("--linear-on-local-slice",)), ("qwen3_5_text", ("--conv-within-slices",)),
    ("olmo_hybrid", ("--set", "model.config_overrides.linear_allow_neg_eigval=false")),
    ("kimi_linear", ("--linear-on-local-slice",)),
], ids=["--linear-on-local-slice", "--conv-within-slices", "olmo_hybrid-beta-not-doubled",
        "kimi_linear--linear-on-local-slice"])
def test_negative_controls_gated_deltanet_on_slices_differs(tmp_path, linear_hybrid_models, hybrid_moe_models,
                                                            family, control):
    """The check above catches a linear-attention layer (Gated DeltaNet; Kimi Delta Attention) run on each rank's
    slice only (what sequence parallelism that does not know the layer silently computes), a conv that does not
    see the previous rank's last tokens (its history restarts at every slice), and OLMo-hybrid's layer computed as
    Qwen3.5's (beta in [0, 1], not doubled: the trained model's `linear_allow_neg_eigval` off, the reference's on)."""
    model_dir = hybrid_moe_models[family] if family == "kimi_linear" else linear_hybrid_models[family]
    samples, result = family_step(tmp_path, model_dir, 2, 2, control,
                                  samples=make_samples(1, 100, vocab=256, masked_prefix=12))
    loss, grads, _, _ = reference_step(model_dir, samples, LR)
    err, name = worst_relative_error(result["grads"], grads)
    print(f"{family} {control}: loss {result['loss']:.6f} vs {loss:.6f}, worst grad rel err {err:.2e} ({name})")
    assert err > 1e-3, (control, err, name)


def test_gated_deltanet_refusals_heads_sp_does_not_divide_no_fla_at_length_other_linear_layers():
    from ulysses_train.config import ConfigError
    from ulysses_train.model.loading import check_supported_architecture
    from ulysses_train.parallel.layout import auto_sequence_parallel_size, validate_parallel_layout

    config = tiny_family_config("qwen3_5_text", **{**GATED_DELTANET, "num_attention_heads": 8,
                                                   "num_key_value_heads": 8, "linear_num_key_heads": 2})
    check_supported_architecture(config)
    validate_parallel_layout(config, 2, "sdpa")
    with pytest.raises(ConfigError, match=r"2 key heads and 8 value heads.*sequence_parallel_size=4.*sp in \[1, 2\]"):
        validate_parallel_layout(config, 4, "sdpa")
    assert auto_sequence_parallel_size(8, config) == 2
    from ulysses_train.model.mixers import gated_deltanet as linear_attention
    from ulysses_train.model.mixers import recurrent

    linear_attention.check_linear_attention_kernels(config, 1 << 20, cuda=False)  # CPU: the torch reference
    if not recurrent.fla_available():
        with pytest.raises(ConfigError, match="seq_length=1,048,576.*pip install flash-linear-attention"):
            linear_attention.check_linear_attention_kernels(config, 1 << 20, cuda=True)
    linear_attention.check_linear_attention_kernels(config, 4096, cuda=True)
    other = tiny_family_config("qwen3_5_text", **GATED_DELTANET)
    other.model_type = "another_hybrid"  # another model's linear attention: not built
    with pytest.raises(ConfigError, match="linear_attention"):
        check_supported_architecture(other)


def test_olmo_hybrid_release_plans_keeps_no_positions_and_its_checkpoint_layout_loads(tmp_path, monkeypatch):
    """The OLMo-hybrid 7B preset: the planner's shape (its Gated DeltaNet heads; the parameter count of the released
    checkpoint, 7,430,870,688) and the sp values both mixers allow (30 heads). No RoPE (rope_theta null): nothing for
    YaRN to scale, so it is left alone within 65,536 tokens, past them only with rope_scaling 'none' (the refusal
    said "rope_theta=None; YaRN needs the base"; control: the same config with a RoPE gets YaRN). The released
    checkpoint layout (separate q/k/v conv filters, OLMo-core's norm names) loads through the weight check into the
    one conv the layer runs. A transformers without the preset's model type (the GPU image's older one may lack
    olmo_hybrid) is named in one line, not AutoConfig's traceback."""
    import warnings

    from safetensors.torch import load_file, save_file

    from ulysses_train.config import ConfigError, ModelConfig
    from ulysses_train.model.loading import build_causal_lm, load_model_config
    from ulysses_train.model.mixers import valid_sp_values
    from ulysses_train.model.presets import FAMILY_PRESETS, preset_config
    from ulysses_train.model.rope import RopeConfigError, RopeLengthWarning, apply_rope_scaling
    from ulysses_train.planner.linear_layer import delta_rule_heads
    from ulysses_train.planner.shapes import load_model_shape

    shape = load_model_shape("allenai/Olmo-Hybrid-7B")
    assert delta_rule_heads(shape) == (30, 30, 96, 192) and shape.total_params == 7_430_870_688
    assert valid_sp_values(shape) == [1, 2, 3, 5, 6, 10, 15, 30]
    assert apply_rope_scaling(preset_config("olmo-hybrid-7b"), 65_536).applied == "none"
    for mode in ("auto", "yarn"):
        with pytest.raises(RopeConfigError, match="no rotary position embeddings.*rope_scaling 'none'"):
            apply_rope_scaling(preset_config("olmo-hybrid-7b"), 131_072, mode)
    with pytest.warns(RopeLengthWarning, match="NoPE"):
        assert apply_rope_scaling(preset_config("olmo-hybrid-7b"), 131_072, "none").max_position_embeddings == 65_536
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # within its positions: nothing to warn of
        apply_rope_scaling(preset_config("olmo-hybrid-7b"), 65_536, "none")
    assert apply_rope_scaling(preset_config("olmo-hybrid-7b", rope_theta=10_000.0), 131_072).applied == "yarn"
    monkeypatch.setitem(FAMILY_PRESETS, "olmo-hybrid-7b", ("olmo_hybrid_next", *FAMILY_PRESETS["olmo-hybrid-7b"][1:]))
    with pytest.raises(ConfigError, match=r"'olmo_hybrid_next' model, which transformers 5\.\d+.* does not know"):
        preset_config("olmo-hybrid-7b")
    monkeypatch.undo()

    # transformers 5.24 saves the conv as three equal thirds under the released names (43, 43, 42 channels here);
    # the release splits it at q | k | v (32, 32, 64)
    folder = save_tiny_model(str(tmp_path / "released"), config=tiny_family_config("olmo_hybrid", **OLMO_HYBRID))
    weights = load_file(f"{folder}/model.safetensors")
    conv = torch.cat([weights.pop(f"model.layers.0.linear_attn.{x}_conv1d.weight") for x in "qkv"])
    key_width = OLMO_HYBRID["linear_num_key_heads"] * OLMO_HYBRID["linear_key_head_dim"]
    parts = conv.split([key_width, key_width, conv.shape[0] - 2 * key_width])
    weights.update({f"model.layers.0.linear_attn.{x}_conv1d.weight": part for x, part in zip("qkv", parts)})
    save_file(weights, f"{folder}/model.safetensors", metadata={"format": "pt"})
    model_cfg = ModelConfig(name_or_path=folder, dtype="float32")
    model = build_causal_lm(load_model_config(model_cfg), model_cfg, "sdpa", None)[0]
    layer = model.model.layers[0]
    assert torch.equal(layer.linear_attn.conv1d.weight, conv)
    assert torch.equal(layer.input_layernorm.weight, weights["model.layers.0.attention_layer_norm.weight"])


HYBRID_MOE_FAMILIES = {"qwen3_5_moe_text": HYBRID_MOE, "qwen3_next": HYBRID_MOE, "kimi_linear": KIMI_LINEAR}
"""Kimi Linear (helpers.KIMI_LINEAR): Kimi Delta Attention (model/mixers/kimi_delta.py), MLA with q/k and v heads of
different widths, experts; its router has no auxiliary loss."""


@pytest.fixture(scope="module")
def hybrid_moe_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_moe")
    return {name: save_tiny_model(str(root / name), config=tiny_family_config(name, **shape))
            for name, shape in HYBRID_MOE_FAMILIES.items()}


@pytest.mark.parametrize("family,nproc,sp,levers", [("qwen3_5_moe_text", 2, 2, True), ("qwen3_next", 4, 4, False),
                                                    ("qwen3_next", 4, 2, False), ("kimi_linear", 2, 2, True),
                                                    ("kimi_linear", 4, 4, False), ("kimi_linear", 4, 2, False)],
                         ids=["qwen3_5_moe-sp2-levers", "qwen3_next-sp4", "qwen3_next-sp2xdp2", "kimi_linear-sp2-levers",
                              "kimi_linear-sp4", "kimi_linear-sp2xdp2"])
def test_hybrid_mixture_of_experts_step_equals_single_process(tmp_path, hybrid_moe_models, family, nproc, sp,
                                                             levers):
    """A linear-attention layer (Gated DeltaNet; Kimi Delta Attention) + an attention layer (gated; MLA) + experts
    (tiled with the levers) + the router loss over the whole sequence where the family has one, against the plain
    model's own loss (+ coef x aux_loss); sequences of 200 and 181 tokens (sp=4: slices of 50, so the conv's
    history and the recurrence cross every slice boundary)."""
    samples, result = family_step(tmp_path, hybrid_moe_models[family], nproc, sp, LEVERS if levers else (),
                                  offload=levers, samples=uneven_samples(nproc // sp))
    reference = reference_step(hybrid_moe_models[family], samples, LR, router_loss=family != "kimi_linear")
    loss_error, grad_error = assert_step_matches(result, *reference)
    print(f"{family} sp={sp} x dp={nproc // sp}{' levers' if levers else ''}: loss rel err {loss_error:.1e}, "
          f"worst grad rel err {grad_error:.1e}")


def test_qwen3_5_image_text_checkpoint_trains_its_language_model(tmp_path):
    """A hub-layout Qwen3.5 checkpoint (`Qwen3_5ForConditionalGeneration`: vision tower, language model under
    `model.language_model.`): AutoModelForCausalLM builds the text model `Qwen3_5ForCausalLM` from it (transformers
    maps the weights, the vision tower stays out), so training and the export are the text model; sp=2 equals
    transformers' own AutoModelForCausalLM of that folder, and no vision weight is trained."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = {**TINY_SHAPE, **GATED_DELTANET}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2)
    model_dir = save_tiny_model(str(tmp_path / "image_text"), config=Qwen3_5Config(text_config=text,
                                                                                 vision_config=vision),
                                model_class=Qwen3_5ForConditionalGeneration)
    samples, result = family_step(tmp_path, model_dir, 2, 2, samples=make_samples(1, 100, vocab=256))
    assert not any("visual" in name for name in result["grads"])
    loss_error, grad_error = assert_step_matches(result, *reference_step(model_dir, samples, LR))
    print(f"qwen3_5 image-text checkpoint sp=2: loss rel err {loss_error:.1e}, worst grad rel err {grad_error:.1e}")


@pytest.mark.parametrize("capability,triton,tilelang,refused", [
    ((9, 0), "3.6.0", False, True),        # the H200 image: fla's backward raises mid-step
    ((9, 0), "3.4.0+git1234", False, True),
    ((9, 0), "3.7.1", False, False),       # fixed Triton
    ((9, 0), "3.6.0", True, False),        # fla takes its tilelang backward
    ((8, 0), "3.6.0", False, False),       # not Hopper
    ((9, 0), "3.3.1", False, False),       # before the miscompilation
])
def test_a_triton_that_fla_refuses_on_hopper_is_named_before_the_model(capability, triton, tilelang, refused):
    from ulysses_train.model.mixers.recurrent import fla_backward_problem

    problem = fla_backward_problem(capability, triton, tilelang)
    assert (problem is not None) == refused
    if refused:
        assert f"Triton {triton}" in problem and "pip install tilelang" in problem and "triton>=3.7.1" in problem
