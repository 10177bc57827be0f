"""A trainer run as plan options: `options_from_run` reads the trainer's `Config` and DeepSpeed dict, and
`detect_hardware` this machine's GPU and host memory (what the trainer's preflight check plans with)."""
from __future__ import annotations

import os

from ulysses_train.constants import DTYPE_BYTES, GIB
from ulysses_train.device import cuda_training
from ulysses_train.errors import UserError
from ulysses_train.lever_keys import auto_lever_keys, fixed_levers
from ulysses_train.model.tiling import auto_tiles
from ulysses_train.planner.options import (PlanOptions, deepspeed_optimizer_state_bytes, deepspeed_torch_adam,
                                          deepspeed_sp_reduce_cast_bytes)
from ulysses_train.planner.shapes import load_model_shape


def options_from_run(cfg, ds_config: dict, world_size: int, gpus_per_node: int, model=None, hf_config=None,
                     **overrides) -> PlanOptions:
    """PlanOptions for a trainer run, from its `Config` (config.py) and final DeepSpeed dict; `overrides`
    (e.g. gpu_memory_gib, host_memory_gib from `detect_hardware()`) win. `model.tiled_mlp: auto` follows
    tiling.py's rule when `model` (anything load_model_shape takes) is given, else is planned untiled
    (the larger of the two). The optimizer's bytes per parameter are the DeepSpeed JSON's optimizer's
    (deepspeed_optimizer_state_bytes); the recurrent mixers' kernels are the run's (`mixer_kernels` override:
    ResolvedRun.mixer_kernels), else chosen here as a run on this machine would (mixers.choose_mixer_kernels).
    A LoRA run's adapters are counted from `hf_config` (or `model` where it is a transformers config)."""
    zero = ds_config.get("zero_optimization") or {}
    offload = (zero.get("offload_optimizer") or {}).get("device", "none")
    gpus_per_node = gpus_per_node or world_size
    sp = cfg.parallel.sequence_parallel_size
    mode = str(cfg.model.tiled_mlp).lower()
    tiled = mode == "true"
    try:
        shape = load_model_shape(model) if model is not None else None
    except NotImplementedError:  # a shape the planner cannot size: only the tiling rule needs it here
        if mode == "auto":
            raise
        shape = None
    if mode == "auto" and shape is not None:
        tiled = auto_tiles(-(-cfg.data.seq_length // sp), shape.hidden)
    adapters = lora_fields(cfg, hf_config if hf_config is not None else model)
    from ulysses_train.model.loading import chosen_attn_implementation
    from ulysses_train.model.mixers import choose_mixer_kernels
    from ulysses_train.model.rmsnorm import offset_norm_kernel_runs
    from ulysses_train.model.swiglu import swiglu_kernel_runs

    fixed = fixed_levers(cfg.model)  # `auto` levers as planned without a chooser (NO_GPU_LEVERS)
    kwargs = dict(
        seq_length=cfg.data.seq_length, sp=sp, gpus_per_node=gpus_per_node, **adapters,
        nodes=max(1, world_size // gpus_per_node), zero_stage=3, offload_optimizer=offload in ("cpu", "nvme"),
        optimizer_state_bytes=deepspeed_optimizer_state_bytes(ds_config), torch_adam=deepspeed_torch_adam(ds_config),
        sp_reduce_cast_bytes=deepspeed_sp_reduce_cast_bytes(ds_config, cfg.model.dtype),
        mixer_kernels=choose_mixer_kernels(shape, cuda_training()) if shape is not None else {},
        offload_activations=bool((ds_config.get("activation_checkpointing") or {}).get("cpu_checkpointing", False)),
        chunked_loss=cfg.loss.type == "chunked", loss_chunk_rows=cfg.loss.chunk_rows, tiled_mlp=tiled,
        keep_attention_fraction=float(fixed.keep_attention_fraction),
        activation_offload_fraction=float(fixed.activation_offload_fraction),
        attention_head_chunks=int(fixed.attention_head_chunks),
        low_memory_rmsnorm=cfg.model.rmsnorm != "hf",
        offset_norm_kernel=cfg.model.rmsnorm == "torch" and offset_norm_kernel_runs(),
        swiglu_kernel=swiglu_kernel_runs(),
        attention_kernel=chosen_attn_implementation(cfg.model.attn_implementation),
        dtype_bytes=DTYPE_BYTES[cfg.model.dtype], gradient_checkpointing=cfg.model.gradient_checkpointing,
        allow_sp_across_nodes=cfg.parallel.allow_sp_across_nodes,
        reduce_bucket_size=int(float(zero.get("reduce_bucket_size", 5e8))),
        prefetch_bucket_size=int(float(zero.get("stage3_prefetch_bucket_size", 5e7))),
        max_live_parameters=int(float(zero.get("stage3_max_live_parameters", 1e9))),
        sub_group_size=int(float(zero.get("sub_group_size", 1e9))),
    )
    kwargs.update(overrides)
    return PlanOptions(**kwargs)


def lora_fields(cfg, hf_config) -> dict:
    """A LoRA run's PlanOptions fields (lora.lora_plan_fields, plan.py --lora-rank's count: the adapters, and the
    fused expert tensors PEFT merges whole) where `hf_config` is a transformers config; none without LoRA, or for a
    shape or a name (which cannot be built to count them)."""
    from transformers import PretrainedConfig

    if not cfg.model.lora or not isinstance(hf_config, PretrainedConfig):
        return {}
    from ulysses_train.model.lora import lora_plan_fields

    return lora_plan_fields(hf_config, cfg.model.lora)


def options_of_resolved_run(run, **overrides) -> PlanOptions:
    """options_from_run for a training.resolved_run.ResolvedRun: its config, DeepSpeed dict, place, planner's
    model and the kernels it chose (`overrides`, e.g. detect_hardware()'s figures, win)."""
    return options_from_run(run.cfg, run.ds, run.dims.world_size, run.dims.gpus_per_node, model=run.planned_model,
                            hf_config=run.hf_config, **{"mixer_kernels": run.mixer_kernels, **overrides})


def choose_run_levers(cfg, ds_config: dict, world_size: int, gpus_per_node: int, model, hf_config=None,
                      **hardware):
    """levers.choose_levers for a trainer run: its `auto` lever keys on this hardware."""
    from ulysses_train.planner.levers import choose_levers
    from ulysses_train.planner.shapes import load_model_shape

    auto = auto_lever_keys(cfg.model)
    options = options_from_run(cfg, ds_config, world_size, gpus_per_node, model=model, hf_config=hf_config,
                               **hardware)
    return choose_levers(load_model_shape(model), options, auto)


HOST_MEMORY_VARIABLE = "ULYSSES_TRAIN_HOST_MEMORY_GIB"
"""States the host memory per node in GiB. Some cloud VMs add memory as it is used, so the total the kernel
reports at start (what is read otherwise) can be a fraction of what the machine will give."""


def detect_hardware() -> dict:
    """{gpu_memory_gib, host_memory_gib} of this machine, for the keys it can read (none on a CPU-only
    machine without psutil); the host figure from HOST_MEMORY_VARIABLE when it is set."""
    found = {}
    try:
        import torch

        if torch.cuda.is_available():
            found["gpu_memory_gib"] = torch.cuda.get_device_properties(0).total_memory / GIB
    except ImportError:
        pass
    stated = os.environ.get(HOST_MEMORY_VARIABLE, "").strip()
    if stated:
        try:
            found["host_memory_gib"] = float(stated)
        except ValueError:
            raise UserError(f"{HOST_MEMORY_VARIABLE}={stated!r} must be the host memory per node in GiB, "
                            f"e.g. 512.") from None
        return found
    try:
        import psutil

        found["host_memory_gib"] = psutil.virtual_memory().total / GIB
    except ImportError:
        pass
    return found
