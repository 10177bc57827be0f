"""Mamba2 layers (Nemotron-H and Nemotron 3, Granite 4.0-H, Bamba) under Ulysses, exactly.

A Mamba2 layer's state space model (SSD) is independent per head: head h keeps its own state [d_state, head_dim],
decays it by exp(dt_h * A_h) and adds dt_h * B_t x_t, where B (and the read-out C) come from the head's group (the
heads split into `n_groups` groups sharing B and C). Its causal conv1d is depthwise over the channels [x | B | C].
The sequence is the only coupling, so, as for attention, one all-to-all (recurrent.py's shared shape) trades each
rank's slice of the sequence (all heads) for the whole sequence of `heads / sp` heads, carrying x, B, C and dt in
one message; the conv (the filters of those channels) and the SSD run over the whole sequence, restarting at every
packed document; one all-to-all brings the output back to the slice, where the gated RMSNorm (per group: each token
holds all its groups there) and `out_proj` run.

Groups. When sp divides `n_groups`, each rank takes its groups' B and C (its heads' groups). When sp is a multiple of
`n_groups` (Granite 4.0-H has one group), each group's B and C are repeated to the sp/n_groups ranks whose heads use
it before the exchange, as DeepSpeed replicates KV heads; the repeat's backward sums the copies' gradients, so the
gradients stay exact. Other sp are refused (mamba2_sp_problem). sp must divide the heads.

The math is transformers' own: dt = clamp(softplus(dt + dt_bias), time_step_limit), A = -exp(A_log), the D skip,
the gated norm and the casts, all read from each family's modeling file (5.17 and 5.25). On CPU its torch functions
(`causal_conv1d_fn`, `mamba2_chunk_scan`, unwrapped) run per document. On CUDA with flash-linear-attention, fla's
causal conv1d and `chunk_simple_gla`, which computes the same recurrence (fla's own tests map Mamba2's chunk scan
onto it): q = C, k = dt * B, v = x, per-head log decay g = dt * A, scale 1, with `cu_seqlens` for the documents;
the D skip is added after. Where fla refuses simple GLA's backward (Hopper with Triton 3.4 to 3.7.0), `chunk_gla`
with that decay on every key channel (fla_decay_scan). The conv's filters and bias and the SSD parameters (A_log, dt_bias, D) are read directly,
so they are registered with ZeRO-3 as external parameters of the layer.

Shapes (recurrent.py's names, plus): I = heads x head_dim (x's width), G groups, N d_state, P head_dim."""
from __future__ import annotations

import functools
import importlib.util
from typing import Optional

import torch
import torch.nn.functional as F

import ulysses_train.model.mixers.recurrent as recurrent
from ulysses_train.kernel_pins import INSTALL_LINE
from ulysses_train.families import linear_mixer_types
from ulysses_train.model.mixers.protocol import HeadCounts, Mixer
from ulysses_train.model.swap import stock_class, swap_class
from ulysses_train.sequence_parallel import SequenceParallel

NAME = "mamba2"
MAMBA2_TYPES = linear_mixer_types(NAME)
"""Text-model types whose `linear_attention` layers are Mamba2 (MAMBA2_CLASSES), from the family records
(Family.linear_mixer)."""
MAMBA2_CLASSES = ("NemotronHMamba2Mixer", "GraniteMoeHybridMambaLayer", "BambaMixer")
"""Their modules, whose forward this module replaces (checked against each one's transformers forward)."""


def mamba2_head_units(text) -> dict:
    """{"heads", "groups"} of the model's Mamba2 layers; {} without any."""
    if not MAMBA2.in_model(text):
        return {}
    heads = getattr(text, "mamba_num_heads", None) or getattr(text, "mamba_n_heads")
    return {"heads": heads, "groups": getattr(text, "n_groups", None) or getattr(text, "mamba_n_groups")}


def mamba2_planner_dims(text) -> dict:
    """What the planner's Mamba2 terms read (planner/mamba2_layer.py): head width P, state size N, conv width."""
    if not MAMBA2.in_model(text):
        return {}
    return {"head dim": getattr(text, "mamba_head_dim", None) or getattr(text, "mamba_d_head"),
            "state": getattr(text, "ssm_state_size", None) or getattr(text, "mamba_d_state"),
            "conv": getattr(text, "conv_kernel", None) or getattr(text, "mamba_d_conv")}


def mamba2_sp_problem(counts: HeadCounts, sp: int, key: str) -> Optional[str]:
    """Why sp cannot split the Mamba2 heads and groups, or None: sp divides the heads, and divides the groups or
    is a multiple of them (each group then repeated to the ranks whose heads read it)."""
    units = counts.of(MAMBA2.name)
    if not units:
        return None
    heads, groups = units["heads"], units["groups"]
    if heads % sp:
        return (f"the model's Mamba2 layers have {heads} heads, not divisible by {key}={sp}: each rank runs the "
                f"whole sequence of heads/sp of them")
    if groups % sp and sp % groups:
        return (f"the model's Mamba2 layers have {groups} groups and {key}={sp}: sp must divide the groups or be a "
                f"multiple of them (then each group's B and C are repeated to the ranks that read them)")
    return None


def owned_groups(groups: int, rank: int, sp: int) -> range:
    """The groups whose B and C rank `rank` holds after the exchange: its share when sp divides the groups, else
    the one group its heads belong to (sp a multiple of the groups)."""
    if groups % sp == 0:
        return range(rank * groups // sp, (rank + 1) * groups // sp)
    return range(rank * groups // sp, rank * groups // sp + 1)


def groups_per_rank_unit(bc: torch.Tensor, sp: int) -> torch.Tensor:
    """B or C [B, t, G, N] laid out so that to_head_shards gives each rank its owned_groups: as they are when sp
    divides G, else each group repeated sp/G times (unit r = the group of rank r's heads)."""
    groups = bc.shape[2]
    return bc if groups % sp == 0 else bc.repeat_interleave(sp // groups, dim=2)


def conv_channels(self, rank: int, sp: int) -> Optional[torch.Tensor]:
    """Indices of the conv channels [x | B | C] rank `rank` holds after the exchange (None: all, sp=1)."""
    if sp == 1:
        return None
    width, state = self.intermediate_size, self.ssm_state_size
    x = recurrent.local_channels((width,), rank, sp)
    owned = owned_groups(self.n_groups, rank, sp)
    group = torch.arange(owned.start * state, owned.stop * state)
    return torch.cat([x, width + group, width + self.n_groups * state + group])


def ssd_scan(module, x, dt, a, b, c, d, dt_bias, cu_seq_lens):
    """The SSD over the whole sequence of this rank's heads, a fresh state at every document, D skip included.
    x [B, T, h, P], dt [B, T, h] (before bias and softplus), a, d, dt_bias [h], b, c [B, T, g, N]."""
    if recurrent.runs_fla(module):
        return fla_ssd_scan(module, x, dt, a, b, c, d, dt_bias, cu_seq_lens)
    scan = recurrent.torch_function(module, "mamba2_chunk_scan")
    return recurrent.per_document(
        lambda *pieces: scan(pieces[0], pieces[1], a, pieces[2], pieces[3], chunk_size=module.chunk_size, D=d,
                             dt_bias=dt_bias, dt_softplus=True, dt_limit=module.time_step_limit),
        [x, dt, b, c], cu_seq_lens)


@functools.lru_cache(maxsize=None)
def simple_gla_backward_runs() -> bool:
    """Whether fla runs chunk_simple_gla's backward on this GPU: fla 0.6 refuses its gated chunk_bwd_dqkwg on Hopper
    with Triton 3.4 to 3.7.0 (fla issue 640), and its TileLang backend declines it too (simple GLA keeps its states
    in fp32, which that backend does not take): found on the H200 image's Triton 3.6.0 with tilelang installed."""
    import triton

    return recurrent.fla_backward_problem(torch.cuda.get_device_capability(), triton.__version__, False) is None


def fla_decay_scan(q, k, v, g, cu, variant: str):
    """q, k [B, T, h, N], v [B, T, h, P], per-head log decay g [B, T, h] (fp32) through fla: chunk_simple_gla, or
    (variant chunk_gla: where its backward does not run, choose_mamba2_kernel) chunk_gla with the head's decay on
    every key channel (the same recurrence; chunk_gla's backward kernels are its own)."""
    if variant == "chunk_simple_gla":
        from fla.ops.simple_gla import chunk_simple_gla

        return chunk_simple_gla(q, k, v, g=g, scale=1.0, cu_seqlens=cu)[0]
    from fla.ops.gla import chunk_gla

    return chunk_gla(q, k, v, g=g[..., None].expand(*q.shape).contiguous(), scale=1.0, cu_seqlens=cu)[0]


def fla_ssd_scan(module, x, dt, a, b, c, d, dt_bias, cu_seq_lens):
    """The SSD through fla (module docstring's mapping: fla_decay_scan), the decay in fp32, q, k, v in x's dtype."""
    low, high = module.time_step_limit
    dt = F.softplus(dt.float() + dt_bias.float()).clamp(min=low, max=high)  # [B, T, h]
    per_group = x.shape[2] // b.shape[2]
    q, k = (t.repeat_interleave(per_group, dim=2) for t in (c, b))  # [B, T, h, N]: each head its group's
    k = k * dt.to(k.dtype)[..., None]  # in the dtype: an fp32 product would save an fp32 copy of B per head
    cu = None if cu_seq_lens is None else cu_seq_lens.to(x.device, torch.long)
    out = fla_decay_scan(q.to(x.dtype), k, x, dt * a.float(), cu, module.kernel_variant)
    return out.float() + d.float()[:, None] * x.float()  # [B, T, h, P], fp32 as transformers' scan returns it


def ulysses_mamba2_forward(self, hidden_states, cache=None, attention_mask=None, cache_params=None, **kwargs):
    """The layer's forward on this rank's slice of the sequence (module docstring); training only (no cache;
    padding sits after every real token of a causal layer, so no mask)."""
    if cache is not None or cache_params is not None:
        raise RuntimeError("the Ulysses Mamba2 forward is for training: no cache")
    batch, length, _ = hidden_states.shape
    sequence_parallel = recurrent.sequence_parallel_of(self)
    sp, rank = sequence_parallel.size, sequence_parallel.rank
    groups_width = self.n_groups * self.ssm_state_size
    gate, x, b, c, dt = self.in_proj(hidden_states).split(  # [B, t, I], [B, t, I], [B, t, G*N] x 2, [B, t, H]
        [self.intermediate_size, self.intermediate_size, groups_width, groups_width, self.num_heads], dim=-1)
    x = x.reshape(batch, length, self.num_heads, self.head_dim)  # [B, t, H, P]
    b, c = (groups_per_rank_unit(t.reshape(batch, length, self.n_groups, -1), sp) for t in (b, c))  # [B, t, G', N]
    x, b, c, dt = sequence_parallel.to_head_shards([x, b, c, dt])  # [B, T, H/sp, P], [B, T, g, N] x 2, [B, T, H/sp]
    total = x.shape[1]
    channels = conv_channels(self, rank, sp)
    weight = recurrent.owned_filters(self.conv1d.weight.squeeze(1), channels)  # [C', W]
    bias = None if self.conv1d.bias is None else recurrent.owned_filters(self.conv1d.bias, channels)
    cu_seq_lens = kwargs.get("cu_seq_lens_q")
    mixed = recurrent.causal_conv(self, torch.cat([t.flatten(2) for t in (x, b, c)], dim=-1), weight,
                                  cu_seq_lens, bias=bias)  # [B, T, C']: x | B | C channels of this rank
    x, b, c = torch.split(mixed, [x[0, 0].numel(), b[0, 0].numel(), c[0, 0].numel()], dim=-1)
    heads = slice(rank * self.num_heads // sp, (rank + 1) * self.num_heads // sp)
    x = x.reshape(batch, total, -1, self.head_dim)  # [B, T, H/sp, P]
    b, c = (t.reshape(batch, total, -1, self.ssm_state_size) for t in (b, c))  # [B, T, g, N]
    a = -torch.exp(self.A_log[heads].float())
    y = ssd_scan(self, x, dt, a, b, c, self.D[heads], self.dt_bias[heads], cu_seq_lens)
    y = sequence_parallel.to_sequence_shards(y)  # [B, t, H, P]
    y = self.norm(y.reshape(batch, length, self.intermediate_size), gate)  # per group, on the slice
    return self.out_proj(y.to(hidden_states.dtype))


def mamba2_layers(model) -> list:
    return [m for m in model.modules() if stock_class(m).__name__ in MAMBA2_CLASSES]


MAMBA2_VARIANTS = {
    recurrent.TORCH: "transformers' torch conv1d, chunk scan and gated RMSNorm",
    "chunk_simple_gla": "fla's causal conv1d and chunk_simple_gla, transformers' gated RMSNorm",
    "chunk_gla": "fla's causal conv1d and chunk_gla (chunk_simple_gla's backward refused here), transformers' "
                 "gated RMSNorm",
}
"""Mamba2's kernel variants (Mixer.kernel_variants), in words for the `model changes:` line."""


def choose_mamba2_kernel(dims: dict, cuda: bool) -> str:
    """On a GPU run with fla's simple-GLA kernels: chunk_simple_gla, or chunk_gla where fla refuses its backward
    (simple_gla_backward_runs); transformers' torch functions elsewhere."""
    variant = recurrent.fla_or_torch(cuda, simple_gla_available(), "chunk_simple_gla")
    return "chunk_gla" if variant == "chunk_simple_gla" and not simple_gla_backward_runs() else variant


def install_mamba2(model, sequence_parallel: SequenceParallel, variant: str) -> Optional[str]:
    """Give every Mamba2 layer the forward above (exchanging through `sequence_parallel`) and its directly read
    weights as ZeRO-3 external parameters; the `model changes:` phrase (None: no Mamba2 layer)."""
    layers = mamba2_layers(model)
    for layer in layers:
        swap_class(layer, "Ulysses", forward=ulysses_mamba2_forward)
        layer.kernel_variant = variant
        layer.sequence_parallel = sequence_parallel
        recurrent.register_direct_weights(layer, [layer.conv1d.weight, layer.conv1d.bias, layer.A_log,
                                                  layer.dt_bias, layer.D])
    if not layers:
        return None
    return f"{len(layers)} Mamba2 layers over the whole sequence of each rank's heads ({MAMBA2_VARIANTS[variant]})"


def simple_gla_available() -> bool:
    return recurrent.fla_available() and importlib.util.find_spec("fla.ops.simple_gla") is not None


def check_mamba2_kernels(hf_config, seq_length: int, cuda: bool) -> None:
    """Before the model loads: a GPU run past recurrent.TORCH_RULE_LIMIT tokens needs fla's simple-GLA kernels."""
    recurrent.check_torch_fallback_length("Mamba2", seq_length, cuda, simple_gla_available(),
                                          "flash-linear-attention's simple-GLA kernels (module fla.ops.simple_gla) "
                                          "are", f"{INSTALL_LINE} (or pip install flash-linear-attention)")


MAMBA2 = Mixer(
    name=NAME,
    layer_types=("linear_attention",),
    model_types=MAMBA2_TYPES,
    module_classes=MAMBA2_CLASSES,
    head_units=mamba2_head_units,
    sp_problem=mamba2_sp_problem,
    sp_rule="sp divides the Mamba2 heads (each rank runs heads/sp of them over the whole sequence) and divides the "
            "groups or is a multiple of them (each group's B and C then repeated to the ranks that read them)",
    check_kernels=check_mamba2_kernels,
    install=install_mamba2,
    kernel_variants=MAMBA2_VARIANTS,
    choose_kernel=choose_mamba2_kernel,
    document_restarts="the conv and the SSD state restart at every document of `cu_seq_lens_q` (fla's "
                      "`cu_seqlens`; on CPU transformers' torch functions per document)",
    planned=True,
    planner_dims=mamba2_planner_dims,
    planner_terms="planner/mamba2_layer.py mamba2_saved_per_token, mamba2_backward_extra_per_token, "
                  "mamba2_exchange_width, mamba2_forward_per_token; FLOPs: its projections only, as the Gated "
                  "DeltaNet's (the SSD is per token and under a few % of 2·N at Nemotron's shapes)",
)
