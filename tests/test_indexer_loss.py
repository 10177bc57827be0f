"""The indexer's KL loss (model.indexer_loss_coef, model/indexer_loss.py) through the core exactness test: one step on
gloo processes equals a plain single-process reference (loss, every gradient, the indexers' included, the update).

transformers trains no indexer (its indexer runs under `no_grad` and returns only its choice), so the reference is
built from transformers' own pieces, not the package's: its model with eager attention, whose attention
probabilities each layer returns (zero on the keys the indexer did not choose; HY-V4's with its sink's share
dropped), and its indexer's own forward re-run on the same (detached) inputs with gradients on, its scores taken
where it calls `topk`. For each layer with an indexer and each token t, over the keys it chose and may see:
p = the attention's probabilities summed over heads, L1-normalised; q = softmax of the indexer's scores;
KL_t = sum p (log(p + 1e-10) - log(q + 1e-10)) (Megatron-Core's `compute_dsa_indexer_loss` with `sparse_loss`).
The objective: mean cross-entropy + coef x sum over layers and tokens of KL_t / (the step's tokens).

Negative control: the index keys gathered without their gradient (the gradient of a key from other ranks' queries
dropped), which only sp can get wrong."""
import inspect

import pytest
import torch
from helpers import assert_step_matches, summed_nll, worst_relative_error
from test_indexed_attention import indexed_models  # noqa: F401  (the fixture)
from test_model_families import LEVERS, LR, family_step, uneven_samples

COEF = 0.5
EPSILON = 1e-10
INDEXER_TOLERANCE = 2e-3
"""The indexers' gradients against the reference's, relative: their fp32 floor is 3.3e-4 (the reference's own fp32
gradients against its fp64 ones, HY-V4's first layer; GLM-5's 2.5e-5), and the control's error is 0.5 and more.
Every other gradient is held to the core test's 1e-4."""


def capture_indexed_layers(model) -> list:
    """Per attention layer with an indexer, a record its hooks fill on each forward: the indexer's call (inputs,
    chosen keys) and the layer's attention probabilities."""
    records = []
    for module in model.modules():
        if getattr(module, "indexer", None) is None or not hasattr(module, "o_proj"):
            continue
        record = {"indexer": module.indexer}
        module.indexer.register_forward_hook(
            lambda m, args, kwargs, out, r=record: r.update(args=args, kwargs=kwargs, chosen=out), with_kwargs=True)
        module.register_forward_hook(lambda m, args, out, r=record: r.update(probs=out[1]))
        records.append(record)
    return records


def indexer_scores_with_gradient(record) -> torch.Tensor:
    """transformers' indexer forward on the recorded (detached) inputs with gradients on: the scores it takes its
    top-k of [B, S, T], masked as it masks them."""
    forward = inspect.unwrap(type(record["indexer"]).forward)  # without its no_grad
    seen, topk = {}, torch.Tensor.topk

    def spy(scores, *args, **kwargs):
        seen["scores"] = scores
        return topk(scores, *args, **kwargs)
    hidden, q_resid, *rest = record["args"]
    torch.Tensor.topk = spy
    try:
        with torch.enable_grad():
            forward(record["indexer"], hidden.detach(), q_resid.detach(), *rest, **{**record["kwargs"], "cache": None})
    finally:
        torch.Tensor.topk = topk
    return seen["scores"]


def layer_kl_sum(record) -> torch.Tensor:
    """One layer's KL summed over the sequence's tokens (module docstring)."""
    scores = indexer_scores_with_gradient(record)
    tokens = scores.shape[-1]
    causal = torch.ones(tokens, tokens, dtype=torch.bool).tril()
    visible = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, record["chosen"].long(), True) & causal
    log_q = torch.log(torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) + EPSILON)
    target = record["probs"].detach().sum(dim=1) * visible
    target = target / target.sum(dim=-1, keepdim=True)
    return (target * (torch.log(target + EPSILON) - log_q)).sum()


def indexer_loss_reference(model_dir, sequences):
    """(loss, gradients, parameters after SGD, label count) of the reference objective (module docstring)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    records = capture_indexed_layers(model)
    tokens = sum(ids.numel() for ids, _ in sequences)
    total, count, kl = 0.0, 0, 0.0
    for ids, labels in sequences:
        nll, labelled = summed_nll(model(input_ids=ids, use_cache=False).logits, labels)
        total, count = total + nll, count + labelled
        kl = kl + sum(layer_kl_sum(record) for record in records) / tokens
    loss = total / count + COEF * kl
    loss.backward()
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    grads = {n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for n, p in named.items()}
    assert all(grads[n].abs().sum() > 0 for n in grads if ".indexer." in n)  # the loss reaches every indexer tensor
    params = {n: (p.detach() - LR * grads[n]).clone() for n, p in named.items()}
    return loss.item(), grads, params, count


@pytest.mark.parametrize("family,nproc,sp,levers,control", [
    ("glm_moe_dsa", 4, 4, True, ""), ("hy_v4", 4, 2, False, ""), ("glm_moe_dsa", 2, 2, False,
                                                                    "--indexer-keys-without-gradient")],
    ids=["glm_moe_dsa-sp4-uneven-levers", "hy_v4-sp2xdp2", "control-keys-without-gradient"])
def test_indexer_loss_step_equals_a_plain_reference(tmp_path, indexed_models, family, nproc, sp, levers,
                                                    control):
    """GLM-5 at sp=4 on uneven lengths with the levers (its shared layer has no indexer and no loss), HY-V4 at
    sp=2 x dp=2 (its sinks in the attention's probabilities). The control differs."""
    extra = ("--set", f"model.indexer_loss_coef={COEF}", *(LEVERS if levers else ()), *((control,) if control else ()))
    samples, result = family_step(tmp_path, indexed_models[family], nproc, sp, extra, offload=levers,
                                  samples=uneven_samples(nproc // sp))
    reference = indexer_loss_reference(indexed_models[family], [(s["input_ids"], s["labels"]) for s in samples])
    if control:
        err, name = worst_relative_error(result["grads"], reference[1])
        print(f"{family} {control}: worst grad rel err {err:.2e} ({name})")
        assert err > 0.1 and ".indexer." in name, (control, err, name)
        return
    assert_indexer_step_matches(result, reference, f"{family} sp={sp} x dp={nproc // sp}")


def assert_indexer_step_matches(result, reference, shown: str) -> None:
    """The core test's bounds for the loss and every gradient but the indexers', INDEXER_TOLERANCE for theirs."""
    loss, grads, params, count = reference
    rest = {key: {n: v for n, v in result[key].items() if ".indexer." not in n} for key in ("grads", "params")}
    loss_error, grad_error = assert_step_matches({**result, **rest}, loss, *({n: v for n, v in d.items()
                                                 if ".indexer." not in n} for d in (grads, params)), count)
    indexer = {n for n in grads if ".indexer." in n}
    assert indexer and indexer <= set(result["grads"])
    indexer_error, name = worst_relative_error({n: result["grads"][n] for n in indexer}, {n: grads[n] for n in indexer})
    assert indexer_error < INDEXER_TOLERANCE, f"gradient of {name} off by {indexer_error:.2e}"
    assert worst_relative_error({n: result["params"][n] for n in indexer}, {n: params[n] for n in indexer})[0] < 1e-5
    print(f"{shown} indexer loss: loss rel err {loss_error:.1e}, worst grad rel err {grad_error:.1e}, worst indexer "
          f"grad rel err {indexer_error:.1e}")


def test_packed_indexer_loss_equals_each_document_run_alone(tmp_path, indexed_models):
    """GLM-5, documents of 1 to 24 tokens packed into 48 at sp=2 x dp=2 with the levers (1-token documents on slice
    edges): each query's loss sees only its own document's chosen keys, and the reference runs every document alone
    (the step's tokens are all the documents')."""
    from test_indexed_attention import document_sequences
    from test_mamba2_families import EDGE_DOCUMENTS
    from test_packed_step import packed_samples, packed_step

    samples = packed_samples(EDGE_DOCUMENTS, seed=5, labelled=0.7)
    result = packed_step(tmp_path, indexed_models["glm_moe_dsa"], 4, 2, samples, levers=True,
                         extra=("--set", f"model.indexer_loss_coef={COEF}"))
    assert_indexer_step_matches(result, indexer_loss_reference(indexed_models["glm_moe_dsa"],
                                                               document_sequences(samples)), "glm_moe_dsa packed")


def test_the_indexer_loss_is_refused_where_it_has_nothing_to_train():
    """Negative, infinite or beside LoRA (config checks), and on a model without an indexer: one line each.
    Control: 0 and a model with indexers pass."""
    from helpers import tiny_family_config
    from test_indexed_attention import GLM_5

    from ulysses_train.config import Config, ConfigError
    from ulysses_train.config_checks import validate
    from ulysses_train.model.mixers.indexed_attention import check_indexer_loss

    for coef, lora, match in ((-1.0, {}, "must be a finite number >= 0"), (float("inf"), {}, "finite"),
                              (0.5, {"r": 4}, "with model.lora")):
        cfg = Config()
        cfg.model.indexer_loss_coef, cfg.model.lora = coef, lora
        with pytest.raises(ConfigError, match=match):
            validate(cfg)
    check_indexer_loss(tiny_family_config("glm_moe_dsa", **GLM_5), 0.5)
    check_indexer_loss(tiny_family_config("qwen3"), 0.0)
    with pytest.raises(ConfigError, match="model type 'qwen3' has none. Fix: model.indexer_loss_coef 0"):
        check_indexer_loss(tiny_family_config("qwen3"), 0.5)
