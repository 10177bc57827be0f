"""One rank of a lever test: one training step through ulysses_train with the memory levers on
(activation offload, kept attention, TiledMLP), counting attention kernels and collectives.

Rank 0 writes the loss, full gradients and parameters after the SGD step to --out; every rank writes what it
saw (tile counts, kernel and collective counts, offload statistics) to --out.rank<r>.
Launched by tests/helpers.run_workers(..., script=lever_worker.py) (torchrun, gloo, CPU).
"""
import argparse
import collections

import torch
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad
from torch.utils._python_dispatch import TorchDispatchMode

from ulysses_train.config import load_config
from ulysses_train.model.recompute import attention_ops
from ulysses_train.model.tiling import agree_max
from ulysses_train.parallel.layout import exit_process
from ulysses_train.training import step as engine_module


class CountOps(TorchDispatchMode):
    """Counts attention kernels and all-to-alls that actually execute (a kept output is not executed), and each
    attention call's kernel, input shapes and dtype (`shapes`)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()
        self.shapes = collections.Counter()
        self.attention = attention_ops()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.attention:
            self.counts["attention"] += 1
            shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
            self.shapes[f"{func} {shapes} {args[0].dtype}"] += 1
            if func is torch.ops.ulysses_train.fa4_forward.default:
                self.counts["fa4"] += 1
        elif "all_to_all" in str(func):  # deepspeed::dim_zero_all_to_all, a custom op
            self.counts["all_to_all"] += 1
        return func(*args, **(kwargs or {}))


def count_zero3_fetches() -> collections.Counter:
    """Count ZeRO-3's parameter fetches by module class: how often each kind of module had its weights
    gathered (or checked) in the step. A tiled MLP must be fetched once per pass, never per tile."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    fetches = collections.Counter()
    fetch = PartitionedParameterCoordinator.fetch_sub_module

    def counting_fetch(self, current_submodule, forward):
        fetches[type(current_submodule).__name__] += 1
        return fetch(self, current_submodule, forward)

    PartitionedParameterCoordinator.fetch_sub_module = counting_fetch
    return fetches


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--ds-config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--set", action="append", default=[], help="a run-config override, as for scripts/train.py")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--tiles-as-zero3-modules", action="store_true",
                    help="negative control: tiled MLPs are not ZeRO-3 leaf modules (every tile's projections fetch)")
    args = ap.parse_args()
    if args.tiles_as_zero3_modules:
        import deepspeed.utils

        deepspeed.utils.set_z3_leaf_module = lambda module, flag: None

    cfg = load_config(None, [f"model.name_or_path={args.model_dir}", "model.dtype=float32",
                             "model.attn_implementation=sdpa", "model.tiled_mlp=true", "loss.chunk_rows=8",
                             f"train.deepspeed_config={args.ds_config}", *args.set])
    fetches = count_zero3_fetches()
    run = engine_module.build_engine(engine_module.resolve_run(cfg), optimizer_factory=lambda p: torch.optim.SGD(p, lr=args.lr))
    dims = run.dims
    causal_lm = run.module.causal_lm
    samples = torch.load(args.data)
    mine = [samples[dims.dp_rank]]

    # ranks propose different tile counts; every rank must end up with the largest
    proposed = 3 + 4 * dims.rank
    agreed = agree_max(proposed, run.device)

    names = [n.removeprefix("causal_lm.") for n, _ in run.module.named_parameters()]
    params = [p for _, p in run.module.named_parameters()]
    grads = {}

    def read_gradients():
        for name, p in zip(names, params):
            grads[name] = safe_get_full_grad(p).detach().clone()

    with CountOps() as counter:
        result = engine_module.train_step(run, mine, before_optimizer_step=read_gradients)
    after = {name: safe_get_full_fp32_param(p).detach().clone() for name, p in zip(names, params)}
    offloader = causal_lm.activation_offloader
    torch.save({
        "proposed": proposed, "agreed": agreed,
        "local_tokens": mine[0]["input_ids"].shape[1] // dims.sp,
        "num_tiles": causal_lm.tiled_mlp_schedule.num_tiles if causal_lm.tiled_mlp_schedule else None,
        "counts": dict(counter.counts), "zero3_fetches": dict(fetches),
        "offload": None if offloader is None else {"pinned_bytes": offloader.pinned_bytes(),
                                                   "prefetched": offloader.prefetched,
                                                   "fetched_on_demand": offloader.fetched_on_demand},
    }, f"{args.out}.rank{dims.rank}")
    if dims.rank == 0:
        torch.save({"loss": result.loss, "num_tokens": result.num_tokens, "grads": grads, "params": after},
                   args.out)
    exit_process(0)


if __name__ == "__main__":
    main()
