"""The token-mixer registry (model/mixers/): each mixer recognises its layers, says which sp splits its heads and
installs itself; the trainer, plan.py and the planner's search ask the registry, so they agree. Each check has a
control (the model or the sp for which the answer differs)."""
import pytest
from helpers import KIMI_LINEAR, tiny_family_config, tiny_qwen3_config

from ulysses_train.config import ConfigError
from ulysses_train.model.mixers import (MIXERS, head_counts, install_mixers, mixers_of,
                                        layer_mixer_names, sp_problems, valid_sp_values)
from ulysses_train.model.mixers.protocol import HeadCounts
from ulysses_train.planner.mixer_terms import MIXER_TERMS
from ulysses_train.planner.linear_layer import delta_rule_heads
from ulysses_train.planner.shapes import ModelShape
from ulysses_train.sequence_parallel import SequenceParallel

SINGLE = SequenceParallel()

GATED_DELTANET = dict(head_dim=16, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=16,
                      linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"])


def hybrid(**overrides):
    return tiny_family_config("qwen3_5_text", **{**GATED_DELTANET, **overrides})


def test_each_mixer_recognises_its_layers_and_its_planner_kind():
    assert [m.name for m in mixers_of(tiny_qwen3_config())] == ["attention"]
    assert [m.name for m in mixers_of(hybrid())] == ["attention", "gated_deltanet"]
    sliding = tiny_family_config("gemma3_text", layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    assert [m.name for m in mixers_of(sliding)] == ["attention"]
    other = hybrid()
    other.model_type = "another_hybrid"  # linear_attention of another family: no mixer builds it
    assert [m.name for m in mixers_of(other)] == ["attention"]
    assert set(layer_mixer_names(tiny_qwen3_config())) == {"attention"}
    # the planner's shape carries the same counts: its kinds and sp rule come from the same registry
    shape = ModelShape.from_hf_config(hybrid())
    assert shape.head_counts == head_counts(hybrid())
    assert {m.name for m in MIXERS} == {"attention", "gated_deltanet", "kimi_delta", "mamba2", "indexed_attention"}
    # one mixer name per decoder layer, from the mixer that builds each layer type; each has its planner terms
    assert shape.kinds == tuple(layer_mixer_names(hybrid())) == tuple(
        "gated_deltanet" if kind == "linear_attention" else "attention" for kind in hybrid().layer_types)
    assert {m.name for m in MIXERS if m.planned} <= set(MIXER_TERMS)
    # Kimi Linear's linear_attention layers are Kimi Delta Attention (not Gated DeltaNet): their own planner kind;
    # its MLA layers are attention with q/k heads of qk_nope + qk_rope and v heads of v_head_dim
    kimi = tiny_family_config("kimi_linear", **KIMI_LINEAR)
    assert [m.name for m in mixers_of(kimi)] == ["attention", "kimi_delta"]
    assert head_counts(kimi) == HeadCounts.of_mixers({"attention": {"query heads": 4, "kv heads": 4},
                                                      "kimi_delta": {"heads": 4}})
    kimi_shape = ModelShape.from_hf_config(kimi)
    assert kimi_shape.kinds == ("kimi_delta", "attention") and kimi_shape.head_counts == head_counts(kimi)
    assert (kimi_shape.head_dim, kimi_shape.value_head_dim, delta_rule_heads(kimi_shape)) == (12, 6, (4, 4, 8, 8))
    assert kimi_shape.shared_expert_intermediate == 32  # one shared expert of moe_intermediate_size
    # GLM-5's indexed_attention layers are indexed attention's, its own kind; no unit is split (any sp)
    from test_indexed_attention import GLM_5

    glm = tiny_family_config("glm_moe_dsa", **GLM_5)
    assert [m.name for m in mixers_of(glm)] == ["indexed_attention"] and layer_mixer_names(glm) == [
        "indexed_attention"] * 2
    assert head_counts(glm) == HeadCounts.of_mixers({"indexed_attention": {"query heads": 4}})
    assert ModelShape.from_hf_config(glm).kinds == ("indexed_attention",) * 2


def test_sp_values_come_from_every_mixer_and_always_include_1():
    """4 query heads, 2 KV heads: attention allows 1, 2, 4; 3 Gated DeltaNet key heads allow 1 and 3 only, so the
    hybrid allows [1] (the old linear-head list started at 2 and said "Use sp in []"). Control: 6 query and KV
    heads with the same 3 key heads allow [1, 3]."""
    assert valid_sp_values(tiny_qwen3_config()) == [1, 2, 4]
    three_keys = dict(linear_num_key_heads=3, linear_num_value_heads=6)
    assert valid_sp_values(hybrid(**three_keys)) == [1]
    assert valid_sp_values(hybrid(**three_keys, num_attention_heads=6, num_key_value_heads=6)) == [1, 3]
    assert valid_sp_values(hybrid(**three_keys, num_attention_heads=6, num_key_value_heads=6), limit=2) == [1]
    assert sp_problems(hybrid(), 2) == []
    assert [p.split(",")[0] for p in sp_problems(hybrid(**three_keys), 2)] == [
        "the model's linear-attention (Gated DeltaNet) layers have 3 key heads and 6 value heads"]
    assert [p.split(",")[0] for p in sp_problems(hybrid(**three_keys), 3)] == ["the model has 4 query heads"]
    # Kimi Delta Attention: sp divides its heads (2 here: sp=4 refused although attention's 4 heads allow it)
    kimi = tiny_family_config("kimi_linear", **{**KIMI_LINEAR, "linear_num_heads": 2})
    assert valid_sp_values(kimi) == [1, 2] and valid_sp_values(tiny_family_config("kimi_linear", **KIMI_LINEAR)) == [
        1, 2, 4]
    assert sp_problems(kimi, 4) == ["the model's Kimi Delta Attention layers have 2 heads, not divisible by sp=4: each "
                                    "rank runs the whole sequence of heads/sp of them"]


def test_install_names_what_changed_and_changes_nothing_in_a_dense_model():
    """The `model changes:` phrases come from each mixer's install: a hybrid's Gated DeltaNet layers get the
    Ulysses forward (sp=1 here: a SequenceParallel of size 1); a dense model has nothing to install (attention was
    installed before the build)."""
    from transformers import AutoModelForCausalLM

    from ulysses_train.model.swap import stock_class

    model = AutoModelForCausalLM.from_config(hybrid())
    phrases = install_mixers(model, SINGLE)
    assert len(phrases) == 1 and phrases[0].startswith("1 Gated DeltaNet layers over the whole sequence"), phrases
    layer = model.model.layers[0].linear_attn
    assert type(layer).__name__.startswith("Ulysses") and stock_class(layer).__name__ == "Qwen3_5GatedDeltaNet"
    assert install_mixers(AutoModelForCausalLM.from_config(tiny_qwen3_config()), SINGLE) == []
    kimi = AutoModelForCausalLM.from_config(tiny_family_config("kimi_linear", **KIMI_LINEAR))
    assert install_mixers(kimi, SINGLE) == ["1 Kimi Delta Attention layers over the whole sequence of each rank's "
                                            "heads (transformers' torch conv1d, chunked KDA rule and gated RMSNorm)"]
    assert stock_class(kimi.model.layers[0].self_attn).__name__ == "KimiLinearDeltaAttention"
    assert type(kimi.model.layers[1].self_attn).__name__ == "KimiLinearAttention"  # MLA: changed under sp only


def test_the_trainer_names_sp_1_when_no_larger_sp_splits_every_mixer():
    """4 query heads split over 2 and 4, 3 Gated DeltaNet key heads over 3: only sp=1 splits both. The refusal
    said "Use sp in []" (its list started at 2 and kept the values attention allows); it now says [1], and auto
    picks 1. Control: with 4 key heads sp=2 passes and auto picks 4 on 4 processes."""
    from ulysses_train.parallel.layout import auto_sequence_parallel_size, validate_parallel_layout

    three_keys = hybrid(linear_num_key_heads=3, linear_num_value_heads=6)
    with pytest.raises(ConfigError, match=r"3 key heads .* parallel.sequence_parallel_size=2: .*Use sp in \[1\]\.$"):
        validate_parallel_layout(three_keys, 2, "sdpa")
    assert auto_sequence_parallel_size(4, three_keys) == 1
    validate_parallel_layout(hybrid(), 2, "sdpa")
    assert auto_sequence_parallel_size(4, hybrid()) == 4


def test_layer_types_are_checked_against_the_mixers_of_the_model_type():
    """A layer type is built where some mixer builds it for that model type: linear_attention is a Gated DeltaNet
    in Qwen3.5 (control) and refused in another family; the config.json check (before transformers reads it, any
    model type) finds a legacy alias and a wrong length inside an image-text release's text_config too, and lets
    the release's own config through (control)."""
    from ulysses_train.model.mixers import check_layer_types, check_raw_layer_types, layer_types_problem

    check_layer_types(hybrid())
    check_layer_types(tiny_qwen3_config())  # no layer_types: every layer full attention
    assert layer_types_problem("qwen3_5_text", ["linear_attention", "full_attention"], 2) is None
    assert layer_types_problem("kimi_linear", ["linear_attention", "full_attention"], 2) is None
    problem = layer_types_problem("another_hybrid", ["linear_attention", "full_attention"], 2)
    assert problem.startswith("model type 'another_hybrid' has layers of type ['linear_attention'] (layers [0])")
    assert "known layer types here: ['full_attention', 'sliding_attention', 'chunked_attention']" in problem
    release = {"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text", "num_hidden_layers": 2,
                                                        "layer_types": ["linear_attention", "full_attention"]}}
    check_raw_layer_types(release, "m")
    for kinds, message in ((["mamba", "full_attention"], r"names \['mamba'\] \(layers \[0\]\), a legacy name"),
                           (["linear_attention"], "has 1 entries but num_hidden_layers=2")):
        with pytest.raises(ConfigError, match=r"^m: its config.json's layer_types " + message):
            check_raw_layer_types({**release, "text_config": {**release["text_config"], "layer_types": kinds}}, "m")


def nemotron_h_release() -> dict:
    """A Nemotron-H config.json as released: the layers as a letter pattern beside num_hidden_layers."""
    return {"model_type": "nemotron_h", "num_hidden_layers": 4, "hybrid_override_pattern": "M*-E",
            "mtp_hybrid_override_pattern": "*E", "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "mamba_num_heads": 4, "mamba_head_dim": 16, "n_groups": 2,
            "intermediate_size": 64, "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
            "vocab_size": 128}


@pytest.mark.parametrize("change,message", [
    ({"hybrid_override_pattern": "M*-X"}, r"hybrid_override_pattern 'M\*-X' has the letter\(s\) \['X'\], which name "
                                          r"no layer type; each letter is one layer: M \(linear_attention\)"),
    ({"hybrid_override_pattern": None, "num_hidden_layers": 6, "layers_block_type": ["mamba", "attention", "mlp", "moe"]},
     r"layers_block_type has 4 entries but num_hidden_layers=6"),
    ({"hybrid_override_pattern": None, "layers_block_type": ["mamba", "attention", "mlp", "retnet"]},
     r"model type 'nemotron_h' has layers of type \['retnet'\] \(layers \[3\]\)"),
    ({"mtp_hybrid_override_pattern": "*R"}, r"mtp_hybrid_override_pattern '\*R' has the letter\(s\) \['R'\]"),
])
def test_nemotron_h_per_layer_keys_are_checked_before_transformers_reads_them(tmp_path, change, message):
    """Nemotron-H names its layers in its own keys (a letter pattern, layers_block_type, their mtp_ twins), which
    transformers reads with a KeyError for an unknown letter and with num_hidden_layers ignored (6 asked, 4 built,
    silently). Each is refused in one line, by the same check train.py and plan.py reach (read_hf_config); the
    release as written passes (control)."""
    import json

    from ulysses_train.model.loading import read_hf_config
    from ulysses_train.model.mixers import check_raw_layer_types

    check_raw_layer_types(nemotron_h_release(), "m")
    config = {k: v for k, v in {**nemotron_h_release(), **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=r"^m: its config.json's " + message):
        check_raw_layer_types(config, "m")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        read_hf_config(str(tmp_path), key="--model")


def test_q_k_v_split_from_one_projection_reach_the_conv_without_a_copy(monkeypatch):
    """At sp=1 Qwen3.5's q, k, v are the split output of `in_proj_qkv`: `side_by_side` gives the conv that output
    itself (same storage, no concatenation in the forward or of the gradients in backward), with the values and
    gradients of the concatenation. Controls: parts of separate tensors, or out of their order in the tensor, are
    concatenated (a new tensor). Then the sp=1 layer with it equals transformers' own layer, output and gradients."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from ulysses_train.model.mixers.recurrent import side_by_side

    projection, tokens = torch.nn.Linear(6, 4 + 4 + 8), torch.randn(2, 5, 6, requires_grad=True)
    projected = projection(tokens)
    q, k, v = (x.reshape(2, 5, -1, 2) for x in torch.split(projected, [4, 4, 8], dim=-1))
    mixed, concatenated = side_by_side(q, k, v), torch.cat([x.flatten(2) for x in (q, k, v)], -1)
    assert mixed.data_ptr() == projected.data_ptr() and torch.equal(mixed, concatenated)
    weights, leaves = torch.randn(2, 5, 16), [tokens, *projection.parameters()]
    ours = torch.autograd.grad((mixed * weights).sum(), leaves, retain_graph=True)
    plain = torch.autograd.grad((concatenated * weights).sum(), leaves, retain_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(ours, plain))
    apart = side_by_side(q.clone(), k, v)
    assert apart.data_ptr() != projected.data_ptr() and torch.equal(apart, mixed)
    swapped = side_by_side(k, q, v)
    assert swapped.data_ptr() != projected.data_ptr() and torch.equal(swapped[..., :4], mixed[..., 4:8])

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hybrid())
    stock = copy.deepcopy(model.model.layers[0].linear_attn)
    install_mixers(model, SINGLE)
    layer = model.model.layers[0].linear_attn
    from ulysses_train.model.mixers import recurrent

    views = []  # whether the layer's conv input was the projection itself (a view of it), not a concatenation
    monkeypatch.setattr(recurrent, "side_by_side",
                        lambda *parts: views.append(side_by_side(*parts)._base is not None) or side_by_side(*parts))
    hidden = torch.randn(1, 70, stock.hidden_size, requires_grad=True)
    outputs = [module(hidden) for module in (stock, layer)]
    assert torch.allclose(outputs[0], outputs[1], atol=1e-5) and views == [True]
    for module, out in zip((stock, layer), outputs):
        out.square().sum().backward()
    for (name, a), b in zip(stock.named_parameters(), layer.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-4, rtol=1e-4), name
