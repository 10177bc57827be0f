"""Stop requests in one process: signals set the flag, a second signal stops at once, the launcher watchdog
notices a parent that is gone. (The whole path through real launchers is in test_train_stops.py.)"""
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from ulysses_train.training import stopping


@pytest.fixture
def restore_signals():
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def test_a_bare_request_is_never_set():
    assert stopping.StopRequest().agreed() is False


def test_sigterm_sets_the_request(restore_signals, capsys):
    stop = stopping.StopRequest().install()
    stop.begin_steps()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        while stop.reason is None:  # the watcher thread's request; nothing else can end this wait
            time.sleep(0.01)
        assert stop.reason == "received SIGTERM" and stop.agreed()
        assert f"exiting with code {stopping.EXIT_STOPPED}" in capsys.readouterr().err
    finally:
        stop.close()


BLOCKED_WHILE_STEPPING = """
import sys, threading
from ulysses_train.training.stopping import StopRequest
def keep():
    open(sys.argv[1], "w").write("kept")
    return "what was done is in " + sys.argv[1]
stop = StopRequest(at_once=keep).install()
stop.begin_steps()
print("ready", flush=True)
threading.Event().wait(600)   # a long forward, a checkpoint write: the main thread waits inside a C call
print("still here", flush=True)
"""


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_stops_at_once_keeping_what_is_done(tmp_path, second):
    """Issue 51: a second SIGTERM (or a Ctrl-C) after a first stop request ends the process at once, even while
    its main thread is inside a C call where no Python handler runs, after `at_once` kept what was done (exit 130).
    Synchronised on the child's own lines only; the negative control is the first signal alone, which only asks
    (the child is still waiting when the second is sent: it has not printed "still here")."""
    kept = tmp_path / "kept.txt"
    proc = subprocess.Popen([sys.executable, "-c", BLOCKED_WHILE_STEPPING, str(kept)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, LOCAL_RANK="0"))
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    first = proc.stderr.readline()
    assert "received SIGTERM: finishing this step" in first and proc.poll() is None and not kept.exists()
    time.sleep(stopping.FORWARDED_WITHIN + 0.2)  # a second request, not a launcher's forward of the first
    proc.send_signal(second)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == stopping.EXIT_INTERRUPTED and "still here" not in out, (out, err)
    assert err.strip() == (f"received {signal.Signals(second).name} again: stopped at once; what was done is in "
                           f"{kept}; exiting with code 130.")
    assert kept.read_text() == "kept"


def test_a_signal_forwarded_right_after_the_first_counts_once(monkeypatch, capsys):
    """One Ctrl-C at a bare `deepspeed` run: SIGINT from the terminal's group and SIGTERM from DeepSpeed's launcher
    reach the worker milliseconds apart, in either order. Deterministic: the arrival times are given, not raced.
    That pair only asks; a signal after the window stops at once. Control: with no window (the old rule) the
    launcher's forward stopped at once, and the step in progress was lost."""
    for window, forward_stops in ((stopping.FORWARDED_WITHIN, False), (0.0, True)):
        monkeypatch.setattr(stopping, "FORWARDED_WITHIN", window)
        stop, stopped_at_once = stopping.StopRequest(), []
        stop.stop_at_once = stopped_at_once.append
        stop.begin_steps()
        stop.on_stop_signal("SIGINT", now=100.0)
        stop.on_stop_signal("SIGTERM", now=100.004)
        assert stop.reason == "received SIGINT" and bool(stopped_at_once) is forward_stops
        stop.on_stop_signal("SIGINT", now=100.0 + 2.5)
        assert stopped_at_once[-1] == "received SIGINT again"
    assert capsys.readouterr().err.count("finishing this step") == 2


BLOCKED_BEFORE_THE_FIRST_STEP = """
import sys, threading
from ulysses_train.training.stopping import StopRequest
stop = StopRequest().install()
print("ready", flush=True)
threading.Event().wait(60)   # a rendezvous, a weight load: the main thread waits inside a C call
print("still here", flush=True)
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_before_the_first_step_exits_75_at_once(signum):
    """Before the first step there is nothing to save: leave at once (exit 75, one accurate line), even while the
    main thread waits in a C call; not 'finishing this step' and a minute of waiting."""
    proc = subprocess.Popen([sys.executable, "-c", BLOCKED_BEFORE_THE_FIRST_STEP], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, LOCAL_RANK="0"))
    assert proc.stdout.readline().strip() == "ready"
    started = time.time()
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == stopping.EXIT_STOPPED, (out, err)
    assert time.time() - started < 20 and "still here" not in out
    assert f"received {signal.Signals(signum).name} before the first step: nothing new to save" in err
    assert "finishing this step" not in err


def test_close_gives_the_signals_back(restore_signals):
    before = signal.getsignal(signal.SIGTERM)
    stop = stopping.StopRequest().install()
    assert signal.getsignal(signal.SIGTERM) == stop._on_signal
    stop.close()
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_first_ctrl_c_only_asks(restore_signals):
    stop = stopping.StopRequest().install()
    stop.begin_steps()
    try:
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt: the handler only replaces Python's default
        while stop.reason is None:
            time.sleep(0.01)
        assert stop.reason == "received SIGINT"
    finally:
        stop.close()


def test_the_watchdog_notices_a_launcher_that_is_gone(monkeypatch):
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    monkeypatch.setattr(stopping, "WATCH_SECONDS", 0.05)
    stop = stopping.StopRequest()
    stop.begin_steps()
    import threading

    threading.Thread(target=stop._watch, args=([psutil.Process(launcher.pid)],), daemon=True).start()
    time.sleep(0.3)
    assert stop.reason is None  # negative control: alive means no request
    launcher.kill()  # stays a zombie until waited for: the watchdog must count that as gone
    deadline = time.time() + 10
    while stop.reason is None and time.time() < deadline:
        time.sleep(0.05)
    launcher.wait()
    stop.close()
    assert stop.reason == f"the launcher (pid {launcher.pid}) is gone"


def test_under_deepspeeds_node_launcher_its_parent_is_watched_too(tmp_path):
    """A child of a process whose command line names deepspeed.launcher.launch watches both."""
    script = tmp_path / "child.py"
    script.write_text("from ulysses_train.training.stopping import watched_launchers\n"
                      "print(sorted(p.pid for p in watched_launchers()))\n")
    fake = tmp_path / "deepspeed" / "launcher"
    fake.mkdir(parents=True)
    (tmp_path / "deepspeed" / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "launch.py").write_text("import subprocess, sys\n"
                                    "out = subprocess.run([sys.executable, sys.argv[1]], capture_output=True, text=True)\n"
                                    "print(out.stdout.strip(), __import__('os').getpid(), __import__('os').getppid())\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    from helpers import REPO

    env["PYTHONPATH"] += os.pathsep + REPO
    out = subprocess.run([sys.executable, "-m", "deepspeed.launcher.launch", str(script)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)
    watched, launcher_pid, its_parent = out.stdout.rsplit(" ", 2)
    assert watched.strip() == str(sorted([int(launcher_pid), int(its_parent)])), out.stdout + out.stderr
