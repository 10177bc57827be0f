"""scripts/bench.py end to end on CPU (gloo), the multi-process path the GPU stages of benchmarks/multi_gpu.sh use:
2 processes, sp=2, a tiny shape, attention through the fa4 op; one warm timed step and the all-to-all share from
DeepSpeed's comms logger."""
import contextlib
import json
import os
import socket
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}


def test_bench_two_processes_sp2_with_all_to_all_share(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, os.path.join(REPO, "scripts", "bench.py"), "--model", "qwen3-0.6b",
           "--shape-overrides", json.dumps(TINY), "--lengths", "256", "--levers", "chunked", "--sp", "2",
           "--nproc", "2", "--steps", "1", "--comm-share", "--attn", "fa4", "--json", str(out)]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["status"] == "ok", row["status"]
    assert row["attn"] == "fa4"  # FlashAttention 4's op, its CPU reference kernel here (tests/test_fa4.py)
    assert row["sp"] == 2 and row["s_per_step"] > 0 and row["tokens_per_s"] > 0
    # every step's costs (training/step_costs.py), the warm-up's first: its seconds are not the timed step's
    costs = row["step_costs"]
    assert len(costs) == 2 and row["all_step_s"] == [round(costs[1]["seconds"], 3)] and row["engine_build_s"] > 0
    assert set(costs[0]["cache_files_added"]) == {"Triton", "TileLang", "CuTe DSL"} and costs[0]["pinned_alloc_s"] == 0.0
    assert row["rmsnorm"] == "hf"  # the sets before `all` keep Hugging Face's norm (model.rmsnorm: hf)
    # 2 layers x 4 exchanges (q, k, v out; attention output back) in forward, again in the checkpoint's
    # recompute, and once more in backward (the exchange's gradient is an all-to-all too)
    assert row["all_to_all_calls"] == 2 * 4 * 3
    assert 0 < row["all_to_all_s"] and 0 < row["all_to_all_share"] < 1
    assert "all-to-all" in proc.stdout


def test_kernel_kinds():
    """Names as torch.profiler reports them on an H200 (CUDA kernels) and on CPU (aten ops)."""
    from ulysses_train.diagnostics.step_time import kernel_kind

    assert kernel_kind("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3") == "attention"
    assert kernel_kind("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>") == "attention"
    assert kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64") == "matmul"
    assert kernel_kind("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN") == "matmul"
    assert kernel_kind("ncclDevKernel_AllToAll_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "communication"
    assert kernel_kind("Memcpy DtoH (Device -> Pinned)") == "host copies (offload)"
    assert kernel_kind("Memcpy DtoD (Device -> Device)") == "copy"
    assert kernel_kind("chunk_gated_delta_rule_fwd_kernel_h_blockdim64") == "gated delta rule"
    assert kernel_kind("chunk_bwd_kernel_dqkwg") == "gated delta rule"
    assert kernel_kind("causal_conv1d_fwd_kernel") == "causal conv1d"
    assert kernel_kind("layer_norm_gated_fwd_kernel") == "norms"
    assert kernel_kind("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16>") \
        == "norms"
    assert kernel_kind("aten::mm") == "matmul" and kernel_kind("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert kernel_kind("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>") \
        == "elementwise and other"


@contextlib.contextmanager
def default_port_held():
    """Another job on the machine listening on the default rendezvous port (29500)."""
    sock = socket.socket()
    try:
        sock.bind(("", 29500))
        sock.listen()
    except OSError:  # something else holds it already: the condition under test holds anyway
        pass
    try:
        yield
    finally:
        sock.close()


def test_bench_time_breakdown_on_cpu(tmp_path):
    """A one-process point, run while another job holds the default port (two benches on one GPU host), with a
    DeepSpeed key set by --deepspeed-overrides (its row's plan fields read it back from the run's JSON)."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, os.path.join(REPO, "scripts", "bench.py"), "--model", "qwen3-0.6b",
           "--shape-overrides", json.dumps(TINY), "--lengths", "128", "--levers", "chunked", "--steps", "1",
           "--time-breakdown", "--deepspeed-overrides", '{"seq_parallel_communication_data_type": "bf16"}',
           "--json", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    with default_port_held():
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["status"] == "ok", row["status"]
    kinds = row["time_by_kind_s"]
    assert kinds["matmul"] > 0 and kinds["attention"] > 0 and kinds["elementwise and other"] > 0
    assert 0 < sum(kinds.values()) and row["profiled_step_s"] > 0
    assert len(row["top_kernels"]) == 40 and row["top_kernels"][0]["s"] >= row["top_kernels"][-1]["s"]
    assert "profiled step by kind" in proc.stdout
    # the kernels the planner record of this row needs (a CPU run with the `chunked` set's Hugging Face norm), and
    # the reduce's cast: bf16 gradients from this fp32 CPU model, 2 bytes (DeepSpeed's fp32 default would be 4)
    assert row["plan_kernels"] == {"mixer_kernels": {}, "offset_norm_kernel": False, "swiglu_kernel": False,
                                   "low_memory_rmsnorm": False, "attention_kernel": "sdpa", "sp_reduce_cast_bytes": 2}


def test_timeout_keeps_the_timed_steps(tmp_path):
    """A point that times out in its extra (profiled) step keeps its timed numbers; one that never finished
    its steps reports the last phase it reached (what a timeout of a 10-minute device command needs)."""
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    from bench import timed_out_row

    point = {"levers": "all", "length": 131072}
    stderr = "noise\n[bench] engine built in 40 s\n[bench] step 0: 70.00 s\n[bench] step 1: 47.00 s\n"
    missing = tmp_path / "none.json"
    row = timed_out_row(point, str(missing), 290, stderr.encode())
    assert row["status"] == "timeout after 290 s (reached: engine built in 40 s; step 0: 70.00 s; step 1: 47.00 s)"
    assert "s_per_step" not in row
    assert timed_out_row(point, str(missing), 5, "")["status"] == "timeout after 5 s (engine not built)"

    written = tmp_path / "row.json"
    written.write_text(json.dumps({**point, "status": "ok", "s_per_step": 47.0}))
    row = timed_out_row(point, str(written), 290, stderr)
    assert row["status"] == "ok" and row["s_per_step"] == 47.0
    assert row["extra_steps"] == "timeout after 290 s (after: step 0: 70.00 s; step 1: 47.00 s)"


def test_a_failure_after_the_timed_steps_keeps_them(tmp_path):
    """A point whose process fails after writing its row (in its planner record or a profiled step: a LoRA row
    once lost a 151 s GPU step so) keeps its timed numbers and names the failure; one that failed before (the
    negative control: no row) reports OOM or the error, as before."""
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    from bench import failed_row

    point = {"levers": "all", "length": 675892}
    tail = "Traceback ...\nNotImplementedError: Cannot copy out of meta tensor; no data!\n"
    written = tmp_path / "row.json"
    written.write_text(json.dumps({**point, "status": "ok", "s_per_step": 120.5}))
    row = failed_row(point, str(written), tail)
    assert row["status"] == "ok" and row["s_per_step"] == 120.5
    assert row["extra_steps"].startswith("failed: Traceback") and row["extra_steps"].endswith("no data!")
    empty = tmp_path / "empty.json"
    empty.write_text("")
    assert failed_row(point, str(empty), tail)["status"] == "failed: " + tail.strip()
    assert failed_row(point, str(empty), "torch.OutOfMemoryError: CUDA out of memory")["status"] == "OOM"
    # an out-of-memory row says how far it got and what it asked for (a build and a step read differently)
    stderr = ("[bench] engine built in 35 s\nTraceback ...\ntorch.OutOfMemoryError: CUDA out of memory. Tried to "
              "allocate 28.00 GiB. GPU 0 has a total capacity of 79.18 GiB\n")
    assert failed_row(point, str(empty), stderr)["oom"] == {"reached": "engine built in 35 s",
                                                            "request": "Tried to allocate 28.00 GiB"}
    assert failed_row(point, str(empty), "CUDA out of memory")["oom"] == {"reached": "engine not built",
                                                                          "request": ""}


def test_bench_config_times_the_run_config_as_train_py_would(tmp_path):
    """--config: the run config's own levers and DeepSpeed JSON, its data.seq_length, synthetic tokens in place of
    the corpus it names (which does not exist here), `--set` on top."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from helpers import save_tiny_model

    model = save_tiny_model(str(tmp_path / "tiny"))
    config = tmp_path / "run.yaml"
    config.write_text(f"model:\n  name_or_path: {model}\n  dtype: float32\n  keep_attention_fraction: 0.5\n"
                      f"  tiled_mlp: true\ndata:\n  source: {tmp_path / 'no_such_corpus.jsonl'}\n"
                      f"  seq_length: 128\ntrain:\n  deepspeed_config: {REPO}/ds_configs/zero3.json\n")
    out = tmp_path / "bench.json"
    cmd = [sys.executable, os.path.join(REPO, "scripts", "bench.py"), "--config", str(config),
           "--set", "loss.chunk_rows=16", "--steps", "1", "--json", str(out)]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["status"] == "ok", row["status"]
    assert row["levers"] == "config" and row["length"] == 128 and row["attn"] == "sdpa"
    assert row["run_levers"]["keep_attention_fraction"] == 0.5 and row["run_levers"]["tiled_mlp"] is True
    assert row["run_levers"]["cpu_checkpointing"] is False  # zero3.json's setting, not a lever set's


def test_bench_config_with_a_bad_key_is_one_line(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("model:\n  no_such_key: 1\n")
    cmd = [sys.executable, os.path.join(REPO, "scripts", "bench.py"), "--config", str(config)]
    proc = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 2 and "no_such_key" in proc.stderr and "Traceback" not in proc.stderr


def test_docs_column_shows_the_documents_a_packed_config_ran_with(capsys):
    """A --config point with data.packing: documents at 131,072 tokens runs 16 documents of 8,192; its row (and the
    table's docs column) said 1 (the --documents flag's 0). Controls: glue is one sequence; --documents wins."""
    from helpers import load_script

    sys.path.insert(0, os.path.join(REPO, "scripts"))  # bench.py imports its points' module, bench_point.py
    bench = load_script("scripts/bench.py")
    point = {"documents": 0, "length": 131072}
    from bench_point import synthetic_documents

    assert synthetic_documents(point, "documents") == 16
    assert synthetic_documents(point, "glue") == 0
    assert synthetic_documents({**point, "documents": 3}, "documents") == 3
    row = {**point, "documents": 16, "levers": "config", "sp": 1, "status": "failed"}
    bench.print_table([row])
    assert capsys.readouterr().out.splitlines()[-1].split()[:4] == ["config", "sdpa", "131072", "16"]


def test_peer_script_help_and_its_guard_against_torch_fallbacks():
    """benchmarks/peer_trl.py (the TRL + Liger side of the Qwen3.5 comparison) answers --help on CPU, and its guard
    finds the gated delta rule bound to transformers' torch reference where fla is not importable (as here): the
    peer then refuses instead of running for hours. Control: a module whose function is the fast one passes."""
    import importlib
    import importlib.util
    import types

    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "peer_trl.py"), "--help"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0 and "--lora" in proc.stdout, proc.stderr[-2000:]
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import peer_trl

    modeling = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    if importlib.util.find_spec("fla") is None:
        assert peer_trl.torch_fallbacks(modeling) == ["torch_chunk_gated_delta_rule"]

    def fast(q):
        return q

    assert peer_trl.torch_fallbacks(types.SimpleNamespace(chunk_gated_delta_rule=fast)) == []


def test_device_time_by_op_keeps_aten_ops_and_the_model_lines():
    """diagnostics/step_time.py (`--time-breakdown-ops`): each aten op's directly launched kernels, costliest first,
    with the Python lines that called it and torch's own frames left out; kernels (no `aten::` key) and ops that
    launched nothing are not listed. Profiler events stood in by their fields (the real ones need a GPU)."""
    from types import SimpleNamespace as Event

    from ulysses_train.diagnostics.step_time import ops_by_device_time

    model_line = "ulysses_train/model/mixers/gated_deltanet.py(207): ulysses_gated_deltanet_forward"
    events = [Event(key="aten::copy_", self_device_time_total=2e5, count=7, stack=[]),
              Event(key="aten::cat", self_device_time_total=3e5, count=48,
                    stack=["torch/nn/modules/module.py(1751): _call_impl", model_line]),
              Event(key="CatArrayBatchedCopy", self_device_time_total=3e5, count=48, stack=[]),
              Event(key="aten::view", self_device_time_total=0, count=9, stack=[])]
    rows = ops_by_device_time(events, with_stack=True)
    assert rows == [{"s": 0.3, "op": "aten::cat", "calls": 48, "stack": [model_line]},
                    {"s": 0.2, "op": "aten::copy_", "calls": 7, "stack": []}]
    assert "stack" not in ops_by_device_time(events)[0]


def test_a_gpu_length_on_a_machine_without_a_gpu_is_refused_in_one_line(capsys):
    """docs/planner.md's emulated 1M-token rank, typed on a CPU machine, computed for minutes; it is refused in one
    line naming the fix. Control: a CPU-sized length passes the check."""
    from helpers import load_script

    sys.path.insert(0, os.path.join(REPO, "scripts"))
    bench = load_script("scripts/bench.py")
    argv = ["--model", "qwen3-8b", "--layers", "2", "--lengths", "1048576", "--levers", "all", "--keep-fraction", "0",
            "--optimizer", "cpu", "--attn", "fa4", "--emulate-sp", "8"]  # as docs/planner.md gives it
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --lengths 1,048,576 on a machine without a GPU") and err.count("\n") == 1, err
    bench.check_cpu_lengths([256, bench.CPU_LONGEST])


def test_shape_overrides_that_are_not_a_json_object_are_refused_in_one_line(capsys):
    """`--shape-overrides hidden_size=64` ended in a JSON traceback; it is refused in one line showing the form.
    Control: a JSON object is read as the fields."""
    from helpers import load_script

    sys.path.insert(0, os.path.join(REPO, "scripts"))
    bench = load_script("scripts/bench.py")
    assert bench.main(["--model", "qwen3-0.6b", "--shape-overrides", "hidden_size=64", "--lengths", "128"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --shape-overrides 'hidden_size=64': give a JSON object") and err.count("\n") == 1
    assert bench.parse_json_object("--shape-overrides", '{"hidden_size": 64}', "") == {"hidden_size": 64}
