"""Rotary frequencies in fp32 whatever builds the model: under bf16 ZeRO-3 zero.Init the rotary modules compute
their inverse frequencies in bf16 (phase errors of radians at long positions); the trainer recomputes them
(model/rope.recompute_rope_buffers_in_fp32), checked against a module built outside zero.Init, with the wiring
and the modules it cannot rebuild (test_rope.py: the YaRN decisions)."""
import warnings

import pytest
import torch
from test_rope import THETA, qwen3_config

from ulysses_train.model.rope import RopeLengthWarning

ZERO_INIT_ROTARY = r"""
import json, os, socket, sys
import torch, deepspeed
from transformers import Gemma3TextConfig, Qwen3Config
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
from ulysses_train.model.rope import frequency_buffer_names, recompute_rope_buffers_in_fp32

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
deepspeed.init_distributed("gloo")
rope = json.loads(sys.argv[1])
if rope == "gemma3":  # one pair of buffers per layer type, with different bases
    config = Gemma3TextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                              num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                              max_position_embeddings=40960)
    rotary_class = Gemma3RotaryEmbedding
else:
    config = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                         num_hidden_layers=1, max_position_embeddings=40960, rope_parameters=rope)
    rotary_class = Qwen3RotaryEmbedding
ds = {"train_batch_size": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
with deepspeed.zero.Init(config_dict_or_path=ds, dtype=torch.bfloat16):
    holder = torch.nn.Sequential(rotary_class(config))
exact = rotary_class(config)
rotary = holder[0]
names = frequency_buffer_names(rotary)
before = max(((getattr(rotary, n).float() - getattr(exact, n)).abs() / getattr(exact, n)).max().item() for n in names)
reported = recompute_rope_buffers_in_fp32(holder)
x, positions = torch.zeros(1, 1, 128), torch.tensor([[8191, 40959]])
kinds = [{"layer_type": t} for t in sorted(set(config.layer_types))] if rope == "gemma3" else [{}]
print(json.dumps({
    "before": before, "reported": reported, "buffers": names,
    "dtype": sorted({str(getattr(rotary, n).dtype) for n in names}),
    "buffers_equal": all(torch.equal(getattr(rotary, n), getattr(exact, n)) for n in names),
    "cos_sin_equal": all(torch.equal(a, b) for kind in kinds
                         for a, b in zip(rotary(x, positions, **kind), exact(x, positions, **kind))),
    "again": recompute_rope_buffers_in_fp32(holder),
}))
"""


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": THETA},
    {"rope_type": "yarn", "rope_theta": THETA, "factor": 4.0, "original_max_position_embeddings": 10240},
    "gemma3",
], ids=["default", "yarn", "per-layer-type"])
def test_rotary_frequencies_built_under_zero_init_are_recomputed_in_fp32(rope):
    """Under bf16 zero.Init the rotary module computes its inverse frequencies in bf16 (the negative control:
    relative error above 1e-3, i.e. radians of phase at long positions); after recompute_rope_buffers_in_fp32 the
    buffers (Gemma 3: one pair per layer type) and the cos/sin equal a module built outside zero.Init exactly,
    and a second call changes nothing."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", ZERO_INIT_ROTARY, json.dumps(rope)], capture_output=True,
                          text=True, timeout=240, env={**__import__("os").environ, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["before"] > 1e-3, result  # zero.Init really did compute them in bf16
    assert result["reported"] == pytest.approx(result["before"], rel=1e-6)
    assert result["dtype"] == ["torch.float32"]
    assert len(result["buffers"]) == (4 if rope == "gemma3" else 2), result
    assert result["buffers_equal"] and result["cos_sin_equal"], result
    assert result["again"] == 0.0


def test_every_model_the_trainer_builds_recomputes_rope_buffers(monkeypatch):
    """The wiring: every model the trainer builds goes through the fp32 recompute (on transformers 5.24 the
    buffers happen to be right without it, so only this test notices if the call goes missing)."""
    import ulysses_train.model.transform as transform
    from ulysses_train.config import Config, ModelConfig

    seen = []
    monkeypatch.setattr(transform, "recompute_rope_buffers_in_fp32", lambda model: seen.append(model) or 0.0)
    module, _, _ = transform.build_long_context_model(
        qwen3_config(), Config(model=ModelConfig(random_init=True, dtype="float32")), "sdpa", None, sp=1, log=False)
    assert seen == [module.causal_lm]


def test_rotary_without_config_is_left_alone_with_a_warning_when_not_fp32():
    from ulysses_train.model.rope import recompute_rope_buffers_in_fp32

    class VisionRotaryEmbedding(torch.nn.Module):  # built from (dim, theta), as vision towers' are
        def __init__(self, dtype):
            super().__init__()
            self.register_buffer("inv_freq", (1.0 / 10000 ** (torch.arange(0, 16, 2) / 16)).to(dtype))

    fp32 = torch.nn.Sequential(VisionRotaryEmbedding(torch.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert recompute_rope_buffers_in_fp32(fp32) == 0.0
    with pytest.warns(RopeLengthWarning, match="no .config"):
        recompute_rope_buffers_in_fp32(torch.nn.Sequential(VisionRotaryEmbedding(torch.bfloat16)))
