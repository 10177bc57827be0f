"""Indexed attention (`indexed_attention` layers): attention in which an indexer picks the keys each query attends
to. The first variant is DeepSeek Sparse Attention (DSA) on multi-head latent attention (MLA): DeepSeek-V3.2
(`deepseek_v32`), GLM-5 (`glm_moe_dsa`, whose `shared` layers reuse the previous indexer layer's choice) and HY-V4
(`hy_v4`: GLM-5's layer with its indexer's own form, INDEXER_FORMS, a sink logit per head in the softmax and a
sigmoid gate on each head's output; its hyper-connected residual streams are per token, run by its stock decoder
layer on each rank's slice, and need nothing here).

Under sequence parallelism nothing is exchanged by heads. Each rank keeps its slice of the queries, all heads, and
gathers the small key side of the whole sequence once per layer (SequenceParallel.gather_sequence): the MLA latent
(kv_lora_rank values a token) with the rotated key part (qk_rope_head_dim), one head shared by every query head,
and the indexer's key (index_head_dim, one head). The indexer scores the rank's queries against every key and keeps
each query's top `index_topk` (indexed_kernels.select_keys: transformers' own arithmetic, in chunks of queries);
the attention of each query over its chosen keys runs in MLA's absorbed form (indexed_kernels.sparse_latent_attention),
kv_b_proj's key rows carrying the query into the latent and its value rows the output back. The gathered latent's
backward returns each rank's share of its gradient through the same all-to-all.

Packed documents (`cu_seq_lens_q`, the whole sequence's): a query sees only its own document's earlier keys, in the
indexer's choice and in the attention. The indexer is frozen, as in transformers (its forward runs under
`no_grad`): its weights are not trained (the `model changes:` line says so), unless model.indexer_loss_coef trains
them by DeepSeek-V3.2's KL loss (model/indexer_loss.py). dots3 (`dots3_note_text`) adds scaled MLA latents, a norm
on the key's rotary part and a gate per head (latent_projections, gated_heads); its sliding layers, of the same
class, are the attention mixer's (indexed_layers tells them apart by layer type). GLM-5.3-Flash (`glm5_next_text`)
has MLA without positions (nothing rotated) and an indexer that scores pools of keys (pooled_index.py: the variant
POOLED_TOP_K of its family record), its index keys gathered with their pool gate scores; -1 in a choice is no key.
kv_b_proj runs as a module on an identity matrix to give its weight, so ZeRO-3 gathers it and LoRA adapts it as in
the plain layer."""
from __future__ import annotations

import sys
from typing import Optional

import torch

from ulysses_train.errors import ConfigError
from ulysses_train.families import indexed_attention_types
from ulysses_train.model.architecture import decoder_of, layer_configs, text_config
from ulysses_train.model.indexer_loss import indexer_kl
from ulysses_train.model.mixers.indexed_kernels import (IndexerForm, chosen_visible, index_keys, select_keys,
                                                         sparse_latent_attention)
from ulysses_train.model.mixers.attention_exchange import ATTENTION_LAYER_TYPES
from ulysses_train.model.mixers.pooled_index import select_pooled_keys
from ulysses_train.model.mixers.protocol import HeadCounts, Mixer, module_layer_type
from ulysses_train.model.swap import stock_class, swap_class
from ulysses_train.sequence_parallel import SequenceParallel

NAME = "indexed_attention"
INDEXED_TYPES = indexed_attention_types()
"""Text-model types with `indexed_attention` layers this mixer builds, from the family records."""
INDEXED_CLASSES = ("DeepseekV32Attention", "GlmMoeDsaAttention", "HYV4Attention", "Dots3NoteTextAttention",
                   "Glm5NextTextAttention")
"""Attention classes of indexed layers (dots3's also builds its sliding layers: the attention mixer's, told apart by
layer type, indexed_layers)."""
INDEXER_FORMS = {"DeepseekV32Indexer": ("apply_rotary_pos_emb", {}),
                 "GlmMoeDsaIndexer": ("apply_rotary_pos_emb_interleave", {}),
                 "Dots3NoteTextIndexer": ("apply_rotary_pos_emb_interleave", {}),
                 "HYV4Indexer": ("apply_rotary_pos_emb_interleave", {"rope_last": True, "scale_weights": True}),
                 "Glm5NextTextIndexer": (None, {"pooled": True})}
"""How each indexer class computes (indexed_kernels.IndexerForm): which of its modeling file's rotary functions it
applies to its q and k (DeepSeek-V3.2's half-split, GLM-5's and HY-V4's interleaved; the main attention of all three
interleaved; GLM-5.3-Flash's none: its layers take no positions), and the differences: HY-V4's rotated channels
last and softmax_scale on the head weights, GLM-5.3-Flash's scores of pooled keys (pooled_index.py)."""
ROTATED_IN_OWN_DTYPE = ("Dots3NoteTextAttention",)
"""Attention classes that cast their rotated q and k parts back to the projections' dtype (the others keep what the
rotary function returns)."""
MASK_KEY = "indexed_attention"
"""transformers' key for these layers' mask in the decoder's mask mapping: handed None (indexed_decoder_kwargs), so the
decoder never builds its [S, S] mask."""


def indexed_layer_config(text):
    """The config of the model's first indexed layer (architecture.layer_configs: dots3 sets head counts and MLA
    widths per layer, and its sliding layers' differ), None without indexed layers. Every indexed layer of a model
    has the same widths."""
    from ulysses_train.model.mixers.protocol import layer_types_of

    return next((layer for kind, layer in zip(layer_types_of(text), layer_configs(text))
                 if INDEXED_ATTENTION.builds(text.model_type, kind)), None)


def indexed_head_units(text) -> dict:
    """{"query heads": H}: every rank runs all of them for its own queries, so sp splits no unit; {} without
    indexed layers."""
    layer = indexed_layer_config(text)
    return {"query heads": layer.num_attention_heads} if layer is not None else {}


def indexed_planner_dims(text) -> dict:
    """The widths the planner's terms read (planner/indexed_layer.py); {} without indexed layers."""
    text = indexed_layer_config(text)
    if text is None:
        return {}
    return {"heads": text.num_attention_heads, "latent": text.kv_lora_rank, "rope": text.qk_rope_head_dim,
            "nope": text.qk_nope_head_dim, "value": text.v_head_dim, "q latent": text.q_lora_rank,
            "index heads": text.index_n_heads, "index width": text.index_head_dim, "top k": text.index_topk}


def indexer_score_widths(text) -> list:
    """Each decoder layer's indexer work per (query, key) pair it scores, in multiply-adds: index heads x (index
    head width + 1: the head weight), over `index_kpool` where it scores pools of that many keys (GLM-5.3-Flash);
    0 for a layer without an indexer (another mixer's, or GLM-5's `shared`)."""
    from ulysses_train.model.mixers.protocol import layer_types_of

    shared = getattr(text, "indexer_types", None) or []
    width = getattr(text, "index_n_heads", 0) * (getattr(text, "index_head_dim", 0) + 1)
    if getattr(text, "index_kpool", None):
        width /= text.index_kpool
    return [width if INDEXED_ATTENTION.builds(text.model_type, kind) and (i >= len(shared) or shared[i] != "shared")
            else 0 for i, kind in enumerate(layer_types_of(text))]


def kernel_name_for_build(hf_config, asked: str) -> str:
    """The attention kernel name transformers is told when it builds the model: `asked`, or "eager" where no layer
    is the attention mixer's (every one indexed, or another mixer's: GLM-5.3-Flash's KDA layers). The indexed
    layers' forward is this mixer's, which never calls the named kernel, and HY-V4's classes refuse any name but
    "eager" at build time (GLM-5.3-Flash's any flash name)."""
    from ulysses_train.model.mixers.protocol import layer_types_of

    text = text_config(hf_config)
    no_attention_layer = all(INDEXED_ATTENTION.builds(text.model_type, kind) or kind not in ATTENTION_LAYER_TYPES
                             for kind in set(layer_types_of(text)))
    return "eager" if no_attention_layer else asked


def check_indexer_loss(hf_config, coefficient: float) -> None:
    """Refuse model.indexer_loss_coef > 0 for a model with no indexer to train (no layer scores keys itself), or
    whose indexer scores pooled keys (GLM-5.3-Flash: no KL target over pools is defined by its release)."""
    text = text_config(hf_config)
    if coefficient > 0 and not any(indexer_score_widths(text)):
        raise ConfigError(f"model.indexer_loss_coef={coefficient} trains the indexer of indexed-attention layers, "
                          f"and model type {text.model_type!r} has none. Fix: model.indexer_loss_coef 0.")
    if coefficient > 0 and getattr(text, "index_kpool", None):
        raise ConfigError(f"model.indexer_loss_coef={coefficient}: model type {text.model_type!r} scores pooled keys "
                          f"(index_kpool={text.index_kpool}), for which no indexer loss is built; its indexer trains "
                          f"frozen. Fix: model.indexer_loss_coef 0.")


def pooled_tail_problem(hf_config) -> Optional[str]:
    """A pooled indexer told not to add each query's own incomplete pool (`index_kpool_always_select_tail` false):
    a query before its document's first complete pool would see no key at all, where transformers' masks give an
    undefined row (pooled_index.py); None otherwise."""
    text = text_config(hf_config)
    if getattr(text, "index_kpool", None) and getattr(text, "index_kpool_always_select_tail", True) is False:
        return (f"model type {text.model_type!r} with index_kpool_always_select_tail false leaves the first "
                f"{text.index_kpool - 1} queries of each document no key to attend to, which is not built. Fix: "
                f"index_kpool_always_select_tail true (the release's value)")
    return None


def indexed_sp_problem(counts: HeadCounts, sp: int, key: str) -> Optional[str]:
    """None: any sp works, as no head is split (each rank gathers the one latent head)."""
    return None


def no_kernel_check(hf_config, seq_length: int, cuda: bool) -> None:
    """The reference kernels run anywhere; the planner counts what they hold."""


def document_of_each_token(cu_seq_lens, total: int, device) -> Optional[torch.Tensor]:
    """Each token's document number over the whole sequence from `cu_seq_lens` (None: one document)."""
    if cu_seq_lens is None:
        return None
    bounds = cu_seq_lens.to(device=device, dtype=torch.long)
    return torch.searchsorted(bounds[1:], torch.arange(total, device=device), right=True)


def latent_weights(module) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj's key rows [R, H, nope] and value rows [R, H, v], from the module itself run on an identity
    matrix (module docstring)."""
    rank = module.kv_lora_rank
    like = module.kv_b_proj.weight
    weight = module.kv_b_proj(torch.eye(rank, dtype=like.dtype, device=like.device))
    weight = weight.view(rank, module.num_heads, module.qk_nope_head_dim + module.v_head_dim)
    return weight[..., :module.qk_nope_head_dim], weight[..., module.qk_nope_head_dim:]


def modeling_function(module, name: str):
    """A function of the module's own transformers modeling file (its rotary functions)."""
    return getattr(sys.modules[stock_class(module).__module__], name)


def indexer_form(indexer) -> IndexerForm:
    """How this indexer computes (INDEXER_FORMS), its rotary function taken from its own modeling file."""
    rope, differences = INDEXER_FORMS[stock_class(indexer).__name__]
    return IndexerForm(rope=rope and modeling_function(indexer, rope), **differences)


def gather_key_side(sequence_parallel, parts: list) -> list:
    """The latent and rotated key part of the whole sequence on every rank (one function, so a negative control
    can take the gather away)."""
    return sequence_parallel.gather_sequence(parts)


def trains_indexer(self) -> bool:
    """Whether this forward computes the layer's indexer loss (model/indexer_loss.py): the layer has an indexer and
    the model a loss whose gradient or value is wanted now."""
    loss = getattr(self, "indexer_loss", None)
    return self.indexer is not None and loss is not None and loss.active()


def gathered_index_keys(self, hidden_states, cos, sin):
    """The indexer's keys of the whole sequence [B, T, D] (each rank's own, gathered); None without an indexer.
    With gradient only where the indexer loss trains through them (its input detached, so nothing else does)."""
    if self.indexer is None:
        return None
    with torch.set_grad_enabled(torch.is_grad_enabled() and trains_indexer(self)):
        keys = index_keys(self.indexer, indexer_form(self.indexer), hidden_states.detach(), cos, sin)
        (keys,) = self.sequence_parallel.gather_sequence([keys])
    return keys


def chosen_keys(self, hidden_states, q_resid, keys, cos, sin, query_index, documents, prev_topk_indices):
    """This layer's keys for each of the slice's queries: its indexer's choice against the whole sequence's index
    keys (gathered_index_keys), or on a layer without an indexer (GLM-5's `shared`) the previous indexer layer's."""
    if self.indexer is None:
        if prev_topk_indices is None:
            raise ValueError("a shared indexed-attention layer needs the top-k of an earlier indexer layer")
        return prev_topk_indices
    form = indexer_form(self.indexer)
    if form.pooled:
        return select_pooled_keys(self.indexer, form, hidden_states, q_resid, keys.detach(), query_index, documents)
    return select_keys(self.indexer, form, hidden_states, q_resid, keys.detach(), cos, sin, query_index, documents)


def with_indexer_loss(self, out, hidden_states, q_resid, cos, sin, keys, query, latent_keys, chosen, visible):
    """The layer's output, carrying its indexer loss (model/indexer_loss.py) where that is on: the indexer's inputs
    detached, the attention's query [B, t, H, R + r] and latent keys [B, T, R + r] its target's."""
    if not trains_indexer(self):
        return out
    kl = indexer_kl(self, indexer_form(self.indexer), hidden_states.detach(), q_resid.detach(), cos, sin, keys,
                    query.detach(), latent_keys.detach(), chosen, visible, self.scaling, getattr(self, "sinks", None))
    return self.indexer_loss.attach(out, kl)


def latent_projections(self, hidden_states, cos, sin):
    """The layer's MLA projections of this rank's tokens, as its stock forward computes them: q_resid (the indexer's
    query input), the query's nope part [B, t, H, nope] and rotated part [B, t, H, r], the latent [B, t, R] and
    rotated key part [B, t, r]. dots3 scales q_resid and the latent by (hidden / rank) ** 0.5 (q_lora_scale,
    kv_lora_scale) and normalises the key's rotary part first (k_rope_only_layernorm), and casts the rotated parts
    back to their projection's dtype (ROTATED_IN_OWN_DTYPE: its indexed layers get fp32 cos and sin)."""
    batch, length, _ = hidden_states.shape
    q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states)) * getattr(self, "q_lora_scale", 1.0)
    q = self.q_b_proj(q_resid).view(batch, length, -1, self.qk_head_dim)  # [B, t, H, nope + rope]
    q_nope, q_rot = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
    latent, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [self.kv_lora_rank, self.qk_rope_head_dim],
                                dim=-1)
    latent = self.kv_a_layernorm(latent) * getattr(self, "kv_lora_scale", 1.0)  # [B, t, R]
    if hasattr(self, "k_rope_only_layernorm"):
        k_rot = self.k_rope_only_layernorm(k_rot)
    if cos is None:  # GLM-5.3-Flash: its decoder hands no positions, and nothing is rotated
        return q_resid, q_nope, q_rot, latent, k_rot
    rope = modeling_function(self, "apply_rotary_pos_emb_interleave")
    q_rot_r, k_rot_r = rope(q_rot.transpose(1, 2), k_rot.unsqueeze(1), cos, sin)  # [B, H, t, r], [B, 1, t, r]
    q_rot_r, k_rot_r = q_rot_r.transpose(1, 2), k_rot_r.squeeze(1)
    if stock_class(self).__name__ in ROTATED_IN_OWN_DTYPE:
        q_rot_r, k_rot_r = q_rot_r.to(q_rot.dtype), k_rot_r.to(k_rot.dtype)
    return q_resid, q_nope, q_rot_r, latent, k_rot_r


def gated_heads(self, hidden_states, out):
    """Each head's output [B, t, H, v] times its sigmoid gate, where the layer has one: HY-V4's gate_proj
    (gate_projection_size values a head), dots3's g_proj (one a head); else as it is."""
    batch, length = hidden_states.shape[:2]
    if hasattr(self, "gate_proj"):
        return out * torch.sigmoid(self.gate_proj(hidden_states).view(batch, length, -1, self.gate_projection_size))
    if hasattr(self, "g_proj"):
        return out * torch.sigmoid(self.g_proj(hidden_states).view(batch, length, -1, 1))
    return out


def ulysses_indexed_forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None,
                            position_ids=None, prev_topk_indices=None, **kwargs):
    """The layer's forward on this rank's slice (module docstring); training only (no cache). Returns what the
    stock forward returns: (output, None), and GLM-5's chosen keys as a third value for its next layer."""
    if cache is not None or kwargs.get("past_key_values") is not None:
        raise RuntimeError("the Ulysses indexed-attention forward is for training: no cache")
    sequence_parallel = self.sequence_parallel
    batch, length, _ = hidden_states.shape
    cos, sin = position_embeddings if position_embeddings is not None else (None, None)  # None: no positions
    q_resid, q_nope, q_rot, latent, k_rot = latent_projections(self, hidden_states, cos, sin)
    latent_all, k_rot_all = gather_key_side(sequence_parallel, [latent, k_rot])  # [B, T, R], [B, T, r]
    total = latent_all.shape[1]
    query_index = sequence_parallel.slice_start(length) + torch.arange(length, device=hidden_states.device)
    documents = document_of_each_token(kwargs.get("cu_seq_lens_q"), total, hidden_states.device)
    keys = gathered_index_keys(self, hidden_states, cos, sin)
    chosen = chosen_keys(self, hidden_states, q_resid, keys, cos, sin, query_index, documents, prev_topk_indices)
    visible = chosen_visible(chosen, query_index, documents)  # [B, t, k]
    key_rows, value_rows = latent_weights(self)
    q_latent = torch.einsum("bthd,rhd->bthr", q_nope, key_rows)
    out_latent = sparse_latent_attention(q_latent, q_rot, latent_all, k_rot_all, chosen, visible, self.scaling,
                                         getattr(self, "sinks", None))
    out = gated_heads(self, hidden_states, torch.einsum("bthr,rhv->bthv", out_latent, value_rows))  # [B, t, H, v]
    out = self.o_proj(out.reshape(batch, length, -1))
    out = with_indexer_loss(self, out, hidden_states, q_resid, cos, sin, keys, torch.cat([q_latent, q_rot], dim=-1),
                            torch.cat([latent_all, k_rot_all], dim=-1), chosen, visible)
    return (out, None, chosen) if hasattr(self, "skip_topk") else (out, None)


def check_latent_adapter(layer) -> None:
    """A LoRA adapter on kv_b_proj with dropout would drop rows of the identity latent_weights runs it on, not
    features of each token as in the plain layer: refused, naming the fix."""
    dropout = getattr(layer.kv_b_proj, "lora_dropout", None) or {}
    if any(getattr(module, "p", 0.0) > 0 for module in dropout.values()):
        raise ConfigError("model.lora has dropout on kv_b_proj of an indexed-attention layer, which the absorbed "
                          "attention runs on its weight, not on each token. Fix: model.lora dropout 0, or leave "
                          "kv_b_proj out of its target_modules.")


def indexed_layers(model) -> list:
    """The model's indexed-attention layers: modules of INDEXED_CLASSES whose layer type this mixer builds (or that
    carry no layer type: a layer built on its own)."""
    return [m for m in model.modules() if stock_class(m).__name__ in INDEXED_CLASSES
            and module_layer_type(m) in (None, *INDEXED_ATTENTION.layer_types)]


def other_layer_masks(decoder, kwargs) -> dict:
    """{layer type: mask} of the decoder's layers that are not indexed (dots3's sliding layers), built by the same
    transformers functions its forward calls, from the call's own mask and positions ({} where every layer is
    indexed; None for a recurrent mixer's layers, GLM-5.3-Flash's KDA, whose forward takes no mask). Those
    functions read only the embeddings' shape, dtype and device: a 0-wide stand-in gives them."""
    from transformers import masking_utils

    from ulysses_train.model.mixers.protocol import layer_types_of

    builders = {"full_attention": masking_utils.create_causal_mask,
                "sliding_attention": masking_utils.create_sliding_window_causal_mask}
    kinds = set(layer_types_of(decoder.config)) - set(INDEXED_ATTENTION.layer_types)
    if not kinds:
        return {}
    given = kwargs.get("inputs_embeds")
    tokens = given.shape[:2] if given is not None else kwargs["input_ids"].shape
    weight = decoder.embed_tokens.weight
    stand_in = torch.empty(*tokens, 0, dtype=weight.dtype, device=weight.device)
    return {kind: builders[kind](config=decoder.config, inputs_embeds=stand_in, cache=None,
                                 attention_mask=kwargs.get("attention_mask"), position_ids=kwargs.get("position_ids"))
            if kind in builders else None for kind in kinds}


def no_decoder_mask(module, args, kwargs):
    """The decoder's forward pre-hook: its indexed layers' mask handed as None, so transformers does not build the
    [S, S] causal mask it otherwise forces for them; the layers mask by themselves (visible_keys). Its other layers
    get the masks transformers builds for them (other_layer_masks)."""
    return args, {**kwargs, "attention_mask": {MASK_KEY: None, **other_layer_masks(module, kwargs)}}


def install_indexed_attention(model, sequence_parallel: SequenceParallel, variant: str) -> Optional[str]:
    """Give every indexed-attention layer the forward above (gathering over `sequence_parallel`), freeze its
    indexer, and keep the decoder from building a dense mask; the `model changes:` phrase (None: no such layer)."""
    layers = indexed_layers(model)
    if not layers:
        return None
    frozen, loss = 0, getattr(model, "indexer_loss", None)
    for layer in layers:
        check_latent_adapter(layer)
        swap_class(layer, "Ulysses", forward=ulysses_indexed_forward)
        layer.sequence_parallel, layer.indexer_loss = sequence_parallel, loss
        for weight in (layer.indexer.parameters() if layer.indexer is not None and loss is None else ()):
            frozen += weight.requires_grad
            weight.requires_grad_(False)
    if hasattr(model, "get_decoder"):  # a whole model (a layer on its own has no decoder to build masks)
        decoder_of(model).register_forward_pre_hook(no_decoder_mask, with_kwargs=True)
    indexers = sum(layer.indexer is not None for layer in layers)
    how = (f"trained by the indexer KL loss (x {loss.coefficient}) alone" if loss is not None else
           f"frozen as in transformers: {frozen} tensors not trained")
    return (f"{len(layers)} indexed-attention layers on each rank's queries against the gathered latent "
            f"({indexers} with an indexer, {how}; torch reference kernels)")


INDEXED_ATTENTION = Mixer(
    name=NAME,
    layer_types=("indexed_attention",),
    model_types=INDEXED_TYPES,
    module_classes=INDEXED_CLASSES,
    head_units=indexed_head_units,
    planner_dims=indexed_planner_dims,
    sp_problem=indexed_sp_problem,
    sp_rule="any sp: each rank runs every head for its own queries against the gathered latent (one head)",
    check_kernels=no_kernel_check,
    install=install_indexed_attention,
    document_restarts="a query's indexer choice and attention see only its own document's earlier keys "
                      "(`cu_seq_lens_q` of the whole sequence)",
    planned=True,
    planner_terms="planner/indexed_layer.py indexed_saved_per_token, indexed_backward_extra_per_token, "
                  "indexed_forward_per_token, indexed_exchange_width (the gathered latent and index keys)",
)
