"""Searches over plans: the sp values a layout allows, the longest sequence that fits, the cheapest lever setting
that fits, and `check_fits`, which refuses a plan that does not fit with the reason and that fix."""
from __future__ import annotations

import itertools
from typing import Optional

from ulysses_train.constants import GIB
from ulysses_train.model.mixers import valid_head_chunks, valid_sp_values
from ulysses_train.parallel.layout import sp_node_problem
from ulysses_train.planner.estimate import estimate
from ulysses_train.planner.options import PlanError, PlanOptions
from ulysses_train.planner.result import PHASE_NAMES, MemoryPlan
from ulysses_train.planner.shapes import ModelShape, load_model_shape

OFFLOAD_SHARES = (1.0, 0.75, 0.5, 0.25)
"""Shares of offloaded layers the planner tries when host memory is short (model.activation_offload_fraction)."""

LEVER_COST = {"chunked_loss": 0, "sp": 1, "offload_activations": 2, "recompute_attention": 4, "tiled_mlp": 8,
              "attention_head_chunks": 16, "offload_optimizer": 32}
"""How much turning a lever on costs, cheapest first: the chunked loss is free; more sp takes GPUs from data
parallelism; activation offload adds host-link traffic; recomputing attention that was kept
(model.keep_attention_fraction=0) runs its forward once more; TiledMLP runs the MLP forward once more; attention in
head chunks runs attention's forward once more again; optimizer offload moves the Adam step to the CPU. Powers of two, so any set of cheaper levers ranks before a more
expensive one. Turning an offload off (when host memory is short) costs nothing."""


def valid_sp(m: ModelShape, o: PlanOptions) -> list[int]:
    """sp values Ulysses can run on this hardware: dividing the world, splitting every mixer's heads (model/mixers
    valid_sp_values: attention's query and KV heads, a Gated DeltaNet's key heads) and inside one node unless
    allowed across nodes, by the trainer's rules (parallel/layout.py)."""
    return [sp for sp in valid_sp_values(m, limit=o.world)
            if not (o.world % sp or sp_node_problem(sp, o.gpus_per_node, o.allow_sp_across_nodes))]


def max_length(model, options: PlanOptions | None = None, **kwargs) -> int:
    """Longest sequence (a multiple of sp) whose plan fits; 0 if not even sp tokens fit.
    Memory grows with length, so a binary search over multiples of sp finds it."""
    m = load_model_shape(model)
    o = options or PlanOptions(seq_length=1, **kwargs)
    if options is not None and kwargs:
        o = o.replace(**kwargs)

    def fits(units: int) -> bool:
        return estimate(m, o.replace(seq_length=units * o.sp)).fits

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > 2 ** 34:
            break
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * o.sp


def _changes(o: PlanOptions, new: PlanOptions) -> tuple[list[str], int]:
    """What `new` changes from `o`, described with the config key that does it, and its cost (LEVER_COST)."""
    changes, cost = [], 0
    if new.chunked_loss != o.chunked_loss:
        changes.append("chunked loss (loss.type=chunked)")
    if new.sp != o.sp:
        changes.append(f"sp={new.sp} (parallel.sequence_parallel_size={new.sp})")
        cost += LEVER_COST["sp"]
    acts, share = new.offload_activations, new.activation_offload_fraction
    if acts != o.offload_activations:
        changes.append("activation offload (activation_checkpointing.cpu_checkpointing=true)"
                       if acts else "activations kept on the GPU (cpu_checkpointing=false)")
        cost += LEVER_COST["offload_activations"] if acts else 0
    if acts and share != o.activation_offload_fraction:
        changes.append(f"offload {share:g} of the layers' activations "
                       f"(model.activation_offload_fraction={share:g})")
    if new.keep_attention_fraction != o.keep_attention_fraction:
        changes.append("attention recomputed (model.keep_attention_fraction=0)")
        cost += LEVER_COST["recompute_attention"]
    if new.tiled_mlp != o.tiled_mlp:
        changes.append("TiledMLP (model.tiled_mlp=true)")
        cost += LEVER_COST["tiled_mlp"]
    if new.attention_head_chunks != o.attention_head_chunks:
        changes.append(f"attention in {new.attention_head_chunks} head chunks "
                       f"(model.attention_head_chunks={new.attention_head_chunks})")
        cost += LEVER_COST["attention_head_chunks"]
    if new.offload_optimizer != o.offload_optimizer:
        changes.append("optimizer offload (zero_optimization.offload_optimizer.device=cpu)"
                       if new.offload_optimizer else "optimizer on the GPU (no offload_optimizer)")
        cost += LEVER_COST["offload_optimizer"] if new.offload_optimizer else 0
    return changes, cost


def _lever_settings(m: ModelShape, o: PlanOptions) -> list[tuple[tuple, list[str], PlanOptions]]:
    """Every setting of the levers that could help, as (rank, changes described, options), cheapest first.
    Never proposes a smaller sp, full logits, keeping more attention, switching TiledMLP off or fewer head chunks:
    they only add memory. Head chunks tried: the options' own and the most the heads allow at that sp."""
    offloads = [(False, o.activation_offload_fraction)] + [
        (True, v) for v in sorted({o.activation_offload_fraction, *OFFLOAD_SHARES}, reverse=True)]
    out = []
    for chunked, sp in itertools.product(sorted({o.chunked_loss, True}), (v for v in valid_sp(m, o) if v >= o.sp)):
        chunk_counts = sorted({o.attention_head_chunks if o.attention_head_chunks in valid_head_chunks(m, sp) else 1,
                               valid_head_chunks(m, sp)[-1]})
        for (acts, share), tiled, keep, chunks in itertools.product(
                offloads, sorted({o.tiled_mlp, True}), sorted({o.keep_attention_fraction, 0.0}, reverse=True),
                chunk_counts):
            if keep > 0 and chunks > 1:  # a layer keeps its attention or chunks it (config_checks)
                continue
            for opt in ((False, True) if o.include_optimizer else (o.offload_optimizer,)):
                new = o.replace(chunked_loss=chunked, sp=sp, offload_activations=acts, tiled_mlp=tiled,
                                offload_optimizer=opt, activation_offload_fraction=share,
                                keep_attention_fraction=keep, attention_head_chunks=chunks)
                changes, cost = _changes(o, new)
                # among equals, the most offloaded: it leaves the GPU the most room
                out.append(((cost, len(changes), sp, -share if acts else 0.0), changes, new))
    return sorted(out, key=lambda item: item[0])


def longest_fitting(model, options: PlanOptions) -> tuple[int, Optional[PlanOptions]]:
    """The longest sequence over every lever setting, with the options that reach it (the cheapest of
    equals). Offloading activations is not always longer: when host memory is the limit, keeping them on
    the GPUs reaches further."""
    m = load_model_shape(model)
    best, best_options = 0, None
    for _, _, o in _lever_settings(m, options):
        length = max_length(m, o)
        if length > best:
            best, best_options = length, o.replace(seq_length=length)
    if best_options is not None and best_options.offload_activations:
        best, best_options = _offload_by_the_layer(m, best, best_options)
    return best, best_options


def _offload_by_the_layer(m: ModelShape, best: int, o: PlanOptions) -> tuple[int, PlanOptions]:
    """The best quarter of offloaded layers refined one layer at a time within a quarter of it: at the longest
    lengths host memory (the offloaded checkpoints) and GPU memory (the kept ones) bind together, so the length
    peaks where one more offloaded layer would overfill the host."""
    for layers in range(m.layers + 1):
        share = layers / m.layers
        if abs(share - o.activation_offload_fraction) < OFFLOAD_SHARES[0] - OFFLOAD_SHARES[1]:
            length = max_length(m, o.replace(activation_offload_fraction=share))
            if length > best:
                best, o = length, o.replace(activation_offload_fraction=share, seq_length=length)
    return best, o


def suggest_fix(p: MemoryPlan) -> tuple[str, Optional[MemoryPlan]]:
    """The cheapest change that fits, as (description, its plan); ("", None) if nothing does.
    First the cheapest lever setting (LEVER_COST) that fits at this length; else a shorter sequence, with
    the lever setting that reaches the longest one."""
    m, o = p.model, p.options
    settings = _lever_settings(m, o)
    for _, changes, opts in settings:
        if changes:
            fixed = estimate(m, opts)
            if fixed.fits:
                return " + ".join(changes), fixed
    best, best_changes, best_options = 0, [], None
    for _, changes, opts in settings:
        length = max_length(m, opts)
        if length > best:
            best, best_changes, best_options = length, changes, opts
    if not best:
        return "", None
    text = f"a shorter sequence: data.seq_length={best:,} or less"
    return " + ".join(best_changes + [text]), estimate(m, best_options.replace(seq_length=best))


MOST_NODES = 64
"""The most nodes fewest_nodes tries (doubling from the plan's own count)."""


def fewest_nodes(p: MemoryPlan) -> tuple[int, list[str], Optional[MemoryPlan]]:
    """The fewest nodes (doubling, up to MOST_NODES) on which this sequence fits at its length, sp groups allowed
    across nodes, with the cheapest lever setting there: (nodes, the changes, its plan), or (0, [], None). For a
    model too big for one node at the length asked (GLM-5.3-Flash at 1,048,576 tokens): each node added takes a share
    of the sequence, the weights and the optimizer states."""
    m, o = p.model, p.options
    nodes = o.nodes * 2
    while nodes <= MOST_NODES:
        wider = o.replace(nodes=nodes, allow_sp_across_nodes=True)
        for _, changes, opts in _lever_settings(m, wider):
            plan = estimate(m, opts)
            if plan.fits:
                return nodes, changes, plan
        nodes *= 2
    return 0, [], None


def nodes_advice(p: MemoryPlan) -> str:
    """check_fits' line on the fewest nodes that fit at this length ("" where none up to MOST_NODES does)."""
    nodes, changes, plan = fewest_nodes(p)
    if plan is None:
        return ""
    o = plan.options
    across = " across nodes: parallel.allow_sp_across_nodes=true" if o.sp > o.gpus_per_node else ""
    return (f"Fewest nodes at this length: {nodes} nodes of {o.gpus_per_node} GPUs (sp={o.sp}{across}"
            + "".join(f"; {c}" for c in changes if not c.startswith("sp=")) + f") -> {plan.summary()}.")


def check_fits(p: MemoryPlan) -> None:
    """None if the plan fits; otherwise PlanError naming what does not fit, by how much, and the cheapest
    change that fits (itself re-planned)."""
    if p.fits:
        return
    o = p.options
    problems = []
    if p.gpu_total > p.gpu_capacity:
        phase = p.peak_phase
        top = sorted(p.components, key=lambda c: c.at(phase), reverse=True)[:3]
        problems.append(f"GPU memory: {p.gpu_total / GIB:.1f} GiB per GPU needed (during {PHASE_NAMES[phase]}) but "
                        f"{o.gpu_memory_gib:g} GiB available: over by {(p.gpu_total - p.gpu_capacity) / GIB:.1f} GiB. "
                        f"Largest parts: " + ", ".join(f"{c.name} {c.at(phase) / GIB:.1f} GiB" for c in top) + ".")
    if p.host_per_node > p.host_capacity:
        top = [c for c in sorted(p.components, key=lambda c: c.host, reverse=True) if c.host][:3]
        problems.append(f"host memory: {p.host_per_node / GIB:.1f} GiB per node needed but {o.host_memory_gib:g} GiB "
                        f"available: over by {(p.host_per_node - p.host_capacity) / GIB:.1f} GiB. Largest parts "
                        f"(x{o.gpus_per_node} GPUs): " + ", ".join(f"{c.name} {c.host / GIB:.1f} GiB" for c in top)
                        + ".")
    fix, fixed = suggest_fix(p)
    advice = (f"Cheapest change that fits: {fix} -> {fixed.summary()}." if fixed is not None else
              "No change the planner knows of fits: use more or larger GPUs, or more host memory.")
    more_nodes = nodes_advice(p) if fixed is None or fixed.options.seq_length < o.seq_length else ""
    raise PlanError(f"{p.model.name} at {o.padded_length:,} tokens (sp={o.sp}, {o.world} GPUs) does not fit.\n"
                    + "\n".join(problems) + "\n" + advice + (f"\n{more_nodes}" if more_nodes else ""))
