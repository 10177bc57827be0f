"""The chunked loss alone, against the two usual ways: time, peak memory, gradient error, lm_head products.

    python benchmarks/loss_forms.py --rows 16384,131072 --json OUT/loss_forms.json

The cross-entropy of `rows` hidden states under an lm_head (Qwen3-4B's 151,936 x 2,560 by default), with
the gradients of both, three ways:

- `full_logits`: `hidden @ weight.T` for all rows at once, upcast to fp32, `F.cross_entropy` (what a
  Hugging Face model does with `labels=`): rows x vocab logits in bf16, their fp32 copy and its gradient.
- `checkpoint_per_chunk`: the plain-library recipe `chunked` of benchmarks/results/plain_hf_baseline_h200.jsonl:
  chunks of `--chunk-rows` rows (that recipe used 256), each under `torch.utils.checkpoint`, so a chunk's logits
  are formed in forward, dropped, and formed again in backward (four lm_head products per chunk); autograd sums
  the weight's gradient over chunks in the weight's dtype.
- `fused`: ulysses_train/model/loss.py's FusedChunkedCrossEntropy: each chunk's logits turned into both
  gradients in the same pass (three lm_head products per chunk), the weight gradient summed in fp32.

Per form: median seconds of forward + backward over --repeats runs (after one warm-up), peak memory
above the inputs (CUDA), the count of matrix products that involve the vocabulary (counted by a dispatch
mode on one run), and the relative error of the loss and both gradients against `checkpoint_per_chunk`
computed in fp32 (plain autograd, an independent code path; fp32 logits of one chunk at a time, so it
also fits at 128K). A form that runs out of memory is a row with status OOM.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from ulysses_train.constants import LOSS_CHUNK_ROWS
from ulysses_train.model.loss import chunked_nll_sum, full_logits_nll_sum

FORMS = ("fused", "checkpoint_per_chunk", "full_logits")  # the one likeliest to run out of memory last
MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm}  # every overload (out=, out_dtype=)


class VocabProductCounter(TorchDispatchMode):
    """Counts matrix products with an operand or result that has a dimension of the vocabulary's size."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.count = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in MATMULS:
            tensors = [a for a in (*args, *(kwargs or {}).values(), out) if isinstance(a, torch.Tensor)]
            self.count += any(self.vocab in t.shape for t in tensors)
        return out


def loss_and_grads(form: str, hidden, weight, labels, chunk_rows: int):
    """Forward and backward of one form; returns the loss and the gradients of hidden and weight."""
    h = hidden.detach().requires_grad_(True)
    w = weight.detach().requires_grad_(True)
    if form == "full_logits":
        total = full_logits_nll_sum(h @ w.t(), labels)
    elif form == "checkpoint_per_chunk":
        def chunk_nll(h_chunk, w_, y_chunk):
            return full_logits_nll_sum(h_chunk @ w_.t(), y_chunk)
        total = sum(checkpoint(chunk_nll, h[s:s + chunk_rows], w, labels[s:s + chunk_rows], use_reentrant=False)
                    for s in range(0, h.shape[0], chunk_rows))
    elif form == "fused":
        total = chunked_nll_sum(h, w, labels, chunk_rows)
    else:
        raise ValueError(f"unknown form {form!r}; choose from {', '.join(FORMS)}")
    total.backward()
    return total.detach(), h.grad, w.grad


def rel_err(got, ref) -> float:
    return float((got.double() - ref.double()).norm() / ref.double().norm())


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_runs(form: str, hidden, weight, labels, chunk_rows: int, repeats: int, counter) -> dict | None:
    """One counted warm-up run, `repeats` timed ones and a last one for the errors; None if out of memory."""
    device = hidden.device
    try:
        with counter:
            loss_and_grads(form, hidden, weight, labels, chunk_rows)
        times, peaks = [], []
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            synchronize(device)
            started = time.perf_counter()
            loss_and_grads(form, hidden, weight, labels, chunk_rows)
            synchronize(device)
            times.append(time.perf_counter() - started)
            if device.type == "cuda":
                peaks.append((torch.cuda.max_memory_allocated(device) - base) / 2**30)
        total, grad_h, grad_w = loss_and_grads(form, hidden, weight, labels, chunk_rows)
        return {"times": times, "peaks": peaks, "total": total, "grad_h": grad_h.cpu(), "grad_w": grad_w.cpu()}
    except torch.OutOfMemoryError:
        return None


def measure(form: str, hidden, weight, labels, chunk_rows: int, repeats: int, reference) -> dict:
    counter = VocabProductCounter(weight.shape[0])
    runs = timed_runs(form, hidden, weight, labels, chunk_rows, repeats, counter)
    if runs is None:  # the failed run's tensors are released once timed_runs has returned
        gc.collect()
        torch.cuda.empty_cache()
        return {"form": form, "status": "OOM", "lm_head_products": counter.count or None}
    ref_total, ref_h, ref_w = reference
    return {"form": form, "status": "ok", "seconds": round(statistics.median(runs["times"]), 4),
            "peak_gib_above_inputs": round(max(runs["peaks"]), 2) if runs["peaks"] else None,
            "lm_head_products": counter.count,
            "loss_rel_err": abs(float(runs["total"]) - float(ref_total)) / abs(float(ref_total)),
            "hidden_grad_rel_err": rel_err(runs["grad_h"], ref_h),
            "weight_grad_rel_err": rel_err(runs["grad_w"], ref_w)}


def run_length(rows: int, args, device, dtype) -> list[dict]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    hidden = (torch.randn(rows, args.hidden, generator=gen) * 0.5).to(device, dtype)
    weight = (torch.randn(args.vocab, args.hidden, generator=gen) * 0.02).to(device, dtype)
    labels = torch.randint(0, args.vocab, (rows,), generator=gen)
    labels[: rows // 8] = -100  # some rows without a label, as a prompt has
    labels = labels.to(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    ref_total, ref_h, ref_w = loss_and_grads("checkpoint_per_chunk", hidden.float(), weight.float(), labels,
                                             args.chunk_rows)
    reference = (ref_total, ref_h.cpu(), ref_w.cpu())
    del ref_h, ref_w
    out = []
    for form in args.forms.split(","):
        row = {"rows": rows, **measure(form, hidden, weight, labels, args.chunk_rows, args.repeats, reference)}
        out.append(row)
        print(format_row(row), flush=True)
    return out


def format_row(r: dict) -> str:
    if r["status"] != "ok":
        return f"{r['rows']:>8} {r['form']:21} {r['status']}"
    peak = f"{r['peak_gib_above_inputs']:8.2f}" if r["peak_gib_above_inputs"] is not None else "       -"
    return (f"{r['rows']:>8} {r['form']:21} {r['seconds']:8.3f} {peak} {r['lm_head_products']:>9} "
            f"{r['loss_rel_err']:9.1e} {r['hidden_grad_rel_err']:9.1e} {r['weight_grad_rel_err']:9.1e}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="131072", help="comma-separated row counts (tokens)")
    ap.add_argument("--hidden", type=int, default=2560)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--chunk-rows", type=int, default=LOSS_CHUNK_ROWS)
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    for form in args.forms.split(","):
        if form not in FORMS:
            ap.error(f"unknown form {form!r}; choose from {', '.join(FORMS)}")

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    print(f"{'rows':>8} {'form':21} {'seconds':>8} {'peak GiB':>8} {'lm_head x':>9} {'loss err':>9} "
          f"{'dh err':>9} {'dW err':>9}")
    rows = [r for n in args.rows.split(",") for r in run_length(int(n), args, device, dtype)]
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "dtype": args.dtype, "hidden": args.hidden, "vocab": args.vocab, "chunk_rows": args.chunk_rows,
              "repeats": args.repeats, "results": rows}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
