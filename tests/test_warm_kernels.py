"""The warm command (scripts/warm_kernels.py) and the trainer's first-step notice, on CPU with the GPU kernels faked
present or left absent: which kernels a run compiles, at which shapes, into which caches; the progress, the
marker that makes a second run compile nothing, the tar, the node lock; the line and the bar's text before the
first step. Negative controls: absent kernels give no notice, another plan is not warm, another cache folder does
not wait on the lock."""
import os
import subprocess
import sys
import tarfile
import time
import types

import pytest
from helpers import REPO

from ulysses_train.planner.shapes import load_model_shape
from ulysses_train.training import first_use_kernels as fuk

sys.path.insert(0, os.path.join(REPO, "scripts"))
import warm_kernels  # noqa: E402

QWEN35 = os.path.join(REPO, "configs", "qwen3_5_9b_sessions_256k_1gpu.yaml")


@pytest.fixture
def kernels_present(monkeypatch):
    """What a Hopper GPU with the `gpu` extra reports: FA4 chosen, FlashQLA, Liger's norm and SwiGLU run."""
    from ulysses_train.model import loading, rmsnorm, swiglu
    from ulysses_train.model.mixers import gated_deltanet_kernels

    monkeypatch.setattr(loading, "chosen_attn_implementation", lambda name: "fa4")
    from ulysses_train.model.mixers import recurrent
    from ulysses_train.planner import run

    monkeypatch.setattr(run, "cuda_training", lambda: True)  # the planner's view of a run here: a GPU run
    monkeypatch.setattr(recurrent, "fla_available", lambda: True)
    monkeypatch.setattr(gated_deltanet_kernels, "flash_qla_choice", lambda dk, dv: (True, ""))
    monkeypatch.setattr(rmsnorm, "offset_norm_kernel_runs", lambda: True)
    monkeypatch.setattr(swiglu, "swiglu_kernel_runs", lambda: True)
    monkeypatch.setattr(fuk, "gpu_here", lambda: True)


@pytest.fixture
def caches(tmp_path, monkeypatch):
    for var, _, _ in fuk.CACHES.values():
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(fuk.CUTE_DSL_CACHE_SWITCH, "1")  # restored after the test (the warm command sets it)
    monkeypatch.setenv(fuk.SHARED_CACHE_VAR, str(tmp_path / "kc"))
    return tmp_path / "kc"


def test_the_plan_names_each_kernel_its_shapes_and_its_cache(kernels_present, caches, capsys):
    assert warm_kernels.main(["--config", QWEN35, "--plan-only"]) == 0
    out = capsys.readouterr().out
    assert "FlashAttention 4 forward and backward: CuTe DSL, variable-length, 262,144 tokens x 16 heads x 256" in out
    assert "FlashQLA's gated delta rule: TileLang, 262,144 tokens x 32 heads x 128/128; ~400-470 s (measured" in out
    assert "fla's causal conv1d and fused gated RMSNorm: Triton" in out
    assert "Liger's RMSNorm and SwiGLU: Triton, 262,144 tokens per rank" in out
    assert f"cache {caches / 'tilelang'}" in out and f"Triton {caches / 'triton'}" in out
    assert "fla's chunked gated delta rule" not in out  # FlashQLA takes the rule


def test_sp_divides_the_heads_and_the_tokens_per_rank(kernels_present, caches, capsys):
    warm_kernels.main(["--config", QWEN35, "--plan-only", "--set", "parallel.sequence_parallel_size=4"])
    out = capsys.readouterr().out
    assert "262,144 tokens x 4 heads x 256" in out and "262,144 tokens x 8 heads x 128/128" in out
    assert "65,536 tokens per rank" in out


def test_without_the_kernels_nothing_compiles(caches, capsys):
    """Negative control: this CPU machine as it is (no CUDA, no kernel package runs)."""
    assert warm_kernels.main(["--config", QWEN35]) == 0
    assert "none compiles on first use" in capsys.readouterr().out


def test_warming_shows_progress_marks_the_plan_and_a_second_run_compiles_nothing(kernels_present, caches, tmp_path,
                                                                                 monkeypatch, capsys):
    fake = ("import os, time; d = os.path.join(os.environ['TRITON_CACHE_DIR'], 'k'); os.makedirs(d, exist_ok=True); "
            "[open(os.path.join(d, str(i)), 'w').close() for i in range(3)]; time.sleep(0.3)")
    calls = []
    monkeypatch.setattr(warm_kernels, "compile_command", lambda args, model, sp, levers=(): calls.append(model) or
                        [sys.executable, "-c", fake])
    tar = tmp_path / "cache.tar"
    assert warm_kernels.main(["--config", QWEN35, "--tar", str(tar)]) == 0
    captured = capsys.readouterr()
    assert "compiling kernels" in captured.err and "Triton=+3 files" in captured.err
    assert "kernels compiled in" in captured.out and calls == ["qwen3.5-9b"]
    assert "triton/k/0" in tarfile.open(tar).getnames()
    assert warm_kernels.main(["--config", QWEN35]) == 0
    assert "already warm for this plan" in capsys.readouterr().out and len(calls) == 1
    warm_kernels.main(["--config", QWEN35, "--set", "data.seq_length=131072"])  # another plan is not warm
    assert len(calls) == 2


def test_an_all_warm_tar_is_still_written_and_said(kernels_present, caches, tmp_path, monkeypatch, capsys):
    """--tar after everything is warm (or where nothing compiles: this CPU as it is) writes the caches and says so,
    with what they hold; before, it wrote nothing and said nothing."""
    monkeypatch.setattr(fuk, "is_warm", lambda kernels, folders: True)
    (caches / "triton").mkdir(parents=True)
    (caches / "triton" / "kernel.bin").write_bytes(b"x")
    assert warm_kernels.main(["--config", QWEN35, "--tar", str(tmp_path / "warm.tar")]) == 0
    out = capsys.readouterr().out
    assert "already warm for this plan" in out and "(Triton 2 files" in out  # the kernel and the node lock
    assert f"caches written to {tmp_path / 'warm.tar'}" in out and "triton/kernel.bin" in tarfile.open(tmp_path / "warm.tar").getnames()
    monkeypatch.setattr(fuk, "gpu_here", lambda: False)
    assert warm_kernels.main(["--config", QWEN35, "--tar", str(tmp_path / "none.tar")]) == 0
    assert f"caches written to {tmp_path / 'none.tar'}" in capsys.readouterr().out


@pytest.mark.parametrize("case", ["file root", "unwritable root", "unknown preset", "config folder"])
def test_the_warm_command_refuses_bad_input_in_one_line(kernels_present, caches, tmp_path, monkeypatch, capsys, case):
    """A cache root that is a file or cannot be written (/proc: not writable even by root, unlike permission bits),
    an unknown --model (refused like plan.py, not after a wait for the hub), a config folder: one line, exit 2.
    Control: the same command with a writable root and a known preset plans (the tests above)."""
    argv = ["--config", QWEN35]
    if case == "file root":
        caches.write_text("not a folder")
    elif case == "unwritable root":
        monkeypatch.setenv(fuk.SHARED_CACHE_VAR, "/proc/ulysses-train-kernel-cache")
    elif case == "unknown preset":
        argv += ["--model", "qwen3.5-99b"]
    else:
        argv = ["--config", os.path.join(REPO, "configs")]
    assert warm_kernels.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert {"file root": "cannot be written: a part of the path is a file, not a folder",
            "unwritable root": "(ULYSSES_TRAIN_KERNEL_CACHE or TRITON_CACHE_DIR)='/proc/ulysses-train-kernel-cache/",
            "unknown preset": "--model 'qwen3.5-99b': unknown preset",
            "config folder": "is a folder. Fix: give one YAML file, e.g. "}[case] in err, err


def test_a_failed_warming_step_is_one_line_and_exit_2(kernels_present, caches, monkeypatch, capsys):
    monkeypatch.setattr(warm_kernels, "compile_command", lambda *a: [sys.executable, "-c", "raise SystemExit(3)"])
    assert warm_kernels.main(["--config", QWEN35]) == 2
    assert "error: the warming step exited with code 3" in capsys.readouterr().err


def test_the_compile_command_is_one_cold_step_at_the_depth_that_holds_every_layer_kind():
    args = warm_kernels.parse_args(["--config", QWEN35, "--set", "train.steps=1"])
    command = warm_kernels.compile_command(args, "qwen3.5-9b", 8)
    assert command[1].endswith("scripts/bench.py")
    joined = " ".join(command)
    assert "--layers 4 --steps 0" in joined and "--emulate-sp 8" in joined and "--set train.steps=1" in joined


def test_the_reduced_depth_step_runs_with_the_full_depth_runs_levers(kernels_present, caches, monkeypatch):
    """On a GPU the config's `auto` levers are chosen for the whole model on this machine (the trainer's own choice)
    and passed to the 4-layer step, which would choose for its 4 layers; on CPU, and for a config without `auto`
    levers (the control), nothing is fixed."""
    from ulysses_train.planner import run as planner_run

    asked = []
    choice = types.SimpleNamespace(values={"tiled_mlp": True, "activation_offload_fraction": 0.5})
    monkeypatch.setattr(planner_run, "choose_run_levers",
                        lambda cfg, ds, world, gpus, model, hf_config=None, **hw: asked.append((world, model)) or choice)
    args = warm_kernels.parse_args(["--config", QWEN35, "--set", "parallel.sequence_parallel_size=1"])
    levers = warm_kernels.plan(args)[4]
    assert levers == ["model.activation_offload_fraction=0.5", "model.tiled_mlp=True"]
    assert asked == [(1, "qwen3.5-9b")]  # the whole model (a preset name, not the 4-layer copy) on 1 GPU
    command = " ".join(warm_kernels.compile_command(args, "qwen3.5-9b", 1, levers))
    assert "--set model.activation_offload_fraction=0.5 --set model.tiled_mlp=True" in command
    fixed = ["--config", QWEN35, "--set", "model.tiled_mlp=false", "--set", "model.keep_attention_fraction=0",
             "--set", "model.activation_offload_fraction=0", "--set", "model.attention_head_chunks=1"]
    assert warm_kernels.plan(warm_kernels.parse_args(fixed))[4] == [] and len(asked) == 1
    monkeypatch.setattr(fuk, "gpu_here", lambda: False)
    assert warm_kernels.plan(args)[4] == []


def test_one_process_per_cache_folder_compiles_the_others_wait(tmp_path):
    folders = {"Triton": str(tmp_path / "a")}
    os.makedirs(folders["Triton"])
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time; fh = open(sys.argv[1], 'w'); fcntl.flock(fh, fcntl.LOCK_EX); print('held', "
        "flush=True); time.sleep(1.5)"), os.path.join(folders["Triton"], ".ulysses_train_warm.lock")],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    started = time.perf_counter()
    with fuk.node_lock({"Triton": str(tmp_path / "b")}):  # another folder: no wait (the control)
        assert time.perf_counter() - started < 0.5
    with fuk.node_lock(folders):
        assert time.perf_counter() - started > 0.8
    holder.wait()


def test_the_kernel_cache_setting_moves_every_cache_and_a_set_variable_wins():
    env = {fuk.SHARED_CACHE_VAR: "/shared/kc", "TILELANG_CACHE_DIR": "/mine"}
    assert fuk.apply_kernel_cache(env) == {"Triton": "/shared/kc/triton", "TileLang": "/mine",
                                           "CuTe DSL": "/shared/kc/flash_attn"}
    assert env[fuk.CUTE_DSL_CACHE_SWITCH] == "1"  # FlashAttention 4 keeps its kernels on disk (its default: not)
    assert fuk.cache_folders({})["Triton"].endswith(".triton/cache")
    assert fuk.cache_folders({})["CuTe DSL"].endswith("flash_attention_cute_dsl_cache")  # FA4's own default
    mine = {fuk.CUTE_DSL_CACHE_SWITCH: "0"}
    fuk.apply_kernel_cache(mine)
    assert mine == {fuk.CUTE_DSL_CACHE_SWITCH: "0"}  # control: a user's choice wins, and no root moves nothing


def fake_run(sp=1):
    """A ResolvedRun's fields as a GPU run of the Qwen3.5 config resolves them (its mixer kernels chosen the
    trainer's way, so under kernels_present FlashQLA's)."""
    from ulysses_train.config import load_config
    from ulysses_train.model.mixers import choose_mixer_kernels
    from ulysses_train.training.ds_config import load_deepspeed_config

    cfg = load_config(QWEN35, [f"parallel.sequence_parallel_size={sp}", "model.name_or_path=qwen3.5-9b"])
    return types.SimpleNamespace(cfg=cfg, ds=load_deepspeed_config(cfg.train.deepspeed_config), hf_config="qwen3.5-9b",
                                 planned_model="qwen3.5-9b", dims=types.SimpleNamespace(world_size=sp, gpus_per_node=sp),
                                 mixer_kernels=choose_mixer_kernels(load_model_shape("qwen3.5-9b"), cuda=True))


def test_the_trainer_names_the_kernels_that_will_compile_before_its_first_step(kernels_present, caches):
    notice = fuk.trainer_notice(fake_run(), cuda=True)
    assert notice.startswith("kernels that compile on first use: FlashAttention 4 forward and backward (CuTe DSL); ")
    # FlashQLA's 400-470 s (an H200's), FA4's 5-30 s (an H100's: measured on neither here), fla's and Liger's estimates
    assert "FlashQLA's gated delta rule (TileLang)" in notice and "roughly 425-590 s in the first step" in notice
    assert f"TileLang {caches / 'tilelang'}" in notice and "scripts/warm_kernels.py" in notice
    kernels = fuk.kernels_for(fuk.facts_from_run(*[getattr(fake_run(), k) for k in ("cfg", "ds")], 1, 1, "qwen3.5-9b"))
    fuk.mark_warm(kernels, fuk.cache_folders())
    assert fuk.trainer_notice(fake_run(), cuda=True).startswith("kernels: warmed for this run")
    assert fuk.trainer_notice(fake_run(), cuda=False) is None


def test_without_the_kernels_the_trainer_says_nothing_and_the_bar_reads_train(caches, monkeypatch):
    from ulysses_train.training import loop

    assert fuk.trainer_notice(fake_run(), cuda=True) is None  # the control: nothing compiles here
    stub = types.SimpleNamespace(rank=0, start_step=0, run=fake_run(), cfg=fake_run().cfg)
    monkeypatch.setattr(loop, "cuda_training", lambda: True)
    assert loop.Trainer._progress_bar(stub).desc == "train"
    monkeypatch.setattr(loop, "trainer_notice", lambda run, cuda: "kernels that compile on first use: x")
    assert loop.Trainer._progress_bar(stub).desc == "compiling kernels"


def test_the_kernels_slow_imports_happen_when_the_engine_is_built_not_in_the_first_step(kernels_present, caches,
                                                                                       monkeypatch, tmp_path):
    """FlashAttention 4's and FlashQLA's modules are imported by build_engine, before the model is built, on every
    rank (each process imports them). A stand-in module records its import; control: it is not imported before."""
    from ulysses_train.training import step

    kernels = fuk.run_kernels(fake_run(), cuda=True)
    assert [k.modules for k in kernels if k.modules] == [("flash_attn.cute.interface",), ("flash_qla",)]
    assert fuk.run_kernels(fake_run(), cuda=False) == []
    (tmp_path / "stand_in_kernel.py").write_text("import sys\nsys.modules[__name__].imported = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    stand_in = [fuk.FirstUseKernel("a kernel", "Triton", "", (1, 2), "", ("stand_in_kernel",))]
    assert "stand_in_kernel" not in sys.modules  # the control
    seen = []

    class ModelBuilt(Exception):
        pass

    def model_built(*args, **kwargs):
        seen.append("stand_in_kernel" in sys.modules)
        raise ModelBuilt

    monkeypatch.setattr(step, "init_distributed", lambda minutes: None)
    monkeypatch.setattr(step, "with_levers", lambda run: run)
    monkeypatch.setattr(step, "cuda_training", lambda: True)
    monkeypatch.setattr(step, "run_kernels", lambda run, cuda: stand_in if cuda else [])
    monkeypatch.setattr(step, "build_long_context_model", model_built)
    run = types.SimpleNamespace(**{**vars(fake_run()), "dims": types.SimpleNamespace(rank=1, sp=1)}, levers=None,
                                rope="", attn="sdpa")
    try:
        with pytest.raises(ModelBuilt):
            step.build_engine(run)
        assert seen == [True]  # imported before the model was built, on a rank other than 0
    finally:
        sys.modules.pop("stand_in_kernel", None)


def test_compile_figures_are_the_cards_own():
    """The notice's and the bar's seconds come from the card they were measured on (first_use_kernels.COMPILE_SECONDS):
    FlashQLA's on an H100 are the H100's, on an H200 the H200's; a card with no figure of its own gets the largest
    measured one, said to be from another card; a kernel measured on no card keeps its estimate, said as one."""
    facts = dict(tokens=262_144, sp=1, attention="fa4", heads=16, head_dim=256, linear=(32, 128, 128),
                 mixer_kernels=(("gated_deltanet", "flash_qla"),))
    rule = {card: next(k for k in fuk.kernels_for(fuk.KernelFacts(**facts, card=card)) if "FlashQLA" in k.name)
            for card in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA B200")}
    assert rule["NVIDIA H100 80GB HBM3"].seconds == (100, 180) and "H100" in rule["NVIDIA H100 80GB HBM3"].source
    assert rule["NVIDIA H200"].seconds == (400, 470) and "H200" in rule["NVIDIA H200"].source
    assert rule["NVIDIA B200"].seconds == (400, 470) and "measured on an H200, not on this card" in \
        rule["NVIDIA B200"].source
    attention = fuk.kernels_for(fuk.KernelFacts(**facts, card="NVIDIA H200"))[0]
    assert attention.seconds == (5, 30) and attention.source == "measured on an H100, not on this card"
    assert fuk.compile_seconds("liger", "NVIDIA H100", (5, 30)) == ((5, 30), "not measured: an estimate")
    notice = fuk.first_step_notice(fuk.kernels_for(fuk.KernelFacts(**facts, card="NVIDIA H100 80GB HBM3")), {}, False)
    assert "a fresh H100" in notice and "roughly" in notice


def test_a_lora_runs_levers_are_chosen_with_its_adapters_counted(kernels_present, caches, monkeypatch):
    """With model.lora the full-depth choice gets the model's config, so the planner counts the adapters PEFT will
    inject (as the trainer's preflight does); the control, the same config without LoRA, passes none."""
    from ulysses_train.planner import run as planner_run

    seen = []
    choice = types.SimpleNamespace(values={"tiled_mlp": True})
    monkeypatch.setattr(planner_run, "choose_run_levers",
                        lambda cfg, ds, world, gpus, model, hf_config=None, **hw: seen.append(hf_config) or choice)
    for extra in (["--set", "model.lora.r=8"], []):
        warm_kernels.plan(warm_kernels.parse_args(["--config", QWEN35, *extra]))
    lora, plain = seen
    assert lora.model_type == "qwen3_5_text" and lora.num_hidden_layers == 32 and plain is None
    fields = planner_run.lora_fields(warm_kernels.run_config(QWEN35, ["model.lora.r=8"]), lora)
    assert fields["adapter_params"] > 0


def test_a_tar_path_that_cannot_be_written_is_one_line_before_any_compile(tmp_path):
    """--tar onto a read-only filesystem (/proc here) or into a missing folder: one line naming the path, before
    the compile (it was a traceback after it). Control: a writable path passes and leaves nothing behind."""
    from ulysses_train.errors import UserError

    for path in ("/proc/kernel-cache.tar", str(tmp_path / "missing" / "kernel-cache.tar")):
        with pytest.raises(UserError, match=r"^--tar '.*': cannot write there \(.*\)\. Fix: a path on a writable"):
            warm_kernels.check_tar_path(path)
    warm_kernels.check_tar_path(str(tmp_path / "cache.tar"))
    assert not (tmp_path / "cache.tar").exists()
