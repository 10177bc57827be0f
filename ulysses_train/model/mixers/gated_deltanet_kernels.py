"""Which library computes each piece of a Gated DeltaNet layer on a GPU, and the pieces that are only a kernel call.

On CUDA with flash-linear-attention (`fla`) installed, linear_attention.py runs the depthwise conv
(`fla.modules.causal_conv1d`) and the gated delta rule (`fla.ops.gated_delta_rule.chunk_gated_delta_rule`) as
fla's kernels. fla 0.6 dispatches that rule to FlashQLA (package `flash-qla`: fused TileLang kernels, about twice
fla's Triton ones forward and backward on Hopper by its own benchmark) when it is installed and the call suits it
(head dims of 128, bf16, no inter-card context parallelism); `FLA_FLASH_QLA=0` turns that off. The output's gated
RMSNorm, which transformers computes as a chain of fp32 elementwise kernels (several fp32 copies of the whole
sequence of a rank's value heads, forward and backward), runs as fla's fused kernel (`rms_norm_gated`: one kernel
each way, saving the bf16 input, the gate and one fp32 scale per row). Its arithmetic differs from transformers'
by bf16 rounding only (it applies the weight before the single cast, as torch's fused RMSNorm does:
rmsnorm.py). With FlashQLA and the fused norm the layer passes benchmarks/fla_check.py's bf16 check against
transformers' torch functions on an H200 (benchmarks/RESULTS.md); the whole-model gradient check
(benchmarks/gpu_equality.py) has not yet been run with them.

`gated_deltanet_kernels` names what runs, for the trainer's `model changes:` line."""
from __future__ import annotations

import importlib.util
import os

import torch


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def fla_rms_norm_gated():
    """fla's fused gated RMSNorm function (fla 0.6 keeps it under modules/norm, earlier releases one level up)."""
    try:
        from fla.modules.norm.fused_norm_gate import rms_norm_gated
    except ImportError:
        from fla.modules.fused_norm_gate import rms_norm_gated
    return rms_norm_gated


def fused_gated_norm_forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The gated RMSNorm of a Gated DeltaNet's output (`w * norm(x) * silu(gate)`: Qwen3.5, Qwen3-Next, OLMo-hybrid)
    as fla's fused kernel. A method of the norm module (swapped in by `use_fused_gated_norm`), so ZeRO-3 gathers its
    weight around the call as before."""
    return fla_rms_norm_gated()(hidden_states, gate, self.weight, None, activation=self.activation,
                                eps=self.variance_epsilon)


def flash_qla_choice(head_k_dim: int, head_v_dim: int) -> tuple[bool, str]:
    """(whether fla will hand this model's gated delta rule to FlashQLA, why not), asked of fla's own FlashQLA
    backend (its availability, FLA_FLASH_QLA and its verifier on a tiny call of this model's head dims)."""
    if not installed("flash_qla"):
        return False, "flash-qla not installed"
    try:
        from fla.ops.gated_delta_rule.backends.flash_qla import FlashQLABackend
    except ImportError:
        return False, "this fla release has no FlashQLA backend (fla-core >= 0.6 has)"
    backend = FlashQLABackend()
    if not backend.is_enabled():
        return False, f"{backend.env_var}={os.environ.get(backend.env_var)}"
    device, dtype = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    q = torch.zeros(1, 64, 1, head_k_dim, device=device, dtype=dtype)
    v = torch.zeros(1, 64, 1, head_v_dim, device=device, dtype=dtype)
    gate = torch.zeros(1, 64, 1, device=device, dtype=torch.float32)
    accepted, reason = backend.chunk_gated_delta_rule_verifier(q, q, v, gate, gate.to(dtype),
                                                               use_qk_l2norm_in_kernel=True)
    return accepted, reason or ""


def flash_qla_runs(head_k_dim: int, head_v_dim: int) -> bool:
    """Whether a GPU run here computes the rule with FlashQLA (the planner's `flash_qla`): CUDA, fla and
    flash_qla_choice."""
    return torch.cuda.is_available() and installed("fla") and flash_qla_choice(head_k_dim, head_v_dim)[0]


def gated_deltanet_kernels(layer, cuda_with_fla: bool) -> str:
    """What computes the layer's conv, rule and gated norm here, in words for the `model changes:` line."""
    if not cuda_with_fla:
        return "transformers' torch conv1d, chunked gated delta rule and gated RMSNorm"
    qla, why_not = flash_qla_choice(layer.head_k_dim, layer.head_v_dim)
    rule = "FlashQLA's gated delta rule (through fla)" if qla else f"fla's gated delta rule ({why_not})"
    return f"fla's causal conv1d, {rule}, fla's fused gated RMSNorm"
