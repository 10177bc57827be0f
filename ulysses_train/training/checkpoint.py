"""Run checkpoints that survive a crash and resume exactly: names, the crash-safe save, the manifest.

Layout under `<output_dir>/checkpoints/`:
    step_00000003/      DeepSpeed's ZeRO-3 files (fp32 master weights, optimizer states), the trainer's
                        client state (step, data position) and one `rng_rank<r>.pt` per rank
    step_00000003/COMPLETE   written by rank 0 after every rank finished writing: a JSON manifest of the
                        layout that wrote it (world size, sp) and of every file (size, sha256)
    latest_good         the tag of the newest COMPLETE checkpoint, replaced atomically

A crash while saving leaves a folder without COMPLETE and `latest_good` still naming the previous one, so
the previous good checkpoint is never damaged and never skipped over. (DeepSpeed's own `latest` file is not
written: it would point at a half-written folder.)

Reading a checkpoint back (safely, verified against the manifest, falling back past damaged ones) is
checkpoint_read.py's; the Hugging Face export is export.py's.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import random
import shutil

import torch

from ulysses_train.errors import UserError

logger = logging.getLogger(__name__)

LATEST = "latest_good"
COMPLETE = "COMPLETE"
DAMAGED_PREFIX = "damaged_"


class CheckpointError(UserError):
    """A checkpoint cannot be written or read; the message names the folder, the file and the way out."""


# ---------------------------------------------------------------- names


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


UNIVERSAL_PREFIX = "universal_"  # checkpoints/universal_<tag>: a checkpoint converted for another layout


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def _step_folders(root: str) -> list[str]:
    """Tags of every step folder, oldest first (complete or not)."""
    if not os.path.isdir(root):
        return []
    return sorted(t for t in os.listdir(root) if t.startswith("step_") and os.path.isdir(os.path.join(root, t)))


def complete_tags(output_dir: str) -> list[str]:
    """Tags of the folders marked COMPLETE, newest first. Marked is not yet verified: see `choose_for_resume`."""
    root = checkpoint_root(output_dir)
    return [t for t in reversed(_step_folders(root)) if os.path.exists(os.path.join(root, t, COMPLETE))]


def latest_good(output_dir: str):
    """The tag `latest_good` names if that folder is complete, else the newest complete one, else None."""
    root = checkpoint_root(output_dir)
    pointer = _read_pointer(root)
    if pointer and os.path.exists(os.path.join(root, pointer, COMPLETE)):
        return pointer
    tags = complete_tags(output_dir)
    return tags[0] if tags else None


def _read_pointer(root: str):
    try:
        with open(os.path.join(root, LATEST)) as fh:
            return fh.read().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


# ---------------------------------------------------------------- small helpers


def _barrier():
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def _world() -> tuple[int, int]:
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _gather(value) -> list:
    """Every rank's `value`, in rank order (our own processes' values: plain data)."""
    if not torch.distributed.is_initialized():
        return [value]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, value)
    return out


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 23), b""):
            digest.update(block)
    return digest.hexdigest()


def _my_share(names: list[str], rank: int, world: int) -> list[str]:
    """Hashing is split over the ranks (file i to rank i mod world), so a save or a check costs each rank
    1/world of the bytes."""
    return [name for i, name in enumerate(sorted(names)) if i % world == rank]


# ---------------------------------------------------------------- RNG


def rng_state() -> dict:
    """Tensors and plain Python values only, so `weights_only=True` can read it back."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ---------------------------------------------------------------- saving


def save(engine, output_dir: str, step: int, client_state: dict, rank: int, keep_last: int = 2,
         layout: dict | None = None) -> str:
    """Save on every rank; mark complete (with the manifest) and point `latest_good` at it only once all ranks
    are done. A failure on any rank (a full disk, a lost permission) fails the save on every rank, removes the
    partial folder and names the last good checkpoint."""
    root = checkpoint_root(output_dir)
    tag = tag_for(step)
    problem = _write_files(engine, root, tag, client_state, rank)
    problems = [p for p in _gather(problem) if p]
    if problems:
        _fail_save(root, tag, rank, problems[0])
    files = _hash_share(root, tag)
    manifest = {"step": step, **(layout or {}), "files": {k: v for part in _gather(files) for k, v in part.items()}}
    if rank == 0:
        _write_atomic(os.path.join(root, tag, COMPLETE), json.dumps(manifest, indent=1) + "\n")
        _write_atomic(os.path.join(root, LATEST), tag)
        _prune(root, keep_last)
    _barrier()
    return tag


def has_frozen_parameters(engine) -> bool:
    """A LoRA run (model.lora): its frozen base weights are not saved, since the run rebuilds them from the model
    it started from; the adapters and their optimizer states are."""
    return any(not p.requires_grad for p in engine.module.parameters())


def _write_files(engine, root: str, tag: str, client_state: dict, rank: int):
    """This rank's part of a save; returns None or what went wrong, in words. A file DeepSpeed fails to write (a
    full disk) is noted and its later files skipped, but save_checkpoint runs to its end: raising out of it would
    leave this rank short of the barrier every other rank waits in, and the next collective mismatched (gloo aborts
    the job with a traceback, the partial folder left behind)."""
    failed = []
    writer = getattr(engine, "checkpoint_engine", None)
    if writer is not None:
        write = writer.save

        def write_or_note(state_dict, path):
            if failed:
                return
            try:
                write(state_dict, path)
            except (OSError, RuntimeError) as err:
                failed.append(_describe_write_error(err, os.path.join(root, tag)))

        writer.save = write_or_note
    try:
        engine.save_checkpoint(root, tag=tag, client_state=client_state, save_latest=False,
                               exclude_frozen_parameters=has_frozen_parameters(engine))
        if not failed:
            torch.save(rng_state(), os.path.join(root, tag, f"rng_rank{rank}.pt"))
    except (OSError, RuntimeError) as err:
        failed.append(_describe_write_error(err, os.path.join(root, tag)))
    finally:
        if writer is not None:
            writer.save = write
    return failed[0] if failed else None


def _describe_write_error(err: Exception, path: str) -> str:
    """torch.save reports a full disk as 'unexpected pos N vs M'; say what it is."""
    free = shutil.disk_usage(os.path.dirname(path) if not os.path.exists(path) else path).free
    if getattr(err, "errno", None) == errno.ENOSPC or free < (64 << 20) or "unexpected pos" in str(err):
        return f"no space left on the device of {path} ({free / 2**20:.0f} MiB free)"
    if getattr(err, "errno", None) in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"no permission to write {path} ({os.strerror(err.errno)})"
    return f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200]} while writing {path}"


def _fail_save(root: str, tag: str, rank: int, problem: str) -> None:
    _barrier()
    if rank == 0:
        shutil.rmtree(os.path.join(root, tag), ignore_errors=True)
    _barrier()
    last = _read_pointer(root)
    last_text = f"the last good checkpoint is {os.path.join(root, last)}" if last else "no checkpoint was written yet"
    raise CheckpointError(f"could not save checkpoint {tag}: {problem}; the partial folder was removed and "
                          f"{last_text}. Free space (or fix the permission) and rerun with --resume.")


def _hash_share(root: str, tag: str) -> dict:
    rank, world = _world()
    folder = os.path.join(root, tag)
    names = [n for n in os.listdir(folder) if os.path.isfile(os.path.join(folder, n)) and n != COMPLETE]
    return {n: {"bytes": os.path.getsize(os.path.join(folder, n)), "sha256": _sha256(os.path.join(folder, n))}
            for n in _my_share(names, rank, world)}


def _prune(root: str, keep_last: int) -> None:
    """Delete complete checkpoints older than the newest `keep_last` ones, and abandoned partial ones."""
    tags = _step_folders(root)
    complete = [t for t in tags if os.path.exists(os.path.join(root, t, COMPLETE))]
    keep = set(complete[-keep_last:]) if keep_last > 0 else set(complete)
    newest = complete[-1] if complete else ""
    for tag in tags:
        if tag not in keep and tag < newest:
            shutil.rmtree(os.path.join(root, tag), ignore_errors=True)


# ---------------------------------------------------------------- the manifest


def read_manifest(output_dir: str, tag: str) -> dict:
    """The COMPLETE file of `tag` as a dict; checkpoints written before manifests existed hold only the step."""
    path = os.path.join(checkpoint_root(output_dir), tag, COMPLETE)
    try:
        with open(path) as fh:
            value = json.loads(fh.read())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} is unreadable ({err}).") from None
    return value if isinstance(value, dict) else {"step": value}


def saved_layout(output_dir: str, tag: str, layout: dict) -> dict | None:
    """The layout (world size, sp) that wrote `tag` when it differs from `layout`, else None. A ZeRO-3 checkpoint
    holds one optimizer partition per rank, so another layout resumes through the universal format
    (`to_universal`)."""
    saved = {k: v for k, v in read_manifest(output_dir, tag).items() if k in layout}
    return saved if saved and saved != {k: layout[k] for k in saved} else None


def layout_words(layout: dict) -> str:
    return f"{layout.get('world_size')} processes with parallel.sequence_parallel_size={layout.get('sp')}"


def step_size_words(saved: dict, layout: dict, accumulation: int, length: int) -> str:
    """What another layout does to a step: sp x dp = the world size, so the data-parallel groups, and with them the
    sequences and tokens of each step, follow the new sp and GPU count (a resume that doubles them must say so)."""
    old_dp, new_dp = (max(1, int(d.get("world_size") or 1) // max(1, int(d.get("sp") or 1))) for d in (saved, layout))
    groups = f"data-parallel groups {old_dp} -> {new_dp}" if old_dp != new_dp else f"data-parallel groups stay {new_dp}"
    return (f"{groups}: each step now trains {accumulation * new_dp} sequence(s) of {length:,} tokens "
            f"(train.gradient_accumulation_steps={accumulation} x {new_dp}), {accumulation * new_dp * length:,} tokens "
            f"per step")
