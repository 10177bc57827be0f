"""Load a Hugging Face causal LM for long-context training, and the wrapper DeepSpeed trains.

Loading: read the model's config (hub name, local folder, or a config object) and apply overrides; refuse
architectures we cannot train correctly (chunked or linear attention, attention soft-capping, unknown logit
post-processing, custom code); build it
with an `HfDeepSpeedConfig` alive, so `from_pretrained` / `from_config` build under `zero.Init` and each rank
only ever materialises its own ZeRO-3 partition. What is changed in the built model, and in which order, is
`transform.py`'s.

`LongContextCausalLM` runs the decoder to its last hidden state and hands it to the chunked loss, which the
`lm_head` (as `ChunkedLossHead`) computes (model/loss.py). It returns (nll_sum, valid_label_count) for this
rank's slice; the trainer turns those into the exact global mean.
"""
from __future__ import annotations

import importlib.util
import logging
import os
from typing import Optional

import torch

from ulysses_train.config import ConfigError, ModelConfig
from ulysses_train.constants import IGNORE_INDEX, LOSS_CHUNK_ROWS
from ulysses_train.device import cuda_training
from ulysses_train.kernel_pins import FA4_INSTALL_LINE, INSTALL_LINE
from ulysses_train.families import check_family
from ulysses_train.model import config_fields
from ulysses_train.model.image_text import checkpoint_key_mapping, text_model_config
from ulysses_train.model.architecture import SUPPORTED_EXAMPLES, decoder_of, logit_transform, text_config
from ulysses_train.model.mixers import check_layer_types, check_raw_layer_types, untested_layers_note
from ulysses_train.model.mixers.indexed_attention import kernel_name_for_build, pooled_tail_problem
from ulysses_train.model.router_balance import check_router_balance
from ulysses_train.model.swap import swap_class
from ulysses_train.model.weight_check import (check_loaded_weights, quiet_load_report, refuse_mismatched_shapes,
                                              refuse_unequal_fused_parts)
from ulysses_train.model.loss import chunked_nll_sum, full_logits_nll_sum, transform_logits
from ulysses_train.sequence_parallel import SequenceParallel
from ulysses_train.user_input import missing_local_path, one_line, partial_local_path_note

logger = logging.getLogger(__name__)



def resolve_attn_implementation(name: str) -> str:
    """The attention the model is built with; registers 'fa4' with transformers when it is chosen.

    `auto`: FlashAttention 4 ('fa4', fa4.py) on a Hopper-or-newer GPU when the flash-attn-4 package is
    installed, else SDPA, which reaches cuDNN's kernel where the card has it (attention.py). FlashAttention
    2 is never picked by `auto`: on an H200 its kernel is far slower than cuDNN's through SDPA
    (benchmarks/RESULTS.md, "Attention kernels on the H200").
    `flash_attention_4` means 'fa4' (transformers' own FA4 path is an autograd.Function that kept
    attention cannot see).
    """
    from ulysses_train.model.fa4 import fa4_importable, register_fa4_attention

    name = chosen_attn_implementation(name)
    if name == "fa4":
        if cuda_training() and not fa4_importable():
            raise ConfigError("model.attn_implementation='fa4' needs FlashAttention 4 (module flash_attn.cute); "
                              f"install it ({INSTALL_LINE}, or {FA4_INSTALL_LINE}) or use 'sdpa'.")
        if not cuda_training():
            logger.warning("model.attn_implementation='fa4' without a GPU runs its fp32 reference kernel "
                           "(slow, O(tokens^2) memory); on CPU 'sdpa' is faster for a model without sliding windows "
                           "and without data.packing: documents, which need fa4's kernel.")
        register_fa4_attention()
    if name == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise ConfigError("model.attn_implementation='flash_attention_2' but the flash_attn package is not "
                          "installed; install it (pip install flash-attn) or use 'sdpa'.")
    return name


def chosen_attn_implementation(name: str) -> str:
    """What `name` (model.attn_implementation) means on this machine, without registering or checking
    anything: `auto` is 'fa4' where FlashAttention 4 runs here, else 'sdpa'. The planner plans that kernel."""
    from ulysses_train.model.fa4 import fa4_supported_here

    if name == "flash_attention_4":
        return "fa4"
    if name == "auto":
        return "fa4" if fa4_supported_here() else "sdpa"
    return name


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


MODEL_FOLDER_FIX = "point it to a Hugging Face model folder (config.json and weights) or a hub name such as Qwen/Qwen3-8B"


def read_hf_config(name_or_path: str, key: str = "model.name_or_path", need_weights: bool = False,
                   fix: str = MODEL_FOLDER_FIX):
    """The transformers config of a hub name or local folder, read without ever running a model's custom code.

    Each way this goes wrong is a ConfigError naming `key` and `fix`: a local path that does not exist, a
    folder without config.json (or, with `need_weights`, without weights), a hub name that could not be fetched,
    a `model_type` this transformers does not know, a config that needs custom code (`auto_map`;
    trust_remote_code stays off).
    """
    from transformers import AutoConfig, PreTrainedConfig, __version__
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    shown = f"{key} {name_or_path!r}" if key.startswith("-") else f"{key}={name_or_path!r}"  # a flag or a key
    problem = missing_local_path(name_or_path)
    if problem:
        raise ConfigError(f"{shown}: {problem}. Fix: {fix}.")
    path = os.path.expanduser(name_or_path)
    if os.path.isfile(path):
        raise ConfigError(f"{shown} is a file; give the folder that holds config.json.")
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            adapter = os.path.isfile(os.path.join(path, "adapter_config.json"))
            raise ConfigError(f"{shown} is a folder without config.json" +
                              ("; it holds a PEFT adapter, not a model: merge it into its base model first."
                               if adapter else f". Fix: {fix}."))
        if need_weights and not any(os.path.isfile(os.path.join(path, n)) for n in WEIGHT_FILES):
            raise ConfigError(f"{shown} has config.json but no weights (none of "
                              f"{', '.join(WEIGHT_FILES)}). Fix: set model.random_init: true to train it from "
                              f"random weights, or point it at a folder with weights.")
        if need_weights:
            refuse_pickle_only_weights(path, shown)
            check_safetensors_headers(path, shown)
    try:
        config_dict, _ = PreTrainedConfig.get_config_dict(path)
    except OSError as err:
        where = "cannot read the model config of" if os.path.isdir(path) else \
            "could not fetch from the Hugging Face hub the model config of"
        raise ConfigError(f"{where} {shown}: {one_line(err)}.{partial_local_path_note(name_or_path)} Fix: check "
                          f"the name, or {fix}.") from None
    model_type = config_dict.get("model_type")
    if model_type not in CONFIG_MAPPING:
        if config_dict.get("auto_map"):
            raise ConfigError(f"{shown} needs custom code (its config.json has auto_map for "
                              f"model_type {model_type!r}), which ulysses-train never runs (trust_remote_code stays "
                              f"off). Supported: decoder-only causal LMs built into transformers, "
                              f"{SUPPORTED_EXAMPLES}.")
        if not model_type:
            raise ConfigError(f"{shown}: its config.json has no model_type, so transformers cannot "
                              f"tell the architecture. Fix: use the config.json the model was released with.")
        raise ConfigError(f"{shown} has model_type {model_type!r}, which transformers {__version__} "
                          f"does not know. Supported: decoder-only causal LMs built into transformers, "
                          f"{SUPPORTED_EXAMPLES}; for a newer architecture, upgrade transformers.")
    check_raw_layer_types(config_dict, shown)  # before transformers rewrites or refuses them with a traceback
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError) as err:  # transformers' own validation (RoPE keys, ...)
        raise ConfigError(f"cannot read the model config of {shown}: {config_fields.error_text(err)}. "
                          f"{config_fields.FIX}.") from None


def refuse_pickle_only_weights(folder: str, shown: str) -> None:
    """A folder whose weights are only pickles (pytorch_model.bin): transformers reads them with the safe unpickler
    and refuses anything else with a traceback, and a pickle is a file format that can hold code, so they are not
    loaded: one line naming the conversion."""
    if any(n.endswith(".safetensors") for n in os.listdir(folder)):
        return
    pickles = sorted(n for n in os.listdir(folder) if n.endswith((".bin", ".pt", ".pth")) and "model" in n)
    if pickles:
        raise ConfigError(f"{shown} holds its weights only as pickle files ({', '.join(pickles[:3])}), which "
                          f"ulysses-train does not load: a pickle can run code. Fix: convert them to safetensors "
                          f"where you trust them (e.g. save_pretrained(..., safe_serialization=True), or the hub's "
                          f"safetensors conversion), or set model.random_init: true.")


def check_safetensors_headers(folder: str, shown: str) -> None:
    """Open the header of every .safetensors file in `folder` (a few kilobytes each, no tensor data) and check that
    every shard its index names is there, so a 0-byte, damaged or missing weights file is named in one line now,
    not by a loader traceback after the process group and DeepSpeed have started."""
    import json

    from safetensors import safe_open

    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as fh:
                shards = sorted(set(json.load(fh)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise ConfigError(f"{shown}: {index!r} is not a readable shard index ({one_line(err)}). Fix: download "
                              f"or copy it again.") from None
        missing = [name for name in shards if not os.path.isfile(os.path.join(folder, name))]
        if missing:
            raise ConfigError(f"{shown}: {index!r} names {len(missing)} shard(s) that are not there, e.g. "
                              f"{missing[0]!r}. Fix: download or copy the missing shards.")
    for name in sorted(n for n in os.listdir(folder) if n.endswith(".safetensors")):
        file = os.path.join(folder, name)
        if os.path.getsize(file) == 0:
            problem = "is empty (0 bytes)"
        else:
            try:
                with safe_open(file, framework="pt"):
                    continue
            except Exception as err:  # safetensors raises its own SafetensorError (and OSError) for a bad header
                problem = f"is not a readable safetensors file ({one_line(err)})"
        raise ConfigError(f"{shown}: the weights file {file!r} {problem}. Fix: download or copy it again.")


def load_model_config(model_cfg: ModelConfig, hf_config=None):
    """The transformers config of the model, with `model.config_overrides` applied."""
    if hf_config is None:
        if not model_cfg.name_or_path:
            raise ConfigError("model.name_or_path is empty; set a hub name (e.g. Qwen/Qwen3-8B) or a local folder.")
        hf_config = read_hf_config(model_cfg.name_or_path, need_weights=not model_cfg.random_init)
    hf_config = text_model_config(hf_config)  # Gemma 3 / 4 image-text releases train their text model
    for key, value in (model_cfg.config_overrides or {}).items():
        if not hasattr(hf_config, key):
            raise ConfigError(f"model.config_overrides.{key}: the model config has no such field.")
        setattr(hf_config, key, value)
    overrides = model_cfg.config_overrides or {}
    refuse_training_mtp(hf_config, overrides)
    if "num_hidden_layers" in overrides and "layer_types" not in overrides and \
            len(getattr(hf_config, "layer_types", None) or []) not in (0, hf_config.num_hidden_layers):
        # the per-layer list was derived for the old depth when the config was built: build it again
        hf_config = type(hf_config).from_dict({k: v for k, v in hf_config.to_dict().items() if k != "layer_types"})
    check_supported_architecture(hf_config, allow_untested=model_cfg.allow_untested_family)
    return hf_config


def refuse_training_mtp(hf_config, overrides: dict) -> None:
    """Refuse `model.config_overrides.num_nextn_predict_layers` > 0: it asks for multi-token-prediction layers, which
    transformers does not build (Nemotron-H, DeepSeek-V3: it drops their `mtp.*` tensors when loading), so they
    would not train. A released config that says so still trains its main model (weight_check names the mtp
    tensors left as they are)."""
    layers = overrides.get("num_nextn_predict_layers")
    if isinstance(layers, int) and layers > 0:
        raise ConfigError(f"model.config_overrides.num_nextn_predict_layers={layers} asks to train "
                          f"multi-token-prediction layers, which transformers does not build for "
                          f"{hf_config.model_type!r} models, so they cannot train. Fix: remove "
                          f"model.config_overrides.num_nextn_predict_layers (the main model trains).")


def check_supported_architecture(hf_config, allow_untested: bool = False) -> None:
    """Refuse models whose layers are neither full nor sliding-window causal attention, or whose logits or
    attention scores are post-processed in a way not built here.

    The chunked loss computes `hidden @ lm_head.T` itself and applies the scales and soft-cap it knows
    (architecture.logit_transform); an unknown logit post-processing would be silently wrong. Chunked or linear
    attention layers would be silently full attention after the all-to-all (sliding windows reach the kernel:
    attention_checks.check_window_attention says which kernel). A router loss is refused for families whose
    function is not the one router_balance.py reproduces. Last, a model type with no family record
    (ulysses_train/families.py) is refused unless `allow_untested` (model.allow_untested_family).
    """
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    if getattr(hf_config, "is_encoder_decoder", False) or type(hf_config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        kind = "an encoder-decoder model" if getattr(hf_config, "is_encoder_decoder", False) else \
            "not built by AutoModelForCausalLM"
        raise ConfigError(f"model type {hf_config.model_type!r} ({type(hf_config).__name__}) is {kind}: it is not a "
                          f"decoder-only causal LM, which is what ulysses-train trains ({SUPPORTED_EXAMPLES}).")
    text = text_config(hf_config)
    if not isinstance(getattr(text, "num_hidden_layers", None), int):  # BLT: byte patches, encoders around a stack
        raise ConfigError(f"model type {text.model_type!r} has no num_hidden_layers: its model is not one stack of "
                          f"decoder layers, which is what ulysses-train trains ({SUPPORTED_EXAMPLES}).")
    config_fields.check_model_fields(hf_config)  # widths, heads, RoPE, per-layer lists: before anything reads them
    check_layer_types(hf_config)  # every layer's type built by a mixer (model/mixers)
    if getattr(text, "attn_logit_softcapping", None) is not None:  # transformers' eager attention caps then
        raise ConfigError(f"model type {text.model_type!r} soft-caps its attention scores "
                          f"(attn_logit_softcapping={text.attn_logit_softcapping}), which the attention kernels here "
                          f"do not do yet; it would be silently dropped.")
    per_layer_heads = sorted(set(getattr(text, "num_attention_heads_per_layer", None) or []))
    if len(per_layer_heads) > 1:  # Laguna's list: the exchange, the sp rule and the planner read one count
        raise ConfigError(f"model type {text.model_type!r} gives its layers different query head counts "
                          f"(num_attention_heads_per_layer: {per_layer_heads}), which is not supported yet: sp and the "
                          f"planner read one count. Fix: a config whose layers have one head count.")
    if pooled_tail_problem(hf_config):
        raise ConfigError(f"{pooled_tail_problem(hf_config)}.")
    check_router_balance(hf_config)
    try:
        logit_transform(hf_config)
    except ValueError as err:
        raise ConfigError(f"{err}.") from None
    check_family(text.model_type, allow_untested, untested_layers_note(hf_config) if allow_untested else "")


def enable_gradient_checkpointing(model) -> None:
    """Non-reentrant checkpointing of each decoder layer, through whichever API this transformers has.

    transformers >= 5.24 names it `activation_checkpointing_enable` (the old name warns); 5.17 only has
    `gradient_checkpointing_enable`. The checkpoint levers (recompute.py) then replace each layer's checkpoint function.
    """
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if hasattr(model, "config"):
        model.config.use_cache = False


def build_causal_lm(hf_config, model_cfg: ModelConfig, attn_implementation: str, ds_config: Optional[dict]):
    """Build (random init) or load the model; under ZeRO-3 each rank materialises only its partition.

    Returns (model, hf_ds_config). Keep the second object alive as long as the model lives: transformers
    consults it (through a weak reference) whenever it needs to know that ZeRO-3 is on.
    """
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    hf_ds_config = HfDeepSpeedConfig(ds_config) if ds_config is not None else None
    dtype = getattr(torch, model_cfg.dtype)
    attn_implementation = kernel_name_for_build(hf_config, attn_implementation)
    if model_cfg.random_init:
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation=attn_implementation,
                                                 trust_remote_code=False)
    else:
        key_mapping = checkpoint_key_mapping(read_hf_config(model_cfg.name_or_path), hf_config)
        try:
            with quiet_load_report():
                model, loading_info = AutoModelForCausalLM.from_pretrained(
                    os.path.expanduser(model_cfg.name_or_path), config=hf_config, dtype=dtype,
                    attn_implementation=attn_implementation, trust_remote_code=False, output_loading_info=True,
                    use_safetensors=True,  # never a pickle (refuse_pickle_only_weights names a pickle-only folder)
                    use_kernels=False,  # transformers >= 5.25 defaults to hub kernels: none the package did not choose
                    **({"key_mapping": key_mapping} if key_mapping else {}))
        except OSError as err:  # e.g. a hub repo without weights; local folders were checked up front
            raise ConfigError(f"cannot load the weights of model.name_or_path={model_cfg.name_or_path!r}: {one_line(err)}. "
                              f"Fix: point it at a model with weights, or set model.random_init: true.") from None
        except RuntimeError as err:
            refuse_mismatched_shapes(err, model_cfg.name_or_path)
            refuse_unequal_fused_parts(err, hf_config, model_cfg.name_or_path, key_mapping)
            raise
        check_loaded_weights(model, loading_info, hf_config, model_cfg.name_or_path, key_mapping)
        if key_mapping:  # save_pretrained would write the image-text names back: the export is the text model
            model._weight_conversions = None
    if getattr(model.get_output_embeddings(), "bias", None) is not None:
        raise ConfigError("the model's lm_head has a bias, which the chunked loss does not add; not supported.")
    return model, hf_ds_config


def _loss_head_forward(self, hidden, shift_labels=None, chunk_rows=LOSS_CHUNK_ROWS):
    """The forward of `ChunkedLossHead<Linear>`: given labels, the chunked NLL sum instead of logits.

    Returns logits (or the loss) after the model's own scale and soft-cap (`self.logit_transform`).
    The loss runs *inside* the lm_head module's call so ZeRO-3's module hooks gather the (possibly tied)
    weight once for all chunks and release it afterwards, exactly as for any other layer; the fused loss
    has already produced the weight's gradient, so backward only hands it over.
    """
    hidden = hidden.to(self.weight.dtype)  # HY-V4 keeps its lm_head in fp32 and casts so; a no-op elsewhere
    if shift_labels is None:
        return transform_logits(torch.nn.functional.linear(hidden, self.weight, self.bias), self.logit_transform)
    return chunked_nll_sum(hidden, self.weight, shift_labels, chunk_rows, self.logit_transform)


class LongContextCausalLM(torch.nn.Module):
    """The module DeepSpeed trains: decoder to last hidden state, then the (chunked) loss.

    forward(input_ids, position_ids, shift_labels) on this rank's slice returns
    (sum of NLL over the slice's valid labels, number of valid labels).
    """

    def __init__(self, causal_lm, loss_type: str = "chunked", chunk_rows: int = LOSS_CHUNK_ROWS):
        super().__init__()
        self.causal_lm = causal_lm
        self.loss_type = loss_type
        self.chunk_rows = chunk_rows
        self.router_balance = None  # model/router_balance.py, for mixture-of-experts models with a router loss
        self.indexer_loss = None  # model/indexer_loss.py, with model.indexer_loss_coef > 0
        self.sequence_parallel = SequenceParallel()  # the sp group's exchanges and sums (transform.py sets it)
        head = causal_lm.get_output_embeddings()
        swap_class(head, "ChunkedLossHead", forward=_loss_head_forward)
        head.logit_transform = logit_transform(causal_lm.config)  # the model head's scale and soft-cap

    @property
    def config(self):
        return self.causal_lm.config

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, shift_labels: torch.Tensor,
                cu_seq_lens: Optional[torch.Tensor] = None, max_seq_len: Optional[int] = None):
        """`cu_seq_lens`, `max_seq_len` (document packing, parallel.layout.slice_sequence): the documents of the
        whole sequence, handed to every attention call as transformers' variable-length keywords."""
        decoder = decoder_of(self.causal_lm)
        documents = {} if cu_seq_lens is None else {"cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens,
                                                     "max_length_q": max_seq_len, "max_length_k": max_seq_len}
        hidden = decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False, **documents).last_hidden_state
        count = (shift_labels != IGNORE_INDEX).sum()
        lm_head = self.causal_lm.get_output_embeddings()
        if self.loss_type == "nll":
            return full_logits_nll_sum(lm_head(hidden), shift_labels), count
        return lm_head(hidden, shift_labels, self.chunk_rows), count
