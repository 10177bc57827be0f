"""Every change to the Hugging Face model is made by one function, in order, and shows in print(model)."""
import pytest
from helpers import tiny_qwen3_config

from ulysses_train.config import Config, LossConfig, ModelConfig
from ulysses_train.model.transform import build_long_context_model

OFFLOAD = {"activation_checkpointing": {"cpu_checkpointing": True}}


def build(capsys, ds_config=None, **model_options):
    cfg = Config(model=ModelConfig(random_init=True, dtype="float32", **model_options), loss=LossConfig())
    module, _, mpu = build_long_context_model(tiny_qwen3_config(), cfg, "sdpa", ds_config, sp=1)
    return module, capsys.readouterr().out


def test_every_change_is_named_in_print_and_in_one_summary_line(capsys):
    module, out = build(capsys, OFFLOAD, tiled_mlp="true", keep_attention_fraction=0.5, rmsnorm="torch")
    shown = str(module)
    for name in ("TiledQwen3MLP", "FusedQwen3RMSNorm", "ChunkedLossHeadLinear", "LeveredQwen3DecoderLayer"):
        assert name in shown, name
    # 2 layers at 0.5: layer 0 offloads its checkpoint (the last layer never does), layer 1 keeps attention
    assert "(0): LeveredQwen3DecoderLayer(\n          checkpoint: offloaded to host\n" in shown
    assert "(1): LeveredQwen3DecoderLayer(\n          checkpoint: attention output kept\n" in shown
    lines = [line for line in out.splitlines() if line.startswith("model changes: ")]
    assert len(lines) == 1
    order = ["attention sdpa", "RoPE frequencies in fp32", "gradient checkpointing of 2 layers",
             "attention kept in 1 of 2 layers, activation offload in 1 of 2", "TiledMLP (true)",
             "9 RMSNorms -> torch kernel", "lm_head -> ChunkedLossHead"]
    positions = [lines[0].index(part) for part in order]
    assert positions == sorted(positions), lines[0]


def test_without_levers_only_the_loss_head_changes(capsys):
    module, out = build(capsys, None, tiled_mlp="false", rmsnorm="hf")
    shown = str(module)
    assert "ChunkedLossHeadLinear" in shown
    for name in ("Tiled", "Fused", "Chunked" + "Qwen3RMSNorm", "Levered"):
        assert name not in shown, name
    assert "Qwen3MLP" in shown and "Qwen3RMSNorm" in shown


@pytest.mark.parametrize("kernel,prefix", [("torch", "Fused"), ("chunked", "Chunked")])
def test_swapped_modules_keep_their_parameters_and_stock_class(capsys, kernel, prefix):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

    from ulysses_train.model.swap import stock_class

    module, _ = build(capsys, None, tiled_mlp="true", rmsnorm=kernel)
    norm = module.causal_lm.model.norm
    mlp = module.causal_lm.model.layers[0].mlp
    assert isinstance(norm, Qwen3RMSNorm) and type(norm).__name__ == f"{prefix}Qwen3RMSNorm"
    assert stock_class(norm) is Qwen3RMSNorm and stock_class(mlp) is Qwen3MLP
    assert [n for n, _ in norm.named_parameters()] == ["weight"]
    assert module.causal_lm.lm_head.weight is module.causal_lm.model.embed_tokens.weight  # still tied
