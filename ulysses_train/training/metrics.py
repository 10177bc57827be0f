"""What a step costs in memory, values over ranks, and the metrics.jsonl writer (its FLOPs: model/flops.py)."""
from __future__ import annotations

import json
import os
import resource

import torch

from ulysses_train.constants import GIB
from ulysses_train.device import collective_device


def peak_gpu_gib() -> float:
    return torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else 0.0


def reset_peak_gpu() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_host_gib() -> float:
    """This process's peak resident memory (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


def max_over_ranks(value: float) -> float:
    return _over_ranks(value, torch.distributed.ReduceOp.MAX)


def sum_over_ranks(value: float) -> float:
    return _over_ranks(value, torch.distributed.ReduceOp.SUM)


def _over_ranks(value: float, op) -> float:
    if torch.distributed.is_initialized():
        tensor = torch.tensor([value], dtype=torch.float64, device=collective_device())
        torch.distributed.all_reduce(tensor, op=op)
        return tensor.item()
    return value


MONITORED = ("loss", "grad_norm", "num_tokens", "step_time_s", "tokens_per_s", "tflops_per_gpu", "peak_gpu_gib",
             "peak_host_gib")


def step_record(step: int, result, seconds: float, epoch: float, flops: float, dims, tokens_per_dp_group: int) -> dict:
    """One step's line of metrics.jsonl: its loss, speed (`flops`: the whole step's model FLOPs, every dp group;
    `tokens_per_dp_group`: the tokens one dp group trains on in the step, gradient accumulation included) and peak memory over ranks.
    Collective: every rank calls it."""
    return {
        "step": step,
        "loss": round(result.loss, 6),
        "grad_norm": None if result.grad_norm is None else round(result.grad_norm, 6),
        "num_tokens": float(result.num_tokens),
        "epoch": round(epoch, 4),
        "step_time_s": round(seconds, 4),
        "tokens_per_s": round(dims.dp * tokens_per_dp_group / seconds, 1),
        "tflops_per_gpu": round(flops / seconds / dims.world_size / 1e12, 3),
        "peak_gpu_gib": round(max_over_ranks(peak_gpu_gib()), 3),
        "peak_host_gib": round(max_over_ranks(peak_host_gib()), 3),
        **({} if result.router_aux_loss is None else {"router_aux_loss": round(result.router_aux_loss, 6)}),
        **({} if result.indexer_loss is None else {"indexer_kl_loss": round(result.indexer_loss, 6)}),
    }


def log_line(record: dict) -> str:
    """The progress line of a step_record."""
    head = {k: record[k] for k in ("loss", "grad_norm", "num_tokens", "epoch")}
    return (f"{head} step {record['step']} | {record['step_time_s']:.2f} s/step | "
            f"{record['tokens_per_s']:.0f} tok/s | {record['tflops_per_gpu']:.1f} TFLOP/s/GPU | "
            f"peak GPU {record['peak_gpu_gib']:.2f} GiB | peak host {record['peak_host_gib']:.2f} GiB")


def monitor_events(record: dict) -> list[tuple[str, float, int]]:
    """A step's record as DeepSpeed monitor events (name, value, step): TensorBoard, W&B and CSV get what
    metrics.jsonl gets."""
    return [(f"Train/{key}", float(record[key]), int(record["step"])) for key in MONITORED
            if record.get(key) is not None]


def _record(line: str):
    """One metrics.jsonl line as its record; None for a blank line or one a crash cut short (a full disk, a killed
    process mid-write), which a resume drops with the steps past its checkpoint."""
    try:
        return json.loads(line) if line.strip() else None
    except json.JSONDecodeError:
        return None


class MetricsLog:
    """One JSON object per step in <output_dir>/metrics.jsonl; appended, so a resumed run continues it."""

    def __init__(self, output_dir: str, start_step: int):
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self._truncate_after(start_step)

    def _truncate_after(self, step: int) -> None:
        """Drop records past the checkpoint we resume from, so the file never holds a step twice."""
        if not os.path.exists(self.path):
            return
        with open(self.path) as fh:
            kept = [line for line in fh if (record := _record(line)) is not None and record.get("step", 0) <= step]
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as fh:   # replaced atomically: a crash here never loses the records kept
            fh.writelines(kept)
        os.replace(tmp, self.path)

    def write(self, record: dict) -> None:
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
