"""Several nodes: SLURM node lists, ranks and sp/dp groups from SLURM variables, the srun environment, sp kept
inside a node (test_slurm_jobs.py: the batch scripts and real multi-"node" runs)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from slurm_helpers import TRAIN, base_env


# ================================================================ node lists


@pytest.mark.parametrize("nodelist,hosts", [
    ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
    ("gpu[8-10]", ["gpu8", "gpu9", "gpu10"]),
    ("node7", ["node7"]),
    ("a1,b[2-3],c", ["a1", "b2", "b3", "c"]),
    ("r[1-2]n[08-09]", ["r1n08", "r1n09", "r2n08", "r2n09"]),
    ("dgx-[001-002]-ib", ["dgx-001-ib", "dgx-002-ib"]),
])
def test_expand_nodelist(nodelist, hosts):
    from ulysses_train.parallel.launch import expand_nodelist

    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["gpu[01-", "gpu[3-1]", "gpu[a-b]", ""])
def test_expand_nodelist_refuses_what_it_cannot_read(nodelist):
    from ulysses_train.parallel.launch import LaunchError, expand_nodelist

    with pytest.raises(LaunchError):
        expand_nodelist(nodelist)


def test_hostnames_prefers_scontrol_and_falls_back_to_the_parser(clean_env, fake_bin, tmp_path):
    from ulysses_train.parallel.launch import hostnames

    log = tmp_path / "calls.log"
    clean_env.setenv("FAKE_HOSTNAMES", "x1 x2")
    clean_env.setenv("FAKE_SLURM_LOG", str(log))
    clean_env.setenv("PATH", fake_bin + os.pathsep + os.environ["PATH"])
    assert hostnames("x[1-2]") == ["x1", "x2"]
    assert log.read_text() == "scontrol show hostnames x[1-2]\n"
    empty = tmp_path / "empty"
    empty.mkdir()
    clean_env.setenv("PATH", str(empty))
    assert hostnames("y[1-2]") == ["y1", "y2"]


def test_tasks_per_node_parsing():
    from ulysses_train.parallel.launch import parse_tasks_per_node

    assert parse_tasks_per_node("8(x2),4") == [8, 8, 4]
    assert parse_tasks_per_node("4") == [4]


# ================================================================ ranks and groups from the environment


def srun_task(env, procid, nodes=2, per_node=4, job_id="1234", nodelist="gpu[01-02]"):
    """Set the variables srun gives task `procid` of a block-distributed step."""
    for key, value in dict(SLURM_PROCID=procid, SLURM_LOCALID=procid % per_node, SLURM_NODEID=procid // per_node,
                           SLURM_NTASKS=nodes * per_node, SLURM_STEP_TASKS_PER_NODE=f"{per_node}(x{nodes})",
                           SLURM_STEP_NODELIST=nodelist, SLURM_JOB_NODELIST=nodelist, SLURM_JOB_ID=job_id).items():
        env.setenv(key, str(value))


@pytest.mark.parametrize("sp", [1, 2, 4])
def test_srun_ranks_and_groups_keep_sp_inside_a_node(clean_env, sp):
    """2 nodes x 4 tasks under srun: ranks, local ranks and GPUs per node come from SLURM, and every sp group
    is a run of consecutive ranks on one node; dp groups (same sp_rank) span the nodes."""
    from ulysses_train.parallel.layout import ParallelDims, rank_from_environment
    from ulysses_train.parallel.launch import local_gpus_per_node

    layout = {}
    for procid in range(8):
        srun_task(clean_env, procid)
        rank, local, world = rank_from_environment()
        assert (rank, local, world) == (procid, procid % 4, 8)
        assert local_gpus_per_node() == 4
        dims = ParallelDims(world_size=world, sp=sp, rank=rank, gpus_per_node=local_gpus_per_node())
        layout[rank] = (procid // 4, dims.dp_rank, dims.sp_rank)
    assert {dp for _, dp, _ in layout.values()} == set(range(8 // sp))
    for dp in range(8 // sp):
        members = sorted(r for r, (_, d, _) in layout.items() if d == dp)
        assert members == list(range(dp * sp, (dp + 1) * sp))            # consecutive ranks
        assert len({layout[r][0] for r in members}) == 1                   # on one node
        assert [layout[r][2] for r in members] == list(range(sp))          # sp_rank = position in the group


def test_launcher_variables_win_over_the_batch_jobs_slurm_variables(clean_env):
    """The DeepSpeed launcher inside an sbatch job: the processes inherit the batch step's SLURM_PROCID=0 and
    SLURM_NTASKS_PER_NODE=1 (one launcher per node). Ranks and GPUs per node must come from the launcher
    (RANK, LOCAL_SIZE), or sp=2 would be refused as 'larger than a node (1 GPUs)'."""
    from ulysses_train.parallel.layout import ParallelDims, rank_from_environment
    from ulysses_train.parallel.launch import local_gpus_per_node

    for key, value in dict(SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="1",
                           SLURM_TASKS_PER_NODE="1(x2)", SLURM_GPUS_ON_NODE="8", RANK="13", LOCAL_RANK="5",
                           WORLD_SIZE="16", LOCAL_SIZE="8").items():
        clean_env.setenv(key, value)
    assert rank_from_environment() == (13, 5, 16)
    assert local_gpus_per_node() == 8
    dims = ParallelDims(world_size=16, sp=8, rank=13, gpus_per_node=local_gpus_per_node())
    assert (dims.dp_rank, dims.sp_rank) == (1, 5)
    clean_env.delenv("LOCAL_SIZE")
    clean_env.setenv("LOCAL_WORLD_SIZE", "8")                              # torchrun's name
    assert local_gpus_per_node() == 8
    clean_env.delenv("LOCAL_WORLD_SIZE")
    assert local_gpus_per_node() == 0                                      # unknown, not SLURM's 1


def test_srun_gpus_per_node_with_uneven_nodes_and_cyclic_distribution(clean_env):
    from ulysses_train.parallel.launch import LaunchError
    from ulysses_train.parallel.launch import local_gpus_per_node

    srun_task(clean_env, 9, nodes=2, per_node=8)
    clean_env.setenv("SLURM_STEP_TASKS_PER_NODE", "8,4")
    clean_env.setenv("SLURM_NODEID", "1")
    clean_env.setenv("SLURM_LOCALID", "1")
    assert local_gpus_per_node() == 4                                      # an sp dividing 4 divides both nodes
    clean_env.setenv("SLURM_STEP_TASKS_PER_NODE", "4(x2)")
    clean_env.setenv("SLURM_PROCID", "3")                                  # cyclic: rank 3 is local 1 of node 1
    with pytest.raises(LaunchError, match="--distribution=block"):
        local_gpus_per_node()


@pytest.mark.parametrize("per_node,sp,message", [
    (6, 4, "does not divide the 6 GPUs per node"),
    (4, 8, "is larger than a node (4 GPUs)"),
])
def test_sp_straddling_nodes_is_refused_unless_allowed(clean_env, per_node, sp, message):
    from ulysses_train.config import ConfigError
    from ulysses_train.parallel.layout import ParallelDims
    from ulysses_train.parallel.launch import local_gpus_per_node

    srun_task(clean_env, 0, nodes=4, per_node=per_node)
    gpus = local_gpus_per_node()
    with pytest.raises(ConfigError, match="parallel.allow_sp_across_nodes=true"):
        ParallelDims(world_size=4 * per_node, sp=sp, gpus_per_node=gpus)
    with pytest.raises(ConfigError) as err:
        ParallelDims(world_size=4 * per_node, sp=sp, gpus_per_node=gpus)
    assert message in str(err.value)
    dims = ParallelDims(world_size=4 * per_node, sp=sp, gpus_per_node=gpus, allow_sp_across_nodes=True)
    assert dims.dp == 4 * per_node // sp


def test_srun_environment_points_every_task_at_the_first_host(clean_env, tmp_path):
    from ulysses_train.parallel.launch import srun_environment

    empty = tmp_path / "empty"
    empty.mkdir()
    clean_env.setenv("PATH", str(empty))                                   # no scontrol: the parser
    srun_task(clean_env, 5, nodelist="gpu[07-08]", job_id="987654")
    assert srun_environment(os.environ) == {"MASTER_ADDR": "gpu07", "MASTER_PORT": str(29500 + 654),
                                            "LOCAL_WORLD_SIZE": "4"}
    clean_env.setenv("MASTER_ADDR", "10.0.0.1")                            # the batch script's export wins
    clean_env.setenv("MASTER_PORT", "31000")
    assert srun_environment(os.environ) == {"LOCAL_WORLD_SIZE": "4"}
    clean_env.setenv("RANK", "5")                                          # a launcher's process: not srun's
    clean_env.setenv("WORLD_SIZE", "8")
    assert srun_environment(os.environ) == {}


def test_train_script_under_srun_refuses_sp_across_nodes_with_exit_2(tmp_path):
    """The whole entry point, posing as task 0 of an srun step with 3 tasks per node: sp=2 would put ranks
    2 and 3 (nodes 0 and 1) in one group. Refused before any process group, naming the fix."""
    env = base_env(SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_NTASKS="6",
                   SLURM_STEP_TASKS_PER_NODE="3(x2)", SLURM_STEP_NODELIST="localhost", SLURM_JOB_ID="7")
    proc = subprocess.run([sys.executable, TRAIN, "--set", f"train.output_dir={tmp_path}",
                           "--set", "parallel.sequence_parallel_size=2"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "does not divide the 3 GPUs per node" in proc.stderr
    assert "parallel.allow_sp_across_nodes=true" in proc.stderr
    assert "Traceback" not in proc.stderr
