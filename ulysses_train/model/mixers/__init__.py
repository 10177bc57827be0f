"""The registry of token mixers (the part of a decoder layer that moves information between tokens), one module
each (attention.py, gated_deltanet.py, kimi_delta.py, mamba2.py; the plumbing the recurrent ones share in
recurrent.py), and the functions that loop over them, so the trainer, evaluation and the planner ask one place:

- which mixer (or none: a layer with only an MLP or only experts) builds each decoder layer (layer_mixers), and
  the questions that follow from it (layer_windows, attention_layer_indices); nothing outside this package
  compares layer-type strings,
- which layer types a model may hold (check_layer_types, before the model is built),
- which sp values split every mixer's units (sp_problems, valid_sp_values, check_sp_splits_heads: plan.py,
  train.py and eval_context.py share them),
- what each needs before the model loads (check_mixer_kernels) and how each is installed (install_mixers).

A new mixer is one module with a `Mixer` entry (protocol.py) added to MIXERS, its planner terms registered under
its name (planner/mixer_terms.py) and its exactness test (tests/test_mixer_registry.py checks all four).
docs/adding_a_mixer.md is the recipe."""
from __future__ import annotations

from typing import Optional

from ulysses_train.config import ConfigError
from ulysses_train.model.architecture import text_config
from ulysses_train.families import FAMILIES
from ulysses_train.model.mixers.attention import ATTENTION, attention_chunk_problem
from ulysses_train.model.mixers.gated_deltanet import GATED_DELTANET
from ulysses_train.model.mixers.indexed_attention import INDEXED_ATTENTION, indexer_score_widths
from ulysses_train.model.mixers.kimi_delta import KIMI_DELTA
from ulysses_train.model.mixers.mamba2 import MAMBA2
from ulysses_train.model.mixers.protocol import HeadCounts, Mixer, has_sliding_windows, layer_types_of
from ulysses_train.model.presets import NEMOTRON_H_PATTERN
from ulysses_train.sequence_parallel import SequenceParallel

MIXERS: tuple[Mixer, ...] = (ATTENTION, GATED_DELTANET, KIMI_DELTA, MAMBA2, INDEXED_ATTENTION)
"""Every mixer, in the order their phrases join the `model changes:` line and the planner takes their terms."""
MIXERLESS_LAYER_TYPES = {t: family.mixerless_layers for family in FAMILIES if family.mixerless_layers
                         for t in family.model_types}
"""Model type -> its layer types that hold no token mixer (family records: Nemotron-H's blocks, a dense MLP only,
experts only). They are first-class layers: per token, so exact on any slice, planned with no mixer terms."""
LEGACY_ALIASES = {"mamba": ("linear_attention", MAMBA2), "attention": ("full_attention", ATTENTION)}
"""Layer-type names transformers 5.24 rewrites when it reads a config (configuration_utils
`_LEGACY_LAYER_TYPE_REMAP`) -> (the name it writes, the mixer the old name means). Granite 4.0-H's config.json says
"mamba" and gets a Mamba2 layer: accepted. A Qwen3.5 config saying "mamba" would silently get a Gated DeltaNet layer:
refused (layer_types_problem), so no layer is silently another kind than its config names."""


def head_counts(model) -> HeadCounts:
    """The HeadCounts of a transformers config (each of its mixers' own units), or of anything that carries them
    (the planner's ModelShape has a `head_counts` property; HeadCounts itself)."""
    if isinstance(model, HeadCounts):
        return model
    if hasattr(model, "head_counts"):
        return model.head_counts
    text = text_config(model)
    return HeadCounts.of_mixers({mixer.name: mixer.head_units(text) for mixer in MIXERS})


def mixer_of_layer(model_type: str, layer_type: str) -> Optional[Mixer]:
    """The mixer that builds a layer of this type in this model type; None for a layer without a token mixer
    (MIXERLESS_LAYER_TYPES) or a type no mixer builds (refused before the build: check_layer_types)."""
    return next((mixer for mixer in MIXERS if mixer.builds(model_type, layer_type)), None)


def layer_mixers(hf_config) -> list[Optional[Mixer]]:
    """Each decoder layer's mixer (None: a layer with only an MLP or only experts)."""
    text = text_config(hf_config)
    return [mixer_of_layer(text.model_type, kind) for kind in layer_types_of(text)]


def layer_mixer_names(hf_config) -> list[str]:
    """Each decoder layer's mixer name, "" for a layer without one: the planner's ModelShape.kinds, whose terms
    planner/mixer_terms.py registers under the same names."""
    return [mixer.name if mixer else "" for mixer in layer_mixers(hf_config)]


def untested_layers_note(hf_config) -> str:
    """The layer kinds of a model tried without a family record and how each runs under sequence parallelism, for
    the opt-in's warning: "Its layers: 26 full_attention (the attention mixer); ...". A kind no mixer builds was
    refused before (check_layer_types)."""
    from collections import Counter

    text = text_config(hf_config)
    counts = Counter(layer_types_of(text))
    parts = []
    for kind, count in counts.items():
        mixer = mixer_of_layer(text.model_type, kind)
        how = f"the {mixer.name} mixer" if mixer else "no token mixer: per token"
        parts.append(f"{count} {kind} ({how})")
    return (f"Its layers: {', '.join(parts)}; under sp > 1 each attention layer is exchanged as softmax attention "
            f"over q, k and v, so anything else its attention class computes is what was not checked")


def mixers_of(hf_config) -> list[Mixer]:
    """The mixers the model's layers are built from, in registry order."""
    present = {mixer.name for mixer in layer_mixers(hf_config) if mixer}
    return [mixer for mixer in MIXERS if mixer.name in present]


def layer_windows(hf_config) -> list:
    """Each decoder layer's attention window (the keys a query sees, itself included): None for full attention,
    the config's `sliding_window` for a sliding layer, half its `attention_chunk_size` for a chunked one (Llama 4: a
    query sees its chunk's earlier keys, half the chunk on average), `index_topk` for an indexed layer (each query
    attends to that many chosen keys), 0 for a layer without attention (a recurrence is per token, under 1% of the weights' 2·N per
    token at Qwen3.5-9B's shapes and not counted; an MLP-only layer has no pairs): what the FLOP count charges
    (model/flops.py)."""
    text = text_config(hf_config)
    window = getattr(text, "sliding_window", None)
    if not getattr(text, "layer_types", None):
        return [window if has_sliding_windows(text) else None] * text.num_hidden_layers
    chunk = getattr(text, "attention_chunk_size", None)
    return [text.index_topk if mixer is INDEXED_ATTENTION else 0 if mixer is not ATTENTION
            else window if kind == "sliding_attention" else max(1, chunk // 2) if kind == "chunked_attention" else None
            for kind, mixer in zip(layer_types_of(text), layer_mixers(text))]


def layer_indexer_widths(hf_config) -> list:
    """Each decoder layer's indexer multiply-adds per (query, key) pair it scores (every earlier key of the
    query's document); 0 for a layer without an indexer: what the FLOP count charges the indexers."""
    return indexer_score_widths(text_config(hf_config))


def attention_layer_indices(hf_config) -> Optional[list]:
    """Indices of the layers that run an attention kernel where some do not (a hybrid's recurrent or MLP-only
    layers); None when every layer does (or no config is known: a stand-in model's layers all attend)."""
    if hf_config is None:
        return None
    mixers = layer_mixers(hf_config)
    if all(mixer is ATTENTION for mixer in mixers):
        return None
    return [i for i, mixer in enumerate(mixers) if mixer is ATTENTION]


def sp_problems(model, sp: int, key: str = "sp") -> list[str]:
    """Why sp cannot split the heads of each mixer the model has (a config, a ModelShape or HeadCounts); empty
    when it can. `key`: how the message names the setting (parallel.sequence_parallel_size, --sp)."""
    counts = head_counts(model)
    return [problem for mixer in MIXERS if mixer.present(counts)
            for problem in [mixer.sp_problem(counts, sp, key)] if problem]


def valid_sp_values(model, limit: Optional[int] = None) -> list[int]:
    """Every sp up to `limit` (default: the largest unit count, the most any mixer can split) that splits every
    mixer's units; never empty: sp=1 splits nothing."""
    counts = head_counts(model)
    return [sp for sp in range(1, (limit or counts.most) + 1) if not sp_problems(counts, sp)]


def check_sp_splits_heads(model, sp: int, key: str = "parallel.sequence_parallel_size") -> None:
    """Refuse an sp that some mixer cannot split, naming the first problem and the sp values that work. The
    trainer and eval_context.py (parallel/layout.validate_parallel_layout) and plan.py (key --sp) refuse alike."""
    problems = sp_problems(model, sp, key)
    if problems:
        raise ConfigError(f"{problems[0]}. Use sp in {valid_sp_values(model)}.")


def valid_head_chunks(model, sp: int) -> list[int]:
    """Every model.attention_head_chunks that splits the heads each of sp ranks runs (attention.py
    attention_chunk_problem); [1] for a model without attention. The planner's `auto` tries these."""
    counts = head_counts(model)
    units = counts.of("attention")
    rank_heads = units["query heads"] // sp if units else 1
    return [n for n in range(1, rank_heads + 1) if not attention_chunk_problem(counts, sp, n)]


def check_head_chunks(model, sp: int, chunks: int, key: str = "model.attention_head_chunks") -> None:
    """Refuse head chunks that do not split the heads a rank runs, naming the values that do."""
    problem = attention_chunk_problem(head_counts(model), sp, chunks)
    if problem:
        raise ConfigError(f"{problem.replace('model.attention_head_chunks', key)}. Use one of "
                          f"{valid_head_chunks(model, sp)}.")


def check_mixer_kernels(hf_config, seq_length: int, cuda: bool) -> None:
    """Before the model loads: each mixer's kernels can run this job (ConfigError naming the fix otherwise)."""
    for mixer in mixers_of(hf_config):
        mixer.check_kernels(hf_config, seq_length, cuda)


def choose_mixer_kernels(model, cuda: bool) -> dict:
    """{mixer name: kernel variant} for each mixer of the model (a config, or the planner's ModelShape) that has
    kernel variants, each mixer's choose_kernel asked once: a run keeps the answer (ResolvedRun.mixer_kernels) and
    install_mixers, the planner (PlanOptions.mixer_kernels) and the first-use kernel notice read it. `cuda`: a GPU
    run (device.cuda_training)."""
    if hasattr(model, "head_counts"):  # the planner's ModelShape: its dims per mixer
        counts, dims_of = model.head_counts, lambda mixer: model.dims(mixer.name)
    else:
        text = text_config(model)
        counts, dims_of = head_counts(text), lambda mixer: mixer.planner_dims(text)
    return {mixer.name: mixer.choose_kernel(dims_of(mixer), cuda) for mixer in MIXERS
            if mixer.kernel_variants and mixer.present(counts)}


def install_mixers(model, sequence_parallel: SequenceParallel, mixer_kernels: Optional[dict] = None) -> list[str]:
    """Install every mixer on the built model (exchanging through `sequence_parallel`: size 1 without sp) with its
    kernel variant of `mixer_kernels` (default: choose_mixer_kernels for the model's device); one phrase per mixer
    that changed something, for the `model changes:` line."""
    if mixer_kernels is None:
        mixer_kernels = choose_mixer_kernels(model.config, model.device.type == "cuda")
    return [phrase for mixer in MIXERS
            for phrase in [mixer.install(model, sequence_parallel, mixer_kernels.get(mixer.name, ""))] if phrase]


def known_layer_types(model_type: Optional[str]) -> list[str]:
    """The layer types some mixer builds for this model type and its mixerless ones (model type None: those some
    mixer builds for any model type), each once."""
    built = [kind for mixer in MIXERS for kind in mixer.layer_types
             if model_type is None or mixer.model_types is None or model_type in mixer.model_types]
    mixerless = [kind for family, kinds in MIXERLESS_LAYER_TYPES.items() for kind in kinds if family == model_type]
    return list(dict.fromkeys(built + mixerless))


def misread_aliases(model_type: Optional[str], layer_types: list) -> list[int]:
    """Layers named by a legacy alias that transformers would build as another mixer than the alias means (any
    alias when the model type is unknown and the alias means a mixer no type-free builder has)."""
    def misread(kind: str) -> bool:
        written, meant = LEGACY_ALIASES[kind]
        if model_type is None:
            return meant.model_types is not None and written not in ATTENTION.layer_types
        return mixer_of_layer(model_type, written) is not meant
    return [i for i, kind in enumerate(layer_types) if kind in LEGACY_ALIASES and misread(kind)]


def layer_types_problem(model_type: Optional[str], layer_types: list, num_layers: int) -> Optional[str]:
    """Why this `layer_types` cannot be built, or None: a legacy alias, a length other than the layers, a type no
    mixer builds for this model type (model_type None: for any type, the check of a config.json as written)."""
    known = known_layer_types(model_type)
    aliased = misread_aliases(model_type, layer_types)
    if aliased:
        names = sorted({layer_types[i] for i in aliased})
        built = sorted({LEGACY_ALIASES[name][0] for name in names})
        return (f"layer_types names {names} (layers {aliased}), a legacy name transformers silently reads as "
                f"{built}: a Gated DeltaNet layer in the Qwen3.5 and Qwen3-Next families, not a Mamba layer. Fix: "
                f"write 'linear_attention' where a Gated DeltaNet layer is meant (Mamba2 layers are built only in "
                f"{', '.join(MAMBA2.model_types)}); known layer types: {known}")
    layer_types = [LEGACY_ALIASES[kind][0] if kind in LEGACY_ALIASES else kind for kind in layer_types]
    if len(layer_types) != num_layers:
        return (f"layer_types has {len(layer_types)} entries but num_hidden_layers={num_layers}: one entry per "
                f"decoder layer. Fix: give {num_layers} entries from {known}, or leave layer_types out")
    unknown = [i for i, kind in enumerate(layer_types) if kind not in known]
    if unknown:
        names = sorted({layer_types[i] for i in unknown})
        return (f"{'model type ' + repr(model_type) + ' has' if model_type else 'layer_types names'} layers of type "
                f"{names} (layers {unknown}), which ulysses-train does not build; known layer types"
                f"{' here' if model_type else ''}: {known}. After the Ulysses all-to-all such a layer would need its "
                f"own mask (or its own recurrence) handed to the kernel over the whole sequence; linear attention is "
                f"built for {linear_families()}")
    return None


def linear_families() -> str:
    """Which model types' `linear_attention` layers some mixer builds, by mixer, for messages."""
    return "; ".join(f"{mixer.name} layers in {', '.join(mixer.model_types)}" for mixer in MIXERS
                     if "linear_attention" in mixer.layer_types)


def check_layer_types(hf_config) -> None:
    """Refuse, before the model is built, a text config whose layer types no mixer builds (layer_types_problem),
    also after model.config_overrides (set without transformers' own checks). Llama 4's chunked layers are the ones
    its `layer_types` names, as its own forward reads them."""
    text = text_config(hf_config)
    types = list(getattr(text, "layer_types", None) or layer_types_of(text))
    problem = layer_types_problem(text.model_type, types, text.num_hidden_layers)
    if not problem and "chunked_attention" in types and not getattr(text, "attention_chunk_size", None):
        problem = (f"model type {text.model_type!r} has chunked_attention layers but no attention_chunk_size, so "
                   f"their chunks are unknown. Fix: set attention_chunk_size, or make them full_attention layers")
    if problem:
        raise ConfigError(problem + ".")


PER_LAYER_KEYS = ("layer_types", "layers_block_type", "hybrid_override_pattern", "mtp_layers_block_type",
                  "mtp_hybrid_override_pattern")
"""The config.json keys that list a layer type per layer (the `mtp_` ones: the multi-token-prediction layers)."""


def raw_per_layer_lists(text: dict) -> tuple[list, str]:
    """Each per-layer list a config.json gives, as (key, [layer type, ...]), patterns read letter by letter; a
    ConfigError-worthy problem (an unknown pattern letter) as the second value, else ""."""
    lists = []
    for key in PER_LAYER_KEYS:
        value = text.get(key)
        if isinstance(value, str):
            unknown = sorted({letter for letter in value if letter not in NEMOTRON_H_PATTERN})
            if unknown:
                letters = ", ".join(f"{k} ({v})" for k, v in NEMOTRON_H_PATTERN.items())
                return lists, (f"{key} {value!r} has the letter(s) {unknown}, which name no layer type; each letter is "
                               f"one layer: {letters}")
            value = [NEMOTRON_H_PATTERN[letter] for letter in value]
        if isinstance(value, list):
            lists.append((key, value))
    return lists, ""


def check_raw_layer_types(config_dict: dict, shown: str) -> None:
    """layer_types_problem on a config.json as written (its `text_config` for image-text releases), before
    transformers reads it: transformers rewrites legacy names silently, refuses a wrong length or an unknown type
    with a traceback, and for Nemotron-H takes the layer count from `layers_block_type` (or its letter pattern)
    whatever `num_hidden_layers` says. Every per-layer key is checked (PER_LAYER_KEYS; the multi-token-prediction
    layers' against their own length), types against every mixer (the model type is checked after)."""
    text = config_dict.get("text_config") if isinstance(config_dict.get("text_config"), dict) else config_dict
    model_type = text.get("model_type")
    lists, problem = raw_per_layer_lists(text)
    for key, types in lists:
        if problem:
            break
        layers = text.get("num_hidden_layers")
        layers = layers if isinstance(layers, int) and not key.startswith("mtp") else len(types)
        problem = layer_types_problem(model_type if model_type in MAMBA2.model_types else None, types, layers)
        problem = problem and problem.replace("layer_types", key)
    if problem:
        raise ConfigError(f"{shown}: its config.json's {problem}.")
