"""Which SDPA backend does a causal GQA attention call reach, and how fast is each? (GPU only)

    python benchmarks/probe_attention.py --lengths 32768,131072 --json attention.json

For Qwen3-4B attention shapes (32 query heads, 8 KV heads, head_dim 128, bf16, batch 1), times forward +
backward of `scaled_dot_product_attention(is_causal=True)` for: the default dispatch with `enable_gqa`
(what transformers passes when there is no mask), the default dispatch with KV heads expanded, and each
backend forced (cuDNN, flash, memory-efficient), both ways. TFLOP/s counts 2·T²·H·D for the causal
forward and 2.5x that for backward (as shared/reference/attention-h200.jsonl does).
"""
import argparse
import json

import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BACKENDS = {"default": None, "sdpa_priority": "priority", "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def timed(fn, repeat=3):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def probe(length, heads=32, kv_heads=8, dim=128):
    rows = []
    q = torch.randn(1, heads, length, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, kv_heads, length, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, kv_heads, length, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(1, heads, length, dim, device="cuda", dtype=torch.bfloat16)
    flops = 2 * length**2 * heads * dim * (1 + 2.5)
    for name, backend in BACKENDS.items():
        for gqa in ("enable_gqa", "expanded"):
            def step():
                kk, vv = (k, v) if gqa == "enable_gqa" else (k.repeat_interleave(heads // kv_heads, 1),
                                                              v.repeat_interleave(heads // kv_heads, 1))
                kwargs = {"enable_gqa": True} if gqa == "enable_gqa" else {}
                out = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, **kwargs)
                out.backward(grad)
            try:
                if backend is None:
                    seconds = timed(step)
                elif backend == "priority":  # what ulysses_train.attention.sdpa_priority gives the model
                    from ulysses_train.attention import sdpa_priority
                    with sdpa_priority():
                        seconds = timed(step)
                else:
                    with sdpa_kernel([backend]):
                        seconds = timed(step)
                rows.append({"length": length, "backend": name, "gqa": gqa, "s": round(seconds, 4),
                             "tflops": round(flops / seconds / 1e12, 1)})
            except Exception as err:  # a backend that refuses these inputs
                rows.append({"length": length, "backend": name, "gqa": gqa, "error": str(err).split("\n")[0][:160]})
            q.grad = k.grad = v.grad = None
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="32768")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    rows = [r for length in args.lengths.split(",") for r in probe(int(length))]
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
