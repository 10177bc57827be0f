"""Hub kernels (transformers >= 5.25 with the `kernels` package): transformers' from_pretrained turns them on by
default (`use_kernels` None -> True unless USE_HUB_KERNELS disables them), so a layer decorated to take a hub
kernel could run a downloaded kernel the package did not choose or name on its `model changes:` line. The package
decides explicitly: model/loading.py loads with use_kernels=False. CPU, a tiny model."""
import pytest
import torch
from helpers import save_tiny_model

pytest.importorskip("kernels")


def replaced_forwards(model) -> list[str]:
    """Modules whose forward is not their class's own (an instance attribute, as kernelize sets)."""
    return [name for name, module in model.named_modules() if "forward" in vars(module)]


def test_the_package_loads_without_hub_kernels_where_transformers_would_enable_them(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from ulysses_train.config import ModelConfig
    from ulysses_train.model.loading import build_causal_lm

    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    folder = save_tiny_model(str(tmp_path / "tiny"))
    plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert plain.use_kernels is True  # the negative control: transformers' own default, with kernels installed
    model, _ = build_causal_lm(plain.config, ModelConfig(name_or_path=folder, dtype="float32"), "sdpa", None)
    assert model.use_kernels is False and replaced_forwards(model) == []
