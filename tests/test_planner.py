"""The planner: component formulas by hand on a tiny shape, the refusal message, max_length, the story,
the CLI, and the replay of every measured peak in benchmarks/planner_validation.jsonl (within 10%). The model
forms (LoRA, experts, kernels, Gated DeltaNet, latent attention): test_planner_forms.py."""
import functools
import json
import os

import pytest
from planner_tiny import D, H, HEADS, I, KV, KV_HEADS, LAYER_PARAMS, LAYERS, Q, TINY, TOTAL_PARAMS, V

from ulysses_train.constants import GIB
from ulysses_train.planner import (ModelShape, PlanError, PlanOptions, check_fits, load_model_shape, max_length, plan,
                                   story)
from ulysses_train.planner.estimate import CUDA_CONTEXT_BYTES, plan_for_record
from ulysses_train.planner.search import suggest_fix
from ulysses_train.planner.model_counts import count_parameters

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VALIDATION = os.path.join(REPO, "benchmarks", "planner_validation.jsonl")


def test_parameter_count_formula():
    from helpers import tiny_qwen3_config

    assert count_parameters(tiny_qwen3_config()) == (LAYER_PARAMS, TOTAL_PARAMS)
    # the real shapes, against counts of the models built on the meta device (4B also in the H200 reference)
    assert load_model_shape("qwen3-0.6b").total_params == 596_049_920
    assert load_model_shape("qwen3-4b").total_params == 4_022_468_096
    assert load_model_shape("Qwen/Qwen3-8B").total_params == 8_190_735_360
    assert load_model_shape("qwen3-8b").layer_params == 192_946_432


def test_components_by_hand_zero3_sp2():
    """Hugging Face's RMSNorm (as in the plain Hugging Face baseline); the low-memory norm's terms are checked
    below."""
    o = PlanOptions(seq_length=1024, sp=2, gpus_per_node=2, reduce_bucket_size=1000, prefetch_bucket_size=100,
                    low_memory_rmsnorm=False, loss_chunk_rows=256)
    p = plan(TINY, options=o)
    c = {x.name: x for x in p.components}
    s, b, world = 512, 2, 2
    per_rank = TOTAL_PARAMS // world  # 45,248

    assert c["weights (ZeRO-3 partition)"].mlp == b * per_rank
    gathered = c["weights gathered"]
    assert gathered.loss == b * V * H  # the tied embedding as lm_head, gathered for the loss
    assert gathered.mlp == gathered.attn == b * (LAYER_PARAMS + 100)  # one layer + the prefetch bucket
    assert c["optimizer (fp32 master, Adam m, v)"].mlp == 12 * per_rank
    assert c["gradients (bf16 + fp32 partitions)"].mlp == (2 + 4) * per_rank
    assert c["checkpointed activations"].loss == LAYERS * s * H * b

    final_norm = s * (4 + 2 + 2) * H  # fp32 upcast + normalized + output of the final RMSNorm
    loss_forward = 4 * V * H + 256 * V * (2 + 4 + 2) + s * H * b  # fp32 grad_weight, a chunk, grad_hidden
    loss_backward = 8 * V * H + 2 * s * H * b  # grad_weight and its scaled copy, grad_hidden twice
    assert c["loss (chunked, fused)"].loss == final_norm + max(loss_forward, loss_backward)

    norms = 2 * (4 + 2 + 2) * H  # two RMSNorms: fp32 input, bf16 normalized, bf16 output (the next input)
    qk_norms = (4 + 2) * (Q + KV)
    kv_after_a2a = 2 * D  # 2 KV heads over sp=2: one head each over the whole sequence = 2 heads per local token
    attention = 2 * (Q + 2 * kv_after_a2a) + 2 * Q + 4 * HEADS  # q, k, v, output, fp32 logsumexp
    o_proj_input = 2 * Q  # made by the reverse all-to-all
    saved = s * (norms + qk_norms + attention + o_proj_input)
    recomputed = c["layer: recomputed saved tensors"]
    assert recomputed.mlp == saved
    assert recomputed.norm == saved - s * 2 * H  # the MLP input is gone once the MLP is done
    assert recomputed.attn == saved - s * (4 + 2 + 2) * H  # so is the whole post-attention norm
    assert c["layer: incoming gradient"].mlp == s * H * b
    assert c["layer: MLP"].mlp == s * (4 + 2) * 2 * I  # 4 saved s x intermediate + net 2 in backward
    assert c["layer: RMSNorm backward"].norm == s * 18 * H
    # dq dk dv, fp32 dq accumulator, dk/dv expanded to the 4 query heads (GQA), fp32 row sums, output gradient
    assert c["layer: attention backward"].attn == s * (2 * (Q + 2 * kv_after_a2a) + 4 * Q + 2 * 2 * Q + 4 * HEADS
                                                       + 2 * Q)
    assert c["ZeRO reduce bucket"].loss == b * 1000
    assert c["all-to-all buffers"].attn == 2 * s * b * Q
    # tied head over 2 GPUs: its gradient, the embedding gathered again and, at 2 layers (the reuse distance), the
    # loss's gathered head, through the layers' backward only
    tied = c["tied head in the layers' backward"]
    assert tied.loss == 0 and tied.mlp == tied.norm == tied.attn == 3 * b * V * H

    fixed = (b * per_rank + b * (LAYER_PARAMS + 100) + 12 * per_rank + 6 * per_rank + LAYERS * s * H * b + b * 1000
             + 3 * b * V * H)
    assert p.gpu_at("mlp") - CUDA_CONTEXT_BYTES == fixed + saved + s * H * b + s * 6 * 2 * I
    assert p.peak_phase == "mlp"
    assert p.gpu_allocated == p.gpu_at("mlp") - CUDA_CONTEXT_BYTES
    assert p.host_per_node == 2 * 5 * GIB  # nothing offloaded: only the two processes

    T = 1024
    attention_forward = 2 * T * T * Q * LAYERS
    assert p.model_flops == 6 * (LAYERS * LAYER_PARAMS + V * H) * T + 3 * attention_forward
    assert p.recompute_flops == 2 * LAYERS * LAYER_PARAMS * T + attention_forward


def test_low_memory_rmsnorm_terms_by_hand():
    """rmsnorm.py keeps each norm's bf16 input and one fp32 scale per row; its backward adds the input gradient
    and a bounded row chunk of fp32 temporaries, against 18 bytes x hidden per token for Hugging Face's."""
    from ulysses_train.model.rmsnorm import CHUNK_ELEMENTS

    s, b = 8192, 2
    hf = {x.name: x for x in plan(TINY, options=PlanOptions(seq_length=s, gpus_per_node=1,
                                                            low_memory_rmsnorm=False)).components}
    low = {x.name: x for x in plan(TINY, options=PlanOptions(seq_length=s, gpus_per_node=1)).components}
    assert low["layer: RMSNorm backward"].norm == s * b * H + 6 * 4 * CHUNK_ELEMENTS
    saved_hf, saved_low = hf["layer: recomputed saved tensors"].mlp, low["layer: recomputed saved tensors"].mlp
    # input norm: output only (its input is the checkpoint); post-attention norm: input + output;
    # q/k norms: bf16 input + a scale per head row
    assert saved_hf - saved_low == s * (2 * (4 + 2 * b) * H - 3 * b * H + (4 + b) * (Q + KV)
                                        - b * (Q + KV) - 4 * (HEADS + KV_HEADS))
    assert low["loss (chunked, fused)"].loss == hf["loss (chunked, fused)"].loss - s * 4 * H  # final norm


def test_levers_by_hand():
    base = PlanOptions(seq_length=8192, sp=1, gpus_per_node=1, low_memory_rmsnorm=False)
    s, b = 8192, 2
    # offload: the checkpoints go to the host but the last layer's (the trainer's offloaded_layer_count), two are
    # on the GPU when backward starts (the last layer's, recomputed, and the next one, prefetched)
    p = plan(TINY, options=base.replace(offload_activations=True, offload_optimizer=True))
    c = {x.name: x for x in p.components}
    assert c["checkpointed activations"].host == (LAYERS - 1) * s * H * b
    assert c["checkpointed activations"].mlp == 2 * s * H * b
    assert c["optimizer (fp32 master, Adam m, v)"].host == 12 * TOTAL_PARAMS
    assert c["gradients (bf16 + fp32 partitions)"].host == 6 * TOTAL_PARAMS
    # TiledMLP: ceil(8192 / 64) = 128 tiles; one tile's 6 x intermediate, the input gradient it accumulates,
    # and (ZeRO-3) the MLP weight gradients until the last tile, one projection's twice while a tile's is added
    p = plan(TINY, options=base.replace(tiled_mlp=True))
    mlp = {x.name: x for x in p.components}["layer: MLP"].mlp
    assert mlp == int(s * (6 * b * I / 128 + b * H) + b * 3 * H * I + b * H * I)
    # full logits: bf16 logits, fp32 log-softmax, its fp32 gradient, the cast gradient
    p = plan(TINY, options=base.replace(chunked_loss=False))
    assert {x.name: x for x in p.components}["loss (full logits)"].loss == s * (4 + 4) * H + s * V * 12
    # kept attention: output + fp32 logsumexp per kept layer, next to the checkpoints
    p = plan(TINY, options=base.replace(keep_attention_fraction=0.5))
    assert {x.name: x for x in p.components}["checkpointed activations"].loss == \
        LAYERS * s * H * b + 1 * s * (b * Q + 4 * HEADS)
    assert p.recompute_flops == 2 * LAYERS * LAYER_PARAMS * s + 2 * s * s * Q * LAYERS / 2


def test_partial_activation_offload_by_hand():
    """A share of the layers offloaded: that share of the checkpoints on the host (never the last layer's), the
    rest on the GPU; an offloaded one comes back at the start of backward only where fewer than the two
    resident buffers (recomputed + prefetched) stay."""
    o = PlanOptions(seq_length=8192, sp=1, gpus_per_node=1, offload_activations=True)
    shape = ModelShape(**{**TINY.__dict__, "layers": 4, "name": "tiny4"})
    per_layer = 8192 * H * 2
    full = {x.name: x for x in plan(shape, options=o).components}["checkpointed activations"]
    half = {x.name: x for x in plan(shape, options=o.replace(activation_offload_fraction=0.5)).components}[
        "checkpointed activations"]
    none = {x.name: x for x in plan(shape, options=o.replace(activation_offload_fraction=0.0)).components}[
        "checkpointed activations"]
    assert (full.host, full.mlp) == (3 * per_layer, 2 * per_layer)
    assert (half.host, half.mlp) == (2 * per_layer, 2 * per_layer)
    assert (none.host, none.mlp) == (0, 4 * per_layer)
    with pytest.raises(PlanError, match="activation_offload_fraction"):
        PlanOptions(seq_length=8, activation_offload_fraction=1.5)


FRACTIONS = (0, 0.1, 0.125, 0.25, 0.3, 0.5, 0.75, 0.9, 1)


@functools.lru_cache(maxsize=1)
def stub_layer_class():
    """A decoder layer with nothing inside, checkpointed: all apply_checkpoint_levers needs to pick layers."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return type("StubLayer", (GradientCheckpointingLayer,), {"gradient_checkpointing": True})


def trainer_layer_choice(layers: int, fraction: float) -> tuple[list[int], int]:
    """(layers keeping their attention output, layers offloading their checkpoint) as the trainer picks them:
    apply_checkpoint_levers on `layers` stub decoder layers, read back from each layer's checkpoint function."""
    import torch

    from ulysses_train.model.recompute import apply_checkpoint_levers

    model = torch.nn.Sequential(*(stub_layer_class()() for _ in range(layers)))
    apply_checkpoint_levers(model, keep_attention_fraction=fraction, offload=True, offload_fraction=fraction)
    chosen = [layer._gradient_checkpointing_func.keywords for layer in model]
    return [i for i, c in enumerate(chosen) if c["keep_attention"]], sum(not c["keep_on_device"] for c in chosen)


def layer_choice_mismatches(depths=range(1, 41)) -> list[tuple[int, float]]:
    """(depth, fraction) where the planner's kept or offloaded layers, or the host bytes and recompute FLOPs it
    plans from them, differ from the layers the trainer picks."""
    from ulysses_train.planner.estimate import checkpoint_layers

    s, b, bad = 64, 2, []
    for layers in depths:
        shape = ModelShape(**{**TINY.__dict__, "layers": layers})
        for f in FRACTIONS:
            kept, offloaded = trainer_layer_choice(layers, f)
            o = PlanOptions(seq_length=s, gpus_per_node=1, offload_activations=True, keep_attention_fraction=f,
                            activation_offload_fraction=f)
            p = plan(shape, options=o)
            host = {c.name: c for c in p.components}["checkpointed activations"].host
            kept_offloaded = sum(i < offloaded for i in kept)
            attention_forward = 2 * s * s * Q * layers
            if (checkpoint_layers(shape, o) != (kept, offloaded)
                    or host != offloaded * s * H * b + kept_offloaded * s * (b * Q + 4 * HEADS)
                    or p.recompute_flops != 2 * layers * LAYER_PARAMS * s
                    + attention_forward * (layers - len(kept)) / layers):
                bad.append((layers, f))
    return bad


def test_planner_counts_the_layers_the_trainer_keeps_and_offloads(monkeypatch):
    """One rule each (model/recompute.py) for the layers that keep their attention output and those that
    offload, used by both sides: over depths 1..40 and the usual fractions the planner plans exactly the
    layers apply_checkpoint_levers picks."""
    from ulysses_train.model import recompute

    assert layer_choice_mismatches() == []
    assert len(trainer_layer_choice(36, 0.125)[0]) == 5 and trainer_layer_choice(36, 1.0)[1] == 35

    # negative controls: either side counting its own way is caught. Python's round() (halves to even) keeps 4
    # of 36 layers at 0.125; counting every layer as offloaded (the planner's old rule) differs at fraction 1.
    with monkeypatch.context() as patch:
        patch.setattr("ulysses_train.planner.estimate.kept_attention_layers",
                      lambda n, f, a=None: recompute.kept_attention_layers(n, round(f * n) / n if n else 0.0, a))
        assert layer_choice_mismatches((35, 36)) == [(35, 0.3), (36, 0.125)]  # 10.5 and 4.5 layers
    with monkeypatch.context() as patch:
        patch.setattr("ulysses_train.planner.estimate.offloaded_layer_count", lambda n, f: round(f * n))
        assert (40, 1) in layer_choice_mismatches((40,))
    with monkeypatch.context() as patch:
        patch.setattr(recompute, "offloaded_layer_count", lambda n, f: round(f * n))
        assert (40, 1) in layer_choice_mismatches((40,))


def test_zero0_backward_trades_checkpoints_for_gradients():
    """Without ZeRO the peak is at the first recomputed layer (all checkpoints, one layer of gradients) or
    the last (one checkpoint, all gradients), whichever holds more."""
    o = PlanOptions(seq_length=16, gpus_per_node=1, zero_stage=0, include_optimizer=False)
    c = {x.name: x for x in plan(TINY, options=o).components}
    ckpt = 16 * H * 2  # far smaller than a layer of gradients: the peak is at the last layer
    assert c["checkpointed activations"].mlp == ckpt
    assert c["gradients (not partitioned)"].mlp == LAYERS * 2 * LAYER_PARAMS + 2 * V * H
    o = o.replace(seq_length=65536)
    c = {x.name: x for x in plan(TINY, options=o).components}
    assert c["checkpointed activations"].mlp == LAYERS * 65536 * H * 2
    assert c["gradients (not partitioned)"].mlp == 2 * LAYER_PARAMS + 2 * V * H


def test_refusal_names_overage_and_a_fix_that_fits():
    p = plan("qwen3-8b", 1_048_576, sp=1, gpus_per_node=8, gpu_memory_gib=141, host_memory_gib=560)
    with pytest.raises(PlanError) as err:
        check_fits(p)
    msg = str(err.value)
    over = (p.gpu_total - 141 * GIB) / GIB
    assert "GPU memory" in msg and f"over by {over:.1f} GiB" in msg
    assert "checkpointed activations" in msg  # names the largest component
    text, fixed = suggest_fix(p)
    assert text in msg and fixed.fits and fixed.options.sp > 1
    check_fits(fixed)  # the suggested change really fits when re-planned

    # full logits at sp=8: the free fix (chunked loss) comes first
    p = plan("qwen3-8b", 1_048_576, sp=8, chunked_loss=False)
    text, fixed = suggest_fix(p)
    assert text.startswith("chunked loss") and fixed.fits

    # host memory short: offloading only part of the layers is the fix; keeping them all on the GPU fits too,
    # at more GPU memory, so it ranks after
    p = plan("qwen3-8b", 2_000_000, sp=8, offload_activations=True)
    assert p.gpu_total < p.gpu_capacity < p.host_capacity < p.host_per_node
    text, fixed = suggest_fix(p)
    assert "model.activation_offload_fraction=0.75" in text and fixed.fits
    assert fixed.options.offload_activations and fixed.options.activation_offload_fraction == 0.75
    all_on_gpu = plan("qwen3-8b", 2_000_000, sp=8, offload_activations=False, tiled_mlp=True)
    assert all_on_gpu.fits and fixed.gpu_total < all_on_gpu.gpu_total
    # with every share over the host too, keeping the activations on the GPU is the fix
    p = plan("qwen3-8b", 2_000_000, sp=8, offload_activations=True, host_memory_gib=100)
    text, fixed = suggest_fix(p)
    assert "activations kept on the GPU" in text and fixed.fits and not fixed.options.offload_activations

    # too long for any lever: the fix is a shorter length that fits
    p = plan("qwen3-8b", 16_000_000, sp=8, tiled_mlp=True, offload_activations=True, offload_optimizer=True)
    with pytest.raises(PlanError, match="host memory.*over by"):
        check_fits(p)
    text, fixed = suggest_fix(p)
    assert "data.seq_length=" in text and fixed.fits and fixed.options.seq_length < 16_000_000


def test_max_length_fits_and_is_monotonic():
    o = PlanOptions(seq_length=1, sp=8, gpus_per_node=8, offload_optimizer=True, tiled_mlp=True,
                    offload_activations=True)
    longest = max_length("qwen3-8b", o)
    assert longest % 8 == 0 and longest > 1_000_000
    assert plan("qwen3-8b", options=o.replace(seq_length=longest)).fits
    assert not plan("qwen3-8b", options=o.replace(seq_length=longest + 8)).fits
    assert max_length("qwen3-8b", o.replace(host_memory_gib=1000)) > longest
    gpu_bound = o.replace(offload_activations=False, tiled_mlp=False)
    assert max_length("qwen3-8b", gpu_bound.replace(gpu_memory_gib=80)) < max_length("qwen3-8b", gpu_bound)
    assert max_length("qwen3-8b", gpu_bound.replace(tiled_mlp=True)) > max_length("qwen3-8b", gpu_bound)
    assert max_length("qwen3-8b", o.replace(gpu_memory_gib=10)) == 0


def test_story_ends_at_the_plan_and_each_lever_lowers_gpu_memory():
    options = PlanOptions(seq_length=1_048_576, sp=8, gpus_per_node=8, offload_activations=True, tiled_mlp=True)
    rows = story("qwen3-8b", options)
    assert [label for label, _ in rows] == ["naive (full logits, sp=1)", "+ chunked loss", "+ activation offload",
                                            "+ TiledMLP", "+ sp=8"]
    gpu = [p.gpu_total for _, p in rows]
    assert gpu == sorted(gpu, reverse=True) and len(set(gpu)) == 5
    assert not rows[0][1].fits and rows[-1][1].fits
    final, planned = rows[-1][1], plan("qwen3-8b", options=options)  # one computation: the story's end is the plan
    assert (final.gpu_total, final.host_per_node, final.step_seconds) == (planned.gpu_total, planned.host_per_node,
                                                                          planned.step_seconds)
    # a lever the plan leaves off is not in its story (the old story offloaded the optimizer regardless)
    assert not any("optimizer" in label for label, _ in rows)
    assert [label for label, _ in story("qwen3-8b", options.replace(offload_optimizer=True))][3] == "+ optimizer offload"


def test_cli_writes_json(tmp_path, capsys):
    from helpers import load_script

    cli = load_script("scripts/plan.py", "plan_cli")
    out = tmp_path / "plan.json"
    assert cli.main(["--model", "qwen3-0.6b", "--seq-length", "65536", "--gpus-per-node", "2", "--sp", "2",
                     "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["plan"]["fits"] and abs(data["story"][-1]["gpu_gib"] - data["plan"]["gpu_total_gib"]) < 0.01
    assert "step time" in capsys.readouterr().out
    assert cli.main(["--model", "qwen3-8b", "--seq-length", "1048576", "--no-story"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_local_config_folder_reads_the_same_shape(tmp_path):
    from ulysses_train.model.presets import save_qwen3_config

    folder = save_qwen3_config("qwen3-4b", str(tmp_path / "q4b"))
    from_folder = load_model_shape(folder)
    assert from_folder.total_params == load_model_shape("qwen3-4b").total_params
    assert (from_folder.hidden, from_folder.layers, from_folder.tied) == (2560, 36, True)


def test_replay_measurements():
    """Every measured peak in benchmarks/planner_validation.jsonl within 10% of the planner's
    torch-allocated peak; points that ran out of memory must be predicted not to fit."""
    with open(VALIDATION) as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    assert len(records) >= 6
    bad = []
    for r in records:
        p = plan_for_record(r)
        label = f"{r['model']} seq={r['seq_length']} sp={r.get('sp', 1)} ({r['source'][:60]})"
        if r.get("oom"):
            if p.gpu_allocated <= r["gpu_memory_gib"] * GIB:
                bad.append(f"{label}: ran out of memory but predicted {p.gpu_allocated / GIB:.1f} GiB")
            continue
        predicted, measured = p.gpu_allocated / GIB, r["measured_peak_gib"]
        if abs(predicted - measured) > 0.10 * measured:
            bad.append(f"{label}: predicted {predicted:.2f} GiB, measured {measured:.2f} GiB "
                       f"({(predicted / measured - 1) * 100:+.1f}%)")
    assert not bad, "planner off by more than 10%:\n" + "\n".join(bad)


def test_options_from_run_reads_config_and_deepspeed_json():
    from ulysses_train.config import Config
    from ulysses_train.planner import options_from_run

    cfg = Config()
    cfg.data.seq_length, cfg.parallel.sequence_parallel_size = 262_144, 4
    with open(os.path.join(REPO, "ds_configs", "zero3.json")) as fh:
        ds = json.load(fh)
    ds["activation_checkpointing"]["cpu_checkpointing"] = True
    ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    o = options_from_run(cfg, ds, world_size=16, gpus_per_node=8, gpu_memory_gib=80)
    assert (o.seq_length, o.sp, o.nodes, o.gpus_per_node, o.gpu_memory_gib) == (262_144, 4, 2, 8, 80)
    assert o.offload_activations and o.offload_optimizer and o.chunked_loss
    assert not o.tiled_mlp  # tiled_mlp: auto without the model's shape plans the untiled (larger) case
    assert o.prefetch_bucket_size == 50_000_000 and o.reduce_bucket_size == 500_000_000
    assert o.sp_reduce_cast_bytes == 4  # DeepSpeed reduces an sp run's gradients in fp32 unless the JSON says
    for dtype, cast in (("bf16", 0), (None, 0), ("fp16", 2), ("FP32", 4)):  # null: the training dtype
        o = options_from_run(cfg, {**ds, "seq_parallel_communication_data_type": dtype}, world_size=16, gpus_per_node=8)
        assert o.sp_reduce_cast_bytes == cast, dtype
    from helpers import load_script  # plan.py's flag for the same key

    plan_cli = load_script("scripts/plan.py")
    for flag, cast in (([], 4), (["--sp-reduce-dtype", "bf16"], 0)):
        assert plan_cli.options_from_args(plan_cli.parse_args(["--model", "qwen3-8b", *flag])).sp_reduce_cast_bytes == cast
    # auto follows tiling.py: tiles once a GPU's slice exceeds 4 x hidden tokens (65,536 > 4 x 4096 here)
    assert options_from_run(cfg, ds, world_size=16, gpus_per_node=8, model="qwen3-8b").tiled_mlp
    cfg.data.seq_length = 4 * 16_384
    assert not options_from_run(cfg, ds, world_size=16, gpus_per_node=8, model="qwen3-8b").tiled_mlp


def test_plan_names_rope_scaling_none_where_it_suggests_a_length_past_a_nope_models_positions(capsys):
    """Nemotron 3 Nano (NoPE, trained to 262,144) planned to 1.67M: training there needs model.rope_scaling none (the
    trainer refuses 'auto' past its positions). Controls: within its positions, and a RoPE model past its own (YaRN
    applies under 'auto'), no note."""
    from helpers import load_script

    note = load_script("scripts/plan.py").positions_note
    assert note("nemotron-3-nano-30b-a3b", None, 1_671_192).endswith("train it there with model.rope_scaling: none")
    assert "past the 262,144 positions" in note("nemotron-3-nano-30b-a3b", None, 1_671_192)
    assert note("nemotron-3-nano-30b-a3b", None, 262_144) == ""
    assert note("qwen3-8b", None, 1_000_000) == ""
    main = load_script("scripts/plan.py").main
    for length, said in ((524_288, True), (131_072, False)):  # the length asked for is noted as the suggested ones
        assert main(["--model", "nemotron-3-nano-30b-a3b", "--seq-length", str(length), "--gpus-per-node", "8",
                     "--sp", "8", "--no-story"]) == 0
        assert ("note: 524,288 tokens; past the 262,144 positions" in capsys.readouterr().out) == said

