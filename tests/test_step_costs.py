"""training/step_costs.py: what a step spends beyond the steady state, by cause, against what the test itself did
inside and outside the measured block (files written to the kernel caches, a child process burning CPU, the
activation offload's host buffers made in the first step and reused in the second). Each cause has a control:
the same work done before the block is not counted."""
import subprocess
import sys

import torch

from helpers import tiny_qwen3_config
from ulysses_train.model.recompute import activation_offloader_of, apply_checkpoint_levers
from ulysses_train.model.loading import enable_gradient_checkpointing
from ulysses_train.training.step_costs import StepCosts, first_step_line, measured_step

BURN = [sys.executable, "-c", "sum(range(20_000_000))"]  # ~0.3-1 s of CPU in a child process, like a compiler


def cache_env(monkeypatch, tmp_path):
    monkeypatch.delenv("ULYSSES_TRAIN_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "tilelang"))
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(tmp_path / "flash_attn"))
    (tmp_path / "triton").mkdir()
    return tmp_path / "triton"


def test_files_added_to_the_kernel_caches_inside_the_step_are_counted(monkeypatch, tmp_path):
    triton = cache_env(monkeypatch, tmp_path)
    (triton / "before.cubin").write_text("x")  # control: there before the step
    with measured_step() as costs:
        (triton / "k1").mkdir()
        (triton / "k1" / "a.cubin").write_text("x")
        (triton / "b.json").write_text("{}")
    assert costs.cache_files_added == {"Triton": 2, "TileLang": 0, "CuTe DSL": 0}
    assert costs.seconds > 0


def test_compiler_subprocess_cpu_is_counted_only_inside_the_step(monkeypatch, tmp_path):
    cache_env(monkeypatch, tmp_path)
    subprocess.run(BURN, check=True)  # control: a child that ended before the step
    with measured_step() as quiet:
        pass
    with measured_step() as busy:
        subprocess.run(BURN, check=True)
    assert quiet.compiler_cpu_s < 0.05, quiet
    assert busy.compiler_cpu_s > 0.1, busy  # CPU seconds, not wall: a busy machine does not shrink them


def test_the_offload_buffers_are_made_in_the_first_step_and_reused_in_the_second(monkeypatch, tmp_path):
    from transformers import AutoModelForCausalLM

    cache_env(monkeypatch, tmp_path)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen3_config(), dtype=torch.float32).train()
    enable_gradient_checkpointing(model)
    apply_checkpoint_levers(model, offload=True)
    ids = torch.randint(0, 256, (1, 64))
    costs = []
    for _ in range(2):
        with measured_step(model) as cost:
            model(input_ids=ids, labels=ids).loss.backward()
        costs.append(cost)
    pool = activation_offloader_of(model).pool
    assert pool.count > 0 and costs[0].pinned_alloc_s > 0
    assert costs[1].pinned_alloc_s == 0.0  # the second step takes every buffer from the pool
    assert costs[0].to_dict()["pinned_alloc_s"] == round(costs[0].pinned_alloc_s, 3)


def test_no_offload_no_pinned_seconds(monkeypatch, tmp_path):
    """Control: a model without the offload lever (and no model at all) reports none."""
    from transformers import AutoModelForCausalLM

    cache_env(monkeypatch, tmp_path)
    model = AutoModelForCausalLM.from_config(tiny_qwen3_config(), dtype=torch.float32).train()
    assert activation_offloader_of(model) is None
    ids = torch.randint(0, 256, (1, 32))
    with measured_step(model) as cost:
        model(input_ids=ids, labels=ids).loss.backward()
    assert cost.pinned_alloc_s == 0.0


def test_the_first_step_line_names_the_causes_it_found():
    compiled = StepCosts(seconds=126.3, cache_files_added={"Triton": 34, "TileLang": 78, "CuTe DSL": 0},
                         compiler_cpu_s=412.4, pinned_alloc_s=8.14)
    assert first_step_line(compiled) == (
        "first step: 126.3 s; kernels compiled on first use (Triton +34 files, TileLang +78 files; compiler processes "
        "412 CPU s; scripts/warm_kernels.py compiles them before a run); the activation offload's host buffers made "
        "and page-locked in 8.1 s. Later steps reuse them.")
    warm = StepCosts(seconds=66.3, cache_files_added={"Triton": 0, "TileLang": 0}, compiler_cpu_s=0.2)
    assert first_step_line(warm) == "first step: 66.3 s; no kernel compiled (the caches were warm). Later steps reuse them."
    # a compile that wrote no file (FlashAttention 4 with its disk cache off) still shows as compiler time
    assert "kernels compiled on first use (no cache file; compiler processes 30 CPU s" in first_step_line(
        StepCosts(seconds=90.0, cache_files_added={"Triton": 0}, compiler_cpu_s=30.0))


def test_the_trainer_measures_only_its_first_step_and_only_on_gpus(monkeypatch):
    import contextlib
    import types

    from ulysses_train.training import loop

    stub = types.SimpleNamespace(start_step=3, rank=0, engine=types.SimpleNamespace(module=torch.nn.Linear(2, 2)))
    monkeypatch.setattr(loop, "cuda_training", lambda: False)
    assert isinstance(loop.Trainer._first_step_costs(stub, 3), contextlib.nullcontext)  # CPU: nothing compiles
    monkeypatch.setattr(loop, "cuda_training", lambda: True)
    monkeypatch.setattr(loop.torch.cuda, "synchronize", lambda: None)
    with loop.Trainer._first_step_costs(stub, 3) as costs:  # the first step of this process (a resumed run's too)
        pass
    assert isinstance(costs, StepCosts) and costs.seconds >= 0
    assert isinstance(loop.Trainer._first_step_costs(stub, 4), contextlib.nullcontext)  # control: a later step
    stub.rank = 1
    assert isinstance(loop.Trainer._first_step_costs(stub, 3), contextlib.nullcontext)  # and another rank
