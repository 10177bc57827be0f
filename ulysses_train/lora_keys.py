"""The `model.lora` keys: their defaults, their spelling and PEFT's own check of them (`lora_config`), before
anything loads. Kept apart from model/lora.py (which injects and exports the adapters) so that the config checks,
which run before the model exists, read them from their own layer (package order: config -> model)."""
from __future__ import annotations

from ulysses_train.errors import ConfigError
from ulysses_train.families import default_lora_targets

LORA_DEFAULTS = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": default_lora_targets()}
"""Every attention and MLP projection under the names the families give them (family records: the usual q/k/v/o and
gate/up/down, and each record's `lora_targets`, such as MLA's low-rank q projections and kv latent projections in
DeepSeek-V3, Kimi K2, LongCat-Flash and Kimi Linear's MLA layers). PEFT adapts the names a model has; the messages
list only those (lora.present_targets)."""
ALIASES = {"alpha": "lora_alpha", "dropout": "lora_dropout"}
LORA_KEYS = {"r": "model.lora.r", "target_modules": "model.lora.target_modules"}
"""How the errors name the rank and the targets: the trainer's config keys (scripts/plan.py passes its flags)."""


def lora_settings(lora: dict) -> dict:
    """model.lora with the defaults filled in and the short names (alpha, dropout) spelled as PEFT does."""
    settings = dict(LORA_DEFAULTS)
    settings.update({ALIASES.get(key, key): value for key, value in lora.items()})
    return settings


def lora_config(lora: dict, keys: dict = LORA_KEYS):
    """PEFT's LoraConfig for model.lora; a ConfigError naming the key (`keys`) for anything PEFT refuses."""
    try:
        from peft import LoraConfig
    except ModuleNotFoundError:
        raise ConfigError("model.lora needs the peft package: pip install peft (or pip install -e '.[lora]').") from None
    settings = lora_settings(lora)
    r = settings["r"]
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ConfigError(f"{keys['r']}={r!r} must be a positive integer (the adapters' rank).")
    try:
        return LoraConfig(**settings)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"model.lora is not a valid PEFT LoRA config: {' '.join(str(exc).split())}. Keys are "
                          f"LoraConfig's (r, lora_alpha, lora_dropout, target_modules, ...).") from None
