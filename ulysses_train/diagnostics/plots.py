"""The two pictures of long-context training: loss by position, and memory over one step.

Both are PNGs (matplotlib, Agg backend, no display needed) with their numbers written next to them,
so a plot can be checked and re-drawn without re-running the model:

- `write_loss_by_position(runs, out_dir)`: one line per evaluated run and length (e.g. YaRN on / off) with
  a band of +-1 standard error of each bucket's mean, dashed unigram-entropy reference lines, a dotted line at the trained length; writes
  `loss_by_position.png`, `.csv` (one row per bucket) and `.json` (the runs as given).
- `plot_memory_timeline(snapshot, png, markers)`: allocated and reserved GPU memory through one step from
  a `torch.cuda.memory._snapshot()` taken with `_record_memory_history` on, the phases (forward, loss,
  backward, optimizer) shaded from the markers `profiling.MemoryProfile` left in the allocator trace.

Re-draw from saved files:
    python -m ulysses_train.diagnostics.plots loss OUT_DIR name=run.json [name=run.json ...]
    python -m ulysses_train.diagnostics.plots memory SNAPSHOT.pickle OUT.png [--markers MARKERS.json]
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import pickle
import sys
from typing import Optional

from ulysses_train.constants import GIB
from ulysses_train.diagnostics.memory_peak import allocated_in_segments, allocated_in_trace, last_alloc_index

PHASE_COLORS = {"forward": "#4C72B0", "loss": "#DD8452", "backward": "#C44E52", "optimizer": "#55A868",
                "start": "#BBBBBB", "eval": "#8172B3"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _tokens(value: float) -> str:
    value = float(value)
    for unit, size in (("M", 2**20), ("K", 2**10)):
        if abs(value) >= size and value % (size / 4) == 0:
            return f"{value / size:g}{unit}"
    return f"{value:,.0f}"


# ---------------------------------------------------------------- loss by position


def loss_rows(runs: list[dict]) -> list[dict]:
    """One row per (run, length, bucket): the numbers the plot draws."""
    rows = []
    for run in runs:
        for res in run["results"]:
            length, bucket = res["length"], res["bucket"]
            for i, (start, total, count) in enumerate(zip(res["bucket_start"], res["nll_sum"], res["count"])):
                se = (res.get("standard_error") or [None] * len(res["count"]))[i]
                rows.append({"run": run["name"], "length": length, "bucket_start": start,
                             "bucket_end": min(start + bucket, length), "mean_nll": total / count if count else "",
                             "standard_error": "" if se is None else se, "count": count,
                             "unigram_entropy": res["unigram_entropy"]})
    return rows


def plot_loss_by_position(runs: list[dict], png: str, title: Optional[str] = None) -> str:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 5), dpi=120)
    multi_length = len({res["length"] for run in runs for res in run["results"]}) > 1
    entropies, trained = {}, set()
    for run in runs:
        if run.get("trained_length"):
            trained.add(int(run["trained_length"]))
        for res in run["results"]:
            xs, ys, errors = [], [], []
            se = res.get("standard_error") or [None] * len(res["count"])
            for start, total, count, error in zip(res["bucket_start"], res["nll_sum"], res["count"], se):
                if count:
                    xs.append(start + min(res["bucket"], res["length"] - start) / 2)
                    ys.append(total / count)
                    errors.append(error or 0.0)
            label = f"{run['name']} ({_tokens(res['length'])})" if multi_length else run["name"]
            (line,) = ax.plot(xs, ys, marker="o" if len(xs) <= 40 else None, markersize=3, linewidth=1.5, label=label)
            if any(errors):  # +-1 standard error of each bucket's mean
                ax.fill_between(xs, [y - e for y, e in zip(ys, errors)], [y + e for y, e in zip(ys, errors)],
                                color=line.get_color(), alpha=0.15, linewidth=0)
            entropy = res["unigram_entropy"]
            if entropy is not None and not math.isnan(entropy):  # runs on the same text share one line
                entropies.setdefault(round(entropy, 6), (line.get_color(), label))
    for value, (color, label) in sorted(entropies.items()):
        if len(entropies) == 1:
            color, label = "gray", "unigram entropy"
        else:
            label = f"unigram entropy, text of {label}"
        ax.axhline(value, color=color, linestyle="--", linewidth=1, label=f"{label}: {value:.3f}")
    references = {k: v for run in runs for k, v in (run.get("references") or {}).items()}
    for name, value in sorted(references.items()):
        ax.axhline(value, color="tab:red", linestyle="-.", linewidth=1, alpha=0.7, label=f"{name} {value:.3f}")
    longest = max((res["length"] for run in runs for res in run["results"]), default=0)
    for length in sorted(t for t in trained if t < longest):  # only where the plot crosses it
        ax.axvline(length, color="black", linestyle=":", linewidth=1, label=f"RoPE trained length {_tokens(length)}")
    ax.set_xlabel("position in the sequence (tokens; bucket centres)")
    ax.set_ylabel("mean NLL per token (nats)")
    ax.set_title(title or "Loss by position")
    ax.xaxis.set_major_formatter(lambda v, _: _tokens(v) if v >= 0 else "")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)
    return png


def write_loss_by_position(runs: list[dict], out_dir: str, stem: str = "loss_by_position",
                           title: Optional[str] = None) -> dict:
    """PNG + CSV + JSON of `runs` (records from `evaluation.run_record`). Returns the paths written;
    without matplotlib the numbers are still written and the PNG is skipped with a message."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, f"{stem}.json"), "csv": os.path.join(out_dir, f"{stem}.csv")}
    with open(paths["json"], "w") as fh:
        json.dump({"runs": runs}, fh, indent=1)
    rows = loss_rows(runs)
    with open(paths["csv"], "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=["run", "length", "bucket_start", "bucket_end", "mean_nll",
                                                "standard_error", "count", "unigram_entropy"])
        writer.writeheader()
        writer.writerows(rows)
    try:
        paths["png"] = plot_loss_by_position(runs, os.path.join(out_dir, f"{stem}.png"), title)
    except ImportError:
        print(f"matplotlib is not installed: wrote {paths['json']} and {paths['csv']} but no PNG; draw it later "
              f"with `python -m ulysses_train.diagnostics.plots loss {out_dir} NAME=RUN.json ...`.", file=sys.stderr)
    return paths


def read_run(path: str, name: Optional[str] = None) -> list[dict]:
    """Runs from a JSON written by eval_positions (one run) or by write_loss_by_position (several)."""
    with open(path) as fh:
        data = json.load(fh)
    runs = data["runs"] if "runs" in data else [data]
    if name is not None:
        if len(runs) != 1:
            return [dict(r, name=f"{name}/{r['name']}") for r in runs]
        runs = [dict(runs[0], name=name)]
    return runs


# ---------------------------------------------------------------- memory over time


def memory_timeline(snapshot: dict, device: Optional[int] = None, markers: Optional[list] = None) -> dict:
    """Allocated and reserved bytes after every allocator event of `device`'s trace.

    The trace only holds events since recording started, so the level before the first event is
    derived backwards from the state at snapshot time: allocated now = blocks still in use, reserved
    now = segments held; subtract what the trace added. Markers (dicts with `name` and the `addr` of a
    tiny tensor allocated at that moment) are located by their own `alloc` event.
    Returns times in ms since the first event (event index when the trace has no times).
    """
    traces = snapshot.get("device_traces") or [[]]
    if device is None:
        device = max(range(len(traces)), key=lambda d: len(traces[d]))
    trace = traces[device]
    segments = [s for s in snapshot.get("segments", []) if s.get("device", device) == device]
    reserved_now = sum(s["total_size"] for s in segments)
    d_alloc = {"alloc": 1, "free_completed": -1}
    d_reserved = {"segment_alloc": 1, "segment_free": -1, "segment_map": 1, "segment_unmap": -1}
    reserved_delta = sum(d_reserved.get(e["action"], 0) * e.get("size", 0) for e in trace)
    allocated = allocated_in_segments(snapshot, device) - allocated_in_trace(trace)
    reserved = reserved_now - reserved_delta
    has_time = bool(trace) and all("time_us" in e for e in trace)
    t0 = trace[0]["time_us"] if has_time else 0
    times, alloc_series, reserved_series = [], [], []
    for i, event in enumerate(trace):
        allocated += d_alloc.get(event["action"], 0) * event.get("size", 0)
        reserved += d_reserved.get(event["action"], 0) * event.get("size", 0)
        times.append((event["time_us"] - t0) / 1000.0 if has_time else float(i))
        alloc_series.append(allocated)
        reserved_series.append(reserved)
    found = []
    if markers:
        # a marker lives until the step ends, so its alloc is the *last* alloc at its address (the caching
        # allocator hands the same address to earlier, short-lived tensors too)
        where = last_alloc_index(trace)
        for marker in markers:
            i = where.get(marker.get("addr"))
            if i is not None:
                found.append({"name": marker["name"], "index": i, "time": times[i]})
            elif has_time and marker.get("time_s") is not None:  # fell out of the ring buffer: use its clock
                found.append({"name": marker["name"], "index": None,
                              "time": (marker["time_s"] * 1e6 - t0) / 1000.0})
    peak = max(alloc_series) if alloc_series else allocated
    return {"time": times, "allocated": alloc_series, "reserved": reserved_series, "markers": found,
            "time_unit": "ms" if has_time else "event", "peak_allocated": peak, "device": device}


def phases(markers: list[dict], end: float) -> list[tuple[str, float, float]]:
    """(name, start, end) spans between consecutive markers; the `end` marker closes the last span."""
    spans = []
    ordered = sorted(markers, key=lambda m: m["time"])
    for i, marker in enumerate(ordered):
        if marker["name"] == "end":
            continue
        stop = ordered[i + 1]["time"] if i + 1 < len(ordered) else end
        spans.append((marker["name"], marker["time"], stop))
    return spans


def plot_memory_timeline(snapshot: dict, png: str, markers: Optional[list] = None, title: Optional[str] = None,
                         device: Optional[int] = None) -> dict:
    """Draw `memory_timeline`; returns it (with the phase spans) so callers can print the numbers."""
    line = memory_timeline(snapshot, device, markers)
    line["phases"] = phases(line["markers"], line["time"][-1] if line["time"] else 0.0)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(11, 5), dpi=120)
    ax.plot(line["time"], [v / GIB for v in line["reserved"]], color="lightgray", linewidth=1, label="reserved")
    ax.plot(line["time"], [v / GIB for v in line["allocated"]], color="black", linewidth=1.2, label="allocated")
    seen = set()
    for name, start, stop in line["phases"]:
        color = PHASE_COLORS.get(name, "#CCB974")
        ax.axvspan(start, stop, color=color, alpha=0.18, linewidth=0, label=None if name in seen else name)
        seen.add(name)
    if line["allocated"]:
        i = max(range(len(line["allocated"])), key=line["allocated"].__getitem__)
        ax.annotate(f"peak {line['peak_allocated'] / GIB:.2f} GiB", (line["time"][i], line["peak_allocated"] / GIB),
                    textcoords="offset points", xytext=(5, 5), fontsize=8)
    ax.set_xlabel("time (ms)" if line["time_unit"] == "ms" else "allocator event")
    ax.set_ylabel("GPU memory (GiB)")
    ax.set_title(title or "GPU memory through one training step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)
    return line


# ---------------------------------------------------------------- command line


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    loss = sub.add_parser("loss", help="loss-by-position PNG/CSV/JSON from eval_positions JSON files")
    loss.add_argument("out_dir")
    loss.add_argument("runs", nargs="+", metavar="NAME=FILE.json")
    loss.add_argument("--title")
    memory = sub.add_parser("memory", help="memory-over-time PNG from a memory snapshot pickle")
    memory.add_argument("snapshot")
    memory.add_argument("png")
    memory.add_argument("--markers", help="markers JSON written next to the snapshot")
    args = ap.parse_args(argv)
    if args.what == "loss":
        runs = []
        for item in args.runs:
            name, _, path = item.rpartition("=")
            runs.extend(read_run(path, name or None))
        print(write_loss_by_position(runs, args.out_dir, title=args.title))
    else:
        with open(args.snapshot, "rb") as fh:
            snapshot = pickle.load(fh)
        markers = None
        if args.markers:
            with open(args.markers) as fh:
                markers = json.load(fh)
        line = plot_memory_timeline(snapshot, args.png, markers)
        print(f"{args.png}: peak allocated {line['peak_allocated'] / GIB:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
