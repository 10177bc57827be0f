"""GLM-5.2's indexed-attention layer at its released widths (preset glm-5.2: 64 heads, MLA latent 512 + 64, an
indexer of 32 heads of 128 keeping the top 2,048 keys): the package's forward (model/mixers/indexed_attention.py, its
torch reference kernels) against transformers' own, on the same weights and random inputs.

For each length it prints one row:
- fp32: the package's output and every gradient against transformers' layer in fp32 (relative error; the worst
  gradient named);
- bf16: the package in bf16 against its own fp32, beside transformers' layer in bf16 against its fp32: the package's
  error should be within the plain bf16 layer's.

    python benchmarks/indexed_check.py --lengths 2048,4096 --json indexed_check.json

transformers' layer builds its [S, S] mask and [S, 32, S] indexer scores, so lengths stay small (4,096 takes ~2 GiB
of scores). On a machine without CUDA (or `--device cpu`) it runs one tiny length in fp32 only, the indexer
keeping 16 keys: a check that the plumbing runs."""
from __future__ import annotations

import argparse
import copy
import importlib
import json

import torch

from ulysses_train.model.mixers.indexed_attention import install_indexed_attention
from ulysses_train.model.presets import preset_config
from ulysses_train.sequence_parallel import SequenceParallel

PRESET = "glm-5.2"
CPU_LENGTH, CPU_TOP_K = 64, 16


class Holder(torch.nn.Module):
    """One layer as a model, for the mixer's install."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer


def build(device: torch.device, top_k: int = 0):
    """(transformers' layer in fp32, the package's copy, the rotary module, the config)."""
    config = preset_config(PRESET)
    config._attn_implementation = "sdpa"
    if top_k:
        config.index_topk = top_k
    module = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    torch.manual_seed(0)
    stock = module.GlmMoeDsaAttention(config, layer_idx=0).to(device).float()
    ours = copy.deepcopy(stock)
    install_indexed_attention(Holder(ours), SequenceParallel(), "")
    return stock, ours, module.GlmMoeDsaRotaryEmbedding(config).to(device), config


def run(layer, hidden, rotary, mask=None):
    """The layer's output and its gradients (of the mean square output), in fp32."""
    layer.zero_grad(set_to_none=True)
    positions = torch.arange(hidden.shape[1], device=hidden.device)[None]
    cos, sin = rotary(hidden.float(), positions)
    args = (hidden, (cos.to(hidden.dtype), sin.to(hidden.dtype))) + ((mask,) if mask is not None else ())
    out = layer(*args)[0]
    out.float().square().mean().backward()
    return out.detach().float(), {n: p.grad.float() for n, p in layer.named_parameters() if p.grad is not None}


def errors(got, want) -> dict:
    """Relative errors of the output and of each gradient (median, worst and the worst one's name)."""
    rel = lambda a, b: float((a - b).norm() / b.norm().clamp(min=1e-30))  # noqa: E731
    grads = {name: rel(got[1][name], want[1][name]) for name in want[1]}
    worst = max(grads, key=grads.get)
    ordered = sorted(grads.values())
    return {"output": rel(got[0], want[0]), "grad_median": ordered[len(ordered) // 2], "grad_worst": grads[worst],
            "grad_worst_name": worst, "grads_compared": len(grads), "grads_missing": sorted(set(want[1]) - set(got[1]))}


def row(length: int, device: torch.device) -> dict:
    cuda = device.type == "cuda"
    stock, ours, rotary, config = build(device, 0 if cuda else CPU_TOP_K)
    hidden = torch.randn(1, length, config.hidden_size, device=device)
    mask = torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None]
    plain32, ours32 = run(stock, hidden, rotary, mask), run(ours, hidden, rotary)
    result = {"length": length, "top_k": config.index_topk, "fp32": errors(ours32, plain32)}
    if cuda:
        result["bf16"] = errors(run(ours.to(torch.bfloat16), hidden.bfloat16(), rotary), ours32)
        result["plain_bf16"] = errors(run(stock.to(torch.bfloat16), hidden.bfloat16(), rotary, mask), plain32)
    return result


def table(rows: list) -> str:
    lines = [f"{'tokens':>7} {'fp32 out':>9} {'fp32 grad':>10}  {'bf16 out':>9} {'grad med':>9} {'worst':>8}  "
             f"{'plain bf16 out':>14} {'grad med':>9} {'worst':>8}"]
    for r in rows:
        half, plain = r.get("bf16"), r.get("plain_bf16")
        tail = (f"{half['output']:>9.2e} {half['grad_median']:>9.2e} {half['grad_worst']:>8.2e}  "
                f"{plain['output']:>14.2e} {plain['grad_median']:>9.2e} {plain['grad_worst']:>8.2e}") if half else "n/a"
        lines.append(f"{r['length']:>7} {r['fp32']['output']:>9.2e} {r['fp32']['grad_worst']:>10.2e}  {tail}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="2048,4096", help="tokens per row, comma-separated (CUDA)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default="", help="write the rows and the versions here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    lengths = [int(n) for n in args.lengths.split(",") if n] if device.type == "cuda" else [CPU_LENGTH]
    rows = []
    for length in lengths:
        rows.append(row(length, device))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(table(rows), flush=True)
    import transformers

    result = {"rows": rows, "device": str(device), "torch": torch.__version__,
              "transformers": transformers.__version__}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return result


if __name__ == "__main__":
    main()
