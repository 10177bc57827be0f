"""One benchmark point of scripts/bench.py, run in its own process group: build the engine with the point's run
config and DeepSpeed JSON, time its steps, and write its row (JSON) for bench.py to collect.

    python scripts/bench_point.py '{"model": "qwen3-4b", "length": 65536, "levers": "all", ..., "out": "row.json"}'

bench.py starts it (under torch.distributed.run for several processes), so one point's memory never leaks into
the next and an out-of-memory point is a row, not a crash. The lever sets (LEVERS) are defined here, where each
point's run config is built; bench.py's help lists them.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

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
    """ds_configs/zero3.json with this point's activation offload, optimizer placement and --deepspeed-overrides;
    None for a --config point (build_engine then reads the config's own DeepSpeed JSON, as scripts/train.py
    does)."""
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
    ds.update(point.get("deepspeed_overrides") or {})
    return without_update(ds) if point["optimizer"] == "none" else ds


def without_update(ds: dict) -> dict:
    """`--optimizer none`: torch.optim.SGD at lr 0 named in the DeepSpeed JSON (DeepSpeed takes torch's optimizers
    by name), so the planner reads what the run keeps, the fp32 master only
    (planner.options.deepspeed_optimizer_state_bytes)."""
    ds["optimizer"] = {"type": "SGD", "params": {"lr": 0.0}}
    ds["zero_allow_untested_optimizer"] = True
    return ds


def build_point(point: dict):
    """(run, its run config, the sample, its document count, model FLOPs per sequence, seconds to build)."""
    import torch

    from ulysses_train.model.presets import save_preset_config
    from ulysses_train.model.flops import model_flops_per_sequence, non_embedding_params
    from ulysses_train.training.step import build_engine, resolve_run

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
    run = build_engine(resolve_run(cfg, deepspeed_config=ds), check_memory=bool(point.get("config")))
    build_seconds = time.perf_counter() - began
    progress(f"engine built in {build_seconds:.0f} s")
    gen = torch.Generator().manual_seed(run.dims.dp_rank)
    ids = torch.randint(0, run.hf_config.vocab_size, (1, point["length"]), generator=gen)
    sample = {"input_ids": ids, "labels": ids.clone()}
    documents = synthetic_documents(point, cfg.data.packing)
    if documents:
        sample["document_lengths"] = equal_documents(point["length"], documents)
    flops = model_flops_per_sequence(run.hf_config, non_embedding_params(run.module.causal_lm), point["length"],
                                     sample.get("document_lengths"))
    return run, cfg, sample, documents, flops, build_seconds


def run_steps(run, sample: dict, steps: int) -> tuple:
    """One warm-up step, then `steps` timed ones (steps=0: the one step is timed cold). Returns (timed seconds, their
    peak GPU GiB, their losses, every step's costs: seconds and first-use causes, training/step_costs.py)."""
    import torch

    from ulysses_train.training.step import train_step
    from ulysses_train.training.step_costs import measured_step

    cuda = torch.cuda.is_available()
    times, peaks, losses, costs = [], [], [], []
    for step in range(steps + 1):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with measured_step(run.module, torch.cuda.synchronize if cuda else None) as cost:
            result = train_step(run, [sample])
        progress(f"step {step}: {cost.seconds:.2f} s")
        costs.append(cost.to_dict())
        if step > 0 or steps == 0:
            times.append(cost.seconds)
            peaks.append(torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0)
            losses.append(result.loss)
    return times, peaks, losses, costs


def run_point(point: dict) -> dict:
    """One (lever set, length) point in this process: build the engine, warm up, time steps."""
    import torch

    from ulysses_train.model.loading import resolve_attn_implementation
    from ulysses_train.training.metrics import peak_host_gib

    run, cfg, sample, documents, flops, build_seconds = build_point(point)
    times, peaks, losses, costs = run_steps(run, sample, point["steps"])
    seconds = sorted(times)[len(times) // 2]
    world, cuda = run.dims.world_size, torch.cuda.is_available()
    row = {**point, "documents": documents, "status": "ok", "s_per_step": round(seconds, 3),
           "tokens_per_s": round(point["length"] * run.dims.dp / seconds, 1),
           "tflops_per_gpu": round(flops * run.dims.dp / seconds / world / 1e12, 1),
           "peak_gpu_gib": round(max(peaks), 2), "peak_host_gib": round(peak_host_gib(), 2),
           "loss": round(losses[-1], 4), "all_step_s": [round(t, 3) for t in times],
           "engine_build_s": round(build_seconds, 2), "step_costs": costs,
           "rmsnorm": cfg.model.rmsnorm, "attn": resolve_attn_implementation(cfg.model.attn_implementation), "sp": run.dims.sp,
           "run_levers": run_levers(run.cfg or cfg, run.ds_config),
           "auto_levers": run.levers.to_dict() if run.levers is not None else None,
           "torch": torch.__version__, "gpu": torch.cuda.get_device_name() if cuda else "cpu"}
    # written now, so a failure or a timeout in what follows keeps the timed steps (launch_point reads it back)
    write_row(point, row)
    row["plan_kernels"] = planned_kernels(run)
    write_row(point, row)
    extra_steps(run, sample, point, row, seconds)
    return row


def extra_steps(run, sample: dict, point: dict, row: dict, seconds: float) -> None:
    """The measurements that each take one more step, as the point asks: the emulated rank's prediction, the
    all-to-all share, the profiled step; the row is rewritten after each."""
    if point.get("emulate_sp"):
        row.update(emulated_prediction(run, sample, seconds, row["peak_host_gib"],
                                       point.get("emulate_gpus_per_node") or point["emulate_sp"]))
        write_row(point, row)
        progress("logged-collectives step done")
    if point.get("comm_share"):
        row.update(all_to_all_seconds(run, sample, seconds))
        progress("all-to-all step done")
    if point.get("time_breakdown") or point.get("time_breakdown_ops"):
        row.update(time_breakdown(run, sample, ops=bool(point.get("time_breakdown_ops"))))
        progress("profiled step done")
    if point.get("memory_profile"):
        row["memory_peak"] = memory_peak(run, sample, point)
        write_row(point, row)
        progress("memory-profiled step done")


def memory_peak(run, sample: dict, point: dict) -> dict:
    """One step with the allocator's history recorded (diagnostics/profiling.py, files under the point's
    memory_profile folder): the peak, its phase and the 12 sites holding most of it."""
    from ulysses_train.diagnostics.profiling import MemoryProfile
    from ulysses_train.training.step import train_step

    tag = f"{point['model']}_{point.get('layers') or 'all'}l_{point['length']}"
    with MemoryProfile(point["memory_profile"], tag=tag, module=run.module,
                       optimizer=run.deepspeed.optimizer) as profile:
        train_step(run, [sample])
    if profile.peak is None:
        return {}
    return {key: profile.peak[key] for key in ("peak_gib", "phase", "alive_before_recording_gib")} | {
        "by_site": profile.peak["by_site"][:12]}


def run_levers(cfg, ds: dict) -> dict:
    """The memory levers the point ran with, as the run config and DeepSpeed JSON name them."""
    return {"keep_attention_fraction": cfg.model.keep_attention_fraction, "tiled_mlp": cfg.model.tiled_mlp,
            "activation_offload_fraction": cfg.model.activation_offload_fraction,
            "attention_head_chunks": cfg.model.attention_head_chunks,
            "cpu_checkpointing": bool((ds.get("activation_checkpointing") or {}).get("cpu_checkpointing")),
            "loss": cfg.loss.type, "lora": bool(cfg.model.lora), "lora_settings": dict(cfg.model.lora or {})}


PLAN_KERNEL_FIELDS = ("mixer_kernels", "offset_norm_kernel", "swiglu_kernel", "low_memory_rmsnorm",
                      "attention_kernel", "sp_reduce_cast_bytes")
"""The PlanOptions fields that say how the run computed, which its levers do not say: the kernels that ran and
the dtype of its gradient reduce (--deepspeed-overrides). A row's planner record (benchmarks/emulated_depth.py,
planner_validation.jsonl) needs them."""


def planned_kernels(run) -> dict:
    """The kernels the run's own preflight plan assumes (planner.run.options_of_resolved_run: its mixer kernels
    as the run chose them)."""
    from ulysses_train.planner.run import options_of_resolved_run

    options = options_of_resolved_run(run.run)
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


def emulated_prediction(run, sample: dict, step_seconds: float, host_gib: float, gpus_per_node: int) -> dict:
    """What the emulated rank (parallel/emulate.py) predicts for the real N-GPU step: its step time plus the
    communication its logged collectives would take on real GPUs in nodes of `gpus_per_node`
    (planner/communication.py), and the host memory of a node of such ranks."""
    from ulysses_train.diagnostics.collectives import call_counts, logged_collectives
    from ulysses_train.planner.communication import estimate_communication
    from ulysses_train.training.step import train_step

    calls = call_counts(logged_collectives(lambda: train_step(run, [sample])))
    world = run.dims.world_size
    estimate = estimate_communication(calls, world, gpus_per_node)
    return {"emulated": {**estimate.to_dict(step_seconds), "collective_calls": calls,
                         "host_gib_per_node": round(host_gib * estimate.gpus_per_node, 1)}}


def time_breakdown(run, sample: dict, ops: bool = False) -> dict:
    """Device time of one more step by kind of work (diagnostics/step_time.py); `ops`: charged to the aten ops
    and Python lines that launched it too (slow: at reduced depth)."""
    import torch

    from ulysses_train.diagnostics.step_time import profile_device_time
    from ulysses_train.training.step import train_step

    return profile_device_time(lambda: train_step(run, [sample]), torch.cuda.is_available(), ops=ops)


def main(argv=None) -> None:
    from ulysses_train.parallel.layout import exit_process

    point = json.loads((argv or sys.argv[1:])[0])
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    from ulysses_train.training.first_use_kernels import apply_kernel_cache

    apply_kernel_cache()  # the caches the trainer uses (cli.prepare_environment): a warmed kernel loads here too
    write_row(point, run_point(point))
    exit_process(0)  # the point ran a process group: no interpreter teardown (parallel.exit_process)


if __name__ == "__main__":
    main()
