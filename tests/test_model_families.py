"""Model families beyond Qwen3 through the core exactness test: one step on gloo processes (sp, sp x dp) equals
the plain single-process Hugging Face model (loss, every gradient, parameters after SGD). Cohere scales its
logits by `logit_scale` and Granite divides them by `logits_scaling` in their heads; the fused loss applies
the same (model/loss.py). Qwen3-MoE: 4 experts, top-2, every layer sparse, its router's
load-balancing loss on (model/router_balance.py: summed over the sp group, each sequence weighted by its tokens,
sequences of two lengths, one padded for sp), experts tiled over the sequence with the levers. Gemma 3 (text): a
sliding-window layer (window 6, shorter than every sp slice, so windows cross slice boundaries) and a full one, each
with its own RoPE, logits soft-capped; its windows reach FlashAttention 4's op (its CPU reference here) after the
Ulysses all-to-all. GPT-OSS: alternating windowed and full layers, learnable attention sinks (each sp rank takes its
own heads' sinks), a mixture of experts with its router loss, attention biases; the reference is its own eager
attention. Checkpoints that do not match the model are refused before training; every preset builds. The linear
hybrids (Qwen3.5, Qwen3-Next, OLMo-hybrid, Kimi Linear): test_linear_hybrids.py. Negative controls: the same step
with the logit transform dropped, with the windows ignored, with every rank taking the first heads' sinks, with
router counts of each rank's own tokens, differs."""
import os

import pytest
import torch
from helpers import (GATED_DELTANET, TINY_SHAPE, assert_step_matches, make_samples, reference_step, run_workers,
                     save_tiny_model, tiny_family_config, worst_relative_error, write_ds_config)

LR = 0.1
FAMILIES = {
    "cohere": dict(logit_scale=0.25, use_qk_norm=False),
    "granite": dict(logits_scaling=4.0, embedding_multiplier=2.0, residual_multiplier=0.5,
                    attention_multiplier=0.2, tie_word_embeddings=False),
}
"""Families whose head scales the logits (the family records of ulysses_train/families.py name this table); the
attention-only families without such a scale: test_attention_families.py."""
QWEN3_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16, norm_topk_prob=True,
                 output_router_logits=True, router_aux_loss_coef=0.5)
"""A tiny Qwen3-MoE whose loss includes the router's load-balancing term (a large coefficient, so a wrong term
shows in every gradient)."""
MIXTRAL = dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.5)
GRANITEMOE = dict(MIXTRAL, logits_scaling=4.0, embedding_multiplier=2.0, residual_multiplier=0.5,
                  attention_multiplier=0.2)
MOE_FAMILIES = {"qwen3_moe": QWEN3_MOE, "mixtral": MIXTRAL, "granitemoe": GRANITEMOE}
"""The families whose router's load-balancing loss the package reproduces beside GPT-OSS's (their records name this
table): Qwen3-MoE through every layout below, Mixtral and GraniteMoE (its head divides by `logits_scaling`) at
sp=2 x dp=2 with the levers."""


WINDOWED = dict(head_dim=16, sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                query_pre_attn_scalar=16, final_logit_softcapping=5.0)
"""A tiny Gemma 3: one windowed layer, one full, a soft-capped head (the reference is transformers' own
sliding-window mask through SDPA)."""
SINKS = dict(head_dim=16, sliding_window=6, layer_types=["sliding_attention", "full_attention"],
             num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, output_router_logits=True,
             router_aux_loss_coef=0.5)
"""A tiny GPT-OSS with its router loss (its reference: transformers' eager attention, which has the sinks)."""
EXAONE4 = dict(head_dim=16, sliding_window=6, layer_types=["sliding_attention", "full_attention"])
"""A tiny EXAONE 4: a windowed layer with RoPE, then a global layer without (EXAONE 4 rotates only its windowed
layers), both with q and k norms."""
WINDOWED_FAMILIES = {"gemma3_text": (WINDOWED, "sdpa"), "gpt_oss": (SINKS, "eager"), "exaone4": (EXAONE4, "sdpa")}
LEVERS = ("--set", "model.keep_attention_fraction=0.5", "--set", "model.tiled_mlp=true")
"""With activation offload (the DeepSpeed JSON); TiledMLP tiles dense MLPs and mixture-of-experts blocks."""


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


def family_step(tmp_path, model_dir, nproc, sp, extra=(), offload=False, samples=None):
    samples = samples or make_samples(nproc // sp, 30, vocab=256, masked_prefix=12)
    data, out = str(tmp_path / "data.pt"), str(tmp_path / "out.pt")
    torch.save(samples, data)
    ds = write_ds_config(str(tmp_path / "ds.json"), offload_activations=offload)
    run_workers(nproc, ["--model-dir", model_dir, "--data", data, "--ds-config", ds, "--out", out,
                        "--set", f"parallel.sequence_parallel_size={sp}", "--lr", str(LR), *extra])
    return samples, torch.load(out)


LAYOUTS = {"sp2": (2, 2, ()), "sp2xdp2": (4, 2, ()), "sp2-full-logits": (2, 2, ("--set", "loss.type=nll"))}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_family_step_equals_single_process(tmp_path, family_models, family, layout):
    nproc, sp, extra = LAYOUTS[layout]
    samples, result = family_step(tmp_path, family_models[family], nproc, sp, extra)
    loss_error, grad_error = assert_step_matches(result, *reference_step(family_models[family], samples, LR))
    print(f"{family}: loss rel err {loss_error:.1e}, worst grad rel err {grad_error:.1e}")


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {routed: save_tiny_model(str(root / str(routed)),
                                    config=tiny_family_config("qwen3_moe", **{**QWEN3_MOE,
                                                                              "output_router_logits": routed}))
            for routed in (True, False)}


def uneven_samples(count: int) -> list[dict]:
    """`count` sequences of 200 and 181 tokens in turn: 2 MLP tiles per sp=2 slice (hidden 64), sp padding on
    the odd ones, and sequences whose router losses weigh differently in the step."""
    samples = make_samples(count, 200, vocab=256, masked_prefix=12)
    for sample in samples[1::2]:
        sample["input_ids"], sample["labels"] = sample["input_ids"][:, :181], sample["labels"][:, :181]
    return samples


@pytest.mark.parametrize("nproc,sp,micro,levers,routed", [(2, 2, 2, True, True), (4, 4, 1, False, True),
                                                         (4, 2, 1, False, True), (2, 2, 1, True, False)],
                         ids=["sp2-levers-micro2", "sp4", "sp2xdp2", "sp2-levers-no-router-loss"])
def test_mixture_of_experts_step_equals_single_process(tmp_path, moe_models, nproc, sp, micro, levers, routed):
    """Qwen3-MoE (4 experts, top-2): experts tiled over the sequence, the router's load-balancing loss over the
    whole sequence (model/router_balance.py), against the plain model's own loss + coef x aux_loss."""
    extra = ("--set", f"train.gradient_accumulation_steps={micro}", *(LEVERS if levers else ()))
    samples, result = family_step(tmp_path, moe_models[routed], nproc, sp, extra, offload=levers,
                                  samples=uneven_samples(nproc // sp * micro))
    loss_error, grad_error = assert_step_matches(result, *reference_step(moe_models[routed], samples, LR,
                                                                         router_loss=routed))
    print(f"qwen3_moe sp={sp} x dp={nproc // sp}, {micro} micro-steps{' levers' if levers else ''}: loss rel err "
          f"{loss_error:.1e}, worst grad rel err {grad_error:.1e}")


@pytest.mark.parametrize("family", ["mixtral", "granitemoe"])
def test_router_loss_family_step_equals_single_process(tmp_path, family):
    """Mixtral and GraniteMoE with their router's load-balancing loss, at sp=2 x dp=2 with the levers (experts
    tiled), against the plain model's loss + coef x aux_loss."""
    model_dir = save_tiny_model(str(tmp_path / family), config=tiny_family_config(family, **MOE_FAMILIES[family]))
    samples, result = family_step(tmp_path, model_dir, 4, 2, LEVERS, offload=True, samples=uneven_samples(2))
    loss_error, grad_error = assert_step_matches(result, *reference_step(model_dir, samples, LR, router_loss=True))
    print(f"{family} sp=2 x dp=2 levers, router loss: loss rel err {loss_error:.1e}, worst grad rel err "
          f"{grad_error:.1e}")


def test_negative_control_router_counts_of_one_rank_differ(tmp_path, moe_models):
    """The check above catches a router loss computed from each rank's own tokens (not summed over the sp
    group): loss and router gradients are off."""
    samples, result = family_step(tmp_path, moe_models[True], 2, 2, ("--router-stats-of-this-rank",),
                                  samples=uneven_samples(1))
    loss, grads, _, _ = reference_step(moe_models[True], samples, LR, router_loss=True)
    err, name = worst_relative_error(result["grads"], grads)
    print(f"router counts of one rank: loss {result['loss']:.6f} vs {loss:.6f}, worst grad rel err {err:.2e} ({name})")
    assert err > 1e-3, (err, name)


def test_a_router_loss_of_an_unchecked_family_is_refused():
    from ulysses_train.config import ConfigError
    from ulysses_train.model.loading import check_supported_architecture

    with pytest.raises(ConfigError, match="output_router_logits.*qwen3_moe, gpt_oss, qwen3_5_moe_text, qwen3_next"):
        check_supported_architecture(tiny_family_config("hy_v3", num_experts=4, output_router_logits=True))
    check_supported_architecture(tiny_family_config("qwen3_moe", **QWEN3_MOE))
    check_supported_architecture(tiny_family_config("hy_v3", num_experts=4))  # no router loss asked: fine


def test_negative_control_without_the_logit_scale_the_step_differs(tmp_path, family_models, monkeypatch):
    """The check above catches a loss that ignores the head's scale: with the transform dropped (what the loss
    did before it knew Cohere's logit_scale), loss and gradients are off."""
    samples, result = family_step(tmp_path, family_models["cohere"], 2, 2, ("--no-logit-transform",))
    loss, grads, _, _ = reference_step(family_models["cohere"], samples, LR)
    err, _ = worst_relative_error(result["grads"], grads)
    assert abs(result["loss"] - loss) / loss > 1e-3 and err > 1e-2


@pytest.mark.parametrize("family", sorted(WINDOWED_FAMILIES))
@pytest.mark.parametrize("nproc,sp,levers,chunks", [(2, 2, True, 1), (4, 4, False, 1), (4, 2, False, 2)],
                         ids=["sp2-levers", "sp4", "sp2xdp2-head-chunks"])
def test_sliding_window_family_step_equals_single_process(tmp_path, windowed_models, family, nproc, sp, levers,
                                                          chunks):
    """At sp=2 x dp=2 in 2 head chunks (model/mixers/head_chunks.py): one query head of each rank's two at a time,
    with its window and (GPT-OSS) its sinks."""
    extra = ("--set", "model.attn_implementation=fa4", *(LEVERS if levers else ()),
             "--set", f"model.attention_head_chunks={chunks}")
    samples, result = family_step(tmp_path, windowed_models[family], nproc, sp, extra, offload=levers)
    reference = reference_step(windowed_models[family], samples, LR, attn=WINDOWED_FAMILIES[family][1],
                               router_loss=family == "gpt_oss")
    loss_error, grad_error = assert_step_matches(result, *reference)
    print(f"{family} sp={sp} x dp={nproc // sp}{' levers' if levers else ''} in {chunks} head chunk(s): loss rel err "
          f"{loss_error:.1e}, worst grad rel err {grad_error:.1e}")


@pytest.mark.parametrize("family,control", [("gemma3_text", "--no-window"), ("gpt_oss", "--no-window"),
                                            ("gpt_oss", "--sinks-of-rank-0"), ("exaone4", "--no-window")])
def test_negative_controls_windows_ignored_or_sinks_of_the_wrong_heads_differ(tmp_path, windowed_models, family,
                                                                                control):
    samples, result = family_step(tmp_path, windowed_models[family], 2, 2,
                                  ("--set", "model.attn_implementation=fa4", control))
    loss, grads, _, _ = reference_step(windowed_models[family], samples, LR, attn=WINDOWED_FAMILIES[family][1],
                                       router_loss=family == "gpt_oss")
    err, name = worst_relative_error(result["grads"], grads)
    print(f"{family} {control}: worst grad rel err {err:.2e} ({name})")
    assert err > 1e-2, (control, err, name)


def test_windowed_models_need_a_kernel_that_takes_the_window_and_other_layer_types_are_named():
    from ulysses_train.config import ConfigError
    from ulysses_train.model.attention_checks import check_window_attention
    from ulysses_train.model.loading import check_supported_architecture

    config = tiny_family_config("gemma3_text", **WINDOWED)
    check_supported_architecture(config)
    check_window_attention(config, "fa4", "fa4", sp=2, seq_length=65536)
    for attn, requested, match in (("sdpa", "sdpa", "window 6.*masks are dropped"), ("sdpa", "auto", "auto chose")):
        with pytest.raises(ConfigError, match=match):
            check_window_attention(config, attn, requested, sp=2, seq_length=4096)
    # at sp=1 transformers' own window mask is exact: SDPA allowed while that seq x seq mask is small
    check_window_attention(config, "sdpa", "sdpa", sp=1, seq_length=32768)
    with pytest.raises(ConfigError, match=r"seq x seq mask, 4 GiB at 65,536 tokens \(allowed up to 32,768 tokens\)"):
        check_window_attention(config, "sdpa", "sdpa", sp=1, seq_length=65536)
    check_window_attention(tiny_family_config("cohere", **FAMILIES["cohere"]), "sdpa", "sdpa", sp=2,
                           seq_length=65536)  # no windows: fine
    chunked = tiny_family_config("gemma3_text", **{**WINDOWED, "layer_types": ["chunked_attention", "full_attention"]})
    with pytest.raises(ConfigError, match="chunked_attention layers but no attention_chunk_size"):
        check_supported_architecture(chunked)  # a chunk size only Llama 4's config carries
    with pytest.raises(ConfigError, match="attn_logit_softcapping"):
        check_supported_architecture(tiny_family_config("gemma3_text", **WINDOWED, attn_logit_softcapping=50.0))


def copy_with_renamed_weights(source: str, target: str, rename) -> str:
    """`source`'s model folder copied to `target` with each tensor name passed through `rename` (None drops it)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    weights = load_file(f"{target}/model.safetensors")
    renamed = {rename(name): tensor for name, tensor in weights.items() if rename(name) is not None}
    save_file(renamed, f"{target}/model.safetensors", metadata={"format": "pt"})
    return target


@pytest.fixture(scope="module")
def mismatched_checkpoints(tmp_path_factory, bpe_tokenizer):
    """A tiny Qwen3 with one tensor renamed and one with a tensor removed; a MiniMax-M2 with one expert's tensor of
    another shape; a hub-layout Qwen3.5 image-text
    checkpoint whose language model sits under `model.text_backbone.` instead of `model.language_model.`; the
    corpus and tokenizer to train them on."""
    from transformers import AutoConfig, Qwen3_5Config, Qwen3_5ForConditionalGeneration

    root = tmp_path_factory.mktemp("mismatched")
    vocab = len(bpe_tokenizer)
    qwen3 = save_tiny_model(str(root / "qwen3"), vocab_size=vocab)
    image_text = save_tiny_model(str(root / "image_text"), model_class=Qwen3_5ForConditionalGeneration,
                                 config=Qwen3_5Config(text_config={**TINY_SHAPE, **GATED_DELTANET, "vocab_size": vocab},
                                                      vision_config=dict(depth=1, hidden_size=32, num_heads=2,
                                                                         out_hidden_size=64)))
    bpe_tokenizer.save_pretrained(str(root / "tokenizer"))
    (root / "corpus.txt").write_text(" ".join(f"word{i % 97}" for i in range(3000)))
    minimax = save_tiny_model(str(root / "minimax"), config=AutoConfig.for_model(  # stored per expert, as released
        "minimax_m2", **{**TINY_SHAPE, "intermediate_size": 32, "vocab_size": vocab}, num_local_experts=4,
        num_experts_per_tok=2, head_dim=16, rotary_dim=8, bos_token_id=0, eos_token_id=1))
    return {"renamed": copy_with_renamed_weights(qwen3, str(root / "renamed"),
                                                 lambda n: n.replace("layers.1.mlp.up_proj", "layers.1.mlp.upper")),
            "removed": copy_with_renamed_weights(qwen3, str(root / "removed"),
                                                 lambda n: None if "layers.0.self_attn.q_norm" in n else n),
            "prefix": copy_with_renamed_weights(image_text, str(root / "prefix"),
                                                lambda n: n.replace("model.language_model.", "model.text_backbone.")),
            "fused": copy_with_reshaped_tensor(minimax, str(root / "fused"),
                                               "model.layers.1.block_sparse_moe.experts.2.w1.weight"),
            "data": [f"data.source={root / 'corpus.txt'}", f"data.tokenizer={root / 'tokenizer'}"], "qwen3": qwen3}


MISMATCHES = {
    "renamed": ["1 of the model's tensors are missing from the checkpoint", "model.layers.1.mlp.up_proj.weight",
                "1 of the checkpoint's tensors are not used by the model", "model.layers.1.mlp.upper.weight"],
    "removed": ["1 of the model's tensors are missing", "model.layers.0.self_attn.q_norm.weight"],
    "prefix": ["the checkpoint's language model is not under model.language_model",
               "its tensors are under lm_head.weight, model.text_backbone, model.visual", "model.embed_tokens.weight"],
    "fused": ["the checkpoint tensor model.layers.1.block_sparse_moe.experts.2.w1.weight is [48, 64]",
              "where the 3 others that make up model.layers.1.mlp.experts.gate_up_proj are [32, 64]"],
}
"""Each mismatched checkpoint and the words its refusal must name (`fused`: one of the per-expert tensors transformers
stacks into one of another shape, which ended in its conversion's traceback)."""


def copy_with_reshaped_tensor(source: str, target: str, name: str) -> str:
    """A copy of the checkpoint whose tensor `name` has half as many rows again."""
    import torch
    from safetensors.torch import load_file, save_file

    copy = copy_with_renamed_weights(source, target, lambda n: n)
    weights = load_file(f"{copy}/model.safetensors")
    rows, columns = weights[name].shape
    weights[name] = torch.zeros(rows + rows // 2, columns)
    save_file(weights, f"{copy}/model.safetensors", metadata={"format": "pt"})
    return copy


@pytest.fixture(scope="module")
def mismatched_runs(mismatched_checkpoints, tmp_path_factory):
    """{case: (CompletedProcess, its output folder)} of scripts/train.py on each mismatched checkpoint, all from one
    launched process (tests/script_cases.py)."""
    from helpers import REPO
    from script_cases import case, run_cases

    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=REPO, HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    cases, folders = [], {}
    for name in MISMATCHES:
        folders[name] = tmp_path_factory.mktemp(f"mismatched_{name}")
        argv = ["--set", f"model.name_or_path={mismatched_checkpoints[name]}", "--set", "model.dtype=float32",
                "--set", "model.attn_implementation=sdpa", "--set", "data.seq_length=64",
                "--set", f"train.output_dir={folders[name] / 'out'}",
                *[f"--set={item}" for item in mismatched_checkpoints["data"]]]
        cases.append(case(name, argv, env, cwd=folders[name]))
    results = run_cases(cases, tmp_path_factory.mktemp("mismatched_cases"), env, at_once=2)
    return {name: (results[name], folders[name]) for name in MISMATCHES}


@pytest.mark.parametrize("name", sorted(MISMATCHES))
def test_a_checkpoint_that_does_not_match_the_model_is_refused_before_training(mismatched_runs, name):
    """Weights loaded = weights trained: a tensor missing from the checkpoint (renamed or removed), or a language
    model under another prefix than its image-text layout's, used to train from random weights with exit 0 (only
    transformers' load report said so, once per rank). Now one line, exit 2, no step taken; ZeRO-3 loads it (where
    transformers reports no unused tensor: they are read from the checkpoint's headers). The matching checkpoints
    of the other tests here load and train (the controls)."""
    proc, folder = mismatched_runs[name]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "LOAD REPORT" not in proc.stderr, proc.stderr[-3000:]
    assert all(word in errors[0] for word in MISMATCHES[name]), errors[0]
    assert not (folder / "out" / "metrics.jsonl").exists()


def test_every_preset_builds_from_its_published_config_fields():
    """Every preset through build_engine (ZeRO-3, one process) with only the fields its release publishes, at test
    size: Qwen3.5-MoE's config has no `intermediate_size`, and the parameter count build_engine makes for ZeRO-3
    (decoder_layer_params) read it, so the preset and a real checkpoint stopped with an AttributeError. Each
    count equals the largest decoder layer of the model transformers builds (on the meta device) and of the
    engine built; at full size too, for the planner's counts."""
    from preset_worker import published_fields, reduced_preset

    from ulysses_train.model.architecture import causal_lm_on_meta, decoder_of
    from ulysses_train.model.presets import FAMILY_PRESETS, QWEN3_SHAPES, preset_config
    from ulysses_train.planner.shapes import load_model_shape
    from ulysses_train.training.resolved_run import decoder_layer_params

    names = [*QWEN3_SHAPES, *FAMILY_PRESETS]
    assert "intermediate_size" not in published_fields("qwen3.5-35b-a3b")  # the case a helper's field used to hide
    largest_layer = lambda config: max(sum(p.numel() for p in layer.parameters())  # noqa: E731
                                       for layer in decoder_of(causal_lm_on_meta(config)).layers)
    built = [line.split() for line in run_workers(1, names, script=f"{os.path.dirname(__file__)}/preset_worker.py",
                                                 timeout=600).stdout.splitlines() if line.startswith("built ")]
    assert [name for _, name, _ in built] == names
    for (_, name, engine_count) in built:
        assert decoder_layer_params(reduced_preset(name)) == largest_layer(reduced_preset(name)) == int(engine_count)
    for name in names:
        assert decoder_layer_params(preset_config(name)) == load_model_shape(name).layer_params, name
    moe = load_model_shape("qwen3.5-35b-a3b")
    assert moe.mlp_width == 8 * 512 + 512  # k routed experts and the shared one per token
    kimi = load_model_shape("kimi-linear-48b-a3b")
    assert kimi.mlp_width == 8 * 1024 + 1024  # its shared expert: num_shared_experts x moe_intermediate_size


def test_allowed_unused_tensors_and_shape_mismatches(mismatched_checkpoints, tmp_path):
    """The allow-list: tensors the model may leave unused (multi-token-prediction heads, a vision tower, stored RoPE
    tables) load; any other unused tensor is refused, as is a tensor of another shape (ZeRO-3's message names the
    first; without ZeRO transformers' report, held back, did)."""
    import torch

    from ulysses_train.config import ConfigError, ModelConfig
    from ulysses_train.model.loading import build_causal_lm, load_model_config
    from ulysses_train.model.weight_check import refuse_mismatched_shapes

    source = mismatched_checkpoints["qwen3"]
    allowed = copy_with_renamed_weights(source, str(tmp_path / "allowed"), lambda n: n)
    extra = {"mtp.fc.weight": torch.ones(2), "model.visual.blocks.0.w": torch.ones(2),
             "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(2)}
    add_tensors(allowed, extra)
    refused = copy_with_renamed_weights(source, str(tmp_path / "refused"), lambda n: n)
    add_tensors(refused, {"model.layers.0.adapter.weight": torch.ones(2)})
    for folder in (allowed, refused):
        model_cfg = ModelConfig(name_or_path=folder, dtype="float32")
        if folder == refused:
            with pytest.raises(ConfigError, match=r"1 of the checkpoint's tensors are not used by the model \(e\.g\. "
                                                  r"model\.layers\.0\.adapter\.weight\)"):
                build_causal_lm(load_model_config(model_cfg), model_cfg, "sdpa", None)
        else:
            build_causal_lm(load_model_config(model_cfg), model_cfg, "sdpa", None)
    zero3 = RuntimeError("Error(s) in loading state_dict for Qwen3ForCausalLM:\n\tsize mismatch for a.weight: copying "
                         "a param with shape torch.Size([100, 64]) from checkpoint, the shape in current model is "
                         "torch.Size([128, 64]).")
    with pytest.raises(ConfigError, match=r"a\.weight is \[100, 64\] in the checkpoint, \[128, 64\] in the model"):
        refuse_mismatched_shapes(zero3, "m")
    refuse_mismatched_shapes(RuntimeError("another fault"), "m")  # not ours: the caller re-raises it


def add_tensors(folder: str, tensors: dict) -> str:
    from safetensors.torch import load_file, save_file

    weights = load_file(f"{folder}/model.safetensors")
    save_file({**weights, **tensors}, f"{folder}/model.safetensors", metadata={"format": "pt"})
    return folder
