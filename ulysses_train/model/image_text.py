"""Image-text releases trained as their text model.

Hub checkpoints of several families are image-text models: a vision (and audio) tower beside the language model,
whose tensors sit under `model.language_model.`. For some (Qwen3.5) transformers' causal-LM class is the text model
already and maps the names itself. For others (Gemma 3, Gemma 4) it is the image-text model, so the towers would load,
take optimizer states and train too. Those configs are built as their text model (text_model_config: its
`text_config`), their language model's tensors loaded under the text model's names (IMAGE_TEXT_KEYS, transformers'
`key_mapping`), the towers left as checkpoint tensors not trained (weight_check.ALLOWED_UNUSED), and the export is
the text model."""
from __future__ import annotations

from typing import Optional

IMAGE_TEXT_KEYS = {r"^model\.language_model\.": "model."}
"""An image-text checkpoint's language-model names -> the text model's (transformers' from_pretrained key_mapping)."""


def text_model_config(hf_config):
    """The config the trainer builds: the text config of an image-text config whose causal-LM class in transformers
    is the image-text model (Gemma 3, Gemma 4); the config itself otherwise."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    except ValueError:  # several text configs (MusicGen's text encoder and decoder): refused as encoder-decoder
        return hf_config
    if text is hf_config or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(hf_config.model_type, "").endswith("ForCausalLM"):
        return hf_config
    return text


def checkpoint_key_mapping(checkpoint_config, hf_config) -> Optional[dict]:
    """IMAGE_TEXT_KEYS where the checkpoint is an image-text release built as its text model (`hf_config`), else
    None (transformers' own names apply)."""
    built_as_text = text_model_config(checkpoint_config) is not checkpoint_config
    return IMAGE_TEXT_KEYS if built_as_text and checkpoint_config.model_type != hf_config.model_type else None


def renamed(names: set, key_mapping: Optional[dict]) -> set:
    """Checkpoint tensor names as from_pretrained renames them under `key_mapping` (None: as they are)."""
    import re

    if not key_mapping:
        return names
    out = set()
    for name in names:
        for pattern, replacement in key_mapping.items():
            name = re.sub(pattern, replacement, name)
        out.add(name)
    return out
