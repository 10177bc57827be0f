"""What the planner prints: one plan as a table or a line, and the story of its levers (from the naive run to the
plan's own options, one lever at a time: chunked loss -> offload -> TiledMLP -> kept attention -> sp)."""
from __future__ import annotations

from ulysses_train.constants import GIB
from ulysses_train.planner.estimate import estimate
from ulysses_train.planner.options import PlanOptions
from ulysses_train.planner.result import PHASE_NAMES, PHASES, MemoryPlan
from ulysses_train.planner.search import valid_sp
from ulysses_train.planner.shapes import load_model_shape


def plan_summary(p: MemoryPlan) -> str:
    """One line: GPU and host memory against capacity, the peak's moment, the step time."""
    o = p.options
    return (f"GPU {p.gpu_total / GIB:.1f} / {o.gpu_memory_gib:g} GiB per GPU (peak during "
            f"{PHASE_NAMES[p.peak_phase]}), host {p.host_per_node / GIB:.1f} / {o.host_memory_gib:g} GiB "
            f"per node; step ~{p.step_seconds:.1f} s")


def plan_table(p: MemoryPlan) -> str:
    """Every component at each moment and on the host, the totals, the fit and the step time (GiB)."""
    o, m = p.options, p.model
    levers = [name for name, on in (("chunked loss", o.chunked_loss), ("activation offload", o.offload_activations),
                                    ("optimizer offload", o.offload_optimizer), ("TiledMLP", o.tiled_mlp),
                                    ("gradient checkpointing", o.gradient_checkpointing)) if on]
    if o.keep_attention_fraction:
        levers.append(f"keep attention {o.keep_attention_fraction:g}")
    if o.offload_activations and o.activation_offload_fraction < 1:
        levers.append(f"activation offload share {o.activation_offload_fraction:g}")
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
    if p.offload_seconds:
        lines.append(f"offload copies ~{p.offload_seconds:.1f} s per step at {o.host_link_gbps:g} GB/s "
                     f"(hidden if shorter than compute)")
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)


def story(model, options: PlanOptions) -> list[tuple[str, MemoryPlan]]:
    """The levers of `options`, one at a time, each on top of the previous: from the naive run (full logits, no
    offload, no tiling, no kept attention, sp=1) to exactly `options`, so the last row is the plan printed above
    it (one computation). Levers that `options` leaves off are not shown; plan with them to see what they buy."""
    m = load_model_shape(model)
    current = options.replace(sp=1, chunked_loss=False, offload_activations=False, offload_optimizer=False,
                              tiled_mlp=False, keep_attention_fraction=0.0)
    steps = [("naive (full logits, sp=1)", current)]
    for label, change in _levers_of(options):
        current = current.replace(**change)
        steps.append((label, current))
    return [(label, estimate(m, o)) for label, o in steps]


def _levers_of(options: PlanOptions) -> list[tuple[str, dict]]:
    """(label, the options it sets) for each lever `options` turns on, in the order the story adds them."""
    levers = []
    if options.chunked_loss:
        levers.append(("+ chunked loss", {"chunked_loss": True}))
    if options.offload_activations:
        share = options.activation_offload_fraction
        levers.append(("+ activation offload" + (f" ({share:.0%} of layers)" if share < 1 else ""),
                       {"offload_activations": True}))
    if options.offload_optimizer:
        levers.append(("+ optimizer offload", {"offload_optimizer": True}))
    if options.tiled_mlp:
        levers.append(("+ TiledMLP", {"tiled_mlp": True}))
    if options.keep_attention_fraction > 0:
        levers.append((f"+ attention kept ({options.keep_attention_fraction:.0%} of layers)",
                       {"keep_attention_fraction": options.keep_attention_fraction}))
    if options.sp > 1:
        levers.append((f"+ sp={options.sp}", {"sp": options.sp}))
    return levers


def story_table(rows: list[tuple[str, MemoryPlan]]) -> str:
    """The story as a table: GPU and host memory, step time, fit and the peak's moment of each step."""
    first = rows[0][1]
    lines = [f"{first.model.name} at {first.options.seq_length:,} tokens, {first.options.world} GPUs "
             f"of {first.options.gpu_memory_gib:g} GiB, {first.options.host_memory_gib:g} GiB host",
             f"{'step':<40}{'GPU GiB':>10}{'host GiB/node':>15}{'step s':>9}  fits  peak during"]
    for label, p in rows:
        lines.append(f"{label:<40}{p.gpu_total / GIB:>10.1f}{p.host_per_node / GIB:>15.1f}{p.step_seconds:>9.1f}"
                     f"  {'yes ' if p.fits else 'NO  '}  {p.peak_phase}")
    return "\n".join(lines)
