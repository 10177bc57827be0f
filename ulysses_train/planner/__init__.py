"""The planner: predicted GPU and host memory, and step time, for one (model, length, layout, levers).

Why: a 1M-token run that dies of out-of-memory after loading is the worst failure this tool can have.
`plan()` does the arithmetic up front from the model's shapes alone (no weights), `check_fits()` refuses
a plan that exceeds the hardware and names the cheapest change that fits, `max_length()` finds the
longest sequence that fits, and `story()` walks the levers one at a time (full logits -> chunked loss
-> CPU offload -> TiledMLP -> sequence parallelism).

How the peak is found. A training step has four moments that can hold the peak on a GPU:
- `loss`: the end of the forward, while the loss runs over the last hidden state (the lm_head weight is
  gathered, logits exist chunk by chunk or in full);
- `mlp`: the backward of the first decoder layer to be recomputed, at its MLP (the recomputed layer's
  saved tensors plus the MLP's intermediates and their gradients);
- `norm`: the same layer's post-attention RMSNorm backward, whose fp32 gradient chain holds ~4 fp32
  copies of its input (the peak once TiledMLP has shrunk the MLP);
- `attn`: the same layer's attention backward (kernel gradients and workspaces, all-to-all buffers).
Every component says how many bytes it holds at each moment; the GPU peak is the largest column sum.
Under ZeRO-3 every checkpoint is still alive at the first recomputed layer, so that layer is the worst.
Without ZeRO (`zero_stage=0`, plain PyTorch as in the reference measurements) gradients are not
partitioned, and backward trades one checkpoint for one layer of gradients per layer: the peak is at
the first or the last recomputed layer, whichever holds more.

Sizes: `b` is the parameter dtype size (2 for bf16); `s` is the tokens on one GPU (`seq_length / sp`);
`h` hidden, `I` intermediate, `q = heads * head_dim`, `kv = kv_heads * head_dim`, `V` vocabulary,
`N` parameters, `W` world size. Everything is bytes; tables print GiB (2**30).

`gpu_allocated` is what `torch.cuda.max_memory_allocated()` would report (what the reference files and
benchmarks record); `gpu_total` adds the CUDA context, NCCL and cuBLAS workspaces that live outside
torch's allocator, and is what must fit the card.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Optional

from ulysses_train.errors import UserError
from ulysses_train.constants import DTYPE_BYTES, GIB
from ulysses_train.model.architecture import text_config

PHASES = ("loss", "mlp", "norm", "attn")
PHASE_NAMES = {"loss": "the loss", "mlp": "the MLP backward of a recomputed layer",
               "norm": "the post-attention RMSNorm backward of a recomputed layer",
               "attn": "the attention backward of a recomputed layer"}

CUDA_CONTEXT_BYTES = 2 * GIB
"""CUDA context (~0.5 GiB), NCCL communicators and cuBLAS workspaces: on the card but outside torch's
allocator, so not in max_memory_allocated. The one global overhead constant of the GPU side."""
HOST_PROCESS_BYTES = 5 * GIB
"""Host memory of one training process before any offload: Python, torch, CUDA and NCCL libraries,
DeepSpeed, the tokenized sample."""


class PlanError(UserError, RuntimeError):
    """The plan does not fit the hardware; the message says what, by how much, and what would fit."""


# ---------------------------------------------------------------- model shapes


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only model the planner needs; read from a config, never from weights."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    layer_params: int
    """Parameters of one decoder layer (projections, MLP, norms)."""
    total_params: int
    """All parameters, counting a tied embedding / lm_head once."""

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def lm_head_params(self) -> int:
        """The output projection (vocab x hidden); the same matrix as the embedding when tied."""
        return self.vocab * self.hidden

    @property
    def matmul_params(self) -> int:
        """Parameters used in one multiply-add per token: every layer plus the lm_head product (the
        embedding is a lookup). This is the N of 6*N*T."""
        return self.layers * self.layer_params + self.lm_head_params

    @classmethod
    def from_hf_config(cls, hf_config, name: str = "") -> "ModelShape":
        text = text_config(hf_config)
        if getattr(text, "num_experts", 0) or getattr(text, "num_local_experts", 0):
            raise NotImplementedError(f"{text.model_type}: mixture-of-experts layers are not modelled by the planner.")
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        layer_params, total_params = count_parameters(text)
        return cls(name=name or getattr(hf_config, "name_or_path", "") or text.model_type,
                   hidden=text.hidden_size, intermediate=text.intermediate_size,
                   layers=text.num_hidden_layers, heads=heads,
                   kv_heads=getattr(text, "num_key_value_heads", None) or heads, head_dim=head_dim,
                   vocab=text.vocab_size, tied=bool(getattr(text, "tie_word_embeddings", False)),
                   layer_params=layer_params, total_params=total_params)


def count_parameters(text_config) -> tuple[int, int]:
    """(parameters of one decoder layer, all parameters).

    Llama-family layouts (Llama, Mistral, Qwen2, Qwen3) by formula, which is instant; anything else by
    building the model on the meta device (exact for any architecture, no memory, a few seconds)."""
    c = text_config
    h, i, v = c.hidden_size, c.intermediate_size, c.vocab_size
    d = getattr(c, "head_dim", None) or h // c.num_attention_heads
    q, kv = c.num_attention_heads * d, (getattr(c, "num_key_value_heads", None) or c.num_attention_heads) * d
    if c.model_type in ("llama", "mistral", "qwen2", "qwen3"):
        attn = h * q + 2 * h * kv + q * h
        if c.model_type == "qwen2":
            attn += q + 2 * kv  # q/k/v biases, no o_proj bias
        elif getattr(c, "attention_bias", False):
            attn += q + 2 * kv + h
        mlp = 3 * h * i + ((2 * i + h) if getattr(c, "mlp_bias", False) else 0)
        norms = 2 * h + (2 * d if c.model_type == "qwen3" else 0)  # Qwen3 adds RMSNorm on q and k heads
        layer = attn + mlp + norms
        tied = bool(getattr(c, "tie_word_embeddings", False))
        return layer, c.num_hidden_layers * layer + v * h * (1 if tied else 2) + h
    return _count_parameters_on_meta(c)


def _count_parameters_on_meta(text_config) -> tuple[int, int]:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(text_config)
    layers = model.get_decoder().layers
    return sum(p.numel() for p in layers[0].parameters()), sum(p.numel() for p in model.parameters())


def load_model_shape(model) -> ModelShape:
    """A ModelShape from: a ModelShape; a transformers config; one of our local names ("qwen3-8b"); a local
    folder or config.json path; or a hub name (read with AutoConfig, which needs the network)."""
    if isinstance(model, ModelShape):
        return model
    if not isinstance(model, str):
        return ModelShape.from_hf_config(model)
    from types import SimpleNamespace

    from ulysses_train.model.presets import known_name, qwen3_config_kwargs

    if known_name(model):  # the same fields Qwen3Config gets, read without importing transformers
        fields = SimpleNamespace(model_type="qwen3", **qwen3_config_kwargs(model))
        return ModelShape.from_hf_config(fields, name=known_name(model))
    from transformers import AutoConfig

    path = os.path.dirname(model) if model.endswith(".json") and os.path.isfile(model) else model
    if model.startswith((".", "/", "~")) and not os.path.exists(os.path.expanduser(path)):
        raise PlanError(f"{model!r}: no such file or folder. Give a local folder with config.json or one of "
                        f"qwen3-0.6b, qwen3-4b, qwen3-8b.")
    try:
        return ModelShape.from_hf_config(AutoConfig.from_pretrained(path), name=model)
    except OSError as err:
        raise PlanError(f"cannot read the config of {model!r}: {err}. Give a local folder with config.json or "
                        f"one of qwen3-0.6b, qwen3-4b, qwen3-8b.") from None


# ---------------------------------------------------------------- options


@dataclass(frozen=True)
class PlanOptions:
    """Everything about a run that changes its memory or time, except the model."""

    seq_length: int
    sp: int = 1
    gpus_per_node: int = 8
    nodes: int = 1
    zero_stage: int = 3
    """3 (the trainer) or 0 (plain PyTorch, nothing partitioned: the reference measurements)."""
    offload_optimizer: bool = False
    """fp32 master weights, Adam moments and fp32 gradient partitions on the host (DeepSpeed offload_optimizer)."""
    offload_activations: bool = False
    """Checkpointed layer inputs on the host between forward and backward."""
    activation_offload_fraction: float = 1.0
    """Share of the layers whose checkpoints are offloaded (model.activation_offload_fraction); the rest stay."""
    chunked_loss: bool = True
    loss_chunk_rows: int = 256
    tiled_mlp: bool = False
    mlp_shards: Optional[int] = None
    """TiledMLP shard count; default ceil(s / hidden) as DeepSpeed's TiledMLP example picks."""
    keep_attention_fraction: float = 0.0
    """Fraction of layers whose attention output (and logsumexp) is kept, so backward skips its recompute."""
    low_memory_rmsnorm: bool = True
    """rmsnorm.py's RMSNorm (model.low_memory_rmsnorm, the trainer's default): saves the bf16 input and one
    fp32 scale per row instead of fp32 copies; False for Hugging Face's module (the reference measurements)."""
    dtype_bytes: int = 2
    gradient_checkpointing: bool = True
    include_optimizer: bool = True
    """False: no optimizer states, no fp32 gradient buffer (a forward+backward only, as in the references)."""
    offload_buffers: int = 2
    """Checkpoints resident on the GPU when offloading: the layer being recomputed and the next one,
    prefetched. 1 for a plain save_on_cpu (no prefetch)."""
    reduce_bucket_size: int = 500_000_000
    """ZeRO-3 reduce_bucket_size (elements): a contiguous gradient bucket allocated on every GPU."""
    prefetch_bucket_size: int = 50_000_000
    """ZeRO-3 stage3_prefetch_bucket_size (elements) of parameters gathered ahead of use (ds_configs/zero3.json)."""
    max_live_parameters: int = 1_000_000_000
    """ZeRO-3 stage3_max_live_parameters: a cap on gathered parameters."""
    sub_group_size: int = 1_000_000_000
    """ZeRO-3 sub_group_size: the optimizer's fp32 gradient buffer holds one sub-group."""
    allow_sp_across_nodes: bool = False
    gpu_memory_gib: float = 141.0
    host_memory_gib: float = 560.0
    tflops: float = 400.0
    """Effective TFLOP/s of one GPU, counting recompute (one H200 here: ~460 at 128K tokens)."""
    host_link_gbps: float = 25.0
    """Host<->GPU copy bandwidth per GPU in GB/s, for the offload transfer time."""

    def __post_init__(self):
        if self.zero_stage not in (0, 3):
            raise PlanError(f"zero_stage={self.zero_stage}: the planner models stage 3 (the trainer) and 0 "
                            f"(plain PyTorch).")
        for key in ("seq_length", "sp", "gpus_per_node", "nodes", "loss_chunk_rows", "dtype_bytes"):
            if getattr(self, key) < 1:
                raise PlanError(f"{key}={getattr(self, key)} must be >= 1.")
        if self.world % self.sp:
            raise PlanError(f"sp={self.sp} does not divide the world size {self.world}.")
        for key in ("keep_attention_fraction", "activation_offload_fraction"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise PlanError(f"{key}={getattr(self, key)} must be in [0, 1].")

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def seq_local(self) -> int:
        """Tokens on one GPU: the sequence is padded to a multiple of sp, then split."""
        return -(-self.seq_length // self.sp)

    @property
    def padded_length(self) -> int:
        return self.seq_local * self.sp

    def replace(self, **changes) -> "PlanOptions":
        return dataclasses.replace(self, **changes)


# ---------------------------------------------------------------- the plan


@dataclass
class Component:
    """One holder of memory: bytes on one GPU at each moment, bytes on the host per GPU process."""

    name: str
    loss: int = 0
    mlp: int = 0
    norm: int = 0
    attn: int = 0
    host: int = 0
    why: str = ""
    outside_allocator: bool = False
    """On the card but not in torch's allocator (not in max_memory_allocated)."""

    def at(self, phase: str) -> int:
        return getattr(self, phase)


@dataclass
class MemoryPlan:
    """A prediction: the components (bytes per GPU at each moment, per GPU process on the host), the FLOPs
    of one sequence, and what follows from them (peak, fit, step time); `table()` prints it all."""

    model: ModelShape
    options: PlanOptions
    components: list[Component]
    model_flops: float
    """6*N*T + 3 * causal attention forward: what a TFLOP/s figure usually counts."""
    recompute_flops: float
    """Extra forward work: checkpoint recompute (layers, attention unless kept), TiledMLP's re-run."""
    notes: list[str] = field(default_factory=list)

    # -- memory
    def gpu_at(self, phase: str, allocated_only: bool = False) -> int:
        return sum(c.at(phase) for c in self.components if not (allocated_only and c.outside_allocator))

    @property
    def peak_phase(self) -> str:
        return max(PHASES, key=self.gpu_at)

    @property
    def gpu_total(self) -> int:
        """Per GPU, everything on the card at the worst moment: what must fit."""
        return max(self.gpu_at(p) for p in PHASES)

    @property
    def gpu_allocated(self) -> int:
        """Per GPU, what torch.cuda.max_memory_allocated() would report."""
        return max(self.gpu_at(p, allocated_only=True) for p in PHASES)

    @property
    def host_per_gpu(self) -> int:
        return sum(c.host for c in self.components)

    @property
    def host_per_node(self) -> int:
        return self.host_per_gpu * self.options.gpus_per_node

    @property
    def gpu_capacity(self) -> int:
        return int(self.options.gpu_memory_gib * GIB)

    @property
    def host_capacity(self) -> int:
        return int(self.options.host_memory_gib * GIB)

    @property
    def fits(self) -> bool:
        return self.gpu_total <= self.gpu_capacity and self.host_per_node <= self.host_capacity

    # -- time
    @property
    def compute_seconds(self) -> float:
        """One sequence's FLOPs (with recompute), shared by the sp GPUs that hold it."""
        o = self.options
        return (self.model_flops + self.recompute_flops) / (o.tflops * 1e12 * o.sp)

    @property
    def offload_seconds(self) -> float:
        """Each offloaded checkpoint crosses the host link twice (out in forward, back in backward)."""
        offloaded = sum(c.host for c in self.components if c.name.startswith("checkpointed"))
        return 2 * offloaded / (self.options.host_link_gbps * 1e9)

    @property
    def step_seconds(self) -> float:
        """Compute time, or the offload copies if they are longer (they overlap compute on a side stream)."""
        return max(self.compute_seconds, self.offload_seconds)

    @property
    def tokens_per_second(self) -> float:
        """Tokens of all data-parallel groups per second."""
        o = self.options
        return o.padded_length * (o.world // o.sp) / self.step_seconds

    # -- output
    def summary(self) -> str:
        o = self.options
        return (f"GPU {self.gpu_total / GIB:.1f} / {o.gpu_memory_gib:g} GiB per GPU (peak during "
                f"{PHASE_NAMES[self.peak_phase]}), host {self.host_per_node / GIB:.1f} / {o.host_memory_gib:g} GiB "
                f"per node; step ~{self.step_seconds:.1f} s")

    def table(self) -> str:
        o, m = self.options, self.model
        levers = [name for name, on in (("chunked loss", o.chunked_loss), ("activation offload", o.offload_activations),
                                        ("optimizer offload", o.offload_optimizer), ("TiledMLP", o.tiled_mlp),
                                        ("gradient checkpointing", o.gradient_checkpointing)) if on]
        if o.keep_attention_fraction:
            levers.append(f"keep attention {o.keep_attention_fraction:g}")
        if o.offload_activations and o.activation_offload_fraction < 1:
            levers.append(f"activation offload share {o.activation_offload_fraction:g}")
        lines = [f"{m.name}: {m.total_params / 1e9:.2f}B params, seq {o.padded_length:,} tokens, sp={o.sp}, "
                 f"{o.nodes} node(s) x {o.gpus_per_node} GPUs (dp={o.world // o.sp}), ZeRO-{o.zero_stage}, "
                 f"{o.seq_local:,} tokens per GPU",
                 f"levers: {', '.join(levers) or 'none'}",
                 "",
                 f"{'component':<36}{'loss':>9}{'mlp bwd':>9}{'norm bwd':>9}{'attn bwd':>9}{'host/GPU':>10}"
                 "  (GiB)"]
        for c in self.components:
            if c.loss or c.mlp or c.norm or c.attn or c.host:
                lines.append(f"{c.name:<36}" + "".join(f"{c.at(p) / GIB:>9.2f}" for p in PHASES)
                             + f"{c.host / GIB:>10.2f}")
        lines.append(f"{'total per GPU':<36}" + "".join(f"{self.gpu_at(p) / GIB:>9.2f}" for p in PHASES)
                     + f"{self.host_per_gpu / GIB:>10.2f}")
        lines += ["",
                  f"GPU peak {self.gpu_total / GIB:.2f} GiB of {o.gpu_memory_gib:g} "
                  f"(during {PHASE_NAMES[self.peak_phase]}; {self.gpu_allocated / GIB:.2f} GiB allocated by torch)",
                  f"host {self.host_per_node / GIB:.1f} GiB per node of {o.host_memory_gib:g} "
                  f"({o.gpus_per_node} x {self.host_per_gpu / GIB:.1f} GiB)",
                  f"fits: {'yes' if self.fits else 'NO'}",
                  f"step time ~{self.step_seconds:.1f} s at {o.tflops:g} TFLOP/s per GPU "
                  f"(model {self.model_flops / 1e15:.1f} PFLOP + recompute {self.recompute_flops / 1e15:.1f} PFLOP "
                  f"per sequence over {o.sp} GPU(s); {self.tokens_per_second:,.0f} tokens/s)"]
        if self.offload_seconds:
            lines.append(f"offload copies ~{self.offload_seconds:.1f} s per step at {o.host_link_gbps:g} GB/s "
                         f"(hidden if shorter than compute)")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "model": dataclasses.asdict(self.model), "options": dataclasses.asdict(self.options),
            "components": [dataclasses.asdict(c) for c in self.components],
            "gpu_total_gib": self.gpu_total / GIB, "gpu_allocated_gib": self.gpu_allocated / GIB,
            "peak_phase": self.peak_phase, "host_per_gpu_gib": self.host_per_gpu / GIB,
            "host_per_node_gib": self.host_per_node / GIB, "fits": self.fits,
            "model_flops": self.model_flops, "recompute_flops": self.recompute_flops,
            "step_seconds": self.step_seconds, "offload_seconds": self.offload_seconds, "notes": self.notes,
        }


# ---------------------------------------------------------------- per-token tensors of one layer


def kv_width_after_all_to_all(m: ModelShape, sp: int) -> int:
    """KV width per token after Ulysses: each rank gets kv_heads/sp heads over the whole sequence, or one
    replicated head when sp exceeds the KV heads (DeepSpeed repeats them). Per local token that is
    max(kv_heads, sp) heads."""
    return (max(m.kv_heads, sp) if sp > 1 else m.kv_heads) * m.head_dim


def layer_saved_per_token(m: ModelShape, o: PlanOptions) -> int:
    """Bytes per local token that one (re)computed layer saves for backward, apart from the MLP's
    intermediates (HF Qwen3/Llama modules; matched to the byte on an H200, layer by layer):
    - two RMSNorms (input, post-attention), each keeping its fp32 upcast (4h), its normalized output (bh)
      and its output (bh), which the next projections (q/k/v; gate/up or TiledMLP) save as their input;
    - Qwen3's q/k RMSNorms: fp32 upcast and normalized q and k;
    - with the low-memory RMSNorm instead: each norm keeps its bf16 input (for the input norm that is the
      checkpoint, counted there) and one fp32 scale per row, plus the output the next projections keep;
    - q, k, v as the attention kernel sees them (under sp: after the all-to-all, each rank holding the
      whole sequence for its share of heads), the kernel's output and its fp32 logsumexp;
    - under sp the o_proj input is a new tensor made by the reverse all-to-all (with sp=1 o_proj saves
      the kernel's output itself)."""
    b, h, q, kv = o.dtype_bytes, m.hidden, m.q_width, m.kv_width
    if o.low_memory_rmsnorm:
        norms = b * h + 2 * b * h  # input norm: its output; post-attention norm: its input and output
        qk_norms = b * (q + kv) + 4 * (m.heads + m.kv_heads)
    else:
        norms = 2 * (4 + 2 * b) * h
        qk_norms = (4 + b) * (q + kv)
    attention = b * (q + 2 * kv_width_after_all_to_all(m, o.sp)) + b * q + 4 * m.heads
    o_proj_input = b * q if o.sp > 1 else 0
    return norms + qk_norms + attention + o_proj_input


def mlp_shards(m: ModelShape, o: PlanOptions) -> int:
    return o.mlp_shards or max(1, math.ceil(o.seq_local / m.hidden))


def mlp_saved_per_token(m: ModelShape, o: PlanOptions) -> float:
    """What the MLP keeps for backward per local token beyond its input (counted with the norm). Untiled,
    down(act(gate(x)) * up(x)) saves four s x intermediate tensors (gate, up, act(gate), the product).
    TiledMLP saves only its input."""
    return 0 if o.tiled_mlp else 4 * o.dtype_bytes * m.intermediate


def mlp_backward_extra_per_token(m: ModelShape, o: PlanOptions) -> float:
    """Extra bytes per local token at the MLP's backward peak. Untiled: the product's gradient and those
    of its two factors, while the product itself (saved by down_proj) is already freed: net 2 x
    intermediate (measured). Tiled: one shard's 4 + 2 intermediates spread over the sequence, plus the
    input gradient TiledMLP accumulates."""
    b, i = o.dtype_bytes, m.intermediate
    if o.tiled_mlp:
        return 6 * b * i / mlp_shards(m, o) + b * m.hidden
    return 2 * b * i


def norm_backward_extra_per_token(m: ModelShape, o: PlanOptions) -> int:
    """HF's RMSNorm backward runs in fp32: at its peak ~4 fp32 copies of the input plus the input gradient
    (measured: 18 bytes x hidden per token in bf16). The low-memory one: the input gradient, plus fp32
    temporaries of one row chunk (`norm_backward_chunk_bytes`)."""
    if o.low_memory_rmsnorm:
        return o.dtype_bytes * m.hidden
    return (16 + o.dtype_bytes) * m.hidden


def norm_backward_chunk_bytes(o: PlanOptions) -> int:
    """The low-memory RMSNorm's fp32 temporaries in backward: about six tensors of one row chunk."""
    from ulysses_train.model.rmsnorm import CHUNK_ELEMENTS

    return 6 * 4 * CHUNK_ELEMENTS if o.low_memory_rmsnorm else 0


def attention_backward_extra_per_token(m: ModelShape, o: PlanOptions) -> int:
    """Extra bytes per local token at the attention kernel's backward (measured for SDPA with GQA): dq, dk,
    dv; the fp32 dq accumulator; dk and dv expanded to every query head before the group sum (GQA only);
    the fp32 softmax row sums; and the gradient of the attention output."""
    b, q, kv = o.dtype_bytes, m.q_width, kv_width_after_all_to_all(m, o.sp)
    expanded = 2 * b * q if kv < q else 0
    return b * (q + 2 * kv) + 4 * q + expanded + 4 * m.heads + b * q


# ---------------------------------------------------------------- plan


def plan(model, seq_length: int | None = None, options: PlanOptions | None = None, **kwargs) -> MemoryPlan:
    """Predict memory and time. Either `plan(model, options)` or `plan(model, seq_length, sp=8, ...)` with
    any PlanOptions field as a keyword. `model`: anything `load_model_shape` accepts."""
    m = load_model_shape(model)
    if options is None:
        options = PlanOptions(seq_length=seq_length, **kwargs)
    elif seq_length is not None or kwargs:
        options = options.replace(**({"seq_length": seq_length} if seq_length else {}), **kwargs)
    return _plan(m, options)


def _plan(m: ModelShape, o: PlanOptions) -> MemoryPlan:
    b, s, h, L, V = o.dtype_bytes, o.seq_local, m.hidden, m.layers, m.vocab
    world, N = o.world, m.total_params
    zero3 = o.zero_stage == 3
    parts: list[Component] = []
    notes: list[str] = []

    def everywhere(name, nbytes, why, host=0):
        parts.append(Component(name, nbytes, nbytes, nbytes, nbytes, host, why))

    def layer(name, mlp=0, norm=0, attn=0, why=""):
        parts.append(Component(name, 0, int(mlp), int(norm), int(attn), 0, why))

    # weights
    if zero3:
        everywhere("weights (ZeRO-3 partition)", b * N // world, "each GPU keeps 1/world of the parameters")
        working = min(o.max_live_parameters, m.layer_params + min(o.prefetch_bucket_size, m.layer_params))
        parts.append(Component("weights gathered", loss=b * m.lm_head_params, mlp=b * working, norm=b * working,
                               attn=b * working, why="loss: the whole lm_head, gathered once for all chunks; "
                                                     "layers: the layer being computed plus the prefetch bucket"))
    else:
        everywhere("weights (not partitioned)", b * N, "every GPU holds all parameters")

    # optimizer states and gradients
    per_rank = N // world if zero3 else N
    fp32_grads = 4 * (min(per_rank, o.sub_group_size) if not o.offload_optimizer else per_rank)
    if o.include_optimizer:
        opt = 12 * per_rank
        if o.offload_optimizer:
            parts.append(Component("optimizer (fp32 master, Adam m, v)", host=opt,
                                   why="on the host (offload_optimizer)"))
        else:
            everywhere("optimizer (fp32 master, Adam m, v)", opt, "12 bytes per parameter, partitioned")

    # checkpointed activations: what each layer keeps between its forward and its backward
    kept_layers = round(o.keep_attention_fraction * L) if o.gradient_checkpointing else 0
    if o.gradient_checkpointing:
        per_layer = s * h * b
        stored = L * per_layer + kept_layers * s * (b * m.q_width + 4 * m.heads)
        ckpt_why = "one s x hidden layer input per layer"
        if kept_layers:
            ckpt_why += f", plus attention output + logsumexp of {kept_layers} kept layers"
    else:
        per_layer = s * (layer_saved_per_token(m, o) + mlp_saved_per_token(m, o))
        stored = L * per_layer
        ckpt_why = "no checkpointing: every layer keeps all its saved tensors"
    # offloaded: all layers' checkpoints on the host, the resident ones back on the GPU while recomputed
    # (the trainer keeps the last layer's on the GPU: it is one of the resident ones). A share below 1 keeps
    # the last layers' checkpoints on the GPU, in proportion (their kept attention outputs are spread evenly).
    offloaded = round(o.activation_offload_fraction * L) if o.offload_activations else 0
    resident = min(offloaded, o.offload_buffers) * per_layer if o.offload_activations else 0
    ckpt_host = stored * offloaded // L
    on_gpu = stored - ckpt_host
    if o.offload_activations:
        share = f" of {offloaded} layers" if offloaded < L else ""
        ckpt_why += f"; on the host{share}, {min(offloaded, o.offload_buffers)} on the GPU while recomputed/prefetched"

    if zero3:
        grad_gpu = b * per_rank + (fp32_grads if o.include_optimizer else 0)
        if o.offload_optimizer:
            parts.append(Component("gradients (bf16 + fp32 partitions)", host=grad_gpu,
                                   why="reduced gradient partitions on the host (pinned)"))
        else:
            everywhere("gradients (bf16 + fp32 partitions)", grad_gpu,
                       "partition of the reduced gradients, plus the optimizer's fp32 copy of one sub-group")
        everywhere("checkpointed activations", on_gpu + resident, ckpt_why, host=ckpt_host)
    else:
        # backward frees one layer's checkpoint as it creates that layer's gradients: the peak is at the
        # first recomputed layer (all checkpoints, one layer of gradients) or the last (one checkpoint, all
        # layer gradients), whichever is larger. The lm_head gradient exists from the loss's backward on.
        layer_grads, ckpt_each = b * m.layer_params, on_gpu // L
        first, last = L * ckpt_each + layer_grads, ckpt_each + L * layer_grads
        ckpt_layers, grads_layers = (L * ckpt_each, layer_grads) if first >= last else (ckpt_each, L * layer_grads)
        grads_layers += b * m.lm_head_params
        layer("gradients (not partitioned)", grads_layers, grads_layers, grads_layers,
              "full-size gradients, created layer by layer during backward")
        parts.append(Component("checkpointed activations", on_gpu + resident, ckpt_layers + resident,
                               ckpt_layers + resident, ckpt_layers + resident, ckpt_host,
                               ckpt_why + "; freed one per layer in backward"))

    # the loss: the final norm's output and saved tensors, then the logits
    final = s * (2 * b if o.low_memory_rmsnorm else 4 + 2 * b) * h
    if o.chunked_loss:
        rows = min(o.loss_chunk_rows, s)
        forward = 4 * V * h + rows * V * (2 * b + 4) + s * h * b
        backward = 8 * V * h + 2 * s * h * b + (0 if zero3 else b * V * h)
        parts.append(Component("loss (chunked, fused)", loss=final + max(forward, backward),
                               why="fp32 lm_head gradient accumulator (and its scaled copy in backward), one chunk "
                                   "of logits, the hidden-state gradient, the final norm's tensors"))
    else:
        parts.append(Component("loss (full logits)", loss=final + s * V * (2 * b + 8),
                               why="s x vocab logits, their fp32 log-softmax, its fp32 gradient and the cast "
                                   "gradient, plus the final norm's tensors"))

    # one layer's recompute and backward: the first recomputed layer, at its three moments
    incoming = s * h * b  # gradient arriving at the layer's output (the residual stream)
    post_norm = s * (2 * b if o.low_memory_rmsnorm else 4 + 2 * b) * h  # the post-attention norm's saved tensors, output
    if o.gradient_checkpointing:
        saved = s * layer_saved_per_token(m, o)
        layer("layer: recomputed saved tensors", saved, saved - s * b * h, saved - post_norm,
              "norms, q/k/v (after all-to-all), attention output, logsumexp; the MLP input is freed before "
              "the norm backward, the whole post-attention norm before the attention backward")
        mlp_saved = s * mlp_saved_per_token(m, o)
    else:
        mlp_saved = 0  # already in the activations every layer keeps
    layer("layer: incoming gradient", incoming, incoming, incoming)
    mlp_grads = b * 3 * h * m.intermediate if (zero3 and o.tiled_mlp) else 0
    layer("layer: MLP", mlp_saved + s * mlp_backward_extra_per_token(m, o) + mlp_grads,
          why=(f"TiledMLP, {mlp_shards(m, o)} shards" + (" (MLP weight gradients kept until the last shard)"
                                                          if mlp_grads else "")) if o.tiled_mlp
          else "4 saved s x intermediate tensors, net +2 in backward")
    layer("layer: RMSNorm backward", norm=s * norm_backward_extra_per_token(m, o) + norm_backward_chunk_bytes(o),
          why="input gradient and fp32 row-chunk temporaries (low-memory norm)" if o.low_memory_rmsnorm
          else "fp32 gradient chain of the post-attention norm (Hugging Face's module)")
    layer("layer: attention backward", attn=s * attention_backward_extra_per_token(m, o),
          why="dq, dk, dv, fp32 dq accumulator, GQA-expanded dk/dv, output gradient")

    # communication
    if zero3:
        everywhere("ZeRO reduce bucket", b * o.reduce_bucket_size, "contiguous gradient bucket, allocated at start")
    if o.sp > 1:
        layer("all-to-all buffers", attn=2 * s * b * m.q_width,
              why="send copy and receive buffer of one q-sized tensor")
    parts.append(Component("cuda context (outside allocator)", *(CUDA_CONTEXT_BYTES,) * 4,
                           why="context, NCCL, cuBLAS workspaces", outside_allocator=True))
    parts.append(Component("host process", host=HOST_PROCESS_BYTES, why="python, libraries, sample"))

    # FLOPs of one sequence (all of it, over its sp GPUs)
    T = o.padded_length
    attention_forward = 2 * T * T * m.q_width * L  # causal QK^T and PV over half the T x T scores
    model_flops = 6 * m.matmul_params * T + 3 * attention_forward
    recompute = 0.0
    if o.gradient_checkpointing:
        recompute += 2 * L * m.layer_params * T + attention_forward * (L - kept_layers) / L
    if o.tiled_mlp:
        recompute += 2 * 3 * h * m.intermediate * L * T  # TiledMLP's backward re-runs each shard's forward
    if m.kv_heads % o.sp and o.sp % m.kv_heads:
        notes.append(f"sp={o.sp} neither divides nor is a multiple of the {m.kv_heads} KV heads; "
                     f"Ulysses cannot split it.")
    if m.heads % o.sp:
        notes.append(f"sp={o.sp} does not divide the {m.heads} query heads; Ulysses cannot split it.")
    return MemoryPlan(m, o, parts, model_flops, recompute, notes)


# ---------------------------------------------------------------- layouts, fitting, max length


def valid_sp(m: ModelShape, o: PlanOptions) -> list[int]:
    """sp values Ulysses can run on this hardware: dividing the query heads, dividing or a multiple of the
    KV heads, dividing the world, and inside one node unless allowed across nodes."""
    out = []
    for sp in range(1, o.world + 1):
        if o.world % sp or m.heads % sp or (m.kv_heads % sp and sp % m.kv_heads):
            continue
        if not o.allow_sp_across_nodes and (sp > o.gpus_per_node or o.gpus_per_node % sp):
            continue
        out.append(sp)
    return out


def max_length(model, options: PlanOptions | None = None, **kwargs) -> int:
    """Longest sequence (a multiple of sp) whose plan fits; 0 if not even sp tokens fit.
    Memory grows with length, so a binary search over multiples of sp finds it."""
    m = load_model_shape(model)
    o = options or PlanOptions(seq_length=1, **kwargs)
    if options is not None and kwargs:
        o = o.replace(**kwargs)

    def fits(units: int) -> bool:
        return _plan(m, o.replace(seq_length=units * o.sp)).fits

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > 2 ** 34:
            break
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * o.sp


OFFLOAD_SHARES = (1.0, 0.75, 0.5, 0.25)
"""Shares of offloaded layers the planner tries when host memory is short (model.activation_offload_fraction)."""

LEVER_COST = {"chunked_loss": 0, "sp": 1, "offload_activations": 2, "tiled_mlp": 4, "offload_optimizer": 8}
"""How much turning a lever on costs, cheapest first: the chunked loss is free; more sp takes GPUs from data
parallelism; activation offload adds host-link traffic; TiledMLP runs the MLP forward once more; optimizer
offload moves the Adam step to the CPU. Powers of two, so any set of cheaper levers ranks before a more
expensive one. Turning an offload off (when host memory is short) costs nothing."""


def _lever_settings(m: ModelShape, o: PlanOptions) -> list[tuple[tuple, list[str], PlanOptions]]:
    """Every setting of the levers that could help, as (rank, changes described, options), cheapest first.
    Never proposes a smaller sp, full logits or switching TiledMLP off: they only add memory."""
    out = []
    for chunked in sorted({o.chunked_loss, True}):
        for sp in (v for v in valid_sp(m, o) if v >= o.sp):
            for acts, share in [(False, o.activation_offload_fraction)] + [
                    (True, v) for v in sorted({o.activation_offload_fraction, *OFFLOAD_SHARES}, reverse=True)]:
                for tiled in sorted({o.tiled_mlp, True}):
                    for opt in ((False, True) if o.include_optimizer else (o.offload_optimizer,)):
                        new = o.replace(chunked_loss=chunked, sp=sp, offload_activations=acts, tiled_mlp=tiled,
                                        offload_optimizer=opt, activation_offload_fraction=share)
                        changes, cost = [], 0
                        if chunked != o.chunked_loss:
                            changes.append("chunked loss (loss.type=chunked)")
                        if sp != o.sp:
                            changes.append(f"sp={sp} (parallel.sequence_parallel_size={sp})")
                            cost += LEVER_COST["sp"]
                        if acts != o.offload_activations:
                            changes.append("activation offload (activation_checkpointing.cpu_checkpointing=true)"
                                           if acts else "activations kept on the GPU (cpu_checkpointing=false)")
                            cost += LEVER_COST["offload_activations"] if acts else 0
                        if acts and share != o.activation_offload_fraction:
                            changes.append(f"offload {share:g} of the layers' activations "
                                           f"(model.activation_offload_fraction={share:g})")
                        if tiled != o.tiled_mlp:
                            changes.append("TiledMLP (model.tiled_mlp=true)")
                            cost += LEVER_COST["tiled_mlp"]
                        if opt != o.offload_optimizer:
                            changes.append("optimizer offload (zero_optimization.offload_optimizer.device=cpu)"
                                           if opt else "optimizer on the GPU (no offload_optimizer)")
                            cost += LEVER_COST["offload_optimizer"] if opt else 0
                        # among equals, the most offloaded: it leaves the GPU the most room
                        out.append(((cost, len(changes), sp, -share if acts else 0.0), changes, new))
    return sorted(out, key=lambda item: item[0])


def longest_fitting(model, options: PlanOptions) -> tuple[int, Optional[PlanOptions]]:
    """The longest sequence over every lever setting, with the options that reach it (the cheapest of
    equals). Offloading activations is not always longer: when host memory is the limit, keeping them on
    the GPUs reaches further."""
    m = load_model_shape(model)
    best, best_options = 0, None
    for _, _, o in _lever_settings(m, options):
        length = max_length(m, o)
        if length > best:
            best, best_options = length, o.replace(seq_length=length)
    return best, best_options


def suggest_fix(p: MemoryPlan) -> tuple[str, Optional[MemoryPlan]]:
    """The cheapest change that fits, as (description, its plan); ("", None) if nothing does.
    First the cheapest lever setting (LEVER_COST) that fits at this length; else a shorter sequence, with
    the lever setting that reaches the longest one."""
    m, o = p.model, p.options
    settings = _lever_settings(m, o)
    for _, changes, opts in settings:
        if changes:
            fixed = _plan(m, opts)
            if fixed.fits:
                return " + ".join(changes), fixed
    best, best_changes, best_options = 0, [], None
    for _, changes, opts in settings:
        length = max_length(m, opts)
        if length > best:
            best, best_changes, best_options = length, changes, opts
    if not best:
        return "", None
    text = f"a shorter sequence: data.seq_length={best:,} or less"
    return " + ".join(best_changes + [text]), _plan(m, best_options.replace(seq_length=best))


def check_fits(p: MemoryPlan) -> None:
    """None if the plan fits; otherwise PlanError naming what does not fit, by how much, and the cheapest
    change that fits (itself re-planned)."""
    if p.fits:
        return
    o = p.options
    problems = []
    if p.gpu_total > p.gpu_capacity:
        phase = p.peak_phase
        top = sorted(p.components, key=lambda c: c.at(phase), reverse=True)[:3]
        problems.append(f"GPU memory: {p.gpu_total / GIB:.1f} GiB per GPU needed (during {PHASE_NAMES[phase]}) but "
                        f"{o.gpu_memory_gib:g} GiB available: over by {(p.gpu_total - p.gpu_capacity) / GIB:.1f} GiB. "
                        f"Largest parts: " + ", ".join(f"{c.name} {c.at(phase) / GIB:.1f} GiB" for c in top) + ".")
    if p.host_per_node > p.host_capacity:
        top = [c for c in sorted(p.components, key=lambda c: c.host, reverse=True) if c.host][:3]
        problems.append(f"host memory: {p.host_per_node / GIB:.1f} GiB per node needed but {o.host_memory_gib:g} GiB "
                        f"available: over by {(p.host_per_node - p.host_capacity) / GIB:.1f} GiB. Largest parts "
                        f"(x{o.gpus_per_node} GPUs): " + ", ".join(f"{c.name} {c.host / GIB:.1f} GiB" for c in top)
                        + ".")
    fix, fixed = suggest_fix(p)
    advice = (f"Cheapest change that fits: {fix} -> {fixed.summary()}." if fixed is not None else
              "No change the planner knows of fits: use more or larger GPUs, or more host memory.")
    raise PlanError(f"{p.model.name} at {o.padded_length:,} tokens (sp={o.sp}, {o.world} GPUs) does not fit.\n"
                    + "\n".join(problems) + "\n" + advice)


# ---------------------------------------------------------------- a trainer run as plan options




def options_from_run(cfg, ds_config: dict, world_size: int, gpus_per_node: int, model=None,
                     **overrides) -> PlanOptions:
    """PlanOptions for a trainer run, from its `Config` (config.py) and final DeepSpeed dict; `overrides`
    (e.g. gpu_memory_gib, host_memory_gib from `detect_hardware()`) win. `model.tiled_mlp: auto` follows
    tiling.py's rule when `model` (anything load_model_shape takes) is given, else is planned untiled
    (the larger of the two)."""
    zero = ds_config.get("zero_optimization") or {}
    offload = (zero.get("offload_optimizer") or {}).get("device", "none")
    gpus_per_node = gpus_per_node or world_size
    sp = cfg.parallel.sequence_parallel_size
    mode = str(cfg.model.tiled_mlp).lower()
    tiled = mode == "true"
    if mode == "auto" and model is not None:
        from ulysses_train.model.tiling import AUTO_TOKENS_PER_HIDDEN

        tiled = -(-cfg.data.seq_length // sp) > AUTO_TOKENS_PER_HIDDEN * load_model_shape(model).hidden
    kwargs = dict(
        seq_length=cfg.data.seq_length, sp=sp, gpus_per_node=gpus_per_node,
        nodes=max(1, world_size // gpus_per_node), zero_stage=3, offload_optimizer=offload in ("cpu", "nvme"),
        offload_activations=bool((ds_config.get("activation_checkpointing") or {}).get("cpu_checkpointing", False)),
        chunked_loss=cfg.loss.type == "chunked", loss_chunk_rows=cfg.loss.chunk_rows, tiled_mlp=tiled,
        keep_attention_fraction=float(getattr(cfg.model, "keep_attention_fraction", 0.0) or 0.0),
        activation_offload_fraction=float(getattr(cfg.model, "activation_offload_fraction", 1.0)),
        low_memory_rmsnorm=bool(getattr(cfg.model, "low_memory_rmsnorm", True)),
        dtype_bytes=DTYPE_BYTES[cfg.model.dtype], gradient_checkpointing=cfg.model.gradient_checkpointing,
        allow_sp_across_nodes=cfg.parallel.allow_sp_across_nodes,
        reduce_bucket_size=int(float(zero.get("reduce_bucket_size", 5e8))),
        prefetch_bucket_size=int(float(zero.get("stage3_prefetch_bucket_size", 5e7))),
        max_live_parameters=int(float(zero.get("stage3_max_live_parameters", 1e9))),
        sub_group_size=int(float(zero.get("sub_group_size", 1e9))),
    )
    kwargs.update(overrides)
    return PlanOptions(**kwargs)


def plan_for_record(record: dict) -> MemoryPlan:
    """The plan of one measured point of benchmarks/planner_validation.jsonl: `model` plus any PlanOptions
    fields; other keys (measured_peak_gib, oom, source, ...) are ignored. Compare `gpu_allocated` with
    measured_peak_gib (both are what torch's allocator saw)."""
    names = {f.name for f in dataclasses.fields(PlanOptions)}
    model = load_model_shape(record["model"])
    if record.get("num_hidden_layers"):  # a reduced-depth measurement: same widths, fewer layers
        layers = record["num_hidden_layers"]
        model = dataclasses.replace(model, layers=layers,
                                    total_params=model.total_params - (model.layers - layers) * model.layer_params)
    return plan(model, options=PlanOptions(**{k: v for k, v in record.items() if k in names}))


def detect_hardware() -> dict:
    """{gpu_memory_gib, host_memory_gib} of this machine, for the keys it can read (none on a CPU-only
    machine without psutil)."""
    found = {}
    try:
        import torch

        if torch.cuda.is_available():
            found["gpu_memory_gib"] = torch.cuda.get_device_properties(0).total_memory / GIB
    except ImportError:
        pass
    try:
        import psutil

        found["host_memory_gib"] = psutil.virtual_memory().total / GIB
    except ImportError:
        pass
    return found


# ---------------------------------------------------------------- the seed's story


def story(model, options: PlanOptions) -> list[tuple[str, MemoryPlan]]:
    """The levers one at a time, each on top of the previous: full logits without offload, tiling or sp;
    then chunked loss; CPU offload (activations and optimizer); TiledMLP; sequence parallelism (the
    options' sp, or the largest valid one if that is 1)."""
    m = load_model_shape(model)
    sp = options.sp if options.sp > 1 else max(valid_sp(m, options))
    base = options.replace(sp=1, chunked_loss=False, offload_activations=False, offload_optimizer=False,
                           tiled_mlp=False)
    steps = [("naive (full logits, sp=1)", base)]
    steps.append(("+ chunked loss", steps[-1][1].replace(chunked_loss=True)))
    steps.append(("+ CPU offload (activations, optimizer)",
                  steps[-1][1].replace(offload_activations=True, offload_optimizer=options.include_optimizer)))
    steps.append(("+ TiledMLP", steps[-1][1].replace(tiled_mlp=True)))
    steps.append((f"+ sp={sp}", steps[-1][1].replace(sp=sp)))
    return [(label, _plan(m, o)) for label, o in steps]


def story_table(rows: list[tuple[str, MemoryPlan]]) -> str:
    first = rows[0][1]
    lines = [f"{first.model.name} at {first.options.seq_length:,} tokens, {first.options.world} GPUs "
             f"of {first.options.gpu_memory_gib:g} GiB, {first.options.host_memory_gib:g} GiB host",
             f"{'step':<40}{'GPU GiB':>10}{'host GiB/node':>15}{'step s':>9}  fits  peak during"]
    for label, p in rows:
        lines.append(f"{label:<40}{p.gpu_total / GIB:>10.1f}{p.host_per_node / GIB:>15.1f}{p.step_seconds:>9.1f}"
                     f"  {'yes ' if p.fits else 'NO  '}  {p.peak_phase}")
    return "\n".join(lines)
