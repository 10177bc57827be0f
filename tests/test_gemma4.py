"""Gemma 4's text model through the core exactness test: one step on gloo processes equals the plain single-process
Hugging Face model (loss, every gradient, the parameters after SGD).

Gemma 4 sets attributes per layer (transformers' `per_layer_config`): its global (full-attention) layers have their
own head width (twice the sliding layers') and their own KV head count, with keys equal to values
(`attention_k_eq_v`: no v projection), while its sliding layers attend within a window; the head soft-caps the
logits; the small releases add per-layer input embeddings and let their last layers reuse an earlier layer's keys
and values (`num_kv_shared_layers`); the 26B-A4B release adds experts beside each layer's MLP. Under sp every
attention layer is exchanged by its own all-to-all (mixers/attention_exchange.py: DeepSpeed's wrapper takes one head
width), its one global KV head repeated in place to every rank. Windows need FlashAttention 4's kernel (on CPU its
fp32 reference). Negative controls: the attention within each rank's slice, and KV heads tiled over the ranks
instead of repeated in place (a rank's query heads then read another group's KV head): each differs."""
import pytest
from helpers import assert_step_matches, reference_step, save_tiny_model, tiny_family_config, worst_relative_error
from test_mamba2_families import EDGE_DOCUMENTS
from test_model_families import LEVERS, LR, family_step, uneven_samples
from test_packed_step import packed_samples, packed_step, reference_by_document

GEMMA4_31B = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8, head_dim=16,
                  global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                  final_logit_softcapping=30.0, hidden_size_per_layer_input=0)
"""The 31B's layout: sliding layers of 16-wide heads (2 KV heads) and a global layer of 32-wide heads with one KV head
whose keys are its values; the soft-capped head."""
GEMMA4_E4B = dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=8,
                  head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                  final_logit_softcapping=30.0, hidden_size_per_layer_input=8, vocab_size_per_layer_input=256,
                  num_kv_shared_layers=2, use_double_wide_mlp=True, enable_moe_block=True, num_experts=4,
                  top_k_experts=2, moe_intermediate_size=32)
"""The small releases' extras in one model: per-layer input embeddings, the last two layers reading the first two's
keys and values (with double-wide MLPs), and the 26B-A4B's experts beside every MLP."""
GEMMA4_FAMILIES = {"gemma4_text": GEMMA4_31B, "gemma4_text-e4b": GEMMA4_E4B}
"""Keyed by model type (the variant after the dash): the family records' walk reads the type."""
FA4 = ("--set", "model.attn_implementation=fa4")


@pytest.fixture(scope="module")
def gemma4_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4")
    return {name: save_tiny_model(str(root / name), config=tiny_family_config("gemma4_text", **shape))
            for name, shape in GEMMA4_FAMILIES.items()}


@pytest.mark.parametrize("variant,nproc,sp,levers", [("gemma4_text", 2, 2, True), ("gemma4_text", 4, 4, False),
                                                     ("gemma4_text", 4, 2, False), ("gemma4_text-e4b", 4, 4, True)],
                         ids=["31b-sp2-levers", "31b-sp4-uneven", "31b-sp2xdp2", "e4b-sp4-uneven-levers"])
def test_gemma4_step_equals_single_process(tmp_path, gemma4_models, variant, nproc, sp, levers):
    samples, result = family_step(tmp_path, gemma4_models[variant], nproc, sp, (*FA4, *(LEVERS if levers else ())),
                                  offload=levers, samples=uneven_samples(nproc // sp))
    loss_error, grad_error = assert_step_matches(result, *reference_step(gemma4_models[variant], samples, LR))
    print(f"{variant} sp={sp} x dp={nproc // sp}{' levers' if levers else ''}: loss rel err {loss_error:.1e}, "
          f"worst grad rel err {grad_error:.1e}")


def test_packed_gemma4_step_equals_each_document_run_alone(tmp_path, gemma4_models):
    samples = packed_samples(EDGE_DOCUMENTS, seed=5, labelled=0.7)
    result = packed_step(tmp_path, gemma4_models["gemma4_text"], 4, 4, samples, levers=True, extra=FA4)
    loss_error, grad_error = assert_step_matches(result, *reference_by_document(gemma4_models["gemma4_text"], samples))
    print(f"gemma4_text packed sp=4: loss rel err {loss_error:.1e}, worst grad rel err {grad_error:.1e}")


@pytest.mark.parametrize("control", ["--own-exchange-on-local-slice", "--kv-heads-tiled"])
def test_negative_controls_gemma4_differs(tmp_path, gemma4_models, control):
    """sp=4: the sliding layers' 2 KV heads and the global layer's 1 are each repeated to the 4 ranks."""
    model_dir = gemma4_models["gemma4_text"]
    samples, result = family_step(tmp_path, model_dir, 4, 4, (*FA4, control), samples=uneven_samples(1))
    loss, grads, _, _ = reference_step(model_dir, samples, LR)
    err, name = worst_relative_error(result["grads"], grads)
    print(f"gemma4 {control}: loss {result['loss']:.6f} vs {loss:.6f}, worst grad rel err {err:.2e} ({name})")
    assert err > 1e-3, (control, err, name)


def test_gemma4_image_text_checkpoint_trains_its_text_model(tmp_path):
    """A hub-layout Gemma 4 checkpoint (`Gemma4ForConditionalGeneration`: a vision tower beside the language model
    under `model.language_model.`), whose causal-LM class in transformers is the image-text model: it trains as its
    text model (`Gemma4ForCausalLM`), no vision tensor trains, and sp=2 equals a plain `Gemma4ForCausalLM` holding the
    image-text model's language-model tensors (copied by name, saved as a text-model folder for the reference). The
    loaded text model saves under the text model's names (what the export writes). Control: the reference holds
    another seed's weights and the check fails."""
    from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration

    from helpers import TINY_SHAPE, make_samples
    from safetensors import safe_open
    from safetensors.torch import load_file

    from ulysses_train.config import ModelConfig
    from ulysses_train.model.loading import build_causal_lm, load_model_config

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, patch_size=4)
    config = Gemma4Config(text_config={**TINY_SHAPE, **GEMMA4_31B}, vision_config=vision, audio_config=None)
    image_text = save_tiny_model(str(tmp_path / "image_text"), config=config,
                                 model_class=Gemma4ForConditionalGeneration)
    language = Gemma4ForConditionalGeneration.from_pretrained(image_text).model.language_model.state_dict()
    text_model = Gemma4ForCausalLM(config.get_text_config())
    text_model.model.load_state_dict(language)
    text_model.tie_weights()
    text_model.save_pretrained(str(tmp_path / "text"))
    model_cfg = ModelConfig(name_or_path=image_text, dtype="float32")
    loaded, _ = build_causal_lm(load_model_config(model_cfg), model_cfg, "sdpa", None)
    loaded.save_pretrained(str(tmp_path / "exported"))
    with safe_open(str(tmp_path / "exported" / "model.safetensors"), framework="pt") as saved:
        assert sorted(saved.keys()) == sorted(load_file(str(tmp_path / "text" / "model.safetensors")))
    samples, result = family_step(tmp_path, image_text, 2, 2, FA4, samples=make_samples(1, 100, vocab=256))
    assert result["grads"] and not any("vision" in name for name in result["grads"])
    loss_error, grad_error = assert_step_matches(result, *reference_step(str(tmp_path / "text"), samples, LR))
    other = save_tiny_model(str(tmp_path / "other"), seed=1, config=config.get_text_config(),
                            model_class=Gemma4ForCausalLM)
    with pytest.raises(AssertionError):  # the control: the check tells these weights from others
        assert_step_matches(result, *reference_step(other, samples, LR))
    print(f"gemma4 image-text checkpoint sp=2: loss rel err {loss_error:.1e}, worst grad rel err {grad_error:.1e}")
