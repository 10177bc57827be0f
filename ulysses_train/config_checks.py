"""The run configuration's checks that need nothing but the config itself (config.Config runs them on
construction): every field against its type, choices, ranges and the keys that only make sense together. Checks
that need the model's shape or the world size live in `parallel.validate_parallel_layout`, the data's in
`data.corpus.check_data_inputs`."""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, Union

from ulysses_train.constants import DTYPE_BYTES
from ulysses_train.data.form import DataForm
from ulysses_train.errors import ConfigError
from ulysses_train.lora_keys import lora_config
from ulysses_train.user_input import brief, one_line

LOSS_TYPES = ("chunked", "nll")
ATTN_IMPLEMENTATIONS = ("sdpa", "fa4", "flash_attention_2", "flash_attention_3", "flash_attention_4", "eager", "auto")
ROPE_SCALING_MODES = ("auto", "yarn", "none")
DTYPES = tuple(DTYPE_BYTES)
TILED_MLP_MODES = ("auto", "true", "false")
RMSNORM_KERNELS = ("torch", "chunked", "hf")
LORA_EXPORTS = ("adapter", "merged")


def _check_choice(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={brief(value)} is not valid; choose one of {', '.join(choices)}.")


def _check_indexer_loss(model_cfg) -> None:
    """model.indexer_loss_coef: a finite number >= 0, and not beside LoRA (whose adapters the loss does not reach)."""
    coef = model_cfg.indexer_loss_coef
    if not coef >= 0 or coef == float("inf"):
        raise ConfigError(f"model.indexer_loss_coef={brief(coef)} must be a finite number >= 0 (0: the indexer "
                          f"frozen, as transformers trains it).")
    if coef > 0 and model_cfg.lora:
        raise ConfigError("model.indexer_loss_coef > 0 with model.lora: the indexer loss trains the indexer's own "
                          "weights, which a LoRA run freezes. Fix: model.indexer_loss_coef 0, or a full fine-tune.")


def _check_positive(key: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{key}={brief(value)} must be a positive integer.")


_TYPE_WORDS = {bool: "true or false (unquoted in YAML)", int: "an integer", float: "a number",
               str: "text (quote it in YAML if it looks like a number or a boolean)",
               dict: "a mapping, e.g. {num_hidden_layers: 4}", list: "a list, e.g. [4096, 16384]"}


def _matches(value: Any, annotation) -> bool:
    """Does `value` (as YAML or the command line gave it) have the annotated type? bool is not an int here."""
    origin = typing.get_origin(annotation)
    if origin is Union:
        return any(_matches(value, arg) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    annotation = origin or annotation
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, annotation)


def _describe(annotation) -> str:
    if typing.get_origin(annotation) is Union:
        words = [_describe(arg) for arg in typing.get_args(annotation) if arg is not type(None)]
        if type(None) in typing.get_args(annotation):
            words.append("unset (null)")
        return " or ".join(words)
    annotation = typing.get_origin(annotation) or annotation
    return _TYPE_WORDS.get(annotation, annotation.__name__)


def check_field_types(cfg: "Config") -> None:
    """Every field of every section against its annotation: `export_hf: "false"` (a string, hence truthy)
    or `save_every: often` is an error that names the key, not a silent wrong value or a later traceback."""
    for section_field in dataclasses.fields(cfg):
        section = getattr(cfg, section_field.name)
        hints = typing.get_type_hints(type(section))
        for f in dataclasses.fields(section):
            value, annotation = getattr(section, f.name), hints[f.name]
            if not _matches(value, annotation):
                raise ConfigError(f"{section_field.name}.{f.name}={brief(value)} must be {_describe(annotation)}.")


def validate(cfg: "Config") -> None:
    """Checks that need nothing but the config itself."""
    check_field_types(cfg)
    _check_choice("loss.type", cfg.loss.type, LOSS_TYPES)
    _check_choice("model.attn_implementation", cfg.model.attn_implementation, ATTN_IMPLEMENTATIONS)
    _check_choice("model.rope_scaling", cfg.model.rope_scaling, ROPE_SCALING_MODES)
    _check_choice("model.dtype", cfg.model.dtype, DTYPES)
    _check_choice("model.tiled_mlp", str(cfg.model.tiled_mlp).lower(), TILED_MLP_MODES)
    _check_positive("loss.chunk_rows", cfg.loss.chunk_rows)
    if cfg.parallel.sequence_parallel_size != "auto":
        _check_positive("parallel.sequence_parallel_size", cfg.parallel.sequence_parallel_size)
    _check_positive("data.seq_length", cfg.data.seq_length)
    _check_positive("train.steps", cfg.train.steps)
    _check_positive("train.gradient_accumulation_steps", cfg.train.gradient_accumulation_steps)
    _check_positive("train.log_every", cfg.train.log_every)
    _check_positive("train.timeout_minutes", cfg.train.timeout_minutes)
    if cfg.train.keep_last < 0:
        raise ConfigError(f"train.keep_last={cfg.train.keep_last} must be >= 0 (0 keeps every checkpoint).")
    if cfg.train.save_every < 0:
        raise ConfigError(f"train.save_every={cfg.train.save_every} must be >= 0 (0 saves only at the end).")
    if cfg.train.eval_every < 0:  # types: check_field_types
        raise ConfigError(f"train.eval_every={cfg.train.eval_every!r} must be an integer >= 0 (0: no evaluation).")
    _check_positive("train.eval_sequences", cfg.train.eval_sequences)
    _check_positive("train.eval_bucket", cfg.train.eval_bucket)
    lengths = cfg.train.eval_lengths
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 2 for n in lengths):
        raise ConfigError(f"train.eval_lengths={brief(lengths)} must be a list of token counts >= 2, e.g. [4096, 16384] "
                          f"(empty: data.seq_length).")
    fraction = cfg.model.keep_attention_fraction
    if fraction != "auto" and (isinstance(fraction, str) or not 0.0 <= fraction <= 1.0):
        raise ConfigError(f"model.keep_attention_fraction={fraction!r} must be auto or a number from 0 to 1.")
    share = cfg.model.activation_offload_fraction
    if share != "auto" and (isinstance(share, str) or not 0.0 <= share <= 1.0):
        raise ConfigError(f"model.activation_offload_fraction={share!r} must be auto or a number from 0 to 1 (the "
                          f"share of layers whose checkpointed activations go to host memory when offload is on).")
    if fraction != "auto" and fraction > 0 and not cfg.model.gradient_checkpointing:
        raise ConfigError("model.keep_attention_fraction > 0 needs model.gradient_checkpointing: true "
                          "(without checkpointing nothing is recomputed); set it to 0 or turn checkpointing on.")
    _check_head_chunks(cfg.model)
    _check_choice("model.rmsnorm", cfg.model.rmsnorm, RMSNORM_KERNELS)
    _check_choice("model.lora_export", cfg.model.lora_export, LORA_EXPORTS)
    if cfg.model.lora:
        lora_config(cfg.model.lora)
    _check_indexer_loss(cfg.model)
    _check_data_form(cfg.data)
    if cfg.model.rope_factor is not None and cfg.model.rope_factor <= 1.0:
        raise ConfigError(f"model.rope_factor={cfg.model.rope_factor} must be > 1 (or unset to derive it).")
    if cfg.data.source != "demo" and not cfg.model.name_or_path:
        raise ConfigError("model.name_or_path is empty; set it to a hub name (e.g. Qwen/Qwen3-8B) or a local folder.")
    if not 0 <= cfg.train.seed < 2**32:
        raise ConfigError(f"train.seed={cfg.train.seed} must be from 0 to 2**32 - 1 (numpy's seed range).")
    _check_positive("data.num_samples", cfg.data.num_samples)
    _check_positive("data.num_proc", cfg.data.num_proc)
    for key in ("data.source", "data.text_field", "train.output_dir", "train.deepspeed_config"):
        section, name = key.split(".")
        if not getattr(getattr(cfg, section), name).strip():
            raise ConfigError(f"{key} is empty; give it a value (default: {_default(cfg, section, name)!r}).")
    if cfg.data.source == "demo":
        _check_demo_length(cfg.data.seq_length)


def _check_data_form(data: "DataConfig") -> None:
    """The data form's keys (each a known choice, loss on assistant turns only for chat data: DataForm's own
    checks, one rule for the config and prepare_data.py's flags), and what only a run config can get wrong."""
    DataForm.from_config(data)
    if data.source == "demo" and (data.format != "text" or data.packing != "glue"):
        raise ConfigError("data.source=demo generates its own sequences; data.format and data.packing apply to a "
                          "corpus. Set data.source to your data, or leave format: text and packing: glue.")
    if data.format == "chat" and not data.messages_field.strip():
        raise ConfigError("data.messages_field is empty; give the column that holds each session's messages "
                          "(default: 'messages').")


def _default(cfg, section: str, name: str):
    factory = {f.name: f.default_factory for f in dataclasses.fields(cfg)}[section]
    return getattr(factory(), name)


def _check_demo_length(seq_length: int) -> None:
    """The demo task's own limit (demo.RetrievalTask), as a ConfigError naming the key and the shortest length."""
    from ulysses_train.data.demo import RetrievalTask

    try:
        RetrievalTask(seq_length=seq_length)
    except ValueError as err:
        shortest = next(n for n in range(seq_length + 1, 1 << 16) if _demo_fits(RetrievalTask, n))
        raise ConfigError(f"data.seq_length={seq_length} is too short for the demo task ({one_line(err)}). "
                          f"Fix: data.seq_length >= {shortest}.") from None


def _demo_fits(task_cls, seq_length: int) -> bool:
    try:
        task_cls(seq_length=seq_length)
        return True
    except ValueError:
        return False


def _check_head_chunks(model_cfg) -> None:
    """model.attention_head_chunks: auto or a whole number >= 1; chunks with kept attention are refused (a kept
    layer's recompute takes the kernel's saved outputs, which a chunked layer does not make)."""
    chunks = model_cfg.attention_head_chunks
    if chunks == "auto":
        return
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ConfigError(f"model.attention_head_chunks={chunks!r} must be auto or a whole number >= 1 (1: all of "
                          f"a rank's heads at once).")
    keep = model_cfg.keep_attention_fraction
    if chunks > 1 and keep != "auto" and keep > 0:
        raise ConfigError(f"model.attention_head_chunks={chunks} with model.keep_attention_fraction={keep}: a layer "
                          f"either keeps its attention or runs it in head chunks; set one of them to 0 (or 1 chunk).")
