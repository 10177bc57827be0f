"""What every token mixer (the part of a decoder layer that moves information between tokens: attention, a Gated
DeltaNet recurrence, ...) tells the rest of the package, so that adding a mixer is one module with one `Mixer`
entry in the registry (model/mixers/__init__.py), not a branch in every caller.

Kept apart from the registry so each mixer module can import it without importing the registry back."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from ulysses_train.model.architecture import text_config


@dataclass(frozen=True)
class HeadCounts:
    """The units each mixer of a model splits over sp ranks (attention's query and KV heads, a Gated DeltaNet's key
    and value heads, Mamba2's heads and groups, ...), by mixer name, the same whether they come from a transformers
    config (the trainer, eval_context.py) or from the planner's ModelShape (plan.py): one source for one rule. Each
    mixer reports its own units (Mixer.head_units) and its sp rule reads them (Mixer.sp_problem); nothing here
    knows any one mixer."""

    units: tuple = ()
    """((mixer name, ((unit name, count), ...)), ...) for every mixer the model has, in registry order."""

    @classmethod
    def of_mixers(cls, by_mixer: dict) -> "HeadCounts":
        """From {mixer name: {unit name: count}} (a mixer whose units are empty has no layers and is left out)."""
        return cls(tuple((name, tuple(units.items())) for name, units in by_mixer.items() if units))

    def __contains__(self, mixer_name: str) -> bool:
        return any(name == mixer_name for name, _ in self.units)

    def of(self, mixer_name: str) -> dict:
        """{unit name: count} of one mixer; {} when the model has none of its layers."""
        return next((dict(units) for name, units in self.units if name == mixer_name), {})

    @property
    def most(self) -> int:
        """The largest count of any unit: no sp beyond it can split that unit (valid_sp_values' default limit)."""
        return max((count for _, units in self.units for _, count in units), default=1)


@dataclass(frozen=True)
class Mixer:
    """One kind of token mixer: how it is recognised, which sp it allows, what it needs before the model loads,
    how it is installed under sp, and where its planner terms live."""

    name: str
    layer_types: tuple
    """Entries of transformers' `layer_types` this mixer builds (a config without `layer_types` is all attention)."""
    model_types: Optional[tuple]
    """Text-model types whose layers of those types it builds; None: any type."""
    module_classes: tuple
    """Class names of its modules in a built transformers model that `install` changes; () when it changes none."""
    head_units: Callable[[object], dict]
    """(text config) -> {unit name: count} of what this mixer splits over sp ranks (heads, groups); {} when the
    model has no layers of this mixer. HeadCounts carries them by mixer name to the sp rule below."""
    sp_problem: Callable[[HeadCounts, int, str], Optional[str]]
    """(counts, sp, the key that set sp) -> why sp cannot split this mixer's heads, or None. sp=1 always works."""
    sp_rule: str
    """The sp values it allows, and why (for readers and messages)."""
    check_kernels: Callable[[object, int, bool], None]
    """(hf_config, seq_length, cuda) -> None, or ConfigError when its kernels cannot run this job; runs before the
    model loads."""
    install: Callable[[object, object, str], Optional[str]]
    """(built model, its SequenceParallel, the kernel variant chosen for the run: choose_kernel) -> its phrase for
    the `model changes:` line, or None when nothing changed. Runs after the model is built (attention's own step is
    before the build: mixers/attention.py)."""
    document_restarts: str
    """How packed documents (data.packing: documents, `cu_seq_lens`) restart inside it."""
    planned: bool
    """Whether the planner has its terms: planner/mixer_terms.py MIXER_TERMS has an entry under this mixer's name
    (tests/test_mixer_registry.py checks both ways); False: the planner refuses the model (planner/shapes.py)."""
    planner_dims: Callable[[object], dict] = lambda text: {}
    """(text config) -> {dimension name: size} its planner terms read beyond head_units (head widths, state size),
    carried by ModelShape.mixer_dims under the mixer's name; {} when its terms read only shared fields."""
    planner_terms: str = ""
    """Where its planner terms (saved tensors, backward transients, exchange width) and its FLOPs live."""
    kernel_variants: dict = field(default_factory=dict)
    """{variant name: what computes the mixer then, in words} of the kernel paths it has; {} for one path chosen
    elsewhere (attention's kernel is model.attn_implementation, resolved once: ResolvedRun.attn)."""
    choose_kernel: Callable[[dict, bool], str] = lambda dims, cuda: ""
    """(its planner_dims, a GPU run) -> the kernel_variants entry this run computes with. Asked once per run
    (mixers.choose_mixer_kernels -> ResolvedRun.mixer_kernels); install, the planner (PlanOptions.mixer_kernels)
    and the first-use kernel notice read that one answer."""

    def builds(self, model_type: str, layer_type: str) -> bool:
        return layer_type in self.layer_types and (self.model_types is None or model_type in self.model_types)

    def in_model(self, hf_config) -> bool:
        """Whether some decoder layer of this config is built from this mixer."""
        text = text_config(hf_config)
        return any(self.builds(text.model_type, kind) for kind in set(layer_types_of(text)))

    def present(self, counts: HeadCounts) -> bool:
        """Whether a model with these counts has layers of this mixer (the planner's shapes carry counts only)."""
        return self.name in counts


def layer_types_of(hf_config) -> list[str]:
    """Each decoder layer's type as transformers names it: the config's `layer_types`, or (configs without it) every
    layer full attention, or sliding where the config windows every layer (Mistral's `sliding_window`). Which mixer
    (if any) a type means is the registry's answer (mixers/registry.py), never a comparison elsewhere."""
    text = text_config(hf_config)
    given = getattr(text, "layer_types", None)
    if given:
        return list(given)
    return ["sliding_attention" if has_sliding_windows(text) else "full_attention"] * text.num_hidden_layers


def module_layer_type(module) -> Optional[str]:
    """The layer type of a built attention module (its config's `layer_types` at its `layer_idx`), or None where it
    carries neither: what tells apart the layers of one attention class that different mixers build (dots3's
    indexed and sliding layers are one class)."""
    index, config = getattr(module, "layer_idx", None), getattr(module, "config", None)
    if index is None or config is None:
        return None
    types = getattr(text_config(config), "layer_types", None)
    return types[index] if types and index < len(types) else None


def has_sliding_windows(hf_config) -> bool:
    """Whether any layer attends within a sliding window: `layer_types` says so per layer; configs without it
    (Mistral's) window every layer when `sliding_window` is set and `use_sliding_window` is not false."""
    text = text_config(hf_config)
    layer_types = getattr(text, "layer_types", None)
    if layer_types:
        return "sliding_attention" in layer_types or "chunked_attention" in layer_types
    return bool(getattr(text, "sliding_window", None)) and getattr(text, "use_sliding_window", True) is not False
