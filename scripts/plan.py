"""Predict per-GPU and per-host memory and the step time of a run, before launching it.

    python scripts/plan.py --model qwen3-8b --seq-length 1048576 --gpus-per-node 8 --sp 8 \
        --offload-activations --offload-optimizer --tiled-mlp
    python scripts/plan.py --model qwen3-8b --gpus-per-node 8 --sp 8 --offload-activations \
        --offload-optimizer --tiled-mlp --max-length
    python scripts/plan.py --model path/to/folder_with_config.json --seq-length 262144 --json plan.json
    python scripts/plan.py --model qwen3.5-9b --gpus-per-node 1 --lora-rank 16 --lora-targets all-linear --max-length

--model takes one of the presets (model/presets.py, e.g. qwen3-8b, qwen3.5-9b; an unknown one is named with the
list), a folder with config.json, or a hub name (needs the network). Only the config is read, never the weights.
Prints the components table, the predicted step time, the story of the levers (from the naive run to these
options, one lever at a time; its last row is the plan above it), with --eval the evaluation forward's table
(what scoring a sequence of this length holds: eval_context.py, probes), and with --max-length the longest
sequence that fits. --lora-rank (and --lora-targets) plans LoRA adapters (model.lora) in all of these: only the
adapters train, counted on the model as PEFT adapts it, and the count is printed first.
Exit status 0 if the plan fits, 1 if it does not (the reason and a fix are printed).
"""
from __future__ import annotations

import argparse
import json
import os

from ulysses_train.cli import report_user_errors, run_script
from ulysses_train.constants import GIB, LOSS_CHUNK_ROWS
from ulysses_train.errors import ConfigError
from ulysses_train.model.mixers import MIXERS, check_head_chunks, check_sp_splits_heads
from ulysses_train.model.mixers.attention import untested_exchange_problem
from ulysses_train.model.presets import PRESETS, known_name, looks_like_a_preset, preset_config
from ulysses_train.planner.forward_only import plan_forward
from ulysses_train.lever_keys import LEVER_KEYS
from ulysses_train.planner.levers import choose_levers
from ulysses_train.planner.options import (DEEPSPEED_DTYPES, OPTIMIZERS, SP_REDUCE_DTYPE_KEY,
                                          deepspeed_sp_reduce_cast_bytes)
from ulysses_train.planner import (ModelShape, PlanError, PlanOptions, check_fits, load_model_shape, longest_fitting,
                                   max_length, plan, story, story_table)
from ulysses_train.user_input import missing_local_path

LOCAL_SHAPES = ", ".join(PRESETS)


def model_shape(name: str, hf_config=None) -> ModelShape:
    """--model as the planner's shape: a local shape name, or `hf_config` (model_config's) for any other name."""
    if known_name(name):
        return sized_shape(name, lambda: load_model_shape(name))
    hf_config = hf_config if hf_config is not None else model_config(name)
    return sized_shape(name, lambda: ModelShape.from_hf_config(hf_config, name=name))


def model_config(name: str, allow_untested: bool = False):
    """--model's transformers config: a preset's own, or a folder / config.json / hub name's, read the way the
    trainer reads it (model.read_hf_config: the same missing-path, unknown-type and custom-code errors) and
    checked to be an architecture the trainer supports."""
    if known_name(name):
        return preset_config(name)
    folder = (os.path.dirname(name) or ".") if name.endswith(".json") and os.path.isfile(name) else name
    problem = missing_local_path(folder)
    if problem:
        raise PlanError(f"--model {name!r}: {problem}. Give a local folder with config.json, a hub name, or one "
                        f"of {LOCAL_SHAPES}.")
    if looks_like_a_preset(name) and not os.path.exists(os.path.expanduser(name)):
        raise PlanError(f"--model {name!r}: unknown model (not one of the presets). Known presets: {LOCAL_SHAPES}; "
                        f"or give a local folder with config.json, or a hub name such as Qwen/Qwen3-8B (read over "
                        f"the network).")
    from ulysses_train.model.loading import check_supported_architecture, read_hf_config

    hf_config = read_hf_config(folder, key="--model", fix=f"give one of the presets ({LOCAL_SHAPES}) or a local "
                                                          f"folder with config.json")
    check_supported_architecture(hf_config, allow_untested=allow_untested)
    return hf_config


def sized_shape(name: str, shape) -> ModelShape:
    """`shape()`, or PlanError for an architecture the planner cannot size (a preset's too: kimi-linear-48b-a3b)."""
    try:
        return shape()
    except (NotImplementedError, AttributeError) as err:
        raise PlanError(f"--model {name!r}: the planner cannot model this architecture ({err}). Fix: plan a "
                        f"model it sizes, or train this one with the levers set by hand (the trainer then skips its "
                        f"memory check and gives `auto` levers their no-GPU values).") from None


def add_kernel_options(p: argparse.ArgumentParser) -> None:
    """The options that say which kernels and adapters the plan assumes (the trainer plans what it finds)."""
    p.add_argument("--attention", choices=("sdpa", "fa4"), default="sdpa",
                   help="the attention kernel whose backward buffers are planned (model.attn_implementation; "
                        "auto is fa4 on a GPU with FlashAttention 4, else sdpa)")
    p.add_argument("--kernel", dest="kernels", action="append", default=[], metavar="MIXER=VARIANT",
                   help="plan a mixer's kernel variant (repeatable; the trainer plans the one it chooses): "
                        + "; ".join(f"{m.name}={'|'.join(m.kernel_variants)}" for m in MIXERS if m.kernel_variants)
                        + ". E.g. gated_deltanet=flash_qla (pip install flash-qla on the GPU machine), "
                          "mamba2=chunk_gla (what a Hopper GPU with Triton 3.4 to 3.7.0 runs)")
    p.add_argument("--flash-qla", dest="kernels", action="append_const", const="gated_deltanet=flash_qla",
                   help="short for --kernel gated_deltanet=flash_qla")
    p.add_argument("--mamba2-chunk-gla", dest="kernels", action="append_const", const="mamba2=chunk_gla",
                   help="short for --kernel mamba2=chunk_gla")
    p.add_argument("--liger", "--liger-norm", dest="liger", action="store_true",
                   help="plan Liger's kernels where the trainer runs them: the (1 + w) RMSNorms of Qwen3.5, "
                        "Qwen3-Next and Gemma 3, and SwiGLU MLPs' activation and product (pip install liger-kernel "
                        "on the GPU machine; the trainer plans what it finds there)")
    p.add_argument("--sp-reduce-dtype", choices=tuple(DEEPSPEED_DTYPES), default="fp32",
                   help="the DeepSpeed JSON's seq_parallel_communication_data_type (DeepSpeed's default fp32: each "
                        "gradient cast to fp32 before its reduce under sp, a copy as large as a fused expert tensor's)")
    p.add_argument("--lora-rank", type=int, default=None,
                   help="plan LoRA adapters of this rank (model.lora.r): only they train, so gradients, fp32 masters "
                        "and optimizer states are the adapters'; counted on the model as PEFT adapts it")
    p.add_argument("--lora-targets", default=None,
                   help="with --lora-rank: the adapted modules, comma-separated (q_proj,k_proj,...) or all-linear "
                        "(model.lora.target_modules; default the trainer's: every attention and MLP projection)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a preset (qwen3-8b, qwen3.5-9b, ...) | local folder | hub name")
    p.add_argument("--allow-untested-family", action="store_true",
                   help="plan a model type with no family record (the trainer's model.allow_untested_family)")
    p.add_argument("--seq-length", type=int, default=1_048_576)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--sp", type=int, default=1, help="sequence-parallel size (GPUs that share one sequence)")
    p.add_argument("--zero-stage", type=int, default=3, choices=(0, 3))
    p.add_argument("--offload-activations", action="store_true")
    p.add_argument("--offload-fraction", type=float, default=1.0,
                   help="with --offload-activations: share of layers offloaded (model.activation_offload_fraction)")
    p.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default=None,
                   help="gpu: AdamW states on the GPU (default); cpu: on the host (offload_optimizer); none: no "
                        "update, a forward and backward (SGD at lr 0: ZeRO-3 still keeps the fp32 master). The "
                        "same meanings as scripts/bench.py --optimizer")
    p.add_argument("--offload-optimizer", action="store_true", help="the same as --optimizer cpu")
    p.add_argument("--tiled-mlp", action="store_true")
    p.add_argument("--mlp-tiles", "--mlp-shards", dest="mlp_tiles", type=int, default=None,
                   help="with --tiled-mlp: TiledMLP's tile count (default ceil(tokens per GPU / hidden), as the trainer)")
    p.add_argument("--no-chunked-loss", action="store_true", help="full seq x vocab logits (loss.type=nll)")
    p.add_argument("--loss-chunk-rows", type=int, default=LOSS_CHUNK_ROWS)
    p.add_argument("--keep-attention-fraction", type=float, default=0.0)
    p.add_argument("--attention-head-chunks", type=int, default=1,
                   help="run attention's all-to-all and kernel over this many chunks of a rank's heads, one at a "
                        "time (model.attention_head_chunks); must divide the query heads each rank runs")
    p.add_argument("--no-gradient-checkpointing", action="store_true")
    p.add_argument("--hf-rmsnorm", action="store_true",
                   help="Hugging Face's RMSNorm (model.rmsnorm: hf) instead of the trainer's default")
    p.add_argument("--no-optimizer", action="store_true",
                   help="the same as --optimizer none (with --zero-stage 0: no fp32 master either)")
    add_kernel_options(p)
    p.add_argument("--dtype-bytes", type=int, default=2)
    p.add_argument("--gpu-gib", type=float, default=141.0)
    p.add_argument("--host-gib", type=float, default=560.0)
    p.add_argument("--tflops", type=float, default=400.0, help="effective TFLOP/s per GPU, counting recompute")
    p.add_argument("--host-link-gbps", type=float, default=25.0)
    p.add_argument("--auto-levers", action="store_true",
                   help="choose keep-attention fraction, TiledMLP and (with --offload-activations) the offloaded "
                        "share as the trainer's `auto` does on this hardware (planner/levers.py), then plan that")
    p.add_argument("--max-length", action="store_true", help="also print the longest sequence that fits")
    p.add_argument("--eval", action="store_true",
                   help="also print the evaluation forward's plan with these options (planner/forward_only.py: what "
                        "eval_context.py and the probes during training hold under no_grad)")
    p.add_argument("--no-story", action="store_true")
    p.add_argument("--json", default=None, help="write the plan (and story, max length) as JSON here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    return report_user_errors(lambda: report(args))


def options_from_args(args) -> PlanOptions:
    """The command line as PlanOptions; hardware numbers the planner divides by must be positive."""
    for flag in ("tflops", "host_link_gbps", "gpu_gib", "host_gib"):
        value = getattr(args, flag)
        if not value > 0:  # also NaN; the planner divides by these
            raise PlanError(f"--{flag.replace('_', '-')}={value} must be a positive number.")
    if args.attention_head_chunks > 1 and args.keep_attention_fraction > 0:
        raise PlanError("--attention-head-chunks > 1 with --keep-attention-fraction > 0: a layer keeps its attention "
                        "or runs it in head chunks; give one of them.")
    return PlanOptions(
        seq_length=args.seq_length, sp=args.sp, gpus_per_node=args.gpus_per_node, nodes=args.nodes,
        zero_stage=args.zero_stage, **optimizer_fields(args),
        offload_activations=args.offload_activations, activation_offload_fraction=args.offload_fraction,
        chunked_loss=not args.no_chunked_loss,
        loss_chunk_rows=args.loss_chunk_rows, tiled_mlp=args.tiled_mlp, mlp_tiles=args.mlp_tiles,
        keep_attention_fraction=args.keep_attention_fraction, attention_head_chunks=args.attention_head_chunks,
        low_memory_rmsnorm=not args.hf_rmsnorm,
        attention_kernel=args.attention,
        dtype_bytes=args.dtype_bytes, mixer_kernels=mixer_kernels_from_args(args.kernels),
        offset_norm_kernel=args.liger, swiglu_kernel=args.liger,
        gradient_checkpointing=not args.no_gradient_checkpointing,
        gpu_memory_gib=args.gpu_gib, host_memory_gib=args.host_gib, tflops=args.tflops,
        host_link_gbps=args.host_link_gbps,
        sp_reduce_cast_bytes=deepspeed_sp_reduce_cast_bytes({SP_REDUCE_DTYPE_KEY: args.sp_reduce_dtype},
                                                            {2: "bfloat16", 4: "float32"}.get(args.dtype_bytes, "")))


def mixer_kernels_from_args(items: list) -> dict:
    """--kernel MIXER=VARIANT items as PlanOptions.mixer_kernels, each checked against the registry's variants."""
    variants = {m.name: m.kernel_variants for m in MIXERS if m.kernel_variants}
    chosen = {}
    for item in items:
        mixer, _, variant = item.partition("=")
        if variant not in variants.get(mixer, {}):
            known = "; ".join(f"{name}={'|'.join(v)}" for name, v in variants.items())
            raise PlanError(f"--kernel {item!r} names no mixer kernel variant. Fix: one of {known}.")
        chosen[mixer] = variant
    return chosen


def optimizer_fields(args) -> dict:
    """--optimizer (or its shorthands) as PlanOptions fields: planner.options.OPTIMIZERS, one meaning for plan.py
    and bench.py. Plain PyTorch (--zero-stage 0) without an update keeps no fp32 master at all."""
    shorthands = [name for name, given in (("cpu", args.offload_optimizer), ("none", args.no_optimizer)) if given]
    named = {args.optimizer} if args.optimizer else set()
    if len(named | set(shorthands)) > 1:
        raise PlanError(f"--optimizer {args.optimizer}, --offload-optimizer and --no-optimizer disagree: give one.")
    choice = (named | set(shorthands) or {"gpu"}).pop()
    fields = dict(OPTIMIZERS[choice])
    if choice == "none" and args.zero_stage == 0:
        fields["include_optimizer"] = False
    return fields


LORA_FLAGS = {"r": "--lora-rank", "target_modules": "--lora-targets"}
"""The flags that stand for model.lora's keys, as lora.py's errors name them."""


def lora_from_args(args):
    """--lora-rank / --lora-targets as the trainer's model.lora mapping; None without --lora-rank (a full
    fine-tune). Targets left out are the trainer's default (lora.LORA_DEFAULTS), so the plan is that run's."""
    if args.lora_rank is None:
        if args.lora_targets is not None:
            raise PlanError("--lora-targets plans LoRA adapters and needs their rank. Fix: add --lora-rank R (16 is "
                            "the trainer's default).")
        return None
    lora = {"r": args.lora_rank}
    if args.lora_targets is not None:
        names = [name.strip() for name in args.lora_targets.split(",") if name.strip()]
        lora["target_modules"] = "all-linear" if names == ["all-linear"] else names
    return lora


def lora_adapters(hf_config, lora: dict) -> dict:
    """The adapters of `lora` as the trainer checks and counts them (lora.check_lora_targets, with the flags'
    names in its errors, and lora.lora_plan_fields: PEFT's own count, and the fused expert tensors it adapts), with
    the line that reports them."""
    from ulysses_train.model.lora import (check_lora_targets, linear_names, lora_plan_fields, lora_settings,
                                          present_targets)

    check_lora_targets(hf_config, lora, keys=LORA_FLAGS)
    targets = lora_settings(lora)["target_modules"]
    targets = targets if isinstance(targets, str) else present_targets(linear_names(hf_config), targets)
    fields = lora_plan_fields(hf_config, lora)
    count = fields["adapter_params"]
    which = targets if isinstance(targets, str) else f"{len(targets)} target modules: {', '.join(targets)}"
    return {**fields, "rank": lora["r"], "target_modules": targets,
            "line": f"LoRA: {count:,} adapter parameters train (rank {lora['r']}, {which})"}


def positions_note(name: str, hf_config, length: int) -> str:
    """What a suggested length past a NoPE model's trained positions needs from the trainer (model/rope.py refuses
    YaRN there, and `auto` past them): `rope_scaling: none`; "" otherwise."""
    from ulysses_train.model.presets import preset_config
    from ulysses_train.model.rope import position_free

    config = hf_config if hf_config is not None else preset_config(name)
    supported = int(getattr(config, "max_position_embeddings", 0) or 0)
    if not supported or length <= supported or not position_free(config):
        return ""
    return (f"; past the {supported:,} positions the model was trained to, and it has no rotary embeddings (NoPE) "
            f"for YaRN to scale: train it there with model.rope_scaling: none")


def longest_lengths(args, model, options, asked, hf_config) -> dict:
    """--max-length: the longest sequence that fits with these levers and over every lever setting, printed; their
    JSON entries."""
    out = {}
    longest = max_length(model, options)
    print(f"\nlongest sequence that fits: {longest:,} tokens"
          + (f" ({plan(model, options=options.replace(seq_length=longest)).summary()})" if longest else "")
          + positions_note(args.model, hf_config, longest))
    out["max_length"] = longest
    best, best_options = longest_fitting(model, asked)  # the same answer with or without --auto-levers
    if best_options is not None:
        o = best_options
        share = (f" (model.activation_offload_fraction={o.activation_offload_fraction:.4g})"
                 if o.activation_offload_fraction < 1 else "")
        print(f"longest over all lever settings: {best:,} tokens with sp={o.sp}, activation offload "
              f"{share.strip() if o.offload_activations and share else ('on' if o.offload_activations else 'off')}, "
              f"optimizer offload "
              f"{'on' if o.offload_optimizer else 'off'}, TiledMLP {'on' if o.tiled_mlp else 'off'} "
              f"({plan(model, options=o).summary()})" + positions_note(args.model, hf_config, best))
        out["max_length_any_levers"] = {"length": best, "options": {
            k: getattr(o, k) for k in ("sp", "offload_activations", "activation_offload_fraction",
                                       "offload_optimizer", "tiled_mlp")}}
    return out


def report(args) -> int:
    options = options_from_args(args)
    lora = lora_from_args(args)
    hf_config = model_config(args.model, args.allow_untested_family) \
        if lora is not None or not known_name(args.model) else None
    model = model_shape(args.model, hf_config)
    check_sp_splits_heads(model, options.sp, key="--sp")  # every mixer's heads, as train.py refuses
    problem = hf_config is not None and untested_exchange_problem(hf_config, options.sp, key="--sp")
    if problem:
        raise ConfigError(problem + ".")
    check_head_chunks(model, options.sp, options.attention_head_chunks, key="--attention-head-chunks")
    out = {}
    if lora is not None:
        adapters = lora_adapters(hf_config, lora)
        options = options.replace(adapter_params=adapters["adapter_params"],
                                  lora_merged_params=adapters["lora_merged_params"])
        print(adapters.pop("line") + "\n")
        out["lora"] = adapters
    asked = options
    if args.auto_levers:
        choice = choose_levers(model, options, set(LEVER_KEYS))
        options = choice.options
        print(choice.describe() + "\n")
        out["auto_levers"] = choice.to_dict()
    result = plan(model, options=options)
    print(result.table())
    asked_note = positions_note(args.model, hf_config, options.seq_length)
    if asked_note:  # the length asked for, as the suggested ones (longest_lengths)
        print(f"note: {options.seq_length:,} tokens{asked_note}")
    out["plan"] = result.to_dict()
    if args.eval:
        forward = plan_forward(model, options=options)
        print("\n" + forward.table())
        out["eval"] = forward.to_dict()
    if not args.no_story:
        rows = story(model, options)
        print("\n" + story_table(rows))
        out["story"] = [{"step": label, "gpu_gib": p.gpu_total / GIB, "host_per_node_gib": p.host_per_node / GIB,
                         "step_seconds": p.step_seconds, "fits": p.fits} for label, p in rows]
    if args.max_length:
        out.update(longest_lengths(args, model, options, asked, hf_config))
    status = 0
    try:
        check_fits(result)
    except PlanError as err:
        print(f"\nDOES NOT FIT: {err}")
        out["error"] = str(err)
        status = 1
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    return status


if __name__ == "__main__":
    run_script(main)
