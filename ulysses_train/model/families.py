"""Each model family the package trains, as one record found by its text-model type.

A record holds what the rest of the package must know of a family beyond its layers' mixers (model/mixers/):
how its head post-processes the logits (a scale, a soft-cap), whether its mixture-of-experts head adds a router
loss, whether its attention takes positions at all, which of its layer kinds hold no token mixer, and where its
exactness test lists it (one step under sp and sp x dp equals the plain model: loss, every gradient, the update).
The tables other modules read (architecture.LOGIT_SCALES, SOFTCAP_TYPES, ROUTER_BALANCE_TYPES,
NO_ROUTER_LOSS_TYPES; rope.NO_POSITION_TYPES; mixers.MIXERLESS_LAYER_TYPES; attention_exchange.OWN_EXCHANGE_CLASSES)
are derived from these records, so a
family's facts are written once, here.

A model type with no record has never been checked against its transformers forward: it is refused in one line
naming the families that train (`check_family`), unless `model.allow_untested_family: true` asks to try it, with a
warning. tests/test_families.py walks the records: each family's types must be listed by the exactness test its
record names, and every type those tests list must have a record. docs/adding_a_mixer.md is the recipe.

Data and small functions importing nothing of the package but its error class, so every module may read it.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Optional

from ulysses_train.errors import ConfigError

BALANCE = "balance"
"""router_loss: with `output_router_logits` on, the head adds `router_aux_loss_coef` x transformers'
`load_balancing_loss_func` (router_balance.py reproduces it exactly under sp)."""
NO_LOSS = "none"
"""router_loss: the head adds no router loss even with `output_router_logits` on (sigmoid routers with grouped
top-k): the flag trains as it is, with a note."""


@dataclass(frozen=True)
class Family:
    name: str
    """How messages and docs/families.md name it."""
    model_types: tuple
    """The text-model types (`text_config(hf_config).model_type`) it covers."""
    exactness: str
    """`test_module.NAME`: the exactness test's table of model types (a dict or tuple) that lists these types."""
    logit_scale: Optional[tuple] = None
    """(config key, "multiply" | "divide"): the head scales `hidden @ lm_head.T` by that config value."""
    logit_softcap: bool = False
    """The head applies `cap * tanh(logits / cap)` with `final_logit_softcapping` (after any scale)."""
    router_loss: Optional[str] = None
    """BALANCE, NO_LOSS, or None (no experts; a router loss asked for is refused)."""
    positions: bool = True
    """False: the attention takes no positions whatever the config says (NoPE; YaRN has nothing to scale)."""
    mixerless_layers: tuple = ()
    """Layer types holding no token mixer (a dense MLP only, experts only): per token, exact on any slice."""
    own_exchange: tuple = ()
    """Attention classes (transformers' names) whose heads DeepSpeed's Ulysses wrapper cannot take: multi-head
    latent attention (q/k and v heads of their own widths), head widths or KV head counts that differ by layer.
    Under sp they go through the package's own all-to-all, q, k and v in one message
    (mixers/attention_exchange.py)."""


FAMILIES: tuple[Family, ...] = (
    Family("Qwen3", ("qwen3",), "test_step.MODEL_TYPES"),
    Family("Llama", ("llama",), "test_attention_families.FAMILIES"),
    Family("Mistral", ("mistral",), "test_attention_families.FAMILIES"),
    Family("Qwen2", ("qwen2",), "test_attention_families.FAMILIES"),
    Family("Cohere", ("cohere",), "test_model_families.FAMILIES", logit_scale=("logit_scale", "multiply")),
    Family("Granite", ("granite",), "test_model_families.FAMILIES", logit_scale=("logits_scaling", "divide")),
    Family("Seed-OSS", ("seed_oss",), "test_attention_families.FAMILIES"),
    Family("SmolLM3", ("smollm3",), "test_attention_families.FAMILIES"),
    Family("Apertus", ("apertus",), "test_attention_families.FAMILIES"),
    Family("GLM-4.5 (MoE)", ("glm4_moe",), "test_attention_families.FAMILIES"),
    Family("MiniMax-M2", ("minimax_m2",), "test_attention_families.FAMILIES"),
    Family("Hunyuan-MoE", ("hunyuan_v1_moe",), "test_attention_families.FAMILIES"),
    Family("ERNIE-4.5-MoE", ("ernie4_5_moe",), "test_attention_families.FAMILIES"),
    Family("EXAONE 4", ("exaone4",), "test_model_families.WINDOWED_FAMILIES"),
    Family("Qwen3-MoE", ("qwen3_moe",), "test_model_families.MOE_FAMILIES", router_loss=BALANCE),
    Family("Gemma 3", ("gemma3_text",), "test_model_families.WINDOWED_FAMILIES", logit_softcap=True),
    Family("GPT-OSS", ("gpt_oss",), "test_model_families.WINDOWED_FAMILIES", router_loss=BALANCE),
    Family("Qwen3.5", ("qwen3_5_text",), "helpers.LINEAR_HYBRIDS"),
    Family("Qwen3.5-MoE", ("qwen3_5_moe_text",), "test_linear_hybrids.HYBRID_MOE_FAMILIES", router_loss=BALANCE),
    Family("Qwen3-Next", ("qwen3_next",), "test_linear_hybrids.HYBRID_MOE_FAMILIES", router_loss=BALANCE),
    Family("OLMo-hybrid", ("olmo_hybrid",), "helpers.LINEAR_HYBRIDS"),
    Family("Kimi Linear", ("kimi_linear",), "test_linear_hybrids.HYBRID_MOE_FAMILIES", router_loss=NO_LOSS,
           positions=False, own_exchange=("KimiLinearAttention",)),
    Family("Nemotron-H", ("nemotron_h",), "test_mamba2_families.MAMBA2_FAMILIES", router_loss=NO_LOSS,
           positions=False, mixerless_layers=("mlp", "moe")),
    Family("Granite 4.0-H", ("granitemoehybrid",), "test_mamba2_families.MAMBA2_FAMILIES",
           logit_scale=("logits_scaling", "divide"), router_loss=BALANCE),
    Family("Bamba", ("bamba",), "test_mamba2_families.MAMBA2_FAMILIES"),
    Family("DeepSeek-V3, Kimi K2, Moonlight (MLA)", ("deepseek_v3",), "test_latent_attention.LATENT_FAMILIES",
           router_loss=NO_LOSS, own_exchange=("DeepseekV3Attention",)),
    Family("LongCat-Flash (MLA)", ("longcat_flash",), "test_latent_attention.LATENT_FAMILIES", router_loss=NO_LOSS,
           own_exchange=("LongcatFlashMLA",)),
    Family("MiMo-V2-Flash", ("mimo_v2_flash",), "test_latent_attention.LATENT_FAMILIES", router_loss=NO_LOSS,
           own_exchange=("MiMoV2FlashAttention",)),
    Family("Gemma 4", ("gemma4_text",), "test_gemma4.GEMMA4_FAMILIES", logit_softcap=True,
           own_exchange=("Gemma4TextAttention",)),
)

UNTESTED_OPT_IN = "model.allow_untested_family"


def family_of(model_type: Optional[str]) -> Optional[Family]:
    """The record covering this text-model type, or None."""
    return next((family for family in FAMILIES if model_type in family.model_types), None)


def types_where(condition) -> tuple:
    """Every model type of the records for which `condition(family)` holds: the derived tables."""
    return tuple(t for family in FAMILIES if condition(family) for t in family.model_types)


def own_exchange_classes() -> tuple:
    """Every record's attention classes that take the package's own exchange under sp (Family.own_exchange)."""
    return tuple(name for family in FAMILIES for name in family.own_exchange)


def family_names() -> str:
    """The families that train, for messages."""
    return ", ".join(family.name for family in FAMILIES)


def untested_family_problem(model_type: str) -> str:
    """Why a model type without a record is refused (the line check_family raises or, opted in, warns)."""
    return (f"model type {model_type!r} has no family record: it was never checked to train exactly under "
            f"sequence parallelism against its transformers forward. Families that train: {family_names()}. "
            f"Fix: one of those, or {UNTESTED_OPT_IN}: true (plan.py: --allow-untested-family) to try it untested")


def check_family(model_type: str, allow_untested: bool) -> None:
    """A model type with no family record is refused in one line naming the families that train;
    `model.allow_untested_family` trains it anyway, said once (by the first rank) as a warning. Called after the
    specific refusals (loading.check_supported_architecture), which name what exactly is not built."""
    if family_of(model_type) is not None:
        return
    problem = untested_family_problem(model_type)
    if not allow_untested:
        raise ConfigError(problem + ".")
    if os.environ.get("RANK", "0") == "0":
        print(f"warning: {problem.split('. Fix:')[0]}; training it anyway ({UNTESTED_OPT_IN}: true).",
              file=sys.stderr, flush=True)
