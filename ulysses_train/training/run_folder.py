"""The output folder of a run: what marks it as holding a run, whether this run may use it, and what
`--overwrite` clears.

A folder holds a run as soon as a run wrote anything there (its `run_config.json`, its `metrics.jsonl`, any
checkpoint folder, complete or not), not only once a checkpoint is complete: a run killed before its first
checkpoint still has metrics a new run must not truncate. Such a folder is used again only with `--resume`
(continue it) or `--overwrite` (delete it first). These checks read files only, so they run before any
process group starts or any weight loads.

One run at a time: rank 0 holds an exclusive `flock` on `<output_dir>/.run.lock` for as long as its process
lives, so a second run into the same folder (even with --resume or --overwrite, which would interleave
metrics.jsonl or delete the first run's checkpoints) is refused at once. The kernel drops the lock when the
holder exits in any way, kill -9 and crashes included, so a stale lock file is simply taken over; what it trusts is
the file system's flock: local file systems and NFSv4 (where a crashed client's lock ends with its lease) honour
it; a Lustre mounted without `flock` refuses it, which is reported as such.
"""
from __future__ import annotations

import errno
import fcntl
import os
import shutil
import socket

from ulysses_train.config import ConfigError
from ulysses_train.parallel.layout import rank_from_environment
from ulysses_train.training.checkpoint import checkpoint_root, complete_tags

RUN_CONFIG = "run_config.json"
METRICS = "metrics.jsonl"
# everything a run writes into its output folder; --overwrite removes exactly these
MONITOR = "monitor"  # TensorBoard / CSV logs of DeepSpeed's monitor (ds_config.place_monitor_logs)
RUN_OUTPUTS = (RUN_CONFIG, METRICS, "checkpoints", "hf_model", "hf_model.partial", "hf_model.previous", "eval",
               "memory", MONITOR)
LOCK = ".run.lock"
_held_locks: dict[str, int] = {}  # real path of an output folder -> the open lock file this process holds


def run_evidence(output_dir: str) -> str | None:
    """What in `output_dir` shows that a run used it, in words, or None for a fresh folder."""
    tags = complete_tags(output_dir)
    if tags:
        return f"checkpoint {tags[0]}"
    root = checkpoint_root(output_dir)
    if os.path.isdir(root) and os.listdir(root):
        return "an incomplete checkpoint folder"
    present = [name for name in (METRICS, RUN_CONFIG) if os.path.exists(os.path.join(output_dir, name))]
    return f"{' and '.join(present)} of a run without a checkpoint" if present else None


def check_output_dir(output_dir: str, resume: bool, overwrite: bool, resume_if_present: bool = False) -> None:
    """Refuse flag combinations and folders that would mix or destroy runs, and paths this run cannot write.
    `--resume` into a folder without a complete checkpoint is refused (it would start over in silence);
    `resume_if_present` (--resume-if-present, what a requeued job passes) continues from a checkpoint where there is
    one and starts the run there otherwise."""
    if (resume or resume_if_present) and overwrite:
        raise ConfigError("--resume and --overwrite contradict each other (continue the run, or delete it and start "
                          "over): pass one of them.")
    check_writable(output_dir, "train.output_dir")
    if rank_from_environment()[0] == 0:
        lock_output_dir(output_dir)
    if overwrite:
        refuse_linked_outputs(output_dir)
    evidence = run_evidence(output_dir)
    if resume and not resume_if_present and not complete_tags(output_dir):
        held = f"it holds {evidence}" if evidence else "nothing was saved there"
        raise ConfigError(f"--resume: train.output_dir={output_dir!r} has no complete checkpoint to continue from "
                          f"({held}). Fix: run without --resume to start the run"
                          f"{' (with --overwrite, which deletes what the folder holds)' if evidence else ''}, or pass "
                          f"--resume-if-present to continue only where a checkpoint exists.")
    if evidence and not (resume or resume_if_present or overwrite):
        raise ConfigError(f"train.output_dir={output_dir!r} already holds a run ({evidence}); pass --resume to "
                          f"continue it, --overwrite to start over, or choose another output_dir.")


def lock_output_dir(output_dir: str) -> None:
    """Take this folder's run lock for the rest of this process's life (see the module docstring), or refuse
    naming the process that holds it. Taking it again in the same process is a no-op."""
    key = os.path.realpath(output_dir)
    if key in _held_locks:
        return
    path = os.path.join(output_dir, LOCK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "a process that has not said which"
        os.close(fd)
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise ConfigError(f"train.output_dir={output_dir!r} is in use by another run ({holder}); wait for it "
                              f"to end or stop it, or choose another output_dir.") from None
        raise ConfigError(f"train.output_dir={output_dir!r}: cannot lock {path} ({describe_os_error(err)}), so "
                          f"two runs could write it at once; choose a folder on a file system with flock "
                          f"(e.g. mount Lustre with -o flock).") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
    _held_locks[key] = fd


def release_output_dir(output_dir: str) -> None:
    """Give the lock back before the process ends (a run that finished, in a process that goes on)."""
    fd = _held_locks.pop(os.path.realpath(output_dir), None)
    if fd is not None:
        os.close(fd)


def check_writable(path: str, key: str) -> None:
    """Create `path` if needed and write a probe file into it, so a read-only, full or forbidden folder is named
    now rather than at the first checkpoint. (Permission bits are not enough: root ignores them.)"""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{key}={path!r} is a file, not a folder; choose a folder path.")
    probe = os.path.join(path, f".write_probe.{socket.gethostname()}.{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        with open(probe, "w") as fh:
            fh.write("ok")
        os.remove(probe)
    except OSError as err:
        raise ConfigError(f"{key}={path!r} cannot be written: {describe_os_error(err)}; choose a writable folder "
                          f"or fix its permissions.") from None


def describe_os_error(err: OSError) -> str:
    if err.errno == errno.ENOSPC:
        return "no space left on the device"
    if err.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    if err.errno == errno.EROFS:
        return "the file system is read-only"
    if err.errno == errno.ENOTDIR:
        return "a part of the path is a file, not a folder"
    return err.strerror or str(err)


def refuse_linked_outputs(output_dir: str) -> None:
    """--overwrite deletes what a run wrote in its folder; a part of it that is a symbolic link (hf_model pointing at
    a shared model store) is not the run's to delete, nor to follow: refused before anything is removed."""
    for name in RUN_OUTPUTS:
        path = os.path.join(output_dir, name)
        if os.path.islink(path):
            raise ConfigError(f"--overwrite: {path} is a symbolic link (to {os.readlink(path)}); overwriting deletes "
                              f"what a run wrote here and does not follow or remove links. Fix: remove or move the "
                              f"link yourself, then rerun.")


def clear_run(output_dir: str) -> None:
    """--overwrite: remove everything an earlier run wrote here (and nothing else). Rank 0 only."""
    for name in RUN_OUTPUTS:
        path = os.path.join(output_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
