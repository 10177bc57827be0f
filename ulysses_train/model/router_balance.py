"""The router's load-balancing (auxiliary) loss of a mixture-of-experts model, exact under Ulysses sp.

What the plain model adds for one sequence when `output_router_logits` is on (transformers'
`load_balancing_loss_func`, the Switch Transformer loss): over the R = (MoE layers x tokens) router rows of the
sequence, with p = softmax(router logits) per row and its top-k experts,

    aux = E * sum_e f_e * P_e,   f_e = (top-k picks of expert e) / R,   P_e = (sum of p_e over the rows) / R,

and the loss becomes `cross-entropy + router_aux_loss_coef * aux`.

Under sp a rank routes only its T/sp tokens, but f and P are means over the whole sequence. `f` is a count (it
has no gradient), and given f the loss is linear in the probabilities, so its gradient on one row's logits is

    d aux / d logits = p * (g - p . g),   g_e = E * f_e / R      (the softmax's Jacobian applied to g)

which needs only the sequence's counts. So: in forward every router call adds its rows' counts and
probability sums to this rank's totals (`RouterBalance.begin_forward` .. `end_forward`); after the forward the
totals are summed over the sp group (one all-reduce of 2E + 1 numbers per micro-step), which gives the exact f,
P and R of the sequence; in backward each router call's logits get the gradient above, injected by an autograd
function on the router's output (`_BalanceGradient`). Why not put `aux` into the graph: the MoE blocks run under
TiledMLP (forward without a graph, recomputed tile by tile in backward) and inside checkpointed layers
(recomputed in backward), so no tensor of the forward reaches the backward; the counts are recorded once, in the
forward phase, and the gradient is applied wherever the router's backward happens to run.

Padding: the sequence is padded at its end to a multiple of sp (parallel/layout.slice_sequence), and document
packing fills a row with a padding segment before that (`routed_tokens`); padded rows are not the plain model's
tokens, so they neither count nor get a gradient. With packing the loss is per row: the row's documents are one
sequence for f and P. The valid rows of a router call
are a prefix of it: the rank's valid rows minus the call's first row (`row_offset`, set by TiledMLP's tiles).

Several sequences in a step (micro-steps, data-parallel groups): the objective is
`CE + coef * sum_m (T_m / T) aux_m`, each sequence's aux weighted by its share of the step's tokens, as the
cross-entropy weights each token once; for sequences of one length that is the mean over sequences a plain
Trainer takes. The injected gradient is multiplied by ZeRO-3's divisor, as the cross-entropy's is
(training/step.py), so DeepSpeed's division leaves the gradient of the objective.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch

from ulysses_train.config import ConfigError
from ulysses_train.constants import IGNORE_INDEX
from ulysses_train.model.architecture import (NO_ROUTER_LOSS_TYPES, ROUTER_BALANCE_TYPES, router_logits_index,
                                             router_of, text_config)
from ulysses_train.sequence_parallel import SequenceParallel


def routed_tokens(sample: dict) -> int:
    """How many leading tokens of a sample the router loss counts: all of them, less document packing's padding
    segment (the last of `document_lengths` when it is one repeated token id without a label: what
    data/document_packing.py appends to fill the row). Per row, as transformers' `load_balancing_loss_func`
    counts a row whose padding its attention mask excludes; the sp padding lies beyond the sequence anyway."""
    ids, labels = sample["input_ids"].reshape(-1), sample["labels"].reshape(-1)
    lengths = sample.get("document_lengths")
    if lengths is None or len(lengths) < 2:
        return ids.numel()
    tail = int(torch.as_tensor(lengths).reshape(-1)[-1])
    padding = bool((labels[-tail:] == IGNORE_INDEX).all()) and bool((ids[-tail:] == ids[-1]).all())
    return ids.numel() - tail if padding else ids.numel()


def router_balance_requested(hf_config) -> bool:
    """The config asks for a router loss: `output_router_logits` on, in a family whose model has one."""
    text = text_config(hf_config)
    return bool(getattr(text, "output_router_logits", False)) and text.model_type not in NO_ROUTER_LOSS_TYPES


def router_loss_note(hf_config) -> str | None:
    """The `model changes:` phrase of a family that has no router loss although its config asks for router logits
    (NO_ROUTER_LOSS_TYPES); None for every other config."""
    text = text_config(hf_config)
    if getattr(text, "output_router_logits", False) and text.model_type in NO_ROUTER_LOSS_TYPES:
        return (f"no router loss ({text.model_type} has none: output_router_logits=true only returns the router "
                f"logits; the loss is the cross-entropy)")
    return None


def check_router_balance(hf_config) -> None:
    """Refuse a router loss whose function is not the one this module reproduces (ROUTER_BALANCE_TYPES)."""
    text = text_config(hf_config)
    if router_balance_requested(hf_config) and text.model_type not in ROUTER_BALANCE_TYPES:
        raise ConfigError(f"model type {text.model_type!r} has output_router_logits=true: its router's auxiliary "
                          f"loss is reproduced for {', '.join(ROUTER_BALANCE_TYPES)} only, so it would be silently "
                          f"dropped; set model.config_overrides: {{output_router_logits: false}} to train without it.")


class _BalanceGradient(torch.autograd.Function):
    """Identity on the router's routing weights; in backward also hands the router logits the load-balancing
    loss's gradient for this call's rows (module docstring)."""

    @staticmethod
    def forward(ctx, logits, weights, balance, valid_rows):
        ctx.save_for_backward(logits)
        ctx.balance, ctx.valid_rows = balance, valid_rows
        return weights.clone()

    @staticmethod
    def backward(ctx, grad_weights):
        (logits,) = ctx.saved_tensors
        return ctx.balance.logit_gradient(logits, ctx.valid_rows), grad_weights, None, None


class RouterBalance:
    """One model's load-balancing loss: the forward hook on its routers, this micro-step's totals, the gradient.

    The trainer calls, per micro-step: `begin_forward(valid_rows)`, the forward, `end_forward(weight, scale)`
    (sums the totals over the sp group, fixes the gradient), the backward; `aux` is then this sequence's loss.
    """

    def __init__(self, routers: list, logits_index: int, num_experts: int, top_k: int, coefficient: float,
                 sequence_parallel: SequenceParallel = SequenceParallel()):
        self.num_experts, self.top_k, self.coefficient = num_experts, top_k, coefficient
        self.logits_index = logits_index
        self.sequence_parallel = sequence_parallel
        self.recording = False
        self.valid_rows = 0
        self.row_offset = 0
        self.aux: Optional[float] = None
        self._gradient: Optional[torch.Tensor] = None  # g (module docstring), times the step's scale
        self._totals: Optional[torch.Tensor] = None  # [counts (E), probability sums (E), rows]
        self.handles = [router.register_forward_hook(self._after_router) for router in routers]

    # ---------------------------------------------------------------- per micro-step, from the trainer

    def begin_forward(self, valid_rows: int, device) -> None:
        """Start recording a forward over this rank's slice, whose first `valid_rows` rows are real tokens."""
        self.valid_rows, self.recording, self._gradient = valid_rows, True, None
        self._totals = torch.zeros(2 * self.num_experts + 1, dtype=torch.float64, device=device)

    def end_forward(self, weight: float, scale: float) -> float:
        """Stop recording, sum the totals over the sp group (every rank of it must call this), fix the gradient
        for the backward: `weight` is this sequence's share of the step's tokens, `scale` ZeRO-3's gradient divisor
        (DeepSpeed divides the summed gradients by it; training/step.py). Returns the sequence's `weight * aux`."""
        self.recording = False
        totals = self.sequence_parallel.sum(self._totals)
        counts, probability_sums, rows = totals[:self.num_experts], totals[self.num_experts:-1], totals[-1]
        rows = rows.clamp(min=1.0)
        fraction = counts / rows
        self.aux = float(self.num_experts * (fraction * probability_sums / rows).sum())
        self._gradient = (self.coefficient * weight * scale * self.num_experts * fraction / rows).float()
        return weight * self.aux

    @contextmanager
    def rows_from(self, offset: int):
        """Router calls inside start at row `offset` of this rank's slice (a TiledMLP tile)."""
        self.row_offset = offset
        try:
            yield
        finally:
            self.row_offset = 0

    # ---------------------------------------------------------------- hooks

    def _after_router(self, module, args, output):
        logits_index = router_logits_index(output, self.logits_index, self.num_experts)
        logits = output[logits_index]
        valid = max(0, min(logits.shape[0], self.valid_rows - self.row_offset))
        if self.recording:
            self._record(logits[:valid].detach())
        if not (torch.is_grad_enabled() and logits.requires_grad):
            return None
        weights_index = next(i for i, t in enumerate(output) if i != logits_index
                             and isinstance(t, torch.Tensor) and t.is_floating_point())
        output = list(output)
        output[weights_index] = _BalanceGradient.apply(logits, output[weights_index], self, valid)
        return tuple(output)

    def _record(self, logits: torch.Tensor) -> None:
        """Add one router call's counts and probability sums (as transformers computes them: softmax in the
        logits' dtype, its top-k)."""
        probabilities = torch.softmax(logits, dim=-1)
        picks = torch.topk(probabilities, self.top_k, dim=-1).indices.reshape(-1)
        E = self.num_experts
        self._totals[:E] += torch.bincount(picks, minlength=E).to(self._totals)
        self._totals[E:-1] += probabilities.double().sum(dim=0)
        self._totals[-1] += logits.shape[0]

    def logit_gradient(self, logits: torch.Tensor, valid: int) -> Optional[torch.Tensor]:
        """d(coef * weight * aux)/d logits of one router call's rows, times the step's scale; zero on padding."""
        if self._gradient is None:
            return None
        probabilities = torch.softmax(logits.detach().float(), dim=-1)
        g = self._gradient.to(logits.device)
        grad = probabilities * (g - (probabilities * g).sum(dim=-1, keepdim=True))
        grad[valid:] = 0
        return grad.to(logits.dtype)


def attach_router_balance(causal_lm, sequence_parallel: SequenceParallel = SequenceParallel()
                          ) -> Optional[RouterBalance]:
    """Hook the model's routers when its config asks for the load-balancing loss; None otherwise."""
    hf_config = causal_lm.config
    if not router_balance_requested(hf_config):
        return None
    check_router_balance(hf_config)
    router_class, logits_index = router_of(causal_lm)
    routers = [m for m in causal_lm.modules() if isinstance(m, router_class)]
    balance = RouterBalance(routers, logits_index, causal_lm.num_experts, causal_lm.num_experts_per_tok,
                            float(text_config(hf_config).router_aux_loss_coef), sequence_parallel)
    for block in causal_lm.modules():  # the expert blocks: their TiledMLP tiles tell the balance their first row
        if any(isinstance(m, router_class) for m in block.children()):
            block.router_balance = balance
    return balance
