"""Compile every GPU kernel a run will use, for that run's shapes, before the run starts.

    python scripts/warm_kernels.py --config configs/qwen3_5_9b_sessions_256k_1gpu.yaml
    python scripts/warm_kernels.py --config X.yaml --plan-only            # which kernels, shapes and caches
    python scripts/warm_kernels.py --config X.yaml --tar kernel-cache.tar  # and pack the caches to carry

On a fresh machine the first step compiles FlashQLA's TileLang kernels (400-470 s on an H200, 100-180 s on an H100), fla's and Liger's
Triton kernels and FlashAttention 4's: minutes in which the step's bar sat silent. This reads the run config as
scripts/train.py does (--set included), asks the trainer's own planner which kernels the run uses on this machine
(training/first_use_kernels.py), prints them with their per-rank shapes and the cache folders they fill, then
runs one step of the run's model at reduced depth (every layer kind once; one process standing in for one rank
of its sp: scripts/bench.py --emulate-sp; the `auto` levers fixed at the whole model's choice on this GPU) while a
progress bar counts what lands in the caches.

ULYSSES_TRAIN_KERNEL_CACHE puts every cache under one folder (a shared filesystem). A file lock in the cache lets
one process per node compile while the others wait; a marker per plan makes a second run say "already warm".
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
import time

from ulysses_train.cli import report_user_errors, run_config, run_script
from ulysses_train.errors import UserError
from ulysses_train.training import first_use_kernels as fuk

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="the run config (YAML) whose kernels to compile")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="a run-config override, as for scripts/train.py (repeatable)")
    ap.add_argument("--model", default="", help="a preset name for the model's shapes (default: the config's model)")
    ap.add_argument("--plan-only", action="store_true", help="print the kernels, shapes and caches; compile nothing")
    ap.add_argument("--force", action="store_true", help="compile even where the caches are warm for this plan")
    ap.add_argument("--tar", default="", help="afterwards, write the cache folders into this tar file")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds the compiling step may take")
    return ap.parse_args(argv)


def run_sp(cfg) -> int:
    sp = cfg.parallel.sequence_parallel_size
    if not isinstance(sp, int):
        raise UserError(f"parallel.sequence_parallel_size={sp!r}: the kernels' shapes depend on it. Fix: --set "
                        f"parallel.sequence_parallel_size=N with the sp the run will use.")
    return sp


def plan(args):
    """(config, model, kernels, folders, the full-depth levers as --set items) of the run the config describes,
    on this machine."""
    from ulysses_train.model.presets import known_name
    from ulysses_train.training.ds_config import load_deepspeed_config

    cfg = run_config(args.config, args.sets)
    sp = run_sp(cfg)
    model = args.model or known_name(cfg.model.name_or_path) or cfg.model.name_or_path
    ds = load_deepspeed_config(cfg.train.deepspeed_config)
    shape = model if known_name(model) else checked_model_config(cfg, model)
    facts = fuk.facts_from_run(cfg, ds, sp, sp, shape)
    return cfg, model, fuk.kernels_for(facts), fuk.cache_folders(), full_depth_levers(cfg, ds, sp, shape)


def checked_model_config(cfg, folder: str):
    """The config of the model `folder` (or hub name) as the trainer reads it (model.loading.load_model_config:
    model.config_overrides applied, every check of train.py and plan.py, one line for a malformed key), its
    weights not needed: only its shapes are."""
    import dataclasses

    from ulysses_train.model.loading import load_model_config

    return load_model_config(dataclasses.replace(cfg.model, name_or_path=folder, random_init=True))


def full_depth_levers(cfg, ds: dict, sp: int, model) -> list:
    """`--set` items fixing the config's `auto` levers at what the full-depth run chooses on this GPU (the trainer's
    own choice, planner.run.choose_run_levers, for sp GPUs): the reduced-depth step would choose for its few layers
    (no TiledMLP, no offload) and could compile other kernel variants than the run will use. None on CPU."""
    from ulysses_train.lever_keys import auto_lever_keys
    from ulysses_train.planner import detect_hardware
    from ulysses_train.planner.run import choose_run_levers

    if not auto_lever_keys(cfg.model) or not fuk.gpu_here():
        return []
    try:
        choice = choose_run_levers(cfg, ds, sp, sp, model, hf_config=lora_model_config(cfg, model),
                                   **detect_hardware())
    except NotImplementedError:  # a model the planner cannot size: the step chooses its own
        return []
    return [f"model.{key}={value}" for key, value in sorted(choice.values.items())]


def lora_model_config(cfg, model):
    """The transformers config a LoRA run's adapters are counted from (planner.run.lora_fields: PEFT's own count, and
    the fused expert tensors it merges whole), so the levers are chosen for the adapters the run will train, as its
    preflight plans them; None without LoRA. `model`: the preset, or the folder's checked config (plan)."""
    if not cfg.model.lora:
        return None
    if not isinstance(model, str):  # checked_model_config's
        return model
    from ulysses_train.model.loading import load_model_config
    from ulysses_train.model.presets import preset_config

    return load_model_config(cfg.model, preset_config(model))


def print_plan(kernels: list, folders: dict) -> None:
    if not kernels:
        print("kernels: none compiles on first use on this machine (no GPU kernel package runs here)")
        return
    print(f"kernels that compile on first use (plan {fuk.plan_digest(kernels)}):")
    for k in kernels:
        where = folders.get(k.compiler, "in each process")
        print(f"  {k.name}: {k.compiler}, {k.shapes}; ~{k.seconds[0]}-{k.seconds[1]} s ({k.source}); cache {where}")
    low, high = fuk.seconds_range(kernels)
    print(f"caches: {', '.join(f'{c} {f}' for c, f in folders.items())}; roughly {low}-{high} s to compile")


def reduced_depth(model) -> int:
    """The fewest first layers that hold every layer kind of the model (a hybrid's pattern repeats)."""
    from ulysses_train.planner.shapes import load_model_shape

    kinds = load_model_shape(model).layer_kinds
    return max(kinds.index(kind) for kind in set(kinds)) + 1


def compile_command(args, model, sp: int, levers: tuple = ()) -> list:
    """One cold step of the run (bench.py --config: its levers, DeepSpeed JSON and kernels) at reduced depth;
    `levers`: --set items fixing its `auto` levers at the full-depth run's (full_depth_levers)."""
    command = [sys.executable, os.path.join(HERE, "bench.py"), "--config", args.config, "--model", model,
               "--layers", str(reduced_depth(model)), "--steps", "0", "--timeout", str(args.timeout),
               "--json", os.path.join(tempfile.mkdtemp(), "warm.json")]
    command += [item for pair in (("--set", s) for s in [*args.sets, *levers]) for item in pair]
    return command + (["--emulate-sp", str(sp)] if sp > 1 else [])


def compile_with_progress(command: list, kernels: list, folders: dict, poll: float = 2.0) -> float:
    """Run `command`, a bar over the estimated seconds with the files each cache gained; its seconds."""
    from tqdm.auto import tqdm

    before, started = fuk.cache_file_counts(folders), time.perf_counter()
    process = subprocess.Popen(command)
    bar = tqdm(total=fuk.seconds_range(kernels)[1], desc=fuk.FIRST_STEP_DESC, unit="s", dynamic_ncols=True)
    while process.poll() is None:
        time.sleep(poll)
        bar.n = min(bar.total, int(time.perf_counter() - started))
        bar.set_postfix({c: f"+{n - before[c]} files" for c, n in fuk.cache_file_counts(folders).items()})
    bar.set_postfix({c: f"+{n - before[c]} files" for c, n in fuk.cache_file_counts(folders).items()})
    bar.close()
    if process.returncode:
        raise UserError(f"the warming step exited with code {process.returncode} (its output is above). Fix: run "
                        f"the same config with scripts/bench.py --config to see it fail alone.")
    return time.perf_counter() - started


def check_tar_path(path: str) -> None:
    """--tar names a file this process can create, checked before minutes of compiling by creating it (and removing
    it again where it was not there): a read-only filesystem or a missing folder is one line naming the path."""
    existed = os.path.exists(path)
    try:
        with open(path, "ab"):
            pass
    except OSError as err:
        raise UserError(f"--tar {path!r}: cannot write there ({err.strerror}). Fix: a path on a writable "
                        f"filesystem, in a folder that exists.") from None
    if not existed:
        os.remove(path)


def write_tar(folders: dict, path: str) -> None:
    """The cache folders as one tar, said with what it holds (also when nothing compiled here: the caches as they
    are, possibly none). A write that fails (a full disk) leaves no partial tar and is one line."""
    counts = fuk.cache_file_counts(folders)
    try:
        with tarfile.open(path, "w") as tar:
            for compiler, folder in folders.items():
                if os.path.isdir(folder):
                    tar.add(folder, arcname=fuk.CACHES[compiler][2])
    except OSError as err:
        if os.path.isfile(path):
            os.remove(path)
        raise UserError(f"--tar {path!r}: writing the caches failed ({err.strerror}); nothing was left there. Fix: "
                        f"free space or choose a writable path; the compiled caches are kept in their folders.") \
            from None
    held = ", ".join(f"{compiler} {n} files" for compiler, n in counts.items() if n) or "no cached kernel yet"
    print(f"caches written to {path} ({held}; unpack into {fuk.SHARED_CACHE_VAR}'s folder on the next machine)")


def check_model_name(name: str) -> None:
    """--model is a preset (or a local folder): a name that is neither is refused now, as plan.py refuses it, not
    after the hub was asked for it."""
    from ulysses_train.model.presets import PRESETS, known_name

    if name and not known_name(name) and not os.path.isdir(os.path.expanduser(name)):
        raise UserError(f"--model {name!r}: unknown preset. Known presets: {', '.join(PRESETS)}; or a local folder "
                        f"with config.json; or leave --model out to use the config's model.")


def warm(args) -> int:
    check_model_name(args.model)
    if args.tar:
        check_tar_path(args.tar)
    fuk.apply_kernel_cache()
    cfg, model, kernels, folders, levers = plan(args)
    print_plan(kernels, folders)
    if levers:
        print(f"levers: the full-depth run's, fixed for the reduced-depth step: {', '.join(levers)}")
    if args.plan_only:
        return 0
    fuk.check_cache_folders(folders)
    if kernels:
        with fuk.node_lock(folders):  # on a node, the first process compiles; the others wait, then find it warm
            if fuk.is_warm(kernels, folders) and not args.force:
                print(f"kernels: already warm for this plan ({fuk.marker_path(kernels, folders)})")
            else:
                seconds = compile_with_progress(compile_command(args, model, run_sp(cfg), levers), kernels, folders)
                print(f"kernels compiled in {seconds:.0f} s; marked warm: {fuk.mark_warm(kernels, folders)}")
    if args.tar:
        write_tar(folders, args.tar)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    return report_user_errors(lambda: warm(args))


if __name__ == "__main__":
    run_script(main)
