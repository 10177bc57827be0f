"""Weights loaded = weights trained: after `from_pretrained`, every tensor the model holds came from the checkpoint and
every tensor the checkpoint holds went into the model, or the run is refused in one line.

transformers only logs a load report (once per rank) and initialises what is missing at random, so a checkpoint whose
keys do not match (a renamed tensor, a language model under another prefix) used to train a random model with exit 0.
Under ZeRO-3 (how every run here loads) transformers reports missing keys but never unexpected ones, so the
checkpoint's tensor names are read from its safetensors headers (no tensor data) and renamed the way transformers
renames them for this model (its own conversion mapping), and what is left over is unexpected.

Not refused (ALLOWED_UNUSED, plus the model class's own `_keys_to_ignore_on_load_*` lists): a vision tower and
multi-token-prediction heads of a release whose text model is what trains, and RoPE tables or position ids that older
checkpoints stored. Tied output embeddings and non-persistent buffers are never missing (transformers ties them, and
they are not in the state dict).
"""
from __future__ import annotations

import json
import logging
import os
import re
from contextlib import contextmanager
from typing import Optional

from ulysses_train.config import ConfigError
from ulysses_train.model.architecture import causal_lm_on_meta, text_config
from ulysses_train.model.image_text import renamed

ALLOWED_UNUSED = {
    "vision (or audio) tower (the text model of an image-text release trains)":
        r"^(model\.)?(visual|vision_tower|vision_model|embed_vision|audio_tower|embed_audio|vision_encoder"
        r"|audio_encoder)\.",
    "multi-token-prediction heads (mtp.*: transformers builds no MTP layer, so they are not trained)": r"^mtp\.",
    "RoPE tables and position ids (computed by the model)": r"(^|\.)(rotary_emb\.inv_freq|position_ids)$",
}
"""Checkpoint tensors the model may leave unused: what each is, and the pattern of its names."""

SHOWN_NAMES = 4  # how many names a refusal shows


@contextmanager
def quiet_load_report():
    """Hold back transformers' multi-line LOAD REPORT (logged once per rank) while loading: check_loaded_weights
    says the same in one line, and refuses."""
    loggers = [logging.getLogger(name) for name in ("transformers.modeling_utils", "transformers.utils.loading_report")]

    def not_a_load_report(record: logging.LogRecord) -> bool:
        return " LOAD REPORT" not in str(record.msg)

    for logger in loggers:
        logger.addFilter(not_a_load_report)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(not_a_load_report)


def check_loaded_weights(model, loading_info: dict, hf_config, name_or_path: str, key_mapping=None) -> None:
    """Refuse (ConfigError) when the model holds a tensor the checkpoint did not give it, or the checkpoint holds one
    the model did not take, outside the allowed lists. `loading_info`: from_pretrained's `output_loading_info`;
    `key_mapping`: the renaming it was given (image_text.IMAGE_TEXT_KEYS), or None."""
    names = checkpoint_tensor_names(name_or_path)
    names = None if names is None else renamed(names, key_mapping)
    missing = sorted(loading_info.get("missing_keys") or ())
    unexpected = set(loading_info.get("unexpected_keys") or ())
    if names is not None:  # the checkpoint's own names (transformers reports them renamed: counted twice with them)
        unexpected = unused_checkpoint_names(model, names)
    model.checkpoint_tensors_not_trained = not_trained_note(model, unexpected)
    unexpected = sorted(name for name in unexpected if not allowed_unused(model, name))
    if not missing and not unexpected:
        return
    shown = f"model.name_or_path={name_or_path!r}"
    fix = ("Fix: point model.name_or_path at the checkpoint this config.json was released with (or rename its "
           "tensors to the model's names), or set model.random_init: true to train from random weights on purpose.")
    if names is not None and missing and text_config(hf_config) is not hf_config and \
            not any("language_model." in name for name in names):
        raise ConfigError(f"{shown}: the checkpoint's language model is not under model.language_model, where the "
                          f"image-text layout of its config ({type(hf_config).__name__}) puts it: its tensors are "
                          f"under {', '.join(name_prefixes(names))}; {len(missing)} of the model's tensors would "
                          f"start from random weights (e.g. {', '.join(missing[:SHOWN_NAMES])}). {fix}")
    parts = []
    if missing:
        parts.append(f"{len(missing)} of the model's tensors are missing from the checkpoint and would train from "
                     f"random weights (e.g. {', '.join(missing[:SHOWN_NAMES])})")
    if unexpected:
        parts.append(f"{len(unexpected)} of the checkpoint's tensors are not used by the model "
                     f"(e.g. {', '.join(unexpected[:SHOWN_NAMES])})")
    raise ConfigError(f"{shown}: the checkpoint does not match the model: {'; '.join(parts)}. {fix}")


def refuse_mismatched_shapes(err: RuntimeError, name_or_path: str) -> None:
    """A ConfigError for from_pretrained's RuntimeError about tensors of another shape than the model's (under ZeRO-3
    it names the first; otherwise its load report did, which quiet_load_report held back); nothing for another
    RuntimeError."""
    text = " ".join(str(err).split())
    if "size mismatch" not in text and "ignore_mismatched_sizes" not in text:
        return
    shape = r"torch\.Size\(\[([^\]]*)\]\)"
    first = re.search(rf"size mismatch for (\S+): copying a param with shape {shape} from checkpoint, the shape in "
                      rf"current model is {shape}", text)
    which = f": {first[1]} is [{first[2]}] in the checkpoint, [{first[3]}] in the model" if first else ""
    raise ConfigError(f"model.name_or_path={name_or_path!r}: the checkpoint's tensors do not have the model's "
                      f"shapes{which}. Fix: use the config.json the checkpoint was saved with (check "
                      f"model.config_overrides).") from None


def refuse_unequal_fused_parts(err: RuntimeError, hf_config, name_or_path: str, key_mapping=None) -> None:
    """A ConfigError for from_pretrained's RuntimeError about a fused tensor it could not build ("Failed to apply weight
    conversion": the per-expert tensors a release stores one by one, stacked into one, of unequal shapes), naming the
    checkpoint tensor whose shape differs from the others of its group; nothing for another RuntimeError. Found from
    the checkpoint's headers (no tensor data) grouped as transformers' conversion mapping groups them."""
    if "Failed to apply weight conversion" not in str(err):
        return
    rename = checkpoint_renamer(causal_lm_on_meta(hf_config), key_mapping)
    groups = {}
    for name, shape in checkpoint_tensor_shapes(name_or_path).items():
        target, pattern = rename(name)
        if pattern is not None:
            groups.setdefault((target, pattern), {}).setdefault(tuple(shape), []).append(name)
    for (target, _), by_shape in sorted(groups.items()):
        if len(by_shape) == 1:
            continue
        usual = max(by_shape, key=lambda shape: len(by_shape[shape]))
        odd = sorted((name, shape) for shape, names in by_shape.items() if shape != usual for name in names)
        (name, shape), more = odd[0], f" ({len(odd)} such tensors)" if len(odd) > 1 else ""
        raise ConfigError(f"model.name_or_path={name_or_path!r}: the checkpoint tensor {name} is {list(shape)}, where "
                          f"the {len(by_shape[usual])} others that make up {target} are {list(usual)}{more}. Fix: "
                          f"use the config.json the checkpoint was saved with, or download or copy that tensor's "
                          f"file again.") from None


def checkpoint_tensor_shapes(name_or_path: str) -> dict:
    """{tensor name: shape} of a safetensors checkpoint, from its files' headers (no tensor data); {} where none."""
    from safetensors import safe_open

    folder = checkpoint_folder(name_or_path)
    shapes = {}
    for file in sorted(os.listdir(folder)) if folder else ():
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(folder, file), framework="pt") as handle:
                shapes.update({name: handle.get_slice(name).get_shape() for name in handle.keys()})
    return shapes


def not_trained_note(model, unused) -> str | None:
    """The checkpoint tensors the model leaves unused and is allowed to (ALLOWED_UNUSED, the class's own list), in
    words for the `model changes:` line ("checkpoint tensors not trained: 12 multi-token-prediction heads (mtp.*)"),
    so an exported model's missing heads are said once, not discovered later; None when there are none."""
    counts = {}
    for name in unused:
        what = next((what for what, pattern in allowed_patterns(model).items() if re.search(pattern, name)), None)
        if what is None and allowed_unused(model, name):
            what = f"ignored by {type(model).__name__} when loading"
        if what is not None:
            counts[what] = counts.get(what, 0) + 1
    if not counts:
        return None
    return "checkpoint tensors not trained: " + ", ".join(f"{n} {what}" for what, n in sorted(counts.items()))


def allowed_patterns(model) -> dict:
    """ALLOWED_UNUSED and, where the config names multi-token-prediction layers stored as extra decoder layers
    (`num_nextn_predict_layers` n: DeepSeek-V3's and GLM-4.5's releases store them as layers L .. L + n - 1 of a
    model of L layers), those layers: transformers builds none (its classes ignore only the released indices, 61 or
    92, so a pruned or tiny model's were refused as a mismatch), so they are not trained, and said so."""
    patterns = dict(ALLOWED_UNUSED)
    text = text_config(model.config) if hasattr(model, "config") else None
    extra, layers = getattr(text, "num_nextn_predict_layers", None), getattr(text, "num_hidden_layers", None)
    if isinstance(extra, int) and isinstance(layers, int) and extra > 0:
        indices = "|".join(str(layers + i) for i in range(extra))
        what = f"layers {layers}" + (f"-{layers + extra - 1}" if extra > 1 else "")
        patterns[f"multi-token-prediction {what} (num_nextn_predict_layers={extra}: transformers builds no MTP "
                 f"layer, so they are not trained)"] = rf"(^|\.)layers\.({indices})\."
    return patterns


def allowed_unused(model, name: str) -> bool:
    patterns = [*allowed_patterns(model).values(), *(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())]
    return any(re.search(pattern, name) for pattern in patterns)


def unused_checkpoint_names(model, names: set) -> set:
    """The checkpoint tensor names that, renamed as transformers renames them when loading this model (image-text
    prefixes, fused experts: its conversion mapping), name no tensor of the model."""
    rename = checkpoint_renamer(model)
    model_names = model.state_dict().keys()
    return {name for name in names if rename(name)[0] not in model_names}


def checkpoint_renamer(model, key_mapping=None):
    """name -> (the model's name for a checkpoint tensor, the conversion source pattern that matched it or None), as
    transformers renames checkpoint tensors when loading this model (its conversion mapping: image-text prefixes,
    per-expert tensors fused into one)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model, key_mapping=key_mapping)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    model_names = dict.fromkeys(model.state_dict().keys(), True)
    prefix = getattr(model, "base_model_prefix", None) or None
    return lambda name: rename_source_key(name, renamings, converters, prefix, model_names)


def checkpoint_tensor_names(name_or_path: str) -> Optional[set]:
    """The tensor names of a safetensors checkpoint (its index, or each file's header: no tensor data), from a local
    folder or the hub cache; None where there is none (a .bin checkpoint: transformers' own report is used)."""
    folder = checkpoint_folder(name_or_path)
    if folder is None:
        return None
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as fh:
            return set(json.load(fh)["weight_map"])
    return set(checkpoint_tensor_shapes(name_or_path)) or None


def checkpoint_folder(name_or_path: str) -> Optional[str]:
    path = os.path.expanduser(name_or_path)
    if os.path.isdir(path):
        return path
    try:
        from transformers.utils import cached_file

        config = cached_file(name_or_path, "config.json", _raise_exceptions_for_missing_entries=False)
    except (OSError, ValueError):
        return None
    return os.path.dirname(config) if config else None


def name_prefixes(names: set) -> list[str]:
    """Where a checkpoint's tensors lie: each name up to its layer list (`.layers.`), else its first two parts."""
    prefixes = {name.split(".layers.")[0] if ".layers." in name else ".".join(name.split(".")[:2]) for name in names}
    return sorted(prefixes)[:8]
