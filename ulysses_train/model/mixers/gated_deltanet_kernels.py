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

GATED_DELTANET_VARIANTS names what runs, for the trainer's `model changes:` line; choose_gated_deltanet_kernel
picks one per run."""
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


GATED_DELTANET_VARIANTS = {
    "torch": "transformers' torch conv1d, chunked gated delta rule and gated RMSNorm",
    "fla": "fla's causal conv1d, fla's gated delta rule, fla's fused gated RMSNorm",
    "flash_qla": "fla's causal conv1d, FlashQLA's gated delta rule (through fla), fla's fused gated RMSNorm",
}
"""The Gated DeltaNet's kernel variants (Mixer.kernel_variants), in words for the `model changes:` line. fla picks
FlashQLA inside its own call; "flash_qla" is what its backend's verifier answers for the model's head widths."""


def choose_gated_deltanet_kernel(dims: dict, cuda: bool) -> str:
    """The variant a run computes with (Mixer.choose_kernel): torch off CUDA or without fla; flash_qla where fla will
    hand the rule to FlashQLA for these head widths (flash_qla_choice); fla otherwise."""
    from ulysses_train.model.mixers.recurrent import fla_available, fla_or_torch

    variant = fla_or_torch(cuda, fla_available(), "fla")
    if variant == "fla" and flash_qla_choice(dims["key head dim"], dims["value head dim"])[0]:
        return "flash_qla"
    return variant
