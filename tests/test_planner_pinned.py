"""The plans of existing models, pinned: the bytes at each moment of a training step and of the evaluation forward,
the host bytes and the FLOPs, computed by the planner before its mixer terms moved into one table by planner kind
(planner/mixer_terms.py; ModelShape's per-layer `kinds` instead of window 0 for a linear layer). A refactor of the
planner must leave these numbers exactly as they were: a change here is a change of a plan, to be made on purpose
(and these values then recomputed), never by accident. Covers a Gated DeltaNet hybrid (Qwen3.5-9B, with and without
checkpointing, Hugging Face's norms and fla's, sp 1 and 8), OLMo-hybrid without ZeRO, a dense model with TiledMLP
and kept attention, a mixture of experts with FlashAttention 4, and a sliding-window model (Gemma 3)."""
from __future__ import annotations

import pytest

from ulysses_train.planner.estimate import plan
from ulysses_train.planner.forward_only import plan_forward
from ulysses_train.planner.result import PHASES

CASES = {
    "qwen3.5-9b sp8": ("qwen3.5-9b", dict(seq_length=131072, gpus_per_node=8, sp=8)),
    "qwen3.5-9b no-ckpt": ("qwen3.5-9b", dict(seq_length=32768, gpus_per_node=8, sp=8, gradient_checkpointing=False,
                                              tiled_mlp=True)),
    "qwen3.5-9b keep fla hf-norm": ("qwen3.5-9b", dict(seq_length=65536, gpus_per_node=1, keep_attention_fraction=0.5,
                                                       low_memory_rmsnorm=False, fused_gated_norm=False)),
    "olmo-hybrid-7b sp2": ("olmo-hybrid-7b", dict(seq_length=65536, gpus_per_node=2, sp=2, zero_stage=0)),
    "qwen3-8b sp8 tiled": ("qwen3-8b", dict(seq_length=262144, gpus_per_node=8, sp=8, tiled_mlp=True,
                                            keep_attention_fraction=0.5)),
    "qwen3-30b-a3b sp4": ("qwen3-30b-a3b", dict(seq_length=131072, gpus_per_node=8, sp=4, attention_kernel="fa4")),
    "gemma-3-12b sp8": ("gemma-3-12b", dict(seq_length=131072, gpus_per_node=8, sp=8)),
}
"""name -> (preset, PlanOptions fields)."""

PINNED = {
    "qwen3.5-9b sp8": ((38313285120, 33109145728, 31766968448, 31231146112), 5368709120, 9673989169348608.0,
                       2958031486713856.0, (8135249024, 4822478592, 3882954496, 5302726400)),
    "qwen3.5-9b no-ckpt": ((53140149760, 44243974272, 43606440064, 43606702208), 5368709120, 1785178594738176.0,
                           316659348799488.0, (7908265088, 3354177280, 3052187392, 3407130368)),
    "qwen3.5-9b keep fla hf-norm": ((181534265856, 191013336192, 185644627072, 181886530688), 5368709120,
                                    3992569654542336.0, 1056803278290944.0,
                                    (24712340480, 26633275008, 22875178624, 26641663616)),
    "olmo-hybrid-7b sp2": ((117700377792, 129223293888, 126908038080, 125653679040), 5368709120,
                           3655675322302464.0, 1168049625366528.0,
                           (16838569280, 18536738112, 16909348160, 21211131200)),
    "qwen3-8b sp8 tiled": ((43249523200, 40071691520, 39199276288, 40545647872), 5368709120, 7.27026610816942e+16,
                           1.6624775262633984e+16, (6042234112, 4312748032, 4715401216, 5526999040)),
    "qwen3-30b-a3b sp4": ((76155216384, 82972402944, 75975779584, 77125018880), 5368709120, 2.265841887136973e+16,
                          7471236271570944.0, (10736815616, 13461672192, 10087354624, 11032121600)),
    "gemma-3-12b sp8": ((45521457152, 45901556992, 43888291072, 43461520640), 5368709120, 1.2893734488244224e+16,
                        4033964280905728.0, (9000147904, 5914507456, 4530387136, 5119686848)),
}
"""name -> (training step's allocated bytes at each of PHASES, host bytes per GPU, model FLOPs, recompute FLOPs,
the evaluation forward's allocated bytes at each of PHASES): the planner's output before the refactor. Changed on
purpose since: Gemma 3's training step at the layer moments, +2 x 1.875 GiB for its tied head held through the
backward across GPUs (estimate.tied_head_in_backward, measured on Gemma 4; benchmarks/RESULTS.md); Qwen3-30B-A3B's
at the MLP moment, +1.61 GB for DeepSpeed's fp32 copy of its fused gate/up experts' gradient under sp
(leaf_blocks.expert_reduce_copy, measured on DeepSeek-V3); Qwen3-8B's tiled step at the MLP moment, +96 MiB, one
projection's gradient twice while a tile's is added (leaf_blocks.tile_gradient_accumulation, measured on
DeepSeek-V3's experts); Qwen3.5-9B's, OLMo-hybrid's and Gemma 3's plans without Liger's norm, their fp32 Hugging
Face norms at what they save (8 bytes a channel where the planner said 6: architecture.saved_bytes_per_channel,
planned since Gemma 4's allocator history showed them), +128 MiB to +2.4 GiB; OLMo-hybrid's worst layer is now
its attention layer (its q/k norms grew), whose mixer moment is 2.0 GiB lower than the Gated DeltaNet layer's was."""

TRAINING_NAMES = ["weights (ZeRO-3 partition)", "weights gathered", "optimizer (fp32 master, Adam m, v)",
                  "gradients (bf16 + fp32 partitions)", "checkpointed activations", "loss (chunked, fused)",
                  "layer: recomputed saved tensors", "layer: incoming gradient", "layer: MLP",
                  "layer: RMSNorm backward", "layer: attention backward", "all-to-all buffers", "ZeRO reduce bucket",
                  "cuda context (outside allocator)", "host process"]


@pytest.mark.parametrize("name", list(CASES))
def test_existing_plans_unchanged(name):
    model, fields = CASES[name]
    step, forward = plan(model, **fields), plan_forward(model, **fields)
    got = (tuple(step.gpu_at(p, allocated_only=True) for p in PHASES), step.host_per_gpu, step.model_flops,
           step.recompute_flops, tuple(forward.gpu_at(p, allocated_only=True) for p in PHASES))
    assert got == PINNED[name]


def test_component_names_unchanged():
    """The table's rows keep their names (the hybrid's worst layer at sp=8 is its attention layer)."""
    for model in ("qwen3.5-9b", "qwen3-8b"):
        assert [c.name for c in plan(model, seq_length=131072, gpus_per_node=8, sp=8).components] == TRAINING_NAMES
    forward = [c.name for c in plan_forward("qwen3.5-9b", seq_length=131072, gpus_per_node=8, sp=8).components]
    assert "layer: mixer forward" in forward and "all-to-all buffers" in forward
