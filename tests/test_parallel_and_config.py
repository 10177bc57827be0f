"""Layout arithmetic, sequence slices and every up-front error, without starting any process."""
import pytest
import torch
from helpers import tiny_qwen3_config

from ulysses_train.config import Config, ConfigError, LossConfig, ModelConfig, ParallelConfig, load_config
from ulysses_train.parallel.layout import ParallelDims, slice_sequence, validate_parallel_layout
from ulysses_train.training.ds_config import check_reduction_path, finalize_deepspeed_config, gradient_divisor


def test_parallel_dims_derive_dp_and_ranks():
    dims = ParallelDims(world_size=8, sp=4, rank=6)
    assert (dims.dp, dims.sp_rank, dims.dp_rank) == (2, 2, 1)


def test_world_not_divisible_by_sp_names_values_and_fix():
    with pytest.raises(ConfigError, match=r"world size 6 is not divisible by parallel.sequence_parallel_size=4.*e\.g\. 3"):
        ParallelDims(world_size=6, sp=4)


def test_sp_straddling_nodes_refused_unless_allowed():
    with pytest.raises(ConfigError, match="does not divide the 8 GPUs per node"):
        ParallelDims(world_size=24, sp=6, gpus_per_node=8)
    with pytest.raises(ConfigError, match="larger than a node"):
        ParallelDims(world_size=32, sp=16, gpus_per_node=8)
    assert ParallelDims(world_size=32, sp=16, gpus_per_node=8, allow_sp_across_nodes=True).dp == 2


def test_query_heads_not_divisible_by_sp():
    with pytest.raises(ConfigError, match=r"4 query heads, not divisible by parallel.sequence_parallel_size=3.*\[1, 2, 4\]"):
        validate_parallel_layout(tiny_qwen3_config(), sp=3, attn_implementation="sdpa")


def test_kv_heads_neither_dividing_nor_divisible():
    cfg = tiny_qwen3_config(num_attention_heads=12, num_key_value_heads=4)
    with pytest.raises(ConfigError, match="4 KV heads and parallel.sequence_parallel_size=6"):
        validate_parallel_layout(cfg, sp=6, attn_implementation="sdpa")
    validate_parallel_layout(cfg, sp=2, attn_implementation="sdpa")   # sp divides KV heads
    validate_parallel_layout(tiny_qwen3_config(num_attention_heads=8, num_key_value_heads=2), sp=8,
                             attn_implementation="sdpa")                  # KV heads replicated


def test_eager_attention_refused_with_sp():
    with pytest.raises(ConfigError, match="'eager' cannot run with sequence parallelism"):
        validate_parallel_layout(tiny_qwen3_config(), sp=2, attn_implementation="eager")
    validate_parallel_layout(tiny_qwen3_config(), sp=1, attn_implementation="eager")


def test_unknown_loss_type():
    with pytest.raises(ConfigError, match="loss.type='focal' is not valid; choose one of chunked, nll"):
        Config(loss=LossConfig(type="focal"))


def test_unknown_config_key_lists_valid_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match="unknown key train.stepz; valid keys of 'train'"):
        load_config(str(path))


def test_overrides_beat_file_and_parse_types(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 3\nloss:\n  chunk_rows: 64\n")
    cfg = load_config(str(path), ["train.steps=10", "model.gradient_checkpointing=false"])
    assert (cfg.train.steps, cfg.loss.chunk_rows, cfg.model.gradient_checkpointing) == (10, 64, False)


@pytest.mark.parametrize("sp,pad", [(1, 0), (2, 0), (4, 2), (8, 2)])
def test_slices_concatenate_to_shifted_padded_sequence(sp, pad):
    length = 30
    ids = torch.arange(100, 100 + length).unsqueeze(0)
    labels = ids.clone()
    labels[:, :5] = -100
    slices = [slice_sequence(ids, labels, sp, r, pad_token_id=7) for r in range(sp)]
    got_ids = torch.cat([s["input_ids"] for s in slices], 1)
    got_pos = torch.cat([s["position_ids"] for s in slices], 1)
    got_lab = torch.cat([s["shift_labels"] for s in slices], 1)
    total = length + pad
    assert got_ids.shape == (1, total) and all(s["input_ids"].shape[1] == total // sp for s in slices)
    assert torch.equal(got_ids[:, :length], ids) and (got_ids[:, length:] == 7).all()
    assert torch.equal(got_pos, torch.arange(total).unsqueeze(0))
    # label of token t is token t+1: none lost at slice boundaries, last real token and padding ignored
    assert torch.equal(got_lab[:, :length - 1], labels[:, 1:])
    assert (got_lab[:, length - 1:] == -100).all()
    assert int((got_lab != -100).sum()) == int((labels[:, 1:] != -100).sum())


def test_deepspeed_batch_arithmetic_and_conflicts():
    dims = ParallelDims(world_size=8, sp=4)
    ds = finalize_deepspeed_config({"train_batch_size": "auto", "bf16": {"enabled": "auto"}}, dims, 3, "bfloat16")
    assert (ds["train_batch_size"], ds["gradient_accumulation_steps"], ds["train_micro_batch_size_per_gpu"]) == (6, 3, 1)
    assert ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False
    with pytest.raises(ConfigError, match="train_batch_size=16, but this run needs 6"):
        finalize_deepspeed_config({"train_batch_size": 16}, dims, 3, "bfloat16")
    with pytest.raises(ConfigError, match="bf16.enabled=True but model.dtype='float32'"):
        finalize_deepspeed_config({"bf16": {"enabled": True}}, dims, 1, "float32")
    with pytest.raises(ConfigError, match="stage=2"):
        finalize_deepspeed_config({"zero_optimization": {"stage": 2}}, dims, 1, "bfloat16")


def test_reuse_distance_auto_is_two_decoder_layers_and_a_number_is_kept():
    from ulysses_train.constants import REUSE_DISTANCE_LAYERS
    from ulysses_train.training.resolved_run import decoder_layer_params

    dims = ParallelDims(world_size=2, sp=2)
    from transformers import AutoModelForCausalLM

    layer = decoder_layer_params(tiny_qwen3_config())
    built = AutoModelForCausalLM.from_config(tiny_qwen3_config())  # reference: count a real layer's tensors
    assert layer == sum(p.numel() for p in built.model.layers[0].parameters())
    for given in ({}, {"zero_optimization": {"stage3_max_reuse_distance": "auto"}}):
        ds = finalize_deepspeed_config(given, dims, 1, "float32", layer_params=layer)
        assert ds["zero_optimization"]["stage3_max_reuse_distance"] == REUSE_DISTANCE_LAYERS * layer == 2 * layer
    kept = finalize_deepspeed_config({"zero_optimization": {"stage3_max_reuse_distance": 12345}}, dims, 1,
                                     "float32", layer_params=layer)
    assert kept["zero_optimization"]["stage3_max_reuse_distance"] == 12345
    # without a layer size (callers that build no model) DeepSpeed's own default stays: no key, no "auto" left
    bare = finalize_deepspeed_config({"zero_optimization": {"stage3_max_reuse_distance": "auto"}}, dims, 1, "float32")
    assert "stage3_max_reuse_distance" not in bare["zero_optimization"]


def test_gradient_divisor_and_reduction_path_check():
    dims = ParallelDims(world_size=8, sp=4)
    assert gradient_divisor({"zero_optimization": {"reduce_scatter": True}}, dims) == 8
    assert gradient_divisor({"zero_optimization": {"reduce_scatter": False}}, dims) == 2
    small_bucket = {"zero_optimization": {"reduce_scatter": False, "reduce_bucket_size": 1000}}
    with pytest.raises(ConfigError, match="reduce_bucket_size >= the largest parameter"):
        check_reduction_path(small_bucket, dims, largest_param_numel=5000)
    check_reduction_path(small_bucket, ParallelDims(world_size=8, sp=1), largest_param_numel=5000)


def test_build_engine_refuses_before_any_heavy_work(monkeypatch, tmp_path):
    """Bad layouts fail in build_engine before a process group starts or a weight loads."""
    from ulysses_train.training.step import build_engine, resolve_run

    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    cfg = Config(model=ModelConfig(name_or_path="unused", random_init=True),
                 parallel=ParallelConfig(sequence_parallel_size=2))
    with pytest.raises(ConfigError, match="world size 3 is not divisible"):
        build_engine(resolve_run(cfg, tiny_qwen3_config()))
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg.model.attn_implementation = "eager"
    with pytest.raises(ConfigError, match="cannot run with sequence parallelism"):
        build_engine(resolve_run(cfg, tiny_qwen3_config()))
    assert not torch.distributed.is_initialized()


def test_config_override_of_depth_rebuilds_the_per_layer_list():
    """`model.config_overrides: {num_hidden_layers: N}` on a config built for another depth: transformers
    derived `layer_types` for the old depth, and building the model would index past its end."""
    from transformers import AutoModelForCausalLM

    from ulysses_train.config import ModelConfig
    from ulysses_train.data.demo import demo_model_config
    from ulysses_train.model.loading import load_model_config

    base = demo_model_config(50)
    assert len(base.layer_types) == 2
    cfg = load_model_config(ModelConfig(config_overrides={"num_hidden_layers": 3, "hidden_size": 64}), hf_config=base)
    assert cfg.num_hidden_layers == 3 and len(cfg.layer_types) == 3 and cfg.hidden_size == 64
    model = AutoModelForCausalLM.from_config(cfg)
    assert len(model.model.layers) == 3


def test_exit_process_shuts_down_flushes_and_keeps_the_exit_code(tmp_path):
    """Ranks end through parallel.exit_process: what they printed (unterminated) reaches the parent, success
    exits 0 (two gloo ranks), a failure keeps its code (torchrun reports a failed worker as 1). The failure runs
    one rank: with two, torchrun kills the other as soon as the first fails, and whether that one had flushed
    yet is a race (it failed 1 run in 6 under load)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "worker.py"
    script.write_text(
        "import sys, torch\n"
        "from ulysses_train.parallel.layout import exit_process\n"
        "torch.distributed.init_process_group('gloo')\n"
        "print('finished-' + str(torch.distributed.get_rank()), end='')\n"
        "exit_process(int(sys.argv[1]))\n")
    for code, expected, ranks in ((0, 0, 2), (3, 1, 1)):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc_per_node={ranks}", str(script), str(code)], capture_output=True, text=True,
                              timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert proc.returncode == expected, proc.stderr[-2000:]
        assert all(f"finished-{rank}" in proc.stdout for rank in range(ranks)), proc.stdout


def test_a_single_process_run_starts_while_another_holds_the_default_port():
    """A run without a launcher is a one-process group: init_distributed lets the OS pick its port, so it starts
    while the default port (launch.DEFAULT_PORT) is taken, as by a second single-process run on the machine.
    Negative control: the same start told to use the default port fails with EADDRINUSE."""
    import os
    import subprocess
    import sys

    from ulysses_train.parallel.launch import DEFAULT_PORT

    try:  # the default port held as another run holds it: by a rendezvous store
        holder = torch.distributed.TCPStore("127.0.0.1", DEFAULT_PORT, is_master=True, wait_for_workers=False)
    except RuntimeError:
        holder = None  # something else holds it already: the condition under test either way
    code = ("from ulysses_train.parallel.layout import init_distributed\n"
            "init_distributed(1)\nimport torch.distributed as d\nprint('started', d.get_world_size())\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT") and not k.startswith("SLURM_")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    try:
        run = lambda extra: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,  # noqa: E731
                                           timeout=120, env=dict(env, **extra))
        started = run({})
        assert started.returncode == 0 and "started 1" in started.stdout, started.stderr[-2000:]
        refused = run({"MASTER_PORT": str(DEFAULT_PORT)})
        assert refused.returncode != 0 and "EADDRINUSE" in refused.stderr
    finally:
        del holder


@pytest.mark.parametrize("overrides,want", [
    (["model.low_memory_rmsnorm=false"], "hf"),
    (["model.rmsnorm_kernel=chunked"], "chunked"),
    (["model.low_memory_rmsnorm=true", "model.rmsnorm_kernel=torch"], "torch"),
    (["model.rmsnorm=chunked"], "chunked"),
    ([], "torch"),
])
def test_old_rmsnorm_keys_still_work_with_a_deprecation_message(overrides, want, capsys):
    from ulysses_train.config import load_config

    assert load_config(None, overrides).model.rmsnorm == want
    err = capsys.readouterr().err
    assert ("is deprecated; this run uses model.rmsnorm=" in err) == any("rmsnorm_" in o or "low_memory" in o
                                                                        for o in overrides)


def test_old_and_new_rmsnorm_keys_together_are_refused():
    from ulysses_train.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="model.rmsnorm replaces model.low_memory_rmsnorm"):
        load_config(None, ["model.rmsnorm=torch", "model.low_memory_rmsnorm=false"])


def test_the_renamed_deepspeed_json_names_its_new_name():
    from ulysses_train.config import ConfigError
    from ulysses_train.training.ds_config import load_deepspeed_config

    with pytest.raises(ConfigError, match="was renamed: use ds_configs/zero3_activation_offload.json"):
        load_deepspeed_config("ds_configs/zero3_offload.json")
    assert load_deepspeed_config("ds_configs/zero3_activation_offload.json")["activation_checkpointing"]


def test_auto_sequence_parallel_size_by_hand():
    """auto: the largest sp that divides the processes, stays in a node and splits the heads (the demo model:
    4 query heads, 2 KV heads, so sp is at most 4)."""
    from ulysses_train.data.demo import demo_model_config
    from ulysses_train.parallel.layout import auto_sequence_parallel_size

    model = demo_model_config(64)
    assert [auto_sequence_parallel_size(world, model) for world in (1, 2, 3, 4, 6, 8)] == [1, 2, 1, 4, 2, 4]
    assert auto_sequence_parallel_size(4, model, gpus_per_node=2) == 2  # an sp group never leaves its node
    assert auto_sequence_parallel_size(4, model, gpus_per_node=2, allow_sp_across_nodes=True) == 4
    with pytest.raises(ConfigError, match="parallel.sequence_parallel_size='some' must be"):
        load_config(None, ["parallel.sequence_parallel_size=some"])


def test_more_processes_than_gpus_is_named_as_such(monkeypatch):
    from ulysses_train.parallel.layout import check_local_rank_has_a_gpu

    check_local_rank_has_a_gpu(0, 1)  # negative control: rank 0 has its GPU
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"2 processes were started on this node but it has 1 GPU\(s\): start at "
                                          r"most 1 \(deepspeed --num_gpus 1"):
        check_local_rank_has_a_gpu(1, 1)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(ConfigError, match="under srun use --gpus-per-node"):  # one process per node, GPUs hidden
        check_local_rank_has_a_gpu(1, 1)


def test_ds_accelerator_cpu_trains_on_the_cpu_even_where_a_gpu_is(monkeypatch):
    from ulysses_train import device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert not device.cuda_training() and device.collective_device().type == "cpu"
    monkeypatch.delenv("DS_ACCELERATOR")
    assert device.cuda_training()  # negative control: a GPU and no accelerator choice means CUDA


def test_free_port_lies_below_the_ephemeral_range_and_is_free(monkeypatch):
    """free_port's port is outside the range the OS gives source ports and bind(0) ports from, so no connection
    the machine opens (another group's gloo) can take it before the group binds it seconds later; nothing listens
    on it. Control: bind(0), what it returned before, lands inside that range. With no room below the range it
    falls back to bind(0) and the port is still free."""
    import socket

    from ulysses_train.parallel import ports

    low, high = ports.ephemeral_ports()
    port = ports.free_port()
    assert ports.LOWEST_FREE_PORT <= port < low
    with socket.socket() as sock:
        sock.bind(("", port))
        with socket.socket() as other:
            other.bind(("127.0.0.1", 0))
            assert low <= other.getsockname()[1] <= high  # the control
    monkeypatch.setattr(ports, "ephemeral_ports", lambda: (1024, 65535))
    with socket.socket() as sock:
        sock.bind(("", ports.free_port()))
