"""An emulated rank of an sp=N step (parallel/emulate.py: one process, torch's fake process group) does what
rank 0 of a real N-process run does, and the communication model (planner/communication.py) adds back what the
fake collectives skip.

The reference is a real 2-process gloo run of the same step: the emulated rank must run the same attention
kernels on the same shapes, issue the same collectives with the same message sizes, and hold the same ZeRO-3
shares of the weights, the fp32 masters and the optimizer state. sp=4 is checked against hand-computed values.
"""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from helpers import REPO, run_workers, save_tiny_model, tiny_qwen3_config, write_ds_config
from ulysses_train.errors import UserError
from ulysses_train.parallel.emulate import check_emulation, loop_back_collectives
from ulysses_train.planner.communication import (CALL_LATENCY_S, EFFECTIVE_LINK_GBPS, estimate_communication,
                                                 wire_bytes)
from ulysses_train.sequence_parallel import SequenceParallel

WORKER = os.path.join(REPO, "tests", "emulate_worker.py")
LEVERS = ["--set", "model.tiled_mlp=true", "--set", "model.keep_attention_fraction=0.5"]
LENGTH = 64
ENV = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=REPO, TOKENIZERS_PARALLELISM="false")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("emulate")
    model = save_tiny_model(str(root / "model"), config=tiny_qwen3_config(num_hidden_layers=2))
    ds = write_ds_config(str(root / "ds.json"), offload_activations=True)
    return root, model, ds


def emulated(setup, sp: int, name: str) -> dict:
    """The emulated rank's record (one plain process, no launcher)."""
    root, model, ds = setup
    out = root / name
    args = ["--emulate", str(sp)] if sp > 1 else ["--sp", "1"]
    proc = subprocess.run([sys.executable, WORKER, "--model-dir", model, "--ds-config", ds, "--out", str(out),
                           "--length", str(LENGTH), *args, *LEVERS], env=ENV, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


@pytest.fixture(scope="module")
def real_sp2(setup):
    root, model, ds = setup
    out = root / "real.pt"
    run_workers(2, ["--model-dir", model, "--ds-config", ds, "--out", str(out), "--length", str(LENGTH),
                    "--sp", "2", *LEVERS], script=WORKER)
    return torch.load(out)


def test_an_emulated_sp2_rank_does_what_rank_0_of_a_real_two_process_run_does(setup, real_sp2):
    mine = emulated(setup, 2, "emulated2.pt")
    assert mine == real_sp2
    # and the reference is what an sp=2 rank must do: attention over all 64 tokens for 2 of the 4 query heads
    # (1 of the 2 KV heads); per layer and pass (forward, recompute, backward) two all-to-alls carry the slice's
    # 4 query heads (q, the output) and two its 2 KV heads (k, v)
    config = tiny_qwen3_config()
    head_dim = config.head_dim
    (kernel,) = [k for k in real_sp2["attention"] if "flash_attention" in k]
    assert f"((1, 2, {LENGTH}, {head_dim}), (1, 1, {LENGTH}, {head_dim})" in kernel
    local = LENGTH // 2
    assert real_sp2["collectives"]["all_to_all_single"] == {local * 4 * head_dim * 4: 12, local * 2 * head_dim * 4: 12}


def test_negative_control_a_one_process_run_is_not_an_sp2_rank(setup, real_sp2):
    """The comparison above catches an emulation that does not split: a plain one-process step differs in its
    attention shapes, its collectives and its ZeRO-3 shares."""
    plain = emulated(setup, 1, "plain.pt")
    for key in ("attention", "collectives", "weight_shard_numel"):
        assert plain[key] != real_sp2[key], key


@pytest.fixture(scope="module")
def emulated_sp4(setup):
    return emulated(setup, 4, "emulated4.pt")


def test_an_emulated_sp4_rank_matches_hand_computed_shapes_and_shares(setup, emulated_sp4):
    """sp=4 over 4 query heads and 2 KV heads: each rank gets 1 query head and a replicated KV head, 16 tokens
    per slice, and a quarter (rounded up per tensor) of every weight."""
    from transformers import AutoModelForCausalLM

    mine = emulated_sp4
    head_dim = tiny_qwen3_config().head_dim
    assert mine["world"] == 4 and mine["sp"] == 4
    (kernel,) = [k for k in mine["attention"] if "flash_attention" in k]
    assert f"((1, 1, {LENGTH}, {head_dim}), (1, 1, {LENGTH}, {head_dim})" in kernel
    local = LENGTH // 4
    # q and the output: 4 heads of the slice; k and v: 2 KV heads, each repeated twice before the exchange
    assert mine["collectives"]["all_to_all_single"] == {local * 4 * head_dim * 4: 24}
    model = AutoModelForCausalLM.from_pretrained(setup[1])
    shards = sum(math.ceil(p.numel() / 4) for p in model.parameters())
    assert mine["weight_shard_numel"] == shards == mine["optimizer_numel"] == mine["momentum_numel"]


def test_the_planners_exchange_is_the_emulated_ranks_logged_all_to_alls(setup, emulated_sp4):
    """planner/exchange_time.py against the all-to-alls the sp=4 rank logged (2 layers, checkpointed, half of them
    keeping attention: every layer still exchanges in its recompute): the same bytes leave the GPU, in as many
    calls. Negative control: a plan without the recompute's pass is a third short."""
    from ulysses_train.planner.exchange_time import layer_traffic, step_wire_bytes
    from ulysses_train.planner.options import PlanOptions
    from ulysses_train.planner.shapes import load_model_shape

    logged = emulated_sp4["collectives"]["all_to_all_single"]
    logged_wire = sum(wire_bytes("all_to_all_single", size, 4) * calls for size, calls in logged.items())
    shape = load_model_shape(setup[1])
    o = PlanOptions(seq_length=LENGTH, sp=4, gpus_per_node=4, dtype_bytes=4, keep_attention_fraction=0.5)
    assert step_wire_bytes(shape, o) == pytest.approx(logged_wire)
    assert sum(layer_traffic(shape, o, kind)[1] for kind in shape.layer_kinds) == sum(logged.values())
    assert step_wire_bytes(shape, o.replace(gradient_checkpointing=False)) == pytest.approx(logged_wire * 2 / 3)


class SilentBackend:
    """Collectives that complete without writing their outputs, as torch's fake backend does on CUDA."""

    def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        return "work"

    def all_gather(self, tensor_list, tensor, group=None, async_op=False):
        return "work"

    def reduce_scatter_tensor(self, output_tensor, input_tensor, op=None, group=None, async_op=False):
        return "work"


def silent_all_to_all(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    """torch.distributed.all_to_all_single on the fake backend: nothing arrives (NaN stands for the garbage that
    torch.empty_like's memory holds)."""
    output.fill_(float("nan"))
    return "work"


def run_silent_collectives(backend) -> dict:
    """Each collective once: DeepSpeed's backend methods, torch's all-to-all as DeepSpeed's backend calls it, and
    the linear mixers' exchange (SequenceParallel: torch.distributed.nn.functional's differentiable all-to-all),
    forward and backward."""
    nan = float("nan")
    shard, gathered = torch.tensor([1.0, 2.0]), torch.full((4,), nan)
    pieces, full = [torch.full((2,), nan), torch.full((2,), nan)], torch.tensor([1.0, 2.0, 3.0, 4.0])
    mine, sent, received = torch.full((2,), nan), torch.arange(4.0), torch.full((4,), nan)
    assert backend.all_gather_into_tensor(gathered, shard, async_op=True) == "work"
    backend.all_gather(pieces, shard)
    backend.reduce_scatter_tensor(mine, full)
    torch.distributed.all_to_all_single(output=received, input=sent)
    blocks = torch.arange(4.0).reshape(2, 2).requires_grad_()
    exchanged = SequenceParallel(group="sp group", size=2, rank=0)._all_to_all(blocks)
    (exchanged * torch.tensor([[1.0, 2.0], [3.0, 4.0]])).sum().backward()
    return {"gathered": gathered, "pieces": torch.cat(pieces), "mine": mine, "received": received,
            "exchanged": exchanged.detach().reshape(-1), "exchanged_grad": blocks.grad.reshape(-1)}


def test_looped_back_collectives_write_what_a_peer_with_this_ranks_data_would_send(monkeypatch):
    """Rank 0 of 2: gathers repeat the local shard, a reduce-scatter keeps rank 0's share, the all-to-all returns
    its input, also as the linear mixers' exchange calls it (SequenceParallel, whose backward is an all-to-all of
    the gradient: the gradient comes back as it was sent); without the wrappers (the negative control) the
    outputs keep the NaN they were given."""
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(torch.distributed, "all_to_all_single", silent_all_to_all)
    assert all(torch.isnan(t).all() for t in run_silent_collectives(SilentBackend()).values())
    backend = SilentBackend()
    loop_back_collectives(backend)
    got = run_silent_collectives(backend)
    assert got["gathered"].tolist() == [1.0, 2.0, 1.0, 2.0] == got["pieces"].tolist()
    assert got["mine"].tolist() == [1.0, 2.0]
    assert got["received"].tolist() == [0.0, 1.0, 2.0, 3.0] == got["exchanged"].tolist()
    assert got["exchanged_grad"].tolist() == [1.0, 2.0, 3.0, 4.0]


def test_wire_bytes_per_collective_by_hand():
    assert wire_bytes("all_to_all_single", 800, 8) == 700  # 1/8 of the input stays on the GPU
    assert wire_bytes("all_gather_into_tensor", 100, 8) == 700  # 7 other shards arrive
    assert wire_bytes("reduce_scatter_tensor", 800, 8) == 700
    assert wire_bytes("all_reduce", 800, 8) == 1400
    with pytest.raises(ValueError, match="no traffic rule"):
        wire_bytes("alltoall_magic", 1, 2)


def two_gpu_all_to_alls(length: int) -> dict:
    """The Ulysses all-to-alls of one step of benchmarks/RESULTS.md's 2 x H200 runs, by hand: Qwen3-4B widths
    (q 32 x 128, kv 8 x 128), 12 layers, bf16, sp=2; per layer q, k, v and the output in forward, in the
    recompute and in backward."""
    local = length // 2
    q, kv = local * 32 * 128 * 2, local * 8 * 128 * 2
    return {"all_to_all_single": {q: 12 * 3 * 2, kv: 12 * 3 * 2}}


@pytest.mark.parametrize("length,measured_s", [(65536, 0.156), (131072, 0.2697), (262144, 0.4812)])
def test_the_link_constants_reproduce_the_measured_two_gpu_all_to_alls(length, measured_s):
    estimate = estimate_communication(two_gpu_all_to_alls(length), world=2)
    assert estimate.zero3_s == 0
    assert abs(estimate.ulysses_s - measured_s) / measured_s < 0.03, estimate.ulysses_s
    fast, slow = estimate.step_range(10.0)
    assert fast == slow == 10.0 + estimate.ulysses_s


def test_the_estimate_splits_ulysses_from_zero3_and_adds_latency_per_call():
    logged = {"all_to_all_single": {10**9: 2}, "all_gather_into_tensor": {10**9: 1}, "barrier": {0: 5}}
    e = estimate_communication(logged, world=2)
    assert e.ulysses_s == pytest.approx(2 * (CALL_LATENCY_S + 0.5 / EFFECTIVE_LINK_GBPS))
    assert e.zero3_s == pytest.approx(CALL_LATENCY_S + 1.0 / EFFECTIVE_LINK_GBPS)
    assert e.step_range(1.0) == pytest.approx((1.0 + e.ulysses_s, 1.0 + e.ulysses_s + e.zero3_s))


def test_emulation_refuses_what_it_cannot_measure():
    for args, match in [((1, "sdpa"), "sp >= 2"), ((2, "sdpa", 2), "drop --nproc"),
                        ((2, "flash_attention_2"), "position ids")]:
        with pytest.raises(UserError, match=match):
            check_emulation(*args)


def test_bench_emulate_sp_prints_the_predicted_step(tmp_path):
    """scripts/bench.py --emulate-sp 4 --emulate-gpus-per-node 2 on CPU: one process, the row carries the
    prediction for 4 GPUs in 2 nodes (host per node: 2 ranks); --nproc 2 with it, or nodes that do not divide
    the sp group, is one line, exit 2."""
    tiny = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}
    out = tmp_path / "bench.json"
    base = [sys.executable, os.path.join(REPO, "scripts", "bench.py"), "--model", "qwen3-0.6b", "--shape-overrides",
            json.dumps(tiny), "--lengths", "256", "--levers", "all", "--steps", "1", "--emulate-sp", "4"]
    proc = subprocess.run([*base, "--emulate-gpus-per-node", "2", "--json", str(out)], env=ENV, capture_output=True,
                          text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["status"] == "ok" and row["sp"] == 4, row["status"]
    assert math.isfinite(row["loss"])  # looped-back collectives: no NaN, so the optimizer step runs
    emulated_row = row["emulated"]
    assert emulated_row["world"] == 4 and emulated_row["collective_calls"]["all_to_all_single"]
    assert emulated_row["gpus_per_node"] == 2
    fast, slow = emulated_row["predicted_step_s"]
    assert row["s_per_step"] < fast <= slow
    assert emulated_row["host_gib_per_node"] == pytest.approx(2 * row["peak_host_gib"], abs=0.1)
    assert "predicted 4-GPU step" in proc.stdout
    for extra, says in ((["--nproc", "2"], "drop --nproc 2"), (["--emulate-gpus-per-node", "3"], "must divide")):
        refused = subprocess.run([*base, *extra], env=ENV, capture_output=True, text=True, timeout=120, cwd=REPO)
        assert refused.returncode == 2 and says in refused.stderr, refused.stderr[-2000:]
        assert len(refused.stderr.strip().splitlines()) == 1 and "Traceback" not in refused.stderr


def test_bench_emulate_sp_takes_a_run_config(tmp_path):
    """--config with --emulate-sp: the config's own levers and DeepSpeed JSON, its sp set to the emulated one."""
    model = save_tiny_model(str(tmp_path / "tiny"))
    config = tmp_path / "run.yaml"
    config.write_text(f"model:\n  name_or_path: {model}\n  dtype: float32\ndata:\n  source: {tmp_path / 'none.jsonl'}\n"
                      f"  seq_length: 128\ntrain:\n  deepspeed_config: {REPO}/ds_configs/zero3.json\n")
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench.py"), "--config", str(config),
                           "--steps", "1", "--emulate-sp", "2", "--json", str(out)], env=ENV, capture_output=True,
                          text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["status"] == "ok" and row["sp"] == 2 and row["levers"] == "config"
    assert "parallel.sequence_parallel_size=2" in row["sets"] and row["emulated"]["world"] == 2


def test_the_logged_step_counts_the_linear_mixers_exchange_once_and_attentions_once(monkeypatch):
    """Under torch_all_to_alls_logged, the linear mixers' exchange (SequenceParallel: torch's all-to-all, forward
    and backward) goes through deepspeed.comm's logged function once per call, and attention's (deepspeed.comm,
    whose backend calls torch's function) is not logged twice. Stand-ins: a backend that calls torch's function as
    DeepSpeed's does, a logged function that calls the backend as deepspeed.comm's does. Negative control: outside
    the context the mixers' exchange is not logged."""
    import deepspeed.comm as dist
    from deepspeed.comm import comm as comm_module

    from ulysses_train.diagnostics.collectives import torch_all_to_alls_logged

    logged, sent = [], []

    def torch_all_to_all(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        sent.append(input.numel())
        output.copy_(input)

    class Backend:
        def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                              async_op=False):
            return torch.distributed.all_to_all_single(output=output, input=input, group=group, async_op=async_op)

    def logged_all_to_all(output, tensor, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        logged.append(tensor.numel())
        return comm_module.cdb.all_to_all_single(output=output, input=tensor, group=group, async_op=async_op)

    monkeypatch.setattr(torch.distributed, "all_to_all_single", torch_all_to_all)
    monkeypatch.setattr(comm_module, "cdb", Backend())
    monkeypatch.setattr(dist, "all_to_all_single", logged_all_to_all)

    def step():
        blocks = torch.arange(6.0).reshape(2, 3).requires_grad_()
        SequenceParallel(group="sp group", size=2, rank=0)._all_to_all(blocks).sum().backward()
        dist.all_to_all_single(torch.empty(4), torch.ones(4))  # attention's exchange

    step()
    assert (logged, sent) == ([4], [6, 6, 4])  # the negative control: the mixers' exchange is not logged
    logged.clear(), sent.clear()
    with torch_all_to_alls_logged():
        step()
    assert logged == [6, 6, 4] == sent
    assert torch.distributed.all_to_all_single is torch_all_to_all and "all_to_all_single" not in vars(comm_module.cdb)
