"""Stopping on request without losing a step: SIGTERM, SIGINT and the death of the launcher.

SLURM sends SIGTERM before a preemption or the time limit (earlier with `--signal=TERM@SECONDS`), a user
presses Ctrl-C or kills the launcher. Each becomes a request: the current step finishes, every rank agrees
(one tiny all-reduce per step, so a signal that reached only some ranks still stops all of them at the same
step), a checkpoint is written, and the process exits with `EXIT_STOPPED` so a batch script can tell "stopped
cleanly, resume me" from a failure.

A second signal (SIGTERM or Ctrl-C, once a first one asked, and more than FORWARDED_WITHIN seconds after it) stops
at once: a user or a scheduler that asks twice
will not wait for a step, a checkpoint save or a probe sequence that can take many minutes. It is acted on by the
watcher thread (below), not by the main thread, which may be inside one long C call (a forward over 1M tokens)
where no Python handler runs until it returns. What is done is kept: the script's `at_once` writes it (the probes
scored so far), and a checkpoint cut short is never the resume point (checkpoint.py marks a save COMPLETE and points
`latest_good` at it only after every file is written). The process then exits with EXIT_INTERRUPTED.
One Ctrl-C at a bare `deepspeed` command reaches each worker twice: from the terminal's process group (SIGINT) and
from DeepSpeed's per-node launcher, whose handler terminates its children (SIGTERM, launch.py's
`sigkill_handler`) within milliseconds. A signal that close to the first is that forward, so it counts once.

The launcher: `deepspeed` starts one per-node launcher (`deepspeed.launcher.launch`), which starts the
workers. Killing the `deepspeed` command leaves that per-node launcher and the workers running, and nothing
passes the signal on. So every worker watches its parent and, when the parent is DeepSpeed's per-node
launcher, that launcher's parent too; when a watched process is gone the worker stops as on SIGTERM.

Before the first step there is nothing new to save, so a stop request ends the process at once with
`EXIT_STOPPED` (a requeued job then resumes from its last checkpoint, or starts again). That must work while the
main thread is blocked inside a C call (a rendezvous waiting for a rank that already failed, a weight load), where
no Python signal handler runs: the signal's number is written to a socket (`signal.set_wakeup_fd`, done by
CPython's C-level handler at once) that a watcher thread reads.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time

import torch

from ulysses_train.device import collective_device
from ulysses_train.training import checkpoint

logger = logging.getLogger(__name__)

EXIT_STOPPED = 75  # sysexits.h EX_TEMPFAIL: "temporary failure, the user is invited to retry"
EXIT_INTERRUPTED = 130  # the shell's code for a process ended by Ctrl-C: stopped at once, the current work dropped
WATCH_SECONDS = 1.0
FORWARDED_WITHIN = 2.0  # seconds: a second signal this soon after the first is the launcher passing it on


class TrainingStopped(Exception):
    """Raised by the loop after the stop checkpoint is written; the command line turns it into EXIT_STOPPED."""

    def __init__(self, step: int, tag: str, reason: str):
        super().__init__(f"stopped after step {step} ({reason}); checkpoint {tag} is saved: rerun the same command "
                         f"with --resume to continue (exit code {EXIT_STOPPED}).")
        self.step, self.tag, self.reason = step, tag, reason


class StopRequest:
    """A flag that signals and the launcher watchdog set, and that all ranks agree on once per step.
    A bare `StopRequest()` is never set (library use, tests); `install()` arms it (the command line) and
    `begin_steps()` says the first step is about to run (before it a request exits at once, see above)."""

    def __init__(self, after: str = "this step", keeping: str = "saving a checkpoint", at_once=None):
        self.after, self.keeping = after, keeping  # what a request finishes, and what it keeps (the messages)
        self.at_once = at_once  # a second signal: called (from the watcher thread) to keep what is done, returns words
        self.reason: str | None = None
        self.stepping = False
        self._first_signal_at: float | None = None
        self._stop_watching = threading.Event()
        self._previous_handlers: dict = {}
        self._previous_wakeup_fd: int | None = None
        self._sockets: tuple | None = None

    def request(self, reason: str) -> None:
        if not self.stepping:
            _exit_before_training(reason)
        if self.reason is None:
            self.reason = reason
            say_once(f"{reason}: finishing {self.after}, then {self.keeping} and exiting with code "
                     f"{EXIT_STOPPED} (a second SIGTERM or Ctrl-C stops at once).")

    def begin_steps(self) -> None:
        """From now on a request finishes the current step and saves; before, it exits at once."""
        self.stepping = True

    def install(self) -> "StopRequest":
        """Arm the signal handlers, their watcher thread and the launcher watchdog until `close()`."""
        read, write = socket.socketpair()
        write.setblocking(False)
        self._sockets = (read, write)
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous_handlers[signum] = signal.signal(signum, self._on_signal)
        self._previous_wakeup_fd = signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._watch_signals, args=(read,), name="stop-signals", daemon=True).start()
        launchers = watched_launchers()
        if launchers:
            threading.Thread(target=self._watch, args=(launchers,), name="launcher-watchdog", daemon=True).start()
        return self

    def _on_signal(self, signum, frame) -> None:
        """The main thread's handler does nothing: it only replaces Python's default (a KeyboardInterrupt, or death
        by SIGTERM) so that the watcher thread, which reads every signal, alone decides (see above)."""

    def _watch_signals(self, read: socket.socket) -> None:
        while not self._stop_watching.is_set():
            try:
                data = read.recv(16)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in (signal.SIGTERM, signal.SIGINT):
                    self.on_stop_signal(signal.Signals(signum).name, time.monotonic())

    def on_stop_signal(self, name: str, now: float) -> None:
        """The first signal asks for a stop; one within FORWARDED_WITHIN seconds of it is the launcher's forward
        of the same request (see above); a later one stops at once."""
        if self._first_signal_at is None:
            self._first_signal_at = now
        elif now - self._first_signal_at < FORWARDED_WITHIN:
            return
        elif self.stepping:
            self.stop_at_once(f"received {name} again")
        self.request(f"received {name}")

    def stop_at_once(self, reason: str) -> None:
        """Keep what is done (`at_once`) and leave now with EXIT_INTERRUPTED, from any thread."""
        kept = "the current work is dropped"
        try:
            kept = self.at_once() if self.at_once is not None else kept
        except Exception as err:  # a failed write must not keep a process that was told twice to stop
            kept = f"keeping what was done failed ({type(err).__name__}: {err})"
        say_once(f"{reason}: stopped at once; {kept}; exiting with code {EXIT_INTERRUPTED}.")
        sys.stdout.flush()
        os._exit(EXIT_INTERRUPTED)

    def _watch(self, launchers: list) -> None:
        while not self._stop_watching.wait(WATCH_SECONDS):
            for proc in launchers:
                if not _alive(proc):
                    self.request(f"the launcher (pid {proc.pid}) is gone")
                    return

    def agreed(self) -> bool:
        """True on every rank when any rank was asked to stop. A collective: every rank calls it every step."""
        if not torch.distributed.is_initialized():
            return self.reason is not None
        flag = torch.tensor([1 if self.reason else 0], dtype=torch.int32, device=collective_device())
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        if flag.item() and self.reason is None:
            self.reason = "another rank was asked to stop"
            if torch.distributed.get_rank() == 0:
                print(f"{self.reason}: {self.keeping} after {self.after} and exiting with code {EXIT_STOPPED}.",
                      file=sys.stderr, flush=True)
        return bool(flag.item())

    def close(self) -> None:
        """Stop watching and give the signals back to the handlers they had before `install()`."""
        self._stop_watching.set()
        if self._sockets is not None:
            signal.set_wakeup_fd(self._previous_wakeup_fd if self._previous_wakeup_fd is not None else -1)
            for sock in self._sockets:
                sock.close()
            self._sockets = None
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers = {}


def resume_point(output_dir: str) -> str:
    """What a training run stopped at once keeps, in words: its last COMPLETE checkpoint, the resume point (a save
    cut short has no COMPLETE marker and is never chosen)."""
    tag = checkpoint.latest_good(output_dir)
    if tag is None:
        return "no checkpoint was complete yet: a rerun starts from the beginning"
    return (f"the step this run was on is not saved; the last complete checkpoint, "
            f"{os.path.join(checkpoint.checkpoint_root(output_dir), tag)}, is the resume point (--resume)")


def say_once(message: str) -> None:
    """Print on the first rank of the node only (every rank gets the signal when a launcher passes it on): one
    line, not one per process."""
    if os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")) == "0":
        print(message, file=sys.stderr, flush=True)


def _exit_before_training(reason: str) -> None:
    """A stop before the first step: nothing new to save, so leave now (from any thread) with EXIT_STOPPED."""
    say_once(f"{reason} before the first step: nothing new to save; exiting with code {EXIT_STOPPED} "
             f"(--resume continues from the last checkpoint, if there is one).")
    sys.stdout.flush()
    os._exit(EXIT_STOPPED)


def watched_launchers() -> list:
    """The parent process, and its parent too when the parent is DeepSpeed's per-node launcher (see above)."""
    import psutil

    try:
        parent = psutil.Process().parent()
        if parent is None or parent.pid <= 1:
            return []
        watched = [parent]
        if "deepspeed.launcher.launch" in " ".join(parent.cmdline()):
            grandparent = parent.parent()
            if grandparent is not None and grandparent.pid > 1:
                watched.append(grandparent)
        return watched
    except psutil.Error:
        return []


def _alive(proc) -> bool:
    """Running and not a zombie (psutil.Process.is_running also guards against a reused pid)."""
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
