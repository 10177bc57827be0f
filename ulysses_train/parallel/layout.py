"""Sequence parallelism (Ulysses) layout: degrees, validation, process groups and sequence slices.

Ranks are laid out the way DeepSpeed's `parallel_state_sp` builds its groups: sp groups are runs of
consecutive ranks (`[0..sp-1], [sp..2sp-1], ...`), so with sp dividing the GPUs per node an sp group
never leaves a node and data parallelism (dp) runs across nodes. Hence
`sp_rank = rank % sp` and `dp_rank = rank // sp`.

Everything heavy (the all-to-all, ZeRO, the groups) is DeepSpeed's; this module only decides who holds
which slice and refuses layouts that cannot work, before any weights load.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch

from ulysses_train.config import ConfigError
from ulysses_train.constants import IGNORE_INDEX
from ulysses_train.device import cuda_training
from ulysses_train.model.mixers import check_sp_splits_heads, valid_sp_values
from ulysses_train.model.mixers.attention import untested_exchange_problem


@dataclass(frozen=True)
class ParallelDims:
    """World split into `dp` data-parallel groups of `sp` ranks that share one sequence."""

    world_size: int
    sp: int
    rank: int = 0
    gpus_per_node: int = 0
    allow_sp_across_nodes: bool = False

    def __post_init__(self):
        if self.sp < 1:
            raise ConfigError(f"parallel.sequence_parallel_size={self.sp} must be >= 1.")
        if self.world_size % self.sp != 0:
            raise ConfigError(
                f"world size {self.world_size} is not divisible by parallel.sequence_parallel_size={self.sp}; "
                f"use an sp that divides the number of processes (e.g. {_largest_divisor_at_most(self.world_size, self.sp)}) "
                f"or launch a multiple of {self.sp} processes."
            )
        node = self.gpus_per_node
        problem = sp_node_problem(self.sp, node, self.allow_sp_across_nodes)
        if problem == "straddles":
            raise ConfigError(
                f"parallel.sequence_parallel_size={self.sp} does not divide the {node} GPUs per node, so an sp "
                f"group would straddle two nodes; use an sp that divides {node}, or set "
                f"parallel.allow_sp_across_nodes=true."
            )
        if problem == "larger":
            raise ConfigError(
                f"parallel.sequence_parallel_size={self.sp} is larger than a node ({node} GPUs): the all-to-all "
                f"would cross the network every layer. If that is intended (e.g. to reach longer sequences), "
                f"set parallel.allow_sp_across_nodes=true."
            )

    @property
    def dp(self) -> int:
        return self.world_size // self.sp

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sp


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def sp_node_problem(sp: int, gpus_per_node: int, allow_sp_across_nodes: bool = False) -> str:
    """Why an sp group would leave its node: "larger" when sp exceeds a node's GPUs (the all-to-all would cross
    the network every layer), "straddles" when sp does not divide them (sp groups are runs of consecutive
    ranks, so one would span two nodes); "" when it stays inside one, when crossing is allowed, or when the node
    size is unknown (0). One rule for ParallelDims (which refuses) and the planner (whose valid_sp skips)."""
    if not gpus_per_node or sp <= 1 or allow_sp_across_nodes:
        return ""
    if sp > gpus_per_node:
        return "larger"
    return "straddles" if gpus_per_node % sp else ""


def auto_sequence_parallel_size(world_size: int, hf_config, gpus_per_node: int = 0,
                                allow_sp_across_nodes: bool = False) -> int:
    """`parallel.sequence_parallel_size: auto`: the largest sp that divides the world size, stays inside a node
    (sp_node_problem) and splits every mixer's heads (model/mixers valid_sp_values); 1 always works."""
    return max(sp for sp in valid_sp_values(hf_config, limit=world_size) if world_size % sp == 0
               and not sp_node_problem(sp, gpus_per_node, allow_sp_across_nodes))


def validate_parallel_layout(hf_config, sp: int, attn_implementation: str) -> None:
    """Refuse head counts and attention kernels that Ulysses cannot split, naming the fix.

    Each mixer says which sp splits its heads (model/mixers: attention's query and KV heads, the Gated DeltaNet's
    key heads); the refusal lists the sp values every mixer allows. The same check refuses plan.py's --sp.
    """
    if sp == 1:
        return
    check_sp_splits_heads(hf_config, sp)
    problem = untested_exchange_problem(hf_config, sp)
    if problem:
        raise ConfigError(problem + ".")
    if attn_implementation in ("eager", "paged|eager"):
        raise ConfigError(
            f"model.attn_implementation={attn_implementation!r} cannot run with sequence parallelism (sp={sp}): "
            f"it builds a full seq x seq mask. Use 'sdpa', 'fa4' or 'flash_attention_2'."
        )


# ---------------------------------------------------------------- processes


def rank_from_environment() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from the launcher's environment: deepspeed, torchrun or SLURM srun."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", 0))
    elif "SLURM_PROCID" in os.environ:
        rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
        local = int(os.environ.get("SLURM_LOCALID", 0))
    else:
        rank, local, world = 0, 0, 1
    return rank, local, world


def init_distributed(timeout_minutes: int = 120) -> None:
    """Start the default process group through DeepSpeed (NCCL on GPUs, gloo on CPU) from any launcher.

    Single-process runs get a one-rank group too, so the same code path (ZeRO-3, collectives) always runs.
    """
    import deepspeed
    import deepspeed.comm

    from ulysses_train.parallel.launch import DEFAULT_PORT, srun_environment

    # srun sets no torch variables: rendezvous at the first host of the node list (see launch.py)
    for key, value in srun_environment(os.environ).items():
        os.environ.setdefault(key, value)
    rank, local_rank, world = rank_from_environment()
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("LOCAL_RANK", str(local_rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    # a one-process group has no peer that must find it: port 0 lets the OS pick a free one, so two single-process
    # runs on one machine do not collide on the default port
    os.environ.setdefault("MASTER_PORT", "0" if world == 1 else str(DEFAULT_PORT))
    if cuda_training():
        check_local_rank_has_a_gpu(local_rank, torch.cuda.device_count())
        torch.cuda.set_device(local_rank)
    if not deepspeed.comm.is_initialized():  # also adopts a group already started (parallel/emulate.py)
        deepspeed.init_distributed(timeout=datetime.timedelta(minutes=timeout_minutes), auto_mpi_discovery=False)


def check_local_rank_has_a_gpu(local_rank: int, visible_gpus: int) -> None:
    """Each process drives the GPU of its local rank (DeepSpeed picks it the same way): more processes on a
    node than GPUs is a launch mistake, named as such, with the launcher's count (LOCAL_WORLD_SIZE, LOCAL_SIZE)."""
    if local_rank < visible_gpus:
        return
    started = next((int(os.environ[key]) for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE")
                    if os.environ.get(key, "").isdigit()), 0)
    if started > visible_gpus:
        raise ConfigError(
            f"{started} processes were started on this node but it has {visible_gpus} GPU(s): start at most "
            f"{visible_gpus} (deepspeed --num_gpus {visible_gpus}, torchrun --nproc_per_node {visible_gpus}), or run "
            f"on the CPU with DS_ACCELERATOR=cpu.")
    raise ConfigError(
        f"local rank {local_rank} but this process sees {visible_gpus} GPU(s) "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): every process must see "
        f"all GPUs of its node; under srun use --gpus-per-node, not --gpus-per-task or --gpu-bind.")


def shutdown_distributed() -> None:
    """Leave the process group cleanly: wait for every rank, then destroy it.

    Without this a rank that finishes first exits while gloo's background threads still run, and the
    C++ runtime aborts it ("terminate called without an active exception"), failing the whole job.
    """
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def exit_process(code: int = 0) -> None:
    """End a process that ran a process group: shut it down, flush output, and exit without Python's
    interpreter teardown.

    destroy_process_group() drops torch's references to the groups, but DeepSpeed's engine and comm backend
    keep theirs, so gloo's backend (its worker threads, and tensors its finished work still holds) is freed
    during interpreter finalization, where it can abort an already finished process with SIGABRT
    ("terminate called without an active exception") and fail the job. On the 2-core test machine this hit
    2 of 3 full test-suite runs. Leaving with os._exit after the flush skips that teardown; every file the
    trainer writes is closed by then (checkpoints and logs use context managers). Use it only at the end of a
    script's __main__, never in a library call. A failing process (code != 0) skips the shutdown's barrier: the
    other ranks may never reach it.
    """
    import logging
    import sys

    if code == 0:
        shutdown_distributed()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ---------------------------------------------------------------- sequence slices


def padded_length(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def valid_slice_tokens(length: int, sp: int, sp_rank: int, real: int | None = None) -> int:
    """How many of the tokens in sp rank `sp_rank`'s slice of a `length`-token sequence are real, not the padding
    slice_sequence appends at the end: a prefix of the slice. `real`: only the first `real` tokens count (default
    all `length`; document packing's own padding ends a row)."""
    local = padded_length(length, sp) // sp
    return max(0, min(local, (length if real is None else real) - sp_rank * local))


def slice_sequence(input_ids: torch.Tensor, labels: torch.Tensor, sp: int, sp_rank: int,
                   pad_token_id: int = 0, document_lengths: torch.Tensor | None = None) -> dict:
    """This rank's contiguous slice of one [batch, seq] sample, ready for the model.

    Order matters (ulysses_train/DESIGN.md, 'One step, end to end'): labels are shifted by one *before*
    slicing, so the label of a slice's last token (the first token of the next slice) is not lost; position
    ids are the global positions, made before slicing; the sequence is padded to a multiple of sp with label
    -100 so padding adds nothing to the loss.

    ``document_lengths`` (document packing, batch 1): the lengths of the sample's documents, summing to its
    length. Position ids then restart at 0 in every document, and the slice also carries ``cu_seq_lens``, the
    cumulative document lengths of the *whole* sequence (int32, what variable-length attention takes; every sp
    rank has the same, since after the Ulysses all-to-all each holds the whole sequence), and
    ``max_seq_len``, the longest document. A document's last token gets no label (the next token belongs to
    another document), whatever the labels say.
    """
    if input_ids.shape != labels.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and labels {tuple(labels.shape)} differ in shape.")
    batch, length = input_ids.shape
    shift_labels = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    total = padded_length(length, sp)
    if total != length:
        input_ids = torch.nn.functional.pad(input_ids, (0, total - length), value=pad_token_id)
        shift_labels = torch.nn.functional.pad(shift_labels, (0, total - length), value=IGNORE_INDEX)
    extra = {}
    if document_lengths is None:
        position_ids = torch.arange(total, dtype=torch.long).unsqueeze(0).expand(batch, total)
    else:
        segments = _segments(document_lengths, batch, length, total)
        position_ids = document_positions(segments).unsqueeze(0)
        shift_labels = shift_labels.clone()
        shift_labels[:, segments.cumsum(0) - 1] = IGNORE_INDEX  # a document's last token predicts nothing
        extra = {"cu_seq_lens": torch.nn.functional.pad(segments.cumsum(0), (1, 0)).to(torch.int32),
                 "max_seq_len": int(segments.max())}
    local = total // sp
    window = slice(sp_rank * local, (sp_rank + 1) * local)
    return {"input_ids": input_ids[:, window].contiguous(), "position_ids": position_ids[:, window].contiguous(),
            "shift_labels": shift_labels[:, window].contiguous(), **extra}


def _segments(document_lengths: torch.Tensor, batch: int, length: int, total: int) -> torch.Tensor:
    """The document lengths, checked, with the sp padding (if any) as one more segment."""
    segments = torch.as_tensor(document_lengths, dtype=torch.long).reshape(-1)
    if batch != 1:
        raise ValueError(f"document packing takes one sequence per sample, got a batch of {batch}.")
    if int(segments.sum()) != length or bool((segments <= 0).any()):
        raise ValueError(f"document_lengths {segments.tolist()} must be positive and sum to the sample's "
                         f"{length:,} tokens.")
    if total != length:
        segments = torch.cat([segments, segments.new_tensor([total - length])])
    return segments


def document_positions(segments: torch.Tensor) -> torch.Tensor:
    """Position ids 0, 1, ... restarting at every segment: [3, 2] -> [0, 1, 2, 0, 1]."""
    starts = torch.repeat_interleave(segments.cumsum(0) - segments, segments)
    return torch.arange(int(segments.sum()), dtype=torch.long) - starts
