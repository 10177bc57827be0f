"""The router's load-balancing loss (model/router_balance.py) against transformers' own, in one process: a tiny
Qwen3-MoE whose mixture-of-experts blocks run over 3 TiledMLP tiles, on a sequence with 5 padding tokens at its
end (what an sp slice has), gives the plain model's `aux_loss` and the gradient of `coef x aux_loss` in every
parameter. The gradient is injected at the routers in backward, so the test backpropagates only it (the
decoder's output times zero). Negative control: tiles that do not say which rows they hold count the padding.
The distributed proof (sp, dp, micro-steps) is in tests/test_model_families.py."""
import contextlib
import copy

import pytest
import torch
from helpers import relative_error, tiny_family_config

from ulysses_train.model import router_balance
from ulysses_train.model.router_balance import attach_router_balance
from ulysses_train.model.tiling import apply_tiled_mlp

TOKENS, PADDING = 150, 5  # 155 rows: 3 tiles of hidden 64 (52, 52, 51), the padding in the last


@pytest.fixture(scope="module")
def plain():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_family_config("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                head_dim=16, output_router_logits=True, router_aux_loss_coef=0.5)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()


def reference(model, ids):
    """transformers' aux_loss on the unpadded sequence, and the gradient of coef x aux_loss."""
    model = copy.deepcopy(model)
    aux = model(input_ids=ids, output_router_logits=True).aux_loss
    (model.config.router_aux_loss_coef * aux).backward()
    return aux.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def ours(model, ids):
    """The same through router_balance.py, tiled, on the padded sequence."""
    model = copy.deepcopy(model)
    schedule = apply_tiled_mlp(model, "true")
    balance = attach_router_balance(model)
    calls = []
    for router in balance_routers(model):
        router.register_forward_hook(lambda *a: calls.append(1))
    padded = torch.nn.functional.pad(ids, (0, PADDING))
    balance.begin_forward(TOKENS, padded.device)
    hidden = model.model(input_ids=padded).last_hidden_state
    balance.end_forward(weight=1.0, scale=1.0)
    (hidden * 0).sum().backward()  # nothing but the router loss's own gradient flows
    assert all(type(layer.mlp).__name__ == "TiledQwen3MoeSparseMoeBlock" for layer in model.model.layers)
    assert schedule.num_tiles == 3 and len(calls) == 2 * 3 * 2  # 2 layers x 3 tiles, in forward and in backward
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None and p.grad.any()}
    return balance.aux, grads


def balance_routers(model):
    from ulysses_train.model.architecture import router_of

    router_class, _ = router_of(model)
    return [m for m in model.modules() if isinstance(m, router_class)]


def test_router_loss_and_its_gradient_equal_transformers_on_a_padded_tiled_slice(plain):
    ids = torch.randint(0, 256, (1, TOKENS), generator=torch.Generator().manual_seed(1))
    want_aux, want_grads = reference(plain, ids)
    got_aux, got_grads = ours(plain, ids)
    assert abs(got_aux - want_aux) / want_aux < 1e-6, (got_aux, want_aux)
    assert sorted(got_grads) == sorted(want_grads)  # the routers and everything below them, nothing else
    worst = max(relative_error(got_grads[n], want_grads[n]) for n in want_grads)
    assert worst < 1e-5, worst


def test_negative_control_tiles_that_do_not_say_their_rows_count_the_padding(plain, monkeypatch):
    ids = torch.randint(0, 256, (1, TOKENS), generator=torch.Generator().manual_seed(1))
    want_aux, _ = reference(plain, ids)
    monkeypatch.setattr(router_balance.RouterBalance, "rows_from", lambda self, offset: contextlib.nullcontext())
    got_aux, _ = ours(plain, ids)
    assert abs(got_aux - want_aux) / want_aux > 1e-4, (got_aux, want_aux)


def test_kimi_linear_router_logits_train_with_a_note_that_it_has_no_router_loss():
    """Issue 51: Kimi Linear with output_router_logits: true was refused as if its router loss would be dropped, but
    transformers' Kimi Linear adds none (the loss is the cross-entropy). Now it is accepted with a `model changes:`
    phrase saying so; the negative control, a family with a router loss not reproduced here (Hy3), stays
    refused, and a checked family (Qwen3-MoE) gets the loss, not the note."""
    from helpers import KIMI_LINEAR, tiny_family_config

    from ulysses_train.config import ConfigError
    from ulysses_train.model.loading import check_supported_architecture
    from ulysses_train.model.router_balance import router_balance_requested, router_loss_note

    kimi = tiny_family_config("kimi_linear", **KIMI_LINEAR, output_router_logits=True)
    check_supported_architecture(kimi)
    assert not router_balance_requested(kimi)
    assert router_loss_note(kimi) == ("no router loss (kimi_linear has none: output_router_logits=true only returns "
                                      "the router logits; the loss is the cross-entropy)")
    assert router_loss_note(tiny_family_config("kimi_linear", **KIMI_LINEAR)) is None
    with pytest.raises(ConfigError, match="would be silently dropped"):
        check_supported_architecture(tiny_family_config("hy_v3", num_experts=4, output_router_logits=True))
    moe = tiny_family_config("qwen3_moe", num_experts=4, num_experts_per_tok=2, output_router_logits=True)
    assert router_balance_requested(moe) and router_loss_note(moe) is None


def without_router_record(monkeypatch, model) -> None:
    """The model as transformers 5.17 builds Nemotron-H and Granite 4.0-H: no `router_logits` in its
    `_can_record_outputs` (5.25 records them)."""
    record = {k: v for k, v in (type(model)._can_record_outputs or {}).items() if k != "router_logits"}
    monkeypatch.setattr(type(model), "_can_record_outputs", record)


@pytest.mark.parametrize("family", ["nemotron_h", "granitemoehybrid", "qwen3_moe"])
def test_routers_are_found_where_transformers_records_no_router_logits(family, monkeypatch):
    """On transformers 5.17 the Mamba2 hybrids' routers went unfound: every expert counted as active (Nemotron 3
    Nano's 7-layer step read 1,018 TFLOP/s on an H200), TiledMLP refused their expert blocks, and Granite's router
    loss could not hook its routers. The router beside the experts is the one transformers records elsewhere, and
    the active parameters and TiledMLP's blocks are the same. Negative control: no router found counts every
    expert."""
    from helpers import NEMOTRON_H
    from test_mamba2_families import GRANITE_4_H

    from ulysses_train.model import architecture
    from ulysses_train.model.architecture import causal_lm_on_meta, router_of
    from ulysses_train.model.flops import non_embedding_params
    from ulysses_train.model.tiling import tileable_blocks

    overrides = {"nemotron_h": NEMOTRON_H, "granitemoehybrid": GRANITE_4_H,
                 "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)}[family]
    model = causal_lm_on_meta(tiny_family_config(family, **overrides))
    recorded, active, tiled = router_of(model), non_embedding_params(model), tileable_blocks(model)[1]
    assert recorded is not None and tiled
    without_router_record(monkeypatch, model)
    assert router_of(model) == (recorded[0], None)
    assert non_embedding_params(model) == active
    assert tileable_blocks(model)[1] == tiled
    monkeypatch.setattr(architecture, "router_beside_experts", lambda model: None)
    assert router_of(model) is None and non_embedding_params(model) > active


def test_router_loss_equals_transformers_with_the_logits_found_by_their_width(plain, monkeypatch):
    """The router loss where router_of could only name the class: the logits are the output with one column per
    expert, first (Qwen3-MoE, Nemotron-H) or last (5.17's Granite 4.0-H router returns index, weights, logits)."""
    from ulysses_train.model.architecture import router_logits_index

    ids = torch.randint(0, 256, (1, TOKENS), generator=torch.Generator().manual_seed(1))
    want_aux, want_grads = reference(plain, ids)
    model = copy.deepcopy(plain)
    without_router_record(monkeypatch, model)
    got_aux, got_grads = ours(model, ids)
    assert abs(got_aux - want_aux) / want_aux < 1e-6, (got_aux, want_aux)
    assert max(relative_error(got_grads[n], want_grads[n]) for n in want_grads) < 1e-5
    chosen, weights, logits = torch.zeros(5, 2, dtype=torch.long), torch.rand(5, 2), torch.rand(5, 4)
    assert router_logits_index((chosen, weights, logits), None, 4) == 2
    assert router_logits_index((logits, weights, chosen), None, 4) == 0
    assert router_logits_index((logits, weights, chosen), 1, 4) == 1  # transformers' record wins
