"""The planner's Gated DeltaNet layer (planner/linear_layer.py) against what one layer held on an H200, and by hand.

`benchmarks/fla_check.py --memory-lengths 131072` measured one Qwen3.5-9B Gated DeltaNet mixer (the trainer's
forward, fla's kernels, bf16): the bytes its forward leaves saved for backward and its backward's peak above them
(benchmarks/results/hybrid/fla_memory.json). The step-level check (whole Qwen3.5-9B steps within 10%) is the
replay of benchmarks/planner_validation.jsonl in test_planner.py."""
from __future__ import annotations

import json
import os

import pytest

from ulysses_train.planner.estimate import plan, worst_layer_transients
from ulysses_train.planner.layer import layer_saved_per_token, norms_saved_per_token
from ulysses_train.planner.linear_layer import (gated_deltanet_backward_extra_per_token,
                                                gated_deltanet_saved_per_token)
from ulysses_train.planner.options import PlanOptions
from ulysses_train.planner.shapes import load_model_shape

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEASURED = os.path.join(REPO, "benchmarks", "results", "hybrid", "fla_memory.json")


@pytest.fixture(scope="module")
def nine():
    return load_model_shape("qwen3.5-9b")


def measured_layer() -> dict:
    with open(MEASURED) as fh:
        return json.load(fh)["memory"][0]


def test_saved_and_backward_bytes_by_hand(nine):
    """Qwen3.5-9B's mixer: q/k 16 heads of 128 (Kd 2048), v 32 heads of 128 (Vd 4096), conv channels 8192, bf16."""
    o = PlanOptions(seq_length=131072, fused_gated_norm=False)
    conv_input = 2 * 8192
    rule = 2 * 2 * 2048 + 4 * 2 * 16 + 2 * 4096 + 2 * 64 * 32 + 4 * 32 + 2 * 32  # q, k, their norms, v, A, g, beta
    decay = 4 * 4 * 32
    gated_norm = 12 * 4096 + 3 * 2 * 4096
    assert gated_deltanet_saved_per_token(nine, o) == conv_input + rule + decay + gated_norm == 111_424
    assert gated_deltanet_backward_extra_per_token(nine, o) == 12 * 4096  # the gated norm's fp32 gradients
    fused = o.replace(fused_gated_norm=True)  # fla's kernel: bf16 input, gate and output, one fp32 scale per row
    assert gated_deltanet_saved_per_token(nine, fused) == conv_input + rule + decay + 3 * 2 * 4096 + 4 * 32


def test_the_mixer_matches_the_layer_measured_on_an_h200(nine):
    """Saved within 1%, backward peak within 2% of the measurement; the attention layer's formula (what the
    planner used for every layer before Gated DeltaNet had its own terms) is the negative control: it misses the
    measured mixer by far."""
    o = PlanOptions(seq_length=131072, low_memory_rmsnorm=False, fused_gated_norm=False)
    layer = measured_layer()
    saved = gated_deltanet_saved_per_token(nine, o)
    assert abs(saved / layer["saved_per_token"] - 1) < 0.01
    extra = gated_deltanet_backward_extra_per_token(nine, o)
    assert abs(extra / layer["backward_extra_per_token"] - 1) < 0.02
    as_attention = layer_saved_per_token(nine, o) - norms_saved_per_token(nine, o)
    assert abs(as_attention / layer["saved_per_token"] - 1) > 0.3  # 67,648 bytes against 111,296


def test_fused_norm_and_flash_qla_match_the_layer_measured_on_an_h200(nine):
    """The trainer's GPU kernels of the ninth session (fla's fused gated norm, FlashQLA's rule through fla), measured
    the same way (benchmarks/results/hybrid/fla_kernels_flashqla.json): saved within 1%, backward peak within 2%.
    Negative controls: the HF-norm terms miss the saved bytes, fla's Triton backward misses the peak, by far."""
    with open(os.path.join(REPO, "benchmarks", "results", "hybrid", "fla_kernels_flashqla.json")) as fh:
        layer = next(r for r in json.load(fh)["memory"] if r["fused_gated_norm"])
    o = PlanOptions(seq_length=131072, fused_gated_norm=True, mixer_kernels={"gated_deltanet": "flash_qla"})
    assert abs(gated_deltanet_saved_per_token(nine, o) / layer["saved_per_token"] - 1) < 0.01
    assert abs(gated_deltanet_backward_extra_per_token(nine, o) / layer["backward_extra_per_token"] - 1) < 0.02
    hf_norm = gated_deltanet_saved_per_token(nine, o.replace(fused_gated_norm=False))
    assert hf_norm / layer["saved_per_token"] - 1 > 0.5  # 111,424 against 62,264
    triton = gated_deltanet_backward_extra_per_token(nine, o.replace(mixer_kernels={"gated_deltanet": "fla"}))
    assert triton / layer["backward_extra_per_token"] - 1 > 1.0  # 89,984 against 37,264


def test_a_hybrid_peaks_at_its_larger_layer_kind(nine):
    """Qwen3.5-9B at 131,072 tokens: the Gated DeltaNet layer saves more than the gated attention layer, so the
    plan's recomputed layer is the linear one; a model of attention layers only keeps the attention rows."""
    o = PlanOptions(seq_length=131072, gpus_per_node=1, tiled_mlp=True)
    names = [part.name for part in worst_layer_transients(nine, o)]
    assert "layer: recomputed saved (linear)" in names and "layer: Gated DeltaNet backward" in names
    qwen3 = [part.name for part in worst_layer_transients(load_model_shape("qwen3-8b"), o)]
    assert "layer: recomputed saved tensors" in qwen3 and "layer: attention backward" in qwen3
    assert plan(nine, options=o).gpu_allocated > 0
