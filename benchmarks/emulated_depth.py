"""Full-depth predictions from emulated ranks measured at reduced depths (scripts/bench.py --emulate-sp N
--layers L): a 1M-token step at full depth does not fit one 10-minute command on one GPU, but a layer of one kind
does the same work wherever it sits, so time is linear in the number of layers of each kind.

    python benchmarks/emulated_depth.py benchmarks/results/emulate/emulated_8b_1m_sp8_{1,2}l.json --json out.json
    python benchmarks/emulated_depth.py nano_1m_sp8_{4,7,14}l.json     # a hybrid: three kinds, three depths

- Step time, Ulysses all-to-all and ZeRO-3 collective seconds: a fixed part plus seconds per layer of each kind
  (the planner's layer kinds: attention (by window), a token mixer, or none), fitted to the rows (bench.py
  --layers L keeps the model's first L layers) and read at the model's own layers. A uniform model needs two
  depths (the line through them); a hybrid needs depths whose kind counts reach the model's: Nemotron 3 Nano's
  4, 7 and 14 (its Mamba2 and expert layers alternate, as many of each in all 52 as at depths 4, 7 and 14, and
  attention comes in 6 of 52, a share no two of its prefixes span), Qwen3.5's 4 and 8 (whole blocks).
  Depths that cannot tell the kinds apart where the model needs them told apart are refused with the reason; a
  line through two prefixes of a hybrid would count its attention layers wrong.
- GPU and host memory: not linear at small depth (the last layer's checkpoint is never offloaded and two
  offloaded checkpoints are resident at a time), so the deepest measurement plus what the planner says the
  remaining layers add (planner.estimate.plan_for_record at both depths).
Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
from collections import Counter

from ulysses_train.constants import GIB
from ulysses_train.planner.options import kernel_fields

SPAN_TOLERANCE = 1e-6
"""Largest residual of the model's kind counts projected on the rows' (relative): beyond it the rows cannot say
what the model's layers cost."""


def kind_counts(model: str, layers: int | None = None) -> Counter:
    """How many layers of each kind the model has (None) or bench.py --layers builds at `layers`: the planner's kind,
    attention keyed by its window. A reduced model is the one built (planner.shapes.reduced_depth_shape), not a
    prefix of the full one: transformers makes a Gemma 4's last layer global whatever its pattern says."""
    from ulysses_train.planner.shapes import load_model_shape, reduced_depth_shape

    shape = load_model_shape(model) if layers is None else reduced_depth_shape(model, layers)
    windows = shape.windows or (None,) * shape.layers
    return Counter(f"{kind} window {window}" if window else kind or "no mixer"
                   for kind, window in zip(shape.layer_kinds, windows))


def fit_at_depth(depths: list, values: list, model: str) -> float:
    """`values` measured at `depths` (first layers of `model`) read at the model's full depth: least squares of
    value = fixed + sum over kinds of count x seconds per layer, evaluated at the full model's counts. Refused
    (SystemExit) when the full model's counts are not a combination of the rows' (the fit would extrapolate a
    kind the rows cannot separate)."""
    import numpy as np

    full = kind_counts(model)
    kinds = sorted(full)
    rows = np.array([[1.0, *(kind_counts(model, d)[k] for k in kinds)] for d in depths])
    target = np.array([1.0, *(full[k] for k in kinds)])
    weights = np.linalg.lstsq(rows.T, target, rcond=None)[0]  # target as a combination of the rows
    if np.linalg.norm(rows.T @ weights - target) > SPAN_TOLERANCE * np.linalg.norm(target):
        counts = "; ".join(f"{d} layers: {dict(kind_counts(model, d))}" for d in depths)
        raise SystemExit(f"emulated_depth: depths {depths} cannot predict {model}'s {dict(full)}: their layer kinds "
                         f"({counts}) do not reach it. Fix: add a depth whose kind counts differ in another "
                         f"proportion (for alternating kinds, depths where they appear equally often).")
    return float(weights @ np.array(values, dtype=float))


def planner_record(row: dict, layers: int) -> dict:
    """The planner's view of an emulated bench row at `layers` (benchmarks/planner_validation.jsonl's keys)."""
    levers = row["run_levers"]
    per_node = row_gpus_per_node(row)
    return {"model": row["model"], "num_hidden_layers": layers, "seq_length": row["length"], "sp": row["sp"],
            "gpus_per_node": per_node, "nodes": row["sp"] // per_node, "allow_sp_across_nodes": per_node < row["sp"],
            "offload_activations": levers["cpu_checkpointing"],
            "activation_offload_fraction": levers["activation_offload_fraction"],
            "offload_optimizer": row["optimizer"] == "cpu", **optimizer_fields(row),
            "tiled_mlp": bool(levers["tiled_mlp"]), "keep_attention_fraction": levers["keep_attention_fraction"],
            "attention_head_chunks": int(levers.get("attention_head_chunks", 1)),  # older rows: one chunk
            "chunked_loss": levers["loss"] == "chunked", "attention_kernel": row.get("attn", "sdpa"),
            **adapter_fields(row, layers),
            **kernel_fields(row.get("plan_kernels", {}))}  # the kernels that ran (older rows: none, or one flag each)


def adapter_fields(row: dict, layers: int) -> dict:
    """A LoRA row's adapters at `layers` (lora.lora_plan_fields of the preset cut to that depth, as plan.py
    --lora-rank counts them): what the planner trains instead of the whole model. Full fine-tunes: none."""
    settings = row["run_levers"].get("lora_settings")
    if not settings:
        return {}
    from ulysses_train.model.lora import lora_plan_fields
    from ulysses_train.model.presets import preset_config

    return lora_plan_fields(preset_config(row["model"], num_hidden_layers=layers), settings)


def row_gpus_per_node(row: dict) -> int:
    """The GPUs per node an emulated row's collectives were costed for (older rows: one node of sp)."""
    return (row.get("emulated") or {}).get("gpus_per_node") or row["sp"]


def optimizer_fields(row: dict) -> dict:
    """The planner's optimizer of a bench row: AdamW (the planner's default), or for `--optimizer none` SGD at lr 0
    under ZeRO-3, which keeps the fp32 master weights and nothing else (4 bytes per parameter)."""
    if row["optimizer"] != "none":
        return {}
    return {"optimizer_state_bytes": 4}


def full_depth(rows: list, plan_gib=None) -> dict:
    """The prediction at the model's own depth from emulated rows of one point at several depths.
    `plan_gib(record)` -> (GPU allocated, host per process) GiB; the planner by default."""
    from ulysses_train.planner.shapes import load_model_shape

    if plan_gib is None:
        from ulysses_train.planner.estimate import plan_for_record

        def plan_gib(record):
            planned = plan_for_record(record)
            return planned.gpu_allocated / GIB, planned.host_per_gpu / GIB
    rows = sorted(rows, key=lambda r: r["layers"])
    deep, depths = rows[-1], [r["layers"] for r in rows]
    if len(set(depths)) < 2 or len(set(depths)) < len(depths) or any(
            (r["model"], r["length"], r["sp"]) != (deep["model"], deep["length"], deep["sp"]) for r in rows):
        raise SystemExit("emulated_depth: give rows of one point (same model, length and sp) at different depths.")
    depth = load_model_shape(deep["model"]).layers
    at_depth = {key: fit_at_depth(depths, [pick(r) for r in rows], deep["model"]) for key, pick in (
        ("compute_s", lambda r: r["s_per_step"]), ("ulysses_s", lambda r: r["emulated"]["ulysses_all_to_all_s"]),
        ("zero3_s", lambda r: r["emulated"]["zero3_collectives_s"]))}
    gpu_deep, host_deep = plan_gib(planner_record(deep, depths[-1]))
    gpu_full, host_full = plan_gib(planner_record(deep, depth))
    fast = at_depth["compute_s"] + at_depth["ulysses_s"]
    per_node = row_gpus_per_node(deep)
    return {"model": deep["model"], "length": deep["length"], "sp": deep["sp"], "gpus_per_node": per_node,
            "layers": depth,
            "measured_layers": depths, **{k: round(v, 2) for k, v in at_depth.items()},
            "predicted_step_s": [round(fast, 1), round(fast + at_depth["zero3_s"], 1)],
            "gpu_gib": round(deep["peak_gpu_gib"] + gpu_full - gpu_deep, 2),
            "host_gib_per_process": round(deep["peak_host_gib"] + host_full - host_deep, 1),
            "host_gib_per_node": round(per_node * (deep["peak_host_gib"] + host_full - host_deep), 1)}


def bench_rows(path: str) -> list:
    """The rows of a scripts/bench.py JSON file (a list of rows, or one row)."""
    with open(path) as fh:
        loaded = json.load(fh)
    return loaded if isinstance(loaded, list) else [loaded]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rows", nargs="+", help="the bench JSON of each depth (one row each; two or more)")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    result = full_depth([bench_rows(path)[0] for path in args.rows])
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
