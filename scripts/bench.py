"""Benchmark warm training steps through the trainer's own code (build_engine + train_step) per lever set.

    python scripts/bench.py --model qwen3-4b --lengths 65536,131072 --levers plain,chunked,all --json out.json
    torchrun --nproc_per_node 2 scripts/bench.py --model qwen3-4b --sp 2 --lengths 131072 ...   # several GPUs
    python scripts/bench.py --config configs/qwen3_4b_256k_1gpu.yaml --model qwen3-4b [--set KEY=VALUE ...]

`--config FILE` times exactly the step scripts/train.py would run with that run config: its levers (the ones
`auto` chooses included), its DeepSpeed JSON and its optimizer, on synthetic tokens of `data.seq_length` (or
--lengths), with random weights: `--model` builds the named shapes locally, otherwise the config's model
folder or hub name is read for its config only. Like train.py, the planner first refuses a run that will not
fit this machine's GPU or host memory (the row says why). `--set` overrides apply to every point, after the
lever set's.

Each (lever set, length) point runs in a fresh process group started by this script (a subprocess), so
one point's memory never leaks into the next and an out-of-memory point is recorded, not fatal.
Prints a table and writes JSON: peak GPU GiB, peak host GiB, s/step, tokens/s, model TFLOP/s per GPU
(ulysses_train/DESIGN.md, 'How throughput is counted': 6·N·T + causal attention, recompute not counted).

Lever sets (cumulative from `chunked`):
  plain     full-logits loss, plain checkpointing (HF's gradient checkpointing)
  chunked   + fused chunked loss
  offload   + activation offload to pinned host memory (DeepSpeed JSON cpu_checkpointing)
  tiled     + TiledMLP
  tiledonly chunked + TiledMLP, without activation offload
  keepattn  + attention outputs kept (never recomputed) for --keep-fraction of the layers
  all       chunked + offload + tiled + keepattn + the trainer's default RMSNorm (model.rmsnorm)
  allhfnorm all, with Hugging Face's RMSNorm (the A/B of the norm alone)
  alltorchnorm    all, with torch's fused RMSNorm (model.rmsnorm: torch)
  allchunkednorm  all, with rmsnorm.py's chunked RMSNorm (model.rmsnorm: chunked)
  alluntiled      all without TiledMLP (no extra MLP forward; the MLP's seq x intermediate tensors are made whole)
The sets before `all` use Hugging Face's RMSNorm, as when they were first measured. `all` follows the
trainer's default RMSNorm kernel, so compare kernels by name (`alltorchnorm`, `allchunkednorm`).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from bench_point import LEVERS
from ulysses_train.constants import LOSS_CHUNK_ROWS
from ulysses_train.errors import UserError
from ulysses_train.planner.options import OPTIMIZERS

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="qwen3-0.6b | qwen3-4b | qwen3-8b | qwen3-30b-a3b | gpt-oss-20b | gemma-3-12b (shapes built "
                         "locally; default qwen3-4b, or with --config the config's model)")
    ap.add_argument("--config", default="", help="a run config (YAML) to time as scripts/train.py would run it")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="a run-config override for every point, as for scripts/train.py (repeatable)")
    ap.add_argument("--layers", type=int, default=0, help="override the number of layers (0: the model's)")
    ap.add_argument("--lengths", default="", help="comma-separated sequence lengths (default 65536, or with "
                                                  "--config its data.seq_length)")
    ap.add_argument("--levers", default="plain,chunked,offload,tiled,keepattn,all")
    ap.add_argument("--keep-fraction", type=float, default=1.0, help="share of layers whose attention is kept")
    ap.add_argument("--offload-fraction", type=float, default=1.0,
                    help="share of layers whose checkpoints are offloaded, in lever sets with offload "
                         "(model.activation_offload_fraction)")
    ap.add_argument("--sp", type=int, default=1)
    ap.add_argument("--nproc", type=int, default=1, help="processes (GPUs) per point")
    ap.add_argument("--steps", type=int, default=2,
                    help="timed steps after one warm-up step; 0: one step only, timed cold (includes first-step setup)")
    ap.add_argument("--optimizer", default="gpu", choices=tuple(OPTIMIZERS),
                    help="AdamW states on the GPU, offloaded to the CPU, or no update (SGD at lr 0, whose fp32 "
                         "master ZeRO-3 keeps): the meanings of scripts/plan.py --optimizer, which the `auto` "
                         "levers plan with")
    ap.add_argument("--chunk-rows", type=int, default=LOSS_CHUNK_ROWS)
    ap.add_argument("--attn", default="sdpa",
                    help="model.attn_implementation, comma-separated for an A/B: sdpa (cuDNN first) | fa4 "
                         "(FlashAttention 4, package flash-attn-4)")
    ap.add_argument("--shape-overrides", default="{}",
                    help='JSON of config fields set on the shape, e.g. \'{"hidden_size": 64}\' (CPU smoke runs)')
    ap.add_argument("--deepspeed-overrides", default="{}", metavar="JSON",
                    help="top-level DeepSpeed JSON keys for every point, e.g. "
                         "'{\"seq_parallel_communication_data_type\": \"bf16\"}'")
    ap.add_argument("--comm-share", action="store_true",
                    help="one more step with DeepSpeed's comms logger timing the Ulysses all-to-alls: their seconds "
                         "and their share of the (unprofiled) step time")
    ap.add_argument("--emulate-sp", type=int, default=0, metavar="N",
                    help="one process stands in for rank 0 of an sp=N step on N GPUs (parallel/emulate.py): prints "
                         "its step time and memory and the predicted N-GPU step (planner/communication.py)")
    ap.add_argument("--emulate-gpus-per-node", type=int, default=0, metavar="G",
                    help="with --emulate-sp N: the N GPUs are in nodes of G (default: one node of N), so the "
                         "predicted step costs the all-to-all's share to other nodes at the network's rate")
    ap.add_argument("--time-breakdown", action="store_true",
                    help="one more step under torch.profiler: device time by kind of work (attention, matmul, "
                         "communication, the gated delta rule, conv, norms, host and device copies, the rest) and the 40 costliest kernels, in the JSON row")
    ap.add_argument("--time-breakdown-ops", action="store_true",
                    help="--time-breakdown with each kernel's time also charged to the aten op and the Python lines "
                         "that launched it (device_time_by_op, device_time_by_stack in the JSON row); records every "
                         "op, so the profiled step is much slower: use it at reduced depth (--layers)")
    ap.add_argument("--memory-profile", default="", metavar="DIR",
                    help="one more step with the GPU allocator's history recorded: snapshot, PNG and the blocks alive "
                         "at the peak written under DIR (diagnostics/memory_peak.py); the peak's largest sites in "
                         "the JSON row")
    ap.add_argument("--documents", default="0",
                    help="comma-separated document counts: 0 one causal sequence; N>0 N equal documents packed into "
                         "it (data.packing: documents, variable-length attention; needs --attn fa4)")
    ap.add_argument("--json", default="", help="write all points here")
    ap.add_argument("--timeout", type=int, default=560, help="seconds per point")
    return ap.parse_args(argv)


def launch_point(point: dict, nproc: int, timeout: int) -> dict:
    """Run one point in fresh processes; an OOM or a timeout becomes a row, not a crash."""
    from ulysses_train.parallel.ports import free_port

    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as out:
        path = out.name
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_point.py"),
           json.dumps({**point, "out": path})]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               *cmd[1:]]
    env = dict(os.environ)
    if nproc == 1 and "MASTER_PORT" not in env:  # a second bench on the machine would hold the default port
        env["MASTER_PORT"] = str(free_port())
    started = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        return timed_out_row(point, path, timeout, exc.stderr)
    wall = {"wall_s": round(time.time() - started, 1)}
    if proc.returncode != 0:
        return {**failed_row(point, path, proc.stderr or proc.stdout), **wall}
    if os.path.getsize(path) == 0:
        return {**point, "status": f"failed: no row written: {(proc.stderr or proc.stdout).strip()[-300:]}", **wall}
    with open(path) as fh:
        return {**json.load(fh), **wall}


def failed_row(point: dict, path: str, tail: str) -> dict:
    """A point whose process failed: its timed steps if they finished (what failed came after them: the row's
    extra steps or its planner record), else OOM or the error's last lines."""
    if os.path.exists(path) and os.path.getsize(path) > 0:
        with open(path) as fh:
            return {**json.load(fh), "extra_steps": f"failed: {tail.strip()[-300:]}"}
    if "OutOfMemoryError" in tail or "out of memory" in tail:
        return {**point, "status": "OOM", "oom": out_of_memory_where(tail)}
    return {**point, "status": f"failed: {tail.strip()[-300:]}"}


def out_of_memory_where(stderr: str) -> dict:
    """Where an out-of-memory point stopped: the last phases it reached (engine built, steps) and what it asked
    for (torch's "Tried to allocate ..."), so a row tells a build from a step (a Kimi K2 rank's once did not)."""
    asked = re.search(r"Tried to allocate [0-9.]+ [KMGT]iB", stderr)
    phases = reached_phases(stderr)
    return {"reached": "; ".join(phases[-2:]) if phases else "engine not built",
            "request": asked.group(0) if asked else ""}


def reached_phases(stderr) -> list:
    """The progress lines ("[bench] ...") a point's process printed, in order."""
    if isinstance(stderr, bytes):
        stderr = stderr.decode(errors="replace")
    return [line[len("[bench] "):] for line in (stderr or "").splitlines() if line.startswith("[bench] ")]


def timed_out_row(point: dict, path: str, timeout: int, stderr) -> dict:
    """A point that ran out of time: its timed steps if they finished (only an extra step timed out), else
    a timeout status with the last phases it reached."""
    phases = reached_phases(stderr)
    if os.path.exists(path) and os.path.getsize(path) > 0:
        with open(path) as fh:
            row = json.load(fh)
        return {**row, "extra_steps": f"timeout after {timeout} s (after: {'; '.join(phases[-2:])})"}
    reached = f" (reached: {'; '.join(phases[-3:])})" if phases else " (engine not built)"
    return {**point, "status": f"timeout after {timeout} s{reached}"}


def print_table(rows: list[dict]) -> None:
    head = f"{'levers':9} {'attn':5} {'length':>8} {'docs':>5} {'sp':>3} {'s/step':>8} {'tok/s':>9} {'TFLOP/s':>8} {'GPU GiB':>8} {'host GiB':>8}  status"
    print(head)
    print("-" * len(head))
    for r in rows:
        if r.get("status") == "ok":
            share = f"  all-to-all {100 * r['all_to_all_share']:.1f}%" if r.get("all_to_all_share") is not None else ""
            print(f"{r['levers']:9} {r.get('attn', 'sdpa'):5} {r['length']:>8} {r.get('documents') or 1:>5} {r['sp']:>3} {r['s_per_step']:>8.2f} {r['tokens_per_s']:>9.0f} "
                  f"{r['tflops_per_gpu']:>8.1f} {r['peak_gpu_gib']:>8.2f} {r['peak_host_gib']:>8.2f}  ok{share}")
            if r.get("emulated"):
                e = r["emulated"]
                fast, slow = e["predicted_step_s"]
                print(f"    emulated rank of sp={e['world']}: predicted {e['world']}-GPU step {fast:.2f}-{slow:.2f} s "
                      f"(+ Ulysses all-to-all {e['ulysses_all_to_all_s']:.2f} s, + ZeRO-3 collectives up to "
                      f"{e['zero3_collectives_s']:.2f} s); host {e['host_gib_per_node']:.0f} GiB per node of "
                      f"{e['world']} ranks")
            if r.get("extra_steps"):
                print(f"    extra steps: {r['extra_steps']}")
            if r.get("time_by_kind_s"):
                total = sum(r["time_by_kind_s"].values()) or 1.0
                print("    profiled step by kind: " + ", ".join(
                    f"{kind} {100 * t / total:.0f}%" for kind, t in sorted(r["time_by_kind_s"].items(), key=lambda kv: -kv[1])))
        else:
            print(f"{r['levers']:9} {r.get('attn', 'sdpa'):5} {r['length']:>8} {r.get('documents') or 1:>5} {r['sp']:>3} {'':>8} {'':>9} {'':>8} {'':>8} {'':>8}  {r['status']}")


def main(argv=None) -> int:
    from ulysses_train.cli import report_user_errors

    args = parse_args(argv)
    return report_user_errors(lambda: bench(args))


def check_emulated_points(args, attns: list[str]) -> None:
    """--emulate-sp: one process, sdpa or fa4 (parallel/emulate.check_emulation); a --config point gets the
    emulated sp as its parallel.sequence_parallel_size."""
    from ulysses_train.model.loading import resolve_attn_implementation
    from ulysses_train.parallel.emulate import check_emulation

    if args.config:
        from ulysses_train.config import load_config

        attns = [load_config(args.config, args.sets).model.attn_implementation]
        args.sets = [*args.sets, f"parallel.sequence_parallel_size={args.emulate_sp}"]
    for attn in attns:
        check_emulation(args.emulate_sp, resolve_attn_implementation(attn), args.nproc)
    per_node = args.emulate_gpus_per_node
    if per_node and (per_node < 1 or args.emulate_sp % per_node):
        raise UserError(f"--emulate-gpus-per-node {per_node}: it must divide --emulate-sp {args.emulate_sp} (an sp "
                        f"group spans whole nodes).")


CPU_LONGEST = 16_384
"""The longest point bench.py runs without a GPU: it measures GPU steps; on a CPU a 1M-token step computes for
tens of minutes and measures nothing useful (the CPU tests run a few hundred tokens)."""


def parse_json_object(option: str, text: str, example: str) -> dict:
    """--shape-overrides or --deepspeed-overrides as a dict; a UserError naming the form otherwise."""
    try:
        fields = json.loads(text)
    except ValueError:
        fields = None
    if not isinstance(fields, dict):
        raise UserError(f"{option} {text!r}: give a JSON object, e.g. '{example}'.")
    return fields


def parse_lengths(text: str) -> list:
    try:
        lengths = [int(n) for n in text.split(",")]
    except ValueError:
        raise UserError(f"--lengths {text!r}: give whole numbers of tokens, comma-separated (e.g. 65536,131072).") from None
    if min(lengths) < 1:
        raise UserError(f"--lengths {text!r}: every length must be at least 1 token.")
    return lengths


def check_cpu_lengths(lengths: list) -> None:
    import torch

    longest = max(lengths)
    if not torch.cuda.is_available() and longest > CPU_LONGEST:
        raise UserError(f"--lengths {longest:,} on a machine without a GPU: bench.py times GPU steps, and on this CPU "
                        f"one step would compute for many minutes. Fix: run it on a GPU machine (docs/planner.md), "
                        f"or --lengths up to {CPU_LONGEST:,} to try it here.")


def bench(args) -> int:
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    rows = []
    attns = args.attn.split(",")
    if set(attns) - {"sdpa", "fa4"}:
        raise UserError(f"--attn takes sdpa and/or fa4, not {args.attn!r}.")
    lengths, lever_sets = args.lengths, args.levers.split(",")
    if args.config:
        from ulysses_train.config import load_config

        given = load_config(args.config, args.sets)  # a bad file or key is one line here, not a failed point
        lengths, lever_sets = lengths or str(given.data.seq_length), ["config"]
    elif args.model is None:
        args.model = "qwen3-4b"
    check_cpu_lengths(parse_lengths(lengths or "65536"))
    if args.emulate_sp:
        check_emulated_points(args, attns)
    unknown = sorted(set(lever_sets) - set(LEVERS) - {"config"})
    if unknown:
        raise UserError(f"--levers: unknown lever set {unknown[0]!r}; choose from {', '.join(LEVERS)}.")
    shape_overrides = parse_json_object("--shape-overrides", args.shape_overrides,
                                        '{"hidden_size": 64, "num_attention_heads": 4}')
    deepspeed_overrides = parse_json_object("--deepspeed-overrides", args.deepspeed_overrides,
                                            '{"seq_parallel_communication_data_type": "bf16"}')
    for length, levers, attn, documents in [(n, lv, a, int(d)) for n in parse_lengths(lengths or "65536")
                                            for lv in lever_sets for a in attns
                                            for d in args.documents.split(",")]:
        point = {"model": args.model, "layers": args.layers, "length": length, "levers": levers,
                 "sp": args.emulate_sp or args.sp, "emulate_sp": args.emulate_sp,
                 "emulate_gpus_per_node": args.emulate_gpus_per_node or args.emulate_sp,
                 "documents": documents, "config": args.config, "sets": args.sets,
                 "attn": attn, "steps": args.steps, "optimizer": args.optimizer, "keep_fraction": args.keep_fraction,
                 "offload_fraction": args.offload_fraction,
                 "chunk_rows": args.chunk_rows, "shape_overrides": shape_overrides,
                 "deepspeed_overrides": deepspeed_overrides,
                 "comm_share": args.comm_share, "time_breakdown": args.time_breakdown,
                 "time_breakdown_ops": args.time_breakdown_ops, "memory_profile": args.memory_profile}
        rows.append(launch_point(point, args.nproc, args.timeout))
        print(json.dumps(rows[-1]), flush=True)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    from ulysses_train.cli import run_script

    run_script(main)
