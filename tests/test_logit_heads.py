"""The function trained is the model's: for every family record, the package's chunked head (architecture.
logit_transform read off the config, then model/loss.py's fused loss) against the plain transformers model's own
logits, on the record's tiny config with each head key at an edge value: absent (the config's default), null, 0,
negative, positive. Each case either trains exactly what transformers computes (the summed loss and its gradient
with respect to the hidden states entering `lm_head`) or is refused in one line, and a refusal is expected only
where transformers' head leaves nothing to train (a scale or cap of 0: every logit 0; dividing by 0: every logit
infinite) or cannot run at all (a null scale). Negative control: Gemma's cap of 0 read as "no cap" (the reading
before this test) trains another loss than transformers'."""
import importlib

import pytest
import torch
from helpers import tiny_family_config, tiny_qwen3_config

from ulysses_train.families import FAMILIES
from ulysses_train.model.architecture import SOFTCAP_KEY, LogitTransform, logit_transform, text_config
from ulysses_train.model.loss import chunked_nll_sum

TOKENS = 24
EQUAL, REFUSED = "equal", "refused"
SCALE_CASES = [("absent", EQUAL), (None, REFUSED), (0.0, REFUSED), (-0.5, EQUAL), (2.0, EQUAL)]
"""A logit scale's edge values and what must happen: transformers multiplies or divides by it whatever it is."""
SOFTCAP_CASES = [("absent", EQUAL), (None, EQUAL), (0.0, REFUSED), (-3.0, EQUAL), (3.0, EQUAL)]
"""A soft-cap's: transformers caps whenever it is not None (a negative cap is the same function as its size)."""
UNREAD_CASES = [(SOFTCAP_KEY, 0.0, EQUAL), (SOFTCAP_KEY, None, EQUAL), ("logit_scale", None, EQUAL)]
"""Keys another family's head reads, set to what changes nothing, on a family whose head never reads them."""


def tiny_config(family):
    """The record's tiny config: the fields its exactness test's table gives its first model type."""
    module, name = family.exactness.split(".")
    table = getattr(importlib.import_module(module), name)
    model_type = family.model_types[0]
    if not isinstance(table, dict):
        return tiny_qwen3_config()
    fields = table[next(key for key in table if key.split("-")[0] == model_type)]
    return tiny_family_config(model_type, **(fields[0] if isinstance(fields, tuple) else fields))


def head_cases(family) -> list:
    """(key, value, expected) for each edge value of each head key the record names; the keys other heads read,
    for a record whose head reads none."""
    cases = []
    if family.logit_scale:
        cases += [(family.logit_scale[0], value, expected) for value, expected in SCALE_CASES]
    if family.logit_softcap:
        cases += [(SOFTCAP_KEY, value, expected) for value, expected in SOFTCAP_CASES]
    return cases or UNREAD_CASES


def plain_loss_and_hidden_grad(config, ids):
    """transformers' summed next-token loss from its own logits, the hidden states entering `lm_head` and the loss's
    gradient with respect to them, and the `lm_head` weight (four Nones where transformers' head cannot run)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    seen = {}

    def keep_input(module, args):
        seen["hidden"] = args[0]
        args[0].retain_grad()

    model.get_output_embeddings().register_forward_pre_hook(keep_input)
    try:
        logits = model(input_ids=ids).logits[0, :-1]
    except TypeError:  # Cohere with a null logit_scale: `logits * None`
        return None, None, None, None
    loss = torch.nn.functional.cross_entropy(logits.double(), ids[0, 1:], reduction="sum")
    loss.backward()
    weight = model.get_output_embeddings().weight.detach()
    return loss.detach(), seen["hidden"].detach()[0, :-1], seen["hidden"].grad[0, :-1], weight


def package_loss_and_hidden_grad(hidden, weight, ids, transform):
    hidden = hidden.clone().requires_grad_(True)
    loss = chunked_nll_sum(hidden, weight, ids[0, 1:], 8, transform)
    loss.backward()
    return loss.detach(), hidden.grad


def outcome(config, transform_of=logit_transform) -> tuple:
    """(EQUAL or REFUSED or a mismatch's description, transformers' loss)."""
    ids = torch.randint(0, text_config(config).vocab_size, (1, TOKENS), generator=torch.Generator().manual_seed(1))
    plain = plain_loss_and_hidden_grad(config, ids)
    try:
        transform = transform_of(config)
    except ValueError as err:
        assert "\n" not in str(err) and ("fix:" in str(err) or "not supported" in str(err)), err
        return REFUSED, plain[0]
    if plain[0] is None:
        return "trained where transformers' head cannot run", None
    want_loss, hidden, want_grad, weight = plain
    got_loss, got_grad = package_loss_and_hidden_grad(hidden, weight, ids, transform)
    loss_error = abs(float(got_loss) - float(want_loss)) / abs(float(want_loss))
    grad_error = float((got_grad - want_grad).norm() / want_grad.norm().clamp(min=1e-30))
    if loss_error < 1e-5 and grad_error < 1e-4:
        return EQUAL, want_loss
    return f"loss off by {loss_error:.2e}, hidden gradient by {grad_error:.2e}", want_loss


def configured(family, key, value):
    """The record's tiny config with `key` set to `value` as a config.json would (transformers 5.25's typed configs
    refuse a null scale when set in Python; 5.17's take it, and the package must too)."""
    config = tiny_config(family)
    if value != "absent":
        object.__setattr__(text_config(config), key, value)
    return config


def untrainable(plain_loss, config) -> bool:
    """Whether transformers' loss says its logits were all equal (ln V a token) or not finite."""
    uniform = (TOKENS - 1) * float(torch.tensor(text_config(config).vocab_size, dtype=torch.float64).log())
    return not torch.isfinite(plain_loss) or abs(float(plain_loss) - uniform) < 1e-6


@pytest.mark.parametrize("family", FAMILIES, ids=[family.model_types[0] for family in FAMILIES])
def test_the_chunked_head_trains_the_plain_models_logits_at_every_edge_value(family):
    for key, value, expected in head_cases(family):
        config = configured(family, key, value)
        got, plain_loss = outcome(config)
        assert got == expected, f"{key}={value!r}: {got}"
        if expected == REFUSED and plain_loss is not None:  # refused only where transformers leaves nothing to train
            assert untrainable(plain_loss, config), f"{key}={value!r} refused, but transformers trains {plain_loss}"


def test_a_cap_of_zero_read_as_no_cap_is_caught():
    """The negative control: `final_logit_softcapping: 0.0` read as no cap (`... or None`) trains another loss
    than transformers' head, whose logits are then all 0 or not a number."""
    gemma = next(family for family in FAMILIES if "gemma3_text" in family.model_types)

    def dropped_cap(config):
        return LogitTransform(1.0, getattr(text_config(config), SOFTCAP_KEY, None) or None)

    config = configured(gemma, SOFTCAP_KEY, 0.0)
    got, plain_loss = outcome(config, transform_of=dropped_cap)
    assert got.startswith("loss off by") and untrainable(plain_loss, config), got
    got, _ = outcome(configured(gemma, SOFTCAP_KEY, 3.0), transform_of=lambda config: LogitTransform())
    assert got.startswith("loss off by"), got  # and the check sees a cap that is dropped outright
