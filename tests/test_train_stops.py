"""scripts/train.py stopped, killed and damaged, on CPU: a run killed mid-way resumes with identical losses; a
partial save never replaces the last good checkpoint (a disk full on one rank is named, its partial folder
removed); SIGTERM to one worker, to a single process or to the deepspeed command stops every rank after the step
with a checkpoint; a resume refuses tampered files and falls back past damaged ones. Each against the losses of
one uninterrupted run (test_train_script.py: refusals, the demo, export)."""
import glob
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import REPO, kill_tree, live_commands, read_metrics, wait_for_steps
from train_runs import TRAIN, env, torchrun, train_ranks


RUN_COMMON = ["--set", "train.export_hf=false", "--set", "train.log_every=1"]
STRAIGHT_STEPS = 30


@pytest.fixture(scope="module")
def straight_losses(tmp_path_factory):
    """(loss, grad_norm) of every step of an uninterrupted 2-process demo run: what every stopped, killed or
    fallen-back run must reproduce after its resume."""
    out = str(tmp_path_factory.mktemp("straight") / "run")
    run = train_ranks(2, "--set", f"train.output_dir={out}", "--set", f"train.steps={STRAIGHT_STEPS}", *RUN_COMMON)
    assert run.returncode == 0, run.stderr[-3000:]
    return [(r["loss"], r["grad_norm"]) for r in read_metrics(out)]


def train_processes(launcher_pid):
    return [p for p, text in live_commands(launcher_pid) if TRAIN in text and "deepspeed.launcher" not in text]


def resume_and_compare(output_dir, resumed_from, straight, extra=3):
    steps = resumed_from + extra
    resumed = train_ranks(2, "--set", f"train.output_dir={output_dir}", "--set", f"train.steps={steps}", "--resume",
                          *RUN_COMMON)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from step_{resumed_from:08d}" in resumed.stdout
    got = read_metrics(output_dir)
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    assert [(r["loss"], r["grad_norm"]) for r in got] == straight[:steps]
    return resumed


def test_sigterm_to_one_worker_stops_every_rank_after_the_step_with_a_checkpoint(tmp_path, straight_losses):
    """SLURM-style: SIGTERM reaches one rank only. Both ranks finish the step, agree, save and exit; the resumed
    run's losses equal the uninterrupted run's."""
    from ulysses_train.training import checkpoint

    out = str(tmp_path / "run")
    proc = subprocess.Popen(torchrun(2, "--set", f"train.output_dir={out}", "--set", "train.steps=1000", *RUN_COMMON),
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    wait_for_steps(out, 3, proc)
    rank1 = [p for p in train_processes(proc.pid) if p.environ().get("RANK") == "1"]
    assert len(rank1) == 1
    rank1[0].send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert "another rank was asked to stop: saving a checkpoint after this step" in stderr  # said once, by rank 0
    assert "received SIGTERM" not in stderr  # rank 1 (not the first of its node) does not repeat it
    assert "exitcode  : 75" in stderr or "exitcode: 75" in stderr, stderr[-3000:]
    stopped_at = len(read_metrics(out))
    assert checkpoint.latest_good(out) == checkpoint.tag_for(stopped_at)  # the step was not lost
    assert stopped_at + 3 <= STRAIGHT_STEPS
    resume_and_compare(out, stopped_at, straight_losses)


def test_a_single_process_stopped_by_sigterm_exits_75_after_saving(tmp_path):
    """What srun passes on to the job: the worker's own exit code, 75 = stopped cleanly, resume me."""
    from ulysses_train.parallel.ports import free_port
    from ulysses_train.training import checkpoint

    out = str(tmp_path / "run")
    single = dict(env(), WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = subprocess.Popen([sys.executable, TRAIN, "--set", f"train.output_dir={out}", "--set", "train.steps=1000",
                             "--set", "parallel.sequence_parallel_size=1", *RUN_COMMON], env=single,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_steps(out, 2, proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 75, stderr[-3000:]
    stopped_at = len(read_metrics(out))
    assert f"stopped after step {stopped_at} (received SIGTERM); checkpoint step_{stopped_at:08d} is saved" in stderr
    assert checkpoint.latest_good(out) == checkpoint.tag_for(stopped_at)
    assert "Traceback" not in stderr


def test_killing_the_deepspeed_command_ends_its_workers_with_a_checkpoint(tmp_path):
    """`deepspeed` starts DeepSpeed's per-node launcher, which starts the workers; SIGTERM to the `deepspeed`
    command alone reaches neither. The workers notice, finish the step, save and exit."""
    import psutil

    from ulysses_train.parallel.ports import free_port
    from ulysses_train.training import checkpoint

    out = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
           TRAIN, "--set", f"train.output_dir={out}", "--set", "train.steps=1000", *RUN_COMMON]
    runner = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        wait_for_steps(out, 2, runner)
        workers = train_processes(runner.pid)
        assert len(workers) == 2
        everything = psutil.Process(runner.pid).children(recursive=True)
        runner.send_signal(signal.SIGTERM)
        runner.wait(timeout=60)
        gone, alive = psutil.wait_procs(everything, timeout=120)
        assert not alive, f"still running after the launcher died: {[p.cmdline() for p in alive]}"
    finally:
        kill_tree(runner.pid) if runner.poll() is None else None
    stopped_at = len(read_metrics(out))
    assert checkpoint.latest_good(out) == checkpoint.tag_for(stopped_at)


def test_one_ctrl_c_to_a_bare_deepspeed_run_saves_the_step(tmp_path):
    """Ctrl-C at a terminal running `deepspeed ...`: SIGINT to the whole process group (the deepspeed command,
    DeepSpeed's per-node launcher, the workers), and the launcher's handler at once terminates its workers
    (SIGTERM). Each worker meets two signals milliseconds apart; they count as one request: the step in progress
    finishes and is saved, and each worker exits 75. (The old rule read the launcher's forward as "again: stop at
    once" and lost the step; the arrival order is raced here, the rule itself tested deterministically in
    test_stopping.py.)"""
    import psutil

    from ulysses_train.parallel.ports import free_port
    from ulysses_train.training import checkpoint

    out, log = str(tmp_path / "run"), tmp_path / "deepspeed.log"
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
           TRAIN, "--set", f"train.output_dir={out}", "--set", "train.steps=1000", *RUN_COMMON]
    with open(log, "w") as sink:
        runner = subprocess.Popen(cmd, env=env(), stdout=sink, stderr=sink,
                                  start_new_session=True)
        try:
            wait_for_steps(out, 2, runner)
            everything = [psutil.Process(runner.pid)] + psutil.Process(runner.pid).children(recursive=True)
            os.killpg(runner.pid, signal.SIGINT)  # the terminal's Ctrl-C
            gone, alive = psutil.wait_procs(everything, timeout=120)
            assert not alive, [p.cmdline() for p in alive]
        finally:
            kill_tree(runner.pid) if runner.poll() is None else None
    text = log.read_text()
    stopped_at = len(read_metrics(out))
    assert f"stopped after step {stopped_at} (received SIG" in text, text[-3000:]
    assert "again: stopped at once" not in text
    assert checkpoint.latest_good(out) == checkpoint.tag_for(stopped_at)


def test_resume_refuses_tampered_files_falls_back_past_damaged_ones(tmp_path, straight_losses):
    """One 2-step run saving every step, then: (1) a pickle payload in the newest checkpoint (manifest forged to
    match) is refused, naming the file, and nothing runs; (2) a truncated optimizer shard makes --resume fall
    back to the previous checkpoint, saying so, and the losses continue exactly; (3) --resume with another sp
    is refused before anything in the folder changes; (4) --resume of the finished run says so; (5) a universal
    folder planted beside the newest checkpoint (DeepSpeed's own conversion of it, one fp32.pt replaced by a payload)
    is replaced by a conversion anew when another layout resumes: nothing runs, the run goes on."""
    import shutil as _shutil

    from test_checkpoint import MARKER_NAME, forge_manifest, plant_payload

    out = str(tmp_path / "run")
    first = train_ranks(2, "--set", f"train.output_dir={out}", "--set", "train.steps=2", "--set", "train.save_every=1",
                        *RUN_COMMON)
    assert first.returncode == 0, first.stderr[-3000:]
    newest = os.path.join(out, "checkpoints", "step_00000002")
    model_states = os.path.join(newest, "zero_pp_rank_1_mp_rank_00_model_states.pt")
    _shutil.copy(model_states, tmp_path / "saved.pt")
    _shutil.copy(os.path.join(newest, "COMPLETE"), tmp_path / "saved_complete")
    marker = tmp_path / MARKER_NAME
    plant_payload(model_states, marker)
    forge_manifest(newest)
    tampered = train_ranks(2, "--set", f"train.output_dir={out}", "--set", "train.steps=3", "--resume", *RUN_COMMON)
    assert tampered.returncode != 0 and f"error: refused to read {model_states}" in tampered.stderr, tampered.stderr[-3000:]
    assert not marker.exists()

    _shutil.copy(tmp_path / "saved.pt", model_states)
    _shutil.copy(tmp_path / "saved_complete", os.path.join(newest, "COMPLETE"))
    shard = os.path.join(newest, "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    os.truncate(shard, os.path.getsize(shard) - 100)
    resumed = resume_and_compare(out, 1, straight_losses, extra=2)
    assert f"passed over damaged checkpoint step_00000002: {shard} has" in resumed.stdout
    assert os.path.isdir(os.path.join(out, "checkpoints", "damaged_step_00000002"))

    finished = train_ranks(2, "--set", f"train.output_dir={out}", "--set", "train.steps=3", "--resume", *RUN_COMMON)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "already finished (step 3 of train.steps=3); raise train.steps to train further" in finished.stdout
    assert len(read_metrics(out)) == 3

    from ulysses_train.training import checkpoint_read

    checkpoint_read.to_universal(out, "step_00000003", 0)
    planted = sorted(glob.glob(os.path.join(out, "checkpoints", "universal_step_00000003", "**", "fp32.pt"),
                               recursive=True))
    assert planted
    plant_payload(planted[0], marker)
    moved = train_ranks(2, "--set", f"train.output_dir={out}", "--set", "train.steps=4", "--resume",
                        "--set", "parallel.sequence_parallel_size=1", *RUN_COMMON)
    assert moved.returncode == 0, moved.stderr[-3000:]
    assert "resuming through DeepSpeed's universal checkpoint (converted anew from step_00000003" in moved.stdout
    assert not marker.exists() and len(read_metrics(out)) == 4


def test_kill_tree_passes_over_a_process_that_ended_before_its_kill(monkeypatch):
    """A real tree (a shell with two sleeping children) where the first kill finds its process gone (faked: a
    launcher's short-lived helper ending between the listing and the kill): every other process is still killed and
    nothing raises. Control: the bare kill raises there, as the loop without the check did."""
    import psutil

    tree = subprocess.Popen(["bash", "-c", "sleep 60 & sleep 60 & wait"], start_new_session=True)
    deadline = time.time() + 30
    while len(psutil.Process(tree.pid).children()) < 2 and time.time() < deadline:
        time.sleep(0.05)
    children = psutil.Process(tree.pid).children()
    real_kill, calls = psutil.Process.kill, []

    def gone(process):  # what the loop met: the process ended before its kill
        raise psutil.NoSuchProcess(process.pid)

    monkeypatch.setattr(psutil.Process, "kill", gone)
    with pytest.raises(psutil.NoSuchProcess):
        children[0].kill()  # the control: the bare kill raises there

    def ends_on_its_own_first(process):
        calls.append(process.pid)
        if len(calls) == 1:  # this one ends between the listing and its kill, which then finds nothing
            real_kill(process)
            raise psutil.NoSuchProcess(process.pid)
        return real_kill(process)

    monkeypatch.setattr(psutil.Process, "kill", ends_on_its_own_first)
    kill_tree(tree.pid)  # returns once every process has ended (helpers.wait_until_dead), the first one included
    assert len(calls) == 3  # the children, then the shell: none passed over after the first
    # the shell ended: killed, or (its children gone first) its `wait` returned and it exited before its own kill
    assert tree.wait(timeout=30) in (-signal.SIGKILL, 0)


LOCK_HOLDER = r"""
import sys, threading
import numpy as np
from ulysses_train.training.run_folder import lock_output_dir
lock_output_dir(sys.argv[1])
memory = np.ones(2**27)  # 1 GiB touched: the last thread to exit tears it down before it closes the files
def spin():
    while True:
        pass
for _ in range(3):
    threading.Thread(target=spin, daemon=True).start()
print("holding", flush=True)
threading.Event().wait()
"""


def test_a_killed_run_lock_is_free_once_kill_tree_returns(tmp_path):
    """What the resume after a kill relies on: once kill_tree returns, a killed process's run lock can be taken.
    A real multi-threaded process holding the lock (run_folder.lock_output_dir), killed five times: with the
    earlier check (a zombie main thread counted as ended) the lock was still held after 5 of 10 such kills on the
    2-core machine. Control, deterministic: a zombie main thread whose other thread is still
    exiting, as /proc shows it, has not ended; a zombie with one thread, or a process gone, has."""
    import fcntl

    import psutil
    from helpers import has_ended

    for attempt in range(5):
        folder = tmp_path / f"run{attempt}"
        folder.mkdir()
        holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(folder)], stdout=subprocess.PIPE,
                                  env=env(), start_new_session=True)
        assert holder.stdout.readline() == b"holding\n"
        kill_tree(holder.pid)
        with open(folder / ".run.lock", "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises BlockingIOError while any thread holds it
        holder.wait()

    class Seen:  # what psutil reads from /proc/<pid>/status
        def __init__(self, status, threads):
            self.pid, self._status, self._threads = 1, status, threads

        def status(self):
            if self._status is None:
                raise psutil.NoSuchProcess(self.pid)
            return self._status

        def num_threads(self):
            return self._threads

    assert not has_ended(Seen(psutil.STATUS_ZOMBIE, 2))  # the control: the old zombie-only check said ended
    assert not has_ended(Seen(psutil.STATUS_RUNNING, 1))
    assert has_ended(Seen(psutil.STATUS_ZOMBIE, 1)) and has_ended(Seen(None, 0))


def test_killed_run_resumes_with_identical_losses(tmp_path, straight_losses):
    """Kill a run (SIGKILL, whole process group) once its step-3 checkpoint is complete, resume it,
    and compare every step's loss with an uninterrupted run (the straight_losses fixture: the same demo, 2
    processes, log_every 1; saving checkpoints does not change a loss, as the stop and fallback tests show)."""
    killed = str(tmp_path / "killed")
    common = ["--set", "train.save_every=3", "--set", "train.export_hf=false", "--set", "train.log_every=1"]
    proc = subprocess.Popen(torchrun(2, "--set", f"train.output_dir={killed}", "--set", "train.steps=1000", *common),
                            env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    latest = os.path.join(killed, "checkpoints", "latest_good")
    deadline = time.time() + 300
    while not os.path.exists(latest) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    kill_tree(proc.pid)
    proc.wait()
    with open(latest) as fh:
        resumed_from = int(fh.read().strip().split("_")[1])
    steps = resumed_from + 3
    assert steps <= STRAIGHT_STEPS, resumed_from
    resumed = train_ranks(2, "--set", f"train.output_dir={killed}", "--set", f"train.steps={steps}", "--resume",
                          *common)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from step_{resumed_from:08d}" in resumed.stdout

    got = read_metrics(killed)
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    assert [r["loss"] for r in got] == [loss for loss, _ in straight_losses[:steps]]
    assert [r["grad_norm"] for r in got] == [grad_norm for _, grad_norm in straight_losses[:steps]]


def test_partial_save_never_replaces_the_previous_good_checkpoint(tmp_path):
    from ulysses_train.training import checkpoint

    root = tmp_path / "checkpoints"
    (root / "step_00000003").mkdir(parents=True)
    (root / "step_00000003" / "COMPLETE").write_text("3\n")
    (root / "latest_good").write_text("step_00000003")
    (root / "step_00000006").mkdir()          # a save that died half way: no COMPLETE, latest untouched
    assert checkpoint.latest_good(str(tmp_path)) == "step_00000003"
    checkpoint._prune(str(root), keep_last=1)
    assert (root / "step_00000003" / "COMPLETE").exists()
    (root / "latest_good").write_text("step_00000006")   # a pointer to an incomplete folder is not trusted:
    assert checkpoint.latest_good(str(tmp_path)) == "step_00000003"   # the newest complete one is


FULL_DISK = """
import errno, os
import torch
_save = torch.save
def save(obj, f, *args, **kwargs):  # this rank's disk is full from the second checkpoint on
    if "step_00000002" in str(f) and os.environ.get("RANK") == "0":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
    return _save(obj, f, *args, **kwargs)
torch.save = save
"""


def test_a_disk_full_during_a_save_on_one_rank_is_named_and_the_partial_folder_removed(tmp_path):
    """Issue 41: one rank's write failing inside DeepSpeed's save_checkpoint (a full disk: rank 0's model states of
    step 2, through a sitecustomize that makes torch.save raise ENOSPC there) used to leave that rank short of
    DeepSpeed's closing barrier: gloo aborted on a collective mismatch, no "no space left" line, step_2's partial
    folder stayed. Now every rank finishes the save's collectives, agrees it failed, and the README's promise holds:
    one line naming the problem and the folder, the partial folder removed, step 1 still what --resume picks."""
    from ulysses_train.training import checkpoint

    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(FULL_DISK)
    out = tmp_path / "run"
    proc = subprocess.run(torchrun(2, "--set", f"train.output_dir={out}", "--set", "train.steps=3", "--set",
                                   "train.save_every=1", "--set", "train.export_hf=false"),
                          env=dict(env(), PYTHONPATH=f"{inject}{os.pathsep}{REPO}"), capture_output=True, text=True,
                          timeout=300)
    output = proc.stdout + proc.stderr
    folder = out / "checkpoints" / "step_00000002"
    assert proc.returncode != 0 and "collective mismatch" not in output and "Connection reset" not in output, output
    assert (f"error: could not save checkpoint step_00000002: no space left on the device of {folder}" in output and
            f"the partial folder was removed and the last good checkpoint is {out / 'checkpoints' / 'step_00000001'}"
            in output), output[-3000:]
    assert not folder.exists() and checkpoint.latest_good(str(out)) == "step_00000001"
    assert (out / "checkpoints" / "step_00000001" / checkpoint.COMPLETE).exists()
