"""YaRN position scaling for training past a model's trained length, set so it cannot be mis-set.

A model asked for positions it never saw during pretraining degrades quietly: the loss climbs past
the unigram entropy instead of failing. YaRN (arXiv 2309.00071) rescales the rotary frequencies so
the longer range maps onto positions the model knows. Three things must be right, and each is read
from the model's own config rather than assumed:

- ``factor = target_length / original_max_position_embeddings``;
- ``rope_theta`` stays what the model shipped with (1e6 for Qwen3; a wrong theta shifts every
  frequency and silently breaks the model);
- ``max_position_embeddings`` becomes the target, so everything downstream sees the new range.

transformers 5 stores all of this in ``config.rope_parameters`` (``rope_type``, ``rope_theta``,
``factor``, ``original_max_position_embeddings``) and computes the frequencies itself
(``ROPE_INIT_FUNCTIONS["yarn"]``); this module only writes that dict. Call it on the config
*before* the model is built: the rotary module reads the config once, at construction.
``save_pretrained`` writes ``rope_parameters`` to ``config.json``, so an exported model keeps the
settings.
"""
from __future__ import annotations

import logging
import numbers
import warnings
from dataclasses import dataclass

from ulysses_train.config import ROPE_SCALING_MODES
from ulysses_train.errors import UserError
from ulysses_train.families import types_where

logger = logging.getLogger(__name__)

MODES = ROPE_SCALING_MODES  # model.rope_scaling (config.py holds the one definition)


KEPT_ROPE_KEYS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")
"""rope_parameters that say which dimensions rotate and how positions map onto them (Qwen3.5: a quarter of the
head dim, three multimodal position axes, equal for text); YaRN rescales those dimensions and keeps these."""


class RopeConfigError(UserError, ValueError):
    """A RoPE setting that would train the model on wrong positions; the message says the fix."""


class RopeLengthWarning(UserWarning):
    """Training past the model's trained length with RoPE scaling switched off."""


@dataclass(frozen=True)
class RopeScalingDecision:
    """What ``apply_rope_scaling`` did to the config, for logs and for the run's saved record."""

    requested_mode: str
    applied: str  # "yarn" when YaRN was written, "none" when RoPE was left as it was
    target_length: int
    original_max_position_embeddings: int
    max_position_embeddings: int
    rope_theta: float
    factor: float | None
    message: str

    def __str__(self) -> str:
        return self.message


def apply_rope_scaling(
    hf_config, target_length: int, mode: str = "auto", factor: float | None = None
) -> RopeScalingDecision:
    """Set (or deliberately not set) YaRN on ``hf_config`` for training at ``target_length``.

    Modes:
      - ``"auto"``: YaRN when ``target_length`` exceeds the length the model supports now
        (``max_position_embeddings``); otherwise leave RoPE alone.
      - ``"yarn"``: YaRN even when the target fits (e.g. to train a model for a longer range later).
      - ``"none"``: never touch RoPE; warn loudly when the target exceeds the trained length,
        because that run will look fine and learn badly.

    ``factor`` overrides ``target / original``. It is also the only way to replace a RoPE scaling
    the model already ships (YaRN, llama3, longrope, ...): stacking YaRN on a scaled RoPE would
    multiply two factors the user never asked for, so without an explicit factor that is refused.
    With an explicit factor the scaling is rebuilt from the model's pretraining length
    (``original_max_position_embeddings`` of the shipped scaling), not stacked.

    Mutates ``hf_config`` in place and returns what it did. Raises ``RopeConfigError``.
    """
    _check_arguments(target_length, mode, factor)
    if position_free(hf_config):
        return _without_positions(hf_config, target_length, mode, factor)
    if not getattr(hf_config, "rope_parameters", None):
        return _without_rope(hf_config, target_length, mode, factor)
    if _nested_rope(hf_config):
        return _per_layer_type_rope(hf_config, target_length, mode, factor)
    rope = hf_config.rope_parameters
    rope_type = rope.get("rope_type", "default")
    theta = _rope_theta(hf_config, rope)
    supported = int(hf_config.max_position_embeddings)
    original = _original_length(hf_config, rope, rope_type)

    if mode == "none":
        return _leave_alone(mode, target_length, original, supported, theta, rope, warn=True)
    if factor is None and mode == "auto" and target_length <= supported:
        return _leave_alone(mode, target_length, original, supported, theta, rope, warn=False)
    if rope_type != "default" and factor is None:
        raise RopeConfigError(
            f"the model already ships a scaled RoPE (rope_type={rope_type!r}, "
            f"factor={rope.get('factor')}, original_max_position_embeddings={original}, "
            f"max_position_embeddings={supported}); refusing to stack YaRN on it for "
            f"target_length={target_length}. Fix: pass an explicit factor (e.g. "
            f"{target_length / original:g} = {target_length} / {original}) to replace the shipped "
            f"scaling, or use rope_scaling 'none' to keep it."
        )
    if factor is None:
        factor = target_length / original
        if factor <= 1.0:
            raise RopeConfigError(
                f"rope_scaling 'yarn' with target_length={target_length} needs no scaling: the "
                f"model was trained to {original} positions (factor would be {factor:g}). Fix: use "
                f"rope_scaling 'auto' or 'none', or pass an explicit factor > 1."
            )
    return _write_yarn(hf_config, mode, target_length, original, supported, theta, rope, float(factor))


def _check_arguments(target_length, mode, factor) -> None:
    """Reject inputs that have no sensible meaning before anything is touched."""
    if mode not in MODES:
        raise RopeConfigError(f"rope_scaling mode {mode!r} is not one of {', '.join(MODES)}.")
    if isinstance(target_length, bool) or not isinstance(target_length, numbers.Integral):
        raise RopeConfigError(
            f"target_length must be a whole number of tokens, got {target_length!r}."
        )
    if target_length <= 0:
        raise RopeConfigError(f"target_length must be positive, got {target_length}.")
    if factor is None:
        return
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real):
        raise RopeConfigError(f"rope factor must be a number, got {factor!r}.")
    if mode == "none":
        raise RopeConfigError(
            f"rope factor={factor} was given with rope_scaling 'none'; a factor means YaRN. "
            f"Fix: drop the factor, or use rope_scaling 'yarn'."
        )
    if not factor >= 1.0:  # also catches NaN
        raise RopeConfigError(
            f"rope factor must be >= 1 (YaRN stretches positions, it does not compress them), "
            f"got {factor}."
        )


def _without_rope(hf_config, target_length, mode, factor) -> RopeScalingDecision:
    """A model without rotary embeddings: nothing to scale. Fine within the positions it supports (or when it
    has no position limit); refused past them, and whenever YaRN is asked for explicitly."""
    name = type(hf_config).__name__
    supported = getattr(hf_config, "max_position_embeddings", None)
    if mode == "yarn" or factor is not None:
        raise RopeConfigError(
            f"{name} has no rope_parameters: this model does not use rotary position embeddings, so YaRN "
            f"(model.rope_scaling 'yarn' / model.rope_factor) cannot apply. Fix: model.rope_scaling 'auto' or "
            f"'none' without a factor" + (f", and data.seq_length <= {int(supported):,}." if supported else ".")
        )
    if supported and target_length > int(supported):
        raise RopeConfigError(
            f"{name} has no rope_parameters (no rotary position embeddings) and supports {int(supported):,} "
            f"positions; YaRN cannot extend it to target_length={target_length:,}. Fix: data.seq_length <= "
            f"{int(supported):,}, or a model with rotary embeddings (e.g. Qwen3, Llama)."
        )
    message = f"{name} has no rotary position embeddings; positions left as they are (target_length={target_length:,})."
    logger.info(message)
    limit = int(supported) if supported else target_length
    return RopeScalingDecision(requested_mode=mode, applied="none", target_length=target_length,
                               original_max_position_embeddings=limit, max_position_embeddings=limit,
                               rope_theta=0.0, factor=None, message=message)


NO_POSITION_TYPES = types_where(lambda family: not family.positions)
"""Model types whose attention never takes positions whatever the config says (family records: `positions`):
NemotronHAttention has no rotary embedding (Nemotron 3 Nano's rope_theta is read by no layer); Kimi Linear's MLA
splits off a `k_rot` part but rotates nothing (the model builds no rotary embedding)."""


def position_free(hf_config) -> bool:
    """Whether the model's attention sees no positions at all (NoPE): a NO_POSITION_TYPES model, or rope_parameters
    naming rope_theta None, which transformers' OLMo-hybrid reads as no rotary embedding (OlmoHybridModel.rotary_emb
    None; its released config.json has no RoPE)."""
    if getattr(hf_config, "model_type", None) in NO_POSITION_TYPES:
        return True
    if hasattr(hf_config, "position_embedding_type") and hf_config.position_embedding_type != "rope":
        return True  # transformers' switch where a family's RoPE is optional: the model builds no rotary embedding
    rope = getattr(hf_config, "rope_parameters", None) or {}
    return "rope_theta" in rope and rope["rope_theta"] is None and not _nested_rope(hf_config)


def rope_description(hf_config) -> str:
    """The model's positions in words for a run's first line: its rope_parameters, or that it has none (NoPE)."""
    return "none (NoPE: attention without positions)" if position_free(hf_config) else \
        str(getattr(hf_config, "rope_parameters", None))


def _without_positions(hf_config, target_length: int, mode: str, factor) -> RopeScalingDecision:
    """A NoPE model (position_free): no frequencies to scale, so YaRN is refused; within its trained positions
    nothing changes, and past them only with mode 'none' (warned: attention without positions is unscaled by
    construction, but the model never saw such lengths), as for a RoPE per layer type."""
    name, supported = type(hf_config).__name__, int(hf_config.max_position_embeddings)
    why = "its attention layers take no positions" if hf_config.model_type in NO_POSITION_TYPES else \
        "rope_theta None: its attention sees no positions"
    shipped = shipped_scaling(hf_config)
    if shipped:
        raise RopeConfigError(f"{name}'s config names a {shipped!r} RoPE scaling, but the model has no rotary "
                              f"position embeddings ({why}): nothing would read it, so YaRN would not be applied. "
                              f"Fix: remove rope_scaling (and any rope_type other than 'default') from its "
                              f"config.json; train past {supported:,} tokens with model.rope_scaling 'none'.")
    refuse_yarn_not_built(f"{name} has no rotary position embeddings ({why}), so there is nothing for YaRN to scale",
                          target_length, mode, factor, supported)
    message = (f"{name} has no rotary position embeddings (NoPE); positions left as they are "
               f"(target_length={target_length:,}, trained to {supported:,}).")
    if target_length > supported:
        warnings.warn(message, RopeLengthWarning, stacklevel=3)
    logger.info(message)
    return RopeScalingDecision(requested_mode=mode, applied="none", target_length=target_length,
                               original_max_position_embeddings=supported, max_position_embeddings=supported,
                               rope_theta=0.0, factor=None, message=message)


def shipped_scaling(hf_config) -> str | None:
    """The rope_type other than 'default' a config ships (`rope_parameters`, or `rope_scaling` as kept), else None."""
    entries = [getattr(hf_config, key, None) for key in ("rope_parameters", "rope_scaling")]
    kinds = [e.get("rope_type") or e.get("type") for e in entries if isinstance(e, dict)]
    return next((kind for kind in kinds if kind not in (None, "default")), None)


def refuse_yarn_not_built(why: str, target_length: int, mode: str, factor, supported: int) -> None:
    """Refuse a run that asks for YaRN (mode 'yarn', an explicit factor) or needs it (mode 'auto' past the supported
    positions) on a model for which YaRN is not built (a RoPE per layer type, no positions); `why` says which."""
    if mode == "yarn" or factor is not None or (mode == "auto" and target_length > supported):
        raise RopeConfigError(
            f"{why}, so target_length={target_length:,} (past its {supported:,} positions, or YaRN asked for) cannot "
            f"be trained with it. Fix: data.seq_length <= {supported:,}, or model.rope_scaling 'none' without a "
            f"factor to train past them as the model is.")


def _nested_rope(hf_config) -> list[str]:
    """The layer types of a model with a separate RoPE per layer type (Gemma 3: local and global), else []."""
    return sorted(key for key, value in hf_config.rope_parameters.items() if isinstance(value, dict))


def _per_layer_type_rope(hf_config, target_length: int, mode: str, factor) -> RopeScalingDecision:
    """A RoPE per layer type (e.g. windowed layers with a small base, full ones with a large one): left as it is
    within the positions the model supports (or with mode 'none'); YaRN for such models is not built, so
    anything that needs it is refused."""
    nested = _nested_rope(hf_config)
    supported = int(hf_config.max_position_embeddings)
    refuse_yarn_not_built(f"{type(hf_config).__name__} has a separate RoPE per layer type ({', '.join(nested)}); "
                          f"YaRN for such models is not built", target_length, mode, factor, supported)
    rope = hf_config.rope_parameters.get("full_attention") or hf_config.rope_parameters[nested[0]]
    return _leave_alone(mode, target_length, supported, supported, _rope_theta(hf_config, rope), rope,
                        warn=mode == "none")


def _rope_theta(hf_config, rope: dict) -> float:
    """``rope_theta`` exactly as the model ships it; missing or non-positive is an error, not 1e4."""
    theta = rope.get("rope_theta")
    if not isinstance(theta, numbers.Real) or isinstance(theta, bool) or not theta > 0:
        raise RopeConfigError(
            f"{type(hf_config).__name__}.rope_parameters has rope_theta={theta!r}; YaRN needs the "
            f"base the model was trained with. Fix: load the model's own config.json."
        )
    return float(theta)


def _original_length(hf_config, rope: dict, rope_type: str) -> int:
    """The pretraining length: stored by a shipped scaling, else ``max_position_embeddings``.

    Some configs (Phi-3) keep ``original_max_position_embeddings`` as a top-level attribute, and
    transformers gives that priority, so it is honoured here too.
    """
    if rope_type != "default" and rope.get("original_max_position_embeddings"):
        return int(rope["original_max_position_embeddings"])
    top_level = getattr(hf_config, "original_max_position_embeddings", None)
    if top_level:
        return int(top_level)
    return int(hf_config.max_position_embeddings)


def _leave_alone(mode, target, original, supported, theta, rope, warn: bool) -> RopeScalingDecision:
    """Record that RoPE stays as shipped; warn when the run trains past what the model supports."""
    rope_type = rope.get("rope_type", "default")
    if target > supported and warn:
        message = (
            f"RoPE scaling is OFF but target_length={target:,} exceeds the {supported:,} positions "
            f"this model supports (rope_type={rope_type!r}, rope_theta={theta:g}). Positions past "
            f"the trained length degrade the loss quietly (it climbs past the unigram entropy). "
            f"Fix: rope_scaling 'auto' (YaRN factor {target / original:g})."
        )
        logger.warning(message)
        warnings.warn(message, RopeLengthWarning, stacklevel=3)
    else:
        message = (
            f"RoPE unchanged (rope_type={rope_type!r}, rope_theta={theta:g}): target_length="
            f"{target:,}, model supports {supported:,} positions."
        )
        logger.info(message)
    return RopeScalingDecision(requested_mode=mode, applied="none", target_length=target,
                               original_max_position_embeddings=original, max_position_embeddings=supported,
                               rope_theta=theta, factor=rope.get("factor"), message=message)


def _write_yarn(hf_config, mode, target, original, supported, theta, rope, factor) -> RopeScalingDecision:
    """Write YaRN into ``rope_parameters`` and raise ``max_position_embeddings`` to the target."""
    new_rope = {
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": original,
        "rope_theta": theta,
    }
    for key in KEPT_ROPE_KEYS:  # what the rotary part is, not how it scales: carried over as shipped
        if key in rope:
            new_rope[key] = rope[key]
    replaced = rope.get("rope_type", "default")
    hf_config.rope_parameters = new_rope
    hf_config.max_position_embeddings = max(target, supported)
    if getattr(hf_config, "original_max_position_embeddings", None):
        hf_config.original_max_position_embeddings = original  # transformers prefers this one
    hf_config.validate_rope()

    message = (
        f"RoPE: YaRN factor {factor:g} (original_max_position_embeddings={original:,}, "
        f"rope_theta={theta:g} from the model config), max_position_embeddings "
        f"{supported:,} -> {hf_config.max_position_embeddings:,} for target_length={target:,}"
    )
    if replaced != "default":
        message += f"; replaced the shipped rope_type={replaced!r} (factor={rope.get('factor')})"
    covered = original * factor
    if covered < target:
        short = (
            f"YaRN factor {factor:g} covers {covered:,.0f} positions, fewer than "
            f"target_length={target:,}. Fix: factor >= {target / original:g}."
        )
        logger.warning(short)
        warnings.warn(short, RopeLengthWarning, stacklevel=3)
        message += f". WARNING: {short}"
    logger.info(message)
    return RopeScalingDecision(requested_mode=mode, applied="yarn", target_length=target,
                               original_max_position_embeddings=original,
                               max_position_embeddings=int(hf_config.max_position_embeddings), rope_theta=theta,
                               factor=factor, message=message)


def frequency_buffer_names(module) -> list:
    """A rotary module's inverse-frequency buffers: `inv_freq` and `original_inv_freq`, or one pair per layer type
    (`sliding_attention_inv_freq`, ...: Gemma 3, whose windowed and full layers rotate with different bases)."""
    return [name for name, _ in module.named_buffers(recurse=False) if name.endswith("inv_freq")]


def rotary_modules(model) -> list:
    """The model's rotary embedding modules (those holding inverse-frequency buffers); [] for a model without RoPE
    (NoPE: Nemotron-H, Kimi Linear), whose `model changes:` line then names no RoPE step."""
    return [m for m in model.modules() if "Rotary" in type(m).__name__ and frequency_buffer_names(m)]


def recompute_rope_buffers_in_fp32(model) -> float:
    """Recompute every rotary module's inverse frequencies in fp32, outside ZeRO-3's init; returns the
    largest relative change (0.0 when they were already right).

    Why: `deepspeed.zero.Init` wraps tensor constructors such as `torch.arange` so that every floating
    tensor made while the model is built comes out in the training dtype. The rotary module computes
    `inv_freq` from `torch.arange(..., dtype=float)` in its `__init__`, so under bf16 ZeRO-3 the
    frequencies are computed in bf16 (8 bits of mantissa). Then the angle `position * inv_freq` is off
    by up to `position * inv_freq * 2**-9` radians: about 16 rad at position 8K for the fastest
    frequency. The loss hardly moves on a random model, but every gradient does (benchmarks/RESULTS.md,
    "Correctness on GPUs", the RoPE trap; ulysses_train/DESIGN.md, 'Traps').
    A fresh rotary module built from the same config, here outside zero.Init, computes them in fp32.
    """
    import torch

    worst = 0.0
    for module in rotary_modules(model):
        names = frequency_buffer_names(module)
        if getattr(module, "config", None) is None:  # e.g. a vision tower's rotary, built from (dim, theta)
            if any(getattr(module, name).dtype != torch.float32 for name in names):
                warnings.warn(f"{type(module).__name__}.{names[0]} is {getattr(module, names[0]).dtype} and the "
                              f"module has no .config to rebuild it from: its positions are imprecise at long "
                              f"lengths.", RopeLengthWarning)
            continue
        fresh = type(module)(config=module.config)
        for name in names:
            if not hasattr(fresh, name):
                continue
            current, exact = getattr(module, name), getattr(fresh, name).to(torch.float32)
            if current.shape != exact.shape:
                raise RopeConfigError(f"{type(module).__name__}.{name} has shape {tuple(current.shape)}, "
                                      f"a fresh one {tuple(exact.shape)}; refusing to replace it.")
            change = ((current.detach().float().cpu() - exact).abs() / exact.abs().clamp_min(1e-30)).max().item()
            worst = max(worst, change)
            current.data = exact.to(current.device)
        for name in [n for n in vars(fresh) if n.endswith("attention_scaling")]:
            setattr(module, name, getattr(fresh, name))
    if worst > 1e-6:
        logger.info("RoPE inverse frequencies had been computed in reduced precision (largest relative error "
                    "%.2e); recomputed in fp32.", worst)
    return worst
