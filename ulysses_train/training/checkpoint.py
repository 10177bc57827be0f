"""Run checkpoints that survive a crash, resume exactly, refuse tampered or damaged files, and export a
plain Hugging Face model.

Layout under `<output_dir>/checkpoints/`:
    step_00000003/      DeepSpeed's ZeRO-3 files (fp32 master weights, optimizer states), the trainer's
                        client state (step, data position) and one `rng_rank<r>.pt` per rank
    step_00000003/COMPLETE   written by rank 0 after every rank finished writing: a JSON manifest of the
                        layout that wrote it (world size, sp) and of every file (size, sha256)
    latest_good         the tag of the newest COMPLETE checkpoint, replaced atomically

A crash while saving leaves a folder without COMPLETE and `latest_good` still naming the previous one, so
the previous good checkpoint is never damaged and never skipped over. (DeepSpeed's own `latest` file is not
written: it would point at a half-written folder.)

Reading a checkpoint never runs code from it. A `.pt` file is a pickle, and a pickle can name any Python
callable; DeepSpeed's own checkpoint engine loads with `weights_only=False`. Here every file is read with
`weights_only=True` (tensors and plain containers only), plus an allow-list of the few DeepSpeed classes
its optimizer files hold (`SAFE_CHECKPOINT_CLASSES`); anything else is refused, naming the file. Before
loading, each file is checked against the manifest, so a truncated or altered file is found before
DeepSpeed reads it, and `--resume` falls back to the newest checkpoint that is intact.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import pickle
import random
import shutil
import subprocess
import sys

import torch

from ulysses_train.errors import UserError

logger = logging.getLogger(__name__)

LATEST = "latest_good"
COMPLETE = "COMPLETE"
DAMAGED_PREFIX = "damaged_"


class CheckpointError(UserError):
    """A checkpoint cannot be written or read; the message names the folder, the file and the way out."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds pickled code: never loaded, never silently skipped."""


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


# ---------------------------------------------------------------- safe reading


def _safe_checkpoint_classes() -> list:
    """The non-container classes DeepSpeed 0.19's ZeRO-3 files hold (found by listing the pickles' globals);
    each is rebuilt from its saved attributes, none runs code on load."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    return [ZeroStageEnum, LossScaler, DynamicLossScaler]


def safe_torch_load(path: str, map_location=None, mmap: bool = False):
    """`torch.load` that cannot execute code: tensors, plain containers and the allow-listed classes only.
    `mmap=True` maps the tensors instead of reading them: a cheap way to check a file's pickle."""
    try:
        with torch.serialization.safe_globals(_safe_checkpoint_classes()):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise UnsafeCheckpointError(f"refused to read {path}: it holds Python objects other than tensors and plain data, "
                              f"so loading it could run code ({reason[:200]}). Nothing from it was run. Delete that "
                              f"checkpoint folder if you did not write it.") from None
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise CheckpointError(f"cannot read {path}: {str(err).strip().splitlines()[0][:200]} (damaged or truncated "
                              f"file).") from None


def install_safe_loader(engine) -> None:
    """Route every file DeepSpeed's engine reads (model states, optimizer partitions) through `safe_torch_load`."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    if type(engine.checkpoint_engine) is not TorchCheckpointEngine:
        raise CheckpointError(f"the DeepSpeed checkpoint engine {type(engine.checkpoint_engine).__name__} is not "
                              f"supported (its loader is not known to be safe); remove the checkpoint engine "
                              f"settings from the DeepSpeed JSON.")
    engine.checkpoint_engine.load = safe_torch_load


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
    """This rank's part of a save; returns None or what went wrong, in words."""
    try:
        engine.save_checkpoint(root, tag=tag, client_state=client_state, save_latest=False,
                               exclude_frozen_parameters=has_frozen_parameters(engine))
        torch.save(rng_state(), os.path.join(root, tag, f"rng_rank{rank}.pt"))
        return None
    except (OSError, RuntimeError) as err:
        return _describe_write_error(err, os.path.join(root, tag))


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


# ---------------------------------------------------------------- choosing what to resume


def read_manifest(output_dir: str, tag: str) -> dict:
    """The COMPLETE file of `tag` as a dict; checkpoints written before manifests existed hold only the step."""
    path = os.path.join(checkpoint_root(output_dir), tag, COMPLETE)
    try:
        with open(path) as fh:
            value = json.loads(fh.read())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} is unreadable ({err}).") from None
    return value if isinstance(value, dict) else {"step": value}


def _check_share(output_dir: str, tag: str) -> tuple[str, str] | None:
    """This rank's share of the check of `tag`: None if intact, else ("unsafe" | "damaged", what is wrong,
    naming the file). Every .pt file's pickle is read by the safe loader with its tensors memory-mapped (cheap),
    and every file is compared with the manifest (size first, then sha256)."""
    rank, world = _world()
    folder = os.path.join(checkpoint_root(output_dir), tag)
    try:
        files = read_manifest(output_dir, tag).get("files")
    except CheckpointError as err:
        return "damaged", str(err)
    names = sorted(files) if files is not None else sorted(n for n in os.listdir(folder) if n.endswith(".pt"))
    for name in _my_share(names, rank, world):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return "damaged", f"{path} is missing"
        problem = _unsafe_or_unreadable(path) if name.endswith(".pt") else None
        if problem and problem[0] == "unsafe":
            return problem  # whatever else is wrong with it
        size = os.path.getsize(path)
        if files is not None and size != files[name]["bytes"]:
            return "damaged", f"{path} has {size} bytes, the manifest says {files[name]['bytes']} (truncated or replaced)"
        if problem:
            return problem
        if files is not None and _sha256(path) != files[name]["sha256"]:
            return "damaged", f"{path} does not match the sha256 in its manifest (damaged or altered)"
    if rank == 0 and files is not None:
        unlisted = sorted(set(os.listdir(folder)) - set(files) - {COMPLETE})
        if unlisted:
            return "damaged", f"{os.path.join(folder, unlisted[0])} is not in the manifest (added after the save)"
    return None


def _unsafe_or_unreadable(path: str) -> tuple[str, str] | None:
    try:
        safe_torch_load(path, map_location="cpu", mmap=True)
    except UnsafeCheckpointError as err:
        return "unsafe", str(err)
    except CheckpointError as err:
        return "damaged", str(err)
    return None


def choose_for_resume(output_dir: str) -> tuple[str | None, list[str]]:
    """The newest checkpoint whose files are all safe and match their manifest (every rank checks a share; all
    agree), and one line per newer checkpoint that was passed over and why. (None, []) when no checkpoint was
    ever completed. A CheckpointError when some were and none is intact; an UnsafeCheckpointError at once when
    any file holds code (a tampered folder is not something to fall back from quietly)."""
    skipped = []
    for tag in complete_tags(output_dir):
        problems = [p for p in _gather(_check_share(output_dir, tag)) if p]
        unsafe = [text for kind, text in problems if kind == "unsafe"]
        if unsafe:
            raise UnsafeCheckpointError(unsafe[0])
        if not problems:
            return tag, skipped
        skipped.append(f"{tag}: {problems[0][1]}")
    if skipped:
        raise CheckpointError(f"no intact checkpoint in {checkpoint_root(output_dir)} (" + "; ".join(skipped)
                              + "); start over with --overwrite.")
    return None, []


def set_aside_damaged(output_dir: str, tag: str) -> None:
    """Rename a damaged checkpoint folder out of the way (kept for inspection, never pruned, never resumed)
    and point `latest_good` at the one we resume. Rank 0 only."""
    root = checkpoint_root(output_dir)
    for other in complete_tags(output_dir):
        if other > tag:
            os.replace(os.path.join(root, other), os.path.join(root, DAMAGED_PREFIX + other))
    if _read_pointer(root) != tag:
        _write_atomic(os.path.join(root, LATEST), tag)


def saved_layout(output_dir: str, tag: str, layout: dict) -> dict | None:
    """The layout (world size, sp) that wrote `tag` when it differs from `layout`, else None. A ZeRO-3 checkpoint
    holds one optimizer partition per rank, so another layout resumes through the universal format
    (`to_universal`)."""
    saved = {k: v for k, v in read_manifest(output_dir, tag).items() if k in layout}
    return saved if saved and saved != {k: layout[k] for k in saved} else None


def layout_words(layout: dict) -> str:
    return f"{layout.get('world_size')} processes with parallel.sequence_parallel_size={layout.get('sp')}"


def to_universal(output_dir: str, tag: str, rank: int) -> str:
    """`tag` in DeepSpeed's universal checkpoint format (every tensor whole, loadable by any number of ranks):
    converted once, by rank 0, with DeepSpeed's own `ds_to_universal`, into checkpoints/universal_<tag> (written
    aside and renamed into place, so a crash leaves no half folder that a later resume would trust). Runs only
    after `choose_for_resume` found every file of `tag` intact and free of code. Returns the folder's name."""
    root = checkpoint_root(output_dir)
    name = UNIVERSAL_PREFIX + tag
    final = os.path.join(root, name)
    problem = None
    if rank == 0 and not os.path.isdir(final):
        partial = final + ".partial"
        shutil.rmtree(partial, ignore_errors=True)
        proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                               os.path.join(root, tag), "--output_folder", partial, "--num_extract_workers", "1",
                               "--num_merge_workers", "1"], capture_output=True, text=True)
        if proc.returncode == 0:
            os.replace(partial, final)
        else:
            shutil.rmtree(partial, ignore_errors=True)
            lines = [line for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
            problem = f"could not convert checkpoint {tag} to DeepSpeed's universal format: {lines[-1] if lines else proc.returncode}"
    problems = [p for p in _gather(problem) if p]
    if problems:
        raise CheckpointError(f"{problems[0]}. Resume with the layout that wrote it instead.")
    return name


# ---------------------------------------------------------------- loading and export


def load(engine, output_dir: str, tag: str, rank: int, universal: bool = False) -> dict:
    """Restore weights, optimizer, scheduler and this rank's RNG; return the client state. Every file goes
    through `safe_torch_load`. `universal`: the checkpoint was written by another layout; load its universal
    form (`to_universal`). DeepSpeed reads that choice from its config when loading, so it is switched on for
    this call only."""
    root = checkpoint_root(output_dir)
    install_safe_loader(engine)
    folder = to_universal(output_dir, tag, rank) if universal else tag
    engine._config.load_universal_checkpoint = universal
    try:
        path, client_state = engine.load_checkpoint(root, tag=folder, load_optimizer_states=True,
                                                    load_lr_scheduler_states=True,
                                                    load_module_strict=not has_frozen_parameters(engine))
    finally:
        engine._config.load_universal_checkpoint = False
    if path is None:
        raise CheckpointError(f"DeepSpeed found no checkpoint files in {os.path.join(root, tag)}.")
    rng_file = os.path.join(root, tag, f"rng_rank{rank}.pt")
    if os.path.exists(rng_file):
        set_rng_state(safe_torch_load(rng_file))
    return client_state or {}


def export_hf_model(engine, causal_lm, export_dir: str, rank: int, model_cfg=None) -> None:
    """A consolidated Hugging Face folder (safetensors + config, RoPE scaling included) that
    `from_pretrained` loads; with `model_cfg.lora`, PEFT's adapter folder or the merged model
    (`model.lora_export`, lora.py). Every rank must call this: the weights are gathered from all partitions."""
    from ulysses_train.model import lora

    state = engine._zero3_consolidated_16bit_state_dict()
    if rank == 0:
        prefix = "causal_lm."
        state = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state.items()}
        adapters = model_cfg.lora if model_cfg is not None else {}
        if adapters and model_cfg.lora_export == "adapter":
            lora.save_adapter(state, adapters, model_cfg.name_or_path, export_dir)
        else:
            state = lora.merged_state(state, adapters) if adapters else state
            causal_lm.save_pretrained(export_dir, state_dict=state, safe_serialization=True)
    _barrier()
