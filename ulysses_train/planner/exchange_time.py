"""The seconds a planned step spends in the Ulysses exchange: every layer's all-to-alls around its token mixer,
inside a node on NVLink and, for an sp group wider than a node, across nodes on the network.

The exchange runs on the compute stream and stalls it, so its time adds to the compute's (planner/result.py
step_seconds). A pass of a layer's exchange sends MixerTerms.exchange_traffic's channels per local token to the
head layout and brings its output back; (sp - 1)/sp of those bytes leave the GPU, and planner/communication.py
transfer_seconds splits them between NVLink and the network as it does for an emulated rank's logged collectives
(one rule for both). A step runs the forward pass, the recompute's of a checkpointed layer (a kept attention
output still rebuilds q, k and v in the head layout: model/recompute.py) and the backward's (the gradients the
other way); in head chunks each chunk's backward sends its q, k and v once more (model/mixers/head_chunks.py).
The evaluation forward is one pass. Equal to the bytes and calls the emulated ranks on GPUs logged (attention,
head chunks, Gated DeltaNet, Mamba2: tests/test_exchange_time.py) and on CPU (tests/test_emulate.py); a model
whose attention widths differ by layer (Gemma 4) is planned with every layer at its worst layer's layout
(estimate.estimate), an upper bound.
"""
from __future__ import annotations

from ulysses_train.planner.communication import CALL_LATENCY_S, transfer_seconds, wire_bytes
from ulysses_train.planner.mixer_terms import MIXER_TERMS
from ulysses_train.planner.options import PlanOptions
from ulysses_train.planner.shapes import ATTENTION_KIND, ModelShape


def layer_traffic(m: ModelShape, o: PlanOptions, kind: str, forward_only: bool = False) -> tuple[float, int]:
    """(channels per local token, all-to-all calls) of one layer's exchanges in a training step (or one forward).
    Calls: attention sends q, k, v and the output one by one, in head chunks each chunk its q, k and v in one
    message (three in its backward: the inputs again, the output gradient, the input gradients); the linear
    mixers send their inputs in one message and their output in another."""
    to_heads, back = MIXER_TERMS[kind].exchange_traffic(m, o)
    if not to_heads:
        return 0.0, 0
    forwards = 1 if forward_only or not o.gradient_checkpointing else 2
    passes = forwards + (0 if forward_only else 1)
    chunks = o.attention_head_chunks if kind == ATTENTION_KIND else 1
    if chunks > 1:
        extra = 0 if forward_only else 1
        return passes * (to_heads + back) + extra * to_heads, chunks * (2 * forwards + 3 * extra)
    return passes * (to_heads + back), passes * (4 if kind == ATTENTION_KIND else 2)


def step_wire_bytes(m: ModelShape, o: PlanOptions, forward_only: bool = False) -> float:
    """Bytes leaving one GPU in a step's all-to-alls (0 without sp)."""
    if o.sp < 2:
        return 0.0
    message = sum(layer_traffic(m, o, kind, forward_only)[0] for kind in m.layer_kinds) * o.seq_local * o.dtype_bytes
    return wire_bytes("all_to_all_single", message, o.sp)


def exchange_seconds(m: ModelShape, o: PlanOptions, forward_only: bool = False) -> float:
    """The step's Ulysses exchange time on one GPU (0 without sp); `forward_only`: one forward's. An sp group
    wider than a node spans whole nodes (parallel/layout.py)."""
    if o.sp < 2:
        return 0.0
    calls = sum(layer_traffic(m, o, kind, forward_only)[1] for kind in m.layer_kinds)
    return calls * CALL_LATENCY_S + transfer_seconds(step_wire_bytes(m, o, forward_only), o.sp, o.gpus_per_node)
