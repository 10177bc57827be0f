"""The story of a plan's levers (from the naive run to the plan's own options, one lever at a time: chunked loss ->
offload -> TiledMLP -> kept attention -> sp -> head chunks). One plan prints itself (MemoryPlan.table and .summary)."""
from __future__ import annotations

from ulysses_train.constants import GIB
from ulysses_train.planner.estimate import estimate
from ulysses_train.planner.options import PlanOptions
from ulysses_train.planner.result import MemoryPlan
from ulysses_train.planner.shapes import load_model_shape


def story(model, options: PlanOptions) -> list[tuple[str, MemoryPlan]]:
    """The levers of `options`, one at a time, each on top of the previous: from the naive run (full logits, no
    offload, no tiling, no kept attention, sp=1) to exactly `options`, so the last row is the plan printed above
    it (one computation). Levers that `options` leaves off are not shown; plan with them to see what they buy."""
    m = load_model_shape(model)
    current = options.replace(sp=1, chunked_loss=False, offload_activations=False, offload_optimizer=False,
                              tiled_mlp=False, keep_attention_fraction=0.0, attention_head_chunks=1)
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
    if options.attention_head_chunks > 1:
        levers.append((f"+ attention in {options.attention_head_chunks} head chunks",
                       {"attention_head_chunks": options.attention_head_chunks}))
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
