"""The planner's Ulysses exchange time (planner/exchange_time.py) and the node split of every collective's bytes
(planner/communication.py transfer_seconds).

References: the all-to-alls logged by emulated ranks on an H100 (benchmarks/results/: Qwen3-8B at 1M tokens and,
in four head chunks, at 5M; bytes leaving a GPU and calls per layer), and hand arithmetic for the split between
NVLink and the network. The planner's bytes against a CPU emulated rank's logged all-to-alls are in
tests/test_emulate.py."""
import pytest

from ulysses_train.planner.communication import (CALL_LATENCY_S, EFFECTIVE_LINK_GBPS, INTER_NODE_LINK_GBPS,
                                                 estimate_communication, transfer_seconds)
from ulysses_train.planner.estimate import plan
from ulysses_train.planner.exchange_time import exchange_seconds, layer_traffic, step_wire_bytes
from ulysses_train.planner.options import PlanOptions
from ulysses_train.planner.shapes import load_model_shape, reduced_depth_shape

ONE_LAYER = reduced_depth_shape("qwen3-8b", 1)


@pytest.mark.parametrize("length, chunks, logged_gb, logged_calls", [
    (1_048_576, 1, 7.046, 12),   # benchmarks/results/emulate/emulated_8b_1m_sp8_1l.json
    (5_000_000, 4, 67.2, 28),    # benchmarks/results/longest/qwen3_8b_5m_sp8_1l_chunks4_h100.json
])
def test_one_layers_exchange_is_what_the_h100_ranks_logged(length, chunks, logged_gb, logged_calls):
    """Qwen3-8B at sp=8: 4 query heads and one KV head per rank. In four chunks each chunk sends the rank's one KV
    head again, and each chunk's backward sends its q, k and v once more: 1.5x the unchunked bytes per token."""
    o = PlanOptions(seq_length=length, sp=8, attention_head_chunks=chunks)
    assert step_wire_bytes(ONE_LAYER, o) / 1e9 == pytest.approx(logged_gb, abs=0.001)
    assert layer_traffic(ONE_LAYER, o, "attention")[1] == logged_calls


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
    assert across == pytest.approx(calls * CALL_LATENCY_S + step_wire_bytes(model, o) * 8 / 15 / (INTER_NODE_LINK_GBPS * 1e9))
    assert "Ulysses exchange" in p.table() and "2 nodes" in p.table()
    assert plan(model, options=o.replace(sp=1, nodes=1, allow_sp_across_nodes=False)).exchange_seconds == 0.0
