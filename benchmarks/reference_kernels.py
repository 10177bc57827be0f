"""The kernels gpu_equality.py's references and fp32 check run: torch's own where a fast kernel would round.

`torch_linear_attention`: the exact answer's Gated DeltaNet layers on transformers' torch functions.

`use_reference_kernel`: FlashAttention 4's two ops on their plain fp32 reference kernel on the GPU. Why:
FlashAttention 4 takes bf16 and fp16 only, and a family with sliding-window layers (Gemma 4) needs a kernel that
takes the window under Ulysses: SDPA is refused there, since DeepSpeed drops transformers' masks. The reference
kernel (ulysses_train/model/fa4.py's CPU implementation: scores, the causal and window masks, softmax, and the
hand-written backward from the log-sum-exp, all in fp32) is plain torch, so it runs on CUDA tensors as well. With
it the fp32 check (exact answer in fp64, plain model in fp32) covers everything around the kernel at a family's
real widths on the GPU: the exchange, per-layer heads, K = V, the soft-capped chunked loss, TiledMLP, offloaded
activations. It is informative where a bf16 check at random init is not (Gemma 4: the plain bf16 model alone is
121-136% off fp32).

The reference holds tokens x tokens fp32 scores per head: 4,096 tokens keep Gemma-4-31B's 32 heads to 2 GiB.
flash-attn-4 need not be installed: the trainer's "fa4 needs FlashAttention 4" check is told it is.

`drop_window=True` is the negative control: the kernel ignores sliding windows, as SDPA under Ulysses would
(every layer attends to the whole past). The check must fail then.
"""
from __future__ import annotations

import contextlib
import inspect
import sys


def use_reference_kernel(drop_window: bool = False) -> None:
    """Register fa4.py's reference forward and backward as the ops' CUDA kernels (this process only)."""
    from ulysses_train.model import fa4
    from ulysses_train.training import step

    def forward(q, k, v, softmax_scale, causal, cu_seqlens, max_seqlen, window_left=-1, sinks=None):
        window_left = -1 if drop_window else window_left
        return fa4._fa4_forward_cpu(q, k, v, softmax_scale, causal, cu_seqlens, max_seqlen, window_left, sinks)

    def backward(grad_out, q, k, v, out, lse, softmax_scale, causal, cu_seqlens, max_seqlen, window_left=-1,
                 sinks=None):
        window_left = -1 if drop_window else window_left
        return fa4._fa4_backward_cpu(grad_out, q, k, v, out, lse, softmax_scale, causal, cu_seqlens, max_seqlen,
                                     window_left, sinks)

    for device in ("cuda", "cpu"):  # on CPU the reference is the kernel already: only the control changes it
        fa4.fa4_forward.register_kernel(device)(forward)
        fa4.fa4_backward.register_kernel(device)(backward)
    fa4.fa4_importable = lambda: True  # loading.attention_implementation's check reads it at call time
    step.import_kernel_modules = lambda kernels: None  # nor are FlashAttention 4's modules imported before the step


@contextlib.contextmanager
def torch_linear_attention(model, enabled: bool):
    """While the exact reference (fp32, or fp64) runs: its Gated DeltaNet layers on transformers' own torch functions. With fla
    installed the plain model takes fla's Triton kernels, whose fp32 matmuls may round to TF32, and the exact
    answer must not. transformers 5.17 and 5.24 both call the module-level `causal_conv1d_fn` and
    `torch_chunk_gated_delta_rule` (fla's behind a hub-kernel wrapper); they are set to their unwrapped torch
    bodies and restored after, so the bf16 plain model keeps fla's kernels: the GPU user's plain model."""
    from ulysses_train.model.mixers.gated_deltanet import gated_deltanets

    modules = {sys.modules[type(layer).__module__] for layer in gated_deltanets(model)} if enabled else set()
    names = ("causal_conv1d_fn", "torch_chunk_gated_delta_rule")
    kept = {(m, n): getattr(m, n) for m in modules for n in names}
    for (module, name), fn in kept.items():
        setattr(module, name, inspect.unwrap(fn))
    try:
        yield
    finally:
        for (module, name), fn in kept.items():
            setattr(module, name, fn)


if __name__ == "__main__":  # a module of gpu_equality.py; --help says what it holds
    import argparse

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog="Imported by benchmarks/gpu_equality.py (--reference-kernel, --control-window, "
                                   "--dtype float32); nothing to run by itself.").parse_args()
