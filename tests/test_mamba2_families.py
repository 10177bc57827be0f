"""The Mamba2 hybrids through the core exactness test (model/mixers/mamba2.py): one step on gloo processes equals the
plain single-process Hugging Face model (loss, every gradient, the parameters after SGD).

Nemotron-H (helpers NEMOTRON_H) and Bamba (the same mixer, RoPE attention, gated MLPs): a Mamba2 layer (8 heads in 2 groups: sp=2 splits the groups, sp=4 repeats each to
the two ranks whose heads read it), a MoE layer (sigmoid top-2 router with its correction bias, a shared expert,
routed scaling, relu² experts), a full-attention layer without positions and a relu² MLP layer (the two layer
kinds without a token mixer). Sequences of 200 and 181 tokens (sp=4: slices of 50 and 46 with padding, the conv's
history and the SSD state cross every slice edge; chunk 16, so the scan spans many chunks). Packed documents,
1-token documents on slice edges among them, restart the conv and the state. Negative controls: the layer on each
rank's slice only, the conv or the state running across documents, groups tiled over the ranks instead of repeated
in place (a rank reading another head's group): each differs from the reference."""
import pytest
from helpers import (NEMOTRON_H, assert_step_matches, make_samples, reference_step, save_tiny_model,
                     tiny_family_config, worst_relative_error)
from test_model_families import LEVERS, LR, family_step, uneven_samples
from test_packed_step import packed_samples, packed_step, reference_by_document

BAMBA = dict(attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8,
             mamba_chunk_size=16)
"""A tiny Bamba: a Mamba2 layer (8 heads of 16, 2 groups) and an attention layer with RoPE, a gated MLP each: the
same mixer module as Nemotron-H's, nothing of its own."""
GRANITE_4_H = dict(layer_types=["linear_attention", "full_attention"], mamba_n_heads=8, mamba_d_head=16,
                   mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=16, num_local_experts=4, num_experts_per_tok=2,
                   intermediate_size=32, shared_intermediate_size=32, position_embedding_type="nope",
                   output_router_logits=True, router_aux_loss_coef=0.5, logits_scaling=4.0, embedding_multiplier=2.0,
                   residual_multiplier=0.5, attention_multiplier=0.2)
"""A tiny Granite 4.0-H: a Mamba2 layer with ONE group (every sp > 1 repeats its B and C to all ranks) and a NoPE
attention layer, each with experts (the router's load-balancing loss on) beside a shared MLP, logits divided by
logits_scaling, its embedding, attention and residual multipliers."""
NEMOTRON_3_SUPER = {**NEMOTRON_H, "moe_latent_size": 16}
"""Nemotron 3 Super's latent mixture of experts: each token projected to a 16-wide latent before its experts and back
after (`moe_latent_size`), the shared expert at full width."""
MAMBA2_FAMILIES = {"nemotron_h": NEMOTRON_H, "bamba": BAMBA, "granitemoehybrid": GRANITE_4_H,
                   "nemotron_h-super": NEMOTRON_3_SUPER}
"""Keyed by model type (a variant after the dash: the family records' walk reads the type)."""
EDGE_DOCUMENTS = ([12, 1, 11, 24], [11, 1, 12, 1, 23])
"""Packed into 48 tokens: sp=4 slices of 12, so 1-token documents sit first in a slice (12, 24) and last (11)."""


@pytest.fixture(scope="module")
def mamba2_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("mamba2")
    return {family: save_tiny_model(str(root / family), config=tiny_family_config(family.split("-")[0], **shape))
            for family, shape in MAMBA2_FAMILIES.items()}


@pytest.mark.parametrize("family,nproc,sp,levers", [("nemotron_h", 2, 2, True), ("nemotron_h", 4, 4, False),
                                                    ("nemotron_h", 4, 2, False), ("bamba", 4, 4, True),
                                                    ("granitemoehybrid", 2, 2, True),
                                                    ("granitemoehybrid", 4, 4, False),
                                                    ("granitemoehybrid", 4, 2, False), ("nemotron_h-super", 4, 4, True)],
                         ids=["nemotron_h-sp2-levers", "nemotron_h-sp4-uneven", "nemotron_h-sp2xdp2",
                              "bamba-sp4-levers", "granite-sp2-levers", "granite-sp4-uneven", "granite-sp2xdp2",
                              "nemotron_3_super-sp4-uneven-levers"])
def test_mamba2_step_equals_single_process(tmp_path, mamba2_models, family, nproc, sp, levers):
    samples, result = family_step(tmp_path, mamba2_models[family], nproc, sp, LEVERS if levers else (),
                                  offload=levers, samples=uneven_samples(nproc // sp))
    reference = reference_step(mamba2_models[family], samples, LR, router_loss=family == "granitemoehybrid")
    loss_error, grad_error = assert_step_matches(result, *reference)
    print(f"{family} sp={sp} x dp={nproc // sp}{' levers' if levers else ''}: loss rel err {loss_error:.1e}, "
          f"worst grad rel err {grad_error:.1e}")


def edge_samples() -> list[dict]:
    return packed_samples(EDGE_DOCUMENTS, seed=5, labelled=0.7)


@pytest.fixture(scope="module")
def packed_reference(mamba2_models):
    return {family: reference_by_document(mamba2_models[family], edge_samples())
            for family in ("nemotron_h", "granitemoehybrid")}


@pytest.mark.parametrize("family,nproc,sp,levers", [("nemotron_h", 4, 4, True), ("nemotron_h", 4, 2, False),
                                                    ("granitemoehybrid", 4, 4, True)],
                         ids=["nemotron_h-sp4-levers", "nemotron_h-sp2xdp2", "granite-sp4-levers"])
def test_packed_mamba2_step_equals_each_document_run_alone(tmp_path, mamba2_models, packed_reference, family, nproc,
                                                           sp, levers):
    # the router loss over packed rows is checked for Qwen3-MoE (test_packed_step.py); here the documents' restarts
    no_router_loss = ["--set", "model.config_overrides.output_router_logits=false"] if family == "granitemoehybrid" else []
    result = packed_step(tmp_path, mamba2_models[family], nproc, sp, edge_samples(), levers=levers,
                         extra=no_router_loss)
    loss_error, grad_error = assert_step_matches(result, *packed_reference[family])
    print(f"{family} packed sp={sp}: loss rel err {loss_error:.1e}, worst grad rel err {grad_error:.1e}")


@pytest.mark.parametrize("control,nproc,sp", [("--linear-on-local-slice", 2, 2), ("--mamba-groups-tiled", 4, 4),
                                              ("--conv-across-documents", 2, 2),
                                              ("--mamba-state-across-documents", 2, 2)])
def test_negative_controls_mamba2_differs(tmp_path, mamba2_models, packed_reference, control, nproc, sp):
    """Each control breaks one thing the Mamba2 layer must do under Ulysses; the step then differs from the plain
    model's (the packed ones from the per-document reference)."""
    model_dir = mamba2_models["nemotron_h"]
    if "documents" in control:
        result = packed_step(tmp_path, model_dir, nproc, sp, edge_samples(), extra=[control])
        reference_grads = packed_reference["nemotron_h"][1]
    else:
        samples, result = family_step(tmp_path, model_dir, nproc, sp, (control,),
                                      samples=make_samples(nproc // sp, 100, vocab=256, masked_prefix=12))
        reference_grads = reference_step(model_dir, samples, LR)[1]
    err, name = worst_relative_error(result["grads"], reference_grads)
    print(f"{control}: worst grad rel err {err:.2e} ({name})")
    assert err > 1e-3, (control, err, name)
