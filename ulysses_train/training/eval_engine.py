"""A model loaded for evaluation only: the trainer's own loading (ZeRO-3, Ulysses, YaRN from the config) without
optimizer states, from an exported Hugging Face folder, a training output_dir or a hub name."""
from __future__ import annotations

import os

from ulysses_train.config import Config, ConfigError


def resolve_model_path(path: str) -> str:
    """An HF model folder, a training output_dir (its exported hf_model), or a hub name as given."""
    if not path or not os.path.isdir(path):
        return path
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    exported = os.path.join(path, "hf_model")
    if os.path.isfile(os.path.join(exported, "config.json")):
        return exported
    if os.path.isdir(os.path.join(path, "checkpoints")) or os.path.basename(path.rstrip("/")).startswith("step_"):
        raise ConfigError(f"{path!r} holds DeepSpeed checkpoints but no exported model; evaluation loads a "
                          f"Hugging Face folder. Train with train.export_hf=true (writes <output_dir>/hf_model), or "
                          f"convert with the zero_to_fp32.py script DeepSpeed writes into the checkpoint folder.")
    raise ConfigError(f"{path!r} is a folder without config.json; point --checkpoint-or-model at a Hugging Face "
                      f"model folder or a training output_dir with hf_model/.")


def inference_deepspeed_config(cfg: Config) -> dict:
    """The run's DeepSpeed JSON without optimizer and scheduler: ZeRO-3 partitions the weights only."""
    from ulysses_train.training.ds_config import load_deepspeed_config

    ds = load_deepspeed_config(cfg.train.deepspeed_config)
    for key in ("optimizer", "scheduler"):
        ds.pop(key, None)
    return ds


def build_eval_engine(cfg: Config, model_path: str, target_length: int, check_memory: bool = False,
                      random_init: bool = False):
    """Load the model the way training does (ZeRO-3, Ulysses, YaRN from the config) for evaluation.

    `data.seq_length` becomes `target_length` (the longest evaluated length), so `model.rope_scaling: auto`
    turns YaRN on exactly when that length exceeds the model's trained length; `none` evaluates without.
    `check_memory`: the planner's preflight for the evaluation forward at that length (planner/forward_only.py).
    `random_init`: random weights of the model's shape (a folder with config.json only: time and memory).
    """
    import dataclasses

    from ulysses_train.parallel.launch import check_op_build_locks
    from ulysses_train.training.step import build_engine, resolve_run

    model = dataclasses.replace(cfg.model)
    hf_config = None
    path = resolve_model_path(model_path)
    if path:
        model.name_or_path, model.random_init = path, random_init
    elif cfg.data.source == "demo":
        from ulysses_train.data.demo import RetrievalTask, demo_model_config

        hf_config = demo_model_config(RetrievalTask().vocab_size)
    data = dataclasses.replace(cfg.data, seq_length=int(target_length))
    eval_cfg = Config(model=model, parallel=cfg.parallel, loss=cfg.loss, data=data, train=cfg.train)
    check_op_build_locks()  # a stale lock would hold the process group's start forever
    run = resolve_run(eval_cfg, hf_config, inference_deepspeed_config(cfg))
    return build_engine(run, check_memory=check_memory, forward_only=True), eval_cfg


def planned_forward(engine, chunk_rows: int):
    """The planner's estimate of the evaluation forward this engine runs at its `data.seq_length` (the longest
    evaluated length), with `chunk_rows` rows of the head at a time; None for a model the planner cannot size.
    Arithmetic only, so CPU runs report it too (the GPU it is planned for is an H200 there)."""
    from ulysses_train.planner import detect_hardware
    from ulysses_train.planner.forward_only import plan_forward
    from ulysses_train.planner.run import options_of_resolved_run

    try:
        options = options_of_resolved_run(engine.run, loss_chunk_rows=chunk_rows, **detect_hardware())
        return plan_forward(engine.hf_config, options=options)
    except NotImplementedError:
        return None
