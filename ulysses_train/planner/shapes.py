"""The numbers of a model the planner needs (`ModelShape`), read from its config, never from its weights."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

from ulysses_train.model.architecture import attention_heads_of, layer_configs, text_config
from ulysses_train.model.mixers.attention import ATTENTION
from ulysses_train.model.mixers.indexed_attention import INDEXED_ATTENTION
from ulysses_train.model.mixers.protocol import HeadCounts
from ulysses_train.families import llama_layout
from ulysses_train.planner.model_counts import attention_head_dims, count_parameters, counts_on_meta
from ulysses_train.planner.options import PlanError

ATTENTION_KIND = ATTENTION.name
"""The planner kind of attention layers, the one with a kernel whose output the kept-attention lever keeps and whose
(query, key) pairs the FLOP count charges."""
INDEXED_KIND = INDEXED_ATTENTION.name
"""The planner kind of indexed-attention layers: each query attends to its `index_topk` chosen keys (a window for the
FLOP count), never kept by the kept-attention lever."""
PAIR_KINDS = (ATTENTION_KIND, INDEXED_KIND)
"""The kinds whose (query, key) pairs the FLOP count charges."""


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
    experts: int = 0
    """Mixture of experts: experts per MoE layer (0: dense)."""
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_expert_intermediate: int = 0
    """A shared expert every token runs beside its k routed ones (Qwen3.5-MoE, Qwen3-Next); 0: none."""
    expert_width: int = 0
    """The width the routed experts run at where a latent projection narrows each token before them and widens
    the experts' sum after (Nemotron 3 Super's `moe_latent_size`); 0: the hidden size."""
    active_layer_params: int = 0
    """Parameters a token multiplies in one layer, on average over the layers (a mixture of experts' k of E
    experts); 0: all of `layer_params`. `layer_params` is then the largest layer, what ZeRO-3 gathers."""
    mlp_block_params: int = 0
    """The largest MLP block's parameters (all its experts): the gradient a ZeRO-3 leaf block holds until its
    backward ends. 0: 3 x hidden x intermediate."""
    kinds: tuple = ()
    """Each decoder layer's mixer name (model/mixers layer_mixer_names: "attention", "gated_deltanet", "kimi_delta",
    "mamba2"; "" for a layer with only an MLP or experts), which picks its terms (planner/mixer_terms.py registers
    them by the same names); empty: every layer attention."""
    windows: tuple = ()
    """Each attention layer's sliding window, None for full attention (and for a layer without attention: `kinds`
    says which), an indexed layer's `index_topk`; empty: no sliding windows and no indexed layers."""
    indexers: tuple = ()
    """Each layer's indexer multiply-adds per scored (query, key) pair (model/mixers layer_indexer_widths), 0 for a
    layer without an indexer; empty: none."""
    norms_per_layer: int = 2
    """RMSNorms over the hidden state in one layer (Llama: 2; Gemma 3: 4)."""
    llama_norms: bool = True
    """Whether they are Llama-style norms, which the trainer's low-memory RMSNorm replaces
    (architecture.LLAMA_STYLE_RMSNORMS); others stay Hugging Face's fp32 modules."""
    offset_norms: bool = False
    """Whether they are `1 + w` norms computed in fp32 (Qwen3.5, Qwen3-Next, Gemma 3: architecture.OFFSET_RMSNORMS),
    which the trainer replaces by Liger's kernel where that runs (PlanOptions.offset_norm_kernel)."""
    head_norms: bool = True
    """RMSNorms over each q and k head (Qwen3, Gemma 3); Llama, Mistral, Qwen2 and GPT-OSS have none."""
    norm_saved: tuple = (6, 6, 0)
    """Bytes per channel that Hugging Face's norm modules save for backward at bf16 (architecture
    .saved_bytes_per_channel, read off the model): (a hidden-state norm, a q or k head norm, a v head norm; 0: none).
    Llama's form is 6 (the fp32 upcast, the bf16 normalized rows); Gemma's normalizes in fp32 before its scale (8),
    and Gemma 4's unscaled v norm keeps its fp32 upcast (4)."""
    output_gate: bool = False
    """Attention output x sigmoid(gate), the gate from q_proj (Qwen3.5, Qwen3-Next's gated attention)."""
    attention_layouts: tuple = ()
    """((KV heads, head width), ...) of the attention layers where these differ by layer (Gemma 4: sliding layers 16 x
    256, global ones 4 x 512): estimate.estimate plans each and keeps the larger. (): every layer kv_heads and
    head_dim."""
    value_head_dim: int = 0
    """Attention's value (and output) head width where it differs from the q/k heads' `head_dim` (Kimi Linear's
    MLA: q/k heads qk_nope + qk_rope wide, v heads v_head_dim); 0: head_dim."""
    attention_latent: tuple = ()
    """Multi-head latent attention (Kimi Linear's MLA): (the kv latent's width, kv_lora_rank; the key heads' part
    expanded from it without RoPE, qk_nope_head_dim); () otherwise."""
    mixer_dims: tuple = ()
    """((mixer name, ((dimension, size), ...)), ...): what each mixer's planner terms read beyond the shared fields
    (Mixer.planner_dims: Mamba2's head width and state size, the delta rules' head widths); `dims(name)` gives one
    mixer's."""
    separate_blocks: bool = False
    """Each decoder layer is a token mixer or a feed-forward block, never both (Nemotron-H's Mamba2, attention,
    MLP and experts blocks, one norm each): a mixer layer has no MLP terms and a layer without a mixer (kind "")
    only them."""
    gated_mlp: bool = True
    """The dense MLP (or each expert) is down(act(gate(x)) * up(x)); False: down(act(up(x))) (Nemotron-H's relu²)."""
    residual_streams: int = 1
    """Hidden states each token carries between layers (HY-V4's hyper-connected `hc_mult` streams); 1: a plain
    residual (planner/hyper_connections.py)."""
    hc_saved: float = 0
    """Bytes per token each hyper-connection saves for backward beyond its input streams, measured on the model's
    own module (model_counts.hyper_connection_saved); 0: the fp32 copy of the streams HY-V4's saves (4 x streams x
    hidden)."""
    mixer_head_counts: Optional[HeadCounts] = None
    """The head counts the registry read from the config (model/mixers head_counts); None for a shape written by
    hand: attention's from heads and kv_heads."""

    @property
    def head_counts(self) -> HeadCounts:
        """The head counts the sp rules read (model/mixers sp_problems, valid_sp_values): the trainer's rule."""
        if self.mixer_head_counts is not None:
            return self.mixer_head_counts
        return HeadCounts.of_mixers({ATTENTION.name: {"query heads": self.heads, "kv heads": self.kv_heads}})

    def per_layout(self) -> list:
        """One shape per attention layout (attention_layouts), each as if every layer had it, or [self]: the
        planner plans each and keeps the largest, the model's worst layer (estimate.estimate,
        forward_only.estimate_forward)."""
        if not self.attention_layouts:
            return [self]
        return [dataclasses.replace(self, kv_heads=kv, head_dim=width, attention_layouts=())
                for kv, width in self.attention_layouts]

    def dims(self, mixer_name: str) -> dict:
        return next((dict(d) for name, d in self.mixer_dims if name == mixer_name), {})

    @property
    def mlp_layer_share(self) -> float:
        """The fraction of decoder layers with an MLP or experts block: 1, or with separate blocks the layers
        without a token mixer."""
        return self.layer_kinds.count("") / self.layers if self.separate_blocks else 1.0

    @property
    def layer_kinds(self) -> tuple:
        """Each decoder layer's planner kind (`kinds`, or every layer attention)."""
        return self.kinds or (ATTENTION_KIND,) * self.layers

    @property
    def attention_layers(self):
        """Indices of the layers with an attention kernel where some have none (a hybrid's linear layers); None
        when every layer attends (model/recompute.kept_attention_layers)."""
        kinds = self.layer_kinds
        return [i for i, kind in enumerate(kinds) if kind == ATTENTION_KIND] if set(kinds) != {ATTENTION_KIND} else None

    @property
    def flop_windows(self):
        """Each layer's window as the FLOP count takes it (model/flops.attention_forward_flops, as
        model/mixers layer_windows gives the trainer): None full, 0 for a layer without attention (no pairs);
        None when every layer attends in full."""
        if not self.windows and self.attention_layers is None:
            return None
        windows = self.windows or (None,) * self.layers
        return [w if kind in PAIR_KINDS else 0 for w, kind in zip(windows, self.layer_kinds)]

    @property
    def indexed_flop_windows(self) -> list:
        """flop_windows with 0 for every layer but the indexed ones (their attention is recomputed in every
        checkpointed layer: the kept-attention lever keeps no indexed layer's)."""
        windows = self.windows or (None,) * self.layers
        return [w if kind == INDEXED_KIND else 0 for w, kind in zip(windows, self.layer_kinds)]

    @property
    def mlp_width(self) -> int:
        """Intermediate width per token: the dense MLP's, or k experts' (and a shared expert's) for a mixture of
        experts."""
        if not self.experts:
            return self.intermediate
        return self.experts_per_token * self.expert_intermediate + self.shared_expert_intermediate

    @property
    def mlp_params(self) -> int:
        """MLP block parameters (every expert): what a layer's MLP gradient holds."""
        return self.mlp_block_params or 3 * self.hidden * self.intermediate

    @property
    def active_params_per_layer(self) -> int:
        return self.active_layer_params or self.layer_params

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Width of k (and of v where value heads are head_dim wide)."""
        return self.kv_heads * self.head_dim

    @property
    def v_head_width(self) -> int:
        return self.value_head_dim or self.head_dim

    @property
    def attention_output_width(self) -> int:
        """The attention kernel's output per token: query heads x value head width (q_width but for MLA)."""
        return self.heads * self.v_head_width

    @property
    def attention_flop_width(self) -> int:
        """The width QK^T and PV cost over (model/flops.attention_width): q_width, or for MLA the mean of the q/k
        and v widths."""
        return self.heads * (self.head_dim + self.v_head_width) // 2

    @property
    def lm_head_params(self) -> int:
        """The output projection (vocab x hidden); the same matrix as the embedding when tied."""
        return self.vocab * self.hidden

    @property
    def matmul_params(self) -> int:
        """Parameters used in one multiply-add per token: every layer plus the lm_head product (the
        embedding is a lookup). This is the N of 6*N*T."""
        return self.layers * self.active_params_per_layer + self.lm_head_params

    @classmethod
    def from_hf_config(cls, hf_config, name: str = "") -> "ModelShape":
        from ulysses_train.model.mixers import (MIXERS, has_sliding_windows, head_counts, layer_indexer_widths,
                                                layer_mixer_names, layer_windows)

        text = text_config(hf_config)
        check_planned_mixers(text)
        attention = planned_attention_config(text)
        heads = attention.num_attention_heads
        head_dim, value_head_dim = attention_head_dims(attention)
        kinds = tuple(layer_mixer_names(text))
        layout = llama_layout(text.model_type)
        if layout is not None:
            layer_params, total_params = count_parameters(text)
            counted = {"head_norms": layout.head_norms}
        else:  # anything else: read from the model built on the meta device, once
            counted = counts_on_meta(text)
            layer_params, total_params = counted.pop("layer_params"), counted.pop("total_params")
        return cls(name=name or getattr(hf_config, "name_or_path", "") or text.model_type,
                   hidden=text.hidden_size,
                   intermediate=getattr(text, "intermediate_size", None) or text.moe_intermediate_size,
                   layers=text.num_hidden_layers, heads=heads,
                   kv_heads=most_kv_heads(text) if attention is text else attention_heads_of(attention)[1],
                   head_dim=head_dim,
                   vocab=text.vocab_size, tied=bool(getattr(text, "tie_word_embeddings", False)),
                   layer_params=layer_params, total_params=total_params,
                   kinds=kinds if set(kinds) != {ATTENTION_KIND} else (),
                   windows=tuple(w if kind in PAIR_KINDS else None for w, kind in zip(layer_windows(text), kinds))
                   if has_sliding_windows(text) or INDEXED_KIND in kinds else (),
                   indexers=tuple(layer_indexer_widths(text)) if INDEXED_KIND in kinds else (),
                   value_head_dim=value_head_dim, attention_latent=attention_latent(attention),
                   expert_width=getattr(text, "moe_latent_size", None) or 0,
                   attention_layouts=attention_layouts(attention), residual_streams=getattr(text, "hc_mult", None) or 1,
                   mixer_head_counts=head_counts(text), separate_blocks="" in kinds,
                   mixer_dims=tuple((mixer.name, tuple(mixer.planner_dims(text).items())) for mixer in MIXERS
                                    if mixer.planner_dims(text)), **counted)


def check_planned_mixers(text_config) -> None:
    """NotImplementedError (the planner's "cannot size this model": the trainer then leaves `auto` levers at
    their no-GPU values and skips its memory check, plan.py refuses in one line) for a model with a token mixer
    that has no planner terms yet (its registry entry's `planned` is False)."""
    from ulysses_train.model.mixers import mixers_of

    unplanned = [mixer.name for mixer in mixers_of(text_config) if not mixer.planned]
    if unplanned:
        raise NotImplementedError(f"the planner has no memory terms for {', '.join(unplanned)} layers "
                                  f"({text_config.model_type}) yet")


def planned_attention_config(text):
    """The config whose attention widths ModelShape reads: the text config, or where a heterogeneous config sets
    multi-head latent attention's widths per layer (dots3: sliding MLA layers beside indexed ones of other widths,
    whose own widths the indexed mixer's planner_dims carry) the first attention layer's own config."""
    from ulysses_train.model.mixers.protocol import layer_types_of

    if not getattr(text, "is_heterogeneous", False):
        return text
    attention = [layer for kind, layer in zip(layer_types_of(text), layer_configs(text))
                 if ATTENTION.builds(text.model_type, kind)]
    return attention[0] if attention and getattr(attention[0], "kv_lora_rank", None) else text


def attention_latent(text_config) -> tuple:
    """ModelShape.attention_latent: (kv_lora_rank, qk_nope_head_dim) of a multi-head latent attention; ()."""
    c = text_config
    if getattr(c, "kv_lora_rank", None) and getattr(c, "qk_nope_head_dim", None):
        return c.kv_lora_rank, c.qk_nope_head_dim
    return ()


def attention_layouts(text_config) -> tuple:
    """ModelShape.attention_layouts: the distinct (KV heads, head width) of the layers where they differ by layer; ()
    where they do not, and for multi-head latent attention (one layout, attention_head_dims)."""
    if getattr(text_config, "qk_nope_head_dim", None):
        return ()
    found = tuple(sorted({attention_heads_of(layer)[1:] for layer in layer_configs(text_config)}))
    return found if len(found) > 1 else ()


def most_kv_heads(text_config) -> int:
    """The KV heads of the layer with the most (Gemma 4's sliding layers; one count in most models). Where the count
    or the head width differs by layer the planner plans each layer's own (ModelShape.attention_layouts)."""
    return max(attention_heads_of(layer)[1] for layer in layer_configs(text_config))


def load_model_shape(model) -> ModelShape:
    """A ModelShape from: a ModelShape; a transformers config; one of our local names ("qwen3-8b"); a local
    folder or config.json path; or a hub name (read over the network), read and checked as the trainer reads it
    (model.loading.read_hf_config, config_fields.check_model_fields: one line naming a malformed key)."""
    if isinstance(model, ModelShape):
        return model
    if not isinstance(model, str):
        return ModelShape.from_hf_config(model)
    from types import SimpleNamespace

    from ulysses_train.model.presets import (QWEN3_MODEL_TYPE, QWEN3_SHAPES, known_name, preset_config,
                                             qwen3_config_kwargs)

    if known_name(model) in QWEN3_SHAPES:  # the same fields Qwen3Config gets, read without importing transformers
        fields = SimpleNamespace(model_type=QWEN3_MODEL_TYPE, **qwen3_config_kwargs(model))
        return ModelShape.from_hf_config(fields, name=known_name(model))
    if known_name(model):
        return ModelShape.from_hf_config(preset_config(model), name=known_name(model))
    from ulysses_train.model.config_fields import check_model_fields
    from ulysses_train.model.loading import read_hf_config

    path = os.path.dirname(model) if model.endswith(".json") and os.path.isfile(model) else model
    if model.startswith((".", "/", "~")) and not os.path.exists(os.path.expanduser(path)):
        raise PlanError(f"{model!r}: no such file or folder. Give a local folder with config.json or one of "
                        f"qwen3-0.6b, qwen3-4b, qwen3-8b.")
    config = read_hf_config(path, key="--model", fix="give a local folder with config.json or a preset name")
    check_model_fields(config)  # the trainer's own reading of the config: the same refusals, before any sizing
    return ModelShape.from_hf_config(config, name=model)


MIXED_DEPTH_FIELDS = {"layer_types", "first_k_dense_replace", "mlp_layer_types"}
"""Preset fields that make layers differ by depth (a pattern of kinds; DeepSeek-V3's dense first layers before its
experts): reduced_depth_shape rebuilds such a preset from its config cut."""


def reduced_depth_shape(model: str, layers: int) -> ModelShape:
    """`model` (a preset name, or anything load_model_shape reads) cut to its first `layers` layers, as
    scripts/bench.py --layers builds it. A preset whose layers differ (hybrids: Mamba2, experts and attention in
    one pattern; DeepSeek-V3's dense first layers, without experts where the cut holds only those) is rebuilt from
    its config cut to those layers, since removing `layer_params` (the largest layer) per missing layer would count
    every removed layer as the largest; a uniform model drops whole layers."""
    from ulysses_train.model.presets import FAMILY_PRESETS, known_name, preset_config

    key = known_name(model) if isinstance(model, str) else None
    if key in FAMILY_PRESETS and MIXED_DEPTH_FIELDS & set(FAMILY_PRESETS[key][2]):
        config = preset_config(key, num_hidden_layers=layers)
        shape = ModelShape.from_hf_config(config, name=key)
        if getattr(config, "first_k_dense_replace", 0) >= layers:  # the cut holds dense layers only
            shape = dataclasses.replace(shape, experts=0, experts_per_token=0)
        return shape
    shape = load_model_shape(model)
    return dataclasses.replace(shape, layers=layers, windows=shape.windows[:layers], kinds=shape.kinds[:layers],
                               indexers=shape.indexers[:layers],
                               total_params=shape.total_params - (shape.layers - layers) * shape.layer_params)
