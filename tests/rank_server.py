"""The process groups of the suite's distributed checks, forked from ONE process that imported everything once.

Each check launches 2 or 4 ranks; a fresh Python pays ~5 s of imports before its rank does anything (torch,
transformers and its model modules, DeepSpeed and the modules it imports lazily while building an engine), and the
suite launches ~100 such groups on a 2-core machine. This server imports them once; for each request it forks the
ranks, each becoming `python <script> <argv>` with the environment torchrun --standalone gives a rank (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) through script_cases._run_in_child, so every
rank is a fresh process as far as the check can tell: its own globals, process group, monkeypatches, outputs and
exit code. The first rank to fail stops the others (ranks blocked in a collective would wait for the dead one).
A control test (test_rank_server.py) checks a group from here against the same group launched by torchrun.

    python tests/rank_server.py      # reads request paths on stdin, answers each with one line on stdout
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

from script_cases import _run_in_child, preload

POLL_S = 0.02


def rank_env(env: dict, rank: int, nproc: int, port: int) -> dict:
    """What torchrun --standalone sets for one rank of one node."""
    return dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def run_group(request: dict, prefix: str) -> dict:
    """Fork the request's ranks, wait for all (killing the rest at the first failure or the deadline); the return
    code (the first failure's, else 0) and every rank's stdout and stderr, rank by rank."""
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for rank in range(request["nproc"]):
        spec = {"script": request["script"], "argv": request["argv"], "cwd": request["cwd"],
                "env": rank_env(request["env"], rank, request["nproc"], request["port"])}
        pid = os.fork()
        if pid == 0:
            _run_in_child(spec, f"{prefix}.{rank}")
        pids.append(pid)
    codes, deadline = {}, time.monotonic() + request["timeout"]
    while len(codes) < len(pids):
        for pid in pids:
            if pid not in codes:
                done, raw = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(raw)
        failed = any(codes.values()) or time.monotonic() > deadline
        if failed:
            for pid in pids:
                if pid not in codes:
                    _kill_group(pid)
        time.sleep(POLL_S)
    first = next((code for code in codes.values() if code), 0)  # dicts keep the order the ranks ended in
    return {"returncode": first, **{kind: "".join(_read(f"{prefix}.{rank}.{kind}") for rank in range(len(pids)))
                                    for kind in ("stdout", "stderr")}}


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass  # already gone


def _read(path: str) -> str:
    with open(path, errors="replace") as fh:
        return fh.read()


def main() -> None:
    preload()
    print("ready", flush=True)
    for line in sys.stdin:
        path = line.strip()
        if not path:
            continue
        with open(path) as fh:
            request = json.load(fh)
        result = run_group(request, path)
        with open(path + ".result", "w") as fh:
            json.dump(result, fh)
        print(f"done {path}", flush=True)


if __name__ == "__main__":
    main()
