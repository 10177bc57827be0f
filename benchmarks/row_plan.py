"""Each bench row's measured peaks and step time against the planner's plan of the same point: the check behind
"peak within 10% of the plan" for any scripts/bench.py row, emulated or not, at any depth.

    python benchmarks/row_plan.py nano_7l_128k.json [more rows.json ...] [--json out.json]

The plan is planner.estimate.plan_for_record of the row (benchmarks/emulated_depth.py's planner_record: the row's
model at the depth it ran, its levers, optimizer and the kernels it recorded). GPU compares torch's allocated
peak with the plan's `gpu_allocated` (both what torch's allocator saw); host compares the process's peak with
the plan's host bytes per process. Prints a table and writes JSON; exit status 1 when a row is off by more than
10% on the GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from emulated_depth import bench_rows, planner_record  # noqa: E402

from ulysses_train.constants import GIB  # noqa: E402

TOLERANCE = 0.10
"""The planner's promise: each measured GPU peak within 10% of the plan (tests/test_planner.py replays them)."""


def compare(row: dict) -> dict:
    """The row's measurements beside the plan of its point."""
    from ulysses_train.planner.estimate import plan_for_record
    from ulysses_train.planner.shapes import load_model_shape

    layers = row.get("layers") or load_model_shape(row["model"]).layers
    planned = plan_for_record(planner_record(row, layers))
    gpu, host = planned.gpu_allocated / GIB, planned.host_per_gpu / GIB
    return {"model": row["model"], "layers": layers, "length": row["length"], "sp": row["sp"],
            "measured_gpu_gib": row["peak_gpu_gib"], "planned_gpu_gib": round(gpu, 2),
            "gpu_ratio": round(row["peak_gpu_gib"] / gpu, 3), "measured_host_gib": row["peak_host_gib"],
            "planned_host_gib": round(host, 2), "s_per_step": row["s_per_step"],
            "tflops_per_gpu": row["tflops_per_gpu"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rows", nargs="+", help="bench JSON files (every ok row in each)")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    results = [compare(r) for path in args.rows for r in bench_rows(path) if r.get("status") == "ok"]
    print(f"{'model':24} {'layers':>6} {'tokens':>9} {'sp':>3} {'GPU GiB':>8} {'planned':>8} {'ratio':>6} "
          f"{'host GiB':>8} {'planned':>8} {'s/step':>7} {'TFLOP/s':>8}")
    for r in results:
        print(f"{r['model']:24} {r['layers']:>6} {r['length']:>9} {r['sp']:>3} {r['measured_gpu_gib']:>8.2f} "
              f"{r['planned_gpu_gib']:>8.2f} {r['gpu_ratio']:>6.3f} {r['measured_host_gib']:>8.2f} "
              f"{r['planned_host_gib']:>8.2f} {r['s_per_step']:>7.2f} {r['tflops_per_gpu']:>8.1f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0 if all(abs(r["gpu_ratio"] - 1) <= TOLERANCE for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
