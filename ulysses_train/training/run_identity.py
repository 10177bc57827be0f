"""What a run folder's checkpoints belong to, and whether `--resume` may continue them with this config.

A checkpoint holds weights, optimizer states and a position in the data order (samples consumed). It continues
the same run only with the same model (architecture and shapes), sequence length and seed, and the same data:
the same rows (corpus content), turned into tokens the same way (tokenizer, chat template) and into sequences
the same way (format, fields, what is learned, packing, too_long, drop_last). With other data the position
points into another sample order and the run silently mixes two data sets. So the identity is recorded in
run_config.json and compared on `--resume` from files only, before any process group starts or any weight
loads: a different model is another run (refused); changed data is refused naming what changed, unless
`train.resume_data_change=true` says the user means it.

Folders written before the data were recorded (no `data` in their identity) are compared on the model only.

The adapter is part of the model: a LoRA run's checkpoints hold only the adapters' weights and optimizer states,
shaped by their rank and targets, so another rank, other targets, LoRA added or removed fail inside DeepSpeed's
state-dict load with a traceback. `lora` (PEFT's settings as the run resolved them, or null) is compared like the
model's fields and named as `model.lora.<field>` (folders written before it was recorded are not compared on it).
"""
from __future__ import annotations

import json
import os

from ulysses_train.config import ConfigError
from ulysses_train.training.run_folder import RUN_CONFIG

MODEL_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "vocab_size", "intermediate_size", "rope_parameters")
TEXT_MODEL_KEYS = ("head_dim", "rope_theta", "partial_rotary_factor", "layer_types", "sliding_window",
                   "tie_word_embeddings", "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts",
                   "num_local_experts", "num_experts_per_tok", "linear_num_key_heads", "linear_num_value_heads",
                   "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim")
"""Recorded since the identity is read from the text model (`text_config` of image-text configs, which used to be
recorded as null): a folder whose identity lacks them was written before, and is compared on what it recorded."""
ADAPTER_KEYS = ("r", "lora_alpha", "target_modules", "use_rslora", "use_dora", "modules_to_save")
"""model.lora's fields that shape or scale the adapters a checkpoint holds (dropout does not)."""
DATA_WORDS = {"tokenizer": "the tokenizer (its vocabulary, merges or special tokens)",
              "chat_template": "the tokenizer's chat template", "corpus": "the corpus content (data.source)"}


def run_identity(cfg, hf_config, data: dict) -> dict:
    """The identity of this run as JSON values. `cfg`, `hf_config`: as the run resolved them
    (resolved_run.resolve_run: the model's config with its RoPE scaling applied, what the engine builds). `data`:
    fingerprint.data_identity, or a marker for data that are not a corpus (the demo, a dataset given in code)."""
    from ulysses_train.model.architecture import text_config

    text = text_config(hf_config).to_dict()  # image-text configs nest the decoder's fields in text_config
    identity = {"model": cfg.model.name_or_path, **{k: text.get(k) for k in MODEL_KEYS + TEXT_MODEL_KEYS},
                "model_type": hf_config.model_type,  # the checkpoint's own type (an image-text one's, not its text's)
                "seq_length": cfg.data.seq_length, "seed": cfg.train.seed, "lora": adapter_identity(cfg.model.lora),
                "data": data}
    return json.loads(json.dumps(identity, default=str))


def adapter_identity(lora: dict) -> dict | None:
    """What shapes a LoRA run's checkpoint (rank, alpha, targets, the rest of model.lora as PEFT reads it); None
    for a full fine-tune."""
    if not lora:
        return None
    from ulysses_train.model.lora import lora_settings

    settings = {k: v for k, v in lora_settings(lora).items() if k in ADAPTER_KEYS}
    targets = settings.get("target_modules")
    if isinstance(targets, (list, tuple, set)):
        settings["target_modules"] = sorted(targets)
    return settings


def previous_identity(output_dir: str) -> dict | None:
    """The identity in the folder's run_config.json, None without one."""
    path = os.path.join(output_dir, RUN_CONFIG)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as fh:
            previous = json.load(fh).get("identity")
        if not isinstance(previous, dict):
            raise ValueError("no 'identity' in it")
    except (OSError, ValueError, AttributeError) as err:
        raise ConfigError(f"{path} is unreadable ({err}); it names the run to resume. Restore it, or start "
                          f"over with --overwrite.") from None
    return previous


def check_resume(output_dir: str, identity: dict, accept_data_change: bool) -> list[str]:
    """Refuse a resume into a folder of another run, or onto changed data unless `accept_data_change`; returns
    the warnings to print (the data changes accepted)."""
    previous = previous_identity(output_dir)
    if previous is None:
        return []
    before, now = dict(previous), dict(identity)
    before_data, now_data = before.pop("data", None), now.pop("data", None)
    if "lora" not in before:  # written before the adapter was recorded
        now.pop("lora", None)
    if before.get("lora") != now.get("lora"):
        raise ConfigError(f"--resume: the checkpoints in {output_dir!r} were trained with another adapter "
                          f"({_adapter_differences(before.get('lora'), now.get('lora'))}); they cannot load into "
                          f"this model. Restore model.lora, or start over (--overwrite or another output_dir).")
    if TEXT_MODEL_KEYS[0] not in before:  # written before the text model's fields were read: compare what it holds
        now = {k: v for k, v in now.items() if before.get(k) is not None or k not in MODEL_KEYS + TEXT_MODEL_KEYS}
        before = {k: v for k, v in before.items() if k in now}
    if before != now:
        raise ConfigError(f"train.output_dir={output_dir!r} holds a run of a different model or configuration "
                          f"({_differences(before, now)}); use another output_dir, or --overwrite to replace it.")
    changes = data_changes(before_data, now_data) if before_data is not None else []
    if not changes:
        return []
    what = "; ".join(changes)
    if not accept_data_change:
        raise ConfigError(f"--resume: the data differ from those the checkpoints in {output_dir!r} were trained on "
                          f"({what}); resuming would continue the sample order over other data. Restore them, start "
                          f"over (--overwrite or another output_dir), or pass --set train.resume_data_change=true "
                          f"to continue on the new data.")
    return [f"warning: resuming on changed data ({what}), as train.resume_data_change=true asks; the sample "
            f"order continues by count over the new data."]


def data_changes(before: dict, now: dict) -> list[str]:
    """What differs between two data identities, in words naming the setting."""
    if not isinstance(before, dict) or not isinstance(now, dict):
        return [] if before == now else [f"data: {_short(before)} -> {_short(now)}"]
    changes = []
    old_form, new_form = before.get("form") or {}, now.get("form") or {}
    for key in sorted(set(old_form) | set(new_form)):
        if old_form.get(key) != new_form.get(key):
            changes.append(f"data.{key}: {_short(old_form.get(key))} -> {_short(new_form.get(key))}")
    for key, words in DATA_WORDS.items():
        if before.get(key) != now.get(key):
            changes.append(f"{words} changed")
    extra = sorted((set(before) | set(now)) - set(DATA_WORDS) - {"form"})
    changes += [f"data {key}: {_short(before.get(key))} -> {_short(now.get(key))}" for key in extra
                if before.get(key) != now.get(key)]
    return changes


def _adapter_differences(before: dict | None, now: dict | None) -> str:
    """model.lora's change in words: added, removed, or each field as `model.lora.<field>: old -> new`."""
    if before is None:
        return "model.lora: none -> LoRA rank " + _short(now.get("r"))
    if now is None:
        return "model.lora: LoRA rank " + _short(before.get("r")) + " -> none (a full fine-tune)"
    return _differences(before, now, "model.lora.")


def _differences(before: dict, now: dict, prefix: str = "") -> str:
    """Each differing field as `name: old -> new`; inside two dicts (rope_parameters) the fields that differ, so a
    long value does not hide the change behind its cut."""
    keys = [k for k in sorted(set(before) | set(now)) if before.get(k) != now.get(k)]
    return ", ".join(_differences(before[k], now[k], f"{prefix}{k}.")
                     if isinstance(before.get(k), dict) and isinstance(now.get(k), dict)
                     else f"{prefix}{k}: {_short(before.get(k))} -> {_short(now.get(k))}" for k in keys)


def _short(value) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."
