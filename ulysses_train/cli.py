"""The command users type: `deepspeed --num_gpus N scripts/train.py --config FILE [--set key=value ...]`.

Also runs under torchrun and SLURM srun (ranks from the environment). With no --config it trains the
embedded demo: a tiny Qwen3 learning key-value retrieval across sequence-parallel slices.
Bad configuration exits with code 2 and a one-line message, never a traceback.
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys
import tempfile
import time
import warnings
from typing import Callable

from ulysses_train.config import Config, ConfigError, load_config
from ulysses_train.training.first_use_kernels import apply_kernel_cache
from ulysses_train.errors import EXIT_USER_ERROR, UserError
from ulysses_train.user_input import missing_local_path

# The demo (configs/demo.yaml holds the same values, as a file to copy and edit). They apply only while the run
# stays the demo (`run_config`): a model or corpus named with --set gets the plain defaults, never random weights.
DEMO_MODEL = "demo-tiny-qwen3"
DEMO_DEFAULTS = {
    "model": {"name_or_path": DEMO_MODEL, "random_init": True, "dtype": "float32",
              "attn_implementation": "sdpa"},
    "parallel": {"sequence_parallel_size": "auto"},  # all processes share each sequence, as the heads allow
    "data": {"source": "demo", "seq_length": 128, "num_samples": 100000},
    "train": {"deepspeed_config": "ds_configs/demo.json", "steps": 600, "log_every": 100,
              "output_dir": "outputs/demo", "save_every": 0, "seed": 0},
}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Every config key, with its default and meaning: docs/configuration.md "
                                        "(the table there is checked against the code).")
    ap.add_argument("--config", help="YAML run config (see configs/); default: the embedded demo")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a config key, e.g. --set train.steps=10 (repeatable)")
    ap.add_argument("--resume", action="store_true",
                    help="continue from the latest complete checkpoint (refused where there is none)")
    ap.add_argument("--resume-if-present", action="store_true",
                    help="continue from the latest complete checkpoint if train.output_dir holds one, else start the "
                         "run there (what a requeued SLURM job passes)")
    ap.add_argument("--overwrite", action="store_true", help="delete checkpoints in output_dir and start over")
    ap.add_argument("--force", action="store_true",
                    help="start even when the memory planner predicts the run does not fit this machine")
    ap.add_argument("--profile-memory", action="store_true",
                    help="record GPU memory through the second step: snapshot, PNG and the blocks alive at its peak "
                         "(with the lines that made them) in <output_dir>/memory (GPU only)")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def prepare_environment() -> None:
    """Settings that must exist before CUDA or the process group start."""
    # long sequences allocate huge contiguous tensors; without expandable segments they fail to find
    # room even when the total fits (ulysses_train/DESIGN.md, 'Traps')
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    # DeepSpeed's JIT op builder cannot parse the '9.0a' form some Hopper machines export
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if arch:
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch.replace("9.0a", "9.0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # every kernel cache under one folder (a shared filesystem) when ULYSSES_TRAIN_KERNEL_CACHE says so
    apply_kernel_cache()
    # DeepSpeed 0.19 calls collectives that torch 2.13 deprecates, once per call: noise, not news
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed\.", category=FutureWarning)


def report_user_errors(action: Callable[[], int]) -> int:
    """Run a command's body: a UserError becomes one `error: ...` line on stderr and EXIT_USER_ERROR, never a
    traceback; a second Ctrl-C becomes 130. Every script's `main` ends here, so they all fail the same way.

    Every rank meets the same refusal (the same command, config and files), so it is told once per machine, not
    once per GPU (`_tell_once`)."""
    try:
        return action()
    except UserError as err:
        _tell_once(f"error: {err}")
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted: stopped without saving; the last complete checkpoint is kept.", file=sys.stderr,
              flush=True)
        return 130


TOLD_WAIT_S = 10.0
"""How long a rank other than the machine's first waits for that rank to tell the same refusal before telling it
itself (the first rank may have met another refusal, or none)."""


def _tell_once(line: str) -> None:
    """Local rank 0 prints `line` and then leaves a marker (named after the launch: the ranks' shared parent
    process, the deepspeed, torchrun or srun step, by pid and start time, and the message); the machine's other
    ranks wait for that marker and stay silent, or print after TOLD_WAIT_S without it. They wait rather than exit
    at once because a launcher stops every rank when the first one exits: a silent rank 1 exiting first would take
    rank 0 down before it printed. A fault that only one machine has is still told by that machine."""
    _, local_rank, world = _ranks()
    marker = _told_marker(line) if world > 1 else None
    if local_rank == 0 or marker is None:
        print(line, file=sys.stderr, flush=True)
        if marker is not None:
            try:
                open(marker, "w").close()
            except OSError:
                pass  # the others print it after their wait
        return
    deadline = time.monotonic() + TOLD_WAIT_S
    while time.monotonic() < deadline:
        if os.path.exists(marker):
            return
        time.sleep(0.05)
    print(line, file=sys.stderr, flush=True)


def _told_marker(line: str) -> str | None:
    """The marker of `line` told in this launch on this machine; None where the parent cannot be identified."""
    parent = os.getppid()
    try:
        with open(f"/proc/{parent}/stat") as fh:
            started = fh.read().rsplit(")", 1)[1].split()[19]  # field 22: the parent's start time
    except (OSError, IndexError):
        return None
    digest = hashlib.sha1(line.encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"ulysses_train_told.{parent}.{started}.{digest}")


def _ranks() -> tuple[int, int, int]:
    """(rank, local rank, world size) from the launcher's variables (layout.py imports torch: only when asked)."""
    from ulysses_train.parallel.layout import rank_from_environment

    return rank_from_environment()


def run_script(main: Callable[[], int]) -> None:
    """The `__main__` of every script: run `main()` and leave through `exit_process` (no interpreter teardown,
    where a process group's gloo backend can abort a finished process)."""
    from ulysses_train.parallel.layout import exit_process

    exit_process(main())


def main(argv=None) -> int:
    args = parse_args(argv)
    prepare_environment()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return report_user_errors(lambda: train(args))


def train(args: argparse.Namespace) -> int:
    from ulysses_train.parallel.layout import rank_from_environment, shutdown_distributed
    from ulysses_train.training.loop import Trainer
    from ulysses_train.training.stopping import EXIT_STOPPED, StopRequest, TrainingStopped, resume_point

    cfg = run_config(args.config, args.set)
    stop_request = StopRequest(at_once=lambda: resume_point(cfg.train.output_dir)).install()
    try:
        trainer = Trainer(cfg, resume=args.resume, overwrite=args.overwrite, force=args.force,
                          profile_memory=args.profile_memory, stop_request=stop_request,
                          resume_if_present=args.resume_if_present)
        stop_request.begin_steps()
        trainer.train()
    except TrainingStopped as stopped:
        if rank_from_environment()[0] == 0:
            print(str(stopped), file=sys.stderr, flush=True)
        return EXIT_STOPPED
    finally:
        stop_request.close()
    shutdown_distributed()
    return 0


def run_config(path: str | None, overrides: list[str]) -> Config:
    """The run's config: the file (if any) and the overrides over the plain defaults; without a file, the demo's
    defaults only while the run stays the demo. Naming a model or a corpus with --set and no --config used to
    keep the demo's `random_init: true`: the named model's shapes trained from random weights, its weights never
    read, the log silent about it."""
    if path:
        cfg = load_config(path, overrides)
    else:
        cfg = load_config(None, overrides, defaults=DEMO_DEFAULTS)
        if cfg.data.source != "demo" or cfg.model.name_or_path != DEMO_MODEL:
            cfg = load_config(None, overrides)
    model = cfg.model.name_or_path
    problem = missing_local_path(model) if model else None
    if problem:  # before the data checks, which would blame the tokenizer it stands in for
        raise ConfigError(f"model.name_or_path={model!r}: {problem}. Fix: point it to a Hugging Face model folder "
                          f"(config.json and weights) or a hub name such as Qwen/Qwen3-8B.")
    if cfg.data.source == "demo" and model not in ("", DEMO_MODEL):
        raise ConfigError(f"data.source=demo is the demo: its own tiny model (data/demo.py) on generated data, not "
                          f"model.name_or_path={model!r}. Fix: set data.source to your corpus to use that model, "
                          f"or leave model.name_or_path out to run the demo.")
    if cfg.model.random_init and cfg.data.source != "demo" and _ranks()[1] == 0:
        print(f"note: model.random_init is true: {model!r}'s architecture trains from random weights; its "
              f"weights are not read.", file=sys.stderr, flush=True)
    return cfg
