"""The run resolved once: every decision a config leaves to the launch (sp's number, the attention kernel, the
RoPE scaling, the DeepSpeed dict, then the `auto` levers) made in one place, in order, into one frozen
ResolvedRun that the trainer (training/loop.py), the engine builder (training/step.py), the evaluation engine and
the run's identity (run_identity.py: from the config as resolved, RoPE scaling included) all read. Nothing
downstream decides one of these again.

Two stages, because the levers need the process group (the ranks agree on the hardware they plan for):
`resolve_run` before it exists (the trainer's early checks use its sp and RoPE-scaled config), `with_levers`
after."""
from __future__ import annotations

import copy
import dataclasses
import logging
import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ulysses_train.config import Config
from ulysses_train.device import collective_device, cuda_training
from ulysses_train.kernel_pins import installed_version_problems
from ulysses_train.lever_keys import auto_lever_keys, fixed_levers
from ulysses_train.model.architecture import text_config
from ulysses_train.model.attention_checks import check_document_attention, check_window_attention
from ulysses_train.model.loading import load_model_config, resolve_attn_implementation
from ulysses_train.model.lora import check_lora_targets
from ulysses_train.model.mixers import check_head_chunks, check_mixer_kernels, choose_mixer_kernels
from ulysses_train.model.mixers.indexed_attention import check_indexer_loss
from ulysses_train.model.rope import RopeScalingDecision, apply_rope_scaling
from ulysses_train.parallel.launch import local_gpus_per_node
from ulysses_train.parallel.layout import (ParallelDims, auto_sequence_parallel_size, rank_from_environment,
                                           validate_parallel_layout)
from ulysses_train.training.ds_config import (check_monitor_paths, finalize_deepspeed_config, load_deepspeed_config,
                                              place_monitor_logs)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResolvedRun:
    """One launch's decisions. `cfg`: sp a number (and after with_levers no lever `auto`); `hf_config`: the
    model's transformers config with the RoPE decision applied; `rope`: that decision; `attn`: the attention
    kernel that runs; `dims`: this rank's place; `ds`: the DeepSpeed dict as the engine gets it; `shape`: the
    planner's ModelShape of the model, built once here (None where the planner cannot size the model: `unplanned`
    says why); `mixer_kernels`: {mixer: kernel variant} of the recurrent mixers, chosen once here
    (mixers.choose_mixer_kernels) and read by the install, the planner and the first-use notice; `levers`: the
    planner's LeverChoice when it chose `auto` levers on GPUs."""

    cfg: Config
    hf_config: Any
    rope: RopeScalingDecision
    attn: str
    dims: ParallelDims
    ds: dict
    shape: Any = None
    unplanned: str = ""
    mixer_kernels: dict = dataclasses.field(default_factory=dict)
    levers: Any = None

    @property
    def planned_model(self):
        """What the planner's functions take for this run's model (anything load_model_shape takes): its shape, or
        the config where the planner cannot size it (they then refuse it again, as NotImplementedError)."""
        return self.shape if self.shape is not None else self.hf_config


def resolve_run(cfg: Config, hf_config=None, deepspeed_config: Optional[dict] = None) -> ResolvedRun:
    """Every decision that needs no process group, each checked as it is made (cheap checks before any weight
    loads). `hf_config`: a transformers config given in code (else read from model.name_or_path; it is used as
    given, and scaled in place); `deepspeed_config`: a DeepSpeed dict instead of train.deepspeed_config's file."""
    rank, _, world = rank_from_environment()
    hf_config = load_model_config(cfg.model, hf_config)
    if cfg.model.lora:
        check_lora_targets(hf_config, cfg.model.lora)
    cfg = resolve_sequence_parallel_size(cfg, hf_config)
    sp = cfg.parallel.sequence_parallel_size
    dims = ParallelDims(world_size=world, sp=sp, rank=rank, gpus_per_node=local_gpus_per_node(),
                        allow_sp_across_nodes=cfg.parallel.allow_sp_across_nodes)
    attn = resolve_attn_implementation(cfg.model.attn_implementation)
    check_document_attention(cfg.data.packing, attn, cfg.model.attn_implementation)
    check_window_attention(hf_config, attn, cfg.model.attn_implementation, sp=sp, seq_length=cfg.data.seq_length)
    check_mixer_kernels(hf_config, cfg.data.seq_length, cuda_training())
    check_indexer_loss(hf_config, cfg.model.indexer_loss_coef)
    if cuda_training() and rank == 0:  # a kernel outside the versions measured together: said, not refused
        for problem in installed_version_problems():
            print(f"warning: {problem}", file=sys.stderr, flush=True)
    rope = apply_rope_scaling(hf_config, cfg.data.seq_length, cfg.model.rope_scaling, cfg.model.rope_factor)
    validate_parallel_layout(hf_config, sp, attn)
    if cfg.model.attention_head_chunks != "auto":
        check_head_chunks(hf_config, sp, cfg.model.attention_head_chunks)
    given = deepspeed_config if deepspeed_config is not None else load_deepspeed_config(cfg.train.deepspeed_config)
    shape, unplanned = model_shape(hf_config)
    ds = finalize_deepspeed_config(copy.deepcopy(given), dims, cfg.train.gradient_accumulation_steps, cfg.model.dtype,
                                   layer_params=shape.layer_params if shape else decoder_layer_params(hf_config))
    check_monitor_paths(place_monitor_logs(ds, cfg.train.output_dir))
    return ResolvedRun(cfg=cfg, hf_config=hf_config, rope=rope, attn=attn, dims=dims, ds=ds, shape=shape,
                       unplanned=unplanned, mixer_kernels=choose_mixer_kernels(hf_config, cuda_training()))


def model_shape(hf_config) -> tuple:
    """(the planner's ModelShape of the model, "") built once for the run (on the meta device where it is not a
    Llama-style formula: seconds, read by the ZeRO-3 settings, the `auto` levers, the memory check and the kernel
    notice), or (None, why) for a model the planner cannot size."""
    from ulysses_train.planner.shapes import ModelShape

    try:
        return ModelShape.from_hf_config(hf_config), ""
    except NotImplementedError as err:
        return None, str(err)


def with_levers(run: ResolvedRun) -> ResolvedRun:
    """`run` with its `auto` levers chosen (resolve_levers); the process group must be up."""
    if run.levers is not None or not auto_lever_keys(run.cfg.model):
        return run
    cfg, levers = resolve_levers(run.cfg, run.ds, run.dims, run.planned_model, run.mixer_kernels, run.hf_config)
    return dataclasses.replace(run, cfg=cfg, levers=levers)


def resolve_sequence_parallel_size(cfg: Config, hf_config) -> Config:
    """`cfg` with `parallel.sequence_parallel_size: auto` replaced by its number for this launch (the processes
    the launcher started, the GPUs per node, the model's heads: layout.auto_sequence_parallel_size); `cfg`
    itself otherwise (resolve_run's first decision: the data checks need the number)."""
    if cfg.parallel.sequence_parallel_size != "auto":
        return cfg
    _, _, world = rank_from_environment()
    sp = auto_sequence_parallel_size(world, hf_config, local_gpus_per_node(), cfg.parallel.allow_sp_across_nodes)
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, sequence_parallel_size=sp))


def agreed_hardware(found: dict) -> dict:
    """detect_hardware()'s figures as every rank will plan with them: the smallest over all ranks (nodes can
    differ), so every rank chooses the same levers."""
    keys = sorted(found)
    if not keys or not torch.distributed.is_initialized():
        return found
    values = torch.tensor([found[k] for k in keys], dtype=torch.float64, device=collective_device())
    torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MIN)
    return dict(zip(keys, values.tolist()))


def resolve_levers(cfg: Config, ds: dict, dims: ParallelDims, model, mixer_kernels: Optional[dict] = None,
                   hf_config=None):
    """(cfg with its `auto` lever keys replaced by values, the LeverChoice or None). On GPUs the planner
    chooses (planner/levers.py) from this node's memory, agreed over the ranks; without a GPU, `auto` takes
    lever_keys.NO_GPU_LEVERS. The process group must be up (the agreement is a collective)."""
    from ulysses_train.planner import detect_hardware
    from ulysses_train.planner.run import choose_run_levers

    if not auto_lever_keys(cfg.model):
        return cfg, None
    if not cuda_training():
        return dataclasses.replace(cfg, model=fixed_levers(cfg.model)), None
    hardware = agreed_hardware(detect_hardware())
    gpus_per_node = dims.gpus_per_node or torch.cuda.device_count()
    try:
        kernels = {} if mixer_kernels is None else {"mixer_kernels": mixer_kernels}  # None: chosen by the planner
        choice = choose_run_levers(cfg, ds, dims.world_size, gpus_per_node, model, hf_config=hf_config, **kernels,
                                   **hardware)
    except NotImplementedError as err:  # a model the planner cannot size
        if dims.rank == 0:
            logger.warning("levers: %s `auto` levers take their no-GPU values; set them to choose yourself.", err)
        return dataclasses.replace(cfg, model=fixed_levers(cfg.model)), None
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **choice.values)), choice


def decoder_layer_params(hf_config) -> int:
    """Parameters of one decoder layer (the planner's count), for ZeRO-3's reuse distance (ds_config.py)."""
    from ulysses_train.planner.model_counts import count_parameters

    return count_parameters(text_config(hf_config))[0]
