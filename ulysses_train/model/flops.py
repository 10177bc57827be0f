"""What a model's step costs in FLOPs (ulysses_train/DESIGN.md, 'How throughput is counted'): one rule for the
trainer's TFLOP/s (training/metrics.py, training/loop.py) and the planner's step time (planner/estimate.py), so
both count the same work."""
from __future__ import annotations

import torch

from ulysses_train.model.architecture import attention_heads_of, layer_configs, text_config
from ulysses_train.model.mixers import layer_indexer_widths, layer_windows


def attention_width(hf_config) -> int:
    """Query heads x head dim: the width of q and of the attention output, whose products QK^T and PV each cost
    2 FLOPs per multiply-add over it. Multi-head latent attention (Kimi Linear's full-attention layers) has q and k
    heads of qk_nope + qk_rope and v heads of v_head_dim (`head_dim` there is only the rotary part): its width is
    the mean of the two, so QK^T and PV together count what they cost."""
    text = text_config(hf_config)
    if getattr(text, "qk_nope_head_dim", None) and getattr(text, "v_head_dim", None):
        qk = text.qk_nope_head_dim + text.qk_rope_head_dim
        return text.num_attention_heads * (qk + text.v_head_dim) // 2
    # Gemma 4's global layers are wider than its sliding ones: the widest, as the planner's shape (the sliding
    # layers' windows attend ~window/T of a full layer's pairs, so their share of the count is small either way)
    head_dim = max(attention_heads_of(layer)[2] for layer in layer_configs(text))
    return text.num_attention_heads * head_dim


def non_embedding_params(model) -> int:
    """Parameters that do matrix work per token (embedding lookups excluded, lm_head included once). A mixture
    of experts' `experts` count k/E of their parameters (each token multiplies only its top-k experts': the
    active parameters)."""
    from ulysses_train.model.architecture import experts_per_token, router_of

    experts, top_k = experts_per_token(model.config)
    size = lambda p: getattr(p, "ds_numel", p.numel())  # noqa: E731  (ZeRO-3 keeps the full size there)
    embeddings = {id(model.get_input_embeddings().weight)}
    total = sum(size(p) for p in model.parameters() if id(p) not in embeddings)
    router = router_of(model)
    if experts and router is not None:
        for block in model.modules():
            bank = getattr(block, "experts", None)
            if isinstance(bank, torch.nn.Module) and any(isinstance(m, router[0]) for m in block.children()):
                total -= sum(size(p) for p in bank.parameters()) * (experts - top_k) // experts
    output = model.get_output_embeddings()
    if output is not None and id(output.weight) in embeddings:  # tied: lm_head still multiplies every token
        total += size(output.weight)
    return total


def attended_pairs(length: int, window=None) -> float:
    """(query, key) pairs a causal layer computes over one document of `length` tokens: length^2 / 2, or with a
    sliding window of W keys per query W^2 / 2 + (length - W) W once the document is longer than W."""
    if window is None or length <= window:
        return length**2 / 2
    return window**2 / 2 + (length - window) * window


def attention_forward_flops(tokens: int, width: int, layers: int, document_lengths=None, windows=None) -> float:
    """Causal attention's forward: QK^T and PV, 2 FLOPs per multiply-add, over the attended (query, key) pairs:
    2·T²·d_attn per full layer (d_attn = query heads x head dim). With document packing each document attends
    only to itself (`document_lengths`: the sequence's, padding segment included: the kernel computes it too);
    `windows`: each layer's sliding window or None (model/mixers layer_windows), default all full."""
    documents = [tokens] if document_lengths is None else [int(n) for n in document_lengths]
    windows = [None] * layers if windows is None else windows
    return sum(4 * width * attended_pairs(n, w) for w in windows for n in documents)


def indexer_forward_flops(tokens: int, indexers, document_lengths=None) -> float:
    """Indexed attention's indexers (model/mixers layer_indexer_widths: multiply-adds per scored pair, by layer):
    each scores every earlier key of its query's document, 2 FLOPs per multiply-add. Forward only: the indexer is
    not trained (its forward runs under no_grad)."""
    documents = [tokens] if document_lengths is None else [int(n) for n in document_lengths]
    return sum(2 * width * attended_pairs(n) for width in (indexers or ()) if width for n in documents)


def model_flops(params: int, tokens: int, width: int, layers: int, document_lengths=None, windows=None,
                indexers=None) -> float:
    """6·N·T for the weights plus causal attention, whose forward (attention_forward_flops) x3 counts fwd+bwd, plus
    the indexers' forward (indexer_forward_flops). Recompute is not counted: this is the work the model needs, not
    the work the step happened to do. The planner's step time starts from the same figure. N: the parameters a
    token multiplies (active ones)."""
    return (6 * params * tokens + 3 * attention_forward_flops(tokens, width, layers, document_lengths, windows)
            + indexer_forward_flops(tokens, indexers, document_lengths))


def model_flops_per_sequence(hf_config, params: int, tokens: int, document_lengths=None) -> float:
    """model_flops of one sequence of `tokens` for a transformers config; `params` do matrix work per token."""
    text = text_config(hf_config)
    return model_flops(params, tokens, attention_width(hf_config), text.num_hidden_layers, document_lengths,
                       layer_windows(hf_config), layer_indexer_widths(hf_config))
