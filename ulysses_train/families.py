"""Each model family the package trains, as one record found by its text-model type.

A record holds what the rest of the package must know of a family: which mixer builds its `linear_attention`
layers (its attention layers are the attention mixer's; model/mixers/) and which of its layer kinds hold no token
mixer, how its head post-processes the logits (a scale, a soft-cap), whether its mixture-of-experts head adds a
router loss and which layer holds its experts, whether its attention takes positions at all, which attention
classes take the package's own exchange, the projection names LoRA adapts beyond the usual ones, whether the
planner counts it by the Llama formula, and where its exactness test lists it (one step under sp and sp x dp
equals the plain model: loss, every gradient, the update). The tables other modules read (architecture.LOGIT_SCALES,
SOFTCAP_TYPES, ROUTER_BALANCE_TYPES, NO_ROUTER_LOSS_TYPES; rope.NO_POSITION_TYPES; mixers.MIXERLESS_LAYER_TYPES;
each mixer's `model_types`; attention_exchange.OWN_EXCHANGE_CLASSES; lora_keys.LORA_DEFAULTS' targets;
planner/model_counts' formula) are derived from these records, so a family's facts are written once, here, and
no other module compares model-type strings (tests/test_families.py scans the package for them). A family's
presets (model/presets.py) are keyed by its model type.

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


USUAL_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The attention and MLP projections under the names most families give them: LoRA's default targets with every
record's `lora_targets` (lora_keys.LORA_DEFAULTS). PEFT adapts the names a model has."""


@dataclass(frozen=True)
class LlamaLayout:
    """A family whose parameters the planner counts by formula (planner/model_counts.count_parameters: instant,
    where building the model on the meta device takes seconds): Llama's layer with these extras."""
    qkv_bias: bool = False
    """q, k and v have biases and o none, whatever `attention_bias` says (Qwen2)."""
    head_norms: bool = False
    """An RMSNorm on each q and k head (Qwen3)."""


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
    linear_mixer: Optional[str] = None
    """The mixer (its `Mixer.name` in model/mixers/) that builds the family's `linear_attention` layers:
    "gated_deltanet", "kimi_delta" or "mamba2"; None: the family has no such layers (any it lists are refused)."""
    experts_layer: Optional[str] = None
    """The layer type holding the family's experts where only some layers do: a config listing no such layer has no
    experts, whatever its expert count says (Nemotron-H 8B's config keeps `n_routed_experts`' default of 8)."""
    lora_targets: tuple = ()
    """Projection names LoRA adapts by default beyond USUAL_LORA_TARGETS (MLA's low-rank q and kv projections)."""
    llama_layout: Optional[LlamaLayout] = None
    """Counted by the Llama formula (planner/model_counts.py) with these extras; None: counted on the meta device."""
    indexer: Optional[str] = None
    """How the family's `indexed_attention` layers pick each query's keys, the indexed-attention mixer's variant
    (model/mixers/indexed_attention.py): TOKEN_TOP_K (DeepSeek Sparse Attention), POOLED_TOP_K (GLM-5.3-Flash);
    None: no such layers (any it lists are refused)."""
    text_head: bool = False
    """transformers ships the text model only inside its image-text model (no causal-LM class for the text config):
    the package's own head is registered for it (model/text_head.py)."""
    own_exchange: tuple = ()
    """Attention classes (transformers' names) whose heads DeepSpeed's Ulysses wrapper cannot take: multi-head
    latent attention (q/k and v heads of their own widths), head widths or KV head counts that differ by layer.
    Under sp they go through the package's own all-to-all, q, k and v in one message
    (mixers/attention_exchange.py)."""


TOKEN_TOP_K = "token top-k"
"""Family.indexer: a lightning indexer scores every earlier token and the query attends to its top `index_topk`
(DeepSeek Sparse Attention on MLA: DeepSeek-V3.2, GLM-5)."""

POOLED_TOP_K = "pooled top-k"
"""Family.indexer: the indexer scores pools of `index_kpool` consecutive keys (a gated average of their index keys),
the query attends to the tokens of its top `index_topk / index_kpool` complete pools and to every key of the pool it
is in (GLM-5.3-Flash's KPool)."""

MLA_LORA_TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
"""Multi-head latent attention's low-rank q projections and kv latent projections (DeepSeek-V3's names)."""

FAMILIES: tuple[Family, ...] = (
    Family("Qwen3", ("qwen3",), "test_step.MODEL_TYPES", llama_layout=LlamaLayout(head_norms=True)),
    Family("Llama", ("llama",), "test_attention_families.FAMILIES", llama_layout=LlamaLayout()),
    Family("Mistral", ("mistral",), "test_attention_families.FAMILIES", llama_layout=LlamaLayout()),
    Family("Qwen2", ("qwen2",), "test_attention_families.FAMILIES", llama_layout=LlamaLayout(qkv_bias=True)),
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
    Family("Ministral 3", ("ministral3",), "test_attention_families.FAMILIES"),
    Family("OLMo 2", ("olmo2",), "test_attention_families.FAMILIES"),
    Family("Phi-3", ("phi3",), "test_attention_families.FAMILIES"),
    Family("Apertus 1.5", ("apertus1p5_text",), "test_attention_families.FAMILIES"),
    Family("FlexOlmo", ("flex_olmo",), "test_attention_families.FAMILIES"),
    Family("Hy3", ("hy_v3",), "test_attention_families.FAMILIES"),
    Family("MiniCPM-5-MoE", ("minicpm5_moe",), "test_attention_families.FAMILIES"),
    Family("MiniMax-M3 (text)", ("minimax_m3_vl_text",), "test_attention_families.FAMILIES"),
    Family("OLMo 3", ("olmo3",), "test_attention_families.SLIDING_FAMILIES"),
    Family("Command A (Cohere 2)", ("cohere2",), "test_attention_families.SLIDING_FAMILIES",
           logit_scale=("logit_scale", "multiply")),
    Family("Cohere 2 MoE", ("cohere2_moe",), "test_attention_families.SLIDING_FAMILIES",
           logit_scale=("logit_scale", "multiply")),
    Family("dots1", ("dots1",), "test_attention_families.SLIDING_FAMILIES"),
    Family("Laguna", ("laguna",), "test_attention_families.SLIDING_FAMILIES"),
    Family("AFMoE", ("afmoe",), "test_attention_families.SLIDING_FAMILIES"),
    Family("Kolibri 1", ("kolibri1",), "test_attention_families.SLIDING_FAMILIES"),
    Family("Llama 4 (text)", ("llama4_text",), "test_attention_families.SLIDING_FAMILIES", router_loss=NO_LOSS),
    Family("Mixtral", ("mixtral",), "test_model_families.MOE_FAMILIES", router_loss=BALANCE),
    Family("GraniteMoE", ("granitemoe",), "test_model_families.MOE_FAMILIES", router_loss=BALANCE,
           logit_scale=("logits_scaling", "divide")),
    Family("Qwen3-MoE", ("qwen3_moe",), "test_model_families.MOE_FAMILIES", router_loss=BALANCE),
    Family("Gemma 3", ("gemma3_text",), "test_model_families.WINDOWED_FAMILIES", logit_softcap=True),
    Family("GPT-OSS", ("gpt_oss",), "test_model_families.WINDOWED_FAMILIES", router_loss=BALANCE),
    Family("Qwen3.5", ("qwen3_5_text",), "helpers.LINEAR_HYBRIDS", linear_mixer="gated_deltanet"),
    Family("Qwen3.5-MoE", ("qwen3_5_moe_text",), "test_linear_hybrids.HYBRID_MOE_FAMILIES", router_loss=BALANCE,
           linear_mixer="gated_deltanet"),
    Family("Qwen3-Next", ("qwen3_next",), "test_linear_hybrids.HYBRID_MOE_FAMILIES", router_loss=BALANCE,
           linear_mixer="gated_deltanet"),
    Family("OLMo-hybrid", ("olmo_hybrid",), "helpers.LINEAR_HYBRIDS", linear_mixer="gated_deltanet"),
    Family("Kimi Linear", ("kimi_linear",), "test_linear_hybrids.HYBRID_MOE_FAMILIES", router_loss=NO_LOSS,
           positions=False, linear_mixer="kimi_delta", lora_targets=MLA_LORA_TARGETS,
           own_exchange=("KimiLinearAttention",)),
    Family("Nemotron-H", ("nemotron_h",), "test_mamba2_families.MAMBA2_FAMILIES", router_loss=NO_LOSS,
           positions=False, linear_mixer="mamba2", mixerless_layers=("mlp", "moe"), experts_layer="moe"),
    Family("Granite 4.0-H", ("granitemoehybrid",), "test_mamba2_families.MAMBA2_FAMILIES",
           logit_scale=("logits_scaling", "divide"), router_loss=BALANCE, linear_mixer="mamba2"),
    Family("Bamba", ("bamba",), "test_mamba2_families.MAMBA2_FAMILIES", linear_mixer="mamba2"),
    Family("DeepSeek-V3, Kimi K2, Moonlight (MLA)", ("deepseek_v3",), "test_latent_attention.LATENT_FAMILIES",
           router_loss=NO_LOSS, lora_targets=MLA_LORA_TARGETS, own_exchange=("DeepseekV3Attention",)),
    Family("LongCat-Flash (MLA)", ("longcat_flash",), "test_latent_attention.LATENT_FAMILIES", router_loss=NO_LOSS,
           lora_targets=MLA_LORA_TARGETS, own_exchange=("LongcatFlashMLA",)),
    Family("MiMo-V2-Flash", ("mimo_v2_flash",), "test_latent_attention.LATENT_FAMILIES", router_loss=NO_LOSS,
           own_exchange=("MiMoV2FlashAttention",)),
    Family("Gemma 4", ("gemma4_text",), "test_gemma4.GEMMA4_FAMILIES", logit_softcap=True,
           own_exchange=("Gemma4TextAttention",)),
    Family("DeepSeek-V3.2 (DSA)", ("deepseek_v32",), "test_indexed_attention.INDEXED_FAMILIES", router_loss=NO_LOSS,
           lora_targets=MLA_LORA_TARGETS, indexer=TOKEN_TOP_K),
    Family("GLM-5 (DSA)", ("glm_moe_dsa",), "test_indexed_attention.INDEXED_FAMILIES", router_loss=NO_LOSS,
           lora_targets=MLA_LORA_TARGETS, indexer=TOKEN_TOP_K),
    Family("Hy4 (DSA, hyper-connections)", ("hy_v4",), "test_indexed_attention.INDEXED_FAMILIES",
           router_loss=NO_LOSS, lora_targets=MLA_LORA_TARGETS, indexer=TOKEN_TOP_K),
    Family("dots3 (DSA, sliding MLA)", ("dots3_note_text",), "test_indexed_attention.INDEXED_FAMILIES",
           router_loss=NO_LOSS, lora_targets=MLA_LORA_TARGETS, indexer=TOKEN_TOP_K,
           own_exchange=("Dots3NoteTextAttention",)),
    Family("GLM-5.3-Flash (KDA, DSA on pooled keys, hyper-connections)", ("glm5_next_text",),
           "test_indexed_attention.INDEXED_FAMILIES", router_loss=NO_LOSS, positions=False, linear_mixer="kimi_delta",
           lora_targets=MLA_LORA_TARGETS, indexer=POOLED_TOP_K, text_head=True),
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


def linear_mixer_types(mixer_name: str) -> tuple:
    """The model types whose `linear_attention` layers this mixer builds (Family.linear_mixer): its `model_types`."""
    return types_where(lambda family: family.linear_mixer == mixer_name)


def indexed_attention_types() -> tuple:
    """The model types whose `indexed_attention` layers the indexed-attention mixer builds (Family.indexer)."""
    return types_where(lambda family: family.indexer is not None)


def llama_layout(model_type: Optional[str]) -> Optional[LlamaLayout]:
    """The Llama formula's extras for this model type, or None where the planner counts on the meta device."""
    family = family_of(model_type)
    return family.llama_layout if family else None


def default_lora_targets() -> list:
    """LoRA's default targets: USUAL_LORA_TARGETS and every record's `lora_targets`, each once, in order."""
    names = [*USUAL_LORA_TARGETS, *(t for family in FAMILIES for t in family.lora_targets)]
    return list(dict.fromkeys(names))


def family_names() -> str:
    """The families that train, for messages."""
    return ", ".join(family.name for family in FAMILIES)


def untested_family_problem(model_type: str) -> str:
    """Why a model type without a record is refused (the line check_family raises or, opted in, warns)."""
    return (f"model type {model_type!r} has no family record: it was never checked to train exactly under "
            f"sequence parallelism against its transformers forward. Families that train: {family_names()}. "
            f"Fix: one of those, or {UNTESTED_OPT_IN}: true (plan.py: --allow-untested-family) to try it untested")


def check_family(model_type: str, allow_untested: bool, layers: str = "") -> None:
    """A model type with no family record is refused in one line naming the families that train;
    `model.allow_untested_family` trains it anyway, said once (by the first rank) as a warning naming its layer kinds
    and how each is run (`layers`: mixers.untested_layers_note), since what its classes do beyond that is what was
    never checked. Called after the specific refusals (loading.check_supported_architecture), which name what
    exactly is not built or cannot be exchanged."""
    if family_of(model_type) is not None:
        return
    problem = untested_family_problem(model_type)
    if not allow_untested:
        raise ConfigError(problem + ".")
    if os.environ.get("RANK", "0") == "0":
        print(f"warning: {problem.split('. Fix:')[0]}; training it anyway ({UNTESTED_OPT_IN}: true)" +
              (f". {layers}" if layers else "") + ".", file=sys.stderr, flush=True)
