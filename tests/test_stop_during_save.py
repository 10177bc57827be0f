"""A second signal during a checkpoint save (training/stopping.py): scripts/train.py stops at once and the save cut
short is never the resume point. No timing: the checkpoint's largest file is a FIFO whose 4,096-byte pipe this test
reads once, so the save blocks in its write (the kernel's wait channel says so) until the process ends."""
import os
import signal
import stat
import subprocess
import sys
import time

from helpers import REPO
from test_probe_stops import wait_for_text, wait_until_blocked_in_a_write

from ulysses_train.training import checkpoint, stopping

TRAIN = os.path.join(REPO, "scripts", "train.py")


def env():
    return dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=REPO, TOKENIZERS_PARALLELISM="false")


def train(out, steps, *extra, **popen):
    argv = [sys.executable, TRAIN, "--set", f"train.output_dir={out}", "--set", f"train.steps={steps}", "--set",
            "train.save_every=1", "--set", "train.export_hf=false", *extra]
    return subprocess.Popen(argv, env=env(), **popen)


def fifo_in_the_next_save(out) -> tuple[str, int]:
    """(path, reader fd): step 2's largest file, as step 1 wrote it, made a FIFO with a 4,096-byte pipe, opened for
    reading (non-blocking, so the writer's open does not wait for a reader)."""
    import fcntl

    root = checkpoint.checkpoint_root(str(out))
    first = os.path.join(root, checkpoint.tag_for(1))
    largest = max(os.listdir(first), key=lambda name: os.path.getsize(os.path.join(first, name)))
    assert os.path.getsize(os.path.join(first, largest)) > 8192  # more than the pipe: its write must block
    os.makedirs(os.path.join(root, checkpoint.tag_for(2)))
    path = os.path.join(root, checkpoint.tag_for(2), largest)
    os.mkfifo(path)
    reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    fcntl.fcntl(reader, fcntl.F_SETPIPE_SZ, 4096)
    return path, reader


def test_a_second_signal_during_a_save_stops_at_once_and_resumes_from_the_last_complete(tmp_path):
    out, errors = tmp_path / "run", tmp_path / "stderr.txt"
    first = train(out, 1, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert first.wait(timeout=600) == 0, first.stderr.read()[-3000:]
    path, reader = fifo_in_the_next_save(out)
    try:
        with open(errors, "w") as err, open(tmp_path / "stdout.txt", "w") as log:
            proc = train(out, 3, "--resume", stdout=log, stderr=err)
        wait_until_blocked_in_a_write(proc)  # step 2's save, in the FIFO's write
        proc.send_signal(signal.SIGTERM)
        wait_for_text(errors, "received SIGTERM: finishing this step", proc)
        assert proc.poll() is None  # the negative control: a first signal only asks, the save still waits
        time.sleep(stopping.FORWARDED_WITHIN + 0.2)  # a second request, not a launcher's forward of the first
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 130, errors.read_text()[-3000:]
    finally:
        os.close(reader)
    kept = os.path.join(checkpoint.checkpoint_root(str(out)), checkpoint.tag_for(1))
    assert (f"received SIGTERM again: stopped at once; the step this run was on is not saved; the last complete "
            f"checkpoint, {kept}, is the resume point (--resume); exiting with code 130.") in errors.read_text()
    assert checkpoint.latest_good(str(out)) == checkpoint.tag_for(1)
    assert not os.path.exists(os.path.join(os.path.dirname(path), checkpoint.COMPLETE))
    assert stat.S_ISFIFO(os.stat(path).st_mode)
    os.remove(path)
    with open(path, "wb") as fh:  # what a write cut short leaves: part of the file
        fh.write(b"\0" * 4096)
    resumed = train(out, 2, "--resume", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, stderr[-3000:]
    assert "resumed from step_00000001 (step 1)" in stdout
    assert checkpoint.latest_good(str(out)) == checkpoint.tag_for(2)
