"""The rank server (tests/rank_server.py, behind helpers.run_workers) against real launches: a distributed step
forked from it equals the same step launched by torchrun, bit for bit; a failing rank stops its group at once with
its own exit code; each rank sees torchrun's variables and nothing a previous group left behind."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

from helpers import REPO, WORKER, make_samples, run_workers, save_tiny_model, write_ds_config
from helpers import launch_ranks


def test_a_step_from_the_server_equals_the_same_step_launched_by_torchrun(tmp_path):
    model = save_tiny_model(str(tmp_path / "model"))
    data = str(tmp_path / "data.pt")
    torch.save(make_samples(1, 30, vocab=256, masked_prefix=12), data)
    ds = write_ds_config(str(tmp_path / "ds.json"))
    args = ["--model-dir", model, "--data", data, "--ds-config", ds, "--set", "parallel.sequence_parallel_size=2"]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=REPO, TOKENIZERS_PARALLELISM="false")
    real = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", WORKER,
                           *args, "--out", str(tmp_path / "real.pt")], env=env, capture_output=True, text=True,
                          timeout=300)
    assert real.returncode == 0, real.stderr[-3000:]
    run_workers(2, [*args, "--out", str(tmp_path / "forked.pt")])
    want, got = torch.load(tmp_path / "real.pt"), torch.load(tmp_path / "forked.pt")
    assert got["loss"] == want["loss"] and got["grads"].keys() == want["grads"].keys()
    for name, grad in want["grads"].items():
        assert torch.equal(got["grads"][name], grad), name


def test_a_failing_rank_stops_its_group_with_its_exit_code(tmp_path):
    """Rank 1 exits 3 while rank 0 would wait forever: the group ends at once with code 3 and both outputs; a group
    that never ends is killed at its deadline; a control group of the same script where no rank fails exits 0. Each
    rank sees torchrun's variables, and not what a rank of an earlier group set in its environment."""
    script = tmp_path / "ranks.py"
    script.write_text("import os, sys, time\n"
                      "print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], os.environ['LOCAL_WORLD_SIZE'],"
                      " os.environ['MASTER_PORT'].isdigit(), 'leftover' in os.environ, flush=True)\n"
                      "os.environ['leftover'] = '1'\n"
                      "if sys.argv[1] == 'fail' and os.environ['RANK'] == '1':\n    sys.exit(3)\n"
                      "if sys.argv[1] in ('fail', 'hang'):\n    time.sleep(600)\n")
    env = dict(os.environ, PYTHONPATH=REPO)
    began = time.monotonic()
    failed = launch_ranks(2, [str(script), "fail"], env, timeout=300)
    assert failed.returncode == 3 and time.monotonic() - began < 60
    assert "rank 1 of 2 2 True False" in failed.stdout
    hung = launch_ranks(2, [str(script), "hang"], env, timeout=2)  # the deadline kills a group that never ends
    assert hung.returncode == -9 and time.monotonic() - began < 120
    passed = launch_ranks(2, [str(script), "pass"], env, timeout=300)
    assert passed.returncode == 0
    assert passed.stdout.splitlines() == ["rank 0 of 2 2 True False", "rank 1 of 2 2 True False"]


def test_stale_shared_buffers_are_removed_and_live_ones_kept():
    """conftest.remove_stale_shared_buffers (run at the end of every test session) removes a DeepSpeed all-reduce
    buffer that is old and mapped by no process, and keeps one a live process maps (a running group's) and one made
    just now (between its making and its mapping). Control: the old unmapped one is there before the call."""
    import mmap
    import os
    import time
    import uuid

    from conftest import remove_stale_shared_buffers

    names = {kind: f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_test_{uuid.uuid4().hex}_{kind}"
             for kind in ("stale", "mapped", "young")}
    for path in names.values():
        with open(path, "wb") as fh:
            fh.write(b"\0" * 4096)
    old = time.time() - 3600
    for kind in ("stale", "mapped"):
        os.utime(names[kind], (old, old))
    with open(names["mapped"], "r+b") as fh, mmap.mmap(fh.fileno(), 4096):
        assert os.path.exists(names["stale"])
        remove_stale_shared_buffers()
        kept = {kind: os.path.exists(path) for kind, path in names.items()}
    for path in names.values():
        if os.path.exists(path):
            os.unlink(path)
    assert kept == {"stale": False, "mapped": True, "young": True}
