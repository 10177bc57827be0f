"""Which SDPA backend does a causal GQA attention call reach, and how fast is each? (GPU only)

    python benchmarks/probe_attention.py --lengths 32768,131072 --json attention.json

For Qwen3-4B attention shapes (32 query heads, 8 KV heads, head_dim 128, bf16, batch 1; `--heads` another), times forward +
backward of `scaled_dot_product_attention(is_causal=True)` for: the default dispatch with `enable_gqa`
(what transformers passes when there is no mask), the default dispatch with KV heads expanded, and each
backend forced (cuDNN, flash, memory-efficient), both ways. With `--fa4`, also FlashAttention 4's CuTe
kernels (`flash_attn.cute.flash_attn_func`, package flash-attn-4, which has a Hopper path), and an accuracy
row per kernel: output and gradient errors against fp32 math attention at `--accuracy-length` tokens. TFLOP/s counts 2·T²·H·D for the causal
forward and 2.5x that for backward (as benchmarks/results/attention_sdpa_h200.jsonl does).
"""
import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

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


def probe(length, heads=32, kv_heads=8, dim=128, backends=tuple(BACKENDS)):
    rows = []
    q = torch.randn(1, heads, length, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, kv_heads, length, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, kv_heads, length, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(1, heads, length, dim, device="cuda", dtype=torch.bfloat16)
    flops = 2 * length**2 * heads * dim * (1 + 2.5)
    for name, backend in BACKENDS.items():
        if name not in backends:
            continue
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
                elif backend == "priority":  # what ulysses_train.model.attention.sdpa_priority gives the model
                    from ulysses_train.model.attention import sdpa_priority
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


def fa4_rows(length, heads=32, kv_heads=8, dim=128):
    """FlashAttention 4 (CuTe DSL) forward + backward, (batch, tokens, heads, dim) layout, GQA native."""
    from flash_attn.cute import flash_attn_func

    q = torch.randn(1, length, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, length, kv_heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, length, kv_heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(1, length, heads, dim, device="cuda", dtype=torch.bfloat16)
    flops = 2 * length**2 * heads * dim * (1 + 2.5)

    def step():
        out = flash_attn_func(q, k, v, causal=True)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(grad)

    def forward():
        with torch.no_grad():
            flash_attn_func(q, k, v, causal=True)

    try:
        seconds, fwd_seconds = timed(step), timed(forward)
        row = {"length": length, "backend": "fa4_cute", "gqa": "native", "s": round(seconds, 4),
               "tflops": round(flops / seconds / 1e12, 1), "fwd_tflops": round(flops / 3.5 / fwd_seconds / 1e12, 1)}
    except Exception as err:
        row = {"length": length, "backend": "fa4_cute", "gqa": "native", "error": f"{type(err).__name__}: {err}"[:300]}
    print(json.dumps(row), flush=True)
    return [row]


def accuracy_rows(length, heads=32, kv_heads=8, dim=128, fa4=True):
    """Each kernel's bf16 output and gradients against fp32 math attention on the same inputs (max |error|
    over max |reference|), so a faster kernel is also shown to compute the same thing."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, g = (torch.randn(1, n, length, dim, device="cuda", generator=gen) for n in (heads, kv_heads, kv_heads, heads))

    def grads(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(g.to(dtype))
        return [t.float() for t in (out, *(leaf.grad for leaf in leaves))]

    def sdpa(qq, kk, vv):
        return F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)

    with sdpa_kernel([SDPBackend.MATH]):
        reference = grads(sdpa, torch.float32)
    kernels = {"cudnn": lambda *t: _with_backend(SDPBackend.CUDNN_ATTENTION, sdpa, *t),
               "flash": lambda *t: _with_backend(SDPBackend.FLASH_ATTENTION, sdpa, *t)}
    if fa4:
        from flash_attn.cute import flash_attn_func

        def fa4_call(qq, kk, vv):  # SDPA layout (batch, heads, tokens, dim) in and out; FA4 takes tokens first
            out = flash_attn_func(qq.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2), causal=True)
            return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)
        kernels["fa4_cute"] = fa4_call
    rows = []
    for name, fn in kernels.items():
        try:
            got = grads(fn, torch.bfloat16)
            errors = {what: float((a - b).abs().max() / b.abs().max())
                      for what, a, b in zip(("out", "dq", "dk", "dv"), got, reference)}
            rows.append({"length": length, "backend": name, "accuracy": {w: round(e, 5) for w, e in errors.items()}})
        except Exception as err:
            rows.append({"length": length, "backend": name, "error": f"{type(err).__name__}: {err}"[:300]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _with_backend(backend, fn, *args):
    with sdpa_kernel([backend]):
        return fn(*args)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="32768")
    ap.add_argument("--json", default="")
    ap.add_argument("--fa4", action="store_true", help="also FlashAttention 4's CuTe kernels (package flash-attn-4)")
    ap.add_argument("--backends", default=",".join(BACKENDS), help="SDPA rows to time (empty: none)")
    ap.add_argument("--accuracy-length", type=int, default=0, help="tokens for the accuracy rows (0: none)")
    ap.add_argument("--heads", default="32,8,128",
                    help="query heads, KV heads, head dim (default Qwen3-4B's; Qwen3.5-9B's attention: 16,4,256)")
    args = ap.parse_args()
    shape = tuple(int(n) for n in args.heads.split(","))
    rows = []
    if args.accuracy_length:
        rows += accuracy_rows(args.accuracy_length, *shape, fa4=args.fa4)
    backends = [name for name in args.backends.split(",") if name]
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown:
        ap.error(f"unknown --backends {unknown}; choose from {sorted(BACKENDS)}")
    for length in args.lengths.split(","):
        rows += probe(int(length), *shape, backends=backends)
        if args.fa4:
            rows += fa4_rows(int(length), *shape)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "heads": shape, "rows": rows},
                      fh, indent=1)


if __name__ == "__main__":
    main()
