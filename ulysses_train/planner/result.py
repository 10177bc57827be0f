"""A prediction: `Component` (one holder of memory at each moment of a step) and `MemoryPlan` (all of them, the
FLOPs of one sequence, and what follows: peak, fit, step time)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ulysses_train.constants import GIB
from ulysses_train.planner.options import PlanOptions
from ulysses_train.planner.shapes import ModelShape

PHASES = ("loss", "mlp", "norm", "attn")
PHASE_NAMES = {"loss": "the loss", "mlp": "the MLP backward of a recomputed layer",
               "norm": "the post-attention RMSNorm backward of a recomputed layer",
               "attn": "the attention backward of a recomputed layer"}


@dataclass
class Component:
    """One holder of memory: bytes on one GPU at each moment, bytes on the host per GPU process."""

    name: str
    loss: int = 0
    mlp: int = 0
    norm: int = 0
    attn: int = 0
    host: int = 0
    why: str = ""
    outside_allocator: bool = False
    """On the card but not in torch's allocator (not in max_memory_allocated)."""

    def at(self, phase: str) -> int:
        return getattr(self, phase)


@dataclass
class MemoryPlan:
    """A prediction: the components (bytes per GPU at each moment, per GPU process on the host), the FLOPs
    of one sequence, and what follows from them (peak, fit, step time); `table()` prints it all."""

    model: ModelShape
    options: PlanOptions
    components: list[Component]
    model_flops: float
    """6*N*T + 3 * causal attention forward: what a TFLOP/s figure usually counts."""
    recompute_flops: float
    """Extra forward work: checkpoint recompute (layers, attention unless kept), TiledMLP's re-run."""
    notes: list[str] = field(default_factory=list)
    exchange_seconds: float = 0.0
    """The Ulysses all-to-alls on one GPU (planner/exchange_time.py): they stall compute, so they add to it."""

    # -- memory
    def gpu_at(self, phase: str, allocated_only: bool = False) -> int:
        return sum(c.at(phase) for c in self.components if not (allocated_only and c.outside_allocator))

    @property
    def peak_phase(self) -> str:
        return max(PHASES, key=self.gpu_at)

    @property
    def gpu_total(self) -> int:
        """Per GPU, everything on the card at the worst moment: what must fit."""
        return max(self.gpu_at(p) for p in PHASES)

    @property
    def gpu_allocated(self) -> int:
        """Per GPU, what torch.cuda.max_memory_allocated() would report."""
        return max(self.gpu_at(p, allocated_only=True) for p in PHASES)

    @property
    def host_per_gpu(self) -> int:
        return sum(c.host for c in self.components)

    @property
    def host_per_node(self) -> int:
        return self.host_per_gpu * self.options.gpus_per_node

    @property
    def gpu_capacity(self) -> int:
        return int(self.options.gpu_memory_gib * GIB)

    @property
    def host_capacity(self) -> int:
        return int(self.options.host_memory_gib * GIB)

    @property
    def fits(self) -> bool:
        return self.gpu_total <= self.gpu_capacity and self.host_per_node <= self.host_capacity

    # -- time
    @property
    def compute_seconds(self) -> float:
        """One sequence's FLOPs (with recompute), shared by the sp GPUs that hold it."""
        o = self.options
        return (self.model_flops + self.recompute_flops) / (o.tflops * 1e12 * o.sp)

    @property
    def offload_seconds(self) -> float:
        """Each offloaded checkpoint crosses the host link twice (out in forward, back in backward)."""
        offloaded = sum(c.host for c in self.components if c.name.startswith("checkpointed"))
        return 2 * offloaded / (self.options.host_link_gbps * 1e9)

    @property
    def step_seconds(self) -> float:
        """Compute and exchange time, or the offload copies if they are longer (they overlap both on a side
        stream)."""
        return max(self.compute_seconds + self.exchange_seconds, self.offload_seconds)

    @property
    def tokens_per_second(self) -> float:
        """Tokens of all data-parallel groups per second."""
        o = self.options
        return o.padded_length * (o.world // o.sp) / self.step_seconds

    # -- output
    def summary(self) -> str:
        """One line: GPU and host memory against capacity, the peak's moment, the step time."""
        p, o = self, self.options
        return (f"GPU {p.gpu_total / GIB:.1f} / {o.gpu_memory_gib:g} GiB per GPU (peak during "
                f"{PHASE_NAMES[p.peak_phase]}), host {p.host_per_node / GIB:.1f} / {o.host_memory_gib:g} GiB "
                f"per node; step ~{p.step_seconds:.1f} s")

    def table(self) -> str:
        """Every component at each moment and on the host, the totals, the fit and the step time (GiB)."""
        p, o, m = self, self.options, self.model
        levers = [name for name, on in (("chunked loss", o.chunked_loss), ("activation offload", o.offload_activations),
                                        ("optimizer offload", o.offload_optimizer), ("TiledMLP", o.tiled_mlp),
                                        ("gradient checkpointing", o.gradient_checkpointing)) if on]
        if o.keep_attention_fraction:
            levers.append(f"keep attention {o.keep_attention_fraction:g}")
        if o.offload_activations and o.activation_offload_fraction < 1:
            levers.append(f"activation offload share {o.activation_offload_fraction:g}")
        if o.attention_head_chunks > 1:
            levers.append(f"attention in {o.attention_head_chunks} head chunks")
        lines = [f"{m.name}: {m.total_params / 1e9:.2f}B params, seq {o.padded_length:,} tokens, sp={o.sp}, "
                 f"{o.nodes} node(s) x {o.gpus_per_node} GPUs (dp={o.world // o.sp}), ZeRO-{o.zero_stage}, "
                 f"{o.seq_local:,} tokens per GPU",
                 f"levers: {', '.join(levers) or 'none'}",
                 "",
                 f"{'component':<36}{'loss':>9}{'mlp bwd':>9}{'norm bwd':>9}{'attn bwd':>9}{'host/GPU':>10}"
                 "  (GiB)"]
        for c in p.components:
            if c.loss or c.mlp or c.norm or c.attn or c.host:
                lines.append(f"{c.name:<36}" + "".join(f"{c.at(phase) / GIB:>9.2f}" for phase in PHASES)
                             + f"{c.host / GIB:>10.2f}")
        lines.append(f"{'total per GPU':<36}" + "".join(f"{p.gpu_at(phase) / GIB:>9.2f}" for phase in PHASES)
                     + f"{p.host_per_gpu / GIB:>10.2f}")
        lines += ["",
                  f"GPU peak {p.gpu_total / GIB:.2f} GiB of {o.gpu_memory_gib:g} "
                  f"(during {PHASE_NAMES[p.peak_phase]}; {p.gpu_allocated / GIB:.2f} GiB allocated by torch)",
                  f"host {p.host_per_node / GIB:.1f} GiB per node of {o.host_memory_gib:g} "
                  f"({o.gpus_per_node} x {p.host_per_gpu / GIB:.1f} GiB)",
                  f"fits: {'yes' if p.fits else 'NO'}",
                  f"step time ~{p.step_seconds:.1f} s at {o.tflops:g} TFLOP/s per GPU "
                  f"(model {p.model_flops / 1e15:.1f} PFLOP + recompute {p.recompute_flops / 1e15:.1f} PFLOP "
                  f"per sequence over {o.sp} GPU(s); {p.tokens_per_second:,.0f} tokens/s)"]
        if p.exchange_seconds:
            lines.append(exchange_line(p))
        if p.offload_seconds:
            lines.append(f"offload copies ~{p.offload_seconds:.1f} s per step at {o.host_link_gbps:g} GB/s "
                         f"(hidden if shorter than compute)")
        lines += [f"note: {n}" for n in p.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "model": dataclasses.asdict(self.model), "options": dataclasses.asdict(self.options),
            "components": [dataclasses.asdict(c) for c in self.components],
            "gpu_total_gib": self.gpu_total / GIB, "gpu_allocated_gib": self.gpu_allocated / GIB,
            "peak_phase": self.peak_phase, "host_per_gpu_gib": self.host_per_gpu / GIB,
            "host_per_node_gib": self.host_per_node / GIB, "fits": self.fits,
            "model_flops": self.model_flops, "recompute_flops": self.recompute_flops,
            "step_seconds": self.step_seconds, "offload_seconds": self.offload_seconds,
            "exchange_seconds": self.exchange_seconds, "notes": self.notes,
        }


def exchange_line(p: MemoryPlan) -> str:
    """The table's line on the Ulysses exchange: its seconds, over NVLink only or across nodes too."""
    from ulysses_train.planner.communication import EFFECTIVE_LINK_GBPS, INTER_NODE_LINK_GBPS

    o = p.options
    links = (f"NVLink at {EFFECTIVE_LINK_GBPS:g} GB/s" if o.sp <= o.gpus_per_node else
             f"{o.sp // o.gpus_per_node} nodes: NVLink at {EFFECTIVE_LINK_GBPS:g} GB/s, the network at "
             f"{INTER_NODE_LINK_GBPS:g} GB/s per GPU (assumed)")
    return f"Ulysses exchange ~{p.exchange_seconds:.1f} s per step, included ({links})"
