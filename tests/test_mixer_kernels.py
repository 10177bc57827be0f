"""Each mixer's kernel variant is chosen once per run (mixers.choose_mixer_kernels -> ResolvedRun.mixer_kernels) and
that one answer is what the install runs and names, what the planner plans (PlanOptions.mixer_kernels) and what the
first-use kernel notice names. Controls: another variant changes each reader's answer."""
import pytest
from helpers import NEMOTRON_H, tiny_family_config

from ulysses_train.model.mixers import MIXERS, choose_mixer_kernels, install_mixers
from ulysses_train.model.mixers.mamba2 import MAMBA2_VARIANTS
from ulysses_train.model.presets import preset_config
from ulysses_train.planner.estimate import plan
from ulysses_train.planner.options import PlanOptions, kernel_fields
from ulysses_train.planner.shapes import load_model_shape
from ulysses_train.sequence_parallel import SequenceParallel
from ulysses_train.training import first_use_kernels as fuk

NANO = "nemotron-3-nano-30b-a3b"


def test_every_mixer_with_variants_chooses_one_of_them_and_torch_off_a_gpu():
    """Off a GPU every recurrent mixer computes with transformers' torch functions (the reference); attention has no
    variants (its kernel is model.attn_implementation) and is never in the choice."""
    with_variants = [m for m in MIXERS if m.kernel_variants]
    assert {m.name for m in with_variants} == {"gated_deltanet", "kimi_delta", "mamba2"}
    for mixer in with_variants:
        assert "torch" in mixer.kernel_variants
    assert choose_mixer_kernels(load_model_shape(NANO), cuda=False) == {"mamba2": "torch"}
    assert choose_mixer_kernels(load_model_shape("qwen3-8b"), cuda=False) == {}
    # the same answer from a transformers config as from the planner's shape of it
    assert choose_mixer_kernels(preset_config("qwen3.5-9b"), False) == {"gated_deltanet": "torch"}


def test_mamba2_picks_chunk_gla_where_simple_glas_backward_is_refused(monkeypatch):
    from ulysses_train.model.mixers import mamba2

    monkeypatch.setattr(mamba2, "simple_gla_available", lambda: True)
    monkeypatch.setattr(mamba2, "simple_gla_backward_runs", lambda: False)
    assert choose_mixer_kernels(load_model_shape(NANO), cuda=True) == {"mamba2": "chunk_gla"}
    monkeypatch.setattr(mamba2, "simple_gla_backward_runs", lambda: True)  # the control
    assert choose_mixer_kernels(load_model_shape(NANO), cuda=True) == {"mamba2": "chunk_simple_gla"}


def test_the_install_runs_and_names_the_variant_it_is_given():
    """A Nemotron-H layer installed with the run's variant keeps it (its forward reads it) and the `model changes:`
    phrase names it; with no variants given, the install chooses for the model's device (CPU: torch)."""
    from transformers import AutoModelForCausalLM

    from ulysses_train.model.mixers.mamba2 import mamba2_layers

    config = tiny_family_config("nemotron_h", **NEMOTRON_H)
    model = AutoModelForCausalLM.from_config(config)
    (phrase,) = install_mixers(model, SequenceParallel(), {"mamba2": "chunk_gla"})
    assert MAMBA2_VARIANTS["chunk_gla"] in phrase and [m.kernel_variant for m in mamba2_layers(model)] == ["chunk_gla"]
    model = AutoModelForCausalLM.from_config(config)
    (phrase,) = install_mixers(model, SequenceParallel())  # the control: chosen here, on CPU
    assert MAMBA2_VARIANTS["torch"] in phrase and [m.kernel_variant for m in mamba2_layers(model)] == ["torch"]


def test_the_planner_plans_the_variant_the_run_chose():
    """Nemotron 3 Nano's Mamba2 layers as chunk_gla save per-channel fp32 decays: the plan differs from
    chunk_simple_gla's by those bytes only (the control: the same options without the choice plan the same as
    chunk_simple_gla). Records written before mixer_kernels (one flag per kernel) read as the same choice."""
    options = PlanOptions(seq_length=131072, gpus_per_node=1, sp=1)
    gla = plan(NANO, options=options.replace(mixer_kernels={"mamba2": "chunk_gla"})).gpu_allocated
    simple = plan(NANO, options=options.replace(mixer_kernels={"mamba2": "chunk_simple_gla"})).gpu_allocated
    assert gla > simple and plan(NANO, options=options).gpu_allocated == simple
    assert kernel_fields({"mamba2_channel_decay": True, "sp": 2}) == {"sp": 2, "mixer_kernels": {"mamba2": "chunk_gla"}}
    assert kernel_fields({"flash_qla": False, "sp": 2}) == {"sp": 2}


def test_the_first_use_notice_names_the_mamba2_kernel_that_runs(monkeypatch):
    """The notice once named chunk_simple_gla whatever ran; it now names the run's variant (control: the other)."""
    monkeypatch.setattr(fuk, "gpu_here", lambda: True)

    def names(variant):
        options = PlanOptions(seq_length=65536, gpus_per_node=1, sp=1, mixer_kernels={"mamba2": variant})
        return [k.name for k in fuk.kernels_for(fuk.facts_from_options(options, NANO, documents=False))]

    assert "fla's causal conv1d and chunk_gla (Mamba2)" in names("chunk_gla")
    assert "fla's causal conv1d and chunk_simple_gla (Mamba2)" in names("chunk_simple_gla")
    assert not any("Mamba2" in name for name in names("torch"))


@pytest.mark.parametrize("item", ["mamba2=chunk_gl", "attention=fa4", "gated_deltanet"])
def test_plan_refuses_a_kernel_no_mixer_has_in_one_line(item, capsys):
    from helpers import load_script

    cli = load_script("scripts/plan.py", "plan_cli")
    assert cli.main(["--model", NANO, "--seq-length", "65536", "--kernel", item, "--no-story"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"--kernel {item!r}" in err and "mamba2=torch|chunk_simple_gla|chunk_gla" in err
    # the control: a variant the registry has plans, and the short form means the same
    assert cli.main(["--model", NANO, "--seq-length", "65536", "--kernel", "mamba2=chunk_gla", "--no-story"]) == 0
    assert cli.main(["--model", NANO, "--seq-length", "65536", "--mamba2-chunk-gla", "--no-story"]) == 0
