"""One typed run configuration, loaded from YAML and overridable from the command line.

Precedence is command line (`--set section.key=value`) > YAML file > dataclass defaults.
Validation (config_checks.py) happens on construction, up front and without side effects (no process groups, no
hub access): a bad key or value raises `ConfigError` naming the key, what was given and what is allowed.
Checks that need the model's shape or the world size live in `parallel.validate_parallel_layout`.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import Optional, Union

from ulysses_train.config_checks import (ATTN_IMPLEMENTATIONS, DTYPES, LORA_EXPORTS,  # noqa: F401 (re-exported)
                                         LOSS_TYPES, RMSNORM_KERNELS, ROPE_SCALING_MODES, TILED_MLP_MODES,
                                         validate)
from ulysses_train.constants import LOSS_CHUNK_ROWS
from ulysses_train.data.form import (DATA_FORMATS, LOSS_ON, PACKING_MODES, TOO_LONG_RULES,  # noqa: F401 (re-exported)
                                     resolved_loss_on)
from ulysses_train.probe_config import ProbeEvalConfig
from ulysses_train.errors import ConfigError  # defined in errors.py; other modules import it from here too
from ulysses_train.user_input import apply_overrides, brief, deep_update, read_yaml


@dataclass
class ModelConfig:
    name_or_path: str = ""
    """Hub name (e.g. Qwen/Qwen3-8B) or local folder with config.json (and weights unless random_init)."""
    random_init: bool = False
    """Build the model from its config with random weights instead of loading weights."""
    allow_untested_family: bool = False
    """Train a model type that has no family record (ulysses_train/families.py: never checked to train exactly under sp),
    with a warning, instead of refusing it."""
    config_overrides: dict = field(default_factory=dict)
    """Keys set on the model's config before building it, e.g. {num_hidden_layers: 4}."""
    attn_implementation: str = "auto"
    """fa4 | sdpa | flash_attention_2 | flash_attention_3 | auto (fa4 on a Hopper-or-newer GPU with flash-attn-4
    installed, else sdpa)."""
    dtype: str = "bfloat16"
    """Parameter dtype on the device: bfloat16 | float16 | float32."""
    gradient_checkpointing: bool = True
    """Recompute each decoder layer in backward; keeps one seq x hidden tensor per layer."""
    rope_scaling: str = "auto"
    """auto (YaRN when data.seq_length exceeds the trained length) | yarn | none."""
    rope_factor: Optional[float] = None
    """Explicit YaRN factor; default target length / original length."""
    tiled_mlp: Union[str, bool] = "auto"
    """auto | true | false: run each MLP over sequence tiles so its intermediates stay small (YAML's bare
    true/false are accepted too). auto: the planner's choice on GPUs (planner/levers.py); without a GPU,
    tiled above 4 x hidden_size local tokens (model/tiling.py)."""
    keep_attention_fraction: Union[float, str] = "auto"
    """Share (0..1) of decoder layers whose attention output is kept from forward to backward instead of
    recomputed (needs gradient_checkpointing); each kept layer holds about seq x heads x head_dim more values,
    in host memory when activation_checkpointing.cpu_checkpointing is on. auto: the planner's choice on GPUs
    (the fastest setting that fits, planner/levers.py); 0 without a GPU."""
    attention_head_chunks: Union[int, str] = "auto"
    """Run each attention layer's all-to-all and kernel over this many chunks of the heads a rank runs, one chunk
    at a time (model/mixers/head_chunks.py): the attention backward's whole-sequence buffers shrink by this factor,
    for one more attention forward per layer. Must divide the query heads each rank runs. auto: the planner's
    choice on GPUs (1 unless a longer sequence needs it); 1 without a GPU."""
    activation_offload_fraction: Union[float, str] = "auto"
    """With activation offload on (activation_checkpointing.cpu_checkpointing in the DeepSpeed JSON): the share
    (0..1) of decoder layers, the first ones, whose checkpointed activations go to host memory; the others stay
    on the GPU. Lower it when host memory, not GPU memory, limits the length (scripts/plan.py shows both).
    auto: the planner's choice on GPUs; 1 without a GPU."""
    indexer_loss_coef: float = 0.0
    """Models with indexed attention (DeepSeek-V3.2, GLM-5, Hy4, dots3): > 0 trains each layer's indexer toward its
    attention by DeepSeek-V3.2's KL loss over the chosen keys, this times the per-layer mean over tokens added to the
    loss (model/indexer_loss.py); only the indexer learns from it. 0: the indexer frozen, as transformers trains
    it."""
    lora: dict = field(default_factory=dict)
    """LoRA through PEFT: {r, lora_alpha, lora_dropout, target_modules, ...} (any field of PEFT's LoraConfig; alpha
    and dropout are read as lora_alpha and lora_dropout; defaults r 16, alpha 32, dropout 0, every attention and
    MLP projection). Only the adapters train and are checkpointed. Empty: a full fine-tune."""
    lora_export: str = "adapter"
    """With model.lora: what hf_model/ holds: `adapter` (PEFT's adapter folder; load with PeftModel.from_pretrained
    on the base model) or `merged` (a plain model, adapters merged into the weights)."""
    rmsnorm: str = "torch"
    """The RMSNorm kernel of every Llama-style norm: `torch` (torch.nn.functional.rms_norm: on CUDA one fused
    kernel each way, the fastest, see benchmarks/RESULTS.md; the weight is applied before the single cast to
    the model dtype, so outputs differ from Hugging Face's by bf16 rounding), `chunked` (rmsnorm.py: outputs
    bit-equal to Hugging Face's, ~7 elementwise kernels each way) or `hf` (Hugging Face's own, whose backward
    holds several fp32 copies of the sequence). Both replacements hold less memory than `hf`. Replaces the
    keys low_memory_rmsnorm and rmsnorm_kernel, still read with a deprecation message."""


@dataclass
class ParallelConfig:
    sequence_parallel_size: Union[int, str] = 1
    """GPUs that share one sequence (Ulysses sp); data-parallel size is world_size / sp. `auto`: the largest sp
    that divides the number of processes, stays inside a node and splits the model's heads (the demo's
    setting, so it runs on any number of processes)."""
    allow_sp_across_nodes: bool = False
    """Allow an sp group to span nodes (slower all-to-all over the network)."""


@dataclass
class LossConfig:
    type: str = "chunked"
    """chunked (never builds seq x vocab logits) | nll (plain full-logits cross-entropy, for comparison)."""
    chunk_rows: int = LOSS_CHUNK_ROWS
    """Rows of hidden states per cross-entropy chunk (constants.LOSS_CHUNK_ROWS says why this many)."""


@dataclass
class DataConfig:
    source: str = "demo"
    """demo (generated key-value retrieval task) | folder of .txt | .jsonl/.parquet file | saved dataset | hub name."""
    tokenizer: str = ""
    """Tokenizer name or path; default model.name_or_path. Unused by the demo task."""
    text_field: str = "text"
    """format text: the column holding each document's text (JSON, Parquet, saved, hub)."""
    format: str = "text"
    """text (one document per row or .txt file) | chat (rows hold a list of {role, content} messages, rendered
    with the tokenizer's chat template; docs/data.md, "Training on chat sessions")."""
    messages_field: str = "messages"
    """format chat: the column holding each session's messages."""
    loss_on: str = "auto"
    """auto (assistant for chat, all for text) | assistant (labels only on the assistant turns' tokens) | all."""
    packing: str = "glue"
    """glue (documents end to end, each followed by EOS, every token attends to all earlier ones) | documents
    (whole documents share a sequence without attending to each other: positions restart per document and
    attention is variable-length; needs model.attn_implementation fa4 or flash_attention_2)."""
    too_long: str = "split"
    """packing documents: a document longer than seq_length is split into pieces of seq_length (each its own
    document) | truncate (keep its first seq_length tokens) | drop. Counted in the summary."""
    seq_length: int = 4096
    """Tokens per training sequence. A corpus is packed to exactly this length, which must then be a multiple
    of parallel.sequence_parallel_size (every sp rank holds an equal slice; data.check_data_inputs and the
    packing refuse others, naming the nearest valid lengths); the demo pads to one."""
    num_samples: int = 64
    """Demo only: number of generated sequences."""
    drop_last: bool = False
    """packing glue: drop the last partial sequence instead of padding it."""
    cache_dir: str = ""
    """Where tokenized and packed sequences are cached; default ~/.cache/ulysses_train/data, shared with
    scripts/prepare_data.py."""
    num_proc: int = 2


@dataclass
class TrainConfig:
    deepspeed_config: str = "ds_configs/zero3.json"
    """DeepSpeed JSON (optimizer, scheduler, ZeRO, activation checkpointing); relative to the repo or cwd."""
    steps: int = 10
    """Optimizer steps."""
    gradient_accumulation_steps: int = 1
    """Sequences per data-parallel group per optimizer step."""
    seed: int = 0
    output_dir: str = "outputs/run"
    log_every: int = 1
    save_every: int = 0
    """Save a checkpoint every K steps (0: only at the end)."""
    keep_last: int = 2
    """Complete checkpoints kept; older ones are deleted after each save (0: keep every one). Damaged folders set
    aside as damaged_step_* are never deleted."""
    export_hf: bool = True
    """Write a consolidated Hugging Face model to <output_dir>/hf_model at the end."""
    resume_data_change: bool = False
    """--resume refuses a folder whose checkpoints were trained on other data (form, tokenizer, chat template,
    corpus content: training/run_identity.py); true continues on the new data."""
    timeout_minutes: int = 120
    """Process-group timeout: long enough for a 1M-token step plus its checkpoint."""
    eval_every: int = 0
    """Evaluate the loss by position every K steps (0: never); writes <output_dir>/eval/ (JSON, CSV, PNG)."""
    eval_lengths: list = field(default_factory=list)
    """Lengths to evaluate at (default: [data.seq_length]); longer ones show positions past the training length."""
    eval_sequences: int = 4
    """Sequences per evaluated length (a corpus: its packed sequences; demo: needle probes, one answer each)."""
    eval_bucket: int = 1024
    """Tokens per position bucket in the evaluation."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: ProbeEvalConfig = field(default_factory=ProbeEvalConfig)  # retrieval probes (probe_config.py)

    def __post_init__(self):
        validate(self)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- loading


def _section_from_dict(section_cls, data: dict, prefix: str):
    if not isinstance(data, dict):
        note = " (an empty section in YAML is null: give it keys or remove it)" if data is None else ""
        raise ConfigError(f"section '{prefix}' must be a mapping of its keys, got {type(data).__name__}{note}.")
    data = _translate_deprecated(prefix, data)
    known = {f.name for f in dataclasses.fields(section_cls)}
    unknown = sorted(str(key) for key in set(data) - known)
    if unknown:
        raise ConfigError(
            f"unknown key {prefix}.{unknown[0]}; valid keys of '{prefix}': {', '.join(sorted(known))}."
        )
    return section_cls(**data)


def _old_rmsnorm_keys(data: dict) -> dict:
    """model.low_memory_rmsnorm (bool) + model.rmsnorm_kernel (torch | chunked) -> model.rmsnorm."""
    data = dict(data)
    low_memory, kernel = data.pop("low_memory_rmsnorm", True), data.pop("rmsnorm_kernel", "torch")
    if "rmsnorm" in data:
        raise ConfigError("model.rmsnorm replaces model.low_memory_rmsnorm and model.rmsnorm_kernel; give only "
                          "model.rmsnorm.")
    if not isinstance(low_memory, bool):
        raise ConfigError(f"model.low_memory_rmsnorm={brief(low_memory)} must be true or false (better: model.rmsnorm).")
    data["rmsnorm"] = kernel if low_memory else "hf"
    return data


# old key -> (its section, the function that rewrites the section's dict into the new keys)
DEPRECATED_KEYS = {("model", "low_memory_rmsnorm"): _old_rmsnorm_keys, ("model", "rmsnorm_kernel"): _old_rmsnorm_keys}


def _translate_deprecated(prefix: str, data: dict) -> dict:
    for (section, key), translate in DEPRECATED_KEYS.items():
        if section == prefix and key in data:
            data = translate(data)
            print(f"warning: {section}.{key} is deprecated; this run uses {section}.rmsnorm={data['rmsnorm']!r}.",
                  file=sys.stderr, flush=True)
    return data


def config_from_dict(data: dict) -> Config:
    """Strict: unknown sections or keys are errors that list the valid ones."""
    data = data or {}
    if not isinstance(data, dict):
        raise ConfigError(f"the config must be a mapping of sections ({', '.join(f.name for f in dataclasses.fields(Config))}),"
                          f" got {type(data).__name__} {brief(data, 60)}.")
    sections = {f.name: f.type for f in dataclasses.fields(Config)}
    unknown = sorted(str(key) for key in set(data) - set(sections))
    if unknown:
        raise ConfigError(f"unknown section '{unknown[0]}'; valid sections: {', '.join(sections)}.")
    kwargs = {}
    for f in dataclasses.fields(Config):
        cls = f.default_factory().__class__
        kwargs[f.name] = _section_from_dict(cls, data.get(f.name, {}), f.name)
    return Config(**kwargs)


def load_config(path: Optional[str] = None, overrides: Optional[list[str]] = None,
                defaults: Optional[dict] = None) -> Config:
    """defaults (a dict in config shape) < YAML file < overrides."""
    data: dict = {}
    for source in (defaults or {}, _beside_file(read_yaml(path), path) if path else {}):
        deep_update(data, source)
    apply_overrides(data, overrides or [])
    return config_from_dict(data)


def _beside_file(data: dict, path: str) -> dict:
    """A config file's train.deepspeed_config that names a file next to the config (and none in the current
    folder) means that file: a run folder holding run.yaml and ds.json works from anywhere. Otherwise the path
    stays as written (the current folder, then the repository: training.ds_config.resolve_path)."""
    train = data.get("train")
    name = train.get("deepspeed_config") if isinstance(train, dict) else None
    if isinstance(name, str) and name.strip() and not os.path.isabs(name) and not os.path.exists(name):
        beside = os.path.join(os.path.dirname(os.path.abspath(path)), name)
        if os.path.isfile(beside):
            data["train"] = {**train, "deepspeed_config": beside}
    return data
