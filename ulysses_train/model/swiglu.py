"""SwiGLU MLPs, `down(silu(gate(x)) * up(x))`, as Liger's SiLU-and-multiply kernel on GPUs with liger-kernel.

Hugging Face's MLP runs the activation and the product as two torch ops: autograd then saves four
s x intermediate tensors per MLP (gate's and up's outputs, the activation's output, the product that down_proj
saves), and the backward makes two more (the gradients of the product's two factors). Liger's
`LigerSiLUMulFunction` computes the same `silu(gate).to(dtype) * up` in one kernel, saves only gate's and up's
outputs (it recomputes the activation in backward) and writes their gradients over them in place: three saved
tensors and one more in backward (the product's gradient). At Qwen3.5-9B's width (12,288) and 131,072 tokens
each such tensor is 3 GiB, and the untiled MLP's backward is the recomputed layer's peak (planner/layer.py).

Applied where `swiglu_kernel_runs` (CUDA and liger-kernel installed), to the classes of
architecture.SWIGLU_MLPS whose activation is SiLU, before TiledMLP (whose tiles then call it: tiling.py calls
the class the MLP had before its own swap). The LoRA-wrapped projections are called as they are. Without CUDA or
Liger, Hugging Face's forward runs; the CPU tests check the swap with a stand-in of Liger's signature."""
from __future__ import annotations

import importlib.util

import torch

from ulysses_train.model.architecture import SWIGLU_MLPS
from ulysses_train.model.swap import swap_class


def swiglu_kernel_runs() -> bool:
    """Whether SwiGLU MLPs run as Liger's kernel here (the planner's `swiglu_kernel`): CUDA and liger-kernel."""
    return torch.cuda.is_available() and importlib.util.find_spec("liger_kernel") is not None


def liger_silu_mul_function():
    """Liger's SiLU-and-multiply autograd function (a Triton kernel each way; imported on use: it needs a GPU)."""
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return LigerSiLUMulFunction


def liger_swiglu_forward(self, x: torch.Tensor) -> torch.Tensor:
    """`down(silu(gate(x)) * up(x))` with the activation and product in Liger's one kernel."""
    return self.down_proj(liger_silu_mul_function().apply(self.gate_proj(x), self.up_proj(x)))


def is_silu(activation) -> bool:
    """transformers' SiLU activation (`ACT2FN["silu"]`: torch's nn.SiLU, or its own SiLUActivation in 5.2x)."""
    return isinstance(activation, torch.nn.SiLU) or type(activation).__name__ == "SiLUActivation"


def replace_swiglu_mlps(model: torch.nn.Module) -> int:
    """Swap every SwiGLU MLP (architecture.SWIGLU_MLPS with a SiLU activation) for `Liger<MLP>` where the kernel
    runs; returns how many changed (0 without CUDA or liger-kernel). Must run before apply_tiled_mlp."""
    if not swiglu_kernel_runs():
        return 0
    swapped = 0
    for module in model.modules():
        if type(module).__name__ in SWIGLU_MLPS and is_silu(getattr(module, "act_fn", None)):
            swap_class(module, "Liger", forward=liger_swiglu_forward)
            swapped += 1
    return swapped
