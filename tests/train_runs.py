"""scripts/train.py as real ranks, shared by the end-to-end tests (test_train_script.py, test_train_stops.py,
test_train_data.py): its path, the CPU environment, a torchrun command, and ranks forked by tests/rank_server.py."""
import os
import subprocess
import sys

from helpers import REPO, launch_ranks

TRAIN = os.path.join(REPO, "scripts", "train.py")


def env():
    return dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=REPO, TOKENIZERS_PARALLELISM="false")


def torchrun(nproc, *args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", TRAIN, *args]


def train_ranks(nproc, *args, run_env=None, timeout=600) -> subprocess.CompletedProcess:
    """scripts/train.py as `nproc` real ranks on gloo, forked by tests/rank_server.py with the environment torchrun
    gives each rank (helpers.launch_ranks: the imports paid once, not per run). For the runs whose check is the
    training itself (resume, data, tampered files); what the launchers do (torchrun, deepspeed, srun: signals,
    a killed launcher) is checked by the tests that start them."""
    return launch_ranks(nproc, [TRAIN, *args], run_env or env(), timeout)
