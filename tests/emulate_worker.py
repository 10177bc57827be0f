"""One rank of an sp step, real (under torchrun, gloo) or emulated (one process: parallel/emulate.py), recording
what the rank does: the attention kernels' input shapes, every collective with its message size, and the
sizes ZeRO-3 gives this rank (weights, gradients, optimizer states). Rank 0 writes them to --out.

    python -m torch.distributed.run --nproc_per_node 2 tests/emulate_worker.py --sp 2 ...   # real
    python tests/emulate_worker.py --emulate 2 ...                                          # emulated
"""
import argparse

import torch
from lever_worker import CountOps  # tests/ is this script's folder

from ulysses_train.config import load_config
from ulysses_train.diagnostics.collectives import call_counts, logged_collectives
from ulysses_train.parallel.layout import exit_process
from ulysses_train.training import step as engine_module


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--ds-config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sp", type=int, default=1, help="a real run's sp")
    ap.add_argument("--emulate", type=int, default=0, help="emulate rank 0 of this sp in one process")
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--set", action="append", default=[])
    args = ap.parse_args()
    sp = args.emulate or args.sp
    if args.emulate:
        from ulysses_train.parallel.emulate import start_emulated_rank

        start_emulated_rank(args.emulate)
    cfg = load_config(None, [f"model.name_or_path={args.model_dir}", "model.dtype=float32",
                             "model.attn_implementation=sdpa", "loss.chunk_rows=8",
                             f"parallel.sequence_parallel_size={sp}",
                             f"train.deepspeed_config={args.ds_config}", *args.set])
    run = engine_module.build_engine(engine_module.resolve_run(cfg), optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    ids = torch.randint(0, run.hf_config.vocab_size, (1, args.length), generator=torch.Generator().manual_seed(0))
    sample = {"input_ids": ids, "labels": ids.clone()}
    engine_module.train_step(run, [sample])  # the first step records ZeRO-3's trace; the second replays it
    with CountOps() as ops:
        logged = logged_collectives(lambda: engine_module.train_step(run, [sample]))
    optimizer = run.deepspeed.optimizer
    if run.dims.rank == 0:
        torch.save({
            "world": run.dims.world_size, "sp": run.dims.sp,
            "attention": dict(ops.shapes), "collectives": call_counts(logged),
            "weight_shard_numel": sum(p.ds_tensor.numel() for p in run.module.parameters()),
            "optimizer_numel": sum(t.numel() for t in optimizer.fp32_partitioned_groups_flat),
            "momentum_numel": sum(s["momentum_buffer"].numel() for s in optimizer.optimizer.state.values()),
        }, args.out)
    exit_process(0)


if __name__ == "__main__":
    main()
