"""What a step costs: model FLOPs (ulysses_train/DESIGN.md, 'How throughput is counted'), peak memory, and the
metrics.jsonl writer."""
from __future__ import annotations

import json
import os
import resource

import torch

from ulysses_train.constants import GIB
from ulysses_train.device import collective_device
from ulysses_train.model.architecture import text_config


def attention_width(hf_config) -> int:
    """Query heads x head dim: the width of q and of the attention output."""
    text = text_config(hf_config)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_attention_heads * head_dim


def non_embedding_params(model) -> int:
    """Parameters that do matrix work per token (embedding lookups excluded, lm_head included once)."""
    total = 0
    embeddings = {id(model.get_input_embeddings().weight)}
    for p in model.parameters():
        if id(p) not in embeddings:
            total += getattr(p, "ds_numel", p.numel())
    output = model.get_output_embeddings()
    if output is not None and id(output.weight) in embeddings:  # tied: lm_head still multiplies every token
        total += getattr(output.weight, "ds_numel", output.weight.numel())
    return total


def attention_forward_flops(tokens: int, width: int, layers: int, document_lengths=None) -> float:
    """Causal attention's forward: QK^T and PV over the half of the T x T scores not masked, 2·T²·d_attn per
    layer (d_attn = query heads x head dim). With document packing each document attends only to itself, so
    the sum of its documents' squared lengths replaces T² (`document_lengths`: the sequence's, padding
    segment included: the kernel computes it too)."""
    squares = tokens**2 if document_lengths is None else sum(int(n) ** 2 for n in document_lengths)
    return 2 * squares * width * layers


def model_flops(params: int, tokens: int, width: int, layers: int, document_lengths=None) -> float:
    """6·N·T for the weights plus causal attention, whose forward (attention_forward_flops) x3 counts fwd+bwd.
    Recompute is not counted: this is the work the model needs, not the work the step happened to do. The
    planner's step time starts from the same figure."""
    return 6 * params * tokens + 3 * attention_forward_flops(tokens, width, layers, document_lengths)


def model_flops_per_sequence(hf_config, params: int, tokens: int, document_lengths=None) -> float:
    """model_flops of one sequence of `tokens` for a transformers config; `params` do matrix work per token."""
    text = text_config(hf_config)
    return model_flops(params, tokens, attention_width(hf_config), text.num_hidden_layers, document_lengths)


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


def monitor_events(record: dict) -> list[tuple[str, float, int]]:
    """A step's record as DeepSpeed monitor events (name, value, step): TensorBoard, W&B and CSV get what
    metrics.jsonl gets."""
    return [(f"Train/{key}", float(record[key]), int(record["step"])) for key in MONITORED
            if record.get(key) is not None]


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
            kept = [line for line in fh if line.strip() and json.loads(line).get("step", 0) <= step]
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as fh:   # replaced atomically: a crash here never loses the records kept
            fh.writelines(kept)
        os.replace(tmp, self.path)

    def write(self, record: dict) -> None:
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
