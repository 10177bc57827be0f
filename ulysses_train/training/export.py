"""The run's Hugging Face export, `<output_dir>/hf_model/`: written whole into a fresh folder and swapped in.

Writing into an existing `hf_model/` in place mixes two models: `save_pretrained` deletes shards it did not
write only when they follow its own naming, and leaves any other `model.safetensors.index.json` or weights
file there, so a loader may read a stale index pointing at files that are gone, or old weights next to new
ones. Here every export goes to `hf_model.partial/` first; only once complete (weights, config, tokenizer) is
the old folder renamed `hf_model.previous/` (one generation kept, so a user's own files there are not lost
silently) and the new one renamed into place. A crash at any point leaves either the old folder or the new
one under `hf_model/`, never a mix.
"""
from __future__ import annotations

import os
import shutil

from ulysses_train.training.checkpoint import CheckpointError, _barrier, _describe_write_error, _gather

PARTIAL_SUFFIX = ".partial"
PREVIOUS_SUFFIX = ".previous"


def staging_dir(export_dir: str) -> str:
    return export_dir.rstrip(os.sep) + PARTIAL_SUFFIX


def export_hf_model(engine, causal_lm, export_dir: str, rank: int, model_cfg=None) -> None:
    """A consolidated Hugging Face folder (safetensors + config, RoPE scaling included) that
    `from_pretrained` loads; with `model_cfg.lora`, PEFT's adapter folder or the merged model
    (`model.lora_export`, lora.py). Every rank must call this: the weights are gathered from all partitions.
    `export_dir` is written as given: pass `staging_dir(...)` and then `swap_in` (Trainer.export does). A write
    that fails (a full disk) removes the partial folder and raises CheckpointError on every rank."""
    state = engine._zero3_consolidated_16bit_state_dict()
    problem = None
    if rank == 0:
        shutil.rmtree(export_dir, ignore_errors=True)  # a partial folder of an earlier, interrupted export
        prefix = "causal_lm."
        state = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state.items()}
        try:
            _write(state, causal_lm, export_dir, model_cfg)
        except Exception as err:  # a full disk: OSError, or safetensors' own error; every rank must hear of it
            shutil.rmtree(export_dir, ignore_errors=True)
            problem = _describe_write_error(err, export_dir)
    problems = [p for p in _gather(problem) if p]
    if problems:
        raise CheckpointError(f"could not export the Hugging Face model: {problems[0]}; the partial folder was "
                              f"removed and the run's checkpoints are kept. Free space (or fix the permission) and "
                              f"rerun with --resume: a finished run exports what it is missing.")
    _barrier()


def _write(state: dict, causal_lm, export_dir: str, model_cfg) -> None:
    """The weights and config (or PEFT's adapter folder: `model.lora_export`) into `export_dir`."""
    from ulysses_train.model import lora

    adapters = model_cfg.lora if model_cfg is not None else {}
    if adapters and model_cfg.lora_export == "adapter":
        lora.save_adapter(state, adapters, model_cfg.name_or_path, export_dir)
    else:
        state = lora.merged_state(state, adapters) if adapters else state
        causal_lm.save_pretrained(export_dir, state_dict=state, safe_serialization=True)


def swap_in(staged: str, export_dir: str) -> str | None:
    """Put the complete folder `staged` at `export_dir`; an existing one becomes `<export_dir>.previous` (replacing
    an older `.previous`). Returns that folder's path when there was one. Rank 0 only."""
    previous = None
    if os.path.lexists(export_dir):
        previous = export_dir.rstrip(os.sep) + PREVIOUS_SUFFIX
        if os.path.isdir(previous) and not os.path.islink(previous):
            shutil.rmtree(previous)
        elif os.path.lexists(previous):
            os.remove(previous)
        os.replace(export_dir, previous)
    os.replace(staged, export_dir)
    return previous
