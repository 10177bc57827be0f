"""benchmarks/gpu_equality.py (the bf16 gradient check on GPUs) runs on CPU too: sp=2 over gloo must pass its
criterion against the plain fp32 model, and the negative control (no all-to-all) must fail it."""
import json
import os

import pytest

from helpers import REPO, launch_ranks, load_script


BISECT_OPTIONS = ["--set", "rmsnorm=hf", "--set", "tiled_mlp=true", "--zero", "overlap_comm=false",
                  "--loss", "nll", "--torch-sdpa-order"]
ALL_LEVERS = ["--set", "keep_attention_fraction=1.0", "--set", "tiled_mlp=true", "--offload-activations"]
TORCH_NORM = ["--set", "rmsnorm=torch"]


@pytest.mark.parametrize("control,options", [(False, []), (True, []), (False, BISECT_OPTIONS), (False, ALL_LEVERS),
                                             (False, TORCH_NORM)],
                         ids=["sp2", "control", "bisect-options", "all-levers", "torch-rmsnorm"])
def test_gpu_equality_script_on_cpu(tmp_path, control, options):
    """The bisect options (used to find the bf16 RoPE trap on the H200) reach the run and change no result."""
    out = tmp_path / "report.json"
    cmd = [os.path.join(REPO, "benchmarks", "gpu_equality.py"), "--model", "tiny", "--length", "64", "--sp", "2",
           "--workdir", str(tmp_path / "work"), "--json", str(out)] + (["--control"] if control else []) + options
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = launch_ranks(2, cmd, env, 600)  # torchrun's variables, forked from the rank server (helpers)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["passed"] is (not control)
    assert report["set"] == options[1:4:2] and report["loss_type"] == ("nll" if "--loss" in options else "chunked")
    assert report["offload_activations"] is ("--offload-activations" in options)
    weights = report["loaded_weights_max_diff"]
    assert len(weights) == len(report["params"]) and all(d == 0.0 for d in weights.values())
    worst = max(r["sp_rel_err"] for r in report["params"])
    if control:
        assert worst > 1e-2 and len(report["failures"]) > len(report["params"]) // 2
    else:
        assert worst < 1e-5  # fp32 on CPU: the exact path
        assert abs(report["loss"]["sp"] - report["loss"]["exact"]) < 1e-5


def test_plain_loss_soft_caps_the_logits_as_the_model_does():
    """The reference loss (the head in recomputed chunks) equals the plain Gemma 4's own forward, whose logits are
    soft-capped (final_logit_softcapping); control: the same loss with the cap dropped is another number."""
    import torch
    from transformers import AutoModelForCausalLM

    from helpers import tiny_family_config

    script = load_script("benchmarks/gpu_equality.py")
    config = tiny_family_config("gemma4_text", layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                                head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                                final_logit_softcapping=3.0, hidden_size_per_layer_input=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # logits of a few units, so the cap of 3 bends them
        model.get_output_embeddings().weight.mul_(30)
    data = script.sample(config.vocab_size, 4100)  # past one 4,096-row chunk
    own = model(input_ids=data["input_ids"], labels=data["labels"]).loss
    ours = script.plain_loss(model, data, "cpu")
    assert abs(ours.item() - own.item()) < 1e-5 * own.item()
    model.config.final_logit_softcapping = None
    assert abs(script.plain_loss(model, data, "cpu").item() - own.item()) > 1e-2


def test_a_check_whose_plain_bf16_gradients_are_far_from_fp32_says_it_is_not_informative():
    """The H100 reports (benchmarks/results/families): Gemma-4-31B at its random init, whose plain bf16 gradients are
    121% off fp32 (median), is flagged; DeepSeek-V3's (5%) is not (the control)."""
    script = load_script("benchmarks/gpu_equality.py")
    results = os.path.join(REPO, "benchmarks", "results", "families")
    gemma = json.load(open(os.path.join(results, "gemma4_31b_4l_equality.json")))["params"]
    deepseek = json.load(open(os.path.join(results, "deepseek_v3_4l_equality.json")))["params"]
    assert abs(script.uninformative(gemma) - 1.2123) < 1e-3 and script.uninformative(deepseek) == 0.0


GEMMA4_SMALL = ["--model", "gemma-4-31b", "--layers", "4", "--override", "vocab_size=2048", "--override",
                "hidden_size=256", "--override", "intermediate_size=512", "--override", "num_attention_heads=4",
                "--override", "num_key_value_heads=2", "--override", "num_global_key_value_heads=1", "--override",
                "sliding_window=128"]
"""Gemma-4-31B's layout at its real head widths (256 sliding, 512 global, K = V, scale 1.0) and 4 layers (3 sliding,
1 global), narrow elsewhere: the fp32 check's shape on CPU."""


@pytest.mark.parametrize("control", [False, True], ids=["reference-kernel", "control-window"])
def test_fp32_check_of_sliding_windows_against_fp64(tmp_path, control):
    """The fp32 check (families_gpu.sh gemma4-fp32) on CPU: the exact answer in fp64, the plain model in fp32, ours
    through fa4's reference kernel with every lever. It passes; with the windows ignored (the control) every gradient
    is out of bounds. The plain fp32 model's own error shows why fp64 is the exact answer here: it is not nil."""
    out = tmp_path / "report.json"
    cmd = [os.path.join(REPO, "benchmarks", "gpu_equality.py"), *GEMMA4_SMALL, "--length", "512", "--sp", "1",
           "--dtype", "float32", "--set", "attn_implementation=fa4", *ALL_LEVERS, "--workdir", str(tmp_path / "work"),
           "--json", str(out), "--control-window" if control else "--reference-kernel"]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = launch_ranks(1, cmd, env, 600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["exact_dtype"] == "torch.float64" and report["passed"] is (not control)
    plain = sorted(r["plain_rel_err"] for r in report["params"])
    assert 1e-5 < plain[len(plain) // 2] < 1e-2
    if control:
        assert len(report["failures"]) == len(report["params"])
    else:
        assert max(r["sp_rel_err"] / r["bound"] for r in report["params"]) < 1.0
