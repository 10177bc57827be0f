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
import subprocess
import sys
import tempfile
import time

from ulysses_train.constants import LOSS_CHUNK_ROWS
from ulysses_train.errors import UserError
from ulysses_train.planner.options import OPTIMIZERS

# Each lever set: `--set` overrides of the run config (what scripts/train.py reads) and whether activation offload
# is on (activation_checkpointing.cpu_checkpointing, a key of the DeepSpeed JSON, not of the run config).
# "{keep}" is --keep-fraction.
_PLAIN = ["loss.type=chunked", "model.tiled_mlp=false", "model.keep_attention_fraction=0", "model.rmsnorm=hf"]
_ALL = ["loss.type=chunked", "model.tiled_mlp=true", "model.keep_attention_fraction={keep}"]
LEVERS = {
    "plain": (["loss.type=nll", *_PLAIN[1:]], False),
    "chunked": (_PLAIN, False),
    "offload": (_PLAIN, True),
    "tiled": ([*_PLAIN, "model.tiled_mlp=true"], True),
    "tiledonly": ([*_PLAIN, "model.tiled_mlp=true"], False),  # TiledMLP without activation offload
    "keepattn": ([*_PLAIN, "model.keep_attention_fraction={keep}"], False),
    "all": (_ALL, True),  # the trainer's default RMSNorm kernel
    "allhfnorm": ([*_ALL, "model.rmsnorm=hf"], True),
    "alltorchnorm": ([*_ALL, "model.rmsnorm=torch"], True),
    "allchunkednorm": ([*_ALL, "model.rmsnorm=chunked"], True),
    "alluntiled": ([*_ALL, "model.tiled_mlp=false"], True),
}


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
    ap.add_argument("--comm-share", action="store_true",
                    help="one more step with DeepSpeed's comms logger timing the Ulysses all-to-alls: their seconds "
                         "and their share of the (unprofiled) step time")
    ap.add_argument("--emulate-sp", type=int, default=0, metavar="N",
                    help="one process stands in for rank 0 of an sp=N step on N GPUs (parallel/emulate.py): prints "
                         "its step time and memory and the predicted N-GPU step (planner/communication.py)")
    ap.add_argument("--time-breakdown", action="store_true",
                    help="one more step under torch.profiler: device time by kind of work (attention, matmul, "
                         "communication, the gated delta rule, conv, norms, host and device copies, the rest) and the 40 costliest kernels, in the JSON row")
    ap.add_argument("--documents", default="0",
                    help="comma-separated document counts: 0 one causal sequence; N>0 N equal documents packed into "
                         "it (data.packing: documents, variable-length attention; needs --attn fa4)")
    ap.add_argument("--json", default="", help="write all points here")
    ap.add_argument("--timeout", type=int, default=560, help="seconds per point")
    ap.add_argument("--point", default="", help=argparse.SUPPRESS)  # internal: run one point in this process
    return ap.parse_args(argv)


def point_config(point: dict, model_dir: str, cuda: bool):
    """The run config of a point, through the same loader as scripts/train.py (later overrides win)."""
    from ulysses_train.config import load_config

    if point.get("config"):
        model = [f"model.name_or_path={model_dir}"] if model_dir else []
        return load_config(point["config"], [*model, "model.random_init=true", "data.source=bench",
                                             f"data.seq_length={point['length']}", *point.get("sets", [])])
    overrides, _ = LEVERS[point["levers"]]
    base = [f"model.name_or_path={model_dir}", "model.random_init=true", f"model.attn_implementation={point.get('attn', 'sdpa')}",
            f"model.dtype={'bfloat16' if cuda else 'float32'}",
            f"model.activation_offload_fraction={point.get('offload_fraction', 1.0)}",
            f"parallel.sequence_parallel_size={point['sp']}", f"loss.chunk_rows={point['chunk_rows']}",
            "data.source=bench", f"data.seq_length={point['length']}",
            f"data.packing={'documents' if point.get('documents') else 'glue'}"]
    return load_config(None, base + [o.format(keep=point["keep_fraction"]) for o in overrides]
                       + point.get("sets", []))


def point_deepspeed_config(point: dict):
    """ds_configs/zero3.json with this point's activation offload and optimizer placement; None for a --config
    point (build_engine then reads the config's own DeepSpeed JSON, as scripts/train.py does)."""
    from ulysses_train.training.ds_config import load_deepspeed_config

    if point.get("config"):
        return None
    ds = load_deepspeed_config("ds_configs/zero3.json")
    ds["activation_checkpointing"] = {"cpu_checkpointing": LEVERS[point["levers"]][1]}
    ds["optimizer"]["params"]["torch_adam"] = True
    if point["optimizer"] == "cpu":
        # torch's AdamW on the host (torch_adam stays on): no JIT build of DeepSpeed's cpu_adam op, which is
        # faster per step but needs a compiler toolchain on the GPU machine
        ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return without_update(ds) if point["optimizer"] == "none" else ds


def without_update(ds: dict) -> dict:
    """`--optimizer none`: torch.optim.SGD at lr 0 named in the DeepSpeed JSON (DeepSpeed takes torch's optimizers
    by name), so the planner reads what the run keeps, the fp32 master only
    (planner.options.deepspeed_optimizer_state_bytes)."""
    ds["optimizer"] = {"type": "SGD", "params": {"lr": 0.0}}
    ds["zero_allow_untested_optimizer"] = True
    return ds


def run_point(point: dict) -> dict:
    """One (lever set, length) point in this process: build the engine, warm up, time steps."""
    import torch

    from ulysses_train.model.presets import save_preset_config
    from ulysses_train.model.loading import resolve_attn_implementation
    from ulysses_train.model.flops import model_flops_per_sequence, non_embedding_params
    from ulysses_train.training.metrics import peak_host_gib
    from ulysses_train.training.step import build_engine, train_step

    began = time.perf_counter()
    folder = tempfile.mkdtemp(prefix="bench_")
    overrides = {"num_hidden_layers": point["layers"]} if point["layers"] else {}
    overrides.update(point.get("shape_overrides") or {})
    model_dir = (save_preset_config(point["model"], os.path.join(folder, "model"), **overrides)
                 if point["model"] else "")
    if point.get("emulate_sp"):
        from ulysses_train.parallel.emulate import start_emulated_rank

        start_emulated_rank(point["emulate_sp"])
    cfg = point_config(point, model_dir, torch.cuda.is_available())
    ds = point_deepspeed_config(point)
    if ds is None and point["optimizer"] == "none":  # a --config point: its own DeepSpeed JSON, without the update
        from ulysses_train.training.ds_config import load_deepspeed_config

        ds = without_update(load_deepspeed_config(cfg.train.deepspeed_config))
    run = build_engine(cfg, deepspeed_config=ds,
                       check_memory=bool(point.get("config")))
    progress(f"engine built in {time.perf_counter() - began:.0f} s")
    vocab = run.hf_config.vocab_size
    gen = torch.Generator().manual_seed(run.dims.dp_rank)
    ids = torch.randint(0, vocab, (1, point["length"]), generator=gen)
    sample = {"input_ids": ids, "labels": ids.clone()}
    documents = synthetic_documents(point, cfg.data.packing)
    if documents:
        sample["document_lengths"] = equal_documents(point["length"], documents)
    flops = model_flops_per_sequence(run.hf_config, non_embedding_params(run.module.causal_lm), point["length"],
                                     sample.get("document_lengths"))
    cuda = torch.cuda.is_available()
    times, peaks, losses = [], [], []
    for step in range(point["steps"] + 1):  # steps=0: the one step is timed cold
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
        started = time.perf_counter()
        result = train_step(run, [sample])
        if cuda:
            torch.cuda.synchronize()
        progress(f"step {step}: {time.perf_counter() - started:.2f} s")
        if step > 0 or point["steps"] == 0:
            times.append(time.perf_counter() - started)
            peaks.append(torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0)
            losses.append(result.loss)
    seconds = sorted(times)[len(times) // 2]
    world = run.dims.world_size
    row = {**point, "documents": documents, "status": "ok", "s_per_step": round(seconds, 3),
           "tokens_per_s": round(point["length"] * run.dims.dp / seconds, 1),
           "tflops_per_gpu": round(flops * run.dims.dp / seconds / world / 1e12, 1),
           "peak_gpu_gib": round(max(peaks), 2), "peak_host_gib": round(peak_host_gib(), 2),
           "loss": round(losses[-1], 4), "all_step_s": [round(t, 3) for t in times],
           "rmsnorm": cfg.model.rmsnorm, "attn": resolve_attn_implementation(cfg.model.attn_implementation), "sp": run.dims.sp,
           "run_levers": run_levers(run.cfg or cfg, run.ds_config),
           "auto_levers": run.levers.to_dict() if run.levers is not None else None,
           "plan_kernels": planned_kernels(run),
           "torch": torch.__version__, "gpu": torch.cuda.get_device_name() if cuda else "cpu"}
    # written now, so a timeout in the extra steps below keeps the timed steps (launch_point reads it back)
    write_row(point, row)
    if point.get("emulate_sp"):
        row.update(emulated_prediction(run, sample, seconds, row["peak_host_gib"]))
        write_row(point, row)
        progress("logged-collectives step done")
    if point.get("comm_share"):
        row.update(all_to_all_seconds(run, sample, seconds))
        progress("all-to-all step done")
    if point.get("time_breakdown"):
        row.update(time_breakdown(run, sample))
        progress("profiled step done")
    return row


def run_levers(cfg, ds: dict) -> dict:
    """The memory levers the point ran with, as the run config and DeepSpeed JSON name them."""
    return {"keep_attention_fraction": cfg.model.keep_attention_fraction, "tiled_mlp": cfg.model.tiled_mlp,
            "activation_offload_fraction": cfg.model.activation_offload_fraction,
            "cpu_checkpointing": bool((ds.get("activation_checkpointing") or {}).get("cpu_checkpointing")),
            "loss": cfg.loss.type, "lora": bool(cfg.model.lora)}


PLAN_KERNEL_FIELDS = ("flash_qla", "offset_norm_kernel", "swiglu_kernel", "low_memory_rmsnorm", "attention_kernel")
"""The PlanOptions fields that say which kernels ran: a row's planner record (benchmarks/emulated_depth.py,
planner_validation.jsonl) needs them, and the row's levers do not say them."""


def planned_kernels(run) -> dict:
    """The kernels the run's own preflight plan would assume here (planner.options_from_run)."""
    from ulysses_train.planner import options_from_run

    options = options_from_run(run.cfg, run.ds_config, run.dims.world_size, run.dims.gpus_per_node or 1,
                               model=run.hf_config)
    return {name: getattr(options, name) for name in PLAN_KERNEL_FIELDS}


SYNTHETIC_DOCUMENT_TOKENS = 8192
"""A --config point with `data.packing: documents` and no --documents packs documents of about this length."""


def synthetic_documents(point: dict, packing: str) -> int:
    """Documents packed into a point's sequence: --documents, or for a --config point with `data.packing:
    documents` one per SYNTHETIC_DOCUMENT_TOKENS; 0 for one causal sequence. The row records this count (its
    "docs" column showed the --documents flag's 0, printed as 1, for a packed config)."""
    return point.get("documents") or (
        max(1, point["length"] // SYNTHETIC_DOCUMENT_TOKENS) if packing == "documents" else 0)


def equal_documents(length: int, count: int):
    """`count` documents as equal as can be (the first ones one token longer), summing to `length`."""
    import torch

    base, extra = divmod(length, count)
    return torch.tensor([base + (i < extra) for i in range(count)])


def progress(message: str) -> None:
    """A line on stderr per phase of a point: on a timeout, launch_point reports the last ones."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"[bench] {message}", file=sys.stderr, flush=True)


def write_row(point: dict, row: dict) -> None:
    if int(os.environ.get("RANK", 0)) == 0:
        with open(point["out"], "w") as fh:
            json.dump(row, fh)


def all_to_all_seconds(run, sample: dict, step_seconds: float) -> dict:
    """Seconds of one more step spent in the Ulysses all-to-alls (diagnostics/collectives.py: the logged step
    is slower, each call's own time is still its own), and their share of the unprofiled step time."""
    from ulysses_train.diagnostics.collectives import logged_collectives, total_seconds
    from ulysses_train.training.step import train_step

    logged = logged_collectives(lambda: train_step(run, [sample]), ("all_to_all_single",))
    records = logged.get("all_to_all_single", {})
    calls = sum(entry[0] for entry in records.values())
    seconds = total_seconds(records)
    return {"all_to_all_calls": calls, "all_to_all_s": round(seconds, 4),
            "all_to_all_share": round(seconds / step_seconds, 4) if step_seconds else None}


def emulated_prediction(run, sample: dict, step_seconds: float, host_gib: float) -> dict:
    """What the emulated rank (parallel/emulate.py) predicts for the real N-GPU step: its step time plus the
    communication its logged collectives would take on real GPUs (planner/communication.py), and the host
    memory of a node of N such ranks."""
    from ulysses_train.diagnostics.collectives import call_counts, logged_collectives
    from ulysses_train.planner.communication import estimate_communication
    from ulysses_train.training.step import train_step

    calls = call_counts(logged_collectives(lambda: train_step(run, [sample])))
    world = run.dims.world_size
    estimate = estimate_communication(calls, world)
    return {"emulated": {**estimate.to_dict(step_seconds), "collective_calls": calls,
                         "host_gib_per_node": round(host_gib * world, 1)}}


# first match wins; names are CUDA kernel names on a GPU, aten op names on CPU
KERNEL_KINDS = (
    ("communication", ("nccl", "all_to_all", "allgather", "all_gather", "reduce_scatter", "gloo")),
    ("attention", ("fmha", "flash", "sdpa", "attention", "scaled_dot_product")),
    # fla's Triton kernels of the gated delta rule (and its L2 norm, decay cumsum, WY solve), FlashQLA's TileLang
    # ones (TileLang names a kernel after its function: `main_kernel`, or FlashQLA's fused_gdr_*)
    ("gated delta rule", ("delta_rule", "chunk_fwd_kernel", "chunk_bwd_kernel", "wy_repr", "recompute_w_u", "kkt",
                          "inverse_kernel", "solve_tril", "l2norm", "cumsum", "_dhu", "gdr", "main_kernel",
                          "prepare_h", "dqkwg", "dv_local")),
    ("causal conv1d", ("conv1d", "causal_conv")),
    ("norms", ("rms_norm", "rmsnorm", "layer_norm", "norm_gate", "layernorm")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "aten::mm", "aten::addmm", "aten::bmm", "aten::matmul")),
    ("host copies (offload)", ("memcpy htod", "memcpy dtoh")),
    ("copy", ("memcpy", "memset", "aten::copy_", "aten::_to_copy", "copy_kernel", "cat_")),
)


TOP_KERNELS = 40
"""Kernels listed by name in a --time-breakdown row, costliest first."""


def kernel_kind(name: str) -> str:
    """Which kind of work a kernel (or, on CPU, an aten op) is: KERNEL_KINDS, else 'elementwise and other'."""
    lowered = name.lower()
    for kind, needles in KERNEL_KINDS:
        if any(needle in lowered for needle in needles):
            return kind
    return "elementwise and other"


def time_breakdown(run, sample: dict) -> dict:
    """Device time of one more step by kind of work, from torch.profiler (the profiled step runs slower; the
    shares, not the seconds, are what to compare). On a GPU it sums each kernel's own time; on CPU each aten
    op's self time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from ulysses_train.training.step import train_step

    cuda = torch.cuda.is_available()
    # on a GPU only the kernels are wanted: without CPU events the profiler does not record every op that the
    # checkpointing's dispatch modes route through Python (a full-depth 128K step did not finish in 290 s)
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    started = time.perf_counter()
    with profile(activities=activities) as prof:
        train_step(run, [sample])
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - started
    by_kind, kernels = {}, []
    for event in prof.key_averages():
        if cuda:
            if "cuda" not in str(getattr(event, "device_type", "")).lower():
                continue
            us = getattr(event, "self_device_time_total", 0) or getattr(event, "self_cuda_time_total", 0)
        else:
            if not event.key.startswith("aten::"):
                continue
            us = event.self_cpu_time_total
        if us <= 0:
            continue
        kind = kernel_kind(event.key)
        by_kind[kind] = by_kind.get(kind, 0.0) + us / 1e6
        kernels.append((us / 1e6, event.key[:120], kind))
    kernels.sort(reverse=True)
    return {"profiled_step_s": round(wall, 3), "time_by_kind_s": {k: round(v, 3) for k, v in sorted(by_kind.items())},
            "top_kernels": [{"s": round(s, 4), "name": n, "kind": k} for s, n, k in kernels[:TOP_KERNELS]]}


def launch_point(point: dict, nproc: int, timeout: int) -> dict:
    """Run one point in fresh processes; an OOM or a timeout becomes a row, not a crash."""
    from ulysses_train.parallel.launch import free_port

    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as out:
        path = out.name
    cmd = [sys.executable, os.path.abspath(__file__), "--point", json.dumps({**point, "out": path})]
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
    if proc.returncode != 0 or os.path.getsize(path) == 0:
        tail = (proc.stderr or proc.stdout)[-600:]
        status = "OOM" if "OutOfMemoryError" in tail or "out of memory" in tail else f"failed: {tail.strip()[-300:]}"
        return {**point, "status": status, "wall_s": round(time.time() - started, 1)}
    with open(path) as fh:
        return {**json.load(fh), "wall_s": round(time.time() - started, 1)}


def timed_out_row(point: dict, path: str, timeout: int, stderr) -> dict:
    """A point that ran out of time: its timed steps if they finished (only an extra step timed out), else
    a timeout status with the last phases it reached."""
    if isinstance(stderr, bytes):
        stderr = stderr.decode(errors="replace")
    phases = [line[len("[bench] "):] for line in (stderr or "").splitlines() if line.startswith("[bench] ")]
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


def bench(args) -> int:
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if args.point:
        from ulysses_train.parallel.layout import exit_process

        point = json.loads(args.point)
        write_row(point, run_point(point))
        exit_process(0)  # the point ran a process group: no interpreter teardown (parallel.exit_process)
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
    if args.emulate_sp:
        check_emulated_points(args, attns)
    unknown = sorted(set(lever_sets) - set(LEVERS) - {"config"})
    if unknown:
        raise UserError(f"--levers: unknown lever set {unknown[0]!r}; choose from {', '.join(LEVERS)}.")
    for length, levers, attn, documents in [(int(n), lv, a, int(d)) for n in (lengths or "65536").split(",")
                                            for lv in lever_sets for a in attns
                                            for d in args.documents.split(",")]:
        point = {"model": args.model, "layers": args.layers, "length": length, "levers": levers,
                 "sp": args.emulate_sp or args.sp, "emulate_sp": args.emulate_sp,
                 "documents": documents, "config": args.config, "sets": args.sets,
                 "attn": attn, "steps": args.steps, "optimizer": args.optimizer, "keep_fraction": args.keep_fraction,
                 "offload_fraction": args.offload_fraction,
                 "chunk_rows": args.chunk_rows, "shape_overrides": json.loads(args.shape_overrides),
                 "comm_share": args.comm_share, "time_breakdown": args.time_breakdown}
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
