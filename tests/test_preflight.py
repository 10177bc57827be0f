"""The trainer's memory preflight: refuses, before any weight loads, a run the planner says cannot fit."""
import pytest
import torch

from ulysses_train.config import Config, DataConfig, ModelConfig, ParallelConfig
from ulysses_train.model.presets import qwen3_config
from ulysses_train.parallel.layout import ParallelDims
from ulysses_train.planner import PlanError
from ulysses_train.training import step as engine_module
from ulysses_train.training.resolved_run import ResolvedRun


def preflight(monkeypatch, seq_length, sp, gpu_gib, host_gib, world=8):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)  # a GPU run (DS_ACCELERATOR=cpu would train on the CPU)
    monkeypatch.setattr("ulysses_train.planner.detect_hardware",
                        lambda: {"gpu_memory_gib": gpu_gib, "host_memory_gib": host_gib})
    cfg = Config(model=ModelConfig(name_or_path="Qwen/Qwen3-8B"), data=DataConfig(source="x", seq_length=seq_length),
                 parallel=ParallelConfig(sequence_parallel_size=sp))
    ds = {"zero_optimization": {"stage": 3}, "activation_checkpointing": {"cpu_checkpointing": False}}
    dims = ParallelDims(world_size=world, sp=sp, gpus_per_node=8)
    engine_module.preflight_memory_check(ResolvedRun(cfg=cfg, hf_config=qwen3_config("qwen3-8b"), rope=None,
                                                     attn="sdpa", dims=dims, ds=ds))


def test_million_tokens_without_sp_is_refused_with_size_and_fix(monkeypatch):
    with pytest.raises(PlanError) as err:
        preflight(monkeypatch, 1_048_576, sp=1, gpu_gib=141, host_gib=560)
    message = str(err.value)
    assert "does not fit" in message and "GPU memory" in message and "over by" in message
    assert "Cheapest change that fits" in message


def test_fitting_run_passes(monkeypatch):
    preflight(monkeypatch, 32_768, sp=8, gpu_gib=141, host_gib=560)  # negative control: no error


def test_cpu_run_is_not_checked(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = Config(model=ModelConfig(name_or_path="Qwen/Qwen3-8B"), data=DataConfig(source="x", seq_length=10**7))
    engine_module.preflight_memory_check(ResolvedRun(cfg=cfg, hf_config=qwen3_config("qwen3-8b"), rope=None,
                                                     attn="sdpa", dims=ParallelDims(world_size=1, sp=1), ds={}))
