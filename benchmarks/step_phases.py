"""Where each training step's time goes, step by step: forward, backward and optimizer seconds, with what the
memory systems did in that step (the slow-second-step bisection).

    python benchmarks/step_phases.py --model qwen3-0.6b --length 65536 --levers all --steps 6 --json out.json

Runs the trainer's own engine and `train_step` (the lever sets of scripts/bench.py), timing each phase with a
device synchronisation around it. Per step it also records: the offload pool's buffers and bytes (new ones mean
host memory was pinned in that step), the CUDA caching allocator's device allocations, frees and retries (a
retry flushes the cache), the process's page faults (minor: fresh host pages touched; major: read from disk)
and its resident memory, and where the main thread's Python waited (sampled stacks). Prints one line per step
and writes JSON.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import bench_point  # noqa: E402  (the lever sets and the point's configs)

from ulysses_train.constants import LOSS_CHUNK_ROWS  # noqa: E402


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class PhaseTimer:
    """Seconds per named phase of one step, each phase closed by a device synchronisation."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        _sync()
        started = time.perf_counter()
        yield
        _sync()
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started


def memory_counters(run) -> dict:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out = {"minor_faults": usage.ru_minflt, "major_faults": usage.ru_majflt, "rss_gib": _rss_gib(),
           "cpu_user_s": usage.ru_utime, "cpu_sys_s": usage.ru_stime,
           "voluntary_switches": usage.ru_nvcsw, "involuntary_switches": usage.ru_nivcsw,
           "gc_s": GC_CLOCK.seconds, "gc_collections": GC_CLOCK.collections}
    offloader = getattr(run.module.causal_lm, "activation_offloader", None)
    pool = offloader.pool if offloader is not None else None
    out.update(pool_buffers=pool.count if pool else 0, pool_gib=(pool.total_bytes if pool else 0) / 2**30)
    if torch.cuda.is_available():
        stats = torch.cuda.memory_stats()
        out.update(device_allocs=stats.get("num_device_alloc", 0), device_frees=stats.get("num_device_free", 0),
                   alloc_retries=stats.get("num_alloc_retries", 0),
                   reserved_gib=torch.cuda.memory_reserved() / 2**30)
    return out


def _rss_gib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


class GarbageCollectorClock:
    """Seconds the Python garbage collector ran (gc.callbacks around every collection): a slow step spent
    inside collections shows up here even though its stacks are spread over whatever code allocated."""

    def __init__(self):
        import gc

        self.seconds, self.collections, self._started = 0.0, 0, 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase, info):
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started
            self.collections += 1


GC_CLOCK = GarbageCollectorClock()


def thread_cpu_seconds() -> dict:
    """CPU seconds (user + system) of every thread of this process, by `name:tid` (from /proc): shows whether
    a slow step burns CPU (and in which thread) or waits."""
    out, tick = {}, os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as fh:
                name = fh.read().strip()
            with open(f"/proc/self/task/{tid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        out[f"{name}:{tid}"] = (int(fields[11]) + int(fields[12])) / tick
    return out


def busiest_threads(before: dict, after: dict, n: int = 6) -> list:
    grown = {k: round(v - before.get(k, 0.0), 2) for k, v in after.items()}
    return sorted(grown.items(), key=lambda kv: -kv[1])[:n]


class StackSampler:
    """Where the main thread's Python is, sampled every `interval` seconds from a side thread: the innermost
    frames of each sample counted, so a slow step shows which call it waits in."""

    def __init__(self, interval: float = 0.25, depth: int = 7):
        import threading

        self.interval, self.depth = interval, depth
        self.counts: dict[str, int] = {}
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        import threading

        me = threading.get_ident()
        while not self._stop.wait(self.interval):
            for ident, frame in sys._current_frames().items():  # every thread: autograd runs backward on its own
                if ident == me:
                    continue
                names = ["main" if ident == self._main else "other"]
                while frame is not None and len(names) <= self.depth:
                    code = frame.f_code
                    names.append(f"{os.path.basename(code.co_filename)}:{frame.f_lineno}:{code.co_name}")
                    frame = frame.f_back
                key = " < ".join(names)
                self.counts[key] = self.counts.get(key, 0) + 1

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def top(self, n: int = 10) -> list:
        return sorted(self.counts.items(), key=lambda kv: -kv[1])[:n]


@contextlib.contextmanager
def device_profile(enabled: bool, host: bool = False):
    """Yield a function that returns the step's top device activities (name, calls, total ms), largest first;
    with `host`, also the top host-side operations and CUDA runtime calls by their own CPU time."""
    if not (enabled and torch.cuda.is_available()):
        yield lambda: {}
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if host else [])

    def top():
        events = prof.key_averages()
        out = {"kernels": [(e.key[:120], e.count, round(e.self_device_time_total / 1000, 1)) for e in sorted(
            events, key=lambda e: -e.self_device_time_total)[:14]]}
        if host:
            out["host_ops"] = [(e.key[:120], e.count, round(e.self_cpu_time_total / 1000, 1)) for e in sorted(
                events, key=lambda e: -e.self_cpu_time_total)[:25]]
        return out

    with profile(activities=activities) as prof:
        yield top


def timed_step(run, sample) -> dict:
    """train_step's work, phase by phase (one micro-batch)."""
    from ulysses_train.constants import IGNORE_INDEX
    from ulysses_train.model.attention import sdpa_priority
    from ulysses_train.parallel.layout import slice_sequence

    engine, dims, timer = run.deepspeed, run.dims, PhaseTimer()
    piece = slice_sequence(sample["input_ids"], sample["labels"], dims.sp, dims.sp_rank, run.pad_token_id,
                           document_lengths=sample.get("document_lengths"))
    batch = {k: v.to(run.device) if isinstance(v, torch.Tensor) else v for k, v in piece.items()}
    count = int((piece["shift_labels"] != IGNORE_INDEX).sum())
    with sdpa_priority():
        with timer.phase("forward"):
            nll, _ = engine(**batch)
        with timer.phase("backward"):
            engine.backward(nll * run.gradient_divisor / count, scale_wrt_gas=False)
    with timer.phase("optimizer"):
        engine.step()
    return timer.seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--length", type=int, default=65536)
    ap.add_argument("--levers", default="all", choices=sorted(bench_point.LEVERS))
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--shape-overrides", default="{}")
    ap.add_argument("--profile-steps", default="", help="comma-separated steps to profile on the device (kernels and "
                                                         "copies by device time, from torch.profiler)")
    ap.add_argument("--host-profile", action="store_true",
                    help="profiled steps also list host operations and CUDA runtime calls by CPU time")
    ap.add_argument("--ds-set", nargs="*", default=[],
                    help="DeepSpeed JSON overrides, e.g. zero_optimization.stage3_prefetch_bucket_size=0")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="gc.freeze() after the first step: objects alive then are never scanned again")
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    from ulysses_train.model.presets import save_qwen3_config
    from ulysses_train.training.step import build_engine
    from ulysses_train.user_input import apply_overrides

    point = {"levers": args.levers, "attn": args.attn, "sp": 1, "length": args.length, "chunk_rows": LOSS_CHUNK_ROWS,
             "keep_fraction": 1.0, "offload_fraction": 1.0, "optimizer": "gpu"}
    overrides = {"num_hidden_layers": args.layers} if args.layers else {}
    overrides.update(json.loads(args.shape_overrides))
    model_dir = save_qwen3_config(args.model, os.path.join(tempfile.mkdtemp(), "model"), **overrides)
    cfg = bench_point.point_config(point, model_dir, torch.cuda.is_available())
    ds = bench_point.point_deepspeed_config(point)
    apply_overrides(ds, args.ds_set)  # the same dotted form (and YAML values) as the run config's --set
    run = build_engine(cfg, deepspeed_config=ds)
    ids = torch.randint(0, run.hf_config.vocab_size, (1, args.length), generator=torch.Generator().manual_seed(0))
    sample = {"input_ids": ids, "labels": ids.clone()}
    rows = []
    for step in range(args.steps):
        before, threads_before = memory_counters(run), thread_cpu_seconds()
        started = time.perf_counter()
        profiled = str(step + 1) in args.profile_steps.split(",")
        with StackSampler() as sampler, device_profile(profiled, args.host_profile) as profile_top:
            phases = timed_step(run, sample)
        after = memory_counters(run)
        row = {"step": step + 1, "seconds": round(time.perf_counter() - started, 3),
               **{k: round(v, 3) for k, v in phases.items()},
               **{f"new_{k}": round(after[k] - before[k], 3) for k in after},
               "busiest_threads": busiest_threads(threads_before, thread_cpu_seconds())}
        print(json.dumps(row), flush=True)
        row["stacks"] = sampler.top()
        row.update(profile_top())
        rows.append(row)
        if args.gc_freeze and step == 0:
            import gc

            gc.collect()
            gc.freeze()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "torch": torch.__version__,
                       "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "steps": rows}, fh, indent=1)
    from ulysses_train.parallel.layout import exit_process

    exit_process(0)


if __name__ == "__main__":
    main()
