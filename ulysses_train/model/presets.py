"""Qwen3 configs with the real shapes, built locally (no hub access), for planning, tests and benchmarks.

`qwen3_config("qwen3-8b")` returns a `transformers.Qwen3Config` with the published shapes of
Qwen/Qwen3-8B (hidden, intermediate, layers, heads, head_dim, vocabulary, tied or not, RoPE theta,
trained length); `save_qwen3_config("qwen3-8b", folder)` writes it as a Hugging Face folder with
`config.json`, so anything that takes `model.name_or_path` can use it with `random_init: true`.

    python -c "from ulysses_train.model.presets import save_qwen3_config as s; s('qwen3-4b', 'outputs/qwen3-4b')"
"""
from __future__ import annotations

import os

# name -> (hidden, intermediate, layers, query heads, kv heads, tied embeddings); all have head_dim 128,
# vocabulary 151,936, rope_theta 1e6 and 40,960 trained positions (the shipped config.json values).
QWEN3_SHAPES = {
    "qwen3-0.6b": (1024, 3072, 28, 16, 8, True),
    "qwen3-4b": (2560, 9728, 36, 32, 8, True),
    "qwen3-8b": (4096, 12288, 36, 32, 8, False),
}
HUB_NAMES = {"qwen3-0.6b": "Qwen/Qwen3-0.6B", "qwen3-4b": "Qwen/Qwen3-4B", "qwen3-8b": "Qwen/Qwen3-8B"}


def known_name(name: str) -> str | None:
    """The local key for `name` ("qwen3-8b", "Qwen3-8B" or "Qwen/Qwen3-8B"), or None if it is not one of ours."""
    key = name.strip().lower().split("/")[-1]
    return key if key in QWEN3_SHAPES else None


def qwen3_config_kwargs(name: str) -> dict:
    """The `Qwen3Config` keyword arguments of `name` (plain data: the planner reads them without transformers)."""
    key = known_name(name)
    if key is None:
        raise ValueError(f"unknown model {name!r}; local shapes exist for {', '.join(QWEN3_SHAPES)}.")
    hidden, intermediate, layers, heads, kv_heads, tied = QWEN3_SHAPES[key]
    return dict(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=128, vocab_size=151936,
        tie_word_embeddings=tied, max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        max_window_layers=layers, attention_bias=False, hidden_act="silu",
        bos_token_id=151643, eos_token_id=151645,
    )


def qwen3_config(name: str, **overrides):
    """A `Qwen3Config` with the real shapes of `name` (see QWEN3_SHAPES); `overrides` are set on top."""
    from transformers import Qwen3Config

    config = Qwen3Config(**{**qwen3_config_kwargs(name), **overrides})
    config.name_or_path = HUB_NAMES[known_name(name)]
    return config


def save_qwen3_config(name: str, folder: str, **overrides) -> str:
    """Write `qwen3_config(name, **overrides)` to `folder/config.json`; returns the folder."""
    os.makedirs(folder, exist_ok=True)
    qwen3_config(name, **overrides).save_pretrained(folder)
    return folder
