"""scripts/plan.py --lora-rank / --lora-targets: the plan of a LoRA run (only the adapters train) with the adapter
count the trainer plans with (lora.lora_parameter_count on the model as PEFT adapts it), against the planner
called directly; bad LoRA flags are one line and exit 2. In process (main(argv)), as tests/test_planner.py does."""
import json

import pytest
from helpers import load_script

from ulysses_train.constants import GIB
from ulysses_train.planner import PlanOptions, max_length, plan

pytest.importorskip("peft")

QWEN35_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv",
                  "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"]
QWEN35_ADAPTERS = 43_278_336  # r=16 on these 12 of Qwen3.5-9B: what PEFT injects (tests/test_lora.py checks the rule)
ONE_GPU = ["--model", "qwen3.5-9b", "--seq-length", "131072", "--gpus-per-node", "1", "--max-length", "--no-story"]


def planned(tmp_path, name, extra=(), status=0):
    out = tmp_path / f"{name}.json"
    assert load_script("scripts/plan.py").main([*ONE_GPU, *extra, "--json", str(out)]) == status
    return json.loads(out.read_text())


def test_lora_plan_counts_the_adapters_and_equals_the_planner_called_directly(tmp_path, capsys):
    """The JSON and the printed line carry 43,278,336 adapters; the plan and the longest length are the planner's
    own with PlanOptions(adapter_params=lora_parameter_count(...)); the same command without LoRA (the negative
    control: a full fine-tune, whose gradients and optimizer states are every weight's) plans more memory and
    does not fit, where LoRA fits."""
    from ulysses_train.model.lora import lora_parameter_count
    from ulysses_train.model.presets import preset_config

    lora = planned(tmp_path, "lora", ["--lora-rank", "16", "--lora-targets", ",".join(QWEN35_TARGETS)])
    assert "LoRA: 43,278,336 adapter parameters train (rank 16, 12 target modules: " in capsys.readouterr().out
    full = planned(tmp_path, "full", status=1)  # AdamW's states of every weight: does not fit one GPU
    adapters = lora_parameter_count(preset_config("qwen3.5-9b"), {"r": 16, "target_modules": QWEN35_TARGETS})
    assert lora["lora"]["adapter_params"] == lora["plan"]["options"]["adapter_params"] == adapters == QWEN35_ADAPTERS
    options = PlanOptions(seq_length=131072, gpus_per_node=1, adapter_params=adapters)
    assert lora["plan"]["gpu_total_gib"] == pytest.approx(plan("qwen3.5-9b", options=options).gpu_total / GIB)
    assert lora["max_length"] == max_length("qwen3.5-9b", options)
    assert "lora" not in full and full["plan"]["options"]["adapter_params"] == 0
    assert full["plan"]["gpu_total_gib"] > lora["plan"]["gpu_total_gib"] + 10  # fp32 grads and states of 9B gone
    assert full["max_length"] < lora["max_length"] and not full["plan"]["fits"] and lora["plan"]["fits"]


@pytest.mark.parametrize("flags, message", [
    (["--lora-rank", "16", "--lora-targets", "qkv,proj_q"],
     "--lora-targets=['proj_q', 'qkv'] names no module of this model; its linear layers are down_proj, gate_proj, "
     "in_proj_a"),
    (["--lora-rank", "0"], "--lora-rank=0 must be a positive integer (the adapters' rank)."),
    (["--lora-targets", "q_proj"], "--lora-targets plans LoRA adapters and needs their rank. Fix: add --lora-rank"),
])
def test_bad_lora_flags_are_one_line(flags, message, capsys):
    assert load_script("scripts/plan.py").main([*ONE_GPU, *flags]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


def test_lora_lines_name_only_targets_the_model_has_and_the_layers_left_without_adapters():
    """Nemotron-H under the default targets: its MLPs have no gate_proj, and its Mamba2 layers hold none of the
    targets. The model-changes phrase names the targets that matched and the layer kind left without adapters,
    with its linear layers; plan.py's line names the same targets. Control: Qwen3, where every default target
    exists and every layer holds adapters, gets neither note."""
    from helpers import NEMOTRON_H, tiny_family_config, tiny_qwen3_config
    from transformers import AutoModelForCausalLM

    from ulysses_train.model.lora import apply_lora

    config = tiny_family_config("nemotron_h", **NEMOTRON_H)
    phrase = apply_lora(AutoModelForCausalLM.from_config(config), {"r": 4}, seed=0)
    assert phrase.startswith("LoRA r=4 on down_proj, k_proj, o_proj, q_proj, up_proj, v_proj (") and "gate" not in phrase
    assert phrase.endswith("; no adapter in the 1 linear_attention layers (their linear layers, in_proj, out_proj, "
                           "are not targets: add them to model.lora.target_modules, or all-linear, to train them)")
    line = load_script("scripts/plan.py").lora_adapters(config, {"r": 4})["line"]
    assert line.endswith("(rank 4, 6 target modules: down_proj, k_proj, o_proj, q_proj, up_proj, v_proj)")
    control = apply_lora(AutoModelForCausalLM.from_config(tiny_qwen3_config()), {"r": 4}, seed=0)
    assert "gate_proj" in control and "no adapter" not in control


def test_lora_on_fused_experts_counts_peft_adapters_and_plans_the_merged_weights():
    """PEFT (>= 0.21) turns gate_proj / up_proj / down_proj targets into adapters on a mixture of experts' fused
    tensors, whose merged weights W + B @ A it builds whole (measured: Kimi K2's expert layer, benchmarks/RESULTS.md).
    lora.lora_plan_fields reads them off the tiny DeepSeek-V3 built on the meta device: by hand 4 experts x 2 x 32 x
    64 (gate_up_proj) and 4 x 64 x 32 (down_proj); the planner adds 2 x total - largest of them at the MLP moment
    (leaf_blocks.merged_adapter_weights). Control: attention-only targets adapt no fused tensor, and their count is
    r x (in + out) of each adapted linear layer by hand; the rule this replaced (the linear layers the targets
    name) counts the dense MLPs PEFT no longer adapts and none of the experts' adapters."""
    import dataclasses

    from helpers import TINY_SHAPE, tiny_family_config
    from test_latent_attention import DEEPSEEK_V3

    from ulysses_train.model.lora import lora_plan_fields
    from ulysses_train.planner.leaf_blocks import merged_adapter_weights
    from ulysses_train.planner.shapes import load_model_shape

    config = tiny_family_config("deepseek_v3", **DEEPSEEK_V3)
    h, experts, width = TINY_SHAPE["hidden_size"], 4, 32
    fields = lora_plan_fields(config, {"r": 4})
    gate_up, down = experts * 2 * width * h, experts * h * width
    assert fields["lora_merged_params"] == (gate_up + down, gate_up)
    shape = load_model_shape(config)
    options = PlanOptions(seq_length=256, sp=2, gpus_per_node=2, **fields)
    assert merged_adapter_weights(shape, options) == 2 * (2 * (gate_up + down) - gate_up)
    assert merged_adapter_weights(dataclasses.replace(shape, experts=0), options) == 0
    attention = lora_plan_fields(config, {"r": 4, "target_modules": ["q_a_proj", "o_proj"]})
    q_a, o_proj = (h, DEEPSEEK_V3["q_lora_rank"]), (TINY_SHAPE["num_attention_heads"] * DEEPSEEK_V3["v_head_dim"], h)
    assert attention == {"adapter_params": config.num_hidden_layers * 4 * (sum(q_a) + sum(o_proj)),
                         "lora_merged_params": ()}
    from peft.tuners.tuners_utils import check_target_module_exists

    from ulysses_train.model.lora import _meta_linears, lora_config

    linear_rule = sum(4 * (m.in_features + m.out_features) for name, m in _meta_linears(config)
                      if check_target_module_exists(lora_config({"r": 4}), name))
    assert linear_rule != fields["adapter_params"]


def test_a_run_too_big_for_its_nodes_is_told_the_fewest_nodes_that_fit(capsys):
    """GLM-5.3-Flash with LoRA at 1,048,576 tokens on one node of 8 x 141 GiB does not fit; the refusal names the
    fewest nodes on which it fits at that length (doubling: 4, sp=32 across nodes), and the planner called
    directly (one adapter parameter standing for LoRA's few) fits 4 nodes and no lever setting of 2. Controls: a plan that fits prints no such line, and one that fits
    on no node count up to MOST_NODES (Qwen3-8B at 2**33 tokens) says so without it."""
    from ulysses_train.planner import load_model_shape
    from ulysses_train.planner.estimate import estimate
    from ulysses_train.planner.search import _lever_settings

    script = load_script("scripts/plan.py")
    base = ["--gpus-per-node", "8", "--sp", "8", "--gpu-gib", "141", "--host-gib", "560", "--no-story"]
    assert script.main(["--model", "glm-5.3-flash", "--seq-length", "1048576", "--lora-rank", "16", *base]) == 1
    out = capsys.readouterr().out
    assert "Fewest nodes at this length: 4 nodes of 8 GPUs (sp=32 across nodes: parallel.allow_sp_across_nodes=true" \
           in out, out[-600:]
    m = load_model_shape("glm-5.3-flash")
    for nodes, fits in ((2, False), (4, True)):
        options = PlanOptions(seq_length=1048576, sp=8, gpus_per_node=8, nodes=nodes, gpu_memory_gib=141,
                              host_memory_gib=560, allow_sp_across_nodes=True, adapter_params=1)
        assert any(estimate(m, o).fits for _, _, o in _lever_settings(m, options)) == fits, nodes
    assert script.main(["--model", "qwen3-8b", "--seq-length", "131072", *base]) == 0
    assert "Fewest nodes" not in capsys.readouterr().out
    assert script.main(["--model", "qwen3-8b", "--seq-length", str(2 ** 33), *base]) == 1
    out = capsys.readouterr().out
    assert "does not fit" in out and "Fewest nodes" not in out
