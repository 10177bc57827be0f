"""The planner's Ulysses exchange time (planner/exchange_time.py) and the node split of every collective's bytes
(planner/communication.py transfer_seconds).

References: the all-to-alls logged by emulated ranks on an H100 (benchmarks/results/: Qwen3-8B at 1M tokens and,
in four head chunks, at 5M; bytes leaving a GPU and calls per layer), and hand arithmetic for the split between
NVLink and the network. The planner's bytes against a CPU emulated rank's logged all-to-alls are in
tests/test_emulate.py."""
import pytest

from ulysses_train.planner.communication import (CALL_LATENCY_S, EFFECTIVE_LINK_GBPS, INTER_NODE_LINK_GBPS,
                                                 estimate_communication, transfer_seconds)
from helpers import REPO
from ulysses_train.planner.estimate import plan, plan_for_record
from ulysses_train.planner.exchange_time import exchange_seconds, layer_traffic, step_wire_bytes
from ulysses_train.planner.options import PlanOptions
from ulysses_train.planner.shapes import load_model_shape, reduced_depth_shape

ONE_LAYER = reduced_depth_shape("qwen3-8b", 1)


LOGGED_ROWS = ["emulate/emulated_8b_1m_sp8_1l.json", "longest/qwen3_8b_5m_sp8_1l_chunks4_h100.json",
               "hybrid/qwen3.5-9b_1m_sp8_8l.json", "hybrid/qwen3.5-9b_1m_sp8_4l_docs.json",
               "nano_1m_sp8_4l_session17.json", "nano_1m_sp8_7l_session17.json",
               "records/qwen3_8b_4m_2l.json"]
"""Emulated ranks on an H100 or H200 whose logged all-to-alls the plan must reproduce: attention (Qwen3-8B at 1M,
and at 5M in four head chunks, each sending the rank's one KV head again and its q, k and v once more in its
backward; 4M at sp=32 with KV heads repeated), Gated DeltaNet with Qwen3.5's gated attention, Mamba2 with
Nemotron 3 Nano's expert layers."""


@pytest.mark.parametrize("name", LOGGED_ROWS)
def test_a_steps_exchange_is_what_the_gpu_ranks_logged(name):
    """The bytes leaving the GPU in a step's all-to-alls and their calls, planned from the model's widths, equal
    what DeepSpeed's comms logger recorded on the GPU (benchmarks/results/)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from emulated_depth import bench_rows, planner_record

    row = bench_rows(os.path.join(REPO, "benchmarks", "results", name))[0]
    planned = plan_for_record(planner_record(row, row["layers"]))
    m, o = planned.model, planned.options
    logged = row["emulated"]
    assert step_wire_bytes(m, o) / 1e9 == pytest.approx(logged["wire_gb"]["all_to_all_single"], abs=0.001)
    calls = sum(layer_traffic(m, o, kind)[1] for kind in m.layer_kinds)
    assert calls == sum(logged["collective_calls"]["all_to_all_single"].values())


def test_a_model_of_per_layer_widths_is_planned_at_its_widest_layer():
    """Gemma 4's plan takes every layer at its worst layer's layout (the global layers' 4 KV heads of 512, whose q is
    twice the sliding layers'): its exchange is an upper bound, 1.40x what Gemma-4-31B's emulated rank logged at 7
    layers (5 sliding, 2 global); 1.68x when the shape mixed the sliding layers' 16 KV heads with the 512 width."""
    import os
    import sys

    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from emulated_depth import bench_rows, planner_record

    row = bench_rows(os.path.join(REPO, "benchmarks", "results", "records", "gemma4_31b_262k_7l.json"))[0]
    planned = plan_for_record(planner_record(row, row["layers"]))
    ratio = step_wire_bytes(planned.model, planned.options) / 1e9 / row["emulated"]["wire_gb"]["all_to_all_single"]
    assert ratio == pytest.approx(1.40, abs=0.01)


def test_without_recompute_there_is_one_pass_less():
    """Negative control for the pass count: no gradient checkpointing drops the recompute's exchange (2 of 3)."""
    o = PlanOptions(seq_length=1_048_576, sp=8)
    assert step_wire_bytes(ONE_LAYER, o.replace(gradient_checkpointing=False)) == pytest.approx(
        step_wire_bytes(ONE_LAYER, o) * 2 / 3)
    assert step_wire_bytes(ONE_LAYER, o, forward_only=True) == pytest.approx(step_wire_bytes(ONE_LAYER, o) / 3)


def test_the_node_split_by_hand():
    """16 GPUs in 2 nodes of 8: of the bytes leaving a GPU, 7/15 go to its node's other GPUs (NVLink) and 8/15 to
    the other node (the network), at once; one node of 16 sends all of them on NVLink."""
    wire = 15e9
    assert transfer_seconds(wire, 16, 8) == pytest.approx(max(7 / EFFECTIVE_LINK_GBPS, 8 / INTER_NODE_LINK_GBPS))
    assert transfer_seconds(wire, 16, 16) == pytest.approx(15 / EFFECTIVE_LINK_GBPS)
    assert transfer_seconds(wire, 1, 8) == 0.0
    logged = {"all_to_all_single": {16 * 10**9: 1}}  # one call: 15/16 of 16 GB leave the GPU
    two_nodes = estimate_communication(logged, 16, gpus_per_node=8)
    assert two_nodes.ulysses_s == pytest.approx(CALL_LATENCY_S + 8 / INTER_NODE_LINK_GBPS)
    assert estimate_communication(logged, 16).ulysses_s == pytest.approx(CALL_LATENCY_S + 15 / EFFECTIVE_LINK_GBPS)


def test_the_plan_adds_the_exchange_across_nodes():
    """Qwen3-8B at 2M tokens on 2 nodes (sp=16): the step is compute plus the exchange, which costs more across
    nodes than the same traffic inside one node of 16; the table says which links it assumed."""
    model = load_model_shape("qwen3-8b")
    o = PlanOptions(seq_length=2_097_152, sp=16, gpus_per_node=8, nodes=2, allow_sp_across_nodes=True,
                    offload_activations=True, offload_optimizer=True, tiled_mlp=True, gpu_memory_gib=80)
    p = plan(model, options=o)
    across = exchange_seconds(model, o)
    inside = exchange_seconds(model, o.replace(gpus_per_node=16, nodes=1))
    assert p.exchange_seconds == across > inside > 0
    assert p.step_seconds == pytest.approx(p.compute_seconds + across)
    calls = 36 * 12
    network = step_wire_bytes(model, o) * 8 / 15 / (INTER_NODE_LINK_GBPS * 1e9)  # the longer of the two links
    assert across == pytest.approx(calls * CALL_LATENCY_S + network)
    assert "Ulysses exchange" in p.table() and "2 nodes" in p.table()
    assert plan(model, options=o.replace(sp=1, nodes=1, allow_sp_across_nodes=False)).exchange_seconds == 0.0
