"""One layer's token mixer on the GPU: the bytes it saves for backward and its backward's peak, beside the planner's.

For one mixer of each of Kimi Linear's Kimi Delta Attention layer, Kimi Linear's MLA attention layer (presets
kimi-linear-48b-a3b), OLMo-hybrid 7B's Gated DeltaNet layer (preset olmo-hybrid-7b), Nemotron 3 Nano's Mamba2 layer
and GLM-5.2's indexed-attention layer (its torch reference kernels), built from transformers at
the preset's widths and installed as the trainer installs it (model/mixers install_mixers at sp=1: fla's kernels on
CUDA; attention through SDPA with the trainer's priority, model/attention.py), in bf16, this measures per token:
- saved: allocated after the forward, less the input, the output and the parameters (what backward keeps);
- backward: the backward's peak above that (the incoming gradient allocated before), less the parameters'
  gradients (the planner counts those with ZeRO's partitions, not in the layer's backward);
and the seconds of one more forward and backward (warm), and prints them beside the planner's terms for the same mixer (planner/mixer_terms.py MIXER_TERMS: the kind's
`saved` and `backward`, the layer's RMSNorms and MLP left out, as here), with the ratio measured / planned.

    python benchmarks/mixer_memory.py --lengths 32768,65536 --json mixer_memory.json

On a machine without CUDA (or with `--device cpu`) it runs at a tiny length in fp32 with transformers' torch functions and
counts the saved bytes with saved-tensor hooks (unique storages), the backward peak not measured: a check that the
plumbing runs, not a measurement (the numbers then differ from the planner's)."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from dataclasses import dataclass

import torch

from ulysses_train.model.attention import sdpa_priority
from ulysses_train.model.mixers import choose_mixer_kernels, install_mixers
from ulysses_train.model.presets import preset_config
from ulysses_train.planner.mixer_terms import MIXER_TERMS
from ulysses_train.planner.options import PlanOptions
from ulysses_train.planner.shapes import load_model_shape
from ulysses_train.sequence_parallel import SequenceParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fla_check import cuda_saved_and_backward_bytes  # noqa: E402  (one measurement for both scripts)

CPU_LENGTH = 128


@dataclass(frozen=True)
class Case:
    name: str
    preset: str
    layer_index: int
    """A layer of the preset of this mixer's type, whose module is built."""
    module_class: str
    kind: str
    """Its planner kind (ModelShape.kinds)."""
    rotary: str = ""
    """The modeling file's rotary-embedding class where the layer takes `position_embeddings` (cos, sin)."""


CASES = (Case("kimi KDA", "kimi-linear-48b-a3b", 0, "KimiLinearDeltaAttention", "kimi_delta"),
         Case("kimi MLA", "kimi-linear-48b-a3b", 3, "KimiLinearAttention", "attention"),
         Case("olmo-hybrid GDN", "olmo-hybrid-7b", 0, "OlmoHybridGatedDeltaNet", "gated_deltanet"),
         Case("nemotron Mamba2", "nemotron-3-nano-30b-a3b", 0, "NemotronHMamba2Mixer", "mamba2"),
         Case("glm-5.2 DSA", "glm-5.2", 0, "GlmMoeDsaAttention", "indexed_attention", "GlmMoeDsaRotaryEmbedding"))


class OneLayer(torch.nn.Module):
    """A holder for one mixer, so the registry's install (which walks a model's modules and reads its device) sees
    a model."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device


def build(case: Case, device: torch.device):
    """The case's mixer at the preset's widths, bf16 (fp32 on CPU, where only the plumbing is checked), installed as
    the trainer installs it at sp=1."""
    config = preset_config(case.preset)
    config._attn_implementation = "sdpa"
    module = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # CPU: the plumbing only, bf16 is slow there
    layer = getattr(module, case.module_class)(config, layer_idx=case.layer_index).to(device, dtype)
    holder = OneLayer(layer)
    install_mixers(holder, SequenceParallel(), choose_mixer_kernels(config, device.type == "cuda"))
    layer.rotary = getattr(module, case.rotary)(config).to(device) if case.rotary else None
    return layer


def forward(layer, hidden):
    """The layer on `hidden`, with the rotary tables of positions 0..T-1 where it takes them."""
    kwargs = {}
    if getattr(layer, "rotary", None) is not None:
        positions = torch.arange(hidden.shape[1], device=hidden.device)[None]
        kwargs["position_embeddings"] = layer.rotary(hidden, positions)
    out = layer(hidden, attention_mask=None, **kwargs) if "Attention" in type(layer).__name__ else layer(hidden)
    return out[0] if isinstance(out, tuple) else out


def parameter_bytes(layer) -> int:
    return sum(p.numel() * p.element_size() for p in layer.parameters())


def measure_cuda(layer, length: int) -> dict:
    """Saved and backward-peak bytes of one forward + backward (module docstring), after a warm-up pass that
    compiles and tunes the kernels at this length."""
    hidden = torch.randn(1, length, layer.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with sdpa_priority():
        saved, extra = cuda_saved_and_backward_bytes(layer, hidden, lambda x: forward(layer, x))
    extra -= sum(p.grad.numel() * p.grad.element_size() for p in layer.parameters() if p.grad is not None)
    return {"saved_per_token": saved / length, "backward_extra_per_token": extra / length,
            "forward_backward_s": forward_backward_seconds(layer, hidden)}


def forward_backward_seconds(layer, hidden) -> float:
    """One more forward and backward at this length (kernels warm), timed with CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with sdpa_priority():
        start.record()
        forward(layer, hidden).sum().backward()
        end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def measure_cpu(layer, length: int) -> dict:
    """CPU: the bytes of the unique storages the forward saves for backward (saved-tensor hooks), less the input's
    and the parameters'; the backward's peak is not measured (None)."""
    hidden = torch.randn(1, length, layer.hidden_size, requires_grad=True)
    storages = {}
    skip = {hidden.untyped_storage().data_ptr()} | {p.untyped_storage().data_ptr() for p in layer.parameters()}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = forward(layer, hidden)
    out.float().sum().backward()
    return {"saved_per_token": sum(storages.values()) / length, "backward_extra_per_token": None,
            "forward_backward_s": None}


def planned(case: Case, length: int, cuda: bool) -> dict:
    """The planner's terms of the case's mixer at sp=1 (the trainer's options there: the kernels a run here
    chooses), bytes per token."""
    shape = load_model_shape(case.preset)
    options = PlanOptions(seq_length=length, gpus_per_node=1, sp=1, low_memory_rmsnorm=shape.llama_norms,
                          mixer_kernels=choose_mixer_kernels(shape, cuda))
    terms = MIXER_TERMS[case.kind]
    return {"planned_saved_per_token": terms.saved(shape, options),
            "planned_backward_extra_per_token": terms.backward(shape, options)}


def ratio(measured, plan) -> float | None:
    return None if measured is None or not plan else measured / plan


def row(case: Case, length: int, device: torch.device) -> dict:
    layer = build(case, device)
    cuda = device.type == "cuda"
    measured = measure_cuda(layer, length) if cuda else measure_cpu(layer, length)
    result = {"mixer": case.name, "kind": case.kind, "preset": case.preset, "length": length, **measured,
              **planned(case, length, cuda)}
    result["saved_ratio"] = ratio(result["saved_per_token"], result["planned_saved_per_token"])
    result["backward_ratio"] = ratio(result["backward_extra_per_token"], result["planned_backward_extra_per_token"])
    del layer
    if cuda:
        torch.cuda.empty_cache()
    return result


def table(rows: list[dict]) -> str:
    fmt = lambda x, spec: "n/a" if x is None else format(x, spec)  # noqa: E731
    lines = [f"{'mixer':<17}{'tokens':>8}{'saved/tok':>12}{'planned':>12}{'ratio':>7}{'bwd/tok':>12}{'planned':>12}"
             f"{'ratio':>7}{'fwd+bwd s':>11}"]
    for r in rows:
        lines.append(f"{r['mixer']:<17}{r['length']:>8}{fmt(r['saved_per_token'], ',.0f'):>12}"
                     f"{r['planned_saved_per_token']:>12,.0f}{fmt(r['saved_ratio'], '.3f'):>7}"
                     f"{fmt(r['backward_extra_per_token'], ',.0f'):>12}{r['planned_backward_extra_per_token']:>12,.0f}"
                     f"{fmt(r['backward_ratio'], '.3f'):>7}{fmt(r['forward_backward_s'], '.3f'):>11}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="32768,65536", help="tokens per measured pass, comma-separated (CUDA)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--mixers", default=",".join(c.name for c in CASES), help="which of the cases, comma-separated")
    ap.add_argument("--json", default="", help="write the rows and the versions here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    lengths = [int(n) for n in args.lengths.split(",") if n] if device.type == "cuda" else [CPU_LENGTH]
    wanted = set(args.mixers.split(","))
    rows = []
    for case in (c for c in CASES if c.name in wanted):  # each row printed as it is measured: a stopped run keeps them
        for length in lengths:
            print(f"measuring {case.name} at {length:,} tokens (its kernels compile on first use)", flush=True)
            rows.append(row(case, length, device))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
            write_rows(args.json, rows, device)
    print(table(rows), flush=True)
    return write_rows(args.json, rows, device)


def write_rows(path: str, rows: list[dict], device: torch.device) -> dict:
    """The rows so far with the versions, written after each row: a run stopped by its time limit (a mixer's
    kernels compiling) keeps what it measured."""
    import transformers

    result = {"rows": rows, "device": str(device), "torch": torch.__version__, "transformers": transformers.__version__}
    if path:
        with open(path, "w") as fh:
            json.dump(result, fh, indent=1)
    return result


if __name__ == "__main__":
    main()
