"""Several commands of one script from ONE launched process: the imports every command pays (torch, transformers,
DeepSpeed, the trainer: several seconds a process on the 2-core CI machine) are paid once, then each case runs in its
own forked child, one after the other, through the script's own `__main__` with its own argv, environment, working
folder, stdout, stderr and exit code, as `python scripts/train.py ...` would. A case that never ends (a refusal that
failed to come before a process group) is killed at its deadline, with its whole process group.

Tests call `run_cases`; the launched process is this file:
    python tests/script_cases.py CASES.json      # writes CASES.json.results
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback

from helpers import REPO

TRAIN = os.path.join(REPO, "scripts", "train.py")
CASE_TIMEOUT_S = 300


def case(name: str, argv: list[str], env: dict, cwd: str = REPO, script: str = TRAIN) -> dict:
    """One command: `python <script> <argv>` in `cwd` with exactly the environment `env`."""
    return {"name": name, "script": script, "argv": [str(a) for a in argv], "env": dict(env), "cwd": str(cwd)}


def run_cases(cases: list[dict], folder, env: dict, timeout: int = 900,
              at_once: int = 1) -> dict[str, subprocess.CompletedProcess]:
    """Run `cases` in one launched process (started with `env`), `at_once` of them side by side (independent cases
    only: each its own output folders); {name: its CompletedProcess}. Names must be unique; the cases' outputs are
    kept under `folder`."""
    names = [c["name"] for c in cases]
    assert len(set(names)) == len(names), names
    path = os.path.join(str(folder), "cases.json")
    with open(path, "w") as fh:
        json.dump(cases, fh)
    launched = subprocess.run([sys.executable, os.path.abspath(__file__), path, str(at_once)], env=env,
                              capture_output=True, text=True, timeout=timeout)
    assert launched.returncode == 0, f"the case runner failed:\n{launched.stdout[-3000:]}\n{launched.stderr[-5000:]}"
    with open(path + ".results") as fh:
        results = json.load(fh)
    return {r["name"]: subprocess.CompletedProcess([r["script"], *r["argv"]], r["returncode"], r["stdout"],
                                                   r["stderr"]) for r in results}


def _run_in_child(spec: dict, prefix: str) -> None:
    """The forked child: become `python <script> <argv>` and never return."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own process group, so a deadline kills whatever it started too
        for fd, suffix in ((1, ".stdout"), (2, ".stderr")):
            handle = os.open(prefix + suffix, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(handle, fd)
            os.close(handle)
        os.environ.clear()
        os.environ.update(spec["env"])
        os.chdir(spec["cwd"])
        sys.argv = [spec["script"], *spec["argv"]]
        sys.path[0] = os.path.dirname(spec["script"])  # what `python <script>` puts first
        import runpy

        runpy.run_path(spec["script"], run_name="__main__")
        code = 0
    except SystemExit as stop:  # what the interpreter would make of it
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except BaseException:  # an uncaught exception: the traceback and exit 1, as the interpreter does
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _start(spec: dict, prefix: str) -> int:
    """Fork the case's process (its own process group); its pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _run_in_child(spec, prefix)
    try:
        os.setpgid(pid, pid)  # also here: the deadline may come before the child's own call
    except OSError:
        pass  # the child got there first
    return pid


def _run_all(cases: list[dict], path: str, at_once: int) -> list[dict]:
    """Every case, at most `at_once` running, each killed at its CASE_TIMEOUT_S; results in the cases' order."""
    waiting, running, results = list(enumerate(cases)), {}, {}
    while waiting or running:
        while waiting and len(running) < at_once:
            index, spec = waiting.pop(0)
            running[_start(spec, f"{path}.{index}")] = (index, time.monotonic() + CASE_TIMEOUT_S, False)
        for pid, (index, deadline, killed) in list(running.items()):
            done, raw = os.waitpid(pid, os.WNOHANG)
            if done:
                del running[pid]
                results[index] = _finished(cases[index], f"{path}.{index}", raw)
            elif not killed and time.monotonic() > deadline:
                os.killpg(pid, signal.SIGKILL)
                running[pid] = (index, deadline, True)
        time.sleep(0.05)
    return [results[index] for index in range(len(cases))]


def _finished(spec: dict, prefix: str, raw: int) -> dict:
    status = os.waitstatus_to_exitcode(raw)
    outputs = {}
    for suffix in ("stdout", "stderr"):
        with open(f"{prefix}.{suffix}", errors="replace") as fh:
            outputs[suffix] = fh.read()
    return {**spec, "returncode": status, **outputs}


PRELOADED_FAMILIES = ("qwen3", "llama", "cohere", "granite", "gemma3", "gpt_oss", "qwen3_moe", "qwen3_5", "qwen3_5_moe",
                      "qwen3_next", "olmo_hybrid", "kimi_linear", "mistral", "qwen2", "seed_oss", "smollm3", "apertus",
                      "glm4_moe", "minimax_m2", "hunyuan_v1_moe", "ernie4_5_moe", "exaone4", "nemotron_h",
                      "granitemoehybrid", "deepseek_v3", "longcat_flash", "gemma4", "mimo_v2_flash")
"""transformers' model modules preload() imports: the families the suite's commands and ranks build."""


def preload() -> None:
    """What every case or rank would import, once, before the first fork (no process group, no thread pool started
    yet): the package, DeepSpeed's engine and ZeRO-3 (and the modules they import while building an engine: its Muon
    optimizer module pulls in torch's compiler), transformers' loading, activations and tokenizers, datasets (the
    data pipeline), and the model modules of the families the checks build (PRELOADED_FAMILIES). Each is ~1-2 s a
    process on the 2-core CI machine."""
    import importlib

    import deepspeed  # noqa: F401
    import deepspeed.runtime.engine  # noqa: F401
    import deepspeed.runtime.zero.stage3  # noqa: F401
    import transformers  # noqa: F401
    import transformers.modeling_utils  # noqa: F401

    import ulysses_train.cli  # noqa: F401
    import ulysses_train.parallel.layout  # noqa: F401
    import ulysses_train.training.loop  # noqa: F401
    import ulysses_train.training.step  # noqa: F401

    for name in ("deepspeed.runtime.zero.muon.muon_optimizer", "torch._inductor.compile_fx",
                 "transformers.core_model_loading", "transformers.integrations.hub_kernels", "transformers.activations",
                 "transformers.models.auto.tokenization_auto", "transformers.tokenization_utils_fast", "datasets",
                 "peft", "ulysses_train.data.corpus", "ulysses_train.diagnostics.evaluation"):
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # another version's layout: the case imports what it needs itself
    for family in PRELOADED_FAMILIES:
        try:
            importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        except ImportError:
            pass


def main(path: str, at_once: int = 1) -> None:
    preload()
    with open(path) as fh:
        cases = json.load(fh)
    results = _run_all(cases, path, at_once)
    with open(path + ".results", "w") as fh:
        json.dump(results, fh)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1)
