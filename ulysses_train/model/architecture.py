"""What the package knows about each model architecture, in one place.

Adding a family means adding it here (and a test through the same exactness checks as the dense core).
"""
from __future__ import annotations

SUPPORTED_EXAMPLES = "e.g. Qwen3, Qwen3-MoE, Llama"
"""How messages name what is supported: decoder-only causal LMs built into transformers whose layers are all
full causal attention and whose logits are plain `hidden @ lm_head.T`."""

LLAMA_STYLE_RMSNORMS = ("Qwen3RMSNorm", "Qwen2RMSNorm", "LlamaRMSNorm", "MistralRMSNorm", "Qwen3MoeRMSNorm")
"""Norm classes computing `w * (x.float() * rsqrt(mean(x^2) + eps)).to(dtype)`, which the RMSNorm kernels
(rmsnorm.py) replace exactly. Others (e.g. Gemma's, which scales by 1 + w) are left as they are."""

DENSE_MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
"""The projections of a dense `down(act(gate(x)) * up(x))` MLP, the form TiledMLP tiles (tiling.py)."""


def text_config(hf_config):
    """The decoder's config: multimodal configs nest it (`get_text_config`), text-only ones are it."""
    return hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
