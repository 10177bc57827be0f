"""The peer for the Qwen3.5 side-by-side: what TRL's SFTTrainer runs on one GPU with Liger, gradient checkpointing
and activation offloading, one sequence per step, so both sides can be measured back to back on one machine.

    python benchmarks/peer_trl.py --model qwen3.5-9b --lengths 131072,262144 --steps 3 --json peer.json
    python benchmarks/peer_trl.py --model qwen3.5-9b --lengths 131072 --lora --json peer_lora.json
    python benchmarks/peer_trl.py ... --profile      # one more step under torch.profiler (the kinds of our side's profile)

Random-init text model of the preset's published shapes (model/presets.py), bf16, SDPA for the full-attention
layers, flash-linear-attention's kernels for the Gated DeltaNet ones (as transformers picks them when fla is
installed). The step is SFTTrainer's `training_step` without the Trainer around it: Liger's patch for the family
(`apply_liger_kernel_to_qwen3_5`: fused linear cross-entropy, RMSNorm, SwiGLU), transformers' non-reentrant
gradient checkpointing, TRL's activation-offloading context around forward and backward
(`trl.models.activation_offloading.get_act_offloading_ctx_manager`, what `activation_offloading=True` installs),
and torch's SGD (full fine-tune: no optimizer states; `--lora`: PEFT adapters of rank 16 on every projection,
the Gated DeltaNet ones included, the base frozen). Prints a table and writes JSON rows with seconds per step
(the median after the first) and torch's peak allocated GPU memory; an out-of-memory point is a row."""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"]
"""Rank-16 adapters on the attention, MLP and Gated DeltaNet projections (our side: model.lora.target_modules)."""


def torch_fallbacks(modeling) -> list[str]:
    """The functions of a transformers modeling module that its hub-kernel decorator bound to the torch reference
    (`is_new_implementation` False in the decorator's closure: the package was not importable when the module was
    imported), e.g. the gated delta rule without fla: hours per step at 131,072 tokens."""
    import inspect

    slow = []
    for name in ("torch_chunk_gated_delta_rule", "chunk_gated_delta_rule"):
        fn = getattr(modeling, name, None)
        while fn is not None:
            if not inspect.isfunction(fn) and inspect.ismethod(getattr(fn, "forward", None)):
                # transformers 5.25 wraps the decorated function in a module whose forward calls it (`func`)
                fn = inspect.getclosurevars(fn.forward.__func__).nonlocals.get("func")
                continue
            closure = inspect.getclosurevars(fn).nonlocals if inspect.isfunction(fn) else {}
            if closure.get("is_new_implementation") is False:
                slow.append(name)
                break
            fn = getattr(fn, "__wrapped__", None)
    return slow


def build_model(preset: str, layers: int, lora: bool):
    import importlib

    import fla.ops.gated_delta_rule  # noqa: F401  (imported before transformers' modeling module binds its kernels)
    from liger_kernel.transformers import monkey_patch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ulysses_train.model.presets import save_preset_config

    overrides = {"num_hidden_layers": layers} if layers else {}
    folder = save_preset_config(preset, tempfile.mkdtemp(prefix="peer_"), **overrides)
    config = AutoConfig.from_pretrained(folder)
    family = config.model_type.replace("_text", "")
    slow = torch_fallbacks(importlib.import_module(f"transformers.models.{family}.modeling_{family}"))
    if slow:
        raise SystemExit(f"peer_trl.py: transformers bound {', '.join(slow)} to its torch reference (fla was not "
                         f"importable when its modeling module loaded): the peer would take hours per step")
    patch = getattr(monkey_patch, f"apply_liger_kernel_to_{family}")
    patch()  # before the model is built, as SFTTrainer(use_liger_kernel=True) does through the Trainer
    with torch.device("cuda"):  # random init on the GPU: 9B parameters initialised on the host take minutes
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        from peft import LoraConfig, get_peft_model

        model.enable_input_require_grads()
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                 target_modules=LORA_TARGETS))
    model.train()
    return model


def one_step(model, optimizer, ids, offload_ctx) -> float:
    """SFTTrainer's training_step: forward and backward inside the offloading context, then the update."""
    with offload_ctx:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def profile_step(model, optimizer, ids, offload_ctx) -> dict:
    """Device time by kind of one more step: the kinds our side's profile uses (diagnostics/step_time.py)."""
    from ulysses_train.diagnostics.step_time import profile_device_time

    return profile_device_time(lambda: one_step(model, optimizer, ids, offload_ctx), cuda=True)


def run_point(args, length: int) -> dict:
    from trl.models.activation_offloading import get_act_offloading_ctx_manager

    row = {"side": "trl+liger" + ("+peft" if args.lora else ""), "model": args.model, "layers": args.layers,
           "length": length, "lora": args.lora}
    torch.cuda.reset_peak_memory_stats()
    model = build_model(args.model, args.layers, args.lora)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    ctx = get_act_offloading_ctx_manager(model=model)
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0)).cuda()
    seconds = []
    try:
        for _ in range(args.steps):
            torch.cuda.synchronize()
            began = time.perf_counter()
            row["loss"] = one_step(model, optimizer, ids, ctx)
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - began)
        row.update(step_s=round(statistics.median(seconds[1:] or seconds), 3), seconds=[round(s, 3) for s in seconds],
                   peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
        if args.profile:
            row.update(profile_step(model, optimizer, ids, ctx))
    except torch.OutOfMemoryError:
        row.update(oom=True, peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
    del model, optimizer
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3.5-9b", help="a preset of ulysses_train/model/presets.py")
    ap.add_argument("--layers", type=int, default=0, help="fewer layers than the preset's (0: all)")
    ap.add_argument("--lengths", default="131072")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("peer_trl.py measures a GPU step: no CUDA device here")
    rows = []
    for length in (int(n) for n in args.lengths.split(",") if n):
        rows.append(run_point(args, length))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "top_kernels"}), flush=True)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(rows, fh, indent=1)
    print(f"{'side':>16} {'length':>8} {'s/step':>8} {'peak GiB':>9}")
    for r in rows:
        print(f"{r['side']:>16} {r['length']:>8} {'OOM' if r.get('oom') else r['step_s']:>8} {r['peak_gib']:>9}")


if __name__ == "__main__":
    main()
