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
import warnings
from typing import Callable

from ulysses_train.config import Config, ConfigError, load_config
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
                                 epilog="Every config key, with its default and meaning: README.md, section "
                                        "'Configuration' (the table there is checked against the code).")
    ap.add_argument("--config", help="YAML run config (see configs/); default: the embedded demo")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a config key, e.g. --set train.steps=10 (repeatable)")
    ap.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    ap.add_argument("--overwrite", action="store_true", help="delete checkpoints in output_dir and start over")
    ap.add_argument("--force", action="store_true",
                    help="start even when the memory planner predicts the run does not fit this machine")
    ap.add_argument("--profile-memory", action="store_true",
                    help="record GPU memory through the second step: snapshot + PNG in <output_dir>/memory (GPU only)")
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
    # DeepSpeed 0.19 calls collectives that torch 2.13 deprecates, once per call: noise, not news
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed\.", category=FutureWarning)


def report_user_errors(action: Callable[[], int]) -> int:
    """Run a command's body: a UserError becomes one `error: ...` line on stderr and EXIT_USER_ERROR, never a
    traceback; a second Ctrl-C becomes 130. Every script's `main` ends here, so they all fail the same way.

    Every rank meets the same refusal (the same command, config and files), so a message is printed by the first
    rank of each machine to meet it (`_first_to_tell`), not once per GPU; a fault that only one machine has (a
    path missing there) is still told by that machine."""
    try:
        return action()
    except UserError as err:
        if _first_to_tell(str(err)):
            print(f"error: {err}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted: stopped without saving; the last complete checkpoint is kept.", file=sys.stderr,
              flush=True)
        return 130


def _first_to_tell(message: str) -> bool:
    """Is this the first rank of this launch on this machine to report `message`? The ranks of one launch share
    their parent (the deepspeed, torchrun or srun step process); the first to create a marker file named after
    that parent (its pid and start time, so a later launch never matches) and the message wins, atomically
    (O_EXCL). Not "local rank 0 prints": the launcher stops every rank when the first one exits, so a silent
    rank 1 that exits first would take rank 0 down before it printed."""
    if _ranks()[2] == 1:
        return True
    parent = os.getppid()
    try:
        with open(f"/proc/{parent}/stat") as fh:
            started = fh.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        started = "0"
    digest = hashlib.sha1(message.encode()).hexdigest()[:16]
    marker = os.path.join(tempfile.gettempdir(), f"ulysses_train_refusal.{parent}.{started}.{digest}")
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False
    except OSError:
        return True  # no shared temp folder: better twice than never
    return True


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
    from ulysses_train.training.stopping import EXIT_STOPPED, StopRequest, TrainingStopped

    cfg = run_config(args.config, args.set)
    stop_request = StopRequest().install()
    try:
        trainer = Trainer(cfg, resume=args.resume, overwrite=args.overwrite, force=args.force,
                          profile_memory=args.profile_memory, stop_request=stop_request)
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
