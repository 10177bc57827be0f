"""Several nodes: SLURM node lists, and what a process started by `srun` must derive for itself.

Two ways to run on N nodes of G GPUs (see docs/multi-node.md):

- `scripts/slurm/train.sbatch`: one batch task; the DeepSpeed launcher starts G processes on every
  node over ssh/pdsh, from a hostfile written from `SLURM_JOB_NODELIST`. DeepSpeed's `launch.py` sets
  RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE, MASTER_ADDR and MASTER_PORT for each process.
- `scripts/slurm/train_srun.sbatch`: `srun` starts one task per GPU. Nothing sets the torch variables,
  so the trainer reads SLURM's: SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID for ranks, the step's tasks
  per node for the GPUs-per-node check, and the first host of the node list as the rendezvous address.

Either way ranks are laid out in blocks (node 0 holds ranks 0..G-1, ...), so sp groups of consecutive
ranks stay inside a node and data parallelism runs across nodes.

Command line, for the batch scripts (no torch import, so it is quick):
    python -m ulysses_train.parallel.launch hosts [NODELIST]   # one host per line (scontrol, else a parser)
    python -m ulysses_train.parallel.launch port               # the job's default rendezvous port
    python -m ulysses_train.parallel.launch stop-ranks PID [TERM|INT]   # pass a stop to the ranks under PID
"""
from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
import time
from typing import Mapping

from ulysses_train.config import ConfigError

DEFAULT_PORT = 29500


class LaunchError(ConfigError):
    """The SLURM environment cannot give a working layout; the message says what to change."""


# ---------------------------------------------------------------- node lists


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM hostlist without scontrol: `gpu[01-03,07],login1` -> gpu01 gpu02 gpu03 gpu07 login1.

    Handles comma-separated items, any number of bracket groups per item (`r[1-2]n[1-2]`, expanded in
    SLURM's order), ranges with zero padding and single numbers. `scontrol show hostnames` is preferred
    where it exists (see `hostnames`).
    """
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip()):
        parts = re.split(r"(\[[^\]]*\])", item)
        expanded = [""]
        for part in parts:
            if part.startswith("["):
                choices = _expand_ranges(part[1:-1], nodelist)
                expanded = [prefix + choice for prefix in expanded for choice in choices]
            elif part:
                if "[" in part or "]" in part:
                    raise LaunchError(f"cannot parse the SLURM node list {nodelist!r} (unbalanced brackets).")
                expanded = [prefix + part for prefix in expanded]
        hosts.extend(expanded)
    if not hosts:
        raise LaunchError(f"the SLURM node list {nodelist!r} names no hosts.")
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split at commas outside brackets."""
    items, depth, current = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    items.append(current)
    return [item.strip() for item in items if item.strip()]


def _expand_ranges(spec: str, nodelist: str) -> list[str]:
    out = []
    for piece in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", piece.strip())
        if not match:
            raise LaunchError(f"cannot parse {piece!r} in the SLURM node list {nodelist!r}.")
        low, high = match.group(1), match.group(2) or match.group(1)
        width = len(low)
        if int(high) < int(low):
            raise LaunchError(f"descending range {piece!r} in the SLURM node list {nodelist!r}.")
        out.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return out


def hostnames(nodelist: str) -> list[str]:
    """The hosts of a node list in SLURM's order: `scontrol show hostnames` if installed, else the parser."""
    scontrol = shutil.which("scontrol")
    if scontrol:
        out = subprocess.run([scontrol, "show", "hostnames", nodelist], check=True, capture_output=True,
                             text=True).stdout
        hosts = out.split()
        if hosts:
            return hosts
    return expand_nodelist(nodelist)


def default_port(job_id: str | int | None) -> int:
    """A rendezvous port that differs between jobs (two jobs may share a node): 29500 + job id mod 1000."""
    try:
        return DEFAULT_PORT + int(job_id) % 1000
    except (TypeError, ValueError):
        return DEFAULT_PORT


# ---------------------------------------------------------------- processes started by srun


def launched_by_srun(env: Mapping[str, str]) -> bool:
    """True when the ranks come from SLURM (no launcher set RANK/WORLD_SIZE): the rule of
    `parallel.rank_from_environment`. A launcher started inside a batch job inherits SLURM_* too, but
    it sets RANK, so its processes are not mistaken for srun tasks."""
    return not ("RANK" in env and "WORLD_SIZE" in env) and "SLURM_PROCID" in env


def parse_tasks_per_node(value: str) -> list[int]:
    """SLURM's compressed task counts, one per node: `8(x2),4` -> [8, 8, 4]."""
    counts = []
    for item in value.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not match:
            raise LaunchError(f"cannot parse SLURM tasks per node {value!r}.")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def srun_tasks_per_node(env: Mapping[str, str]) -> int:
    """Tasks (= GPUs in use) per node under srun, the value the sp-inside-a-node check needs; 0 if unknown.

    With uneven nodes (`8,4`) it is their greatest common divisor: an sp that divides it divides every
    node. Also refuses a cyclic task distribution, where consecutive ranks sit on different nodes and
    every sp group would cross the network.
    """
    for key in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if env.get(key):
            counts = parse_tasks_per_node(env[key])
            break
    else:
        value = env.get("SLURM_NTASKS_PER_NODE", "")
        if not value.isdigit():
            return 0
        counts = [int(value)]
    node_id, local_id, rank = env.get("SLURM_NODEID"), env.get("SLURM_LOCALID"), env.get("SLURM_PROCID")
    if node_id is not None and local_id is not None and rank is not None and int(node_id) < len(counts):
        expected = sum(counts[:int(node_id)]) + int(local_id)
        if expected != int(rank):
            raise LaunchError(
                f"srun placed task {rank} as local task {local_id} of node {node_id}: ranks are not laid out in "
                f"blocks of consecutive ranks per node, so sequence-parallel groups would span nodes. Launch with "
                f"`srun --distribution=block` (the default).")
    return math.gcd(*counts)


def srun_environment(env: Mapping[str, str]) -> dict[str, str]:
    """What torch.distributed needs and srun does not set: the rendezvous address (the first host of the
    step's node list), a port (from the job id) and LOCAL_WORLD_SIZE. Values already in `env` win, so a
    batch script's `export MASTER_ADDR=...` is kept. Empty when the process was not started by srun."""
    if not launched_by_srun(env):
        return {}
    out = {}
    if "MASTER_ADDR" not in env:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if nodelist:
            out["MASTER_ADDR"] = hostnames(nodelist)[0]
    if "MASTER_PORT" not in env:
        out["MASTER_PORT"] = str(default_port(env.get("SLURM_JOB_ID")))
    if "LOCAL_WORLD_SIZE" not in env:
        per_node = srun_tasks_per_node(env)
        if per_node:
            out["LOCAL_WORLD_SIZE"] = str(per_node)
    return out


# ---------------------------------------------------------------- passing a stop on to the ranks

# launchers that start ranks on this machine and set RANK / LOCAL_RANK for them
LOCAL_LAUNCHERS = ("deepspeed.launcher.launch", "torch.distributed.run", "torchrun")
RANKS_APPEAR_SECONDS = 10.0


def training_ranks(pid: int) -> list:
    """The training ranks in the process tree of `pid` (itself included): the highest processes that a torch-style
    launcher started (RANK and LOCAL_RANK in their environment) and that are no launcher themselves. Ranks that
    srun or pdsh start on other nodes are not in this tree."""
    import psutil

    ranks, frontier = [], [psutil.Process(pid)]
    while frontier:
        proc = frontier.pop()
        try:
            if _is_rank(proc):
                ranks.append(proc)
            else:
                frontier.extend(proc.children())
        except psutil.Error:
            continue
    return ranks


def _is_rank(proc) -> bool:
    import psutil

    try:
        environ, command = proc.environ(), " ".join(proc.cmdline())
    except psutil.Error:
        return False
    return "RANK" in environ and "LOCAL_RANK" in environ and not any(n in command for n in LOCAL_LAUNCHERS)


def _starts_local_ranks(pid: int) -> bool:
    import psutil

    try:
        tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        return any(name in " ".join(p.cmdline()) for p in tree for name in LOCAL_LAUNCHERS)
    except psutil.Error:
        return False


def stop_ranks(pid: int, signum: int) -> int:
    """Send `signum` to the training ranks under `pid` (waiting a moment for a launcher still starting them);
    the number reached. The ranks then finish their step, save and exit 75, and the launcher exits with their
    code: signalling DeepSpeed's launchers instead ends `deepspeed` at once and has its per-node launcher kill
    the ranks 30 s later. 0 means nobody was reached: signal the command itself (srun passes it on)."""
    deadline = time.monotonic() + RANKS_APPEAR_SECONDS
    while True:
        ranks = training_ranks(pid)
        if ranks or not _starts_local_ranks(pid) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for proc in ranks:
        proc.send_signal(signum)
    return len(ranks)


# ---------------------------------------------------------------- DeepSpeed's CPU op build lock


CPU_COMM_OP = "deepspeed_shm_comm"  # the op DeepSpeed builds (torch's JIT) when a CPU process group starts
STALE_LOCK_SECONDS = 600.0  # several nodes: a lock no process here holds is another node's build until this old
LOCK_SETTLE_SECONDS = 1.0  # a build that ends closes its lock file a moment before removing it


def check_op_build_locks(env: Mapping[str, str] = os.environ, ops: tuple = (CPU_COMM_OP,)) -> None:
    """Refuse a stale build lock of DeepSpeed's CPU communication op before the process group starts. torch's JIT
    build creates `<extensions dir>/<python>_<device>/<op>/lock`, builds, and removes it; a run killed meanwhile
    leaves it, and every later run then waits on it forever at process-group start, saying nothing (even with the
    op built, since the lock is taken to check it). A lock is stale when no process on this machine holds it open
    (the builder does) and the run is on one node; on several nodes, only once it is older than any build takes
    (another node may be building into a shared home folder)."""
    from ulysses_train.device import cuda_training

    if cuda_training():
        return  # DeepSpeed builds this op for CPU process groups only
    for lock in _op_build_locks(env, ops):
        if _held_open(lock):
            continue
        time.sleep(LOCK_SETTLE_SECONDS)
        try:
            age = time.time() - os.stat(lock).st_mtime
        except OSError:
            continue  # the build that held it just finished
        if _held_open(lock):
            continue
        if _one_node(env) or age > STALE_LOCK_SECONDS:
            raise LaunchError(f"DeepSpeed's CPU op build lock {lock} is left from a run killed while building it "
                              f"({age / 60:.0f} min old, no process here holds it), and the process group would "
                              f"wait on it forever. Fix: rm {lock} (or set TORCH_EXTENSIONS_DIR to another folder).")
        print(f"note: waiting for DeepSpeed's CPU op build lock {lock} (another node may be building the op); if "
              f"none is, remove the file.", file=sys.stderr, flush=True)


def _op_build_locks(env: Mapping[str, str], ops: tuple) -> list[str]:
    import glob

    root = env.get("TORCH_EXTENSIONS_DIR")
    if not root:
        from torch.utils.cpp_extension import get_default_build_root

        root = get_default_build_root()
    return sorted({path for op in ops for pattern in (f"*/{op}/lock", f"{op}/lock")
                   for path in glob.glob(os.path.join(glob.escape(root), pattern))})


def _held_open(path: str) -> bool:
    """Whether a process on this machine (one this user may inspect) has `path` open."""
    import psutil

    target = os.path.realpath(path)
    for proc in psutil.process_iter():
        try:
            if any(os.path.realpath(f.path) == target for f in proc.open_files()):
                return True
        except (psutil.Error, OSError):
            continue
    return False


def _one_node(env: Mapping[str, str]) -> bool:
    """The run's ranks all start on this machine (torchrun, deepspeed's launcher, one srun node, a bare process)."""
    if env.get("SLURM_NNODES") == "1":
        return True
    world = env.get("WORLD_SIZE") or env.get("SLURM_NTASKS") or "1"
    return world == "1" or (env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE")) == world


# ---------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["hosts"]:
        nodelist = argv[1] if len(argv) > 1 else os.environ.get("SLURM_JOB_NODELIST", "")
        if not nodelist:
            print("error: no node list given and SLURM_JOB_NODELIST is not set", file=sys.stderr)
            return 2
        try:
            print("\n".join(hostnames(nodelist)))
        except (LaunchError, subprocess.CalledProcessError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        return 0
    if argv[:1] == ["port"]:
        print(default_port(os.environ.get("SLURM_JOB_ID")))
        return 0
    if argv[:1] == ["stop-ranks"] and len(argv) in (2, 3) and argv[1].isdigit():
        import signal

        signum = signal.Signals[f"SIG{argv[2] if len(argv) == 3 else 'TERM'}"]
        reached = stop_ranks(int(argv[1]), signum)
        print(f"# passed {signum.name} to {reached} training rank(s) under pid {argv[1]}", flush=True)
        return 0 if reached else 1
    print("usage: python -m ulysses_train.parallel.launch hosts [NODELIST] | port | stop-ranks PID [TERM|INT]",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())


def local_gpus_per_node() -> int:
    """Processes per node as the launcher reports it (0 when unknown, e.g. a single process): torchrun's
    LOCAL_WORLD_SIZE, the deepspeed launcher's LOCAL_SIZE, or under srun the step's tasks per node.
    SLURM's job variables are not read under a launcher: one started by sbatch inherits e.g.
    SLURM_NTASKS_PER_NODE=1 (one launcher per node), which says nothing about its processes."""
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        value = os.environ.get(key, "")
        if value.isdigit():
            return int(value)
    return srun_tasks_per_node(os.environ) if launched_by_srun(os.environ) else 0
