"""One training step, provably the computation a single giant GPU would do.

`build_engine` turns a resolved run (resolved_run.py) into a DeepSpeed engine (ZeRO-3, Ulysses sp) around
`LongContextCausalLM`. `train_step` runs one optimizer step over the micro-batches of this rank's
data-parallel group.

How the loss becomes exact (ulysses_train/DESIGN.md, 'How the loss becomes exact'):
- each rank computes `s` = summed NLL over the valid labels of its slice, for each micro-step;
- `N` = valid labels of the whole step (every sp rank, micro-step and dp replica), all-reduced once
  before the first backward (labels are known up front, so this costs one tiny collective);
- each rank backpropagates `s * D / N`, where `D` is what ZeRO-3 divides the summed gradients by
  (`ds_config.gradient_divisor`). The per-rank gradients then sum to the gradient of
  `sum(all s) / N`, the token-weighted mean of the whole step, and DeepSpeed's division cancels `D`.
  Gradients crossing the Ulysses all-to-all are routed back by its own backward, so they count once.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from accelerate.utils import set_seed

from ulysses_train.config import Config
from ulysses_train.constants import IGNORE_INDEX
from ulysses_train.device import cuda_training
from ulysses_train.model.attention import sdpa_priority
from ulysses_train.model.loading import LongContextCausalLM
from ulysses_train.model.router_balance import routed_tokens
from ulysses_train.model.transform import build_long_context_model
from ulysses_train.parallel.layout import ParallelDims, init_distributed, slice_sequence, valid_slice_tokens
from ulysses_train.training.ds_config import check_reduction_path, gradient_divisor
from ulysses_train.training.first_use_kernels import import_kernel_modules, run_kernels
from ulysses_train.training.resolved_run import ResolvedRun, resolve_run, with_levers

logger = logging.getLogger(__name__)


@dataclass
class Engine:
    """What the training loop needs: the DeepSpeed engine and the facts it was built from."""

    deepspeed: object
    """DeepSpeed's engine (deepspeed.initialize's first result)."""
    dims: ParallelDims
    ds_config: dict
    hf_config: object
    gradient_divisor: int
    pad_token_id: int
    hf_ds_config: object = None  # keeps transformers' ZeRO-3 awareness alive with the model
    cfg: Optional[Config] = None
    """The run config as built: `auto` sp and levers replaced by their values."""
    levers: object = None
    """planner.levers.LeverChoice of the `auto` levers on a GPU run (None otherwise)."""
    run: Optional[ResolvedRun] = None
    """The resolved run it was built from, its `auto` levers chosen (the kernels, the planner's shape)."""

    @property
    def module(self) -> LongContextCausalLM:
        return self.deepspeed.module

    @property
    def device(self) -> torch.device:
        return self.deepspeed.device


@dataclass
class StepResult:
    loss: float
    """The step's objective: token-weighted cross-entropy, plus the router loss term where the model has one."""
    num_tokens: int
    grad_norm: Optional[float]
    router_aux_loss: Optional[float] = None
    """Mixture-of-experts models with `output_router_logits`: the load-balancing loss, each sequence's weighted
    by its share of the step's tokens, before `router_aux_loss_coef` (model/router_balance.py)."""
    indexer_loss: Optional[float] = None
    """With model.indexer_loss_coef > 0: the indexer KL term, summed over the layers with an indexer of each one's
    mean over the step's tokens, before the coefficient (model/indexer_loss.py)."""


def preflight_memory_check(run: ResolvedRun, forward_only: bool = False) -> None:
    """Refuse, before any weight loads, a run whose planned peak exceeds this machine's GPU or host memory.

    Raises planner.PlanError naming what does not fit, by how much, and the cheapest change that fits.
    Only on GPUs: the planner models CUDA memory, and a CPU run has nothing to protect. `forward_only`: the
    engine only evaluates, so the plan is the forward's under no_grad (planner/forward_only.py), not a step's.
    """
    if not cuda_training():
        return
    from ulysses_train.planner import PlanError, check_fits, detect_hardware, plan
    from ulysses_train.planner.forward_only import check_forward_fits, plan_forward
    from ulysses_train.planner.run import options_of_resolved_run

    dims, model = run.dims, run.planned_model
    try:
        options = options_of_resolved_run(run, **detect_hardware())
        planned = plan_forward(model, options=options) if forward_only else plan(model, options=options)
    except NotImplementedError as err:  # a model the planner cannot size: nothing to check against
        if dims.rank == 0:
            logger.warning("preflight memory check skipped: %s", err)
        return
    try:
        (check_forward_fits if forward_only else check_fits)(planned)
    except PlanError as err:
        raise PlanError(f"{err} (The planner refused this " + ("evaluation before loading weights.)" if forward_only
                        else "run before loading weights; pass --force to start it anyway.)")) from None


def build_engine(run: ResolvedRun, optimizer_factory: Optional[Callable] = None, check_memory: bool = False,
                 forward_only: bool = False) -> Engine:
    """The one entry from a resolved run (resolved_run.resolve_run: the config, the model's config, the DeepSpeed
    dict, the planner's shape, decided once) to the DeepSpeed engine: the `auto` levers chosen once the process
    group is up, then the model built partitioned and wrapped.

    `optimizer_factory(params)` supplies a client optimizer instead of the DeepSpeed JSON's `optimizer` section
    (tests use plain SGD). `check_memory` runs the planner first (preflight_memory_check). `forward_only`: an
    engine for evaluation only; `check_memory` then plans a forward, not a training step.
    """
    import deepspeed

    init_distributed(run.cfg.train.timeout_minutes)
    run = with_levers(run)
    cfg, hf_config, ds, dims = run.cfg, run.hf_config, run.ds, run.dims
    if check_memory:
        preflight_memory_check(run, forward_only)
    if dims.rank == 0:
        if run.rope.applied == "yarn":  # a change to the model's positions: said where the user reads, not logged
            print(f"RoPE: {run.rope}", flush=True)
        else:
            logger.info("RoPE: %s", run.rope)
        if run.levers is not None:
            logger.info("%s", run.levers.describe())
    import_kernel_modules(run_kernels(run, cuda_training()))  # their slow imports: not inside the first step
    set_seed(cfg.train.seed)  # random init (and anything random after it) is reproducible from the seed
    module, hf_ds_config, mpu = build_long_context_model(hf_config, cfg, run.attn, ds, dims.sp, log=dims.rank == 0,
                                                         mixer_kernels=run.mixer_kernels)
    largest = max(getattr(p, "ds_numel", p.numel()) for p in module.parameters())
    check_reduction_path(ds, dims, largest)

    optimizer = None
    if optimizer_factory is not None:
        optimizer = optimizer_factory([p for p in module.parameters() if p.requires_grad])
        ds.setdefault("zero_allow_untested_optimizer", True)
    engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=ds, mpu=mpu,
                                      model_parameters=None if optimizer else
                                      [p for p in module.parameters() if p.requires_grad])
    pad = hf_config.pad_token_id if getattr(hf_config, "pad_token_id", None) is not None else 0
    return Engine(deepspeed=engine, dims=dims, ds_config=ds, hf_config=hf_config,
                  gradient_divisor=gradient_divisor(ds, dims), pad_token_id=pad, hf_ds_config=hf_ds_config,
                  cfg=cfg, levers=run.levers, run=run)


def _all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.SUM)
    return value


def train_step(run: Engine, samples: list[dict], before_optimizer_step: Optional[Callable] = None) -> StepResult:
    """One optimizer step over `samples`: this dp group's micro-batches, each a dict of [1, seq] tensors
    `input_ids` and `labels` (labels unshifted; -100 where no loss) and, for document packing, the 1-D
    `document_lengths`. Every sp rank of a dp group passes the same samples and keeps its own slice.

    `before_optimizer_step()` runs after the last backward and before the optimizer updates the weights
    (tests read the gradients there).
    """
    engine, dims = run.deepspeed, run.dims
    if len(samples) != engine.gradient_accumulation_steps():
        raise ValueError(f"train_step got {len(samples)} micro-batches; the DeepSpeed config accumulates "
                         f"{engine.gradient_accumulation_steps()}.")
    slices = [slice_sequence(s["input_ids"], s["labels"], dims.sp, dims.sp_rank, run.pad_token_id,
                             document_lengths=s.get("document_lengths")) for s in samples]
    real = [routed_tokens(s) for s in samples]  # the router loss's rows: no padding of any kind
    routed = [valid_slice_tokens(s["input_ids"].shape[-1], dims.sp, dims.sp_rank, r) for s, r in zip(samples, real)]
    local_count = sum(int((sh["shift_labels"] != IGNORE_INDEX).sum()) for sh in slices)
    step_counts = torch.tensor([local_count, sum(routed)], dtype=torch.float64, device=run.device)
    total_count, total_tokens = (int(v) for v in _all_reduce_sum(step_counts).tolist())
    if total_count == 0:
        logger.warning("no valid labels in this step on any rank; the step changes nothing but momentum.")
    scale = run.gradient_divisor / max(total_count, 1)
    balance = run.module.router_balance
    if balance is not None and any(s["input_ids"].shape[0] != 1 for s in samples):
        raise ValueError("the router's load-balancing loss takes one sequence per micro-batch ([1, seq] tensors).")

    loss_sum = torch.zeros((), dtype=torch.float64, device=run.device)
    aux_sum = torch.zeros((), dtype=torch.float64, device=run.device)
    indexer, indexer_sum = run.module.indexer_loss, torch.zeros((), dtype=torch.float64, device=run.device)
    for index, (piece, sample) in enumerate(zip(slices, samples)):
        batch = {k: v.to(run.device) if isinstance(v, torch.Tensor) else v for k, v in piece.items()}
        with sdpa_priority():
            if balance is not None:
                balance.begin_forward(routed[index], run.device)
            if indexer is not None:  # each real query's KL weighted by 1 / the step's tokens, like the router loss
                indexer.begin_forward(routed[index], total_tokens, run.gradient_divisor)
            nll, _ = engine(**batch)
            if balance is not None:  # the sequence's share of the step's tokens; gradients scaled like nll's
                term = balance.end_forward(real[index] / total_tokens, run.gradient_divisor)
                aux_sum += term if dims.sp_rank == 0 else 0.0  # every sp rank of the sequence has the same
            indexer_sum += indexer.end_forward() if indexer is not None else 0.0  # this rank's own queries
            engine.backward(nll * scale, scale_wrt_gas=False)
        loss_sum += nll.detach().double()
        if index == len(slices) - 1 and before_optimizer_step is not None:
            before_optimizer_step()
        engine.step()
    loss = _all_reduce_sum(loss_sum).item() / max(total_count, 1)
    aux = _all_reduce_sum(aux_sum).item() if balance is not None else None
    if aux is not None:
        loss += balance.coefficient * aux
    kl = _all_reduce_sum(indexer_sum).item() if indexer is not None else None
    if kl is not None:
        loss += indexer.coefficient * kl
    grad_norm = engine.get_global_grad_norm()
    grad_norm = float(grad_norm) if grad_norm is not None else None
    return StepResult(loss=loss, num_tokens=total_count, grad_norm=grad_norm, router_aux_loss=aux, indexer_loss=kl)
