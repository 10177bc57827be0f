"""What the package knows about each model architecture, in one place."""
from __future__ import annotations


def text_config(hf_config):
    """The decoder's config: multimodal configs nest it (`get_text_config`), text-only ones are it."""
    return hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
