"""What the planner is asked about: `PlanOptions` (every setting of a run that changes its memory or time, except
the model) and `PlanError`, the planner's one error type."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from ulysses_train.constants import DTYPE_BYTES, LOSS_CHUNK_ROWS
from ulysses_train.errors import UserError


class PlanError(UserError, RuntimeError):
    """The plan does not fit the hardware; the message says what, by how much, and what would fit."""


OPTIMIZERS = {
    "gpu": {"offload_optimizer": False, "optimizer_state_bytes": 12},
    "cpu": {"offload_optimizer": True, "optimizer_state_bytes": 12},
    "none": {"offload_optimizer": False, "optimizer_state_bytes": 4},
}
"""`--optimizer` of scripts/bench.py and scripts/plan.py as PlanOptions fields, one meaning for both. gpu, cpu:
AdamW under ZeRO-3, its fp32 master and two moments (12 bytes per trained parameter) on the GPU or on the host
(offload_optimizer); none: no update (SGD at lr 0, a forward and backward), for which ZeRO-3 still keeps the
fp32 master weights (4 bytes) and its fp32 gradient buffer."""

STATE_BYTES_BY_OPTIMIZER = {"adam": 12, "adamw": 12, "fusedadam": 12, "cpuadam": 12, "lamb": 12, "onebitadam": 12,
                            "zerooneadam": 12, "onebitlamb": 12, "muadam": 12, "muadamw": 12, "adagrad": 8,
                            "lion": 8, "musgd": 8}
"""Bytes per trained parameter a DeepSpeed JSON optimizer keeps under ZeRO-3: the fp32 master (4) and its states
(Adam-like: two fp32 moments; Adagrad, Lion: one). SGD: the master, plus one buffer with momentum."""


def deepspeed_optimizer_state_bytes(ds_config: dict) -> int:
    """STATE_BYTES_BY_OPTIMIZER for the DeepSpeed dict's `optimizer` section; an unknown type (or none, which
    DeepSpeed would refuse without a client optimizer) is planned as Adam, the larger."""
    section = ds_config.get("optimizer") or {}
    kind = str(section.get("type", "adamw")).lower()
    if kind == "sgd":
        return 8 if float((section.get("params") or {}).get("momentum", 0) or 0) else 4
    return STATE_BYTES_BY_OPTIMIZER.get(kind, 12)


def deepspeed_torch_adam(ds_config: dict) -> bool:
    """PlanOptions.torch_adam for the DeepSpeed dict: its optimizer's `torch_adam` parameter (DeepSpeed's default,
    false, takes its cpu_adam op when the optimizer is offloaded)."""
    return bool(((ds_config.get("optimizer") or {}).get("params") or {}).get("torch_adam", False))


SP_REDUCE_DTYPE_KEY = "seq_parallel_communication_data_type"
"""The DeepSpeed JSON key of the gradient reduce's dtype in an sp run: it replaces `communication_data_type` when
sp > 1, and DeepSpeed 0.19 defaults it to "fp32" (runtime/constants.py); `null` means the training dtype."""

DEEPSPEED_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def deepspeed_sp_reduce_cast_bytes(ds_config: dict, model_dtype: str) -> int:
    """Bytes per element of the copy ZeRO-3 makes of each gradient before an sp run's reduce
    (stage3.py `__avg_scatter_grads` casts when the reduce dtype is not the training dtype): 4 for DeepSpeed's
    fp32 default, 0 when the JSON sets the training dtype (or null). An unknown name is planned as fp32 (DeepSpeed
    itself refuses it)."""
    value = ds_config.get(SP_REDUCE_DTYPE_KEY, "fp32")
    if value is None:
        return 0
    name = DEEPSPEED_DTYPES.get(str(value).lower(), "float32")
    return 0 if name == model_dtype else DTYPE_BYTES[name]


@dataclass(frozen=True)
class PlanOptions:
    """Everything about a run that changes its memory or time, except the model."""

    seq_length: int
    """Tokens of one sequence (padded to a multiple of sp before it is split)."""
    sp: int = 1
    """Ulysses sequence-parallel degree: the GPUs that share one sequence."""
    gpus_per_node: int = 8
    nodes: int = 1
    offload_optimizer: bool = False
    """fp32 master weights, Adam moments and fp32 gradient partitions on the host (DeepSpeed offload_optimizer)."""
    offload_activations: bool = False
    """Checkpointed layer inputs on the host between forward and backward."""
    activation_offload_fraction: float = 1.0
    """Share of the layers whose checkpoints are offloaded (model.activation_offload_fraction); the rest stay.
    Counted as the trainer counts (model/recompute.py offloaded_layer_count): never the last layer."""
    offload_buffers: int = 2
    """Checkpoints resident on the GPU when offloading: the layer being recomputed and the next one,
    prefetched. 1 for a plain save_on_cpu (no prefetch)."""
    chunked_loss: bool = True
    loss_chunk_rows: int = LOSS_CHUNK_ROWS
    tiled_mlp: bool = False
    mlp_tiles: Optional[int] = None
    """TiledMLP tile count; default the trainer's (model/tiling.py mlp_tile_count: ceil(s / hidden))."""
    keep_attention_fraction: float = 0.0
    """Fraction of layers whose attention output (and logsumexp) is kept, so backward skips its recompute;
    the layers are the trainer's (model/recompute.py kept_attention_layers: halves round up)."""
    attention_head_chunks: int = 1
    """Chunks of a rank's heads whose all-to-all and attention kernel run one at a time
    (model.attention_head_chunks: model/mixers/head_chunks.py): attention's whole-sequence backward buffers and
    exchange divided by it, one more attention forward per layer."""
    low_memory_rmsnorm: bool = True
    """rmsnorm.py's RMSNorm (model.low_memory_rmsnorm, the trainer's default): saves the bf16 input and one
    fp32 scale per row instead of fp32 copies; False for Hugging Face's module (the plain Hugging Face baseline)."""
    offset_norm_kernel: bool = False
    """The `1 + w` norms (ModelShape.offset_norms) as Liger's kernel, which saves what the low-memory norm saves
    (what a GPU run with liger-kernel runs: model/rmsnorm.py); False: Hugging Face's fp32 modules."""
    swiglu_kernel: bool = False
    """Dense SwiGLU MLPs as Liger's SiLU-and-multiply kernel, which saves one s x intermediate tensor fewer and
    makes one fewer in backward (what a GPU run with liger-kernel runs: model/swiglu.py); False: Hugging Face's."""
    fused_gated_norm: bool = True
    """A Gated DeltaNet layer's gated RMSNorm as fla's fused kernel (what a GPU run with fla runs:
    model/mixers/gated_deltanet_kernels.py); False for transformers' fp32 module (planner/linear_layer.py)."""
    mixer_kernels: dict = dataclasses.field(default_factory=dict)
    """{mixer name: kernel variant} as the run chose them (mixers.choose_mixer_kernels; each mixer's variants:
    Mixer.kernel_variants). The terms that differ by kernel read `kernel(mixer)`: a Gated DeltaNet's "flash_qla"
    (FlashQLA's fused backward holds less than fla's Triton one: planner/linear_layer.py), Mamba2's "chunk_gla"
    (per-channel fp32 decays and intra-chunk scores, where fla refuses chunk_simple_gla's backward:
    planner/mamba2_layer.py). A mixer left out is planned as its default kernels."""
    dtype_bytes: int = 2
    attention_kernel: str = "sdpa"
    """The model's attention (model.attn_implementation as resolved): "fa4" plans FlashAttention 4's backward
    buffers; any other is planned as SDPA's (measured), the larger of the two under GQA."""
    gradient_checkpointing: bool = True
    adapter_params: int = 0
    """LoRA adapter parameters (model.lora; lora.lora_parameter_count). When > 0 only they train: the gradients,
    fp32 masters and optimizer states are theirs, the base weights are frozen (and the adapters add their own
    weights). 0: a full fine-tune. The time model still counts the full backward."""
    lora_merged_params: tuple = ()
    """(elements, the largest) of the fused expert tensors one layer's LoRA adapts through PEFT's parametrization,
    which builds W + B @ A whole on every forward (lora.lora_plan_fields; leaf_blocks.merged_adapter_weights); ()
    where no fused tensor is adapted."""
    include_optimizer: bool = True
    """False: no optimizer states, no fp32 gradient buffer (a forward+backward only, as in the plain Hugging Face
    baseline)."""
    optimizer_state_bytes: int = 12
    """Bytes per trained parameter the ZeRO-3 optimizer keeps: the fp32 master (4) and Adam's m and v (8). 4 for
    an optimizer without states (OPTIMIZERS["none"]: SGD at lr 0, whose fp32 master DeepSpeed still keeps)."""
    torch_adam: bool = True
    """The DeepSpeed JSON's optimizer runs as torch's (`"torch_adam": true`, as in ds_configs/; deepspeed_torch_adam).
    With the optimizer on the host its step holds two fp32 temporaries of a sub-group (estimate.optimizer_states);
    DeepSpeed's own cpu_adam op updates in place."""
    zero_stage: int = 3
    """3 (the trainer) or 0 (plain PyTorch, nothing partitioned: the plain Hugging Face baseline,
    benchmarks/results/plain_hf_baseline_h200.jsonl)."""
    sp_reduce_cast_bytes: int = 4
    """Bytes per element of the copy of each gradient ZeRO-3 casts before reducing it in an sp run
    (deepspeed_sp_reduce_cast_bytes): 4 under DeepSpeed's fp32 default, 0 where the reduce runs in the training
    dtype. Planned where one gradient is large: a fused expert tensor (leaf_blocks.expert_reduce_copy)."""
    reduce_bucket_size: int = 500_000_000
    """ZeRO-3 reduce_bucket_size (elements): a contiguous gradient bucket allocated on every GPU."""
    prefetch_bucket_size: int = 50_000_000
    """ZeRO-3 stage3_prefetch_bucket_size (elements) of parameters gathered ahead of use (ds_configs/zero3.json)."""
    max_live_parameters: int = 1_000_000_000
    """ZeRO-3 stage3_max_live_parameters: a cap on gathered parameters."""
    sub_group_size: int = 1_000_000_000
    """ZeRO-3 sub_group_size: the optimizer's fp32 gradient buffer holds one sub-group."""
    allow_sp_across_nodes: bool = False
    """sp groups may span nodes (parallel.allow_sp_across_nodes); otherwise an sp group stays inside one node."""
    gpu_memory_gib: float = 141.0
    host_memory_gib: float = 560.0
    tflops: float = 400.0
    """Effective TFLOP/s of one GPU, counting recompute: the rate a whole step reaches on the card,
    above the model-FLOPs rate that benchmarks/RESULTS.md reports."""
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
        if self.attention_head_chunks < 1:
            raise PlanError(f"attention_head_chunks={self.attention_head_chunks} must be >= 1.")
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

    def kernel(self, mixer: str) -> str:
        """The kernel variant planned for a mixer ("" when mixer_kernels does not name it)."""
        return self.mixer_kernels.get(mixer, "")


LEGACY_KERNEL_FLAGS = {"flash_qla": ("gated_deltanet", "flash_qla"), "mamba2_channel_decay": ("mamba2", "chunk_gla")}
"""PlanOptions fields of one kernel each, as measured records written before mixer_kernels name them
(benchmarks/planner_validation.jsonl, a bench row's `plan_kernels`) -> (mixer, the variant a true value meant)."""


def kernel_fields(record: dict) -> dict:
    """A record's PlanOptions fields with LEGACY_KERNEL_FLAGS turned into mixer_kernels (a false flag: the mixer's
    default kernels, left out)."""
    fields = {k: v for k, v in record.items() if k not in LEGACY_KERNEL_FLAGS}
    legacy = {mixer: variant for flag, (mixer, variant) in LEGACY_KERNEL_FLAGS.items() if record.get(flag)}
    if legacy:
        fields["mixer_kernels"] = {**legacy, **record.get("mixer_kernels", {})}
    return fields
