"""Document packing is exact: one step on 2 and 4 gloo processes over sequences packed from several documents
(boundaries inside and across sp slices, labels on scattered spans only, as for assistant turns) equals a
plain single-process Hugging Face model run on each document separately, its token-weighted losses summed:
loss (< 1e-5), every parameter's gradient (< 1e-4) and the parameters after one SGD step. Attention runs
as the FlashAttention 4 op's variable-length form (its CPU reference kernel here); the reference runs SDPA on
each document alone. Negative control: the same packed sequences without document boundaries.
Qwen3.5 (a Gated DeltaNet layer and a gated attention layer): the conv and the delta rule's state restart at
every document too (model/mixers/gated_deltanet.py), OLMo-hybrid (the same mixer, NoPE attention) and Kimi
Linear's Kimi Delta Attention layer (model/mixers/kimi_delta.py) with its MLA layer, packed, with the levers; the
negative controls keep the recurrences running across documents."""

import functools

import pytest
import torch
from helpers import (KIMI_LINEAR, assert_step_matches, run_workers, save_tiny_model, sgd_reference, summed_nll,
                     tiny_family_config, worst_relative_error, write_ds_config)

LR = 0.1
LENGTH = 48
# sp=2 slices are 24 tokens, sp=4 slices 12: boundaries fall inside slices, a document crosses slice edges,
# one document is a single token (nothing to predict in it)
DOCUMENTS = ([13, 7, 20, 8], [5, 1, 18, 24])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("packed") / "model"), tie_word_embeddings=False)


def packed_samples(documents=DOCUMENTS, seed: int = 3, labelled: float = 0.6) -> list[dict]:
    """Random tokens packed as `documents` (lengths per sequence, each summing to LENGTH); labels on ~`labelled` of
    positions (the rest -100, like a session's non-assistant tokens)."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for lengths in documents:
        ids = torch.randint(0, 256, (1, LENGTH), generator=gen)
        labels = torch.where(torch.rand(1, LENGTH, generator=gen) < labelled, ids, torch.full_like(ids, -100))
        samples.append({"input_ids": ids, "labels": labels, "document_lengths": torch.tensor(lengths)})
    return samples


def reference_by_document(model_dir: str, samples: list[dict]):
    """Independent of ulysses_train: the plain model on every document alone (positions from 0, nothing before
    it), cross-entropy summed over all documents and divided by their label count; gradients; SGD update."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    documents = []
    for sample in samples:
        ends = torch.as_tensor(sample["document_lengths"]).cumsum(0).tolist()
        documents += [(sample["input_ids"][:, start:end], sample["labels"][:, start:end])
                      for start, end in zip([0, *ends[:-1]], ends)]
    return sgd_reference(model, documents, LR)


@pytest.fixture(scope="module")
def reference(model_dir):
    return reference_by_document(model_dir, packed_samples())


def packed_step(tmp_path, model_dir, nproc, sp, samples, levers=False, extra=()):
    dp = nproc // sp
    gas = len(samples) // dp
    data = str(tmp_path / "data.pt")
    torch.save(samples, data)
    # levers: activation offload (from the DeepSpeed JSON), attention kept in 2 of 2 layers, TiledMLP
    ds = write_ds_config(str(tmp_path / "ds.json"), offload_activations=levers)
    levers_on = ["--set", "model.keep_attention_fraction=1.0", "--set", "model.tiled_mlp=true"] if levers else []
    extra = [*extra, *levers_on]
    out = str(tmp_path / "out.pt")
    run_workers(nproc, ["--model-dir", model_dir, "--data", data, "--ds-config", ds, "--out", out, "--lr", str(LR),
                        "--set", f"parallel.sequence_parallel_size={sp}",
                        "--set", f"train.gradient_accumulation_steps={gas}",
                        "--set", "model.attn_implementation=fa4", "--set", "data.packing=documents",
                        "--set", "data.source=samples-passed-in", *extra])  # the worker reads --data
    return torch.load(out)


@pytest.mark.parametrize("nproc,sp,levers", [
    (2, 2, False),   # sp=2: two micro-steps, one per packed sequence
    (4, 4, False),   # sp=4: 12-token slices, KV heads replicated
    (4, 2, False),   # sp=2 x dp=2
    (2, 2, True),    # sp=2 with offload, kept attention and TiledMLP
], ids=["sp2", "sp4", "sp2xdp2", "sp2-levers"])
def test_packed_step_equals_each_document_run_alone(tmp_path, model_dir, reference, nproc, sp, levers):
    result = packed_step(tmp_path, model_dir, nproc, sp, packed_samples(), levers=levers)
    loss_error, grad_error = assert_step_matches(result, *reference)
    print(f"loss rel err {loss_error:.1e}, worst grad rel err {grad_error:.1e}")


def test_negative_control_packed_without_document_boundaries_differs(tmp_path, model_dir, reference):
    """The same packed sequences trained as one causal stream (documents attend to earlier documents, positions
    run on): the gradients must not match the per-document reference."""
    samples = [{k: v for k, v in s.items() if k != "document_lengths"} for s in packed_samples()]
    result = packed_step(tmp_path, model_dir, 2, 2, samples)
    err, _ = worst_relative_error(result["grads"], reference[1])
    print(f"without document boundaries: worst grad rel err {err:.1e}")
    assert err > 1e-2, f"gradients matched without document masking (err {err:.1e}): the test cannot fail"


@pytest.fixture(scope="module")
def linear_hybrid(tmp_path_factory):
    """family -> (its tiny model of tests/helpers.py LINEAR_HYBRIDS, its per-document reference), built
    the first time a test asks for the family."""
    from helpers import LINEAR_HYBRIDS

    shapes = {**LINEAR_HYBRIDS, "kimi_linear": KIMI_LINEAR}
    root = tmp_path_factory.mktemp("packed_linear_hybrids")

    @functools.cache
    def model_and_reference(family: str):
        model_dir = save_tiny_model(str(root / family), config=tiny_family_config(family, **shapes[family]))
        return model_dir, reference_by_document(model_dir, packed_samples())
    return model_and_reference


@pytest.mark.parametrize("family,nproc,sp,levers", [("qwen3_5_text", 2, 2, True), ("qwen3_5_text", 4, 4, False),
                                                    ("olmo_hybrid", 2, 2, True), ("kimi_linear", 4, 4, True)],
                         ids=["sp2-levers", "sp4", "olmo_hybrid-sp2-levers", "kimi_linear-sp4-levers"])
def test_packed_gated_deltanet_step_equals_each_document_run_alone(tmp_path, linear_hybrid, family, nproc, sp,
                                                                   levers):
    model_dir, reference = linear_hybrid(family)
    result = packed_step(tmp_path, model_dir, nproc, sp, packed_samples(), levers=levers)
    loss_error, grad_error = assert_step_matches(result, *reference)
    print(f"{family} packed sp={sp}: loss rel err {loss_error:.1e}, worst grad rel err {grad_error:.1e}")


@pytest.mark.parametrize("family", ["kimi_linear", "qwen3_5_text"])
def test_negative_control_gated_deltanet_not_restarted_at_documents_differs(tmp_path, linear_hybrid, family):
    """Attention kept inside each document, but the conv and the recurrence run on across document boundaries:
    the gradients must not match the per-document reference."""
    model_dir, reference = linear_hybrid(family)
    result = packed_step(tmp_path, model_dir, 2, 2, packed_samples(), extra=["--recurrence-across-documents"])
    err, name = worst_relative_error(result["grads"], reference[1])
    print(f"recurrence across documents: worst grad rel err {err:.1e} ({name})")
    assert err > 1e-2, f"gradients matched without restarting the recurrence (err {err:.1e}): the test cannot fail"


QWEN3_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16, norm_topk_prob=True,
                 output_router_logits=True, router_aux_loss_coef=0.5, tie_word_embeddings=False)
ROUTED_DOCUMENTS = ([13, 7, 20], [5, 1, 18, 24])
"""The first row ends with 8 tokens of packing padding (pad id 0, no labels), the second is full."""


def packed_rows_with_padding() -> list[dict]:
    samples = packed_samples()
    first = samples[0]
    first["input_ids"][:, 40:], first["labels"][:, 40:] = 0, -100
    first["document_lengths"] = torch.tensor([*ROUTED_DOCUMENTS[0], 8])
    return samples


def router_reference_by_row(model_dir: str, samples: list[dict]):
    """Independent of ulysses_train: every document alone through the plain Qwen3-MoE (its cross-entropy summed),
    and per packed row transformers' own load_balancing_loss_func over the router logits of the row's documents
    (padding excluded), each row weighted by its share of the real tokens."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    real = [sum(lengths) for lengths in ROUTED_DOCUMENTS]
    total, count, aux = 0.0, 0, 0.0
    for sample, lengths, tokens in zip(samples, ROUTED_DOCUMENTS, real):
        ends = torch.tensor(lengths).cumsum(0).tolist()
        router_rows = []
        for start, end in zip([0, *ends[:-1]], ends):
            out = model(input_ids=sample["input_ids"][:, start:end], output_router_logits=True)
            nll, labelled = summed_nll(out.logits, sample["labels"][:, start:end])
            total, count = total + nll, count + labelled
            router_rows += list(out.router_logits)
        row_aux = load_balancing_loss_func(tuple(router_rows), model.config.num_experts,
                                           model.config.num_experts_per_tok)
        aux = aux + tokens / sum(real) * row_aux
    loss = total / count + model.config.router_aux_loss_coef * aux
    loss.backward()
    named = dict(model.named_parameters())
    return (loss.item(), {n: p.grad.detach().clone() for n, p in named.items()},
            {n: (p.detach() - LR * p.grad).clone() for n, p in named.items()}, count)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("packed_moe") / "model"),
                           config=tiny_family_config("qwen3_moe", **QWEN3_MOE))


@pytest.mark.parametrize("control", [None, "--router-counts-packing-padding"], ids=["exact", "counting-padding"])
def test_packed_router_loss_excludes_packing_padding(tmp_path, moe_model, control):
    """The router's load-balancing loss of packed rows is per row over the row's real tokens (padding segment
    excluded), against transformers' own function; the negative control counts the padding and must differ."""
    reference = router_reference_by_row(moe_model, packed_rows_with_padding())
    result = packed_step(tmp_path, moe_model, 2, 2, packed_rows_with_padding(), extra=[control] if control else [])
    if control is None:
        loss_error, grad_error = assert_step_matches(result, *reference)
        print(f"packed router loss: loss rel err {loss_error:.1e}, worst grad rel err {grad_error:.1e}")
        return
    err, name = worst_relative_error(result["grads"], reference[1])
    print(f"router counting the padding: loss {result['loss']:.6f} vs {reference[0]:.6f}, grad err {err:.1e} ({name})")
    assert abs(result["loss"] - reference[0]) / reference[0] > 1e-5 and err > 1e-2  # beyond both bounds
