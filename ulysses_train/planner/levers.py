"""`auto` memory levers: the fastest setting the planner says fits this machine, with a safety margin.

`model.keep_attention_fraction`, `model.activation_offload_fraction`, `model.tiled_mlp` and
`model.attention_head_chunks` default to `auto`.
At start the trainer asks `choose_levers` for the setting of the `auto` ones that the planner's time model says
is fastest among those whose predicted GPU peak and host total fit inside SAFETY of this node's memory. Keeping
attention outputs saves attention's recompute (the largest recompute at long lengths) but holds them on the GPU;
TiledMLP adds an MLP forward and saves the MLP's intermediates; attention in head chunks adds an attention forward
and divides attention's whole-sequence backward buffers; activation offload (only when the DeepSpeed JSON
turns `cpu_checkpointing` on) moves layer inputs to the host, nearly free in time while its copies overlap.
A value the user gives is never changed. Ties (within TIE of the fastest) go to less offload, then to the
smaller GPU peak: offload's copies compete with the rest of the host, and a smaller peak leaves more margin.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from ulysses_train.constants import GIB
from ulysses_train.model.mixers import valid_head_chunks
from ulysses_train.planner.estimate import estimate
from ulysses_train.planner.options import PlanOptions
from ulysses_train.planner.result import MemoryPlan
from ulysses_train.planner.shapes import ModelShape

AUTO = "auto"
KEEP_CHOICES = (0.0, 0.25, 0.5, 0.75, 1.0)
OFFLOAD_CHOICES = (0.0, 0.25, 0.5, 0.75, 1.0)
SAFETY = {"gpu": 0.92, "host": 0.85}
"""Shares of the detected memory a chosen setting may plan to use. The planner's GPU total is 1-13% above every
measured peak of benchmarks/planner_validation.jsonl, so the GPU share mostly covers what the planner does not
see (the CUDA context, other processes on the card); the host share leaves room for the page cache, the data
loader and the launcher."""
TIE = 0.01
"""Settings whose predicted step time is within this share of the fastest count as equally fast."""


@dataclass(frozen=True)
class LeverChoice:
    """The chosen setting, as PlanOptions and as the config values it replaces, with its plan."""

    options: PlanOptions
    plan: MemoryPlan
    values: dict
    """The chosen values of the keys that were `auto` (config names, config types)."""
    fits: bool
    """False when no setting fits within SAFETY: the one with the smallest GPU peak is returned, and the
    trainer's preflight check refuses it with the planner's advice."""

    def describe(self) -> str:
        """One line for the log: what was chosen and what the planner predicts."""
        o, p = self.options, self.plan
        parts = [f"attention kept in {o.keep_attention_fraction:.0%} of layers",
                 "TiledMLP " + ("on" if o.tiled_mlp else "off"),
                 (f"activation offload {o.activation_offload_fraction:.0%} of layers" if o.offload_activations
                  else "no activation offload")]
        if o.attention_head_chunks > 1:
            parts.append(f"attention in {o.attention_head_chunks} head chunks")
        return (f"levers (auto: {', '.join(sorted(self.values))}): {'; '.join(parts)}. Predicted: GPU peak "
                f"{p.gpu_total / GIB:.1f} of {o.gpu_memory_gib:.1f} GiB, host {p.host_per_node / GIB:.1f} of "
                f"{o.host_memory_gib:.1f} GiB per node, {p.step_seconds:.1f} s per step"
                + ("" if self.fits else f" (nothing fits within {SAFETY['gpu']:.0%} of the GPU and "
                                        f"{SAFETY['host']:.0%} of the host; the preflight check says what would)") + ".")

    def to_dict(self) -> dict:
        p = self.plan
        return {"chosen": self.values, "fits": self.fits, "predicted_gpu_peak_gib": round(p.gpu_total / GIB, 2),
                "predicted_host_gib_per_node": round(p.host_per_node / GIB, 2),
                "predicted_step_seconds": round(p.step_seconds, 2),
                "gpu_memory_gib": round(self.options.gpu_memory_gib, 2),
                "host_memory_gib": round(self.options.host_memory_gib, 2), "safety": SAFETY}


def _within_safety(p: MemoryPlan) -> bool:
    o = p.options
    return (p.gpu_total <= SAFETY["gpu"] * o.gpu_memory_gib * GIB
            and p.host_per_node <= SAFETY["host"] * o.host_memory_gib * GIB)


def candidates(m: ModelShape, o: PlanOptions, auto: set[str]) -> list[PlanOptions]:
    """Every setting of the `auto` levers (the others as `o` has them). Offload shares are tried only when
    activation offload is on (the DeepSpeed JSON's cpu_checkpointing); without it the share does nothing."""
    keeps = KEEP_CHOICES if "keep_attention_fraction" in auto else (o.keep_attention_fraction,)
    shares = (OFFLOAD_CHOICES if "activation_offload_fraction" in auto and o.offload_activations
              else (o.activation_offload_fraction,))
    tiles = (False, True) if "tiled_mlp" in auto else (o.tiled_mlp,)
    chunks = valid_head_chunks(m, o.sp) if "attention_head_chunks" in auto else (o.attention_head_chunks,)
    if not o.gradient_checkpointing or o.dtype_bytes > 2:
        # nothing is recomputed, so there is nothing to keep; or fp32, where no fused kernel runs for kept layers
        # to save (FlashAttention 4 takes bf16 only, and SDPA on a GPU falls back to its math path with GQA)
        keeps = (0.0,)
    return [o.replace(keep_attention_fraction=k, activation_offload_fraction=s, tiled_mlp=t, attention_head_chunks=n)
            for k, s, t, n in itertools.product(keeps, shares, tiles, chunks)
            if not (k > 0 and n > 1)]  # a layer keeps its attention or chunks it (config_checks)


def choose_levers(m: ModelShape, o: PlanOptions, auto: set[str]) -> LeverChoice:
    """The fastest setting of the `auto` levers whose plan fits within SAFETY (module docstring)."""
    plans = [estimate(m, c) for c in candidates(m, o, auto)]
    fitting = [p for p in plans if _within_safety(p)]
    if fitting:
        fastest = min(p.step_seconds for p in fitting)
        near = [p for p in fitting if p.step_seconds <= fastest * (1 + TIE)]
        offloaded = lambda p: p.options.activation_offload_fraction if p.options.offload_activations else 0.0
        best = min(near, key=lambda p: (offloaded(p), p.gpu_total, p.step_seconds))
    else:
        best = min(plans, key=lambda p: (p.gpu_total, p.host_per_node))
    c = best.options
    chosen = {"keep_attention_fraction": c.keep_attention_fraction,
              "activation_offload_fraction": c.activation_offload_fraction, "tiled_mlp": c.tiled_mlp,
              "attention_head_chunks": c.attention_head_chunks}
    return LeverChoice(c, best, {k: v for k, v in chosen.items() if k in auto}, bool(fitting))
