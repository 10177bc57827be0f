"""Full-depth predictions from emulated ranks measured at two reduced depths (scripts/bench.py --emulate-sp N
--layers L1 / L2): a 1M-token step at full depth does not fit one 10-minute command on one GPU, but every decoder
layer does the same work, so time is linear in depth.

    python benchmarks/emulated_depth.py benchmarks/results/emulate/emulated_8b_1m_sp8_{1,2}l.json --json out.json

- Step time, Ulysses all-to-all and ZeRO-3 collective seconds: the straight line through the two depths,
  read at the model's depth (two points fix a line; they cannot show it is one: the per-layer work is the same
  by construction, and the planner's time model is linear in depth too).
- GPU and host memory: not linear at small depth (the last layer's checkpoint is never offloaded and two
  offloaded checkpoints are resident at a time), so the deeper measurement plus what the planner says the
  remaining layers add (planner.estimate.plan_for_record at both depths).
Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json

from ulysses_train.constants import GIB


def line_at(x: float, x1: float, y1: float, x2: float, y2: float) -> float:
    """The straight line through (x1, y1) and (x2, y2), at x."""
    return y1 + (y2 - y1) * (x - x1) / (x2 - x1)


def planner_record(row: dict, layers: int) -> dict:
    """The planner's view of an emulated bench row at `layers` (benchmarks/planner_validation.jsonl's keys)."""
    levers = row["run_levers"]
    return {"model": row["model"], "num_hidden_layers": layers, "seq_length": row["length"], "sp": row["sp"],
            "gpus_per_node": row["sp"], "offload_activations": levers["cpu_checkpointing"],
            "activation_offload_fraction": levers["activation_offload_fraction"],
            "offload_optimizer": row["optimizer"] == "cpu", **optimizer_fields(row),
            "tiled_mlp": bool(levers["tiled_mlp"]), "keep_attention_fraction": levers["keep_attention_fraction"],
            "chunked_loss": levers["loss"] == "chunked", "attention_kernel": row.get("attn", "sdpa"),
            **row.get("plan_kernels", {})}  # the kernels that ran (rows from before they were recorded: none)


def optimizer_fields(row: dict) -> dict:
    """The planner's optimizer of a bench row: AdamW (the planner's default), or for `--optimizer none` SGD at lr 0
    under ZeRO-3, which keeps the fp32 master weights and nothing else (4 bytes per parameter)."""
    if row["optimizer"] != "none":
        return {}
    return {"optimizer_state_bytes": 4}


def full_depth(shallow: dict, deep: dict, plan_gib=None) -> dict:
    """The prediction at the model's own depth from two emulated rows. `plan_gib(record)` -> (GPU allocated,
    host per process) GiB; the planner by default."""
    from ulysses_train.planner.shapes import load_model_shape

    if plan_gib is None:
        from ulysses_train.planner.estimate import plan_for_record

        def plan_gib(record):
            planned = plan_for_record(record)
            return planned.gpu_allocated / GIB, planned.host_per_gpu / GIB
    l1, l2 = shallow["layers"], deep["layers"]
    if l1 == l2 or shallow["length"] != deep["length"] or shallow["sp"] != deep["sp"]:
        raise SystemExit("emulated_depth: give two rows of one point (same length and sp) at two depths.")
    depth = load_model_shape(deep["model"]).layers
    e1, e2 = shallow["emulated"], deep["emulated"]
    at_depth = {key: line_at(depth, l1, a, l2, b) for key, a, b in (
        ("compute_s", shallow["s_per_step"], deep["s_per_step"]),
        ("ulysses_s", e1["ulysses_all_to_all_s"], e2["ulysses_all_to_all_s"]),
        ("zero3_s", e1["zero3_collectives_s"], e2["zero3_collectives_s"]))}
    gpu_deep, host_deep = plan_gib(planner_record(deep, l2))
    gpu_full, host_full = plan_gib(planner_record(deep, depth))
    fast = at_depth["compute_s"] + at_depth["ulysses_s"]
    world = deep["sp"]
    return {"model": deep["model"], "length": deep["length"], "sp": world, "layers": depth,
            "measured_layers": [l1, l2], **{k: round(v, 2) for k, v in at_depth.items()},
            "predicted_step_s": [round(fast, 1), round(fast + at_depth["zero3_s"], 1)],
            "gpu_gib": round(deep["peak_gpu_gib"] + gpu_full - gpu_deep, 2),
            "host_gib_per_process": round(deep["peak_host_gib"] + host_full - host_deep, 1),
            "host_gib_per_node": round(world * (deep["peak_host_gib"] + host_full - host_deep), 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rows", nargs=2, help="the bench JSON of the two depths (one row each)")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    rows = []
    for path in args.rows:
        with open(path) as fh:
            loaded = json.load(fh)
        rows.append(loaded[0] if isinstance(loaded, list) else loaded)
    shallow, deep = sorted(rows, key=lambda r: r["layers"])
    result = full_depth(shallow, deep)
    print(f"{'model':10} {'tokens':>9} {'sp':>3} {'layers':>6} {'s/step (fast-slow)':>19} {'GPU GiB':>8} "
          f"{'host GiB/node':>13}")
    fast, slow = result["predicted_step_s"]
    print(f"{result['model']:10} {result['length']:>9} {result['sp']:>3} {result['layers']:>6} "
          f"{f'{fast:.1f}-{slow:.1f}':>19} {result['gpu_gib']:>8.2f} {result['host_gib_per_node']:>13.1f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
