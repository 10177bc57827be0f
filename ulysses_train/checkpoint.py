"""Checkpoints that survive a crash, resume exactly, and export a plain Hugging Face model.

Layout under `<output_dir>/checkpoints/`:
    step_00000003/      DeepSpeed's ZeRO-3 files (fp32 master weights, optimizer states), the trainer's
                        client state (step, data position) and one `rng_rank<r>.pt` per rank
    step_00000003/COMPLETE   written by rank 0 after every rank finished writing
    latest_good         the tag of the newest COMPLETE checkpoint, replaced atomically

A crash while saving leaves a folder without COMPLETE and `latest_good` still naming the previous one,
so the previous good checkpoint is never damaged and never skipped over. (DeepSpeed's own `latest`
file is not written: it would point at a half-written folder.)
"""
from __future__ import annotations

import os
import random
import shutil

import torch

LATEST = "latest_good"
COMPLETE = "COMPLETE"


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def _barrier():
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(engine, output_dir: str, step: int, client_state: dict, rank: int, keep_last: int = 2) -> str:
    """Save on every rank; mark complete and point `latest_good` at it only once all ranks are done."""
    root = checkpoint_root(output_dir)
    tag = tag_for(step)
    engine.save_checkpoint(root, tag=tag, client_state=client_state, save_latest=False)
    torch.save(rng_state(), os.path.join(root, tag, f"rng_rank{rank}.pt"))
    _barrier()
    if rank == 0:
        _write_atomic(os.path.join(root, tag, COMPLETE), f"{step}\n")
        _write_atomic(os.path.join(root, LATEST), tag)
        _prune(root, keep_last)
    _barrier()
    return tag


def _prune(root: str, keep_last: int) -> None:
    """Delete complete checkpoints older than the newest `keep_last` ones, and abandoned partial ones."""
    tags = sorted(t for t in os.listdir(root) if t.startswith("step_"))
    complete = [t for t in tags if os.path.exists(os.path.join(root, t, COMPLETE))]
    keep = set(complete[-keep_last:]) if keep_last > 0 else set(complete)
    newest = complete[-1] if complete else ""
    for tag in tags:
        if tag not in keep and tag < newest:
            shutil.rmtree(os.path.join(root, tag), ignore_errors=True)


def latest_good(output_dir: str):
    """The tag of the newest complete checkpoint, or None."""
    root = checkpoint_root(output_dir)
    path = os.path.join(root, LATEST)
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        tag = fh.read().strip()
    return tag if os.path.exists(os.path.join(root, tag, COMPLETE)) else None


def load(engine, output_dir: str, tag: str, rank: int) -> dict:
    """Restore weights, optimizer, scheduler and this rank's RNG; return the client state."""
    root = checkpoint_root(output_dir)
    path, client_state = engine.load_checkpoint(root, tag=tag, load_optimizer_states=True,
                                                load_lr_scheduler_states=True)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {os.path.join(root, tag)}.")
    rng_file = os.path.join(root, tag, f"rng_rank{rank}.pt")
    if os.path.exists(rng_file):
        set_rng_state(torch.load(rng_file, weights_only=False))
    return client_state or {}


def export_hf_model(engine, causal_lm, export_dir: str, rank: int) -> None:
    """A consolidated Hugging Face folder (safetensors + config, RoPE scaling included) that
    `from_pretrained` loads. Every rank must call this: the weights are gathered from all partitions."""
    state = engine._zero3_consolidated_16bit_state_dict()
    if rank == 0:
        prefix = "causal_lm."
        state = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state.items()}
        causal_lm.save_pretrained(export_dir, state_dict=state, safe_serialization=True)
    _barrier()
