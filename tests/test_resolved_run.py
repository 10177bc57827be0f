"""The run resolved once (training/resolved_run.py): sp's number, the kernel, the RoPE decision and the DeepSpeed
dict come out of one call into a frozen object, and what reads it (the run's identity) does not decide again.
The identity equals the one earlier versions recorded (RoPE applied to a copy of the unscaled config), so their
checkpoints still resume; negative control: the identity without the RoPE decision differs."""
import dataclasses

import pytest

from helpers import tiny_qwen3_config


def resolved(seq_length: int):
    from ulysses_train.config import load_config
    from ulysses_train.training.resolved_run import resolve_run

    cfg = load_config(None, [f"data.seq_length={seq_length}", "parallel.sequence_parallel_size=auto",
                             "model.attn_implementation=auto"])
    return resolve_run(cfg, tiny_qwen3_config(max_position_embeddings=4096))


def test_resolve_run_decides_each_thing_once_into_a_frozen_run():
    from ulysses_train.model.rope import apply_rope_scaling
    from ulysses_train.training.run_identity import run_identity

    run = resolved(8192)  # twice the model's 4,096 positions: rope_scaling auto turns YaRN on
    assert run.cfg.parallel.sequence_parallel_size == 1 and run.dims.sp == 1 and run.dims.world_size == 1
    assert run.attn == "sdpa"  # auto without a GPU
    assert run.hf_config.rope_parameters["rope_type"] == "yarn" and run.hf_config.rope_parameters["factor"] == 2.0
    assert "yarn" in str(run.rope).lower()
    assert run.ds["train_micro_batch_size_per_gpu"] == 1 and run.ds["zero_optimization"]["stage"] == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.attn = "fa4"
    identity = run_identity(run.cfg, run.hf_config, {"source": "demo"})
    assert identity["rope_parameters"]["rope_type"] == "yarn" and identity["seq_length"] == 8192
    earlier = tiny_qwen3_config(max_position_embeddings=4096)  # how earlier versions computed it
    apply_rope_scaling(earlier, 8192, "auto", None)
    assert run_identity(run.cfg, earlier, {"source": "demo"}) == identity
    unscaled = run_identity(run.cfg, tiny_qwen3_config(max_position_embeddings=4096), {"source": "demo"})
    assert unscaled != identity


def test_a_length_the_model_covers_leaves_rope_alone():
    run = resolved(2048)
    assert run.hf_config.rope_parameters.get("rope_type", "default") == "default"


def test_the_planner_shape_is_built_once_and_kept_with_the_run(monkeypatch):
    """The planner's ModelShape (built on the meta device for most families) is built once, by resolve_run, and
    what plans the run later reads it from the run: the memory preflight (faked onto a GPU) and the first-use
    kernel notice build no other. Control: the old path, planning from the transformers config, builds it again."""
    import torch

    from ulysses_train.planner import shapes
    from ulysses_train.training import first_use_kernels, step

    built = []
    real = shapes.ModelShape.from_hf_config.__func__
    monkeypatch.setattr(shapes.ModelShape, "from_hf_config",
                        classmethod(lambda cls, *a, **kw: built.append(1) or real(cls, *a, **kw)))
    run = resolved(4096)
    assert len(built) == 1 and run.shape.layers == run.hf_config.num_hidden_layers
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setattr("ulysses_train.planner.detect_hardware", lambda: {"gpu_memory_gib": 141, "host_memory_gib": 560})
    step.preflight_memory_check(run)
    first_use_kernels.facts_from_run(run.cfg, run.ds, 1, 1, run.planned_model)
    assert len(built) == 1
    step.preflight_memory_check(dataclasses.replace(run, shape=None))  # control: planned from the config again
    assert len(built) > 1


def test_a_lora_run_is_planned_with_its_adapters_from_the_model_config():
    """The preflight check, the `auto` levers and the first-use notice plan a resolved run from its shape
    (ResolvedRun.planned_model); a LoRA run's adapters are counted from its transformers config: q, k, v, o, gate,
    up, down at rank 4 over 2 layers of 64 wide (q 4 x 16, kv 2 x 16, MLP 128) are 4 x (64 + 64 + 2 x (64 + 32) + 64 +
    64 + 2 x (64 + 128) + 128 + 64) x 2 = 8,192 by hand. Before, the shape reached PEFT's counter and a LoRA run on a
    GPU stopped with a KeyError; a run without LoRA plans none (the control)."""
    pytest.importorskip("peft")
    from ulysses_train.config import load_config
    from ulysses_train.planner.run import options_of_resolved_run
    from ulysses_train.training.resolved_run import resolve_run

    cfg = load_config(None, ["data.seq_length=1024", "model.lora.r=4"])
    run = resolve_run(cfg, tiny_qwen3_config(head_dim=16))
    assert run.planned_model is run.shape and run.shape is not None
    assert options_of_resolved_run(run).adapter_params == 8_192
    plain = resolve_run(load_config(None, ["data.seq_length=1024"]), tiny_qwen3_config(head_dim=16))
    assert options_of_resolved_run(plain).adapter_params == 0
