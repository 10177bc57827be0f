"""Stopping scripts/eval_context.py: SIGTERM ends the grid after the sequence being scored and writes what is
done; a second signal stops at once, writing the scores done. The stop is caught while the script is blocked
writing a progress line to a full pipe (the kernel's syscall entry read from /proc), so the test does not race
the script (test_retrieval_probes.py: the probes and their scores)."""
import json
import os
import time

from helpers import REPO

from ulysses_train.training import stopping


def fill_pipe(fd: int) -> None:
    """Write NUL bytes into a pipe until it is full: the process writing into it then blocks on its next line. `fd`
    must be a description of its own (stdout_pipe's filler): O_NONBLOCK on the child's would make its print fail
    with BlockingIOError instead of waiting."""
    for chunk in (4096, 1):
        try:
            while True:
                os.write(fd, b"\0" * chunk)
        except BlockingIOError:
            pass


def stdout_pipe():
    """(read end, the child's write end, a filler: the same pipe opened again, non-blocking, as a description of its
    own). The pipe holds 4,096 bytes: fewer than a long grid's progress lines, so the child blocks once it is full
    whatever the machine's speed."""
    import fcntl

    read_fd, write_fd = os.pipe()
    fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, 4096)
    filler = os.open(f"/proc/self/fd/{write_fd}", os.O_WRONLY | os.O_NONBLOCK)
    return read_fd, write_fd, filler


def read_until(fd: int, proc, marker: bytes, seen: bytearray) -> None:
    import select

    while marker not in seen:
        assert proc.poll() is None, f"the script ended (rc={proc.returncode}) before printing {marker!r}"
        if select.select([fd], [], [], 1.0)[0]:
            seen += os.read(fd, 65536)


def wait_for_text(path, text: str, proc) -> None:
    """Until the child has written `text` into `path` (its stderr): a wait on the child's own marker."""
    import time

    while text not in path.read_text():
        assert proc.poll() is None, path.read_text()
        time.sleep(0.05)


def wait_until_blocked_in_a_write(proc) -> None:
    """Until the child's main thread sleeps in a pipe write (the kernel's wait channel, /proc/PID/wchan: pipe_write
    or anon_pipe_write): the state the child itself enters once the pipe is full, not a guess of how long it takes."""
    import time

    while "pipe_write" not in open(f"/proc/{proc.pid}/wchan").read():
        assert proc.poll() is None, f"the script ended (rc={proc.returncode})"
        time.sleep(0.05)


WRITE_SYSCALL = {"x86_64": "1", "aarch64": "64"}
"""write(2)'s number, as /proc/PID/syscall names the call a thread sleeps in."""
PROGRESS_LINE = b"per dp group done"


def blocked_write(pid: int):
    """The bytes the process's main thread sleeps writing into a full pipe (its wait channel, then its syscall's
    buffer and count from /proc/PID/syscall, read from /proc/PID/mem); None while it is not in such a write."""
    import platform

    if "pipe_write" not in open(f"/proc/{pid}/wchan").read():
        return None
    fields = open(f"/proc/{pid}/syscall").read().split()
    if fields[0] != WRITE_SYSCALL.get(platform.machine(), "1"):
        return None  # it moved on between the two reads
    buffer, count = int(fields[2], 16), int(fields[3], 16)
    with open(f"/proc/{pid}/mem", "rb") as memory:
        memory.seek(buffer)
        return memory.read(count)


def wait_until_blocked_on_a_progress_line(proc, read_fd: int, filler: int, seen: bytearray) -> None:
    """Until the child's main thread sleeps writing a probe sequence's progress line into the full pipe: that
    sequence's scores are done, the next not begun. When it sleeps on anything else (a library's log line on
    stdout), one pipe's worth is read into `seen` and the pipe filled again (`filler`), and its writes go on until
    one sleeps again. Lines it completes meanwhile may land after the last NUL byte: count every progress line read
    (drained's count and its text after the last NUL)."""
    import select
    import time

    while True:
        assert proc.poll() is None, f"the script ended (rc={proc.returncode})"
        pending = blocked_write(proc.pid)
        if pending is not None and PROGRESS_LINE in pending:
            return
        if pending:  # one read: the child can then write one pipe's worth at most before sleeping again
            if select.select([read_fd], [], [], 0)[0]:
                seen += os.read(read_fd, 65536)
            fill_pipe(filler)
        time.sleep(0.05)


def test_the_wait_lets_a_stray_line_through_and_stops_on_a_progress_line():
    """A child that writes a log line into its full stdout pipe, then progress lines: the wait drains and refills
    the pipe and returns while the child sleeps on a progress line. Control: first the child slept on the log line,
    which the bare wait (the wait channel alone) took for a progress line."""
    import subprocess
    import sys

    read_fd, write_fd, filler = stdout_pipe()
    child = ("import sys; sys.stdout.write('[deepspeed] a log line\\n'); sys.stdout.flush(); "
             "[print(f'  probes: sequence {i}/999 per dp group done', flush=True) for i in range(1, 1000)]")
    fill_pipe(filler)
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=write_fd)
    os.close(write_fd)
    seen = bytearray()
    try:
        wait_until_blocked_in_a_write(proc)
        assert blocked_write(proc.pid) == b"[deepspeed] a log line\n"  # the control
        wait_until_blocked_on_a_progress_line(proc, read_fd, filler, seen)
        assert PROGRESS_LINE in blocked_write(proc.pid)
    finally:
        os.close(filler)
        proc.kill()
        proc.wait()
        os.close(read_fd)


GRID = ["--lengths", "1001,1500", "--depths", "0,1,...,100", "--tasks", "passkey"]
GRID_SEQUENCES = 202
"""202 probe sequences: their progress lines (~45 bytes each) are over twice the pipe, so the grid cannot end before
the test has filled it, however slow the test process is."""


def blocked_probe_run(probe_model_dir, out, errors):
    """eval_context.py over GRID with its stdout a 4,096-byte pipe that is full (stdout_pipe, fill_pipe) once it has
    said how many sequences it probes: rank 0 then waits inside a write, on the line of the next sequence it
    finishes. (process, read end, filler, bytes read so far); every progress line before the last NUL byte was
    printed before the pipe was full. The caller closes the filler (until then the read end never sees its end)."""
    import subprocess
    import sys

    read_fd, write_fd, filler = stdout_pipe()
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=REPO, TOKENIZERS_PARALLELISM="false")
    with open(errors, "w") as err:
        proc = subprocess.Popen([sys.executable, os.path.join(REPO, "scripts", "eval_context.py"), "--model", probe_model_dir,
                                 "--set", "model.dtype=float32", "--set", "model.attn_implementation=sdpa", *GRID,
                                 "--out", str(out)], stdout=write_fd, stderr=err, env=env)
    os.close(write_fd)
    seen = bytearray()
    read_until(read_fd, proc, f"{GRID_SEQUENCES} sequences on 1 process(es)".encode(), seen)
    fill_pipe(filler)
    return proc, read_fd, filler, seen


def drained(read_fd, proc, seen: bytearray) -> tuple[int, str]:
    """(progress lines printed before the pipe was full, the text after its last NUL byte) once the child ended."""
    try:
        seen += b"".join(iter(lambda: os.read(read_fd, 65536), b""))
    finally:
        proc.kill() if proc.poll() is None else None
        os.close(read_fd)
    before, _, after = bytes(seen).rpartition(b"\0")
    return before.decode(errors="replace").count("per dp group done"), after.decode()


def test_sigterm_ends_the_grid_after_the_sequence_being_scored_and_writes_what_is_done(probe_model_dir, tmp_path):
    """Issue 41: SIGTERM during eval_context.py used to leave the ranks scoring the whole grid. Now every rank agrees
    after each probe sequence whether one was asked to stop, and the scores done so far are written (exit 75). No
    timing (issue 51: an earlier form counted the lines it had read before filling the pipe, and raced with lines
    the child wrote meanwhile): rank 0 blocks in the write of the line of the next sequence it finishes; SIGTERM is
    sent and its request acknowledged while it waits there, then the pipe is drained: the grid ends right after that
    sequence, and retrieval.json holds exactly the probes scored."""
    import signal

    out, errors = tmp_path / "out", tmp_path / "stderr.txt"
    proc, read_fd, filler, seen = blocked_probe_run(probe_model_dir, out, errors)
    os.close(filler)
    proc.send_signal(signal.SIGTERM)
    wait_for_text(errors, "finishing this probe sequence", proc)
    printed, after = drained(read_fd, proc, seen)
    assert proc.wait(timeout=120) == 75, errors.read_text()
    assert printed + 1 < GRID_SEQUENCES, "nothing was left to stop"
    record = json.loads((out / "retrieval.json").read_text())
    assert record["complete"] is False and record["scored_sequences"] == printed + 1
    assert sorted({p["sequence"] for p in record["probes"]}) == list(range(printed + 1))
    assert after.count("per dp group done") == 1 and "retrieval accuracy: " in after
    assert f"stopped after {printed + 1} of {GRID_SEQUENCES} probe sequences (received SIGTERM)" in errors.read_text()


def test_a_second_signal_stops_at_once_writing_the_scores_done(probe_model_dir, tmp_path):
    """Issue 51: a second SIGTERM and a Ctrl-C were held back while a sequence was scored (12 minutes at 1M tokens).
    Here rank 0's main thread is stuck inside a write (the full pipe) after a first SIGTERM, as it would be inside a
    long forward; a Ctrl-C then ends the process at once (exit 130) with the sequences scored so far written. The
    negative control is the first test: there the process waits for the drained pipe and ends with 75."""
    import signal

    out, errors = tmp_path / "out", tmp_path / "stderr.txt"
    proc, read_fd, filler, seen = blocked_probe_run(probe_model_dir, out, errors)
    try:
        wait_until_blocked_on_a_progress_line(proc, read_fd, filler, seen)
    finally:
        os.close(filler)  # the read end sees its end once the child has ended
    proc.send_signal(signal.SIGTERM)
    wait_for_text(errors, "finishing this probe sequence", proc)
    time.sleep(stopping.FORWARDED_WITHIN + 0.2)  # a second request, not a launcher's forward of the first
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130, errors.read_text()  # the pipe is still full: the main thread never left
    printed, after = drained(read_fd, proc, seen)
    completed = printed + after.count(PROGRESS_LINE.decode())  # the blocked line's write never completed
    record = json.loads((out / "retrieval.json").read_text())
    assert record["complete"] is False and record["interrupted"] is True
    assert record["scored_sequences"] == completed + 1
    line = (f"received SIGINT again: stopped at once; the {completed + 1} probe sequence(s) scored on rank 0 are "
            f"written to {out / 'retrieval.json'}; exiting with code 130.")
    assert line in errors.read_text().splitlines()
