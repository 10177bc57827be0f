"""One process standing in for one rank of an sp=N step, so one GPU can measure what N GPUs will do.

A rank of an sp=N Ulysses step does a fixed amount of work: projections, norms, MLP and loss over its T/N
tokens, attention over all T tokens for its H/N heads, and ZeRO-3 holding 1/N of the weights, gradients and
optimizer states. Only the communication needs the other ranks. `start_emulated_rank(N)` makes this single
process rank 0 of a world of N by starting torch's "fake" process-group backend (torch.testing's fake_pg: a
process group whose collectives complete at once without any peer), then hands that group to DeepSpeed. After
that nothing else changes: `build_engine` and `train_step` run exactly as on N GPUs, with the same kernels,
shapes, levers and ZeRO-3 partitioning (DeepSpeed partitions over the world size it is told), so the step's
time and memory are the rank's, minus the time of its collectives.

What the collectives hand back. The fake backend completes a collective without writing its output (on CUDA
the output keeps whatever memory it was given: NaN there made DeepSpeed skip the optimizer step, so Adam's
states were never allocated and the peak came out 6 GiB low). So DeepSpeed's collectives are wrapped
(`loop_back_collectives`) to write what a peer with this rank's data would send: the all-to-all returns its
input (each head group of the local slice stands in for another rank's slice, so the attention kernel gets a
[T, H/N, D] tensor of real values), all-gathers fill every rank's share with this rank's (ZeRO-3's gathered
weights are this rank's shard repeated), a reduce-scatter keeps this rank's share of its input, all-reduces
and broadcasts leave their tensor as it is. The all-to-all is wrapped at `torch.distributed.all_to_all_single`,
which both DeepSpeed's backend (attention's exchange) and torch's differentiable all-to-all (the linear mixers'
exchange: sequence_parallel.py) look up when they are called; the others at DeepSpeed's backend. The values, and
so the loss, mean little; shapes, kernels, bytes and every allocation are the real ones. The copies cost a few
milliseconds a step (device memory bandwidth), counted in the emulated step. The communication time is added
back from each collective's logged size (planner/communication.py).

Limits: one node (dp = 1, world = sp); attention kernels that read the gathered position ids to find document
boundaries (flash_attention_2) would see the fake gather's copies, so only sdpa and fa4 are emulated.
"""
from __future__ import annotations

import os

import torch

from ulysses_train.errors import UserError

EMULATED_ATTENTION = ("sdpa", "fa4")
"""Attention implementations whose kernels do not read the gathered position ids (see the module docstring)."""


def check_emulation(sp: int, attn_implementation: str, processes: int = 1) -> None:
    """Refuse an emulation that would not measure an sp rank, naming the fix."""
    if sp < 2:
        raise UserError(f"--emulate-sp {sp}: emulating needs sp >= 2 (sp=1 is a plain one-GPU run).")
    if processes != 1:
        raise UserError(f"--emulate-sp runs one process standing in for one of {sp} ranks; drop --nproc {processes}.")
    if attn_implementation not in EMULATED_ATTENTION:
        raise UserError(f"--emulate-sp supports attention {' and '.join(EMULATED_ATTENTION)}, not "
                        f"{attn_implementation!r} (it reads the gathered position ids, which the emulation fakes).")


def start_emulated_rank(world_size: int, rank: int = 0) -> None:
    """Make this process rank `rank` of `world_size` ranks on one node: the launcher's variables (so the
    trainer's layout, the planner's ranks per node and DeepSpeed's device choice read them), then a fake
    process group, then DeepSpeed's communication backend on top of it. Call before build_engine."""
    import deepspeed
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    if torch.distributed.is_initialized():
        raise RuntimeError("start_emulated_rank: a process group is already running in this process.")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0",
                      LOCAL_WORLD_SIZE=str(world_size))
    if torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") != "cpu":
        torch.cuda.set_device(0)
    torch.distributed.init_process_group("fake", rank=rank, world_size=world_size)
    deepspeed.init_distributed(auto_mpi_discovery=False)  # adopts the running group (no rendezvous)
    loop_back_collectives(deepspeed.comm.comm.cdb)


def loop_back_collectives(backend) -> None:
    """Make DeepSpeed's communication backend (its TorchBackend instance) and torch's all-to-all write, after
    each fake collective, what a peer holding this rank's data would send (module docstring). Every collective
    DeepSpeed issues (ZeRO-3, attention's exchange) goes through these; the linear mixers' exchange
    (SequenceParallel) calls torch.distributed.all_to_all_single directly."""
    def rank_in(group):
        return torch.distributed.get_rank(group)

    def all_gather_into_tensor(run):
        def wrapped(output_tensor, input_tensor, group=None, async_op=False):
            work = run(output_tensor, input_tensor, group=group, async_op=async_op)
            for share in output_tensor.view(-1, input_tensor.numel()):
                if share.data_ptr() != input_tensor.data_ptr():  # ZeRO-3 gathers in place: its own share is set
                    share.copy_(input_tensor.reshape(-1))
            return work
        return wrapped

    def all_gather(run):
        def wrapped(tensor_list, tensor, group=None, async_op=False):
            work = run(tensor_list, tensor, group=group, async_op=async_op)
            for out in tensor_list:
                out.copy_(tensor)
            return work
        return wrapped

    def reduce_scatter_tensor(run):
        def wrapped(output_tensor, input_tensor, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
            work = run(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
            share = input_tensor.view(-1, output_tensor.numel())[rank_in(group)]
            if share.data_ptr() != output_tensor.data_ptr():
                output_tensor.copy_(share.view_as(output_tensor))
            return work
        return wrapped

    def all_to_all_single(run):
        def wrapped(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            work = run(output, input, output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes,
                       group=group, async_op=async_op)
            output.copy_(input)
            return work
        return wrapped

    for name, wrap in (("all_gather_into_tensor", all_gather_into_tensor), ("all_gather", all_gather),
                       ("reduce_scatter_tensor", reduce_scatter_tensor)):
        setattr(backend, name, wrap(getattr(backend, name)))
    torch.distributed.all_to_all_single = all_to_all_single(torch.distributed.all_to_all_single)
