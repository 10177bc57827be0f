"""The time of a step's collectives on real GPUs, from their logged sizes: what an emulated rank
(parallel/emulate.py) adds back to its own step time to predict an N-GPU step.

Input: DeepSpeed's comms-logger records of one step, `{op: {message_bytes: calls}}` (the logger's message is
the tensor each call passes: the local input of an all-to-all, the local shard of an all-gather, the whole
input of a reduce-scatter). Each call costs a fixed latency plus the bytes that leave (or reach) one GPU over
the effective bandwidth:

- all_to_all_single: message x (N-1)/N (the rest stays on the GPU);
- all_gather_into_tensor, all_gather: message x (N-1) (every other rank's shard arrives);
- reduce_scatter_tensor: message x (N-1)/N;
- all_reduce: 2 x message x (N-1)/N (ring);
- broadcast: the message once.

The constants are fitted to the only multi-GPU measurement at hand: the Ulysses all-to-alls of the 2 x H200
runs in benchmarks/RESULTS.md ("Two GPUs against one": Qwen3-4B widths, 12 layers, sp=2, 144 calls per step;
0.156 / 0.270 / 0.481 s at 65,536 / 131,072 / 262,144 tokens, i.e. 12.1 / 24.2 / 48.3 GB leaving each GPU).
A straight line through the two ends gives 111.4 GB/s and 0.33 ms per call; the middle point is then within
2%. That bandwidth is assumed for ZeRO-3's collectives and for more GPUs too (NVSwitch gives every GPU its
own links, so per-GPU bandwidth should not fall with N; a probe on a lent multi-GPU machine replaces it).

Across nodes (an sp group or a ZeRO-3 world larger than a node): of the bytes leaving a GPU, the share bound for
the g - 1 other GPUs of its node stays on NVLink and the share bound for the N - g GPUs of other nodes crosses the
network, each at its own rate; the two run at once, so a call takes the longer (`transfer_seconds`). The network
rate, INTER_NODE_LINK_GBPS, is an assumption, not a measurement (no multi-node machine is lent here): a DGX H100
gives each GPU one 400 Gb/s InfiniBand port (50 GB/s), and NCCL's all-to-all across nodes reaches about 80% of it.
The planner costs the Ulysses exchange with the same rule (planner/exchange_time.py).

The Ulysses all-to-alls run on the compute stream and stall it, so their time adds to the step. ZeRO-3's
gathers and reduce-scatters run on their own streams, prefetched and overlapped with compute; how much of them
shows is not known without a multi-GPU run, so the prediction is a range: all-to-alls added (fast end), and
all-to-alls plus every ZeRO-3 collective added (slow end).
"""
from __future__ import annotations

from dataclasses import dataclass

EFFECTIVE_LINK_GBPS = 111.4
"""Bytes leaving one GPU per second in an NCCL collective inside one H200 node (GB/s; fit above)."""
CALL_LATENCY_S = 3.3e-4
"""Fixed cost of one collective call (s; fit above)."""
INTER_NODE_LINK_GBPS = 40.0
"""Bytes leaving one GPU per second towards other nodes (GB/s): 80% of one 400 Gb/s port per GPU (assumed: above)."""

ULYSSES_OPS = ("all_to_all_single", "all_gather")
"""The Ulysses exchange around attention and its gather of the position ids (the list form of all_gather;
ZeRO-3 gathers into one tensor): synchronous, on the compute stream."""
_WIRE_FACTOR = {
    "all_to_all_single": lambda n: (n - 1) / n,
    "all_gather_into_tensor": lambda n: n - 1,
    "all_gather": lambda n: n - 1,
    "reduce_scatter_tensor": lambda n: (n - 1) / n,
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "broadcast": lambda n: 1,
}


def wire_bytes(op: str, message_bytes: int, world: int) -> float:
    """Bytes that leave (or reach) one GPU in one call of `op` with this logged message size."""
    factor = _WIRE_FACTOR.get(op)
    if factor is None:
        raise ValueError(f"no traffic rule for the collective {op!r}; known: {', '.join(_WIRE_FACTOR)}.")
    return message_bytes * factor(world)


def transfer_seconds(wire: float, world: int, gpus_per_node: int) -> float:
    """Seconds for `wire` bytes leaving one GPU towards the other `world - 1` GPUs of its group, spread evenly over
    them, when `gpus_per_node` of the group share a node: NVLink carries the share for the node's other GPUs, the
    network the rest, at once (module docstring)."""
    if world < 2:
        return 0.0
    local = min(gpus_per_node, world)
    intra = wire * (local - 1) / (world - 1)
    inter = wire - intra
    return max(intra / (EFFECTIVE_LINK_GBPS * 1e9), inter / (INTER_NODE_LINK_GBPS * 1e9))


def collective_seconds(op: str, records: dict, world: int, gpus_per_node: int | None = None) -> float:
    """Predicted seconds of all calls of one op: records {message_bytes: calls}; the world spans nodes of
    `gpus_per_node` GPUs (None: one node)."""
    per_node = gpus_per_node or world
    return sum(calls * (CALL_LATENCY_S + transfer_seconds(wire_bytes(op, int(size), world), world, per_node))
               for size, calls in records.items())


@dataclass(frozen=True)
class CommunicationEstimate:
    """A step's collectives on `world` real GPUs."""

    world: int
    gpus_per_node: int
    ulysses_s: float
    """The Ulysses all-to-alls (stall compute: always added)."""
    zero3_s: float
    """ZeRO-3's parameter gathers, gradient reduce-scatters and the small all-reduces (overlapped, partly)."""
    wire_gb: dict
    """GB leaving one GPU per op, for the table."""

    def step_range(self, compute_s: float) -> tuple[float, float]:
        """(fast, slow) N-GPU step seconds for a rank whose step without communication takes compute_s."""
        return compute_s + self.ulysses_s, compute_s + self.ulysses_s + self.zero3_s

    def to_dict(self, compute_s: float) -> dict:
        fast, slow = self.step_range(compute_s)
        return {"world": self.world, "gpus_per_node": self.gpus_per_node,
                "ulysses_all_to_all_s": round(self.ulysses_s, 3), "zero3_collectives_s": round(self.zero3_s, 3),
                "wire_gb": {k: round(v, 3) for k, v in self.wire_gb.items()},
                "predicted_step_s": [round(fast, 3), round(slow, 3)],
                "link_gbps": EFFECTIVE_LINK_GBPS, "inter_node_link_gbps": INTER_NODE_LINK_GBPS,
                "call_latency_s": CALL_LATENCY_S}


def estimate_communication(logged: dict, world: int, gpus_per_node: int | None = None) -> CommunicationEstimate:
    """The estimate from one step's logged collectives {op: {message_bytes: calls}} on `world` GPUs in nodes of
    `gpus_per_node` (None: one node). Barriers and other ops without a traffic rule are skipped: they move no
    data."""
    per_node = min(gpus_per_node or world, world)
    ulysses = zero3 = 0.0
    wire = {}
    for op, records in logged.items():
        if op not in _WIRE_FACTOR:
            continue
        seconds = collective_seconds(op, records, world, per_node)
        wire[op] = sum(calls * wire_bytes(op, int(size), world) for size, calls in records.items()) / 1e9
        if op in ULYSSES_OPS:
            ulysses += seconds
        else:
            zero3 += seconds
    return CommunicationEstimate(world=world, gpus_per_node=per_node, ulysses_s=ulysses, zero3_s=zero3, wire_gb=wire)
