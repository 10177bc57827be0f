"""The memory levers a config may leave `auto`, and what `auto` means where nothing chooses: one table for the
config's checks, the model transform (model/transform.py), the trainer (training/step.py) and the planner
(planner/run.py, planner/levers.py, which chooses them on GPUs). It sits beside config.py, below the model and the
planner, so that both read it without either importing the other."""
from __future__ import annotations

import dataclasses

LEVER_KEYS = ("keep_attention_fraction", "activation_offload_fraction", "tiled_mlp", "attention_head_chunks")
"""The `model.*` keys that accept `auto`."""

NO_GPU_LEVERS = {"keep_attention_fraction": 0.0, "activation_offload_fraction": 1.0, "tiled_mlp": "auto",
                 "attention_head_chunks": 1}
"""What `auto` levers mean where there is no GPU memory to plan for (CPU runs; scripts/plan.py without
--auto-levers): attention recomputed, every layer offloaded when offload is on, TiledMLP by tiling.py's length
rule, attention's heads in one chunk. One table for the trainer and the planner."""


def fixed_levers(model_cfg):
    """`model_cfg` (a config.ModelConfig) with any lever still `auto` given its NO_GPU_LEVERS value: what code
    that builds a model outside build_engine (which chooses on GPUs) runs with."""
    auto = auto_lever_keys(model_cfg)
    return dataclasses.replace(model_cfg, **{key: NO_GPU_LEVERS[key] for key in auto}) if auto else model_cfg


def auto_lever_keys(model_cfg) -> set[str]:
    """The `model.*` lever keys set to `auto` (LEVER_KEYS)."""
    return {key for key in LEVER_KEYS if str(getattr(model_cfg, key)).lower() == "auto"}
