"""The indexer's KL loss (`model.indexer_loss_coef` > 0): DeepSeek-V3.2's sparse training stage, which trains the
lightning indexer of indexed-attention layers (model/mixers/indexed_attention.py) toward the main attention.

For each query t of a layer with an indexer, over the keys it chose and may see (its document's, causal):

    p_t = sum over heads of the attention's probabilities, L1-normalised   (the target; no gradient)
    q_t = softmax of the indexer's scores                                  (indexed_kernels.chosen_scores_of)
    KL_t = sum_j p_tj * (log(p_tj + 1e-10) - log(q_tj + 1e-10))

as Megatron-Core's `compute_dsa_indexer_loss` computes it with `sparse_loss` (the 1e-10 included). The objective is
`cross-entropy + coef * sum_layers sum_t KL_t / T`: T the step's real tokens (sp padding and document packing's
padding segment are not tokens), so each sequence's per-layer mean KL is weighted by its share of the step's
tokens, as the router loss weighs its sequences (router_balance.py); for one sequence it is Megatron's per-layer
mean. The indexer's inputs are detached, so only the indexer learns from it, and from nothing else (its choice of
keys has no gradient): DeepSeek's "the indexer input is detached from the computational graph".

Under sp each rank holds its queries and the whole sequence's index keys, gathered with their gradient
(SequenceParallel.gather_sequence), so the gradient of a key reached by other ranks' queries returns to the rank
that computed it. The loss's gradient joins the backward through the layer's output (AttachedLoss, as Megatron's
auxiliary-loss scalers do): the layer runs inside activation checkpointing, where no tensor of the first forward
survives to the backward, so whichever forward builds the graph that backward runs (the first one, or the
recomputation) carries the loss with it, once. Its value is tallied only between begin_forward and end_forward, not
again when the layer is recomputed. The KL runs in chunks of queries, each checkpointed: what it holds for backward
is its inputs."""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ulysses_train.model.mixers.indexed_kernels import (ATTENTION_PICK_BUDGET, chosen_scores_of, chunk_probabilities,
                                                         gather_keys, head_weights, index_queries, query_chunks)

EPSILON = 1e-10
"""Inside both logarithms, as Megatron-Core's loss (an unseen key's zero probabilities stay finite)."""


class AttachedLoss(torch.autograd.Function):
    """The layer's output unchanged, with `loss` riding along: backward passes the output's gradient through and
    gives `loss` a gradient of one, so the loss's own backward runs with the layer's."""

    @staticmethod
    def forward(ctx, output, loss):
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, torch.ones((), dtype=torch.float32, device=grad_output.device)


class IndexerLoss:
    """The KL loss's state on a model (one object shared by its indexed layers): the coefficient, and for the
    micro-step being run the weight of one query's KL and how many of this rank's queries are real tokens."""

    def __init__(self, coefficient: float):
        self.coefficient = coefficient
        self.gradient_weight = 0.0
        """coef x ZeRO-3's gradient divisor / T: the gradient of one query's KL (the cross-entropy's scaling)."""
        self.value_weight = 0.0
        """1 / T: one query's share of the tally (the KL term before the coefficient)."""
        self.valid_tokens = 0
        self.tally = None
        self.recording = False

    def begin_forward(self, valid_tokens: int, step_tokens: int, gradient_divisor: float) -> None:
        """Before a micro-step's forward: this rank's first `valid_tokens` queries are the sequence's real tokens,
        and the step has `step_tokens` of them over every rank and micro-step."""
        self.valid_tokens, self.recording, self.tally = valid_tokens, True, None
        self.value_weight = 1.0 / max(step_tokens, 1)
        self.gradient_weight = self.coefficient * gradient_divisor * self.value_weight

    def end_forward(self) -> float:
        """After the forward: this rank's tally of the micro-step (sum over its queries and layers of KL / T)."""
        self.recording = False
        return 0.0 if self.tally is None else float(self.tally)

    def active(self) -> bool:
        """Whether a forward needs the KL: its gradient (a graph is being built) or its value (the tally)."""
        return torch.is_grad_enabled() or self.recording

    def attach(self, output: torch.Tensor, kl_sum: torch.Tensor) -> torch.Tensor:
        """Tally a layer's summed KL (while recording) and attach its weighted gradient to the layer's output."""
        if self.recording:
            value = kl_sum.detach() * self.value_weight
            self.tally = value if self.tally is None else self.tally + value
        if not torch.is_grad_enabled() or not kl_sum.requires_grad:
            return output
        return AttachedLoss.apply(output, kl_sum * self.gradient_weight)


def chunk_kl(form, index_scale: float, queries, weights, index_keys, attention_query, attention_keys, chosen, visible,
             counted, attention_scale: float, sinks):
    """The summed KL of one chunk of queries (module docstring): their index queries [B, c, Hi, D] and head weights
    [B, c, Hi] against the chosen index keys, their attention's query against the chosen latent keys, over its
    `counted` [c] queries."""
    logits = chosen_scores_of(form, index_scale, queries, weights, gather_keys(index_keys, chosen))
    log_q = torch.log(torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1) + EPSILON)  # [B, c, k]
    with torch.no_grad():
        probs = chunk_probabilities(attention_query, gather_keys(attention_keys, chosen), visible, attention_scale,
                                    sinks)
        target = probs.sum(dim=2)
        target = target / target.sum(dim=-1, keepdim=True)  # [B, c, k]
    kl = (target * (torch.log(target + EPSILON) - log_q)).sum(dim=-1)  # [B, c]
    return (kl * counted[None, :]).sum()


def indexer_kl(layer, form, hidden, q_resid, cos, sin, index_keys, attention_query, attention_keys, chosen, visible,
               scale: float, sinks) -> torch.Tensor:
    """A layer's KL summed over this rank's real queries: hidden [B, t, hidden] and q_resid detached, the whole
    sequence's index keys [B, T, D] (gathered with their gradient), the attention's query [B, t, H, R + r] and
    latent keys [B, T, R + r] (detached), the chosen keys [B, t, k] and which of them each query sees. The indexer's
    projections run once for the slice (a module call per chunk would be a ZeRO-3 trace entry per chunk)."""
    indexer, loss = layer.indexer, layer.indexer_loss
    queries, weights = index_queries(indexer, form, q_resid, cos, sin), head_weights(indexer, form, hidden)
    counted = (torch.arange(hidden.shape[1], device=hidden.device) < loss.valid_tokens).to(torch.float32)
    top, heads = chosen.shape[-1], attention_query.shape[2]
    per_query = top * (4 * (3 * indexer.n_heads + 2 * index_keys.shape[-1] + 2 * heads + attention_keys.shape[-1]))
    total = hidden.new_zeros((), dtype=torch.float32)
    for rows in query_chunks(hidden.shape[1], per_query, ATTENTION_PICK_BUDGET):
        total = total + checkpoint(chunk_kl, form, indexer.softmax_scale, queries[:, rows], weights[:, rows],
                                   index_keys, attention_query[:, rows], attention_keys, chosen[:, rows],
                                   visible[:, rows], counted[rows], scale, sinks, use_reentrant=False)
    return total
