"""A token mixer is one home, found by name: every mixer in the registry (model/mixers MIXERS) has its planner terms
registered under its name (planner/mixer_terms.py MIXER_TERMS, and every entry there a mixer), an sp rule that reads
its own units, a kernel check, and an exactness test in the gloo suite (a test module that names the mixer's module
and runs it through dist_worker's step). Each check has a negative control: a registry entry missing the part is
found."""
import dataclasses
import os

import pytest

from ulysses_train.model.mixers import MIXERS, head_counts, layer_mixer_names, layer_windows
from ulysses_train.model.mixers.protocol import HeadCounts
from ulysses_train.planner.mixer_terms import MIXER_TERMS, NO_MIXER

TESTS = os.path.dirname(__file__)
EXACTNESS_TESTS = {"attention": "test_step.py", "gated_deltanet": "test_model_families.py",
                   "kimi_delta": "test_model_families.py", "mamba2": "test_mamba2_families.py",
                   "indexed_attention": "test_indexed_attention.py"}
"""Each mixer's gloo exactness test: one step on real processes against the plain transformers model."""


def registry_gaps(mixers, terms: dict, exactness: dict) -> list[str]:
    """What a registered mixer lacks: planner terms under its name, an sp rule and head units, a kernel check, an
    exactness test that exists and launches ranks; and planner terms registered for no mixer."""
    gaps = []
    for mixer in mixers:
        if mixer.planned and mixer.name not in terms:
            gaps.append(f"{mixer.name}: no planner terms")
        if not (callable(mixer.sp_problem) and callable(mixer.head_units) and mixer.sp_rule):
            gaps.append(f"{mixer.name}: no sp rule")
        if not callable(mixer.check_kernels):
            gaps.append(f"{mixer.name}: no kernel check")
        path = os.path.join(TESTS, exactness.get(mixer.name, "-"))
        if not os.path.isfile(path) or not any(launch in open(path).read() for launch in ("run_workers", "family_step")):
            gaps.append(f"{mixer.name}: no exactness test")
    gaps += [f"{name}: planner terms of no mixer" for name in terms
             if name != NO_MIXER and name not in {m.name for m in mixers}]
    return gaps


def test_every_mixer_has_terms_an_sp_rule_a_kernel_check_and_an_exactness_test():
    assert registry_gaps(MIXERS, MIXER_TERMS, EXACTNESS_TESTS) == []
    assert all(mixer.planned for mixer in MIXERS)


def test_the_registry_check_finds_what_a_mixer_lacks():
    """Negative controls: a mixer with its terms removed, one without an exactness test, terms of a mixer that is
    not registered."""
    terms = {name: t for name, t in MIXER_TERMS.items() if name != "mamba2"}
    assert registry_gaps(MIXERS, terms, EXACTNESS_TESTS) == ["mamba2: no planner terms"]
    assert registry_gaps(MIXERS, MIXER_TERMS, {**EXACTNESS_TESTS, "kimi_delta": "test_missing.py"}) == [
        "kimi_delta: no exactness test"]
    renamed = tuple(dataclasses.replace(m, name="mamba3") if m.name == "mamba2" else m for m in MIXERS)
    assert "mamba2: planner terms of no mixer" in registry_gaps(renamed, MIXER_TERMS, EXACTNESS_TESTS)


def test_layers_without_a_token_mixer_are_first_class():
    """Nemotron-H's `mlp` and `moe` layers have no mixer: the registry says so (""), gives them window 0 (no
    attended pairs), and its head counts hold only the mixers present; its Mamba2 units are its own (heads,
    groups), read by its sp rule. Control: Qwen3's layers are all attention."""
    from helpers import NEMOTRON_H, tiny_family_config, tiny_qwen3_config

    nemotron = tiny_family_config("nemotron_h", **NEMOTRON_H)
    assert layer_mixer_names(nemotron) == ["mamba2", "", "attention", ""]
    assert layer_windows(nemotron) == [0, 0, None, 0]
    assert head_counts(nemotron) == HeadCounts.of_mixers({"attention": {"query heads": 4, "kv heads": 2},
                                                          "mamba2": {"heads": 8, "groups": 2}})
    assert layer_mixer_names(tiny_qwen3_config()) == ["attention", "attention"]


@pytest.mark.parametrize("sp,groups,problem", [(2, 2, None), (4, 2, None), (8, 8, None), (4, 3, "groups"),
                                               (3, 2, "heads")])
def test_mamba2_sp_rule_reads_its_heads_and_groups(sp, groups, problem):
    """sp divides the Mamba2 heads, and divides the groups or is a multiple of them (then repeated)."""
    from ulysses_train.model.mixers.mamba2 import MAMBA2

    counts = HeadCounts.of_mixers({"mamba2": {"heads": 24 if groups == 3 else 8, "groups": groups}})
    found = MAMBA2.sp_problem(counts, sp, "sp")
    assert (found is None) == (problem is None) and (problem is None or f" {problem}" in found), found


def test_attention_calls_without_position_ids_get_the_slice_positions(monkeypatch):
    """DeepSpeed's Ulysses entry needs `position_ids` in every attention call; a family whose model keeps them from
    its layers (Granite 4.0-H) gets the slice's own, kept by the decoder's pre-hook; a call that has them keeps its
    own (control), and before any decoder forward nothing is invented."""
    import torch

    from ulysses_train.model.mixers import attention

    seen = []
    entry = attention.with_slice_positions(lambda module, q, k, v, mask, **kw: seen.append(kw.get("position_ids")))
    monkeypatch.setattr(attention, "SLICE_POSITIONS", {})
    entry(None, 0, 0, 0, None)
    attention.SLICE_POSITIONS["ids"] = torch.arange(4)[None]
    entry(None, 0, 0, 0, None)
    entry(None, 0, 0, 0, None, position_ids=torch.arange(8)[None])
    assert seen[0] is None and torch.equal(seen[1], torch.arange(4)[None]) and seen[2].shape[-1] == 8
