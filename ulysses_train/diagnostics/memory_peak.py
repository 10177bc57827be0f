"""What is alive at a step's GPU memory peak, from the allocator's recorded history: the answer to "which tensors make
the peak", which a peak number alone cannot give (a planner gap is found by comparing this list with the plan's
components table).

    peak = allocations_at_peak(torch.cuda.memory._snapshot())   # recorded with stacks="python"
    for site in peak["by_site"][:10]: print(site)

The trace holds every alloc and free since recording began, each alloc with the Python stack that made it. Replaying
it gives the allocated bytes after every event; at the highest point the live blocks are those allocated and not yet
freed, plus whatever was alive before recording began (one sum: its stacks were never seen). A block is named by its
innermost frame outside torch itself (the model or package line that asked for it); blocks made inside autograd's
backward show the line that called backward, so their sizes tell them apart. MemoryProfile writes this beside its
snapshot (`<tag>_rank<r>_peak.json`)."""
from __future__ import annotations

from typing import Optional

from ulysses_train.constants import GIB

TORCH_FRAMES = ("/torch/", "<frozen", "/contextlib.py", "/functools.py")
"""Path parts of frames that are plumbing rather than the code that asked for memory."""
PLUMBING_FUNCTIONS = (("ulysses_train/model/recompute.py", "__torch_dispatch__"),
                      ("deepspeed/utils/nvtx.py", "wrapped_fn"))
"""(path part, function) of frames every op passes through in some layers: the kept-attention dispatch modes and
DeepSpeed's range markers."""


def is_plumbing(frame: dict) -> bool:
    path = frame.get("filename", "")
    return (any(part in path for part in TORCH_FRAMES)
            or any(part in path and frame.get("name") == name for part, name in PLUMBING_FUNCTIONS))


def frame_name(frame: dict) -> str:
    """'file.py:LINE function' with the path cut to the package that holds it."""
    path = frame.get("filename", "?")
    for root in ("site-packages/", "ulysses_train/", "scripts/", "benchmarks/"):
        if root in path:
            path = (root if root != "site-packages/" else "") + path.split(root, 1)[1]
            break
    return f"{path}:{frame.get('line', '?')} {frame.get('name', '?')}"


def site_of(frames: list) -> tuple[str, list]:
    """(the innermost frame outside torch and the plumbing, the three frames from it outwards) of one alloc event's
    stack."""
    useful = [f for f in frames or [] if not is_plumbing(f)]
    if not useful:
        return ("torch internals" if frames else "no stack"), []
    return frame_name(useful[0]), [frame_name(f) for f in useful[:3]]


def replay(trace: list, allocated_now: int) -> tuple[int, int, dict, int]:
    """(bytes alive since before the trace and still alive at the peak, index of the peak event, {addr: alloc
    event} alive at the peak, peak bytes). The level before the trace is derived backwards from the bytes alive
    when the snapshot was taken."""
    before = allocated_now - allocated_in_trace(trace)
    live, level, unseen_freed = {}, before, 0
    peak, peak_index, peak_live, peak_before = before, -1, {}, before
    for i, event in enumerate(trace):
        if event["action"] == "alloc":
            live[event["addr"]] = event
            level += event.get("size", 0)
        elif event["action"] == "free_completed":
            level -= event.get("size", 0)
            if live.pop(event["addr"], None) is None:
                unseen_freed += event.get("size", 0)  # a block from before recording
        if level > peak:
            peak, peak_index, peak_live, peak_before = level, i, dict(live), before - unseen_freed
    return peak_before, peak_index, peak_live, peak


def allocated_in_trace(trace: list) -> int:
    """Bytes the trace's allocs added, net of its completed frees."""
    return sum(e.get("size", 0) * {"alloc": 1, "free_completed": -1}.get(e["action"], 0) for e in trace)


def allocated_in_segments(snapshot: dict, device: int) -> int:
    """Bytes in blocks in use when the snapshot was taken, on `device`."""
    return sum(b["size"] for s in snapshot.get("segments", []) if s.get("device", device) == device
               for b in s.get("blocks", []) if b.get("state") in ("active_allocated", "active_awaiting_free"))


def allocations_at_peak(snapshot: dict, device: Optional[int] = None, top: int = 40,
                        markers: Optional[list] = None) -> dict:
    """The peak of `device`'s recorded trace and what holds it: the largest live blocks (GiB, site, stack) and
    the bytes per site, largest first; with `markers` (MemoryProfile's: name and the address of a tiny tensor
    allocated when the phase began) the phase the peak fell in."""
    traces = snapshot.get("device_traces") or [[]]
    if device is None:
        device = max(range(len(traces)), key=lambda d: len(traces[d]))
    trace = traces[device]
    before, index, live, peak = replay(trace, allocated_in_segments(snapshot, device))
    blocks, by_site = [], {}
    for event in live.values():
        site, stack = site_of(event.get("frames"))
        blocks.append({"gib": event.get("size", 0) / GIB, "site": site, "stack": stack})
        total, count = by_site.get(site, (0.0, 0))
        by_site[site] = (total + event.get("size", 0) / GIB, count + 1)
    blocks.sort(key=lambda b: -b["gib"])
    return {"peak_gib": peak / GIB, "event_index": index, "phase": phase_at(trace, index, markers or []),
            "alive_before_recording_gib": before / GIB,
            "by_site": [{"site": s, "gib": round(g, 4), "blocks": n}
                        for s, (g, n) in sorted(by_site.items(), key=lambda kv: -kv[1][0])],
            "largest_blocks": [{**b, "gib": round(b["gib"], 4)} for b in blocks[:top]]}


def phase_at(trace: list, index: int, markers: list) -> Optional[str]:
    """The phase the event `index` falls in: the last marker allocated at or before it. A marker's own alloc is
    the last one at its address in the whole trace (it lives until the step ends; the allocator hands earlier
    short-lived tensors the same address)."""
    own = last_alloc_index(trace)
    found = [(own[m["addr"]], m["name"]) for m in markers if own.get(m.get("addr"), index + 1) <= index]
    return max(found)[1] if found else None


def last_alloc_index(trace: list) -> dict:
    """{address: index of the last alloc at it}: where a marker (a tiny tensor alive until the step ends) sits in
    the trace."""
    return {event.get("addr"): i for i, event in enumerate(trace) if event["action"] == "alloc"}
