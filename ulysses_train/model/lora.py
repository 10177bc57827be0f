"""LoRA adapters through PEFT (`model.lora`): only the adapters train; the base weights stay frozen.

`apply_lora` injects PEFT's LoRA layers into the built model (`peft.inject_adapter_in_model`: the layers of
`PeftModel`, without its wrapper, so the model keeps its own forward, the chunked loss and every lever) and
freezes everything else. Under ZeRO-3 the new layers are partitioned by DeepSpeed when it wraps the model;
the frozen base weights get no gradients, no fp32 masters and no optimizer states. LoRA layers are per token,
so sequence parallelism and TiledMLP need nothing from them (TiledMLP recomputes with the adapter weights of
its MLP among its compute parameters).

Adapter weights are drawn from a generator seeded with `train.seed`, the same on every rank. PEFT's default
starts `lora_B` at zero (the adapted model equals the base at step 0); `init_lora_weights: false` draws it at
random (the exactness tests use it, so every adapter weight has a gradient at step 0).

Export (`model.lora_export`): `adapter` writes PEFT's folder (`adapter_config.json`,
`adapter_model.safetensors`; `PeftModel.from_pretrained(base, folder)` loads it), `merged` a plain Hugging Face
model whose weights are base + scaling x B @ A.
"""
from __future__ import annotations

import os

import torch

from ulysses_train.errors import ConfigError
from ulysses_train.lora_keys import LORA_KEYS, lora_config, lora_settings  # noqa: F401  (the model.lora keys)

ADAPTER = "default"  # PEFT's adapter name inside the model's module names


def check_lora_targets(hf_config, lora: dict, keys: dict = LORA_KEYS) -> None:
    """model.lora.target_modules must name at least one linear layer of the model: checked on the model built on
    the meta device (no weights, no memory) before the weights load, with PEFT's own matching rule, so a typo is
    one line listing the model's linear layer names, not PEFT's refusal after minutes of loading."""
    from peft.tuners.tuners_utils import check_target_module_exists

    config = lora_config(lora, keys)
    if config.target_modules == "all-linear":
        return
    names = [name for name, _ in _meta_linears(hf_config)]
    if not any(check_target_module_exists(config, name) for name in names):
        short = sorted({name.rsplit(".", 1)[-1] for name in names})
        given = config.target_modules
        given = sorted(given) if isinstance(given, (set, list, tuple)) else given
        raise ConfigError(f"{keys['target_modules']}={given!r} names no module of this model; its linear layers are {', '.join(short)}. Fix: list "
                          f"some of these (or all-linear).")


def apply_lora(model, lora: dict, seed: int) -> str:
    """Inject the adapters and freeze the rest; returns the summary phrase for the model-changes line."""
    from peft import inject_adapter_in_model

    config = lora_config(lora)
    asked = config.target_modules  # PEFT rewrites the config's targets when it adapts fused expert tensors
    asked = asked if isinstance(asked, str) else sorted(asked)
    names = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            inject_adapter_in_model(config, model, adapter_name=ADAPTER)
        except ValueError as exc:  # e.g. no module matches target_modules
            raise ConfigError(f"model.lora: {' '.join(str(exc).split())}") from None
    trained = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
    total = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    return (f"LoRA r={config.r} on {', '.join(present_targets(names, asked))} ({trained:,} of "
            f"{total:,} parameters train){fused_expert_note(model, names, asked)}"
            f"{layers_without_adapters(model)}")


def fused_expert_note(model, linear_names: list, targets) -> str:
    """"" unless PEFT adapted fused expert tensors (PEFT >= 0.21 turns gate/up/down targets of a mixture of experts
    into adapters on `gate_up_proj` and `down_proj`): then which tensors, that their merged weights are built whole
    on each forward (planned: leaf_blocks.merged_adapter_weights), and which named targets adapt no linear layer."""
    from peft.tuners.lora.layer import ParamWrapper

    fused = sorted({m.parameter_name for m in model.modules() if isinstance(m, ParamWrapper)})
    if not fused:
        return ""
    adapted = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if hasattr(m, "lora_A")}
    idle = [t for t in present_targets(linear_names, targets) if t not in adapted]
    return (f"; the experts' fused {', '.join(fused)} adapted (PEFT builds their merged weights whole each forward)"
            + (f", the {', '.join(idle)} linear layers not" if idle else ""))


def present_targets(linear_names: list, targets) -> list:
    """The targets that name some linear layer of the model (PEFT matches a name or a dotted suffix): what the
    messages say is adapted. A default target a family lacks (Nemotron-H's MLPs have no gate_proj) is left out."""
    if isinstance(targets, str):
        return [targets]
    return sorted(t for t in targets if any(name == t or name.endswith("." + t) for name in linear_names))


def layers_without_adapters(model) -> str:
    """"" when every decoder layer holds an adapter, else which layer kinds hold none (a hybrid's Mamba2 layers
    under the default attention and MLP targets), so a user knows those layers do not train."""
    from ulysses_train.model.mixers.protocol import layer_types_of
    from ulysses_train.model.recompute import decoder_layers

    layers = decoder_layers(model)
    kinds = layer_types_of(model.config) if len(layer_types_of(model.config)) == len(layers) else ["layer"] * len(layers)
    bare = [(kind, layer) for layer, kind in zip(layers, kinds)
            if not any(is_adapter_key(name + ".") for name, _ in layer.named_modules())]
    if not bare:
        return ""
    counts = ", ".join(f"{sum(kind == k for k in kinds)} {kind}" for kind in sorted({kind for kind, _ in bare}))
    linears = sorted({name.rsplit(".", 1)[-1] for _, layer in bare for name, module in layer.named_modules()
                      if isinstance(module, torch.nn.Linear)})
    return (f"; no adapter in the {counts} layers (their linear layers, {', '.join(linears) or 'none'}, are not "
            f"targets: add them to model.lora.target_modules, or all-linear, to train them)")


def lora_parameter_count(hf_config, lora: dict) -> int:
    """Adapter parameters (what the planner needs): lora_plan_fields' count."""
    return lora_plan_fields(hf_config, lora)["adapter_params"]


def lora_plan_fields(hf_config, lora: dict) -> dict:
    """The planner's view of a LoRA run (PlanOptions.adapter_params, lora_merged_params), read from the model built
    on the meta device (no weights, no memory) with the adapters injected as apply_lora injects them, so the count
    is PEFT's own: its matching rule, and its conversion of a mixture of experts' targets (PEFT >= 0.21 turns
    gate_proj, up_proj and down_proj into adapters on the fused expert tensors, `gate_up_proj` and `down_proj`,
    and then adapts no dense MLP under those names). Those fused tensors PEFT adapts through a parametrization that
    builds the merged weight, W + B @ A, whole on every forward: lora_merged_params is (the elements of the
    merged tensors of the layer with the most, the largest of them); () where no fused tensor is adapted."""
    import re

    from peft import inject_adapter_in_model
    from peft.tuners.lora.layer import ParamWrapper

    from ulysses_train.model.architecture import causal_lm_on_meta

    model = causal_lm_on_meta(hf_config)
    inject_adapter_in_model(lora_config(lora), model, adapter_name=ADAPTER, low_cpu_mem_usage=True)
    adapters = sum(p.numel() for name, p in model.named_parameters() if ".lora_" in name)
    merged = {}
    for name, module in model.named_modules():
        if isinstance(module, ParamWrapper):
            layer = re.search(r"\.layers\.(\d+)\.", name + ".")
            numel = getattr(module.get_base_layer(), module.parameter_name).numel()
            merged.setdefault(layer[1] if layer else name, []).append(numel)
    if not merged:
        return {"adapter_params": adapters, "lora_merged_params": ()}
    widest = max(merged.values(), key=sum)
    return {"adapter_params": adapters, "lora_merged_params": (sum(widest), max(widest))}


def linear_names(hf_config) -> list:
    """The names of the model's linear layers (built on the meta device): what `present_targets` matches."""
    return [name for name, _ in _meta_linears(hf_config)]


def _meta_linears(hf_config) -> list:
    """(name, module) of every linear layer of the causal LM built on the meta device."""
    from ulysses_train.model.architecture import causal_lm_on_meta

    model = causal_lm_on_meta(hf_config)
    return [(name, module) for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]


def is_adapter_key(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def adapter_state(state: dict) -> dict:
    """The adapter weights of a full state dict, named as PEFT saves them (`base_model.model.<module>.lora_A.
    weight`: the adapter name dropped)."""
    return {"base_model.model." + name.replace(f".{ADAPTER}.", "."): tensor
            for name, tensor in state.items() if is_adapter_key(name)}


def merged_state(state: dict, lora: dict) -> dict:
    """A full state dict with each adapted weight merged (base + scaling x B @ A, in fp32, then the base dtype)
    and the adapter layers' names gone: a plain Hugging Face state dict."""
    settings = lora_settings(lora)
    scaling = settings["lora_alpha"] / (settings["r"] ** 0.5 if settings.get("use_rslora") else settings["r"])
    merged = {}
    for name, tensor in state.items():
        if is_adapter_key(name):
            continue
        if ".base_layer." in name:
            module = name.split(".base_layer.")[0]
            if name.endswith("weight"):
                a = state[f"{module}.lora_A.{ADAPTER}.weight"].float()
                b = state[f"{module}.lora_B.{ADAPTER}.weight"].float()
                tensor = (tensor.float() + scaling * (b @ a)).to(tensor.dtype)
            name = name.replace(".base_layer.", ".")
        merged[name] = tensor
    return merged


def save_adapter(state: dict, lora: dict, base_name_or_path: str, folder: str) -> None:
    """PEFT's adapter folder: adapter_config.json and adapter_model.safetensors."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    config = lora_config(lora)
    config.base_model_name_or_path = base_name_or_path
    config.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in adapter_state(state).items()},
              os.path.join(folder, "adapter_model.safetensors"), metadata={"format": "pt"})
