"""YaRN loader: right factor and theta, same cos/sin as transformers' own YaRN, survives export.

The reference cos/sin come from ``ROPE_INIT_FUNCTIONS["yarn"]`` applied to a config built by hand,
so a wrong factor, theta or original length in ``apply_rope_scaling`` shows up as a mismatch.
"""
import copy
import math

import pytest
import torch
from transformers import AutoConfig, Qwen3Config, Qwen3ForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from ulysses_train.model.rope import RopeConfigError, RopeLengthWarning, RopeScalingDecision, apply_rope_scaling

TRAINED = 40_960
TARGET = 163_840
THETA = 1_000_000.0
POSITIONS = [0, 1, 1_000, 40_959, 40_960, 100_000, 163_839]


def qwen3_config(**overrides) -> Qwen3Config:
    """Qwen3-4B positions and theta, tiny widths (head_dim 16 keeps 8 frequencies)."""
    kwargs = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=TRAINED,
        rope_theta=THETA,
    )
    kwargs.update(overrides)
    return Qwen3Config(**kwargs)


def rotary_cos_sin(config) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin from the model's own rotary module, built from ``config`` like the model builds it."""
    rotary = Qwen3RotaryEmbedding(config)
    x = torch.zeros(1, len(POSITIONS), config.head_dim)
    return rotary(x, torch.tensor([POSITIONS]))


def reference_yarn_cos_sin(factor, original, theta, head_dim=16):
    """transformers' YaRN frequencies from a config written out by hand, applied to POSITIONS."""
    reference = qwen3_config(
        max_position_embeddings=int(original * factor),
        head_dim=head_dim,
        rope_parameters={
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": original,
            "rope_theta": theta,
        },
    )
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](reference, "cpu")
    angles = torch.tensor([POSITIONS], dtype=torch.float32)[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def test_auto_sets_factor_from_model_length_and_keeps_theta():
    config = qwen3_config()
    decision = apply_rope_scaling(config, TARGET)
    assert isinstance(decision, RopeScalingDecision)
    assert decision.applied == "yarn"
    assert decision.factor == 4.0
    assert decision.rope_theta == THETA
    assert decision.original_max_position_embeddings == TRAINED
    assert config.rope_parameters == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": TRAINED,
        "rope_theta": THETA,
    }
    assert config.max_position_embeddings == TARGET
    assert "factor 4" in decision.message and "1e+06" in decision.message


def test_theta_and_length_are_read_not_assumed():
    config = qwen3_config(rope_theta=500_000.0, max_position_embeddings=32_768)
    decision = apply_rope_scaling(config, 131_072)
    assert config.rope_parameters["rope_theta"] == 500_000.0
    assert config.rope_parameters["original_max_position_embeddings"] == 32_768
    assert decision.factor == 4.0


def test_rotary_embedding_equals_transformers_yarn_across_range():
    config = qwen3_config()
    apply_rope_scaling(config, TARGET)
    cos, sin = rotary_cos_sin(config)
    ref_cos, ref_sin = reference_yarn_cos_sin(4.0, TRAINED, THETA)
    torch.testing.assert_close(cos, ref_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, ref_sin, rtol=0, atol=1e-6)


def test_yarn_shape_matches_the_paper():
    """Independent of transformers: attention scale 0.1 ln(s) + 1; fastest frequency kept,
    slowest divided by the factor."""
    config = qwen3_config()
    apply_rope_scaling(config, TARGET)
    rotary = Qwen3RotaryEmbedding(config)
    plain = 1.0 / THETA ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)
    assert rotary.attention_scaling == pytest.approx(0.1 * math.log(4.0) + 1.0)
    assert rotary.inv_freq[0].item() == pytest.approx(plain[0].item())
    assert rotary.inv_freq[-1].item() == pytest.approx(plain[-1].item() / 4.0)


def test_negative_controls_differ():
    """The comparison above can fail: unscaled RoPE, or YaRN with the wrong theta, gives other values."""
    scaled = qwen3_config()
    apply_rope_scaling(scaled, TARGET)
    cos, _ = rotary_cos_sin(scaled)
    unscaled_cos, _ = rotary_cos_sin(qwen3_config())
    wrong_theta_cos, _ = reference_yarn_cos_sin(4.0, TRAINED, 10_000.0)
    far = POSITIONS.index(100_000)
    assert (cos[0, far] - unscaled_cos[0, far]).abs().max() > 0.1
    assert (cos[0, far] - wrong_theta_cos[0, far]).abs().max() > 0.1


def test_settings_survive_save_and_reload(tmp_path):
    config = qwen3_config()
    apply_rope_scaling(config, TARGET)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(tmp_path)

    reloaded_config = AutoConfig.from_pretrained(tmp_path)
    assert reloaded_config.rope_parameters == config.rope_parameters
    assert reloaded_config.max_position_embeddings == TARGET
    reloaded = Qwen3ForCausalLM.from_pretrained(tmp_path)
    torch.testing.assert_close(reloaded.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq)
    assert reloaded.model.rotary_emb.attention_scaling == model.model.rotary_emb.attention_scaling
    cos, _ = rotary_cos_sin(reloaded.config)
    ref_cos, _ = reference_yarn_cos_sin(4.0, TRAINED, THETA)
    torch.testing.assert_close(cos, ref_cos, rtol=0, atol=1e-6)


def test_auto_within_trained_length_leaves_rope_alone():
    config = qwen3_config()
    before = dict(config.rope_parameters)
    decision = apply_rope_scaling(config, 32_768)
    assert decision.applied == "none"
    assert config.rope_parameters == before
    assert config.max_position_embeddings == TRAINED


def test_forced_yarn_inside_trained_length_with_explicit_factor():
    config = qwen3_config()
    decision = apply_rope_scaling(config, 32_768, mode="yarn", factor=2.0)
    assert decision.applied == "yarn"
    assert config.rope_parameters["factor"] == 2.0
    assert config.max_position_embeddings == TRAINED  # never lowered


def test_none_past_trained_length_warns_loudly_and_changes_nothing():
    config = qwen3_config()
    before = dict(config.rope_parameters)
    with pytest.warns(RopeLengthWarning, match="163,840.*40,960"):
        decision = apply_rope_scaling(config, TARGET, mode="none")
    assert decision.applied == "none"
    assert config.rope_parameters == before
    assert config.max_position_embeddings == TRAINED


def test_refuses_to_stack_yarn_on_shipped_scaling():
    config = qwen3_config(
        max_position_embeddings=131_072,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32_768,
            "rope_theta": THETA,
        },
    )
    before = dict(config.rope_parameters)
    with pytest.raises(RopeConfigError, match=r"rope_type='yarn'.*factor=4\.0.*explicit factor"):
        apply_rope_scaling(config, 262_144)
    with pytest.raises(RopeConfigError, match="stack"):
        apply_rope_scaling(config, 262_144, mode="yarn")
    assert config.rope_parameters == before


def test_explicit_factor_replaces_shipped_scaling_from_pretraining_length():
    config = qwen3_config(
        max_position_embeddings=131_072,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32_768,
            "rope_theta": THETA,
        },
    )
    decision = apply_rope_scaling(config, 262_144, factor=8.0)
    assert config.rope_parameters["factor"] == 8.0
    assert config.rope_parameters["original_max_position_embeddings"] == 32_768
    assert config.max_position_embeddings == 262_144
    assert "replaced the shipped rope_type='yarn'" in decision.message


def test_shipped_scaling_that_covers_target_is_kept_in_auto():
    config = qwen3_config(
        max_position_embeddings=131_072,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32_768,
            "rope_theta": THETA,
        },
    )
    decision = apply_rope_scaling(config, 131_072)
    assert decision.applied == "none"
    assert config.rope_parameters["factor"] == 4.0


def test_too_small_explicit_factor_warns():
    config = qwen3_config()
    with pytest.warns(RopeLengthWarning, match="covers 81,920"):
        apply_rope_scaling(config, TARGET, factor=2.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(target_length=TARGET, mode="YaRN"), "'YaRN' is not one of auto, yarn, none"),
        (dict(target_length=0), "positive, got 0"),
        (dict(target_length=-5), "positive, got -5"),
        (dict(target_length=1.5e5), "whole number"),
        (dict(target_length=True), "whole number"),
        (dict(target_length=TARGET, factor=0.5), ">= 1.*0.5"),
        (dict(target_length=TARGET, factor=float("nan")), ">= 1"),
        (dict(target_length=TARGET, factor="4"), "must be a number"),
        (dict(target_length=TARGET, mode="none", factor=4.0), "'none'.*drop the factor"),
        (dict(target_length=32_768, mode="yarn"), "needs no scaling.*40960"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    config = qwen3_config()
    before = dict(config.rope_parameters)
    with pytest.raises(RopeConfigError, match=match):
        apply_rope_scaling(config, **kwargs)
    assert config.rope_parameters == before
    assert config.max_position_embeddings == TRAINED


def test_error_is_a_value_error():
    assert issubclass(RopeConfigError, ValueError)


def test_model_without_rope_is_refused():
    config = qwen3_config()
    config.rope_parameters = None
    with pytest.raises(RopeConfigError, match="no rope_parameters"):
        apply_rope_scaling(config, TARGET)


def test_per_layer_rope_is_left_alone_within_its_positions_and_refused_past_them():
    """Gemma 3's form (a RoPE per layer type): YaRN for it is not built, so past the supported positions (or
    with YaRN asked for) it is refused; within them, and with 'none', RoPE stays exactly as shipped."""
    config = qwen3_config()
    config.rope_parameters = {
        "full_attention": {"rope_type": "default", "rope_theta": THETA},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    }
    shipped = copy.deepcopy(config.rope_parameters)
    for mode, factor in (("auto", None), ("yarn", None), ("auto", 4.0)):
        with pytest.raises(RopeConfigError, match="per layer type.*full_attention, sliding_attention"):
            apply_rope_scaling(config, TARGET, mode, factor)
    decision = apply_rope_scaling(config, config.max_position_embeddings)
    assert decision.applied == "none" and decision.rope_theta == THETA
    with pytest.warns(RopeLengthWarning):
        assert apply_rope_scaling(config, TARGET, "none").applied == "none"
    assert config.rope_parameters == shipped and config.max_position_embeddings == 40960


# Run in a child process: zero.Init needs a process group, which this test process should not keep.
def test_qwen3_5_partial_multimodal_rope_reaches_1m_with_yarn_over_the_rotary_part():
    """Qwen3.5-9B (262,144 native, rotary on a quarter of head dim 256, three position axes): `auto` at
    1,048,576 writes YaRN factor 4 the way the model card extends it, keeps the partial factor and the multimodal
    sections, and transformers' own rotary module then holds 32 frequencies, the fastest unchanged and the
    slowest divided by 4 (by hand from theta 1e7), with YaRN's attention scaling 0.1 ln 4 + 1. At the native
    length it is left alone."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    from ulysses_train.model.presets import preset_config

    config = preset_config("qwen3.5-9b", num_hidden_layers=4)
    assert apply_rope_scaling(config, 262_144, "auto").applied == "none"
    decision = apply_rope_scaling(config, 1_048_576, "auto")
    assert decision.applied == "yarn" and decision.factor == 4.0 and config.max_position_embeddings == 1_048_576
    rope = config.rope_parameters
    assert rope["partial_rotary_factor"] == 0.25 and rope["mrope_section"] == [11, 11, 10] and rope["mrope_interleaved"]
    rotary = Qwen3_5TextRotaryEmbedding(config)
    inv_freq = rotary.inv_freq.double()
    assert inv_freq.shape == (32,)
    assert math.isclose(inv_freq[0], 1.0, rel_tol=1e-6) and math.isclose(inv_freq[1], 1e7 ** (-2 / 64), rel_tol=1e-6)
    assert math.isclose(inv_freq[-1], 1e7 ** (-62 / 64) / 4, rel_tol=1e-5)
    assert math.isclose(rotary.attention_scaling, 0.1 * math.log(4) + 1, rel_tol=1e-9)


@pytest.mark.parametrize("position_embedding_type,free", [(None, True), ("nope", True), ("rope", False)])
def test_a_config_that_switches_rope_off_is_position_free(position_embedding_type, free):
    """transformers' `position_embedding_type` switch (Granite 4.0-H: "nope" in its config.json; transformers builds
    the rotary embedding only for "rope"): NoPE unless it says rope, so YaRN is refused there. Control: "rope"."""
    from helpers import tiny_family_config

    from ulysses_train.model import rope

    config = tiny_family_config("granitemoehybrid", position_embedding_type=position_embedding_type)
    assert rope.position_free(config) == free
    from transformers import AutoModelForCausalLM

    assert (AutoModelForCausalLM.from_config(config).model.rotary_emb is None) == free  # what transformers builds


def test_nope_families_refuse_a_shipped_yarn_entry_and_name_no_rope_step():
    """Nemotron-H and Kimi Linear build no rotary embedding (NO_POSITION_TYPES): a `rope_scaling` yarn entry in such a
    config.json would be read by nothing, so it is refused like model.rope_scaling=yarn (control: the same config
    without it trains past its positions with 'none'); their built models hold no rotary module, so the `model
    changes:` line names no RoPE step (control: Qwen3 holds one)."""
    from helpers import KIMI_LINEAR, NEMOTRON_H, tiny_family_config, tiny_qwen3_config
    from transformers import AutoModelForCausalLM

    from ulysses_train.model.rope import position_free, rotary_modules

    for model_type, fields in (("nemotron_h", NEMOTRON_H), ("kimi_linear", KIMI_LINEAR)):
        config = tiny_family_config(model_type, **fields)
        assert position_free(config)
        with pytest.warns(RopeLengthWarning):
            assert apply_rope_scaling(copy.deepcopy(config), 1 << 20, "none").applied == "none"
        config.rope_parameters = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
        with pytest.raises(RopeConfigError, match=r"config names a 'yarn' RoPE scaling, but the model has no rotary"):
            apply_rope_scaling(config, 1 << 20, "none")
        assert rotary_modules(AutoModelForCausalLM.from_config(tiny_family_config(model_type, **fields))) == []
    assert len(rotary_modules(Qwen3ForCausalLM(tiny_qwen3_config()))) == 1
