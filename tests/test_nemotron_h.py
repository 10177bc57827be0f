"""Nemotron-H (transformers' `nemotron_h`) family plumbing: presets, TiledMLP on its relu² MLPs and experts, the
planner's counts, strict weight loading (hub layout, mtp tensors), NoPE, and its router without a loss. Each against
transformers' own modules; the Mamba2 mixer under Ulysses is tested with the mixers."""
import copy
import os

import pytest
import torch

NEMOTRON_H = dict(layers_block_type=["linear_attention", "moe", "full_attention", "mlp"], hidden_size=32,
                  intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8, mamba_num_heads=4,
                  mamba_head_dim=8, ssm_state_size=8, n_groups=2, n_routed_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=16, moe_shared_expert_intermediate_size=24, vocab_size=64, chunk_size=16,
                  routed_scaling_factor=2.5, pad_token_id=0, bos_token_id=1, eos_token_id=2)
"""A tiny Nemotron-H with one layer of each type: Mamba2 (4 heads of 8, 2 groups), experts (4, top-2, a shared
expert 24 wide), attention without positions, a relu² MLP 48 wide."""


def tiny_config(**overrides):
    from transformers import NemotronHConfig

    return NemotronHConfig(**{**NEMOTRON_H, **overrides})


def tiny_model(seed=0, **overrides):
    """The tiny model (float32: transformers' grouped expert kernel takes no float64) with random correction biases
    and norms (so every term has a non-trivial value)."""
    from transformers import NemotronHForCausalLM

    torch.manual_seed(seed)
    model = NemotronHForCausalLM(tiny_config(**overrides))
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name or "e_score_correction_bias" in name:
                tensor.add_(0.1 * torch.randn_like(tensor))
    return model


def test_presets_have_the_published_shapes_and_their_test_sizes_build():
    """The two presets: their layer patterns (Nano: 23 Mamba2, 23 expert, 6 attention layers; 8B: 24 Mamba2, 24 MLP,
    4 attention), the parameter counts of the published models (31.6B, 8.1B), their hub names; the test sizes
    (preset_worker.reduced_preset: one period of the pattern) build in transformers and count the same in the
    planner and the model (the counts ZeRO-3's reuse distance reads)."""
    from collections import Counter

    from preset_worker import reduced_preset

    from ulysses_train.model.architecture import causal_lm_on_meta, experts_per_token
    from ulysses_train.model.presets import known_name, preset_config
    from ulysses_train.training.resolved_run import decoder_layer_params

    nano, h8b = preset_config("nemotron-3-nano-30b-a3b"), preset_config("nemotron-h-8b")
    assert Counter(nano.layers_block_type) == {"linear_attention": 23, "moe": 23, "full_attention": 6}
    assert Counter(h8b.layers_block_type) == {"linear_attention": 24, "mlp": 24, "full_attention": 4}
    assert nano.hybrid_override_pattern == "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
    assert sum(p.numel() for p in causal_lm_on_meta(nano).parameters()) == 31_577_937_344
    assert sum(p.numel() for p in causal_lm_on_meta(h8b).parameters()) == 8_100_852_736
    assert experts_per_token(nano) == (128, 6) and experts_per_token(h8b) == (0, 0)  # 8B: n_routed_experts default
    assert known_name("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16") == "nemotron-3-nano-30b-a3b"
    assert known_name("nvidia/Nemotron-H-8B-Base-8K") == "nemotron-h-8b" and known_name("nvidia/other") is None
    for name, pattern in (("nemotron-3-nano-30b-a3b", "MEMEM*"), ("nemotron-h-8b", "M-M-M-M*")):
        config = reduced_preset(name)
        assert config.hybrid_override_pattern == pattern and config.hidden_size == 64
        model = causal_lm_on_meta(config)
        largest = max(sum(p.numel() for p in layer.parameters()) for layer in model.get_decoder().layers)
        assert decoder_layer_params(config) == largest


def test_tiled_relu2_mlp_and_experts_equal_their_own_forward_and_backward():
    """TiledMLP on Nemotron-H: its relu² MLP and its expert block (router, experts, shared expert) are tiled, its
    Mamba2 and attention layers are not; the model's logits and every gradient over 3 tiles (an uneven length,
    so a padded tile) equal the same model untiled. Negative control: the Mamba2 mixer run through the same tiles
    (its recurrence crosses tile edges) differs from its own forward."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP
    from helpers import assert_same_logits_and_gradients

    from ulysses_train.model.tiling import _mlp_forward, apply_tiled_mlp, tileable_blocks

    model = tiny_model()
    reference = copy.deepcopy(model)
    mlps, tileable = tileable_blocks(model)
    assert [type(m).__name__ for m in tileable] == ["NemotronHMoE", "NemotronHMLP"] and mlps == tileable
    schedule = apply_tiled_mlp(model, "true")
    assert_same_logits_and_gradients(model, reference, torch.randint(3, 64, (1, 95)))
    assert schedule.num_tiles == 3  # ceil(95 / 32)

    mamba = reference.model.layers[0].mixer
    x = torch.randn(1, 96, 32)
    tiled = TiledMLP.apply(_mlp_forward, mamba, x, 3, list(mamba.parameters()))
    assert (tiled - mamba(x)).abs().max() > 1e-3


def test_planner_counts_nemotron_h_by_hand():
    """counts_on_meta on the tiny model against a count by hand: the expert bank (E x 2 x I x H), the largest
    MLP block (the expert block: bank, router, shared expert), active parameters per layer (k/E of the bank) and the
    shared expert's width (moe_shared_expert_intermediate_size, not n_shared_experts x moe_intermediate_size).
    Controls: the Mamba2 mixer is no MLP block (it is larger than the MLP here), and a config without an expert
    layer counts no experts though transformers gives it n_routed_experts 8."""
    from ulysses_train.planner.model_counts import counts_on_meta

    c = tiny_config()
    H, E, k, I_moe, shared, I_mlp = 32, 4, 2, 16, 24, 48
    d_inner, groups_state, heads = 4 * 8, 2 * 8, 4
    conv = d_inner + 2 * groups_state
    mamba = H * (2 * d_inner + 2 * groups_state + heads) + conv * 4 + conv + 3 * heads + d_inner + d_inner * H + H
    bank = E * 2 * I_moe * H
    moe = bank + E * H + 2 * H * shared + H
    attention = H * 4 * 8 + 2 * H * 2 * 8 + 4 * 8 * H + H
    mlp = 2 * H * I_mlp + H
    counted = counts_on_meta(c)
    assert counted["layer_params"] == max(mamba, moe, attention, mlp)
    assert counted["total_params"] == mamba + moe + attention + mlp + 2 * 64 * H + H
    assert counted["mlp_block_params"] == moe - H and mamba - H > mlp - H  # the control: a mixer is not counted
    assert counted["active_layer_params"] == (mamba + moe - bank * (E - k) // E + attention + mlp) // 4
    assert counted["shared_expert_intermediate"] == shared and counted["expert_intermediate"] == I_moe
    dense = counts_on_meta(tiny_config(layers_block_type=["linear_attention", "mlp", "full_attention"]))
    assert "experts" not in dense and tiny_config().n_routed_experts == E


def save_hub_layout(model, folder: str, extra: dict = ()) -> str:
    """`model` saved by transformers (the hub's layout: `backbone.`, one tensor per expert), plus `extra` tensors."""
    from safetensors.torch import load_file, save_file

    model.save_pretrained(folder)
    weights = load_file(f"{folder}/model.safetensors")
    assert any(n.startswith("backbone.") for n in weights) and any(".experts.0.up_proj" in n for n in weights)
    save_file({**weights, **dict(extra)}, f"{folder}/model.safetensors", metadata={"format": "pt"})
    return folder


def test_hub_layout_loads_strictly_mtp_tensors_are_named_and_an_unknown_tensor_refused(tmp_path):
    """The hub's parameter names (`backbone.`, per-expert tensors) load through the weight check into transformers'
    model (equal tensors); `mtp.*` tensors (transformers drops them) load and are named as not trained; an unknown
    tensor is refused; a config override asking for multi-token-prediction layers is refused in one line."""
    from ulysses_train.config import ConfigError, ModelConfig
    from ulysses_train.model.loading import build_causal_lm, load_model_config

    source = tiny_model()
    mtp = {"mtp.layers.0.mixer.q_proj.weight": torch.ones(2, 2), "mtp.norm.weight": torch.ones(2)}
    folders = {"hub": save_hub_layout(source, str(tmp_path / "hub")),
               "mtp": save_hub_layout(source, str(tmp_path / "mtp"), mtp),
               "extra": save_hub_layout(source, str(tmp_path / "extra"), {"backbone.layers.0.adapter": torch.ones(2)})}
    load = lambda folder, **overrides: build_causal_lm(  # noqa: E731
        load_model_config(cfg := ModelConfig(name_or_path=folder, dtype="float32", config_overrides=overrides)),
        cfg, "sdpa", None)[0]
    loaded = load(folders["hub"])
    for (name, p), q in zip(loaded.state_dict().items(), source.state_dict().values()):
        assert torch.equal(p, q), name
    assert getattr(loaded, "checkpoint_tensors_not_trained", None) is None
    note = load(folders["mtp"]).checkpoint_tensors_not_trained
    assert note.startswith("checkpoint tensors not trained: 2 multi-token-prediction heads (mtp.*"), note
    with pytest.raises(ConfigError, match=r"1 of the checkpoint's tensors are not used by the model \(e\.g\. "
                                          r"backbone\.layers\.0\.adapter\)"):
        load(folders["extra"])
    with pytest.raises(ConfigError, match=r"^model\.config_overrides\.num_nextn_predict_layers=1 asks to train "
                                          r"multi-token-prediction layers.*Fix: remove"):
        load(folders["hub"], num_nextn_predict_layers=1)


def test_export_writes_the_hub_layout_and_loads_back(tmp_path):
    """export_hf_model (the trainer's export: the engine's consolidated state, `causal_lm.` prefixed) writes the
    hub's names for nemotron_h, and the folder loads back through our loader to the same tensors."""
    from safetensors import safe_open

    from ulysses_train.config import ModelConfig
    from ulysses_train.model.loading import build_causal_lm, load_model_config
    from ulysses_train.training.export import export_hf_model

    model = tiny_model()

    class Engine:
        def _zero3_consolidated_16bit_state_dict(self):
            return {f"causal_lm.{k}": v for k, v in model.state_dict().items()}

    folder = str(tmp_path / "hf_model")
    export_hf_model(Engine(), model, folder, rank=0)
    with safe_open(f"{folder}/model.safetensors", "pt") as handle:
        names = set(handle.keys())
    assert "backbone.embeddings.weight" in names and "backbone.layers.1.mixer.experts.3.down_proj.weight" in names
    cfg = ModelConfig(name_or_path=folder, dtype="float32")
    loaded = build_causal_lm(load_model_config(cfg), cfg, "sdpa", None)[0]
    for (name, p), q in zip(loaded.state_dict().items(), model.state_dict().values()):
        assert torch.equal(p, q), name


def test_no_positions_yarn_refused_and_eval_told_so():
    """Nemotron-H's attention takes no positions (its Nano config.json's rope_theta 10000 is read by no layer): NoPE,
    as OLMo-hybrid's. Within its positions nothing changes; past them YaRN ('auto', 'yarn', a factor) is refused and
    'none' trains, warned (the 1M-token runs of the issue). Control: without the NoPE rule the config would read as
    having no rope_parameters, which refuses 'none' past its positions."""
    import warnings

    from ulysses_train.model import rope
    from ulysses_train.model.presets import preset_config

    nano = lambda: preset_config("nemotron-3-nano-30b-a3b")  # noqa: E731
    assert rope.position_free(nano()) and rope.rope_description(nano()).startswith("none (NoPE")
    assert rope.apply_rope_scaling(nano(), 262_144).applied == "none"
    for mode, factor in (("auto", None), ("yarn", None), ("auto", 4.0)):
        with pytest.raises(rope.RopeConfigError, match="its attention layers take no positions.*nothing for YaRN"):
            rope.apply_rope_scaling(nano(), 1_048_576, mode, factor)
    with pytest.warns(rope.RopeLengthWarning, match="NoPE"):
        assert rope.apply_rope_scaling(nano(), 1_048_576, "none").max_position_embeddings == 262_144
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rope.apply_rope_scaling(preset_config("nemotron-h-8b"), 8192, "none")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rope, "NO_POSITION_TYPES", ())
        with pytest.raises(rope.RopeConfigError, match="no rope_parameters"):
            rope.apply_rope_scaling(nano(), 1_048_576, "none")


def test_router_logits_train_without_a_router_loss_as_transformers_does():
    """transformers' NemotronHForCausalLM returns its router logits with output_router_logits but adds no router loss
    (5.17 and 5.25): its loss equals the plain cross-entropy. So nemotron_h with output_router_logits is accepted and
    no router loss is attached. Control: a family whose loss has an unchecked router term is still refused."""
    from helpers import tiny_family_config

    from ulysses_train.config import ConfigError
    from ulysses_train.model.loading import check_supported_architecture
    from ulysses_train.model.router_balance import attach_router_balance

    model = tiny_model(output_router_logits=True)
    ids = torch.randint(3, 64, (1, 20))
    out = model(input_ids=ids, labels=ids)
    assert len(out.router_logits) == 1
    cross_entropy = torch.nn.functional.cross_entropy(out.logits[0, :-1], ids[0, 1:])
    torch.testing.assert_close(out.loss, cross_entropy, rtol=1e-6, atol=0)
    check_supported_architecture(model.config)
    assert attach_router_balance(model) is None
    with pytest.raises(ConfigError, match="output_router_logits=true"):
        check_supported_architecture(tiny_family_config("hy_v3", num_experts=4, output_router_logits=True))


if __name__ == "__main__":
    raise SystemExit(pytest.main([os.path.abspath(__file__), "-q"]))


def test_a_reduced_depth_record_is_planned_on_the_layers_it_keeps():
    """bench.py --layers 6 builds Nemotron 3 Nano's first six layers (Mamba2, experts, Mamba2, experts, Mamba2,
    attention); the planner's record of that row must count those layers' parameters. Reference: the transformers
    model of that config built on the meta device. Control: dropping the largest layer's count per missing layer
    (right for a uniform model, checked on Qwen3-8B) is billions off for a hybrid, below zero here."""
    from transformers import AutoModelForCausalLM

    from ulysses_train.model.presets import preset_config
    from ulysses_train.planner.shapes import load_model_shape, reduced_depth_shape

    def meta_count(name, layers):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(preset_config(name, num_hidden_layers=layers))
        return sum(p.numel() for p in model.parameters())

    nano = reduced_depth_shape("nemotron-3-nano-30b-a3b", 6)
    assert nano.total_params == meta_count("nemotron-3-nano-30b-a3b", 6)
    assert nano.kinds == ("mamba2", "", "mamba2", "", "mamba2", "attention")
    full = load_model_shape("nemotron-3-nano-30b-a3b")
    assert full.total_params - (full.layers - 6) * full.layer_params < 0  # the control
    qwen = reduced_depth_shape("qwen3-8b", 4)
    assert qwen.total_params == meta_count("qwen3-8b", 4) and qwen.layers == 4
    # the first 4 layers have no attention: the plan recomputes only the layers' matmuls (it divided by zero)
    from ulysses_train.planner.estimate import plan_for_record

    prefix = reduced_depth_shape("nemotron-3-nano-30b-a3b", 4)
    planned = plan_for_record({"model": "nemotron-3-nano-30b-a3b", "num_hidden_layers": 4, "seq_length": 4096})
    assert "attention" not in prefix.kinds
    assert planned.recompute_flops == 2 * 4 * prefix.active_params_per_layer * 4096
