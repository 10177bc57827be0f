"""The token mixers this package trains under Ulysses, one module each (attention.py, gated_deltanet.py,
kimi_delta.py), and the
functions that loop over them, so the trainer, evaluation and the planner ask one place:

- which layer types a model may hold (check_layer_types, before the model is built),
- which sp values split every mixer's heads (sp_problems, valid_sp_values, check_sp_splits_heads: plan.py,
  train.py and eval_context.py share them),
- what each needs before the model loads (check_mixer_kernels) and how each is installed (install_mixers),
- which kind the planner's terms take for each decoder layer (layer_planner_kinds).

A new mixer is one module with a `Mixer` entry (protocol.py) added to MIXERS."""
from __future__ import annotations

from typing import Optional

from ulysses_train.config import ConfigError
from ulysses_train.model.architecture import has_sliding_windows, text_config
from ulysses_train.model.mixers.attention import ATTENTION
from ulysses_train.model.mixers.gated_deltanet import GATED_DELTANET, linear_head_counts
from ulysses_train.model.mixers.kimi_delta import KIMI_DELTA, kda_head_count
from ulysses_train.model.mixers.protocol import HeadCounts, Mixer
from ulysses_train.sequence_parallel import SequenceParallel

MIXERS: tuple[Mixer, ...] = (ATTENTION, GATED_DELTANET, KIMI_DELTA)
"""Every mixer, in the order their phrases join the `model changes:` line and the planner takes their kinds."""
LEGACY_ALIASES = {"mamba": "linear_attention"}
"""Layer-type names transformers 5.24 rewrites when it reads a config (configuration_utils
`_LEGACY_LAYER_TYPE_REMAP`): a Qwen3.5 config saying "mamba" silently gets a Gated DeltaNet layer there. Refused
(check_raw_layer_types, check_layer_types), so no layer is silently another kind than its config names."""


def head_counts(model) -> HeadCounts:
    """The HeadCounts of a transformers config, or of anything that carries them (the planner's ModelShape has a
    `head_counts` property; HeadCounts itself)."""
    if isinstance(model, HeadCounts):
        return model
    if hasattr(model, "head_counts"):
        return model.head_counts
    text = text_config(model)
    heads = text.num_attention_heads
    return HeadCounts(heads, getattr(text, "num_key_value_heads", None) or heads, *linear_head_counts(text),
                      kda_heads=kda_head_count(text))


def layer_types_of(hf_config) -> list[str]:
    """Each decoder layer's type: the config's `layer_types`, or (configs without it) every layer full attention,
    or sliding where the config windows every layer (Mistral's `sliding_window`)."""
    text = text_config(hf_config)
    given = getattr(text, "layer_types", None)
    if given:
        return list(given)
    return ["sliding_attention" if has_sliding_windows(text) else "full_attention"] * text.num_hidden_layers


def mixers_of(hf_config) -> list[Mixer]:
    """The mixers the model's layers are built from."""
    text = text_config(hf_config)
    kinds = set(layer_types_of(text))
    return [mixer for mixer in MIXERS if any(mixer.builds(text.model_type, kind) for kind in kinds)]


def sp_problems(model, sp: int, key: str = "sp") -> list[str]:
    """Why sp cannot split the heads of each mixer the model has (a config, a ModelShape or HeadCounts); empty
    when it can. `key`: how the message names the setting (parallel.sequence_parallel_size, --sp)."""
    counts = head_counts(model)
    return [problem for mixer in MIXERS if mixer.present(counts)
            for problem in [mixer.sp_problem(counts, sp, key)] if problem]


def valid_sp_values(model, limit: Optional[int] = None) -> list[int]:
    """Every sp up to `limit` (default: the query heads, the most any attention can split) that splits every
    mixer's heads; never empty: sp=1 splits nothing."""
    counts = head_counts(model)
    return [sp for sp in range(1, (limit or counts.query) + 1) if not sp_problems(counts, sp)]


def check_sp_splits_heads(model, sp: int, key: str = "parallel.sequence_parallel_size") -> None:
    """Refuse an sp that some mixer cannot split, naming the first problem and the sp values that work. The
    trainer and eval_context.py (parallel/layout.validate_parallel_layout) and plan.py (key --sp) refuse alike."""
    problems = sp_problems(model, sp, key)
    if problems:
        raise ConfigError(f"{problems[0]}. Use sp in {valid_sp_values(model)}.")


def check_mixer_kernels(hf_config, seq_length: int, cuda: bool) -> None:
    """Before the model loads: each mixer's kernels can run this job (ConfigError naming the fix otherwise)."""
    for mixer in mixers_of(hf_config):
        mixer.check_kernels(hf_config, seq_length, cuda)


def install_mixers(model, sequence_parallel: SequenceParallel) -> list[str]:
    """Install every mixer on the built model (exchanging through `sequence_parallel`: size 1 without sp); one
    phrase per mixer that changed something, for the `model changes:` line."""
    return [phrase for mixer in MIXERS for phrase in [mixer.install(model, sequence_parallel)] if phrase]


def layer_planner_kinds(hf_config) -> list[str]:
    """Each decoder layer's planner kind: its type (layer_types_of) -> the mixer that builds it -> its planner_kind
    (the planner's ModelShape.kinds). A type no mixer builds is refused before (check_layer_types)."""
    text = text_config(hf_config)
    builder = {kind: next(mixer for mixer in MIXERS if mixer.builds(text.model_type, kind))
               for kind in set(layer_types_of(text))}
    return [builder[kind].planner_kind for kind in layer_types_of(text)]


def known_layer_types(model_type: Optional[str]) -> list[str]:
    """The layer types some mixer builds for this model type (None: for any model type), each once."""
    return list(dict.fromkeys(kind for mixer in MIXERS for kind in mixer.layer_types
                              if model_type is None or mixer.model_types is None or model_type in mixer.model_types))


def layer_types_problem(model_type: Optional[str], layer_types: list, num_layers: int) -> Optional[str]:
    """Why this `layer_types` cannot be built, or None: a legacy alias, a length other than the layers, a type no
    mixer builds for this model type (model_type None: for any type, the check of a config.json as written)."""
    known = known_layer_types(model_type)
    aliased = [i for i, kind in enumerate(layer_types) if kind in LEGACY_ALIASES]
    if aliased:
        names = sorted({layer_types[i] for i in aliased})
        built = sorted({LEGACY_ALIASES[name] for name in names})
        return (f"layer_types names {names} (layers {aliased}), a legacy name transformers silently reads as "
                f"{built}: a Gated DeltaNet layer in the Qwen3.5 and Qwen3-Next families, not a Mamba layer. Fix: "
                f"write 'linear_attention' where a Gated DeltaNet layer is meant (Mamba layers are not built); "
                f"known layer types: {known}")
    if len(layer_types) != num_layers:
        return (f"layer_types has {len(layer_types)} entries but num_hidden_layers={num_layers}: one entry per "
                f"decoder layer. Fix: give {num_layers} entries from {known}, or leave layer_types out")
    unknown = [i for i, kind in enumerate(layer_types) if kind not in known]
    if unknown:
        names = sorted({layer_types[i] for i in unknown})
        return (f"{'model type ' + repr(model_type) + ' has' if model_type else 'layer_types names'} layers of type "
                f"{names} (layers {unknown}), which ulysses-train does not build; known layer types"
                f"{' here' if model_type else ''}: {known}. After the Ulysses all-to-all such a layer would need its "
                f"chunks (or its own recurrence) handed to the kernel over the whole sequence; linear attention is "
                f"built for {linear_families()}")
    return None


def linear_families() -> str:
    """Which model types' `linear_attention` layers some mixer builds, by mixer, for messages."""
    return "; ".join(f"{mixer.name} layers in {', '.join(mixer.model_types)}" for mixer in MIXERS
                     if "linear_attention" in mixer.layer_types)


def check_layer_types(hf_config) -> None:
    """Refuse, before the model is built, a text config whose layer types no mixer builds (layer_types_problem),
    also after model.config_overrides (set without transformers' own checks). A config with
    `attention_chunk_size` has chunked attention layers even without `layer_types` (Llama 4)."""
    text = text_config(hf_config)
    types = list(getattr(text, "layer_types", None) or layer_types_of(text))
    if getattr(text, "attention_chunk_size", None):
        types = [*types, "chunked_attention"]
        problem = layer_types_problem(text.model_type, types, len(types))
    else:
        problem = layer_types_problem(text.model_type, types, text.num_hidden_layers)
    if problem:
        raise ConfigError(problem + ".")


def check_raw_layer_types(config_dict: dict, shown: str) -> None:
    """layer_types_problem on a config.json as written (its `text_config` for image-text releases), before
    transformers reads it: transformers rewrites legacy names silently and refuses a wrong length or an unknown
    type with a traceback. Types are checked against every mixer here (the model type is checked after)."""
    text = config_dict.get("text_config") if isinstance(config_dict.get("text_config"), dict) else config_dict
    types, layers = text.get("layer_types"), text.get("num_hidden_layers")
    if not isinstance(types, list) or not isinstance(layers, int):
        return
    problem = layer_types_problem(None, types, layers)
    if problem:
        raise ConfigError(f"{shown}: its config.json's {problem}.")
