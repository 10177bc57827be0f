"""Sequence parallelism as one object: the sp group, its size, this rank's place in it, and the two exchanges and the
sum every part of the package needs under it.

Why one home. Under Ulysses each rank holds a slice of the sequence. Attention's exchange is DeepSpeed's public
`UlyssesSPAttentionHF`, which replaces the kernel's entry in transformers' attention registry before the model is
built and makes the sp groups (model/mixers/attention.py; the ranks' layout: parallel/layout.py). Everything else
that crosses the sp group goes through a `SequenceParallel`: the linear mixers (model/mixers/gated_deltanet.py,
kimi_delta.py and its MLA routing) trade the slice of all heads for the whole sequence of a rank's heads and back,
the router's load-balancing loss (model/router_balance.py) and the retrieval probes (diagnostics/probe_scoring.py)
sum their per-slice totals. The object is built once, from the group DeepSpeed's sp state made (model/transform.py),
and handed to each of them; without sequence parallelism it is `SequenceParallel()` (size 1, rank 0, no group),
whose exchanges return their input and whose sum leaves its tensor alone, so single-GPU code runs the same lines
with no branches.

Why torch's public collective. The exchange is `torch.distributed.nn.functional.all_to_all_single`: differentiable
(its backward is the reverse all-to-all of the gradient), public, and looked up at call time through
`torch.distributed.all_to_all_single`, so the one-GPU emulation (parallel/emulate.py, which wraps that function)
sees it, and a logged step routes it through DeepSpeed's comms logger (diagnostics/collectives.py). DeepSpeed's
`_dim_zero_all_to_all` (what the Gated DeltaNet exchanged through before) is private and may change under us.
torch's function refuses to run under torch.compile (this package does not compile the layers).

This module imports only torch and the standard library: model/ uses it, and the package order is base -> config ->
model -> parallel -> planner -> training/diagnostics -> cli."""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed
from torch.distributed.nn.functional import all_to_all_single


@dataclass(frozen=True)
class SequenceParallel:
    """The sp group (None without sequence parallelism), its size and this rank's place in it."""

    group: Optional[Any] = None
    size: int = 1
    rank: int = 0

    @classmethod
    def from_group(cls, group) -> "SequenceParallel":
        """The object for a process group (DeepSpeed's sp group); None -> no sequence parallelism."""
        if group is None:
            return cls()
        return cls(group, torch.distributed.get_world_size(group), torch.distributed.get_rank(group))

    def to_head_shards(self, parts: list) -> list:
        """Seq-sharded [B, t, H_i, ...] tensors -> [B, sp*t, H_i/sp, ...]: the whole sequence of this rank's heads
        (head group r of every rank's slice, in rank order), all parts in one all-to-all. At size 1: the parts."""
        if self.size == 1:
            return list(parts)
        sp = self.size
        batch, length = parts[0].shape[:2]
        shapes = [p.shape[2:] for p in parts]
        flat = [p.reshape(batch, length, sp, -1) for p in parts]
        widths = [f.shape[-1] for f in flat]
        packed = torch.cat(flat, dim=-1).permute(2, 0, 1, 3).contiguous()  # [sp, B, t, C/sp]
        received = self._all_to_all(packed)  # [w] = rank w's slice of my heads
        whole = received.permute(1, 0, 2, 3).reshape(batch, sp * length, -1)
        return [x.reshape(batch, sp * length, shape[0] // sp, *shape[1:])
                for x, shape in zip(torch.split(whole, widths, dim=-1), shapes)]

    def to_sequence_shards(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, H/sp, d] (this rank's heads, whole sequence) -> [B, T/sp, H, d] (this rank's slice, all heads).
        At size 1: x."""
        if self.size == 1:
            return x
        sp = self.size
        batch, total, heads, dim = x.shape
        length = total // sp
        packed = x.reshape(batch, sp, length, heads * dim).permute(1, 0, 2, 3).contiguous()  # [w] = rank w's slice
        received = self._all_to_all(packed)  # [w] = head group w of my slice
        return received.permute(1, 2, 0, 3).reshape(batch, length, sp * heads, dim)

    def gather_sequence(self, parts: list) -> list:
        """Seq-sharded [B, t, ...] tensors -> [B, sp*t, ...]: every rank's slice, in rank order, on every rank (the
        small key-side tensors of indexed attention: one latent head, the indexer's keys). One all-to-all that
        sends this rank's slice to every rank, all parts in one message; its backward sends each rank's gradient
        of this slice back, and the copies' gradients are summed. At size 1: the parts."""
        if self.size == 1:
            return list(parts)
        batch, length = parts[0].shape[:2]
        shapes = [p.shape[2:] for p in parts]
        flat = [p.reshape(batch, length, -1) for p in parts]
        widths = [f.shape[-1] for f in flat]
        mine = torch.cat(flat, dim=-1)  # [B, t, C]
        received = self._all_to_all(mine.unsqueeze(0).expand(self.size, *mine.shape).contiguous())  # [sp, B, t, C]
        whole = received.permute(1, 0, 2, 3).reshape(batch, self.size * length, -1)
        return [x.reshape(batch, self.size * length, *shape) for x, shape in zip(torch.split(whole, widths, -1),
                                                                                 shapes)]

    def slice_start(self, length: int) -> int:
        """Where this rank's slice of `length` tokens starts in the whole sequence (slices are contiguous, in rank
        order)."""
        return self.rank * length

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the sp group in place (every rank of the group must call this); returns it. At size 1
        the tensor is already the sum."""
        if self.size > 1:
            torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM, group=self.group)
        return tensor

    def _all_to_all(self, packed: torch.Tensor) -> torch.Tensor:
        """Block w of dim 0 goes to rank w; block w of the result came from rank w. Differentiable: the backward
        sends the gradient's blocks back the same way. torch marks the function deprecated in favour of its
        functional collectives (a private module, `_functional_collectives`), so its warning is silenced here."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return all_to_all_single(torch.empty_like(packed), packed, group=self.group)
