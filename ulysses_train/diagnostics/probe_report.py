"""The retrieval heatmaps and their numbers: what scripts/eval_context.py writes.

One PNG per task (depth down, length across, accuracy in each cell, the trained length marked by a dashed line
and named in the title), one CSV row per (task, length, depth) cell, and one JSON with the run's facts, the cells
and every probe, so a heatmap can be re-drawn or compared without re-running the model:
    python -m ulysses_train.diagnostics.probe_report OUT_DIR/retrieval.json
How to read it: a column that stays green to the bottom means the model finds a fact anywhere in that context;
red cells at one depth band (often the middle) are the "lost in the middle" pattern; columns right of the dashed
line are past the length the model was trained on, where RoPE scaling (YaRN) is doing the work.
"""
from __future__ import annotations

import csv
import json
import os
import sys
from typing import Optional

from ulysses_train.diagnostics.plots import _pyplot, _tokens

CSV_FIELDS = ("task", "length", "depth", "count", "accuracy", "mean_logprob", "mean_token_logprob")


def plot_heatmap(table: list, task: str, png: str, trained_length: Optional[int] = None,
                 title: Optional[str] = None) -> str:
    """Accuracy of `task`'s cells as a depth x length grid; empty cells (not evaluated) stay blank."""
    import numpy as np

    plt = _pyplot()
    rows = [c for c in table if c["task"] == task]
    lengths, depths = sorted({c["length"] for c in rows}), sorted({c["depth"] for c in rows})
    grid = np.full((len(depths), len(lengths)), np.nan)
    for c in rows:
        grid[depths.index(c["depth"]), lengths.index(c["length"])] = c["accuracy"]
    fig, ax = plt.subplots(figsize=(max(4.8, 1.2 + 0.9 * len(lengths)), 1.6 + 0.45 * len(depths)), dpi=120)
    image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    for (i, j), value in np.ndenumerate(grid):
        if not np.isnan(value):
            ax.text(j, i, f"{100 * value:.0f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(lengths)), [_tokens(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d}%" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    heading = title or f"{task}: exact-match accuracy (%)"
    if trained_length:
        within = sum(1 for n in lengths if n <= trained_length)
        if 0 < within < len(lengths):
            ax.axvline(within - 0.5, color="black", linestyle="--", linewidth=1.5)
        heading += f"\ntrained length {_tokens(trained_length)}" + (" (dashed)" if 0 < within < len(lengths) else "")
    ax.set_title(heading, fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.05)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)
    return png


def write_probe_report(record: dict, out_dir: str) -> dict:
    """retrieval.json (the record as given), retrieval.csv (the cells) and retrieval_<task>.png; their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, "retrieval.json"), "csv": os.path.join(out_dir, "retrieval.csv")}
    with open(paths["json"], "w") as fh:
        json.dump(record, fh, indent=1)
    with open(paths["csv"], "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows({k: c[k] for k in CSV_FIELDS} for c in record["cells"])
    for task in sorted({c["task"] for c in record["cells"]}):
        paths[task] = plot_heatmap(record["cells"], task, os.path.join(out_dir, f"retrieval_{task}.png"),
                                   record.get("trained_length"))
    return paths


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m ulysses_train.diagnostics.probe_report OUT_DIR/retrieval.json")
    with open(sys.argv[1]) as fh:
        print(write_probe_report(json.load(fh), os.path.dirname(os.path.abspath(sys.argv[1]))))
