"""Mamba2's GPU kernels against transformers' torch math: one Nemotron 3 Nano Mamba2 layer (preset widths: 64 heads
of 64, 8 groups, state 128) with the Ulysses forward (model/mixers/mamba2.py) at sp=1, output and every parameter's
gradient in bf16 through fla's causal conv1d and chunk_simple_gla, and in bf16 through transformers' torch
functions, each against the fp32 torch path (the CPU-tested reference), one sequence and packed documents. Passes
where fla's relative error is at most twice the torch bf16 path's + 1e-3 (benchmarks/fla_check.py's rule).

    python benchmarks/mamba2_check.py --lengths 4096,16384 --json mamba2_check.json
    python benchmarks/mamba2_check.py --lengths 4096 --forms packed   # only the packed documents"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fla_check import documents, relative  # noqa: E402  (the same documents and error as the Gated DeltaNet check)
from mixer_memory import CASES, build  # noqa: E402

from ulysses_train.model.mixers import recurrent  # noqa: E402
from ulysses_train.model.mixers.mamba2 import choose_mamba2_kernel  # noqa: E402


def run(layer, hidden, cu, dtype, kernels: bool):
    """Output and gradients of the layer in `dtype`, through fla's kernels or transformers' torch functions."""
    layer.kernel_variant = choose_mamba2_kernel({}, cuda=True) if kernels else recurrent.TORCH
    layer.to(dtype).zero_grad(set_to_none=True)
    x = hidden.detach().to(dtype).requires_grad_(True)
    out = layer(x, cu_seq_lens_q=cu)
    out.float().square().mean().backward()
    grads = {name: p.grad.float().clone() for name, p in layer.named_parameters()}
    return out.float().detach(), {**grads, "input": x.grad.float()}


def check(layer, length: int, packed: bool) -> dict:
    hidden = torch.randn(1, length, layer.hidden_size, device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    cu = documents(length, packed, hidden.device)
    ref_out, ref_grads = run(layer, hidden, cu, torch.float32, kernels=False)
    row = {"length": length, "packed": packed, "documents": 1 if cu is None else len(cu) - 1}
    for name, kernels in (("torch_bf16", False), ("fla_bf16", True)):
        out, grads = run(layer, hidden, cu, torch.bfloat16, kernels)
        row[name] = {"output": relative(out, ref_out), **{k: relative(grads[k], ref_grads[k]) for k in ref_grads}}
    worst = max(row["fla_bf16"][k] - 2 * row["torch_bf16"][k] for k in row["fla_bf16"])
    row["passed"] = worst <= 1e-3
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="4096,16384")
    ap.add_argument("--forms", default="single,packed", help="single (one sequence), packed (5 documents), or both")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    case = next(c for c in CASES if c.kind == "mamba2")
    layer = build(case, torch.device("cuda")).float()
    with torch.no_grad():  # trained-like parameters: decays from slow to fast, a real D skip and dt bias
        layer.A_log.uniform_(-2, 2)
        layer.dt_bias.normal_(0, 1)
        layer.D.normal_(1, 0.5)
    print(f"fla's SSD kernel on this GPU: {choose_mamba2_kernel({}, cuda=True)}", flush=True)
    print(f"{'tokens':>8} {'docs':>5} {'fla out':>9} {'fla worst grad':>15} {'torch bf16 worst':>17} passed", flush=True)
    packed_forms = [form == "packed" for form in ("single", "packed") if form in args.forms.split(",")]
    rows = []
    for n in args.lengths.split(","):
        for packed in packed_forms:  # each row printed and written as it is measured: a stopped run keeps them
            r = dict(check(layer, int(n), packed), kernel=kernel)
            rows.append(r)
            fla, plain = r["fla_bf16"], r["torch_bf16"]
            print(f"{r['length']:>8} {r['documents']:>5} {fla['output']:>9.2e} {max(fla.values()):>15.2e} "
                  f"{max(plain.values()):>17.2e} {r['passed']}", flush=True)
            if args.json:
                with open(args.json, "w") as fh:
                    json.dump(rows, fh, indent=1)
    sys.exit(0 if all(r["passed"] for r in rows) else 1)


if __name__ == "__main__":
    main()
