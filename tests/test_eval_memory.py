"""Evaluating at length L never needs more GPU memory than a training step at L: the planner's evaluation forward
(planner/forward_only.py) against its training step (planner/estimate.py) on posed shapes. Pure planner arithmetic,
no processes.

Posed: six model families (dense, sliding-window, linear-attention and mixture-of-experts), lengths 32K to 1M, every
sp Ulysses allows on one node of eight GPUs, each with the levers a training run there would have (the planner's own
choice over every `auto` lever, levers.choose_levers), with the DeepSpeed JSON's offloads off and on. Then a
component computed by hand, the plan against peaks measured on an H200, negative controls (wrong evaluation
estimates the comparison must catch), and the evaluation's own preflight."""
import json

import pytest
import torch

from ulysses_train.planner.estimate import checkpoints, estimate
from ulysses_train.planner.forward_only import check_forward_fits, estimate_forward, plan_forward
from ulysses_train.planner.layer import attention_forward_per_token
from ulysses_train.lever_keys import LEVER_KEYS
from ulysses_train.planner.levers import choose_levers
from ulysses_train.planner.options import PlanError, PlanOptions
from ulysses_train.planner.result import Component
from ulysses_train.planner.search import valid_sp
from ulysses_train.planner.shapes import load_model_shape

MODELS = ("qwen3-4b", "qwen3-8b", "qwen3.5-9b", "gpt-oss-20b", "gemma-3-12b", "qwen3-30b-a3b")
LENGTHS = [2 ** k for k in range(15, 21)]  # 32K .. 1M
OFFLOADS = ((False, False), (True, True))  # (activations, optimizer) on the host, as the DeepSpeed JSON says


@pytest.fixture(scope="module")
def posed():
    """(shape, options) of every posed point, the levers as a training run there would choose them."""
    points = []
    for name in MODELS:
        m = load_model_shape(name)
        for length in LENGTHS:
            base = PlanOptions(seq_length=length, gpus_per_node=8)
            for sp in valid_sp(m, base):
                for acts, opt in OFFLOADS:
                    o = base.replace(sp=sp, offload_activations=acts, offload_optimizer=opt)
                    points.append((m, choose_levers(m, o, set(LEVER_KEYS)).options))
    return points


def over_training(points, eval_estimate) -> list:
    """The posed points where `eval_estimate(m, o)` plans more GPU memory than the training step at the same
    length, sp and world: the check of the issue, and what each negative control must trip."""
    return [(m.name, o.seq_length, o.sp, o.offload_activations) for m, o in points
            if eval_estimate(m, o).gpu_total > estimate(m, o).gpu_total]


def test_evaluation_never_needs_more_gpu_memory_than_a_training_step(posed):
    assert {m.name for m, _ in posed} == set(MODELS) and {o.seq_length for _, o in posed} == set(LENGTHS)
    assert {o.sp for _, o in posed} == {1, 2, 4, 8} and len(posed) >= 250
    assert {o.tiled_mlp for _, o in posed} == {False, True}  # the levers vary over the grid
    assert over_training(posed, estimate_forward) == []
    # between training steps (the `eval` probes) the optimizer states and gradient partitions stay: still below
    assert over_training(posed, lambda m, o: estimate_forward(m, o, during_training=True)) == []


def test_a_component_by_hand():
    """Qwen3-4B (hidden 2560, 32 heads and 8 KV heads of 128, vocabulary 151,936, 4,022,468,096 parameters) at
    131,072 tokens on one GPU, bf16, SDPA."""
    m = load_model_shape("qwen3-4b")
    o = PlanOptions(seq_length=131_072, sp=1, gpus_per_node=1)
    # attention forward per token: input norm output 2*2560, local q/k/v 2*(4096 + 2*1024), k and v expanded to
    # 32 heads 2*2*4096 (GQA), kernel output and its transposed copy 2*2*4096, fp32 logsumexp 4*32
    assert attention_forward_per_token(m, o) == 5120 + 12288 + 16384 + 16384 + 128 == 50_304
    # sp=4: plus q/k/v after the all-to-all, 2*(4096 + 2*1024) (8 KV heads over 4 ranks: no replication), and the
    # int64 position ids of the whole sequence, 8*4 per local token
    sp4 = o.replace(sp=4, gpus_per_node=4)
    assert attention_forward_per_token(m, sp4) == 50_304 + 12_288 + 32
    # and the all-to-all's send copy and receive buffer of q, 2 x 32768 local tokens x 2 x 4096
    buffers = [c.attn for c in plan_forward(m, options=sp4).components if c.name == "all-to-all buffers"]
    assert buffers == [2 * 32_768 * 2 * 4096]
    # the head moment: the whole weights (ZeRO-3 over one GPU) 2*4,022,468,096; the lm_head gathered 2*151936*2560;
    # input ids, positions, labels (3 x int64) and two cos/sin tables (2 x 2 x 2 x 128) per token; the last hidden
    # states and their labelled rows 2 x 131072 x 2 x 2560, fp64 log-prob and hit 16 x 131072, one chunk of
    # 1024 x 151936 logits at 2 + 4 + 4 + 4 bytes; the CUDA context 2 GiB
    head = 2 * 131_072 * 2 * 2560 + 16 * 131_072 + 1024 * 151_936 * 14
    assert head == 3_522_428_928
    total = 8_044_936_192 + 777_912_320 + 131_072 * (24 + 1024) + head + 2 * 2 ** 30
    assert plan_forward(m, options=o).gpu_at("loss") == total == 14_630_124_544


def test_the_estimate_bounds_the_measured_forward_on_an_h200():
    """benchmarks/results/eval_forward_memory_h200.jsonl: eval_context.py's peak (torch's allocator) on one H200,
    Qwen3-4B random weights, 32K untiled and 128K tiled and untiled: the plan is above each, by at most 15%."""
    import os

    from helpers import REPO

    from ulysses_train.constants import GIB

    with open(os.path.join(REPO, "benchmarks", "results", "eval_forward_memory_h200.jsonl")) as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    assert len(records) == 3
    for r in records:
        planned = plan_forward(r["model"], r["seq_length"], sp=r["sp"], gpus_per_node=r["gpus_per_node"],
                               tiled_mlp=r["tiled_mlp"]).gpu_allocated / GIB
        assert planned == pytest.approx(r["planned_eval_gpu_gib"], abs=1e-3)  # what the script printed there
        assert r["measured_peak_gib"] <= planned <= 1.15 * r["measured_peak_gib"], r


def keeps_every_layer(m, o):
    """Wrong: the forward as if grad were on without checkpointing, every layer's saved tensors kept."""
    p = estimate_forward(m, o)
    kept = checkpoints(m, o.replace(gradient_checkpointing=False)).stored
    p.components.append(Component("every layer's activations", kept, kept, kept, kept))
    return p


def full_logits(m, o):
    """Wrong: the head builds the slice's seq x vocab logits at once (bf16, fp32 copy, fp32 log-softmax)."""
    p = estimate_forward(m, o)
    p.components.append(Component("full logits", loss=o.seq_local * m.vocab * (o.dtype_bytes + 8)))
    return p


@pytest.mark.parametrize("wrong", [keeps_every_layer, full_logits])
def test_negative_control_the_comparison_catches_a_wrong_eval_estimate(posed, wrong):
    caught = over_training(posed, wrong)
    assert ("qwen3-4b", 131_072, 1, False) in caught and len(caught) >= 10


def test_the_forward_is_refused_when_it_cannot_fit_and_names_the_fix():
    """Qwen3-8B at 1M tokens, untiled: 138.7 GiB planned (the MLP's intermediates alone 112 GiB)."""
    one_gpu = PlanOptions(seq_length=1_048_576, sp=1, gpus_per_node=1, tiled_mlp=False, gpu_memory_gib=120)
    with pytest.raises(PlanError) as err:
        check_forward_fits(plan_forward("qwen3-8b", options=one_gpu))
    message = str(err.value)
    assert "evaluating 1,048,576 tokens" in message and "during a layer's MLP forward" in message
    assert "Cheapest change that fits: TiledMLP (model.tiled_mlp=true)." in message
    check_forward_fits(plan_forward("qwen3-8b", options=one_gpu.replace(tiled_mlp=True)))  # fits: no error
    node = one_gpu.replace(gpus_per_node=8, gpu_memory_gib=80)  # more sp is cheaper than TiledMLP (search.LEVER_COST)
    with pytest.raises(PlanError, match=r"Cheapest change that fits: sp=2 \(parallel.sequence_parallel_size=2\)"):
        check_forward_fits(plan_forward("qwen3-8b", options=node))
    with pytest.raises(PlanError, match="Evaluate shorter lengths, or on more GPUs"):
        check_forward_fits(plan_forward("qwen3-8b", options=node.replace(gpu_memory_gib=10)))


def test_eval_engine_preflight_plans_the_forward_not_a_training_step(monkeypatch):
    """Qwen3-8B at 1M tokens on one H200: a training step does not fit; the evaluation forward (TiledMLP by the
    length rule) does, so the eval engine's preflight passes where the training bound would refuse."""
    from ulysses_train.config import Config, DataConfig, ModelConfig, ParallelConfig
    from ulysses_train.model.presets import qwen3_config
    from ulysses_train.parallel.layout import ParallelDims
    from ulysses_train.training.resolved_run import ResolvedRun
    from ulysses_train.training.step import preflight_memory_check

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setattr("ulysses_train.planner.detect_hardware",
                        lambda: {"gpu_memory_gib": 141, "host_memory_gib": 560})
    cfg = Config(model=ModelConfig(name_or_path="Qwen/Qwen3-8B"), data=DataConfig(source="x", seq_length=1_048_576),
                 parallel=ParallelConfig(sequence_parallel_size=1))
    ds, dims = {"zero_optimization": {"stage": 3}}, ParallelDims(world_size=1, sp=1, gpus_per_node=1)
    hf_config = qwen3_config("qwen3-8b")
    with pytest.raises(PlanError, match="pass --force"):
        preflight_memory_check(ResolvedRun(cfg=cfg, hf_config=hf_config, rope=None, attn="sdpa", dims=dims, ds=ds))
    preflight_memory_check(ResolvedRun(cfg=cfg, hf_config=hf_config, rope=None, attn="sdpa", dims=dims, ds=ds),
                           forward_only=True)


def test_plan_script_prints_the_evaluation_forward(tmp_path, capsys):
    from helpers import load_script

    script = load_script("scripts/plan.py", "plan_script")
    out = tmp_path / "plan.json"
    assert script.main(["--model", "qwen3-4b", "--seq-length", "131072", "--gpus-per-node", "1", "--auto-levers",
                        "--eval", "--no-story", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "qwen3-4b evaluation forward: seq 131,072 tokens" in printed and "attn fwd" in printed
    record = json.loads(out.read_text())
    assert 0 < record["eval"]["gpu_total_gib"] < record["plan"]["gpu_total_gib"]
