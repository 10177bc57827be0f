"""What the SLURM tests share (test_slurm.py: node lists, ranks and groups; test_slurm_jobs.py: the batch
scripts and real multi-"node" runs): the scripts' paths, an environment without launcher or SLURM variables,
the fake SLURM commands (tests/fake_bin; conftest.py's fake_bin and clean_env fixtures use these), and starting
and finishing a command in its own session."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from helpers import REPO, kill_tree

TRAIN = os.path.join(REPO, "scripts", "train.py")
SBATCH = os.path.join(REPO, "scripts", "slurm", "train.sbatch")
SRUN_SBATCH = os.path.join(REPO, "scripts", "slurm", "train_srun.sbatch")
FAKE_BIN = os.path.join(REPO, "tests", "fake_bin")
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "GPUS_PER_NODE", "NUM_NODES", "TIMEOUT_MINUTES", "FORWARD_VARS", "DS_ENV_FILE", "JOB_DIR", "REPO")
# the same run everywhere: the demo, sp=2 (its default), 9 steps, a checkpoint every 3
RUN = ["--set", "train.steps=9", "--set", "train.save_every=3", "--set", "train.export_hf=false",
       "--set", "train.log_every=1", "--set", "parallel.sequence_parallel_size=2"]  # the same sp on every layout


def base_env(**extra) -> dict:
    """This process's environment without any launcher or SLURM variables (the suite may itself run in a
    SLURM job), plus the CPU settings of the other end-to-end tests."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in LAUNCH_VARS}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=REPO, TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env


def default_sigint() -> None:
    """In the started command, before it runs: Ctrl-C's default action, as a terminal's shell has it. A test run
    started in the background of a non-interactive shell inherits SIGINT ignored, and a shell started with a signal
    ignored cannot trap it (bash), so the Ctrl-C case would test nothing there."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(cmd, env, log_path):
    """Start a command in its own session, output to a file (several run at once: pipes could fill up)."""
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=default_sigint)
    proc.log_path = log_path
    return proc


def finish(proc, timeout):
    """Wait for a started command; on timeout kill its whole tree. Returns (returncode, output)."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.wait()
    with open(proc.log_path) as fh:
        return proc.returncode, fh.read()


def torchrun_node(nnodes, node_rank, nproc, port, *args):
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node_rank={node_rank}",
            f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1", f"--master_port={port}", TRAIN, *args]


def losses(output_dir):
    with open(os.path.join(output_dir, "metrics.jsonl")) as fh:
        return [(r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, fh) if r]
