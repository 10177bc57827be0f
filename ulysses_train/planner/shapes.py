"""The numbers of a model the planner needs (`ModelShape`), read from its config, never from its weights."""
from __future__ import annotations

import os
from dataclasses import dataclass

from ulysses_train.model.architecture import text_config
from ulysses_train.planner.options import PlanError


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only model the planner needs; read from a config, never from weights."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    layer_params: int
    """Parameters of one decoder layer (projections, MLP, norms)."""
    total_params: int
    """All parameters, counting a tied embedding / lm_head once."""

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def lm_head_params(self) -> int:
        """The output projection (vocab x hidden); the same matrix as the embedding when tied."""
        return self.vocab * self.hidden

    @property
    def matmul_params(self) -> int:
        """Parameters used in one multiply-add per token: every layer plus the lm_head product (the
        embedding is a lookup). This is the N of 6*N*T."""
        return self.layers * self.layer_params + self.lm_head_params

    @classmethod
    def from_hf_config(cls, hf_config, name: str = "") -> "ModelShape":
        text = text_config(hf_config)
        if getattr(text, "num_experts", 0) or getattr(text, "num_local_experts", 0):
            raise NotImplementedError(f"{text.model_type}: mixture-of-experts layers are not modelled by the planner.")
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        layer_params, total_params = count_parameters(text)
        return cls(name=name or getattr(hf_config, "name_or_path", "") or text.model_type,
                   hidden=text.hidden_size, intermediate=text.intermediate_size,
                   layers=text.num_hidden_layers, heads=heads,
                   kv_heads=getattr(text, "num_key_value_heads", None) or heads, head_dim=head_dim,
                   vocab=text.vocab_size, tied=bool(getattr(text, "tie_word_embeddings", False)),
                   layer_params=layer_params, total_params=total_params)


def count_parameters(text_config) -> tuple[int, int]:
    """(parameters of one decoder layer, all parameters).

    Llama-family layouts (Llama, Mistral, Qwen2, Qwen3) by formula, which is instant; anything else by
    building the model on the meta device (exact for any architecture, no memory, a few seconds)."""
    c = text_config
    h, i, v = c.hidden_size, c.intermediate_size, c.vocab_size
    d = getattr(c, "head_dim", None) or h // c.num_attention_heads
    q, kv = c.num_attention_heads * d, (getattr(c, "num_key_value_heads", None) or c.num_attention_heads) * d
    if c.model_type in ("llama", "mistral", "qwen2", "qwen3"):
        attn = h * q + 2 * h * kv + q * h
        if c.model_type == "qwen2":
            attn += q + 2 * kv  # q/k/v biases, no o_proj bias
        elif getattr(c, "attention_bias", False):
            attn += q + 2 * kv + h
        mlp = 3 * h * i + ((2 * i + h) if getattr(c, "mlp_bias", False) else 0)
        norms = 2 * h + (2 * d if c.model_type == "qwen3" else 0)  # Qwen3 adds RMSNorm on q and k heads
        layer = attn + mlp + norms
        tied = bool(getattr(c, "tie_word_embeddings", False))
        return layer, c.num_hidden_layers * layer + v * h * (1 if tied else 2) + h
    return _count_parameters_on_meta(c)


def _count_parameters_on_meta(text_config) -> tuple[int, int]:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(text_config)
    layers = model.get_decoder().layers
    return sum(p.numel() for p in layers[0].parameters()), sum(p.numel() for p in model.parameters())


def load_model_shape(model) -> ModelShape:
    """A ModelShape from: a ModelShape; a transformers config; one of our local names ("qwen3-8b"); a local
    folder or config.json path; or a hub name (read with AutoConfig, which needs the network)."""
    if isinstance(model, ModelShape):
        return model
    if not isinstance(model, str):
        return ModelShape.from_hf_config(model)
    from types import SimpleNamespace

    from ulysses_train.model.presets import known_name, qwen3_config_kwargs

    if known_name(model):  # the same fields Qwen3Config gets, read without importing transformers
        fields = SimpleNamespace(model_type="qwen3", **qwen3_config_kwargs(model))
        return ModelShape.from_hf_config(fields, name=known_name(model))
    from transformers import AutoConfig

    path = os.path.dirname(model) if model.endswith(".json") and os.path.isfile(model) else model
    if model.startswith((".", "/", "~")) and not os.path.exists(os.path.expanduser(path)):
        raise PlanError(f"{model!r}: no such file or folder. Give a local folder with config.json or one of "
                        f"qwen3-0.6b, qwen3-4b, qwen3-8b.")
    try:
        return ModelShape.from_hf_config(AutoConfig.from_pretrained(path), name=model)
    except OSError as err:
        raise PlanError(f"cannot read the config of {model!r}: {err}. Give a local folder with config.json or "
                        f"one of qwen3-0.6b, qwen3-4b, qwen3-8b.") from None
