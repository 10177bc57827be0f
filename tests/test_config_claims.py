"""What a shipped config's comments say it needs (~N GiB GPU, ~M GiB host) is what that config runs with: its
levers are fixed (an `auto` lever is the planner's choice on the card at hand, e.g. 115.6 GiB GPU and 17.3 GiB host
for a config that said ~75 / ~60), and the planner's prediction for those levers is within 15% of the stated
numbers. Every config in configs/ is checked; a negative control puts one lever back to auto."""
import glob
import os
import re

from helpers import REPO

from ulysses_train.config import load_config
from ulysses_train.model.presets import known_name
from ulysses_train.planner import plan
from ulysses_train.planner.run import options_from_run
from ulysses_train.training.ds_config import load_deepspeed_config

LEVERS = ("keep_attention_fraction", "tiled_mlp", "activation_offload_fraction")
CLAIM = re.compile(r"~(\d+(?:\.\d+)?) GiB GPU, ~(\d+(?:\.\d+)?) GiB host")


def claim_problems(path: str, overrides=()) -> list:
    """Why the memory a config's comments state is not what it runs with; [] when it states none or holds."""
    with open(path) as fh:
        comments = " ".join(line.lstrip("# ").strip() for line in fh if line.lstrip().startswith("#"))
    claim = CLAIM.search(comments)
    if not claim:
        return []
    cfg = load_config(path, list(overrides))
    name = os.path.basename(path)
    auto = [f"model.{lever}" for lever in LEVERS if str(getattr(cfg.model, lever)).lower() == "auto"]
    if auto:
        return [f"{name} states ~{claim[1]} GiB GPU / ~{claim[2]} GiB host but leaves {', '.join(auto)} auto"]
    gpus = int(re.search(r"(\d+)gpu", name)[1])
    model = known_name(cfg.model.name_or_path)
    options = options_from_run(cfg, load_deepspeed_config(cfg.train.deepspeed_config), gpus, gpus, model=model)
    predicted = plan(model, options=options)
    gib = 2**30
    problems = []
    for what, stated, value in (("GPU", float(claim[1]), predicted.gpu_total / gib),
                                ("host", float(claim[2]), predicted.host_per_node / gib)):
        if abs(value - stated) > 0.15 * stated:
            problems.append(f"{name}: states ~{stated:g} GiB {what}, the planner predicts {value:.1f}")
    return problems


def test_every_shipped_config_runs_with_the_memory_it_states():
    paths = sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml")))
    assert any(claim_problems(p) == [] and CLAIM.search(open(p).read()) for p in paths)  # at least one is checked
    assert [problem for p in paths for problem in claim_problems(p)] == []


def test_the_claim_check_catches_an_auto_lever_and_a_wrong_number(tmp_path):
    """Negative controls: the sessions config with its offload share left to the planner, and with ~40 GiB GPU."""
    path = os.path.join(REPO, "configs", "qwen3_4b_sessions_128k_1gpu.yaml")
    assert claim_problems(path, ["model.activation_offload_fraction=auto"]) == [
        "qwen3_4b_sessions_128k_1gpu.yaml states ~75 GiB GPU / ~60 GiB host but leaves "
        "model.activation_offload_fraction auto"]
    wrong = tmp_path / "qwen3_4b_sessions_128k_1gpu.yaml"
    wrong.write_text(open(path).read().replace("~75 GiB GPU", "~40 GiB GPU"))
    (problem,) = claim_problems(str(wrong))
    assert problem.startswith("qwen3_4b_sessions_128k_1gpu.yaml: states ~40 GiB GPU, the planner predicts")


def test_the_qwen3_5_configs_fit_the_machines_they_name_with_auto_levers():
    """The Qwen3.5-9B session configs leave their levers to the planner (no stated memory), so what holds them is that
    the planner finds levers that fit: sp=8 at 1,048,576 tokens on one node of 8 H200s (560 GiB host), and one H200
    at 262,144 with AdamW on a 256 GiB host (the plan.py line in its comments); not on a 128 GiB host."""
    from ulysses_train.planner.run import choose_run_levers
    from ulysses_train.planner.shapes import load_model_shape

    shape = load_model_shape("qwen3.5-9b")

    def fits(name, gpus, host_gib):
        cfg = load_config(os.path.join(REPO, "configs", name))
        ds = load_deepspeed_config(cfg.train.deepspeed_config)
        assert known_name(cfg.model.name_or_path) == "qwen3.5-9b" and cfg.data.format == "chat"
        return choose_run_levers(cfg, ds, gpus, gpus, shape, gpu_memory_gib=139.8, host_memory_gib=host_gib).fits

    assert fits("qwen3_5_9b_sessions_1m_8gpu.yaml", 8, 560)
    assert fits("qwen3_5_9b_sessions_256k_1gpu.yaml", 1, 256) and not fits("qwen3_5_9b_sessions_256k_1gpu.yaml", 1, 128)
