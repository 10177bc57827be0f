"""benchmarks/emulated_depth.py and benchmarks/row_plan.py: an emulated rank's reduced-depth rows taken to the model's
full depth (seconds per layer kind, fitted to the layers each depth builds) and set beside the planner's plan.
References: per-kind seconds by hand, a planner plan of a config folder read as a user would; controls: depths
that cannot separate the kinds are refused, a row 20% over its plan fails the 10% check."""
import json
import os
import sys

import pytest

from helpers import REPO
from ulysses_train.constants import GIB


def test_full_depth_from_two_depths_by_hand():
    """benchmarks/emulated_depth.py: times on the line through the two depths (Qwen3-8B: 36 layers), memory the
    deeper measurement plus the planner's difference (a stub planner here: 1 GiB GPU and 2 GiB host per layer)."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from emulated_depth import full_depth

    def row(layers, seconds, a2a, zero3, gpu, host):
        return {"model": "qwen3-8b", "layers": layers, "length": 1 << 20, "sp": 8, "optimizer": "cpu",
                "s_per_step": seconds, "peak_gpu_gib": gpu, "peak_host_gib": host,
                "run_levers": {"cpu_checkpointing": True, "activation_offload_fraction": 1.0, "tiled_mlp": True,
                               "keep_attention_fraction": 0.0, "loss": "chunked"},
                "emulated": {"ulysses_all_to_all_s": a2a, "zero3_collectives_s": zero3}}

    records = []

    def stub(record):
        records.append(record)
        return 10.0 + record["num_hidden_layers"], 5.0 + 2.0 * record["num_hidden_layers"]

    deep = {**row(2, 20.0, 0.2, 0.06, 17.0, 8.0), "plan_kernels": {"swiglu_kernel": True, "flash_qla": True}}
    got = full_depth([row(1, 11.0, 0.1, 0.05, 15.0, 7.0), deep], plan_gib=stub)
    # the planner is asked about the kernels the deeper row ran (its plan_kernels; a row's one-kernel flag as the
    # mixer's variant), at both depths
    assert [(r["num_hidden_layers"], r["swiglu_kernel"], r["mixer_kernels"]) for r in records] == [
        (2, True, {"gated_deltanet": "flash_qla"}), (36, True, {"gated_deltanet": "flash_qla"})]
    assert got["layers"] == 36 and got["compute_s"] == pytest.approx(2.0 + 36 * 9.0)
    assert got["ulysses_s"] == pytest.approx(3.6) and got["zero3_s"] == pytest.approx(0.04 + 36 * 0.01)
    assert got["predicted_step_s"] == [pytest.approx(round(326.0 + 3.6, 1)), pytest.approx(round(329.6 + 0.4, 1))]
    assert got["gpu_gib"] == pytest.approx(17.0 + 34) and got["host_gib_per_node"] == pytest.approx(8 * (8.0 + 68))


def test_a_hybrid_at_full_depth_from_its_layer_kinds_by_hand():
    """Nemotron 3 Nano (52 layers: 23 Mamba2, 23 expert layers, 6 attention) from rows at depths 4, 7 and 14 made
    of per-kind seconds (fixed 2, Mamba2 0.5, experts 0.7, attention 5): the fit recovers 2 + 23 x 0.5 + 23 x 0.7 +
    6 x 5 exactly. Controls: depths 7 and 14 alone (Mamba2 and experts 3:3 then 6:6, attention 1 then 2) are
    refused, as the line through them would count 52 / 7 attention layers where the model has 6."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from emulated_depth import full_depth, kind_counts

    seconds = {"mamba2": 0.5, "no mixer": 0.7, "attention": 5.0}
    model = "nemotron-3-nano-30b-a3b"

    def row(layers):
        step = 2.0 + sum(seconds[k] * n for k, n in kind_counts(model, layers).items())
        return {"model": model, "layers": layers, "length": 1 << 20, "sp": 8, "optimizer": "gpu",
                "s_per_step": step, "peak_gpu_gib": 100.0, "peak_host_gib": 40.0,
                "run_levers": {"cpu_checkpointing": True, "activation_offload_fraction": 1.0, "tiled_mlp": False,
                               "keep_attention_fraction": 1.0, "loss": "chunked"},
                "emulated": {"ulysses_all_to_all_s": 0.1 * kind_counts(model, layers)["attention"],
                             "zero3_collectives_s": 0.01 * layers}}

    got = full_depth([row(14), row(4), row(7)], plan_gib=lambda record: (1.0, 1.0))
    assert got["measured_layers"] == [4, 7, 14] and got["layers"] == 52
    assert got["compute_s"] == pytest.approx(2.0 + 23 * 0.5 + 23 * 0.7 + 6 * 5.0)
    assert got["ulysses_s"] == pytest.approx(0.6) and got["zero3_s"] == pytest.approx(0.52)
    with pytest.raises(SystemExit, match="cannot predict"):
        full_depth([row(7), row(14)], plan_gib=lambda record: (1.0, 1.0))
    line = row(7)["s_per_step"] + (row(14)["s_per_step"] - row(7)["s_per_step"]) * (52 - 7) / 7
    assert abs(line - got["compute_s"]) > 5  # what the refused line would have said


def test_reduced_gemma4_depths_are_counted_as_built_with_their_last_layer_global():
    """transformers makes a Gemma 4's last layer global whatever its pattern says, so bench.py --layers 1, 5 and 6
    of Gemma-4-31B each hold one global layer (1 + 0, 4 + 1, 5 + 1): those depths cannot separate the global
    layer from the fixed part and are refused, and adding 7 layers (5 + 2) fits per-kind seconds exactly (the
    measured rows of benchmarks/RESULTS.md). Negative control: counting the pattern's prefix (5 sliding at 5
    layers, no global below 6) accepts 1, 5, 6 and gets the global layers' seconds wrong."""
    import numpy as np

    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from emulated_depth import fit_at_depth, kind_counts

    model, sliding, globe = "gemma-4-31b", "attention window 1024", "attention"
    assert [dict(kind_counts(model, n)) for n in (1, 5, 7)] == [{globe: 1}, {sliding: 4, globe: 1},
                                                                  {sliding: 5, globe: 2}]
    step = lambda n: 1.0 + 0.35 * kind_counts(model, n)[sliding] + 22.0 * kind_counts(model, n)[globe]  # noqa: E731
    with pytest.raises(SystemExit, match="cannot predict"):
        fit_at_depth([1, 5, 6], [step(n) for n in (1, 5, 6)], model)
    assert fit_at_depth([1, 5, 6, 7], [step(n) for n in (1, 5, 6, 7)], model) == pytest.approx(
        1.0 + 50 * 0.35 + 10 * 22.0)
    prefix = {1: (1, 0), 5: (5, 0), 6: (5, 1)}  # (sliding, global) of the pattern's first layers
    rows = np.array([[1.0, *prefix[n]] for n in (1, 5, 6)])
    weights = np.linalg.solve(rows.T, np.array([1.0, 50, 10]))
    assert abs(weights @ np.array([step(n) for n in (1, 5, 6)]) - (1.0 + 50 * 0.35 + 10 * 22.0)) > 100


def test_row_plan_compares_a_reduced_depth_row_with_the_plan_of_that_model(tmp_path):
    """benchmarks/row_plan.py on a Nemotron 3 Nano row at 7 layers and 131,072 tokens (every lever, AdamW on the
    GPU, chunk_gla's terms): its plan equals the planner's plan of a config folder with those 7 layers, read as a
    user would (`plan.py --model FOLDER`). Exit 0 within 10%; 1 for a row 20% over (the control)."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import row_plan

    from ulysses_train.model.presets import save_preset_config
    from ulysses_train.planner.estimate import plan
    from ulysses_train.planner.options import PlanOptions

    folder = save_preset_config("nemotron-3-nano-30b-a3b", str(tmp_path / "nano7"), num_hidden_layers=7)
    options = PlanOptions(seq_length=131072, sp=1, gpus_per_node=1, offload_activations=True,
                          activation_offload_fraction=1.0, tiled_mlp=True, keep_attention_fraction=1.0,
                          chunked_loss=True, attention_kernel="sdpa", mixer_kernels={"mamba2": "chunk_gla"})
    expected = plan(folder, options=options).gpu_allocated / GIB
    row = {"model": "nemotron-3-nano-30b-a3b", "layers": 7, "length": 131072, "sp": 1, "optimizer": "gpu",
           "status": "ok", "s_per_step": 3.0, "tflops_per_gpu": 400.0, "peak_host_gib": 9.0,
           "run_levers": {"cpu_checkpointing": True, "activation_offload_fraction": 1.0, "tiled_mlp": True,
                          "keep_attention_fraction": 1.0, "loss": "chunked"},
           "plan_kernels": {"attention_kernel": "sdpa", "mamba2_channel_decay": True}}
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps([{**row, "peak_gpu_gib": round(expected * 1.05, 2)}]))
    assert row_plan.main([str(rows), "--json", str(tmp_path / "out.json")]) == 0
    (got,) = json.loads((tmp_path / "out.json").read_text())
    assert got["planned_gpu_gib"] == pytest.approx(expected, abs=0.01)
    assert got["gpu_ratio"] == pytest.approx(1.05, abs=1e-3)
    rows.write_text(json.dumps([{**row, "peak_gpu_gib": round(expected * 1.2, 2)}]))
    assert row_plan.main([str(rows)]) == 1


def test_a_lora_row_is_planned_with_its_adapters_at_the_depth_it_ran():
    """A LoRA row's planner record trains its adapters: Qwen3-0.6B's default targets (q, k, v, o, gate, up, down)
    at rank 8 over 2 layers are 8 x (3,072 + 2 x 2,048 + 3,072 + 2 x 4,096 + 4,096) x 2 = 360,448 parameters by hand;
    a full fine-tune's record has none (the control: its plan holds AdamW for every parameter)."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from emulated_depth import planner_record

    from ulysses_train.planner.estimate import plan_for_record

    levers = {"cpu_checkpointing": False, "activation_offload_fraction": 0.0, "tiled_mlp": False,
              "keep_attention_fraction": 0.0, "loss": "chunked"}
    row = {"model": "qwen3-0.6b", "length": 4096, "sp": 1, "optimizer": "gpu", "attn": "sdpa",
           "run_levers": {**levers, "lora": True, "lora_settings": {"r": 8}}}
    lora = planner_record(row, 2)
    full = planner_record({**row, "run_levers": {**levers, "lora": False, "lora_settings": {}}}, 2)
    assert lora["adapter_params"] == 360_448 and "adapter_params" not in full
    assert plan_for_record(lora).gpu_allocated < plan_for_record(full).gpu_allocated - 2 * GIB


def test_deepseek_v3_cut_to_its_dense_layers_is_planned_without_experts():
    """DeepSeek-V3's first 3 layers are dense (first_k_dense_replace): a 3-layer cut is planned with the dense
    layer's parameters and no experts (the 131,072-token sp=8 row: 17.43 GiB measured, benchmarks/RESULTS.md), a
    4-layer cut with its expert layer (the control: 256 experts, 11.5B parameters in that layer)."""
    from ulysses_train.planner.shapes import reduced_depth_shape

    dense, with_experts = reduced_depth_shape("deepseek-v3", 3), reduced_depth_shape("deepseek-v3", 4)
    assert dense.experts == 0 and dense.layer_params == 583_483_392
    assert with_experts.experts == 256 and with_experts.layer_params == 11_507_286_016
