"""Attention families with nothing of their own in the head, through the core exactness test: one step at sp=2 x dp=2
(four gloo processes: the sp=2 exchange in each data-parallel group, and the data-parallel reduction) equals the
plain single-process Hugging Face model (loss, every gradient, parameters after SGD). Their layers differ from
Qwen3's inside the attention module or the MLP (biases, q/k norms, layers without positions, experts with shared
ones), all per token or per head, so the same step checks them; the family records of ulysses_train/families.py name
this table. A file of its own so the test workers share these runs with test_model_families.py's."""
import pytest
from helpers import (assert_step_matches, reference_step, save_tiny_model, tiny_family_config,
                     worst_relative_error)
from test_model_families import LR, family_step

FAMILIES = {
    "llama": dict(tie_word_embeddings=False),
    "mistral": dict(sliding_window=None, head_dim=16),
    "qwen2": dict(tie_word_embeddings=False),
    "seed_oss": dict(head_dim=16, attention_dropout=0.0, residual_dropout=0.0),
    "smollm3": dict(no_rope_layers=[1, 0], pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "apertus": dict(pad_token_id=0, max_position_embeddings=65536),
    "glm4_moe": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                     head_dim=16, n_group=1, topk_group=1),
    "minimax_m2": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, rotary_dim=8, intermediate_size=32),
    "hunyuan_v1_moe": dict(num_experts=4, moe_topk=2, head_dim=16, moe_intermediate_size=32),
    "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_layer_start_index=1),
    "ministral3": dict(head_dim=16, max_position_embeddings=262144),
    "olmo2": dict(eos_token_id=None),
    "phi3": dict(eos_token_id=None, pad_token_id=None),
    "apertus1p5_text": dict(max_position_embeddings=65536),
    "flex_olmo": dict(num_experts=4, num_experts_per_tok=2, pad_token_id=None, eos_token_id=None),
    "hy_v3": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
    "minicpm5_moe": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
    "minimax_m3_vl_text": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, bos_token_id=None,
                               eos_token_id=None),
}
"""Seed-OSS's released dropout is off (every test here compares deterministic steps); SmolLM3's second layer takes no
positions (`no_rope_layers`); MiniMax-M2 norms q and k over all heads before they are split; GLM-4.5, Hunyuan-MoE
and ERNIE-4.5-MoE have a dense first layer, then experts (and shared experts), MiniMax-M2 experts in every layer;
their router losses are not built (refused when asked for: check_router_balance). Ministral 3 (YaRN), OLMo 2 (q/k
norms over all heads, norms after each block), Phi-3 (fused qkv and gate-up projections), Apertus 1.5's text model,
FlexOlmo, Hy3, MiniCPM-5-MoE and MiniMax-M3's text model (experts in every layer or after dense ones) need nothing
of their own either: a record and a row here. Token ids past the tiny vocabulary are dropped from their configs."""


WINDOW = dict(sliding_window=6, layer_types=["sliding_attention", "full_attention"], head_dim=16)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
SLIDING_FAMILIES = {
    "olmo3": dict(WINDOW, eos_token_id=None, pad_token_id=None),
    "cohere2": dict(WINDOW),
    "cohere2_moe": dict(WINDOW, **EXPERTS, num_shared_experts=1),
    "dots1": dict(WINDOW, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                  n_group=1, topk_group=1, n_shared_experts=1),
    "laguna": dict(WINDOW, **EXPERTS, shared_expert_intermediate_size=32),
    "afmoe": dict(WINDOW, **EXPERTS, num_shared_experts=1, num_dense_layers=1),
    "kolibri1": dict(WINDOW, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                     shared_expert_intermediate_size=32),
    "llama4_text": dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size=32, intermediate_size_mlp=128,
                        head_dim=16, attention_chunk_size=8, floor_scale=4, no_rope_layers=[1, 0],
                        pad_token_id=None, bos_token_id=None, eos_token_id=None),
}
"""Families with sliding-window layers beside full ones and nothing else of their own: a windowed layer then a full
one (window 6 in sequences of 30, crossing the slice edge), with `model.attn_implementation: fa4` (its fp32 reference
on CPU), against transformers' own window mask through SDPA. Command A's and Cohere 2 MoE's heads multiply the
logits by `logit_scale` (0.0625); Laguna gates each head's output (`gating`), with experts after a dense first layer;
AFMoE, Kolibri 1, Cohere 2 MoE and dots1 have experts with shared ones. Llama 4's text model: a chunked layer
(chunks of 8, so every sequence of 30 has four, one cut by the slice edge) then a layer without positions that scales
its queries by their position (`floor_scale` 4, so the scale changes every 4 tokens; attn_temperature_tuning), experts
with a shared one; its controls: chunks ignored, and the queries scaled by the slice's own positions."""
FA4 = ("--set", "model.attn_implementation=fa4")


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("attention_families")
    return {name: save_tiny_model(str(root / name), config=tiny_family_config(name, **kw))
            for name, kw in FAMILIES.items()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_attention_family_step_equals_single_process(tmp_path, family_models, family):
    samples, result = family_step(tmp_path, family_models[family], 4, 2)
    loss_error, grad_error = assert_step_matches(result, *reference_step(family_models[family], samples, LR))
    print(f"{family}: loss rel err {loss_error:.1e}, worst grad rel err {grad_error:.1e}")


@pytest.fixture(scope="module")
def sliding_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sliding_families")
    return {name: save_tiny_model(str(root / name), config=tiny_family_config(name, **kw))
            for name, kw in SLIDING_FAMILIES.items()}


@pytest.mark.parametrize("family,control", [*((family, "") for family in sorted(SLIDING_FAMILIES)),
                                            ("olmo3", "--no-window"), ("llama4_text", "--no-chunks"),
                                            ("llama4_text", "--positions-of-the-slice-for-tuning")])
def test_sliding_family_step_equals_single_process(tmp_path, sliding_models, family, control):
    """sp=2 x dp=2; the control (every layer attends to the whole past) differs."""
    samples, result = family_step(tmp_path, sliding_models[family], 4, 2, (*FA4, *((control,) if control else ())))
    reference = reference_step(sliding_models[family], samples, LR)
    if control:
        err, name = worst_relative_error(result["grads"], reference[1])
        assert err > 1e-2, (control, err, name)
        return
    loss_error, grad_error = assert_step_matches(result, *reference)
    print(f"{family}: loss rel err {loss_error:.1e}, worst grad rel err {grad_error:.1e}")


def test_layers_with_different_head_counts_are_refused_in_one_line():
    """Laguna's `num_attention_heads_per_layer` with two counts is refused, naming them; one count loads."""
    from ulysses_train.config import ConfigError
    from ulysses_train.model.loading import check_supported_architecture

    check_supported_architecture(tiny_family_config("laguna", **SLIDING_FAMILIES["laguna"]))
    mixed = tiny_family_config("laguna", **SLIDING_FAMILIES["laguna"], num_attention_heads_per_layer=[4, 8])
    with pytest.raises(ConfigError, match=r"different query head counts \(num_attention_heads_per_layer: \[4, 8\]\)"):
        check_supported_architecture(mixed)


def test_llama4_packed_documents_equal_each_document_run_alone(tmp_path, sliding_models):
    """Llama 4's text model on packed documents (1 to 24 tokens in 48, 1-token documents on slice edges) at
    sp=2 x dp=2 with the levers equals each document run alone: its chunks are counted from each document's start
    (fa4.chunk_bounds) and its query temperature reads each document's own positions (attention.PositionsAsCache),
    as the document alone has them. Control: the tuning's positions read off the slice differ."""
    from test_indexed_attention import document_sequences
    from test_mamba2_families import EDGE_DOCUMENTS
    from test_packed_step import packed_samples, packed_step

    model_dir = sliding_models["llama4_text"]
    samples = packed_samples(EDGE_DOCUMENTS, seed=5, labelled=0.7)
    documents = [{"input_ids": ids, "labels": labels} for ids, labels in document_sequences(samples)]
    reference = reference_step(model_dir, documents, LR)
    result = packed_step(tmp_path, model_dir, 4, 2, samples, levers=True, extra=FA4)
    loss_error, grad_error = assert_step_matches(result, *reference)
    print(f"llama4_text packed: loss rel err {loss_error:.1e}, worst grad rel err {grad_error:.1e}")
    control = packed_step(tmp_path, model_dir, 4, 2, samples, extra=(*FA4, "--positions-of-the-slice-for-tuning"))
    assert worst_relative_error(control["grads"], reference[1])[0] > 1e-3


def test_chunked_layers_under_sp_need_the_kernel_that_takes_their_chunks():
    """Under Ulysses transformers' chunked mask is dropped, so Llama 4 with SDPA at sp=2 is refused in one line naming
    the chunks and the fix (fa4); fa4 passes (the control), as does SDPA at sp=1 with a small mask."""
    from ulysses_train.config import ConfigError
    from ulysses_train.model.attention_checks import check_window_attention
    from ulysses_train.model.loading import check_supported_architecture

    llama4 = tiny_family_config("llama4_text", **SLIDING_FAMILIES["llama4_text"])
    check_supported_architecture(llama4)
    check_window_attention(llama4, "fa4", "fa4", sp=2, seq_length=4096)
    check_window_attention(llama4, "sdpa", "sdpa", sp=1, seq_length=4096)
    with pytest.raises(ConfigError, match=r"chunked attention layers \(chunks of 8\).*masks are dropped.*Fix: "
                                          r"model.attn_implementation fa4"):
        check_window_attention(llama4, "sdpa", "sdpa", sp=2, seq_length=4096)
