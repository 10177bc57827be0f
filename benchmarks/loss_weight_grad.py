"""The chunked loss's lm_head-gradient accumulation: plain `+=` against one fused fp32-output GEMM.

    python benchmarks/loss_weight_grad.py --rows 131072 --json OUT/loss_weight_grad.json

A profile of a 128K step of Qwen3-4B shapes on an H200 showed 0.72 s in one mixed-dtype add kernel: the
`grad_weight (fp32) += grad_logits.T @ h (bf16)` of every 256-row chunk (loss.py). This times the whole
chunked loss (forward, which also forms both gradients) with each form of that accumulation, and checks
both gradients against an fp32 computation of the same chunks (relative error of the weight gradient and
the hidden-state gradient). On a machine without the fused GEMM (CPU) only the plain form runs; that is
how the script is tested.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from ulysses_train.constants import LOSS_CHUNK_ROWS
from ulysses_train.model import loss as loss_module


def synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_loss(hidden, weight, labels, chunk_rows):
    h = hidden.detach().requires_grad_(True)
    w = weight.detach().requires_grad_(True)
    total = loss_module.chunked_nll_sum(h, w, labels, chunk_rows)
    total.backward()
    return total.detach(), h.grad, w.grad


def rel_err(got, ref):
    return float((got.double() - ref.double()).norm() / ref.double().norm())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=131072)
    ap.add_argument("--hidden", type=int, default=2560)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--chunk-rows", type=int, default=LOSS_CHUNK_ROWS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16
    gen = torch.Generator(device="cpu").manual_seed(0)
    hidden = (torch.randn(args.rows, args.hidden, generator=gen) * 0.5).to(device, dtype)
    weight = (torch.randn(args.vocab, args.hidden, generator=gen) * 0.02).to(device, dtype)
    labels = torch.randint(0, args.vocab, (args.rows,), generator=gen).to(device)

    torch.backends.cuda.matmul.allow_tf32 = False
    _, ref_h, ref_w = run_loss(hidden.float(), weight.float(), labels, args.chunk_rows)  # fp32 reference
    ref_h, ref_w = ref_h.cpu(), ref_w.cpu()
    fused = loss_module.fused_fp32_gemm_available(device)
    key = (device.type, device.index)
    rows = []
    for form in (["plain", "fused"] if fused else ["plain"]):
        loss_module._FUSED_GEMM_PROBED[key] = form == "fused"
        times = []
        for _ in range(args.repeats + 1):
            synchronize()
            started = time.perf_counter()
            total, grad_h, grad_w = run_loss(hidden, weight, labels, args.chunk_rows)
            synchronize()
            times.append(time.perf_counter() - started)
        rows.append({"form": form, "seconds": round(statistics.median(times[1:]), 4),
                     "weight_grad_rel_err": rel_err(grad_w.cpu(), ref_w),
                     "hidden_grad_rel_err": rel_err(grad_h.cpu(), ref_h), "loss": float(total)})
    loss_module._FUSED_GEMM_PROBED.pop(key, None)
    for r in rows:
        print(f"{r['form']:6} {r['seconds']:8.4f} s   weight grad rel err {r['weight_grad_rel_err']:.2e}   "
              f"hidden grad rel err {r['hidden_grad_rel_err']:.2e}   loss {r['loss']:.4f}")
    if not fused:
        print(f"fused fp32-output GEMM not available on {device.type}: only the plain form ran")
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "rows": args.rows, "hidden": args.hidden, "vocab": args.vocab, "chunk_rows": args.chunk_rows,
              "fused_available": fused, "forms": rows}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
