"""Which kernel runs causal attention at the head widths the 2026 families bring, and how fast, forward and backward?
(GPU only.)

    python benchmarks/head_dim_kernels.py --lengths 16384,65536 --json head_dims.json [--fa4]

Cases are one rank's heads after the Ulysses exchange at sp=8 (the whole sequence, heads/8):
- `gemma4-global`: Gemma-4-31B's global layers, 32 query heads of 512 (4 per rank) over 4 KV heads (one per rank,
  repeated in place), keys equal to values;
- `gemma4-sliding`: its sliding layers, 256 wide, 16 KV heads (2 per rank), without the window (an upper bound);
- `mla`: DeepSeek-V3's MLA, 128 heads (16 per rank), q/k 192 wide and v 128.

Kernels: SDPA forced to each backend (cuDNN, flash, memory-efficient), FlexAttention (torch.compile'd, causal block
mask) and with `--fa4` FlashAttention 4 (package flash-attn-4: on Hopper it takes head widths up to 256). Each row
has the forward's and the backward's TFLOP/s (a causal forward counts T² x heads x (q/k width + v width) FLOPs, the
backward 2.5 times that; backward time is forward + backward less forward), or the kernel's refusal. Accuracy rows
(`--accuracy-length`) compare each kernel's bf16 output and gradients with fp32 math attention: the kernel must be
exact to bf16, not only fast. Prints a table; writes JSON.
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_attention import timed  # noqa: E402  (one timing rule for both attention probes: median of 3 after a warm-up)

CASES = {"gemma4-global": (4, 1, 512, 512), "gemma4-sliding": (4, 2, 256, 256), "mla": (16, 16, 192, 128)}
"""case -> (query heads, KV heads, q/k width, v width) on one rank at sp=8."""
SDPA_BACKENDS = {"sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa-flash": SDPBackend.FLASH_ATTENTION,
                 "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION}


def sdpa_kernel_of(backend):
    """(q, k, v) in (batch, heads, tokens, width) -> output, through one SDPA backend (KV heads expanded: the
    memory-efficient and cuDNN backends take no GQA at these widths)."""
    def run(q, k, v):
        groups = q.shape[1] // k.shape[1]
        k, v = (x.repeat_interleave(groups, 1) if groups > 1 else x for x in (k, v))
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return run


def flex_kernel():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    masks = {}

    def run(q, k, v):
        tokens = q.shape[2]
        if tokens not in masks:
            masks[tokens] = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, tokens, tokens)
        return compiled(q, k, v, block_mask=masks[tokens], enable_gqa=q.shape[1] != k.shape[1])
    return run


def fa4_kernel():
    from flash_attn.cute import flash_attn_func

    def run(q, k, v):  # FA4 takes (batch, tokens, heads, width)
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)
    return run


def kernels(fa4: bool) -> dict:
    found = {name: sdpa_kernel_of(backend) for name, backend in SDPA_BACKENDS.items()}
    found["flex"] = flex_kernel()
    if fa4:
        found["fa4"] = fa4_kernel()
    return found


def inputs(case: str, tokens: int, dtype=torch.bfloat16, seed: int = 0):
    heads, kv_heads, width, v_width = CASES[case]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = ((heads, width), (kv_heads, width), (kv_heads, v_width), (heads, v_width))
    return [torch.randn(1, n, tokens, d, device="cuda", generator=gen).to(dtype) for n, d in shapes]


def speed_row(case: str, tokens: int, name: str, kernel) -> dict:
    heads, _, width, v_width = CASES[case]
    q, k, v, grad = inputs(case, tokens)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    forward_flops = tokens**2 * heads * (width + v_width)
    row = {"case": case, "tokens": tokens, "kernel": name}
    try:
        with torch.no_grad():
            forward = timed(lambda: kernel(q, k, v))
        both = timed(lambda: kernel(q, k, v).backward(grad))
        row.update(fwd_ms=round(forward * 1e3, 2), bwd_ms=round((both - forward) * 1e3, 2),
                   fwd_tflops=round(forward_flops / forward / 1e12, 1),
                   bwd_tflops=round(2.5 * forward_flops / (both - forward) / 1e12, 1))
    except Exception as err:  # a kernel that refuses these widths
        row["error"] = f"{type(err).__name__}: {err}".split("\n")[0][:200]
    torch.cuda.empty_cache()
    return row


def accuracy_row(case: str, tokens: int, name: str, kernel) -> dict:
    """max |kernel - fp32 math| / max |fp32 math| of the output and of each gradient."""
    def grads(fn, dtype):
        q, k, v, grad = inputs(case, tokens, dtype)
        leaves = [x.requires_grad_() for x in (q, k, v)]
        out = fn(*leaves)
        out.backward(grad)
        return [x.float() for x in (out, *(leaf.grad for leaf in leaves))]

    reference = grads(sdpa_kernel_of(SDPBackend.MATH), torch.float32)
    row = {"case": case, "tokens": tokens, "kernel": name}
    try:
        got = grads(kernel, torch.bfloat16)
        row["errors"] = {what: round(float((a - b).abs().max() / b.abs().max()), 5)
                         for what, a, b in zip(("out", "dq", "dk", "dv"), got, reference)}
    except Exception as err:
        row["error"] = f"{type(err).__name__}: {err}".split("\n")[0][:200]
    return row


def print_table(rows: list) -> None:
    print(f"{'case':<15} {'tokens':>7} {'kernel':<15} {'fwd ms':>8} {'bwd ms':>8} {'fwd TF/s':>9} {'bwd TF/s':>9}")
    for r in rows:
        if "fwd_ms" in r:
            print(f"{r['case']:<15} {r['tokens']:>7} {r['kernel']:<15} {r['fwd_ms']:>8} {r['bwd_ms']:>8} "
                  f"{r['fwd_tflops']:>9} {r['bwd_tflops']:>9}")
        elif "errors" in r:
            print(f"{r['case']:<15} {r['tokens']:>7} {r['kernel']:<15} errors vs fp32: {r['errors']}")
        else:
            print(f"{r['case']:<15} {r['tokens']:>7} {r['kernel']:<15} refused: {r['error'][:90]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="16384,65536")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--accuracy-length", type=int, default=4096, help="tokens of the accuracy rows (0: none)")
    ap.add_argument("--fa4", action="store_true", help="also FlashAttention 4 (package flash-attn-4)")
    ap.add_argument("--kernels", default="", help="only these kernels, comma-separated (default: all found)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    found, rows = kernels(args.fa4), []
    if args.kernels:
        found = {name: kernel for name, kernel in found.items() if name in args.kernels.split(",")}
    for case in args.cases.split(","):
        for name, kernel in found.items():
            if args.accuracy_length:
                rows.append(accuracy_row(case, args.accuracy_length, name, kernel))
                print(json.dumps(rows[-1]), flush=True)
            for tokens in (int(n) for n in args.lengths.split(",")):
                rows.append(speed_row(case, tokens, name, kernel))
                print(json.dumps(rows[-1]), flush=True)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "cases": CASES,
                       "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
