"""Where a first step's extra seconds go when no kernel compiles (the caches warm): cProfile around the first and
the second training step of one bench point, in one process, and the functions whose time the first step has and
the second has not. A one-off measurement (benchmarks/RESULTS.md cites the commit that ran it).

usage: python benchmarks/first_step_profile.py POINT_JSON OUT_DIR   (POINT_JSON: a bench.py row or point)"""
import cProfile
import json
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
POINT_KEYS = ("model", "layers", "length", "levers", "sp", "emulate_sp", "documents", "config", "sets", "attn",
              "steps", "optimizer", "keep_fraction", "offload_fraction", "chunk_rows", "shape_overrides",
              "comm_share", "time_breakdown", "time_breakdown_ops")


def profiled_step(run, sample, path):
    """One step under cProfile; its stats written to `path`, its own seconds returned."""
    import torch

    from ulysses_train.training.step import train_step

    prof = cProfile.Profile()
    began = time.perf_counter()
    prof.enable()
    train_step(run, [sample])
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    prof.disable()
    seconds = time.perf_counter() - began
    prof.dump_stats(path)
    return seconds


def by_function(path):
    """{function: own seconds} of one profile."""
    return {f"{os.path.basename(key[0])}:{key[1]}:{key[2]}": value[2]
            for key, value in pstats.Stats(path).stats.items()}


def main():
    row, out = json.load(open(sys.argv[1])), sys.argv[2]
    point = {key: (row[0] if isinstance(row, list) else row)[key] for key in POINT_KEYS}
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533"), ("RANK", "0"),
                        ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(name, value)
    from ulysses_train.training.first_use_kernels import apply_kernel_cache

    apply_kernel_cache()
    import bench_point

    run, *_ = bench_point.build_point(point)
    paths = [os.path.join(out, f"step{i}.prof") for i in (1, 2)]
    seconds = [profiled_step(run, bench_point_sample(bench_point, run, point), path) for path in paths]
    first, second = by_function(paths[0]), by_function(paths[1])
    extra = sorted(((first[f] - second.get(f, 0.0), f) for f in first), reverse=True)[:40]
    print(f"first step {seconds[0]:.2f} s, second {seconds[1]:.2f} s (both under cProfile)")
    print("own seconds the first step has beyond the second, by function:")
    for delta, name in extra:
        print(f"  {delta:8.3f}  {name}")
    for index, path in enumerate(paths, 1):
        print(f"--- step {index}: top 25 by cumulative seconds")
        pstats.Stats(path).sort_stats("cumulative").print_stats(25)
    sys.stdout.flush()
    os._exit(0)  # a process group is up: no interpreter teardown (as bench_point)


def bench_point_sample(bench_point, run, point):
    """The same random sample bench_point builds (seeded by the data-parallel rank)."""
    import torch

    gen = torch.Generator().manual_seed(run.dims.dp_rank)
    ids = torch.randint(0, run.hf_config.vocab_size, (1, point["length"]), generator=gen)
    sample = {"input_ids": ids, "labels": ids.clone()}
    documents = bench_point.synthetic_documents(point, run.cfg.data.packing)
    if documents:
        sample["document_lengths"] = bench_point.equal_documents(point["length"], documents)
    return sample


if __name__ == "__main__":
    main()
