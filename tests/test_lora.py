"""LoRA through PEFT (`model.lora`, ulysses_train/model/lora.py): on 2 and 4 gloo processes (sp=2, sp=2 x dp=2, and
sp=2 with every memory lever) the adapters' loss, gradients and weights after one SGD step equal a plain
single-process PEFT model's (`get_peft_model` on the Hugging Face model, fp32; loss < 1e-5, gradients < 1e-4),
with the same initial adapter weights. Only the adapters train. Negative control: without the Ulysses
all-to-all the adapter gradients differ. Also: the adapter export loads with PeftModel.from_pretrained, the
merged export equals PEFT's own merge, bad settings are named."""
import json

import pytest
import torch
from helpers import (assert_step_matches, make_samples, run_workers, save_tiny_model, sgd_reference, tiny_qwen3_config,
                     worst_relative_error, write_ds_config)

from ulysses_train.config import ConfigError, load_config
from ulysses_train.model import lora

pytest.importorskip("peft")

LR = 0.1
LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
        "init_lora_weights": False}  # lora_B drawn at random: every adapter weight has a gradient at step 0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("lora") / "model"), tie_word_embeddings=False)


def peft_reference(model_dir, samples, initial, targets=LORA["target_modules"]):
    """A plain PEFT model (independent of ulysses_train) with the run's initial adapter weights: token-weighted
    cross-entropy over all samples, the adapters' gradients and their weights after one SGD step."""
    from peft import LoraConfig, get_peft_model

    from test_indexed_attention import plain_model  # SDPA, or eager where the classes take nothing else (HY-V4)

    model = get_peft_model(plain_model(model_dir), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets))
    named = {n.removeprefix("base_model.model."): p for n, p in model.named_parameters() if p.requires_grad}
    assert sorted(named) == sorted(initial)
    with torch.no_grad():
        for name, p in named.items():
            p.copy_(initial[name])
    return sgd_reference(model, [(s["input_ids"], s["labels"]) for s in samples], LR, named)


def lora_step(tmp_path, model_dir, nproc, sp, samples, extra=(), offload=False, settings=LORA):
    data = str(tmp_path / "data.pt")
    torch.save(samples, data)
    ds = write_ds_config(str(tmp_path / "ds.json"), offload_activations=offload)
    out = str(tmp_path / "out.pt")
    gas = len(samples) // (nproc // sp)
    run_workers(nproc, ["--model-dir", model_dir, "--data", data, "--ds-config", ds, "--out", out, "--lr", str(LR),
                        "--set", f"parallel.sequence_parallel_size={sp}", "--set", f"train.gradient_accumulation_steps={gas}",
                        "--set", f"model.lora={json.dumps(settings)}", *extra])
    return torch.load(out)


@pytest.mark.parametrize("nproc,sp,levers", [(2, 2, False), (4, 2, False), (2, 2, True)],
                         ids=["sp2", "sp2xdp2", "sp2-levers"])
def test_lora_step_equals_a_plain_peft_model(tmp_path, model_dir, nproc, sp, levers):
    samples = make_samples(2, 30, vocab=256, masked_prefix=12)
    extra = ["--set", "model.keep_attention_fraction=1.0", "--set", "model.tiled_mlp=true"] if levers else []
    result = lora_step(tmp_path, model_dir, nproc, sp, samples, extra, offload=levers)
    assert result["grads"] and all(lora.is_adapter_key(n) for n in result["grads"])  # only adapters train
    loss_error, grad_error = assert_step_matches(result, *peft_reference(model_dir, samples, result["initial"]))
    # the planner's adapter count, taken with the engine's ZeRO-3 config alive (bench plans its rows then),
    # equals what trains
    assert result["zero3_alive"] and result["planned_adapters"] == sum(t.numel() for t in result["initial"].values())
    print(f"loss rel err {loss_error:.1e}, worst adapter grad rel err {grad_error:.1e}")


def test_lora_on_the_mlp_only_with_tiled_mlp_equals_a_plain_peft_model(tmp_path, model_dir):
    """Adapters on the MLP projections only, tiled: nothing trainable comes before the first layer's MLP, and
    the tiled MLP is a ZeRO-3 leaf module whose gradients a module backward hook reduces, which must fire after
    the MLP's backward (a hook on a module whose inputs need no gradient would fire before it)."""
    settings = {**LORA, "target_modules": ["gate_proj", "down_proj"]}
    samples = make_samples(2, 30, vocab=256, masked_prefix=12)
    result = lora_step(tmp_path, model_dir, 2, 2, samples, ["--set", "model.tiled_mlp=true"], settings=settings)
    assert_step_matches(result, *peft_reference(model_dir, samples, result["initial"], settings["target_modules"]))


def test_adapter_count_holds_with_a_zero3_config_alive(model_dir):
    """lora_parameter_count in a process whose ZeRO-3 DeepSpeed config is alive (as after build_engine, where bench
    plans its rows) equals the count without it; the meta-device build through transformers' from_config fails
    there (the negative control: what the count did before architecture.causal_lm_on_meta)."""
    import os

    from transformers import AutoConfig

    script = os.path.join(os.path.dirname(__file__), "meta_build_worker.py")
    line = run_workers(1, [model_dir, json.dumps(LORA)], script=script).stdout.strip().splitlines()[-1]
    beside_zero3 = json.loads(line)
    assert beside_zero3["zero3"] and "meta tensor" in beside_zero3["from_config_failure"]
    assert beside_zero3["adapters"] == lora.lora_parameter_count(AutoConfig.from_pretrained(model_dir), LORA) > 0


def test_negative_control_lora_without_the_all_to_all_differs(tmp_path, model_dir):
    samples = make_samples(2, 30, vocab=256, masked_prefix=12)
    result = lora_step(tmp_path, model_dir, 2, 2, samples, ["--no-ulysses"])
    _, grads, _, _ = peft_reference(model_dir, samples, result["initial"])
    err, _ = worst_relative_error(result["grads"], grads)
    print(f"without the all-to-all: worst adapter grad rel err {err:.1e}")
    assert err > 1e-2


# ---------------------------------------------------------------- one process: export, counts, settings


def injected(seed=0, **settings):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen3_config(tie_word_embeddings=False), dtype=torch.float32)
    lora.apply_lora(model, {**LORA, **settings}, seed)
    return model


def test_the_planner_count_of_a_hybrid_is_what_peft_trains():
    """Qwen3.5 (a Gated DeltaNet layer and an attention layer) with adapters on the attention, MLP and Gated DeltaNet
    projections, and with all-linear: the planner's count is what PEFT injects. Negative control: the Llama-style
    formula this replaced (q/k/v/o and the MLP in every layer) counts otherwise."""
    from transformers import AutoModelForCausalLM

    from helpers import tiny_family_config

    config = tiny_family_config("qwen3_5_text", layer_types=["linear_attention", "full_attention"],
                                num_hidden_layers=2)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv",
               "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"]
    for settings in ({"r": 4, "target_modules": targets}, {"r": 2, "target_modules": "all-linear"}):
        model = AutoModelForCausalLM.from_config(config)
        lora.apply_lora(model, settings, seed=0)
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert trained == lora.lora_parameter_count(config, settings) > 0, settings
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    h, i = config.hidden_size, config.intermediate_size
    llama_formula = 4 * 2 * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h))
    assert lora.lora_parameter_count(config, {"r": 4, "target_modules": targets}) != llama_formula


def test_only_adapters_train_and_the_planner_count_is_exact():
    model = injected()
    trained = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(lora.is_adapter_key(n) for n in trained)
    assert sum(trained.values()) == lora.lora_parameter_count(tiny_qwen3_config(), LORA)
    # the same seed draws the same adapters (every rank), another seed other ones
    first, again, other = injected(seed=1), injected(seed=1), injected(seed=2)
    name = next(n for n in trained if "lora_B" in n)
    pick = lambda m: dict(m.named_parameters())[name]  # noqa: E731
    assert torch.equal(pick(first), pick(again)) and not torch.equal(pick(first), pick(other))


def test_merged_export_equals_peft_merge_and_the_adapter_folder_loads(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir = save_tiny_model(str(tmp_path / "base"), tie_word_embeddings=False)
    ours = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora.apply_lora(ours, LORA, seed=3)
    state = ours.state_dict()
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours(input_ids=ids).logits
    lora.save_adapter(state, LORA, model_dir, str(tmp_path / "adapter"))
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    with torch.no_grad():
        assert (loaded(input_ids=ids).logits - expected).abs().max() < 1e-5
    merged_by_peft = loaded.merge_and_unload().state_dict()
    merged = lora.merged_state(state, LORA)
    assert sorted(merged) == sorted(merged_by_peft)
    assert max((merged[k] - merged_by_peft[k]).abs().max().item() for k in merged) < 1e-6
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert max((merged[k] - plain.state_dict()[k]).abs().max().item() for k in merged) > 1e-3  # negative control


@pytest.mark.parametrize("settings, message", [
    ({"r": 0}, r"model.lora.r=0 must be a positive integer"),
    ({"rank": 4}, r"model.lora is not a valid PEFT LoRA config.*rank"),
])
def test_bad_lora_settings_are_named(settings, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"model.lora={json.dumps(settings)}"])
    with pytest.raises(ConfigError, match="model.lora_export='both' is not valid"):
        load_config(None, ["model.lora_export=both"])


def family_lora_step_matches_peft(tmp_path, config, targets: list, adapted: str, extra_args=()) -> dict:
    """One sp=2 LoRA step of a tiny model of `config` with adapters on `targets` (one of whose adapter names holds
    `adapted`), compared with a plain PEFT model (loss and every adapter gradient); the step's result."""
    model_type = config.model_type
    model_dir = save_tiny_model(str(tmp_path / model_type), config=config)
    settings = {**LORA, "target_modules": targets}
    samples = make_samples(1, 60, vocab=256, masked_prefix=12)
    result = lora_step(tmp_path, model_dir, 2, 2, samples, list(extra_args), settings=settings)
    assert any(adapted in n for n in result["grads"]) and all(lora.is_adapter_key(n) for n in result["grads"])
    loss_error, grad_error = assert_step_matches(result, *peft_reference(model_dir, samples, result["initial"],
                                                                         targets))
    print(f"{model_type} LoRA sp=2: loss rel err {loss_error:.2e}, worst adapter grad rel err {grad_error:.2e} "
          f"({len(result['grads'])} adapter tensors)")
    return result


def test_lora_on_gated_deltanet_projections_equals_a_plain_peft_model(tmp_path):
    """Qwen3.5 (a Gated DeltaNet layer and a gated attention layer) at sp=2: adapters on the linear-attention
    projections (before and after its all-to-alls) and on the attention's, against a plain PEFT model."""
    from helpers import tiny_family_config

    config = tiny_family_config("qwen3_5_text", head_dim=16, linear_num_key_heads=4, linear_num_value_heads=8,
                                linear_key_head_dim=16, linear_value_head_dim=8,
                                layer_types=["linear_attention", "full_attention"])
    family_lora_step_matches_peft(tmp_path, config, ["in_proj_qkv", "in_proj_z", "in_proj_a", "out_proj", "q_proj"],
                                  adapted="in_proj_qkv")


def test_lora_on_fused_experts_equals_a_plain_peft_model(tmp_path):
    """A tiny DeepSeek-V3 (a dense layer, then 4 routed experts fused in two tensors beside a shared expert) at sp=2
    with TiledMLP: PEFT turns the gate/up/down targets into adapters on the fused expert tensors, merged whole in
    each tile's forward (lora.lora_plan_fields), and the step equals a plain PEFT model's; the planner's count is
    what trains."""
    from helpers import tiny_family_config
    from test_latent_attention import DEEPSEEK_V3

    result = family_lora_step_matches_peft(
        tmp_path, tiny_family_config("deepseek_v3", **DEEPSEEK_V3),
        ["q_a_proj", "kv_b_proj", "gate_proj", "up_proj", "down_proj"], adapted=".experts.",
        extra_args=["--set", "model.tiled_mlp=true"])
    assert result["planned_adapters"] == sum(t.numel() for t in result["initial"].values())


@pytest.mark.parametrize("family,targets", [
    ("glm_moe_dsa", ["q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]),
    ("hy_v4", ["q_b_proj", "kv_b_proj", "gate_proj", "o_proj"]),
    ("dots3_note_text", ["q_b_proj", "kv_b_proj", "g_proj", "o_proj"]),
    ("glm5_next_text", ["q_b_proj", "kv_b_proj", "o_proj", "q_proj", "v_proj"])])
def test_lora_on_indexed_attention_equals_a_plain_peft_model(tmp_path, family, targets):
    """A tiny GLM-5 (indexed attention: a layer with the indexer, one reusing its choice), HY-V4 (its attention's
    output gate among the targets, hyper-connected streams), dots3 (its head gate g_proj; the same projections
    adapted in its sliding layer, which the attention mixer exchanges) and GLM-5.3-Flash (pooled indexer, its KDA
    layer's q, v and o projections adapted too) at sp=2: adapters on the MLA projections,
    kv_b_proj's included (the absorbed form runs it on an identity matrix, so its adapter shapes the keys and values
    as in the plain layer), against a plain PEFT model."""
    from helpers import tiny_family_config
    from test_indexed_attention import FAMILY_ARGS, INDEXED_FAMILIES

    family_lora_step_matches_peft(tmp_path, tiny_family_config(family, **INDEXED_FAMILIES[family]), targets,
                                  adapted="kv_b_proj", extra_args=list(FAMILY_ARGS.get(family, ())))


def test_the_model_changes_line_says_which_fused_expert_tensors_peft_adapts_in_place_of_named_linears():
    """PEFT adapts a mixture of experts' fused tensors for gate/up/down targets and then no linear layer of those
    names (the dense first layer's MLP, the shared expert): the summary line says both. Control: attention targets
    only, no such clause."""
    from transformers import AutoModelForCausalLM

    from helpers import tiny_family_config
    from test_latent_attention import DEEPSEEK_V3

    config = tiny_family_config("deepseek_v3", **DEEPSEEK_V3)
    model = AutoModelForCausalLM.from_config(config)
    line = lora.apply_lora(model, {"r": 4}, seed=0)
    fused = "the experts' fused down_proj, gate_up_proj adapted (PEFT builds their merged weights whole each forward)"
    # PEFT 0.21 then adapts no linear layer of those names, PEFT 0.22 adapts them too: the line says what it did
    linears = [name for name, module in model.named_modules() if name.endswith("mlp.gate_proj")
               and isinstance(module, torch.nn.Module) and hasattr(module, "lora_A")]
    tail = "" if linears else ", the down_proj, gate_proj, up_proj linear layers not"
    assert line.endswith(fused + tail), (line, linears)
    attention = lora.apply_lora(AutoModelForCausalLM.from_config(config), {"r": 4, "target_modules": ["q_a_proj"]}, 0)
    assert "fused" not in attention and attention.startswith("LoRA r=4 on q_a_proj (")
