"""Reading a checkpoint back: never running code from it, verified against its manifest, falling back past
damaged checkpoints to the newest intact one, and through DeepSpeed's universal format for another layout.

Reading a checkpoint never runs code from it. A `.pt` file is a pickle, and a pickle can name any Python
callable; DeepSpeed's own checkpoint engine loads with `weights_only=False`. Here every file is read with
`weights_only=True` (tensors and plain containers only), plus an allow-list of the few DeepSpeed classes
its optimizer files hold (`_safe_checkpoint_classes`); anything else is refused, naming the file.

Before loading, each file is checked against the manifest written with it (checkpoint.py): a file whose size or
sha256 differs is damaged (truncated, bit-flipped, replaced), whatever its bytes now decode to, and `--resume`
falls back to the newest checkpoint that is intact. A file that matches its manifest and still holds code was
written that way on purpose: that is refused outright, never fallen back from quietly.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import runpy
import shutil
import subprocess
import sys

import torch

from ulysses_train.training.checkpoint import (COMPLETE, DAMAGED_PREFIX, LATEST, UNIVERSAL_PREFIX, CheckpointError,
                                               _gather, _my_share, _read_pointer, _sha256, _world, _write_atomic,
                                               checkpoint_root, complete_tags, has_frozen_parameters, read_manifest,
                                               set_rng_state)


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds pickled code: never loaded, never silently skipped."""


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
            # torch.serialization.load, not torch.load: inside `weights_only_loads` torch.load is this function
            return torch.serialization.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(f"refused to read {path}: it holds Python objects other than tensors and plain data, "
                              f"so loading it could run code ({_unpickling_reason(err)}). Nothing from it was run. "
                              f"Delete that checkpoint folder if you did not write it.") from None
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise CheckpointError(f"cannot read {path}: {str(err).strip().splitlines()[0][:200]} (damaged or truncated "
                              f"file).") from None


def _unpickling_reason(err: Exception) -> str:
    """The line of torch's refusal that names what the file holds ("unsupported GLOBAL posix.system")."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    named = [line for line in lines if "global" in line.lower()]
    return (named or lines or [type(err).__name__])[-1][:200]


# torch's own switch: every torch.load reads weights only, even where the caller passed weights_only=False
FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"


def _safe_load_anything(f, map_location=None, *args, mmap=None, **kwargs):
    """`torch.load`'s signature, `safe_torch_load`'s behaviour: whatever `weights_only` the caller asked for."""
    return safe_torch_load(f, map_location=map_location, mmap=bool(mmap))


@contextlib.contextmanager
def weights_only_loads():
    """While DeepSpeed reads a checkpoint, every `torch.load` in this process goes through `safe_torch_load`.
    DeepSpeed's checkpoint engine is only one of its readers: the universal format's per-parameter files
    (`stage3.load_hp_checkpoint_state`) and the optimizer files are read with `torch.load(weights_only=False)`
    directly. `torch.load` is replaced (so a refusal names the file) and torch's own switch is set as well (so a
    reader holding another reference to the function is still safe)."""
    previous_load, previous_switch = torch.load, os.environ.get(FORCE_WEIGHTS_ONLY)
    torch.load, os.environ[FORCE_WEIGHTS_ONLY] = _safe_load_anything, "1"
    try:
        with torch.serialization.safe_globals(_safe_checkpoint_classes()):
            yield
    except pickle.UnpicklingError as err:  # met through the switch, not the replaced function
        raise UnsafeCheckpointError(f"refused to read a checkpoint file: it holds Python objects other than tensors "
                                    f"and plain data, so loading it could run code ({_unpickling_reason(err)}). "
                                    f"Nothing from it was run.") from None
    finally:
        torch.load = previous_load
        if previous_switch is None:
            os.environ.pop(FORCE_WEIGHTS_ONLY, None)
        else:
            os.environ[FORCE_WEIGHTS_ONLY] = previous_switch


def run_module_weights_only(module: str) -> None:
    """Run `python -m module` with every `torch.load` safe: DeepSpeed's `ds_to_universal` reads the step's files
    with `weights_only=False`."""
    with weights_only_loads():
        runpy.run_module(module, run_name="__main__", alter_sys=True)


def install_safe_loader(engine) -> None:
    """Route every file DeepSpeed's engine reads (model states, optimizer partitions) through `safe_torch_load`."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    if type(engine.checkpoint_engine) is not TorchCheckpointEngine:
        raise CheckpointError(f"the DeepSpeed checkpoint engine {type(engine.checkpoint_engine).__name__} is not "
                              f"supported (its loader is not known to be safe); remove the checkpoint engine "
                              f"settings from the DeepSpeed JSON.")
    engine.checkpoint_engine.load = safe_torch_load


# ---------------------------------------------------------------- choosing what to resume


def _check_share(output_dir: str, tag: str) -> tuple[str, str] | None:
    """This rank's share of the check of `tag`: None if intact, else ("unsafe" | "damaged", what is wrong,
    naming the file). Every file is compared with the manifest (size, then sha256) first: a file that differs
    from what the run wrote is damaged, whatever its bytes now decode to (flipped bytes inside a pickle stream
    read like unknown globals), and is never read. Every .pt file that matches is then read by the safe loader
    with its tensors memory-mapped (cheap): code there was saved on purpose and is refused as unsafe."""
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
        mismatch = _differs_from_manifest(path, files[name]) if files is not None else None
        if mismatch:
            return "damaged", mismatch
        problem = _unsafe_or_unreadable(path) if name.endswith(".pt") else None
        if problem:
            return problem
    if rank == 0 and files is not None:
        unlisted = sorted(set(os.listdir(folder)) - set(files) - {COMPLETE})
        if unlisted:
            return "damaged", f"{os.path.join(folder, unlisted[0])} is not in the manifest (added after the save)"
    return None


def _differs_from_manifest(path: str, entry: dict) -> str | None:
    size = os.path.getsize(path)
    if size != entry["bytes"]:
        return f"{path} has {size} bytes, the manifest says {entry['bytes']} (truncated or replaced; not read)"
    if _sha256(path) != entry["sha256"]:
        return f"{path} does not match the sha256 in its manifest (damaged, e.g. flipped bytes; not read)"
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
    a file that matches its manifest holds code (saved that way on purpose: not something to fall back from
    quietly). A file that differs from its manifest is damaged and passed over: it is never read."""
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


# ---------------------------------------------------------------- loading


def to_universal(output_dir: str, tag: str, rank: int) -> str:
    """`tag` in DeepSpeed's universal checkpoint format (every tensor whole, loadable by any number of ranks):
    converted by rank 0, with DeepSpeed's own `ds_to_universal`, into checkpoints/universal_<tag> (written aside
    and renamed into place). Runs only after `choose_for_resume` found every file of `tag` intact and free of
    code, and always converts anew: a universal folder already there is no evidence of anything (no manifest
    covers it; it may have been planted), so it is replaced, never read; one that is a symbolic link (or whose
    `.partial` is) is refused naming it, before anything is written. Returns the folder's name."""
    root = checkpoint_root(output_dir)
    name = UNIVERSAL_PREFIX + tag
    final = os.path.join(root, name)
    problem = None
    partial = final + ".partial"
    linked = [path for path in (final, partial) if os.path.islink(path)]
    if rank == 0 and linked:  # rmtree takes no link, and the conversion would write where it points
        problem = (f"{linked[0]} is a symbolic link (to {os.readlink(linked[0])}): a resume on another layout writes "
                   f"that folder anew and follows no link; nothing was read from it. Remove the link and rerun "
                   f"with --resume")
    elif rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)
        convert = ("from ulysses_train.training.checkpoint_read import run_module_weights_only as run; "
                   "run('deepspeed.checkpoint.ds_to_universal')")
        proc = subprocess.run([sys.executable, "-c", convert, "--input_folder", os.path.join(root, tag),
                               "--output_folder", partial, "--num_extract_workers", "1", "--num_merge_workers", "1"],
                              capture_output=True, text=True)
        if proc.returncode == 0:
            os.replace(partial, final)
        else:
            shutil.rmtree(partial, ignore_errors=True)
            lines = [line for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
            problem = f"could not convert checkpoint {tag} to DeepSpeed's universal format: {lines[-1] if lines else proc.returncode}"
    problems = [p for p in _gather(problem) if p]
    if problems:
        fix = "" if problems[0].endswith("--resume") else " Resume with the layout that wrote it instead."
        raise CheckpointError(f"{problems[0]}.{fix}")
    return name


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
        with weights_only_loads():
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
