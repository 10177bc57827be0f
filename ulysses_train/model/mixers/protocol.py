"""What every token mixer (the part of a decoder layer that moves information between tokens: attention, a Gated
DeltaNet recurrence, ...) tells the rest of the package, so that adding a mixer is one module with one `Mixer`
entry in the registry (model/mixers/__init__.py), not a branch in every caller.

Kept apart from the registry so each mixer module can import it without importing the registry back."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class HeadCounts:
    """The head counts the sp rules read, the same whether they come from a transformers config (the trainer,
    eval_context.py) or from the planner's ModelShape (plan.py): one source for one rule."""

    query: int
    kv: int
    linear_key: int = 0
    """Gated DeltaNet key heads; 0 when the model has no Gated DeltaNet layers."""
    linear_value: int = 0
    kda_heads: int = 0
    """Kimi Delta Attention heads (as many key as value heads); 0 when the model has no such layers."""


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
    present: Callable[[HeadCounts], bool]
    """Whether a model with these head counts has layers of this mixer (the planner's shapes carry counts only)."""
    sp_problem: Callable[[HeadCounts, int, str], Optional[str]]
    """(counts, sp, the key that set sp) -> why sp cannot split this mixer's heads, or None. sp=1 always works."""
    sp_rule: str
    """The sp values it allows, and why (for readers and messages)."""
    check_kernels: Callable[[object, int, bool], None]
    """(hf_config, seq_length, cuda) -> None, or ConfigError when its kernels cannot run this job; runs before the
    model loads."""
    install: Callable[[object, object], Optional[str]]
    """(built model, its SequenceParallel) -> its phrase for the `model changes:` line, or None when nothing changed.
    Runs after the model is built (attention's own step is before the build: mixers/attention.py)."""
    document_restarts: str
    """How packed documents (data.packing: documents, `cu_seq_lens`) restart inside it."""
    planner_kind: str
    """The kind the planner's per-layer terms take: its key in planner/mixer_terms.py MIXER_TERMS, and each of its
    layers' entry in ModelShape.kinds; "" when the planner has no terms for it yet (it then refuses the model:
    planner/shapes.py)."""
    planner_terms: str
    """Where its planner terms (saved tensors, backward transients, exchange width) and its FLOPs live."""

    def builds(self, model_type: str, layer_type: str) -> bool:
        return layer_type in self.layer_types and (self.model_types is None or model_type in self.model_types)
