"""Which elementwise work a decoder layer's training step does, in bytes moved per token.

    python benchmarks/elementwise_census.py --model qwen3-4b --tokens 1024 --json OUT/census.json

The H200 profile of a 128K step (RESULTS.md) put 17% of the device time in "elementwise and other" kernels
and 4% in copies; with attention and matmuls at their kernels' speed that is where the 45% model-FLOPs
target is lost. This counts, on any machine (CPU included), every aten op of one training step of the
real model code with the trainer's levers (gradient checkpointing with kept attention, TiledMLP, the
low-memory RMSNorm, the fused chunked loss), outside matmuls and attention, with the bytes it reads and
writes. A step of 2 layers minus a step of 1 layer gives one decoder layer's share; the rest (embedding,
final norm, loss) is per step. Each op's bytes are split into a per-step constant (weight-sized buffers) and a part
linear in the tokens, from counts at two lengths; elementwise kernels are memory-bound, so the bytes
predict their time at any length: `--predict-tokens 131072 --predict-layers 12 --bandwidth-tbs 3.0` prints
the seconds a GPU streaming at that rate would spend, to hold against the profile. (On CPU the loss's
lm_head-gradient accumulation takes the plain form, which on CUDA is now one fused GEMM: loss.py.)
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
import tempfile

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# ops that move no data (views and metadata) or are counted elsewhere (matmuls, attention kernels)
NO_DATA = ("view", "_unsafe_view", "reshape", "t", "transpose", "expand", "slice", "select", "as_strided",
           "unsqueeze", "squeeze", "permute", "alias", "detach", "split", "chunk", "unbind", "split_with_sizes",
           "empty", "empty_like", "empty_strided", "lift_fresh", "_to_copy_meta", "is_same_size", "unfold",
           "_reshape_alias", "narrow")
MATMUL = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_mm")


def op_kind(name: str) -> str:
    """'matmul', 'attention', 'view' (no data moved) or 'elementwise' for an aten op's base name."""
    if name in MATMUL:
        return "matmul"
    if "attention" in name or "flash" in name or "efficient" in name:
        return "attention"
    if name in NO_DATA:
        return "view"
    return "elementwise"


class ByteCensus(TorchDispatchMode):
    """Every op that runs: count and bytes of its tensor inputs (read) and outputs (written)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.defaultdict(lambda: {"calls": 0, "bytes": 0})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name.split("::")[-1]
        if op_kind(name) == "elementwise":
            tensors = [t for t in tree_flatten((args, kwargs or {}, out))[0] if isinstance(t, torch.Tensor)]
            entry = self.ops[name]
            entry["calls"] += 1
            entry["bytes"] += sum(t.numel() * t.element_size() for t in tensors)
        return out


ABLATIONS = ("norms", "rope", "mlp_activation")
"""Parts that --ablate removes (the function becomes the identity), so the bytes they move are the difference:
every RMSNorm, the rotary embedding's application to q and k, the MLP's SiLU."""


@contextlib.contextmanager
def ablated(model, part: str):
    """`model` with `part` (ABLATIONS) computing the identity, for the duration of the block."""
    import transformers.models.qwen3.modeling_qwen3 as qwen3

    from ulysses_train.model.architecture import LLAMA_STYLE_RMSNORMS
    from ulysses_train.model.swap import stock_class

    saved = []
    if part == "norms":
        for module in model.modules():
            if stock_class(module).__name__ in LLAMA_STYLE_RMSNORMS:
                saved.append((module, "forward", module.forward))
                module.forward = lambda x: x
    elif part == "rope":
        saved.append((qwen3, "apply_rotary_pos_emb", qwen3.apply_rotary_pos_emb))
        qwen3.apply_rotary_pos_emb = lambda q, k, cos, sin, unsqueeze_dim=1: (q, k)
    elif part == "mlp_activation":
        for module in model.modules():
            if hasattr(module, "act_fn") and hasattr(module, "gate_proj"):
                saved.append((module, "act_fn", module.act_fn))
                module.act_fn = torch.nn.Identity()
    else:
        raise ValueError(f"unknown part {part!r}; choose from {', '.join(ABLATIONS)}")
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def census(model_name: str, layers: int, tokens: int, dtype: torch.dtype, overrides: dict | None = None,
           ablate: str = "") -> dict:
    """Elementwise ops of one training step (forward with the fused loss, backward) of `layers` layers;
    `ablate`: one of ABLATIONS made the identity (or "" for the whole model)."""
    from transformers import AutoConfig

    from ulysses_train.config import ModelConfig
    from ulysses_train.model.loading import LongContextCausalLM, build_causal_lm
    from ulysses_train.model.presets import save_qwen3_config
    from ulysses_train.model.transform import apply_memory_levers

    folder = save_qwen3_config(model_name, tempfile.mkdtemp(prefix="census_"),
                               **{**(overrides or {}), "num_hidden_layers": layers})
    cfg = ModelConfig(name_or_path=folder, random_init=True, dtype={torch.bfloat16: "bfloat16"}.get(dtype, "float32"),
                      tiled_mlp="true", keep_attention_fraction=1.0, rmsnorm="torch")
    torch.manual_seed(0)
    causal_lm, _ = build_causal_lm(AutoConfig.from_pretrained(folder), cfg, "sdpa", None)
    apply_memory_levers(causal_lm, cfg, None)
    model = LongContextCausalLM(causal_lm)
    ids = torch.randint(0, causal_lm.config.vocab_size, (1, tokens))
    labels = torch.roll(ids, -1, dims=1)
    counter = ByteCensus()
    with ablated(causal_lm, ablate) if ablate else contextlib.nullcontext(), counter:
        loss, count = model(ids, torch.arange(tokens)[None], labels)
        loss.backward()
    return {name: dict(v) for name, v in counter.ops.items()}


def split_costs(runs: dict, t1: int, t2: int) -> dict:
    """Per op, bytes = step_fixed + step_per_token * T + L * (layer_fixed + layer_per_token * T), solved from
    the censuses of (L, T) in {1, 2} x {t1, t2}. Fixed terms are per step (e.g. a weight-sized gradient
    buffer), per-token terms grow with the sequence."""
    names = set().union(*(r.keys() for r in runs.values()))
    out = {}
    for name in names:
        b = {key: runs[key].get(name, {}).get("bytes", 0) for key in runs}
        calls = {key: runs[key].get(name, {}).get("calls", 0) for key in runs}
        layer1, layer2 = b[(2, t1)] - b[(1, t1)], b[(2, t2)] - b[(1, t2)]
        layer_per_token = (layer2 - layer1) / (t2 - t1)
        layer_fixed = layer1 - layer_per_token * t1
        step1, step2 = b[(1, t1)] - layer1, b[(1, t2)] - layer2
        step_per_token = (step2 - step1) / (t2 - t1)
        step_fixed = step1 - step_per_token * t1
        out[name] = {"calls_per_layer_t1": calls[(2, t1)] - calls[(1, t1)], "layer_per_token": layer_per_token,
                     "layer_fixed": layer_fixed, "step_per_token": step_per_token, "step_fixed": step_fixed}
    return out


def predict_bytes(costs: dict, layers: int, tokens: int) -> float:
    return sum(c["step_fixed"] + c["step_per_token"] * tokens + layers * (c["layer_fixed"] + c["layer_per_token"] * tokens)
               for c in costs.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-4b")
    ap.add_argument("--tokens", type=int, default=512, help="the shorter of the two lengths counted (and twice it)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--shape-overrides", default="{}", help='JSON of config fields, e.g. \'{"hidden_size": 64}\'')
    ap.add_argument("--predict-tokens", type=int, default=131072)
    ap.add_argument("--predict-layers", type=int, default=12)
    ap.add_argument("--bandwidth-tbs", type=float, default=3.0, help="achieved streaming bandwidth, TB/s")
    ap.add_argument("--ablate", default="", help=f"comma-separated parts whose bytes to measure by removing them: "
                                                 f"{', '.join(ABLATIONS)}")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    t1, t2 = args.tokens, 2 * args.tokens
    overrides = json.loads(args.shape_overrides)

    def costs_of(ablate=""):
        runs = {(layers, t): census(args.model, layers, t, dtype, overrides, ablate)
                for layers in (1, 2) for t in (t1, t2)}
        return split_costs(runs, t1, t2)

    costs = costs_of()
    total = predict_bytes(costs, args.predict_layers, args.predict_tokens)
    parts = {}
    for part in [p for p in args.ablate.split(",") if p]:
        without = predict_bytes(costs_of(part), args.predict_layers, args.predict_tokens)
        parts[part] = {"bytes": total - without, "share": (total - without) / total}
    seconds = total / (args.bandwidth_tbs * 1e12)

    gb = 1e9
    print(f"{args.model}, {args.dtype}, counted at {t1} and {t2} tokens; GB moved per step at "
          f"{args.predict_tokens:,} tokens, {args.predict_layers} layers")
    print(f"{'op':24} {'calls/layer':>11} {'bytes/token/layer':>18} {'layers GB':>10} {'per-step GB':>12}")
    rows = []
    for name, c in costs.items():
        layers_gb = args.predict_layers * (c["layer_fixed"] + c["layer_per_token"] * args.predict_tokens) / gb
        step_gb = (c["step_fixed"] + c["step_per_token"] * args.predict_tokens) / gb
        if abs(layers_gb) + abs(step_gb) > 1e-3:
            rows.append((layers_gb + step_gb, name, c, layers_gb, step_gb))
    for _, name, c, layers_gb, step_gb in sorted(rows, key=lambda r: -r[0]):
        print(f"{name:24} {c['calls_per_layer_t1']:>11} {c['layer_per_token']:>18,.0f} {layers_gb:>10.1f} {step_gb:>12.1f}")
    print(f"total {total / gb:,.0f} GB: predicted elementwise time {seconds:.2f} s at {args.bandwidth_tbs:g} TB/s")
    for part, v in parts.items():
        print(f"  {part}: {v['bytes'] / gb:,.0f} GB ({100 * v['share']:.0f}%), "
              f"{v['bytes'] / (args.bandwidth_tbs * 1e12):.2f} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": args.model, "tokens": [t1, t2], "dtype": args.dtype, "torch": torch.__version__,
                       "ops": costs, "parts": parts, "predict": {"tokens": args.predict_tokens, "layers": args.predict_layers,
                                                 "bandwidth_tbs": args.bandwidth_tbs, "bytes": total,
                                                 "seconds": seconds}}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
