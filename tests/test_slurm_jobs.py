"""The SLURM batch scripts: dry runs with a fake SLURM (tests/fake_bin) that write the hostfile, the env file and
the launcher's command; real two-"node" runs on this machine (gloo, sp=2 dp=2) whose losses equal a one-node run
(two torchrun invocations, the sbatch script through DeepSpeed's multi-node launcher, a run that loses a node and
resumes on a new allocation); a clean stop that requeues the job; the kernels warmed once per node.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest
from helpers import REPO, kill_tree, launch_ranks, wait_for_steps
from slurm_helpers import RUN, SBATCH, SRUN_SBATCH, TRAIN, base_env, finish, losses, start, torchrun_node

from ulysses_train.parallel.ports import free_port


# ================================================================ the batch scripts, dry run


def sbatch_env(fake_bin, tmp_path, **extra):
    env = base_env(PATH=fake_bin + os.pathsep + os.environ["PATH"], FAKE_SLURM_LOG=str(tmp_path / "calls.log"),
                   SLURM_SUBMIT_DIR=REPO, SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="gpu[01-03]",
                   FAKE_HOSTNAMES="gpu01 gpu02 gpu03", SLURM_JOB_NUM_NODES="3", SLURM_NNODES="3",
                   SLURM_NTASKS_PER_NODE="1", SLURM_GPUS_ON_NODE="8", JOB_DIR=str(tmp_path / "job"))
    env.update(extra)
    return env


def run_sbatch(script, env, *args):
    """Run a batch script as sbatch would: from the spool folder, a copy of the file, bash."""
    spool = os.path.join(env["FAKE_SLURM_LOG"] + ".spool")
    os.makedirs(spool, exist_ok=True)
    copy = os.path.join(spool, "slurm_script")
    shutil.copy(script, copy)
    return subprocess.run(["bash", copy, *args], env=env, cwd=spool, capture_output=True, text=True, timeout=120)


def printed_command(stdout):
    lines = stdout.splitlines()
    return shlex.split(lines[lines.index(next(l for l in lines if l.startswith("# command"))) + 1])


def test_sbatch_dry_run_writes_hostfile_env_file_and_deepspeed_command(fake_bin, tmp_path):
    env = sbatch_env(fake_bin, tmp_path, DRY_RUN="1", NCCL_SOCKET_IFNAME="ib0", FORWARD_VARS="MY_SETTING",
                     MY_SETTING="a b")
    proc = run_sbatch(SBATCH, env, "--config", "configs/qwen3_8b_1m_8gpu.yaml", "--set", "train.output_dir=/shared/x y")
    assert proc.returncode == 0, proc.stderr
    job = tmp_path / "job"
    assert (job / "hostfile").read_text() == "gpu01 slots=8\ngpu02 slots=8\ngpu03 slots=8\n"
    assert "scontrol show hostnames gpu[01-03]" in (tmp_path / "calls.log").read_text()

    # the env file, read by DeepSpeed's own parser and exporter (no blank lines or comments: it would fail)
    from deepspeed.launcher.multinode_runner import PDSHRunner

    exported = {}
    for line in (job / ".deepspeed_env").read_text().splitlines(keepends=True):
        key, value = line.split("=", maxsplit=1)
        PDSHRunner.add_export(type("R", (), {"exports": exported})(), key, value)
    assert exported["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert exported["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert exported["NCCL_DEBUG"] == "WARN"
    assert exported["NCCL_SOCKET_IFNAME"] == "ib0"
    assert exported["MY_SETTING"] == '"a b"'
    assert "DEEPSPEED_TIMEOUT" not in exported                             # the config's train.timeout_minutes

    cmd = printed_command(proc.stdout)
    assert cmd[cmd.index("--hostfile") + 1] == str(job / "hostfile")
    launcher = cmd[:cmd.index("--hostfile")]
    assert launcher in (["deepspeed"], ["python", "-m", "deepspeed.launcher.runner"])
    assert cmd[len(launcher) + 2:] == [
        "--num_nodes", "3", "--num_gpus", "8", "--master_addr", "gpu01", "--master_port", str(29500 + 242),
        "scripts/train.py", "--config", "configs/qwen3_8b_1m_8gpu.yaml", "--set", "train.output_dir=/shared/x y"]


def test_sbatch_dry_run_options(fake_bin, tmp_path):
    """GPUs from SLURM_GPUS_PER_NODE='type:N', fewer nodes than allocated, a requeued job resumes, an
    explicit timeout reaches both DeepSpeed and the trainer, and one node needs no hostfile (no ssh)."""
    env = sbatch_env(fake_bin, tmp_path, DRY_RUN="1", SLURM_GPUS_PER_NODE="h100:4", NUM_NODES="2",
                     SLURM_RESTART_COUNT="1", TIMEOUT_MINUTES="240", MASTER_PORT="31111")
    del env["SLURM_GPUS_ON_NODE"]
    proc = run_sbatch(SBATCH, env, "--config", "c.yaml")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "job" / "hostfile").read_text() == "gpu01 slots=4\ngpu02 slots=4\n"
    assert "DEEPSPEED_TIMEOUT=240\n" in (tmp_path / "job" / ".deepspeed_env").read_text()
    cmd = printed_command(proc.stdout)
    assert cmd[cmd.index("--num_nodes"):] == [
        "--num_nodes", "2", "--num_gpus", "4", "--master_addr", "gpu01", "--master_port", "31111",
        "scripts/train.py", "--config", "c.yaml", "--resume-if-present", "--set",
        "train.timeout_minutes=240"]

    one = run_sbatch(SBATCH, dict(env, NUM_NODES="1", SLURM_RESTART_COUNT="0"), "--config", "c.yaml")
    cmd = printed_command(one.stdout)
    assert "--hostfile" not in cmd and cmd[cmd.index("--num_gpus"):] == [
        "--num_gpus", "4", "--master_port", "31111", "scripts/train.py", "--config", "c.yaml",
        "--set", "train.timeout_minutes=240"]


@pytest.mark.parametrize("change,message", [
    ({"SLURM_GPUS_ON_NODE": None}, "cannot tell the GPUs per node"),
    ({"SLURM_JOB_NODELIST": None}, "SLURM_JOB_NODELIST is not set"),
    ({"SLURM_SUBMIT_DIR": "/"}, "has no scripts/train.py"),
    ({"NUM_NODES": "4"}, "NUM_NODES=4 but the job has 3 node(s)"),
])
def test_sbatch_refuses_with_a_message(fake_bin, tmp_path, change, message):
    env = sbatch_env(fake_bin, tmp_path, DRY_RUN="1")
    for key, value in change.items():
        env.pop(key) if value is None else env.__setitem__(key, value)
    proc = run_sbatch(SBATCH, env, "--config", "c.yaml")
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_srun_sbatch_dry_run(fake_bin, tmp_path):
    env = sbatch_env(fake_bin, tmp_path, DRY_RUN="1", SLURM_NTASKS_PER_NODE="8", SRUN_ARGS="--cpus-per-task=12")
    proc = run_sbatch(SRUN_SBATCH, env, "--config", "c.yaml", "--set", "train.steps=3")
    assert proc.returncode == 0, proc.stderr
    assert "rendezvous gpu01:29742" in proc.stdout
    assert printed_command(proc.stdout) == [
        "srun", "--kill-on-bad-exit=1", "--distribution=block", "--cpus-per-task=12", "python", "-u",
        "scripts/train.py", "--config", "c.yaml", "--set", "train.steps=3"]


# ================================================================ real runs: two "nodes" on this machine


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    """The reference: one node of 4 processes, sp=2 dp=2, as torchrun --standalone starts them (forked by the rank
    server: the launchers are what the tests below check, not this run)."""
    out = str(tmp_path_factory.mktemp("one_node") / "run")
    proc = launch_ranks(4, [TRAIN, "--set", f"train.output_dir={out}", *RUN], base_env(), 600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = losses(out)
    assert [r[0] for r in records] == list(range(1, 10))
    return records


def test_two_torchrun_nodes_equal_one_node(one_node, tmp_path):
    """Two torchrun invocations with node ranks 0 and 1 (2 processes each) rendezvous on loopback, share one
    output folder (the shared filesystem), and train exactly what one node of 4 processes trains."""
    out, port = str(tmp_path / "run"), free_port()
    nodes = [start(torchrun_node(2, n, 2, port, "--set", f"train.output_dir={out}", *RUN), base_env(),
                   str(tmp_path / f"node{n}.log")) for n in range(2)]
    results = [finish(node, timeout=600) for node in nodes]
    for n, (rc, log) in enumerate(results):
        assert rc == 0, f"node {n}:\n{log[-4000:]}"
    assert losses(out) == one_node


def test_sbatch_through_the_deepspeed_multinode_launcher_equals_one_node(one_node, fake_bin, tmp_path):
    """scripts/slurm/train.sbatch for real: 2 nodes x 2 'GPUs', DeepSpeed's pdsh launcher (a fake pdsh that
    runs each node's command here in an empty environment, like a fresh ssh login), so DS_ACCELERATOR and
    OMP_NUM_THREADS reach the processes only through the env file."""
    out = str(tmp_path / "run")
    env = sbatch_env(fake_bin, tmp_path, SLURM_JOB_NODELIST="node[a-b]", FAKE_HOSTNAMES="nodea nodeb",
                     SLURM_JOB_NUM_NODES="2", SLURM_NNODES="2", GPUS_PER_NODE="2", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(free_port()), FORWARD_VARS="DS_ACCELERATOR OMP_NUM_THREADS",
                     SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NTASKS="2")
    spool = tmp_path / "spool"
    spool.mkdir()
    shutil.copy(SBATCH, spool / "slurm_script")
    proc = subprocess.Popen(["bash", str(spool / "slurm_script"), "--set", f"train.output_dir={out}", *RUN],
                            env=env, cwd=spool, stdout=open(tmp_path / "job.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    proc.log_path = str(tmp_path / "job.log")
    rc, log = finish(proc, timeout=600)
    assert rc == 0, log[-6000:]
    calls = (tmp_path / "calls.log").read_text()
    assert "pdsh -S -f 1024 -w nodea,nodeb" in calls and "--node_rank=%n" in calls
    assert "export DS_ACCELERATOR=cpu" in calls
    assert losses(out) == one_node


def test_node_lost_mid_run_stops_the_job_keeps_the_checkpoint_and_resumes_on_a_new_allocation(one_node, fake_bin,
                                                                                                tmp_path):
    """Two torchrun 'nodes'; once the step-3 checkpoint is complete, node 1 dies (SIGKILL, whole tree). Node 0
    must stop with an error instead of hanging; `latest_good` still names a complete checkpoint. A new
    allocation (the srun script, 2 nodes x 2 tasks, other ranks' launcher) resumes it with --resume, and
    every step's loss equals the uninterrupted one-node run."""
    from ulysses_train.training import checkpoint

    out, port = str(tmp_path / "run"), free_port()
    long_run = ["--set", f"train.output_dir={out}", *RUN, "--set", "train.steps=1000"]
    nodes = [start(torchrun_node(2, n, 2, port, *long_run), base_env(), str(tmp_path / f"node{n}.log"))
             for n in range(2)]
    latest = os.path.join(out, "checkpoints", checkpoint.LATEST)
    deadline = time.time() + 300
    while not os.path.exists(latest) and time.time() < deadline and all(n.poll() is None for n in nodes):
        time.sleep(0.05)
    kill_tree(nodes[1].pid)
    nodes[1].wait()
    started = time.time()
    rc, log = finish(nodes[0], timeout=300)
    assert rc not in (0, None), "node 0 kept running after node 1 was lost"
    print(f"node 0 stopped {time.time() - started:.1f} s after node 1 was lost, rc={rc}; its last lines:\n"
          + "\n".join(log.splitlines()[-5:]))
    tag = checkpoint.latest_good(out)
    assert tag is not None
    resumed_from = int(tag.split("_")[1])
    assert resumed_from in (3, 6), resumed_from

    env = sbatch_env(fake_bin, tmp_path, SLURM_JOB_NODELIST="localhost,127.0.0.1", FAKE_HOSTNAMES="localhost 127.0.0.1",
                     SLURM_JOB_NUM_NODES="2", SLURM_NNODES="2", SLURM_NTASKS_PER_NODE="2",
                     MASTER_PORT=str(free_port()), SLURM_RESTART_COUNT="1")
    spool = tmp_path / "spool"
    spool.mkdir()
    shutil.copy(SRUN_SBATCH, spool / "slurm_script")
    proc = subprocess.Popen(["bash", str(spool / "slurm_script"), "--set", f"train.output_dir={out}", *RUN,
                             "--set", f"train.steps={resumed_from + 3}"],
                            env=env, cwd=spool, stdout=open(tmp_path / "srun.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    proc.log_path = str(tmp_path / "srun.log")
    rc, log = finish(proc, timeout=600)
    assert rc == 0, log[-6000:]
    assert f"resumed from {tag}" in log
    assert "srun --kill-on-bad-exit=1" in (tmp_path / "calls.log").read_text()
    assert losses(out) == one_node[:resumed_from + 3]


# ---------------------------------------------------------------- a clean stop requeues the job

REQUEUE_SH = os.path.join(REPO, "scripts", "slurm", "run_or_requeue.sh")


@pytest.mark.parametrize("command_exit,requeued", [(75, True), (1, False), (0, False)])
def test_a_job_that_stopped_cleanly_is_requeued_and_keeps_its_exit_code(fake_bin, tmp_path, command_exit, requeued):
    log = tmp_path / "calls.log"
    env = dict(os.environ, PATH=f"{fake_bin}{os.pathsep}{os.environ['PATH']}", FAKE_SLURM_LOG=str(log),
               SLURM_JOB_ID="4242")
    proc = subprocess.run(["bash", "-c", f"set -euo pipefail; source {REQUEUE_SH}; run_or_requeue bash -c 'exit {command_exit}'"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == command_exit
    calls = log.read_text() if log.exists() else ""
    assert ("scontrol requeue 4242" in calls) == requeued, calls
    if requeued:
        assert "requeueing job 4242" in proc.stdout


def test_sigterm_to_the_batch_shell_reaches_the_training_command(fake_bin, tmp_path):
    """sbatch --signal=B:TERM signals only the batch shell: it must pass the signal on and report the command's
    own exit code (here a stand-in that exits 75 on SIGTERM, as the trainer does after its checkpoint)."""
    stand_in = tmp_path / "trainer.sh"
    stand_in.write_text("trap 'echo got-term; exit 75' TERM\nwhile true; do sleep 0.05; done\n")
    log = tmp_path / "calls.log"
    env = dict(os.environ, PATH=f"{fake_bin}{os.pathsep}{os.environ['PATH']}", FAKE_SLURM_LOG=str(log),
               SLURM_JOB_ID="7")
    proc = subprocess.Popen(["bash", "-c", f"set -euo pipefail; source {REQUEUE_SH}; run_or_requeue bash {stand_in}"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 75 and "got-term" in out, (out, err)
    assert "scontrol requeue 7" in log.read_text()


def test_a_command_that_ends_while_the_signal_is_passed_on_keeps_its_exit_code(fake_bin, tmp_path):
    """The race CI met: the command ends (exit 75) before the trap handler returns, so it is gone when
    run_or_requeue looks whether to wait again; the old loop then returned the interrupted wait's 143. Forced here:
    the handler signals the command and returns only after it has ended."""
    stand_in = tmp_path / "trainer.sh"
    stand_in.write_text("trap 'exit 75' TERM\nwhile true; do sleep 0.05; done\n")
    env = dict(os.environ, PATH=f"{fake_bin}{os.pathsep}{os.environ['PATH']}", FAKE_SLURM_LOG=str(tmp_path / "log"))
    slow_handler = 'stop_training() { kill -TERM "$1"; sleep 1; }'
    proc = subprocess.Popen(["bash", "-c", f"set -euo pipefail; source {REQUEUE_SH}; {slow_handler}; "
                             f"run_or_requeue bash {stand_in}"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, (proc.returncode, out, err)


# ---------------------------------------------------------------- a stop through the real launchers is requeued


STOP_RUN = ["--set", "train.steps=1000", "--set", "train.export_hf=false", "--set", "train.log_every=1",
            "--set", "parallel.sequence_parallel_size=2"]


@pytest.mark.parametrize("how", ["deepspeed-sigterm-to-the-batch-shell", "deepspeed-ctrl-c-at-the-terminal",
                                 "srun-sigterm-to-the-batch-shell"])
def test_a_stop_waits_for_the_ranks_checkpoint_exits_75_and_requeues(fake_bin, tmp_path, how):
    """SLURM's warning signal (sbatch --signal=B:TERM: the batch shell only) or a Ctrl-C at the terminal (the whole
    foreground process group) around the real `deepspeed` launcher, and around srun-started ranks (the srun batch
    script; the fake srun passes signals on as srun does): the command returns only after every rank finished its
    step and the checkpoint is complete, exits 75 and requeues the job; no process is left behind."""
    import psutil

    from ulysses_train.training import checkpoint

    out = str(tmp_path / "run")
    args = ["--set", f"train.output_dir={out}", *STOP_RUN]
    env = sbatch_env(fake_bin, tmp_path, SLURM_JOB_NODELIST="localhost", FAKE_HOSTNAMES="localhost",
                     SLURM_JOB_NUM_NODES="1", SLURM_NNODES="1", SLURM_NTASKS_PER_NODE="2", SLURM_JOB_ID="4242",
                     MASTER_PORT=str(free_port()), PYTHON=sys.executable)
    if how.startswith("srun"):
        cmd = ["bash", SRUN_SBATCH, *args]
    else:
        launcher = f"{shlex.quote(sys.executable)} -m deepspeed.launcher.runner --num_gpus 2 --master_port {free_port()}"
        cmd = ["bash", "-c", f"set -euo pipefail; source {REQUEUE_SH}; run_or_requeue {launcher} {TRAIN} "
                             + " ".join(map(shlex.quote, args))]
    proc, tree = start(cmd, env, str(tmp_path / "job.log")), []
    try:
        wait_for_steps(out, 2, proc)
        tree = psutil.Process(proc.pid).children(recursive=True)
        if how == "deepspeed-ctrl-c-at-the-terminal":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
        rc, log = finish(proc, timeout=300)
        _, alive = psutil.wait_procs(tree, timeout=5)
    finally:  # orphans of a launcher that returned early must not outlive the test
        kill_tree(proc.pid)
        for child in tree:
            child.kill() if child.is_running() else None
    assert not alive, f"left running after the command returned: {[p.cmdline() for p in alive]}"
    assert rc == 75, log[-4000:]
    stopped_at = len(losses(out))
    assert checkpoint.latest_good(out) == checkpoint.tag_for(stopped_at), log[-4000:]
    assert "requeueing job 4242" in log and "scontrol requeue 4242" in (tmp_path / "calls.log").read_text()
    assert "Traceback" not in log, log[-4000:]


def printed_warm(stdout):
    lines = stdout.splitlines()
    marks = [i for i, line in enumerate(lines) if line.startswith("# kernels, once per node")]
    return shlex.split(lines[marks[0] + 1]) if marks else None


@pytest.mark.parametrize("script", [SBATCH, SRUN_SBATCH])
def test_both_scripts_warm_the_kernels_once_per_node_before_the_ranks(fake_bin, tmp_path, script):
    """One task per node runs scripts/warm_kernels.py with the run's --config and --set (not --resume); WARM_KERNELS=0
    and a run without --config (the demo) print no warm line: the controls."""
    env = sbatch_env(fake_bin, tmp_path, DRY_RUN="1", SLURM_NTASKS_PER_NODE="8")
    proc = run_sbatch(script, env, "--config", "c.yaml", "--set", "train.steps=3", "--resume")
    assert proc.returncode == 0, proc.stderr
    warm = printed_warm(proc.stdout)
    assert warm[:2] == ["srun", "--nodes=3"] and "--ntasks-per-node=1" in warm
    assert warm[-5:] == ["scripts/warm_kernels.py", "--config", "c.yaml", "--set", "train.steps=3"]
    assert proc.stdout.index("# kernels, once per node") < proc.stdout.index("# command")
    assert printed_warm(run_sbatch(script, {**env, "WARM_KERNELS": "0"}, "--config", "c.yaml").stdout) is None
    assert printed_warm(run_sbatch(script, env).stdout) is None


def missing_kernel_cache_forwards(sbatch_text: str) -> set:
    """The kernel cache settings (training/first_use_kernels.py, their one definition) that train.sbatch does not
    send to the other nodes: the deepspeed launcher starts them over ssh with only the variables it is given."""
    from ulysses_train.training import first_use_kernels as fuk

    block = re.search(r'^FORWARD="(.*?)"', sbatch_text, flags=re.S | re.M).group(1)
    wanted = {var for var, _, _ in fuk.CACHES.values()} | {fuk.SHARED_CACHE_VAR, fuk.CUTE_DSL_CACHE_SWITCH}
    return wanted - set(block.split())


def test_every_kernel_cache_setting_reaches_every_node():
    text = open(SBATCH).read()
    assert missing_kernel_cache_forwards(text) == set()
    # control: a list without FlashAttention 4's cache folder is caught
    assert missing_kernel_cache_forwards(text.replace(" FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", "")) == {
        "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"}
