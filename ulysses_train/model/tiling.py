"""TiledMLP: run each decoder layer's MLP (dense, or a whole mixture-of-experts block) over sequence tiles so its
intermediates stay small.

`down(act(gate(x)) * up(x))` creates four seq x intermediate tensors (at 1M tokens and intermediate 9728:
19 GB each). DeepSpeed's `TiledMLP` autograd function runs the MLP tile by tile in forward without keeping
anything, and again tile by tile in backward; only one tile's intermediates exist at a time. It costs one
extra MLP forward per layer (three in all with gradient checkpointing).

Tile count (mlp_tile_count): ceil(local tokens / hidden_size), so a tile holds about hidden_size
tokens. Under ZeRO-3 every tile gathers the MLP's partitioned weights, so all ranks must run the same number
of tiles or the gathers deadlock; ranks can hold different lengths (different samples per data-parallel
group), so the count comes from the longest local slice, agreed by one all-reduce MAX over the default group
(the group ZeRO-3 gathers over) in a forward pre-hook of the decoder: once per forward, and the checkpoint's
recompute in backward reuses it. A rank whose slice cannot be split into exactly that many tiles pads the
slice with zero rows (they add nothing to outputs or gradients).

Each tiled MLP is a ZeRO-3 *leaf module* (DeepSpeed's `set_z3_leaf_module`): its weights are gathered once
when the MLP is entered and its gradients reduced once after its backward, instead of ZeRO-3 hooking each
projection at every tile. Without it every tile's projection calls join ZeRO-3's module trace (at 64K tokens
of Qwen3-0.6B: 64 tiles x 3 projections x 4 passes per layer), and DeepSpeed's release decision scans the
rest of that trace once per trace entry in the first step that uses the trace (`__params_to_release`,
quadratic in its length, then cached): the second training step took 80 s longer than the others.

`model.tiled_mlp`: `true` always tiles; `false` never; `auto` tiles when the longest local slice exceeds
AUTO_TOKENS_PER_HIDDEN x hidden_size tokens: from there on the MLP's intermediates (about 15 layer inputs'
worth for Qwen3's intermediate/hidden ratio) are the largest tensors of a layer's recompute, and below it
they are small enough that the extra MLP forward is not worth paying.
"""
from __future__ import annotations

import itertools
import logging
import math
from typing import Optional

import torch
import torch.nn.functional as F

from ulysses_train.config import TILED_MLP_MODES, ConfigError
from ulysses_train.model.architecture import (MLPS_RETURNING_ROUTER_SCORES, decoder_of, feed_forward_blocks,
                                             is_dense_mlp, router_of, text_config)
from ulysses_train.model.swap import stock_class, swap_class

logger = logging.getLogger(__name__)

AUTO_TOKENS_PER_HIDDEN = 4


def tiled_mlp_mode(value) -> str:
    """`model.tiled_mlp` as one of auto | true | false (YAML may give a bool)."""
    mode = str(value).lower()
    if mode not in TILED_MLP_MODES:
        raise ConfigError(f"model.tiled_mlp={value!r} is not valid; choose one of {', '.join(TILED_MLP_MODES)}.")
    return mode


def agree_max(value: int, device: torch.device) -> int:
    """The largest `value` over all ranks (the value itself without a process group)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return int(tensor.item())


def _chunk_count(length: int, tiles: int) -> int:
    """How many pieces `torch.chunk` really returns (fewer than asked when the pieces would be uneven)."""
    return -(-length // -(-length // tiles)) if length else 0


def mlp_tile_count(longest_local_tokens: int, hidden_size: int) -> int:
    """TiledMLP's tile count: ceil(tokens / hidden_size), so a tile holds about hidden_size tokens. One rule for the trainer (TiledMLPSchedule) and the planner's MLP term."""
    return max(1, math.ceil(longest_local_tokens / hidden_size))


def auto_tiles(longest_local_tokens: int, hidden_size: int) -> bool:
    """Whether `model.tiled_mlp: auto` tiles: above AUTO_TOKENS_PER_HIDDEN x hidden_size local tokens (why: the
    module docstring). The trainer's schedule and the planner's options_from_run both ask this."""
    return longest_local_tokens > AUTO_TOKENS_PER_HIDDEN * hidden_size


class TiledMLPSchedule:
    """The tile count of the current forward, agreed across ranks before the first layer runs."""

    def __init__(self, mode: str, hidden_size: int):
        self.mode = mode
        self.hidden_size = hidden_size
        self.num_tiles: Optional[int] = None  # None: plain MLP this forward

    def tiles_for(self, longest_local_tokens: int) -> Optional[int]:
        if self.mode == "auto" and not auto_tiles(longest_local_tokens, self.hidden_size):
            return None
        return mlp_tile_count(longest_local_tokens, self.hidden_size)

    def before_decoder(self, module, args, kwargs):
        """Forward pre-hook of the decoder: agree on the longest local slice, derive the tile count."""
        tokens = kwargs.get("input_ids")
        if tokens is None and args:
            tokens = args[0]
        if tokens is not None:
            local, device = tokens.shape[-1], tokens.device
        else:
            embeds = kwargs["inputs_embeds"]
            local, device = embeds.shape[-2], embeds.device
        self.num_tiles = self.tiles_for(agree_max(local, device))


def _mlp_forward(mlp, x):
    """The stock MLP's forward (the module's own is the tiled one) on one tile, its hidden states only: GPT-OSS's
    MLP also returns its router scores, which its layer drops (tiled_mlp_forward puts a None in their place)."""
    flat = x.dim() == 2  # TiledMLP's backward hands [rows, hidden] tiles; mixture-of-experts blocks want a batch
    out = stock_class(mlp).forward(mlp, x.unsqueeze(0) if flat else x)
    out = out[0] if isinstance(out, tuple) else out
    return out.squeeze(0) if flat else out


def _tiled_forward(self, x):
    """The forward of `Tiled<MLP>`."""
    return tiled_mlp_forward(self, self.tiled_mlp_schedule, x)


def tiled_mlp_forward(mlp, schedule: TiledMLPSchedule, x: torch.Tensor):
    """Replacement forward of one MLP module (dense or mixture of experts)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    tiles = schedule.num_tiles
    if tiles is None:
        return stock_class(mlp).forward(mlp, x)
    length = x.shape[-2]
    pad = 0
    if _chunk_count(length, tiles) != tiles or _chunk_count(x.shape[:-1].numel(), tiles) != tiles:
        pad = -(-length // tiles) * tiles - length
        x = F.pad(x, (0, 0, 0, pad))
    # compute_params: ZeRO-3 adds these gradients to its reduce bucket once, after the last tile
    tile_rows = -(-(length + pad) // tiles)  # torch.chunk's piece size
    out = TiledMLP.apply(_tile_function(mlp, tile_rows, tiles), mlp, x, tiles, list(mlp.parameters()))
    out = out[..., :length, :] if pad else out
    return (out, None) if getattr(mlp, "returns_router_scores", False) else out


def _tile_function(mlp, tile_rows: int, tiles: int):
    """What TiledMLP calls per tile. A router loss (router_balance.py) must know which rows of the slice a tile
    holds: TiledMLP runs the tiles in order, in forward and again in backward, so call k holds tile k mod tiles."""
    balance = getattr(mlp, "router_balance", None)
    if balance is None:
        return _mlp_forward
    calls = itertools.count()

    def tile_forward(module, x):
        with balance.rows_from((next(calls) % tiles) * tile_rows):
            return _mlp_forward(module, x)
    return tile_forward


def tileable_blocks(model) -> tuple[list, list]:
    """(every decoder layer's MLP, those TiledMLP can tile): dense MLPs, gated `down(act(gate(x)) * up(x))` or
    ungated `down(act(up(x)))` (architecture.is_dense_mlp), and mixture-of-experts blocks (they hold the model's
    router, architecture.router_of, and Nemotron-H's its shared expert), whose routing is per token, so running them
    over tiles of the sequence computes exactly what one call over all of it does. A layer with no MLP (Nemotron-H's
    Mamba2 and attention layers: one module per layer, architecture.feed_forward_blocks) has nothing to tile; a layer
    with two (Granite's experts and shared MLP) has both tiled."""
    from ulysses_train.model.recompute import decoder_layers

    router = router_of(model)
    layers = decoder_layers(model)
    mlps = []
    for layer in layers:  # one module per layer (Nemotron-H's `mixer`): only some layers have a feed-forward block
        mlps += feed_forward_blocks(layer) or ([] if getattr(layer, "mixer", None) is not None else [None])

    def tileable(mlp):
        if mlp is None:
            return False
        if is_dense_mlp(mlp):
            return True
        return router is not None and any(isinstance(m, router[0]) for m in mlp.children())
    return mlps, [m for m in mlps if tileable(m)]


def apply_tiled_mlp(model, mode) -> Optional[TiledMLPSchedule]:
    """Route every decoder layer's MLP through TiledMLP (per `mode`); returns the schedule or None.

    Must run before DeepSpeed wraps the model (the decoder pre-hook must be in place for the first forward).
    Mixture-of-experts blocks are tiled whole (router and experts, tileable_blocks): a ZeRO-3 leaf module gathers
    all of its experts once per call, so ranks routing their tiles to different experts still gather the same.
    """
    mode = tiled_mlp_mode(mode)
    model.tiled_mlp_schedule = None
    if mode == "false":
        return None
    from deepspeed.utils import set_z3_leaf_module

    mlps, tileable = tileable_blocks(model)
    if len(tileable) != len(mlps) or not mlps:
        if mode == "true":
            raise ConfigError("model.tiled_mlp=true needs a dense MLP (gate_proj/up_proj/down_proj, or up_proj/"
                              "down_proj) or a mixture-of-experts block with the model's router in every decoder "
                              "layer that has one; this model has other blocks. Set model.tiled_mlp to false.")
        logger.info("tiled MLP: the model's MLP blocks are not all dense or mixtures of experts; left untiled.")
        return None
    text = text_config(model.config)
    schedule = TiledMLPSchedule(mode, text.hidden_size)
    decoder_of(model).register_forward_pre_hook(schedule.before_decoder, with_kwargs=True)
    for mlp in tileable:
        mlp.tiled_mlp_schedule = schedule
        mlp.returns_router_scores = type(mlp).__name__ in MLPS_RETURNING_ROUTER_SCORES
        swap_class(mlp, "Tiled", forward=_tiled_forward)
        set_z3_leaf_module(mlp, True)  # one gather and one gradient reduction per MLP, not per tile (docstring)
    model.tiled_mlp_schedule = schedule
    return schedule
