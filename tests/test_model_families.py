"""Model families beyond Qwen3 through the core exactness test: one step on gloo processes (sp, sp x dp) equals
the plain single-process Hugging Face model (loss, every gradient, parameters after SGD). Cohere scales its
logits by `logit_scale` and Granite divides them by `logits_scaling` in their heads; the fused loss applies
the same (training/loss.py). Qwen3-MoE: 4 experts, top-2, every layer sparse (its MoE blocks are ZeRO-3 leaf
modules by DeepSpeed's default; TiledMLP leaves them untiled). Gemma 3 (text): a sliding-window layer (window 6,
shorter than every sp slice, so windows cross slice boundaries) and a full one, each with its own RoPE, logits
soft-capped; its windows reach FlashAttention 4's op (its CPU reference here) after the Ulysses all-to-all.
GPT-OSS: alternating windowed and full layers, learnable attention sinks (each sp rank takes its own heads'
sinks), a mixture of experts, attention biases; the reference is its own eager attention.
Negative controls: the same step with the logit transform dropped, with the windows ignored, or with every rank
taking the first heads' sinks, differs."""
import pytest
import torch
from helpers import (assert_step_matches, make_samples, reference_step, run_workers, save_tiny_model,
                     tiny_family_config, worst_relative_error, write_ds_config)

LR = 0.1
FAMILIES = {
    "cohere": dict(logit_scale=0.25, use_qk_norm=False),
    "granite": dict(logits_scaling=4.0, embedding_multiplier=2.0, residual_multiplier=0.5,
                    attention_multiplier=0.2, tie_word_embeddings=False),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16,
                      norm_topk_prob=True),
}


WINDOWED = dict(head_dim=16, sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                query_pre_attn_scalar=16, final_logit_softcapping=5.0)
"""A tiny Gemma 3: one windowed layer, one full, a soft-capped head (the reference is transformers' own
sliding-window mask through SDPA)."""
SINKS = dict(head_dim=16, sliding_window=6, layer_types=["sliding_attention", "full_attention"],
             num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)
"""A tiny GPT-OSS (its reference: transformers' eager attention, which has the sinks)."""
WINDOWED_FAMILIES = {"gemma3_text": (WINDOWED, "sdpa"), "gpt_oss": (SINKS, "eager")}
LEVERS = ("--set", "model.keep_attention_fraction=0.5")
"""With activation offload (the DeepSpeed JSON); TiledMLP too where the MLP is dense (not GPT-OSS's experts)."""


@pytest.fixture(scope="module")
def windowed_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("windowed")
    return {name: save_tiny_model(str(root / name), config=tiny_family_config(name, **shape))
            for name, (shape, _) in WINDOWED_FAMILIES.items()}


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: save_tiny_model(str(root / name), config=tiny_family_config(name, **kw))
            for name, kw in FAMILIES.items()}


def family_step(tmp_path, model_dir, nproc, sp, extra=(), offload=False):
    samples = make_samples(nproc // sp, 30, vocab=256, masked_prefix=12)
    data, out = str(tmp_path / "data.pt"), str(tmp_path / "out.pt")
    torch.save(samples, data)
    ds = write_ds_config(str(tmp_path / "ds.json"), offload_activations=offload)
    run_workers(nproc, ["--model-dir", model_dir, "--data", data, "--ds-config", ds, "--out", out,
                        "--set", f"parallel.sequence_parallel_size={sp}", "--lr", str(LR), *extra])
    return samples, torch.load(out)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("nproc,sp,extra", [(2, 2, ()), (4, 2, ()), (2, 2, ("--set", "loss.type=nll"))],
                         ids=["sp2", "sp2xdp2", "sp2-full-logits"])
def test_family_step_equals_single_process(tmp_path, family_models, family, nproc, sp, extra):
    samples, result = family_step(tmp_path, family_models[family], nproc, sp, extra)
    loss_error, grad_error = assert_step_matches(result, *reference_step(family_models[family], samples, LR))
    print(f"{family}: loss rel err {loss_error:.1e}, worst grad rel err {grad_error:.1e}")


def test_a_router_auxiliary_loss_that_would_be_dropped_is_refused():
    from ulysses_train.config import ConfigError
    from ulysses_train.model.loading import check_supported_architecture

    with pytest.raises(ConfigError, match="output_router_logits"):
        check_supported_architecture(tiny_family_config("qwen3_moe", **FAMILIES["qwen3_moe"],
                                                        output_router_logits=True))
    check_supported_architecture(tiny_family_config("qwen3_moe", **FAMILIES["qwen3_moe"]))  # the default: no aux loss


def test_negative_control_without_the_logit_scale_the_step_differs(tmp_path, family_models, monkeypatch):
    """The check above catches a loss that ignores the head's scale: with the transform dropped (what the loss
    did before it knew Cohere's logit_scale), loss and gradients are off."""
    samples, result = family_step(tmp_path, family_models["cohere"], 2, 2, ("--no-logit-transform",))
    loss, grads, _, _ = reference_step(family_models["cohere"], samples, LR)
    err, _ = worst_relative_error(result["grads"], grads)
    assert abs(result["loss"] - loss) / loss > 1e-3 and err > 1e-2


@pytest.mark.parametrize("family", sorted(WINDOWED_FAMILIES))
@pytest.mark.parametrize("nproc,sp,levers", [(2, 2, True), (4, 4, False), (4, 2, False)],
                         ids=["sp2-levers", "sp4", "sp2xdp2"])
def test_sliding_window_family_step_equals_single_process(tmp_path, windowed_models, family, nproc, sp, levers):
    tiled = ("--set", f"model.tiled_mlp={str(family != 'gpt_oss').lower()}")
    extra = ("--set", "model.attn_implementation=fa4", *((*LEVERS, *tiled) if levers else ()))
    samples, result = family_step(tmp_path, windowed_models[family], nproc, sp, extra, offload=levers)
    reference = reference_step(windowed_models[family], samples, LR, attn=WINDOWED_FAMILIES[family][1])
    loss_error, grad_error = assert_step_matches(result, *reference)
    print(f"{family} sp={sp} x dp={nproc // sp}{' levers' if levers else ''}: loss rel err {loss_error:.1e}, "
          f"worst grad rel err {grad_error:.1e}")


@pytest.mark.parametrize("family,control", [("gemma3_text", "--no-window"), ("gpt_oss", "--no-window"),
                                            ("gpt_oss", "--sinks-of-rank-0")])
def test_negative_controls_windows_ignored_or_sinks_of_the_wrong_heads_differ(tmp_path, windowed_models, family,
                                                                                control):
    samples, result = family_step(tmp_path, windowed_models[family], 2, 2,
                                  ("--set", "model.attn_implementation=fa4", control))
    loss, grads, _, _ = reference_step(windowed_models[family], samples, LR, attn=WINDOWED_FAMILIES[family][1])
    err, name = worst_relative_error(result["grads"], grads)
    print(f"{family} {control}: worst grad rel err {err:.2e} ({name})")
    assert err > 1e-2, (control, err, name)


def test_windowed_models_need_a_kernel_that_takes_the_window_and_other_layer_types_are_named():
    from ulysses_train.config import ConfigError
    from ulysses_train.model.loading import check_supported_architecture, check_window_attention

    config = tiny_family_config("gemma3_text", **WINDOWED)
    check_supported_architecture(config)
    check_window_attention(config, "fa4", "fa4")
    for attn, requested, match in (("sdpa", "sdpa", "window 6.*masks are dropped"), ("sdpa", "auto", "auto chose")):
        with pytest.raises(ConfigError, match=match):
            check_window_attention(config, attn, requested)
    check_window_attention(tiny_family_config("cohere", **FAMILIES["cohere"]), "sdpa", "sdpa")  # no windows: fine
    chunked = tiny_family_config("gemma3_text", **{**WINDOWED, "layer_types": ["chunked_attention", "full_attention"]})
    with pytest.raises(ConfigError, match="chunked_attention"):
        check_supported_architecture(chunked)
    with pytest.raises(ConfigError, match="attn_logit_softcapping"):
        check_supported_architecture(tiny_family_config("gemma3_text", **WINDOWED, attn_logit_softcapping=50.0))
