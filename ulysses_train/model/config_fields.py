"""A model config's own numbers, checked before anything reads them: the widths and counts that size its tensors, its
heads, its RoPE parameters and its per-layer lists.

A config.json edited by hand (or a `model.config_overrides` typo) can hold a value transformers takes without a word
and fails on later: a value head of width 0 (a reshape error at step 1), more KV heads than query heads (a size
mismatch at step 1, after plan.py said it fits), YaRN without its `factor` or with a `mscale` that is not a number
(a KeyError or TypeError where the rotary table is built), a `no_rope_layers` list shorter than the model (an
IndexError while building it). `check_model_fields` names each in one line with the key and the fix, and every
entry point runs it (loading.check_supported_architecture: train.py, plan.py, warm_kernels.py, eval_context.py).

Keys are read by name whatever the model type (a key a config does not have is not checked), so a family added
later is checked without an edit here; tests/test_config_fields.py walks every family record's transformers config to
keep PER_LAYER_LISTS complete.
"""
from __future__ import annotations

import math
from typing import Any, Optional

from ulysses_train.errors import ConfigError
from ulysses_train.model.architecture import layer_configs, text_config
from ulysses_train.user_input import brief, one_line

POSITIVE_WIDTHS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers", "vocab_size",
                   "num_attention_heads", "num_key_value_heads", "head_dim", "global_head_dim", "v_head_dim",
                   "kv_lora_rank", "q_lora_rank", "moe_latent_size", "index_n_heads", "index_head_dim", "index_topk",
                   "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                   "mamba_num_heads", "mamba_head_dim", "ssm_state_size")
"""Widths and counts that must be whole numbers > 0 wherever a config sets them (None: the key's own default)."""
NON_NEGATIVE_WIDTHS = ("qk_nope_head_dim", "qk_rope_head_dim", "first_k_dense_replace", "num_kv_shared_layers")
"""Widths and counts where 0 has a meaning (no rotary part of a latent head, no dense first layers)."""
HEAD_GROUPS = (("num_attention_heads", "num_key_value_heads"), ("linear_num_value_heads", "linear_num_key_heads"))
"""(query or value heads, the heads they share): each KV head serves a whole group of query heads, so the second
count must divide the first."""
PER_LAYER_LISTS = ("no_rope_layers", "mlp_layer_types", "indexer_types", "num_attention_heads_per_layer")
"""Lists with one entry per layer beside `layer_types` (whose entries mixers.check_layer_types checks)."""
LAYER_INDEX_LISTS = ("mlp_only_layers", "moe_layers")
"""Lists of layer indices (each from 0 to num_hidden_layers - 1): Llama 4's `moe_layers` holds one for every layer
where experts sit in every layer."""
ROPE_NUMBERS = ("rope_theta", "factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
                "beta_slow", "mscale", "mscale_all_dim", "partial_rotary_factor", "low_freq_factor",
                "high_freq_factor")
"""The RoPE parameters that are numbers (transformers only logs a warning for another value, then fails on it)."""
ROPE_POSITIVE = ("rope_theta", "factor", "original_max_position_embeddings")
FIX = "Fix: use the config.json the model was released with, or correct the key there or in model.config_overrides"


def check_model_fields(hf_config) -> None:
    """ConfigError, one line naming the key and the fix, for the first malformed width, head count, RoPE parameter
    or per-layer list of the text model's config (its per-layer views too: Gemma 4's full-attention layers)."""
    text = text_config(hf_config)
    problems = [found for view in _views(text) for found in (width_problem(view), head_group_problem(view))]
    problems += [padding_problem(text), rope_problem(text), per_layer_problem(text, _field(text, "num_hidden_layers"))]
    problem = next((found for found in problems if found), "")
    if problem:
        raise ConfigError(f"the model config's {problem}. {FIX}.")


def error_text(err: BaseException) -> str:
    """A library's exception on one line, without the quotes str() puts around a KeyError's message."""
    return one_line(err).strip('"')


def _field(config, key: str) -> Any:
    """`config.key`, or None where it has none (a heterogeneous config raises for a key its layers set)."""
    try:
        return getattr(config, key, None)
    except (AttributeError, ValueError, KeyError, RuntimeError):  # RuntimeError: transformers' per-layer access
        return None


def _views(text) -> list:
    """The text config and each distinct per-layer view of it (one: the config itself, where layers share it)."""
    try:
        views = [text, *layer_configs(text)]
    except (AttributeError, TypeError, ValueError):  # a layer count that is not a number: width_problem names it
        views = [text]
    return list({id(view): view for view in views}.values())


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def width_problem(config) -> str:
    """The first width or count that is not a whole number at least its least value (or a list of them, one a
    layer). A latent-attention config's `head_dim` may be 0 (GLM-5.3-Flash's default): its heads' widths are qk_nope/qk_rope_head_dim and v_head_dim."""
    for key in POSITIVE_WIDTHS + NON_NEGATIVE_WIDTHS:
        value = _field(config, key)
        least = 0 if key == "head_dim" and _field(config, "kv_lora_rank") else 1 if key in POSITIVE_WIDTHS else 0
        per_layer = isinstance(value, (list, tuple)) and value  # Gemma 3n's intermediate_size, one a layer
        if value is not None and not all(_whole(v) and v >= least for v in (value if per_layer else [value])):
            return f"{key}={brief(value)} must be a whole number {'> 0' if least else '>= 0'}"
    return ""


def padding_problem(text) -> str:
    """A `pad_token_id` outside the vocabulary: transformers builds the embedding with it as `padding_idx`, which
    torch refuses with a bare AssertionError (a config whose vocabulary was cut without its token ids)."""
    pad, vocab = _field(text, "pad_token_id"), _field(text, "vocab_size")
    if _whole(pad) and _whole(vocab) and not 0 <= pad < vocab:
        return f"pad_token_id={pad} is not a token of its vocab_size={vocab} (the embedding's padding row)"
    return ""


def head_group_problem(config) -> str:
    for many, shared in HEAD_GROUPS:
        heads, groups = _field(config, many), _field(config, shared)
        if _whole(heads) and _whole(groups) and heads > 0 and groups > 0 and heads % groups:
            relation = "is more than" if groups > heads else "does not divide"
            return (f"{shared}={groups} {relation} {many}={heads}: each of the {shared} serves a whole group of "
                    f"the {many}, so it must divide {many}")
    return ""


def rope_problem(text) -> str:
    """The RoPE parameters complete (transformers' own validate_rope: the keys each rope_type needs) and numeric."""
    validate = getattr(text, "validate_rope", None)
    if callable(validate):
        try:
            validate()
        except (KeyError, ValueError, TypeError) as err:
            return f"rope_parameters are incomplete or invalid ({error_text(err)})"
    for where, parameters in rope_parameter_sets(_field(text, "rope_parameters")):
        for key in ROPE_NUMBERS:
            value = parameters.get(key)
            if value is None:
                continue
            number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not number or (key in ROPE_POSITIVE and value <= 0):
                return f"rope_parameters{where}.{key}={brief(value)} must be a finite number" + \
                    (" > 0" if key in ROPE_POSITIVE else "")
    return ""


def rope_parameter_sets(parameters) -> list[tuple[str, dict]]:
    """(where, dict) for each RoPE parameter set: one, or one per layer type (Gemma's {"full_attention": {...}})."""
    if not isinstance(parameters, dict):
        return []
    nested = {key: value for key, value in parameters.items() if isinstance(value, dict)}
    if nested:
        return [(f"[{key!r}]", value) for key, value in nested.items()]
    return [("", parameters)]


def per_layer_problem(text, layers: Optional[int]) -> str:
    if not _whole(layers):
        return ""
    for key in PER_LAYER_LISTS:
        value = _field(text, key)
        if value is not None and (not isinstance(value, (list, tuple)) or len(value) != layers):
            count = f"{len(value)} entries" if isinstance(value, (list, tuple)) else brief(value)
            return f"{key} has {count}, where num_hidden_layers={layers} needs one per layer"
    for key in LAYER_INDEX_LISTS:
        value = _field(text, key)
        if value is not None and (not isinstance(value, (list, tuple)) or
                                  not all(_whole(i) and 0 <= i < layers for i in value)):
            return f"{key}={brief(value)} must list layer indices from 0 to {layers - 1} (num_hidden_layers={layers})"
    return ""
