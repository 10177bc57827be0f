"""The planner's terms of each token mixer, registered by the mixer's name (model/mixers: each Mixer's `name`; a
model's layers carry theirs in ModelShape.kinds, "" for a layer without a mixer). A new mixer adds one entry to
MIXER_TERMS (and a module with its terms, like linear_layer.py, kda_layer.py or mamba2_layer.py), not a branch in
estimate.py and forward_only.py, which only look its name up here (tests/test_mixer_registry.py: every registered
mixer has terms, and every entry here a mixer)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ulysses_train.planner.indexed_layer import (indexed_backward_extra_per_token, indexed_exchange_traffic,
                                                 indexed_exchange_width, indexed_forward_per_token,
                                                 indexed_saved_per_token)
from ulysses_train.planner.kda_layer import (kda_backward_extra_per_token, kda_exchange_width, kda_forward_per_token,
                                             kda_saved_per_token)
from ulysses_train.planner.layer import (attention_backward_extra_per_token, attention_exchange_traffic,
                                        attention_exchange_width, attention_forward_per_token,
                                        attention_saved_per_token)
from ulysses_train.planner.mamba2_layer import (mamba2_backward_extra_per_token, mamba2_exchange_traffic,
                                                mamba2_exchange_width,
                                                mamba2_forward_per_token, mamba2_saved_per_token)
from ulysses_train.planner.linear_layer import (exchange_width, gated_deltanet_backward_extra_per_token,
                                                gated_deltanet_saved_per_token, linear_forward_per_token,
                                                linear_widths)
from ulysses_train.planner.options import PlanOptions
from ulysses_train.planner.shapes import ATTENTION_KIND, ModelShape

PerToken = Callable[[ModelShape, PlanOptions], float]
NO_MIXER = ""
"""ModelShape.kinds' entry for a layer without a token mixer (model/mixers layer_mixer_names)."""


@dataclass(frozen=True)
class MixerTerms:
    """One mixer's memory per local token (bytes), each function taking (shape, options)."""

    saved: PerToken
    """What one recomputed layer of this kind saves for backward beyond its input, apart from the layer's two
    RMSNorms and its MLP (planned alike for every kind)."""
    saved_name: str
    """The plan's row for a recomputed layer of this kind's saved tensors (norms included)."""
    backward: PerToken
    """Extra at its backward's peak, over what it saved."""
    backward_name: str
    backward_why: str
    exchange_width: Callable[[ModelShape, PlanOptions], float]
    """Channels per token its largest all-to-all carries while the backward's other buffers are held (the send copy
    and the receive buffer hold that many); 0 where its exchanges never meet its peak."""
    exchange_traffic: Callable[[ModelShape, PlanOptions], tuple[float, float]]
    """(channels per local token in the dtype that one pass of its all-to-alls sends to the head layout, channels
    that come back) (planner/exchange_time.py)."""
    forward: PerToken
    """Its forward under no_grad (the evaluation forward, forward_only.py), beyond the residual stream."""
    forward_why: str


MIXER_TERMS: dict[str, MixerTerms] = {
    ATTENTION_KIND: MixerTerms(
        saved=attention_saved_per_token, saved_name="layer: recomputed saved tensors",
        backward=attention_backward_extra_per_token, backward_name="layer: attention backward",
        backward_why="dq, dk, dv, fp32 dq accumulator, GQA-expanded dk/dv, output gradient",
        exchange_width=attention_exchange_width, exchange_traffic=attention_exchange_traffic,
        forward=attention_forward_per_token,
        forward_why="input norm output, q/k/v (and after the all-to-all), GQA expansion, kernel output"),
    "gated_deltanet": MixerTerms(
        saved=gated_deltanet_saved_per_token, saved_name="layer: recomputed saved (linear)",
        backward=gated_deltanet_backward_extra_per_token, backward_name="layer: Gated DeltaNet backward",
        backward_why="the gated norm's fp32 gradients, or fla's recomputed chunk states and gradients",
        exchange_width=lambda m, o: exchange_width(m),
        exchange_traffic=lambda m, o: (exchange_width(m), linear_widths(m)[2]),  # q, k, v, a, b; the output
        forward=linear_forward_per_token,
        forward_why="a Gated DeltaNet's conv, rule, gated norm"),
    "kimi_delta": MixerTerms(
        saved=kda_saved_per_token, saved_name="layer: recomputed saved (kda)",
        backward=kda_backward_extra_per_token, backward_name="layer: Kimi Delta Attention backward",
        backward_why="the gated norm's fp32 gradients, or fla's chunk_kda_bwd: recomputed decay, w, u, states, "
                     "fp32 dq/dk/dg twice",
        exchange_width=lambda m, o: kda_exchange_width(m),
        exchange_traffic=lambda m, o: (kda_exchange_width(m), linear_widths(m)[2]),  # q, k, v, gate, beta; output
        forward=kda_forward_per_token,
        forward_why="a Kimi Delta Attention layer's conv, chunk_kda, gated norm"),
    "mamba2": MixerTerms(
        saved=mamba2_saved_per_token, saved_name="layer: recomputed saved (mamba2)",
        backward=mamba2_backward_extra_per_token, backward_name="layer: Mamba2 backward",
        backward_why="the gated norm's fp32 gradients, or fla's chunk_simple_gla backward: recomputed chunk states "
                     "and their gradients, dq/dk/dv, fp32 dg",
        exchange_width=lambda m, o: mamba2_exchange_width(m), exchange_traffic=mamba2_exchange_traffic,
        forward=mamba2_forward_per_token,
        forward_why="a Mamba2 layer's conv, chunk_simple_gla, D skip, gated norm"),
    "indexed_attention": MixerTerms(
        saved=indexed_saved_per_token, saved_name="layer: recomputed saved (indexed)",
        backward=indexed_backward_extra_per_token, backward_name="layer: indexed attention backward",
        backward_why="the chosen keys' and probabilities' gradients, the gathered latent's gradient, one chunk",
        exchange_width=indexed_exchange_width, exchange_traffic=indexed_exchange_traffic,
        forward=indexed_forward_per_token,
        forward_why="q, the latent and index keys of the whole sequence, one indexer and one attention chunk"),
    NO_MIXER: MixerTerms(
        saved=lambda m, o: 0.0, saved_name="layer: recomputed saved (MLP only)",
        backward=lambda m, o: 0.0, backward_name="layer: no token mixer", backward_why="a feed-forward block only",
        exchange_width=lambda m, o: 0, exchange_traffic=lambda m, o: (0, 0), forward=lambda m, o: 0.0,
        forward_why="a feed-forward block only"),
}
"""mixer name -> its terms (attention: planner/layer.py; Gated DeltaNet: linear_layer.py; KDA: kda_layer.py; Mamba2:
mamba2_layer.py; indexed attention: indexed_layer.py); NO_MIXER: a layer with only an MLP or experts (ModelShape.separate_blocks)."""


def kinds_of(m: ModelShape) -> list[str]:
    """The planner kinds of the model's layers, each once, in MIXER_TERMS order (so ties between kinds resolve the
    same way for every model)."""
    present = set(m.layer_kinds)
    return [kind for kind in MIXER_TERMS if kind in present]
