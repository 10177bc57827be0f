"""`auto` memory levers (planner/levers.py): the chooser against a brute-force reference over the planner, explicit
values kept, the no-GPU meaning, and every rank choosing the same from different detected memory."""
import dataclasses
import itertools
import os
import subprocess
import sys

import pytest

from ulysses_train.constants import GIB
from ulysses_train.model.mixers.head_chunks import chunk_problem
from ulysses_train.planner import PlanOptions, load_model_shape, plan
from ulysses_train.lever_keys import LEVER_KEYS
from ulysses_train.planner.levers import KEEP_CHOICES, OFFLOAD_CHOICES, SAFETY, TIE, choose_levers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALL = set(LEVER_KEYS)


def fits_with_margin(p) -> bool:
    o = p.options
    return p.gpu_total <= SAFETY["gpu"] * o.gpu_memory_gib * GIB and \
        p.host_per_node <= SAFETY["host"] * o.host_memory_gib * GIB


def brute_force_fastest(model, o: PlanOptions) -> float:
    """The reference: plan every combination with plan() and take the fastest that fits (no chooser code)."""
    chunks = [n for n in range(1, model.heads // o.sp + 1) if not chunk_problem(model.heads, model.kv_heads, o.sp, n)]
    times = [p.step_seconds for k, s, t, n in itertools.product(KEEP_CHOICES, OFFLOAD_CHOICES, (False, True), chunks)
             if not (k > 0 and n > 1)
             for p in [plan(model, options=o.replace(keep_attention_fraction=k, activation_offload_fraction=s,
                                                     tiled_mlp=t, attention_head_chunks=n))] if fits_with_margin(p)]
    return min(times)


@pytest.mark.parametrize("model,length,gpus,sp,gpu_gib,host_gib", [
    ("qwen3-4b", 131_072, 1, 1, 139.8, 125.8),   # the 1-GPU H200 machine
    ("qwen3-4b", 262_144, 1, 1, 139.8, 125.8),
    ("qwen3-4b", 131_072, 1, 1, 96.0, 125.8),    # a 96 GB card: less can be kept
    ("qwen3-8b", 1_048_576, 8, 8, 139.8, 560.0),  # the 8-GPU node
    ("qwen3-8b", 1_048_576, 8, 8, 139.8, 200.0),  # the same with little host memory
])
def test_the_choice_fits_and_nothing_that_fits_is_faster(model, length, gpus, sp, gpu_gib, host_gib):
    m = load_model_shape(model)
    o = PlanOptions(seq_length=length, sp=sp, gpus_per_node=gpus, offload_activations=True,
                    gpu_memory_gib=gpu_gib, host_memory_gib=host_gib)
    choice = choose_levers(m, o, ALL)
    assert choice.fits and fits_with_margin(choice.plan)
    assert choice.plan.step_seconds <= brute_force_fastest(m, o) * (1 + TIE)
    assert set(choice.values) == ALL
    assert choice.values["keep_attention_fraction"] in KEEP_CHOICES


def test_expected_settings_for_known_budgets():
    """Hand-checked cases: a roomy card keeps every layer's attention; the 80 GB card cannot keep it all at
    128K; with no host memory to spare nothing is offloaded."""
    m = load_model_shape("qwen3-4b")
    roomy = choose_levers(m, PlanOptions(seq_length=131_072, gpus_per_node=1, offload_activations=True,
                                         gpu_memory_gib=139.8, host_memory_gib=125.8), ALL)
    assert roomy.values["keep_attention_fraction"] == 1.0
    small = choose_levers(m, PlanOptions(seq_length=131_072, gpus_per_node=1, offload_activations=True,
                                         gpu_memory_gib=96.0, host_memory_gib=125.8), ALL)
    assert small.fits and small.plan.gpu_total <= 0.92 * 96 * GIB
    assert small.values != roomy.values
    no_host = choose_levers(m, PlanOptions(seq_length=131_072, gpus_per_node=1, offload_activations=True,
                                           gpu_memory_gib=139.8, host_memory_gib=8.0), ALL)
    assert no_host.values["activation_offload_fraction"] == 0.0


def test_fp32_models_keep_no_attention():
    """A float32 model (the demo) has no fused attention kernel on a GPU whose outputs a kept layer could save (the
    trainer warned 'no attention kernel ran in a kept layer'): auto keeps none; bf16 on the same card keeps some."""
    m = load_model_shape("qwen3-4b")
    options = dict(seq_length=8192, gpus_per_node=1, offload_activations=True, gpu_memory_gib=139.8,
                   host_memory_gib=125.8)
    assert choose_levers(m, PlanOptions(**options, dtype_bytes=4), ALL).values["keep_attention_fraction"] == 0.0
    assert choose_levers(m, PlanOptions(**options), ALL).values["keep_attention_fraction"] > 0.0  # control


def test_explicit_values_are_never_changed():
    m = load_model_shape("qwen3-4b")
    o = PlanOptions(seq_length=131_072, gpus_per_node=1, offload_activations=True, gpu_memory_gib=139.8,
                    host_memory_gib=125.8, keep_attention_fraction=0.25, tiled_mlp=True)
    choice = choose_levers(m, o, {"activation_offload_fraction"})
    assert set(choice.values) == {"activation_offload_fraction"}
    assert (choice.options.keep_attention_fraction, choice.options.tiled_mlp) == (0.25, True)


def test_without_offload_in_the_deepspeed_json_the_share_is_not_varied():
    m = load_model_shape("qwen3-4b")
    o = PlanOptions(seq_length=131_072, gpus_per_node=1, offload_activations=False, gpu_memory_gib=139.8,
                    host_memory_gib=125.8)
    choice = choose_levers(m, o, ALL)
    assert not choice.options.offload_activations and choice.values["activation_offload_fraction"] == 1.0


def test_when_nothing_fits_the_smallest_is_returned_and_marked():
    m = load_model_shape("qwen3-4b")
    o = PlanOptions(seq_length=4_194_304, gpus_per_node=1, offload_activations=True, gpu_memory_gib=24.0,
                    host_memory_gib=64.0)
    choice = choose_levers(m, o, ALL)
    assert not choice.fits and "nothing fits" in choice.describe()
    # negative control for the check above: the roomy case is marked as fitting
    roomy = choose_levers(m, o.replace(seq_length=8192, gpu_memory_gib=139.8, host_memory_gib=560.0), ALL)
    assert roomy.fits and "nothing fits" not in roomy.describe()


def test_resolve_levers_on_a_gpu_run_and_without_one(monkeypatch):
    """The trainer's entry: on a (posed) GPU run the planner's choice replaces `auto`, a set value stays; on
    CPU `auto` takes the no-GPU table."""
    from helpers import tiny_qwen3_config

    from ulysses_train.config import load_config
    from ulysses_train.parallel.layout import ParallelDims
    from ulysses_train.lever_keys import NO_GPU_LEVERS
    from ulysses_train.training import resolved_run as step

    cfg = load_config(None, ["model.tiled_mlp=false", "data.seq_length=65536"])
    ds = {"activation_checkpointing": {"cpu_checkpointing": True}, "zero_optimization": {"stage": 3}}
    dims = ParallelDims(world_size=1, sp=1)
    hf = tiny_qwen3_config(num_hidden_layers=4)
    cpu_cfg, none = step.resolve_levers(cfg, ds, dims, hf)
    assert none is None and cpu_cfg.model.keep_attention_fraction == NO_GPU_LEVERS["keep_attention_fraction"]
    assert cpu_cfg.model.attention_head_chunks == NO_GPU_LEVERS["attention_head_chunks"] == 1
    assert cpu_cfg.model.activation_offload_fraction == NO_GPU_LEVERS["activation_offload_fraction"]

    monkeypatch.setattr(step, "cuda_training", lambda: True)
    monkeypatch.setattr("ulysses_train.planner.detect_hardware",
                        lambda: {"gpu_memory_gib": 139.8, "host_memory_gib": 125.8})
    monkeypatch.setattr(step.torch.cuda, "device_count", lambda: 1)
    gpu_cfg, choice = step.resolve_levers(cfg, ds, dims, hf)
    assert gpu_cfg.model.tiled_mlp is False  # set by the user: kept
    assert set(choice.values) == {"keep_attention_fraction", "activation_offload_fraction", "attention_head_chunks"}
    assert gpu_cfg.model.keep_attention_fraction == choice.values["keep_attention_fraction"] == 1.0  # tiny: all fit
    assert gpu_cfg.model.attention_head_chunks == 1  # nothing to save: no extra attention forward
    assert dataclasses.asdict(gpu_cfg)["model"]["activation_offload_fraction"] != "auto"


WORKER = """
import json, sys, torch
torch.distributed.init_process_group('gloo')
rank = torch.distributed.get_rank()
from ulysses_train.training.resolved_run import agreed_hardware
got = agreed_hardware({'gpu_memory_gib': 139.8 - 40 * rank, 'host_memory_gib': 100.0 + 400 * rank})
with open(sys.argv[1] + f'/rank{rank}.json', 'w') as fh:  # a file per rank: their stdout lines can interleave
    json.dump(got, fh)
from ulysses_train.parallel.layout import exit_process
exit_process(0)
"""


def test_every_rank_plans_with_the_smallest_memory_of_any_rank(tmp_path):
    """Two ranks that detect different memory (two kinds of node) both plan with the smaller figures, so they
    choose the same levers."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script), str(tmp_path)], capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["gpu_memory_gib"] == pytest.approx(99.8) and got["host_memory_gib"] == pytest.approx(100.0)


@pytest.mark.parametrize("sized", [True, False], ids=["mixture-of-experts", "a-model-the-planner-cannot-size"])
def test_auto_levers_for_a_mixture_of_experts_and_for_a_model_the_planner_cannot_size(monkeypatch, sized):
    """Qwen3-MoE on a (posed) GPU run: the planner sizes its experts, so `auto` levers are chosen and the
    preflight check runs. A model the planner cannot size (posed by a shape reader that raises) falls back to
    the no-GPU values, and the preflight check steps aside with a warning instead of a traceback."""
    from helpers import tiny_family_config

    from ulysses_train.config import load_config
    from ulysses_train.parallel.layout import ParallelDims
    from ulysses_train.lever_keys import NO_GPU_LEVERS
    from ulysses_train.planner.shapes import ModelShape
    from ulysses_train.training import resolved_run, step

    monkeypatch.setattr(step, "cuda_training", lambda: True)
    monkeypatch.setattr(resolved_run, "cuda_training", lambda: True)
    monkeypatch.setattr("ulysses_train.planner.detect_hardware",
                        lambda: {"gpu_memory_gib": 139.8, "host_memory_gib": 125.8})
    monkeypatch.setattr(step.torch.cuda, "device_count", lambda: 1)
    if not sized:
        def cannot(*args, **kwargs):
            raise NotImplementedError("posed: layers the planner does not model")
        monkeypatch.setattr(ModelShape, "from_hf_config", cannot)
    moe = tiny_family_config("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    cfg = load_config(None, ["data.seq_length=4096"])
    ds = {"activation_checkpointing": {"cpu_checkpointing": True}, "zero_optimization": {"stage": 3}}
    dims = ParallelDims(world_size=1, sp=1)
    resolved, choice = resolved_run.resolve_levers(cfg, ds, dims, moe)
    if sized:
        assert choice is not None and choice.fits
        assert {k: getattr(resolved.model, k) for k in choice.values} == choice.values
    else:
        assert choice is None
        assert resolved.model.keep_attention_fraction == NO_GPU_LEVERS["keep_attention_fraction"]
    run = resolved_run.ResolvedRun(cfg=resolved, hf_config=moe, rope=None, attn="sdpa", dims=dims, ds=ds)
    step.preflight_memory_check(run)  # fits (tiny), or skipped: no exception either way


def test_the_optimizer_is_planned_as_the_run_has_it(tmp_path):
    """One meaning of gpu / cpu / none for plan.py, bench.py and the trainer's `auto`: bench's `none` names SGD at
    lr 0 in the DeepSpeed JSON, which the trainer's options read as the fp32 master only (4 bytes per parameter,
    not AdamW's 12); plan.py's --optimizer none and --no-optimizer plan the same. Negative control: the JSON as
    shipped (AdamW) plans 12 bytes, and at Qwen3.5-9B's 128K on one H200 the choice then differs (the issue's
    "fits: false" and the slowest levers)."""
    import copy
    import json

    from ulysses_train.config import Config
    from ulysses_train.planner import options_from_run
    from ulysses_train.planner.options import OPTIMIZERS, deepspeed_optimizer_state_bytes

    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import bench_point
    import plan as plan_script

    with open(os.path.join(REPO, "ds_configs", "zero3.json")) as fh:
        shipped = json.load(fh)
    point = {"levers": "all", "optimizer": "none"}
    none_ds = bench_point.point_deepspeed_config(point)
    assert deepspeed_optimizer_state_bytes(none_ds) == OPTIMIZERS["none"]["optimizer_state_bytes"] == 4
    assert deepspeed_optimizer_state_bytes(shipped) == OPTIMIZERS["gpu"]["optimizer_state_bytes"] == 12
    momentum = copy.deepcopy(none_ds)
    momentum["optimizer"]["params"]["momentum"] = 0.9
    assert deepspeed_optimizer_state_bytes(momentum) == 8
    cfg = Config()
    cfg.data.seq_length, cfg.parallel.sequence_parallel_size = 131_072, 1
    cfg.model.attn_implementation = "fa4"
    hardware = dict(gpu_memory_gib=139.8, host_memory_gib=125.0)
    ours = options_from_run(cfg, none_ds, 1, 1, model="qwen3.5-9b", **hardware)
    adamw = options_from_run(cfg, bench_point.point_deepspeed_config({**point, "optimizer": "gpu"}), 1, 1,
                             model="qwen3.5-9b", **hardware)
    assert (ours.optimizer_state_bytes, adamw.optimizer_state_bytes) == (4, 12)
    shape = load_model_shape("qwen3.5-9b")
    chosen = choose_levers(shape, ours, set(LEVER_KEYS))
    assert chosen.fits and chosen.values["keep_attention_fraction"] > 0  # the measured run's choice: attention kept
    assert not choose_levers(shape, adamw, set(LEVER_KEYS)).fits  # negative control: AdamW's states fit nothing
    for flags in (["--optimizer", "none"], ["--no-optimizer"]):
        args = plan_script.parse_args(["--model", "qwen3.5-9b", "--seq-length", "131072", "--gpus-per-node", "1",
                                       *flags])
        assert plan_script.options_from_args(args).optimizer_state_bytes == 4
    args = plan_script.parse_args(["--model", "qwen3-4b", "--offload-optimizer", "--gpus-per-node", "1"])
    assert plan_script.options_from_args(args).offload_optimizer
    with pytest.raises(Exception, match="disagree"):
        plan_script.options_from_args(plan_script.parse_args(["--model", "qwen3-4b", "--optimizer", "gpu",
                                                              "--no-optimizer"]))


def test_longest_over_all_levers_is_one_answer_with_or_without_auto_levers():
    """plan.py --max-length's "longest over all lever settings" searched from the auto-chosen options (attention
    kept) with --auto-levers and from the given ones without: two answers to one question. Now both search from
    the options given, and kept attention is one of the levers searched."""
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    from ulysses_train.planner.search import longest_fitting

    shape = load_model_shape("qwen3.5-9b")
    given = PlanOptions(seq_length=1, sp=8, gpus_per_node=8, attention_kernel="fa4", gpu_memory_gib=139.8,
                        host_memory_gib=560)
    kept = given.replace(keep_attention_fraction=1.0)
    assert longest_fitting(shape, kept)[0] == longest_fitting(shape, given)[0] > 0
