"""The planner's Kimi Linear terms (planner/kda_layer.py; MLA as attention with its own head widths, planner/layer.py),
by hand at the preset's widths, with negative controls: a Gated DeltaNet of the same widths (a per-head decay) plans
other bytes, and MLA planned with one head width (the config's `head_dim`, its rotary part only, as before) plans
far fewer. The GPU check of these terms is benchmarks/mixer_memory.py (its plumbing runs on CPU here)."""
from __future__ import annotations

import dataclasses
import json
import sys

import pytest

from ulysses_train.planner.estimate import layer_transients, plan
from ulysses_train.planner.kda_layer import kda_backward_extra_per_token, kda_exchange_width, kda_saved_per_token
from ulysses_train.planner.layer import (attention_backward_extra_per_token, attention_exchange_width,
                                        attention_saved_per_token)
from ulysses_train.planner.linear_layer import delta_rule_heads, gated_deltanet_saved_per_token
from ulysses_train.planner.options import PlanOptions
from ulysses_train.planner.shapes import load_model_shape

H, D, HIDDEN = 32, 128, 2304
"""Kimi-Linear-48B-A3B: 32 KDA heads of 128 (Kd = Vd = 4096), hidden 2304; MLA: 32 heads, q/k 128 + 64, v 128."""


@pytest.fixture(scope="module")
def kimi():
    return load_model_shape("kimi-linear-48b-a3b")


def test_shape_reads_kinds_and_widths(kimi):
    assert kimi.kinds.count("kimi_delta") == 20 and kimi.kinds.count("attention") == 7 and kimi.kinds[3] == "attention"
    assert (kimi.heads, kimi.kv_heads, kimi.head_dim, kimi.value_head_dim) == (32, 32, 192, 128)
    assert not kimi.output_gate and not kimi.head_norms  # the KDA layers' q_proj is no attention output gate
    assert delta_rule_heads(kimi) == (H, H, D, D) and kimi.attention_latent == (512, 128) and kimi.attention_layers == [3, 7, 11, 15, 19, 23, 26]
    assert kimi.attention_output_width == 32 * 128 and kimi.attention_flop_width == 32 * (192 + 128) // 2


def test_kda_terms_by_hand(kimi):
    o = PlanOptions(seq_length=65536, gpus_per_node=1)
    kd = vd = H * D
    conv, gate_inputs = 2 * 3 * kd, 2 * 2 * D + 2 * H
    rule = 2 * 2 * kd + 4 * 2 * H + 2 * vd + 2 * kd + 2 * 2 * 64 * H  # q, k, rstd, v, raw gate, Aqk and Akk
    norm = 16 * vd + 2 * vd  # transformers' fp32 gated norm, its bf16 output
    assert kda_saved_per_token(kimi, o) == conv + gate_inputs + rule + norm == 140_096
    states = 2 * H * D * D / 64
    recomputed = 4 * kd + 3 * 2 * kd + 2 * vd + states + 2 * vd  # g (fp32), w qg kg, u, h, v_new
    gradients = 2 * 4 * 64 * H + states + 2 * vd + 6 * 4 * kd + 4 * H * 5  # dAqk dAkk, dh, dv, fp32 x6, db
    assert kda_backward_extra_per_token(kimi, o) == recomputed + gradients + 2 * vd - norm == 148_096  # do
    assert kda_exchange_width(kimi) == 3 * kd + kd + H  # q, k, v, raw gate, beta
    # negative control: read as a Gated DeltaNet (one decay per head, no raw gate kept, Qwen's gated norm) it differs
    assert gated_deltanet_saved_per_token(kimi, o) != kda_saved_per_token(kimi, o)


def test_mla_attention_takes_its_head_widths(kimi):
    o, sp8 = PlanOptions(seq_length=65536, gpus_per_node=1), PlanOptions(seq_length=131072, gpus_per_node=8, sp=8)
    q = k = 32 * 192
    v = out = 32 * 128
    latent_norm = (4 + 2 + 2) * 512 + 4  # fp32 upcast and scale, normalized rows, output (kv_lora_rank 512)
    nope_keys = 2 * 32 * 128  # the rest of kv_b_proj's output, kept alive by the kernel's v (a view of it)
    assert attention_saved_per_token(kimi, o) == 2 * (q + k + v) + 2 * out + 4 * 32 + latent_norm + nope_keys
    # under sp: o_proj's input from the reverse exchange; v is the exchange's own tensor
    assert attention_saved_per_token(kimi, sp8) == 2 * (q + k + v) + 2 * out + 4 * 32 + latent_norm + 2 * out
    assert attention_backward_extra_per_token(kimi, o) == 2 * (q + k + v) + 4 * q + 2 * out + 4 * 32
    assert attention_exchange_width(kimi, o) == q + k + v  # one message carries q, k and v (attention_exchange.own_exchange_attention)
    # negative control: one head width (the config's head_dim, the rotary part) plans far less
    rotary_only = dataclasses.replace(kimi, head_dim=64, value_head_dim=0, attention_latent=())
    assert attention_saved_per_token(rotary_only, o) < attention_saved_per_token(kimi, o) / 2
    assert attention_exchange_width(rotary_only, o) == 32 * 64


def test_a_kimi_plan_weighs_both_layer_kinds(kimi):
    """Without checkpointing every layer keeps what it saves: the mean over 20 KDA and 7 MLA layers; with it the
    worst recomputed layer is whichever kind's backward holds more (here the KDA layer's)."""
    o = PlanOptions(seq_length=131072, gpus_per_node=8, sp=8)
    step = plan(kimi, options=o)
    names = [c.name for c in step.components]
    assert "layer: Kimi Delta Attention backward" in names and "layer: attention backward" not in names
    attn = sum(c.attn for c in layer_transients(kimi, o.replace(low_memory_rmsnorm=False), "attention"))
    kda = sum(c.attn for c in layer_transients(kimi, o.replace(low_memory_rmsnorm=False), "kimi_delta"))
    assert kda > attn
    assert plan(kimi, options=o.replace(seq_length=32768, gradient_checkpointing=False)).gpu_allocated > 0


def test_mixer_memory_script_runs_on_cpu(capsys, monkeypatch, tmp_path):
    """benchmarks/mixer_memory.py's plumbing (build, install, measure, plan, table, JSON) at a tiny length on CPU;
    its numbers are not checked here (transformers' torch functions save other tensors than fla's kernels). A run
    stopped during a later mixer (a device command's time limit while its kernels compile) keeps the rows
    measured before it in its JSON."""
    from helpers import load_script

    monkeypatch.setitem(sys.modules, "mixer_memory", None)  # restored after the test
    script = load_script("benchmarks/mixer_memory.py", modules=sys.modules)  # its dataclass looks its module up
    written = tmp_path / "rows.json"
    result = script.main(["--device", "cpu", "--json", str(written)])
    assert [r["mixer"] for r in result["rows"]] == ["kimi KDA", "kimi MLA", "olmo-hybrid GDN", "nemotron Mamba2",
                                                       "glm-5.2 DSA"]
    assert all(r["saved_per_token"] > 0 and r["planned_backward_extra_per_token"] > 0 for r in result["rows"])
    assert "planned" in capsys.readouterr().out
    assert json.loads(written.read_text())["rows"] == json.loads(json.dumps(result["rows"]))

    measure = script.row

    def stopped_at_olmo(case, length, device):
        if case.name.startswith("olmo"):
            raise TimeoutError("stopped while its kernels compile")
        return measure(case, length, device)

    monkeypatch.setattr(script, "row", stopped_at_olmo)
    kept = tmp_path / "stopped.json"
    with pytest.raises(TimeoutError):
        script.main(["--device", "cpu", "--json", str(kept)])
    assert [r["mixer"] for r in json.loads(kept.read_text())["rows"]] == ["kimi KDA", "kimi MLA"]


def test_flash_qla_is_planned_for_the_gated_deltanet_only(kimi, monkeypatch):
    """FlashQLA runs Gated DeltaNet's rule, never KDA's: on a GPU run where fla would hand the rule to it (faked
    here), Qwen3.5's mixer kernels are FlashQLA's and Kimi Linear's KDA is fla's own (their delta-rule widths once
    stood in a shared field that both mixers filled). Off a GPU both are transformers' torch functions."""
    from ulysses_train.model.mixers import choose_mixer_kernels, gated_deltanet_kernels, kimi_delta, recurrent

    monkeypatch.setattr(recurrent, "fla_available", lambda: True)
    monkeypatch.setattr(gated_deltanet_kernels, "flash_qla_choice", lambda key_dim, value_dim: (True, ""))
    monkeypatch.setattr(kimi_delta, "kda_kernels_available", lambda: True)
    assert choose_mixer_kernels(load_model_shape("qwen3.5-9b"), cuda=True) == {"gated_deltanet": "flash_qla"}
    assert choose_mixer_kernels(kimi, cuda=True) == {"kimi_delta": "fla"}
    assert choose_mixer_kernels(kimi, cuda=False) == {"kimi_delta": "torch"}
    monkeypatch.setattr(gated_deltanet_kernels, "flash_qla_choice", lambda key_dim, value_dim: (False, "no"))
    # the control: FlashQLA's own verifier is what decides
    assert choose_mixer_kernels(load_model_shape("qwen3.5-9b"), cuda=True) == {"gated_deltanet": "fla"}
