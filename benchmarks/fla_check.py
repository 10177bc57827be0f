"""The Gated DeltaNet layer on the GPU: flash-linear-attention's kernels against transformers' torch functions.

On CUDA the layer's conv and gated delta rule run fla's kernels (`model/mixers/gated_deltanet.py`); everything on CPU,
where the exactness tests run, uses transformers' torch functions. This checks that the two agree in bf16 at
Qwen3.5-9B's linear-attention shapes (16 key / 32 value heads of 128), output and every gradient, for one
sequence and for packed documents (`cu_seqlens`), and times one forward + backward of the layer.

Three runs of the same layer and inputs: `ref` (torch functions, fp32: the reference), `torch_bf16` (torch
functions, bf16: what bf16 itself costs), `fla_bf16` (the kernels, bf16). A point passes when every relative error
of `fla_bf16` is at most 2x that of `torch_bf16` plus 1e-3.

    python benchmarks/fla_check.py --lengths 4096,32768 --time-lengths 131072 --json OUT.json

`--memory-lengths` measures what the layer holds (bf16, the kernels): the bytes its forward leaves saved for
backward (allocated after the forward, less the input and the output) and the backward's peak above that, per
token: what the planner's Gated DeltaNet terms (planner/linear_layer.py) must match.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from ulysses_train.model.mixers.gated_deltanet_kernels import fused_gated_norm_forward
from ulysses_train.model.mixers import gated_deltanet as linear_attention
from ulysses_train.model.mixers import recurrent
from ulysses_train.model.swap import stock_class, swap_class
from ulysses_train.sequence_parallel import SequenceParallel


def build_layer(device):
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    config = Qwen3_5TextConfig(num_hidden_layers=1, layer_types=["linear_attention"])  # the 9B's widths
    torch.manual_seed(0)
    layer = Qwen3_5GatedDeltaNet(config, layer_idx=0).to(device)
    layer.sequence_parallel = SequenceParallel()
    return layer


def documents(length: int, packed: bool, device) -> torch.Tensor | None:
    if not packed:
        return None
    cuts = torch.linspace(0, length, 6).round().long().tolist()  # five documents of uneven rounding
    cuts[1] += 37
    return torch.tensor(cuts, dtype=torch.int32, device=device)


def use_kernels(layer, kernels: bool, fused_norm: bool = True) -> None:
    """The layer as the trainer builds it on a GPU with fla (conv, rule and, with `fused_norm`, the gated norm as
    fla's kernels: linear_attention.apply_gated_deltanet_ulysses), or with transformers' torch functions."""
    layer.kernel_variant = "fla" if kernels and layer.conv1d.weight.is_cuda else recurrent.TORCH  # fla picks FlashQLA
    if kernels and fused_norm:
        swap_class(layer.norm, "Fused", forward=fused_gated_norm_forward)
    else:
        layer.norm.__class__ = stock_class(layer.norm)


def run(layer, hidden, cu, dtype, kernels: bool):
    """Output and gradients (inputs, then parameters by name) of one forward + backward."""
    use_kernels(layer, kernels)
    layer = layer.to(dtype)
    x = hidden.to(dtype).detach().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    kwargs = {} if cu is None else {"cu_seq_lens_q": cu}
    out = linear_attention.ulysses_gated_deltanet_forward(layer, x, **kwargs)
    probe = torch.randn(out.shape, generator=torch.Generator(out.device).manual_seed(1), device=out.device)
    (out.float() * probe).sum().backward()
    grads = {"input": x.grad.float()}
    grads.update({name: p.grad.float() for name, p in layer.named_parameters()})
    return out.float().detach(), grads


def relative(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check(layer, length: int, packed: bool) -> dict:
    device = next(layer.parameters()).device
    hidden = torch.randn(1, length, layer.hidden_size, device=device, generator=torch.Generator(device).manual_seed(2))
    cu = documents(length, packed, device)
    ref_out, ref_grads = run(layer, hidden, cu, torch.float32, kernels=False)
    row = {"length": length, "packed": packed, "documents": 1 if cu is None else len(cu) - 1}
    for name, kernels in (("torch_bf16", False), ("fla_bf16", True)):
        out, grads = run(layer, hidden, cu, torch.bfloat16, kernels)
        row[name] = {"output": relative(out, ref_out), **{k: relative(grads[k], ref_grads[k]) for k in ref_grads}}
    layer.float()
    worst = max(row["fla_bf16"][k] - 2 * row["torch_bf16"][k] for k in row["fla_bf16"])
    row["passed"] = worst <= 1e-3
    return row


TIMED_VARIANTS = {"fla rule, torch norm": ("0", False), "fla rule, fused norm": ("0", True),
                  "FlashQLA rule, fused norm": ("1", True)}
"""(FLA_FLASH_QLA, fused gated norm) of each timed variant: fla hands its rule to FlashQLA when that is installed
and the variable is not 0 (model/mixers/gated_deltanet_kernels.py)."""


def timed(layer, length: int, repeats: int = 3) -> list[dict]:
    """Seconds of one forward + backward of the layer (the best of `repeats` after a first call that compiles),
    for each TIMED_VARIANTS entry whose kernels are here."""
    import importlib.util
    import os

    device = next(layer.parameters()).device
    layer = layer.to(torch.bfloat16)
    hidden = torch.randn(1, length, layer.hidden_size, device=device, dtype=torch.bfloat16, requires_grad=True)
    rows = []
    for name, (qla, fused_norm) in TIMED_VARIANTS.items():
        if qla == "1" and importlib.util.find_spec("flash_qla") is None:
            continue
        os.environ["FLA_FLASH_QLA"] = qla
        use_kernels(layer, True, fused_norm)
        seconds = []
        for _ in range(repeats + 1):
            torch.cuda.synchronize()
            started = time.perf_counter()
            linear_attention.ulysses_gated_deltanet_forward(layer, hidden).float().sum().backward()
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - started)
        rows.append({"length": length, "variant": name, "seconds_fwd_bwd": min(seconds[1:]),
                     "first_call_seconds": seconds[0], "peak_gib": torch.cuda.max_memory_allocated() / 2**30})
    os.environ.pop("FLA_FLASH_QLA")
    layer.float()
    return rows


def cuda_saved_and_backward_bytes(layer, hidden, run_forward) -> tuple[int, int]:
    """(bytes one forward leaves allocated beyond its output: what it saved for backward, the backward's peak above
    what was allocated before it), after a warm-up pass that compiles and tunes the kernels at this length. Also
    benchmarks/mixer_memory.py's measurement."""
    run_forward(hidden).sum().backward()
    hidden.grad = None
    layer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    out = run_forward(hidden)
    torch.cuda.synchronize()
    saved = torch.cuda.memory_allocated() - base - out.numel() * out.element_size()
    grad = torch.ones_like(out)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out.backward(grad)
    torch.cuda.synchronize()
    return saved, torch.cuda.max_memory_allocated() - before


def memory(layer, length: int, fused_norm: bool = True) -> dict:
    """Saved-for-backward and backward-peak bytes of one forward + backward (module docstring), with the gated
    norm as fla's fused kernel or as transformers' fp32 module."""
    device = next(layer.parameters()).device
    layer = layer.to(torch.bfloat16)
    use_kernels(layer, True, fused_norm)
    hidden = torch.randn(1, length, layer.hidden_size, device=device, dtype=torch.bfloat16, requires_grad=True)
    saved, extra = cuda_saved_and_backward_bytes(layer, hidden,
                                                 lambda x: linear_attention.ulysses_gated_deltanet_forward(layer, x))
    layer.float()
    return {"length": length, "fused_gated_norm": fused_norm, "saved_bytes": saved, "backward_peak_extra_bytes": extra,
            "saved_per_token": saved / length, "backward_extra_per_token": extra / length}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="4096,32768")
    ap.add_argument("--time-lengths", default="131072")
    ap.add_argument("--memory-lengths", default="")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not (torch.cuda.is_available() and recurrent.fla_available()):
        raise SystemExit("fla_check.py needs a CUDA GPU and the fla package (pip install flash-linear-attention)")
    layer = build_layer("cuda")
    result = {"checks": [], "timing": [], "memory": [], "torch": torch.__version__}
    for length in (int(n) for n in args.memory_lengths.split(",") if n):
        for fused_norm in (False, True):
            result["memory"].append(memory(layer, length, fused_norm))
            print(f"fla layer memory: {result['memory'][-1]}", flush=True)
            save(result, args.json)
    print(f"{'length':>8} {'docs':>4} {'kind':>10} {'output':>9} {'d input':>9} {'worst grad':>11}  pass", flush=True)
    for length in (int(n) for n in args.lengths.split(",") if n):
        for packed in (False, True):
            row = check(layer, length, packed)
            result["checks"].append(row)
            print_row(row)
            save(result, args.json)
    for length in (int(n) for n in args.time_lengths.split(",") if n):
        try:
            t = timed(layer, length)
        except torch.OutOfMemoryError:
            t = [{"length": length, "out_of_memory": True}]
            layer.float()
            torch.cuda.empty_cache()
        result["timing"] += t
        for row in t:
            print(f"fla layer fwd+bwd: {row}", flush=True)
        save(result, args.json)


def print_row(r: dict) -> None:
    for kind in ("torch_bf16", "fla_bf16"):
        e = r[kind]
        worst = max(v for k, v in e.items() if k not in ("output", "input"))
        print(f"{r['length']:>8} {r['documents']:>4} {kind:>10} {e['output']:9.2e} {e['input']:9.2e} "
              f"{worst:11.2e}  {r['passed'] if kind == 'fla_bf16' else ''}", flush=True)


def save(result: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as fh:
            json.dump(result, fh, indent=1)

if __name__ == "__main__":
    main()
