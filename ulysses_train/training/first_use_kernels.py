"""The GPU kernels a run compiles on first use: which, at which shapes, how long, where they are cached.

A first step on a fresh machine spends minutes compiling (FlashQLA's TileLang kernels: 400-470 s on a fresh H200,
100-180 s on a fresh H100: COMPILE_SECONDS, per card, from benchmarks/RESULTS.md) behind a silent progress bar, and every SLURM node pays it again with all its ranks
compiling the same kernels at once. This module is the one place that knows the kernels a run uses (from the
planner's own view of the run, planner.options_from_run, and the model's mixers), the cache folders they fill,
one setting that moves them all (ULYSSES_TRAIN_KERNEL_CACHE, e.g. to a shared filesystem), the marker that says
a plan's kernels were warmed, and the node lock that lets one process compile while the others wait. The warm
command (scripts/warm_kernels.py) and the trainer's first-step notice both read it.
"""
from __future__ import annotations

import contextlib
import fcntl
import getpass
import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from typing import Optional

SHARED_CACHE_VAR = "ULYSSES_TRAIN_KERNEL_CACHE"


def _cute_dsl_default() -> str:
    """FlashAttention 4's own default (flash_attn/cute/cache_utils.py: the temp folder, then the user name)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no user name in a bare container: FlashAttention 4 would fail the same way
        user = "user"
    return os.path.join(tempfile.gettempdir(), user, "flash_attention_cute_dsl_cache")


CACHES = {"Triton": ("TRITON_CACHE_DIR", "~/.triton/cache", "triton"),
          "TileLang": ("TILELANG_CACHE_DIR", "~/.tilelang/cache", "tilelang"),
          "CuTe DSL": ("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", _cute_dsl_default(), "flash_attn")}
"""compiler -> (its cache variable, its default folder, its subfolder under ULYSSES_TRAIN_KERNEL_CACHE)."""
CUTE_DSL_CACHE_SWITCH = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"
"""FlashAttention 4 keeps its compiled kernels on disk only when this is 1 (its default is 0, every process
compiling again); apply_kernel_cache sets it to 1 unless the user set it, so warmed kernels load."""
MARKERS = "ulysses_train_warm"
"""Folder, inside the first cache, of one marker file per warmed plan (named by plan_digest)."""


@dataclass(frozen=True)
class FirstUseKernel:
    name: str
    compiler: str   # a key of CACHES
    shapes: str     # what it is compiled for, per rank
    seconds: tuple  # rough first-use compile time (low, high) and where that figure comes from
    source: str
    modules: tuple = ()  # Python modules its first call would import (import_kernel_modules)


COMPILE_SECONDS = {
    "fa4": {"H100": ((5, 30), "measured: 6 s at 1,048,576 tokens on a fresh H100, benchmarks/RESULTS.md")},
    "flash_qla": {"H200": ((400, 470), "measured: a fresh H200, benchmarks/RESULTS.md"),
                  "H100": ((100, 180), "measured: a fresh H100 compiled a Qwen3.5 step's kernels, this one, fla's, "
                                       "FlashAttention 4's and Liger's, in 172 s, benchmarks/RESULTS.md")},
}
"""kernel -> {card: ((low, high) first-use compile seconds, where the figure comes from)}, the card matched as a part
of the GPU's name. Figures are per card: a kernel compiles for the card's architecture, on its host's CPU."""


def compile_seconds(kernel: str, card: str, estimate: tuple) -> tuple:
    """((low, high) seconds, their source) of a kernel's first-use compile on `card` (the GPU's name): its figure
    measured on this card; else, where measured only on others, the largest of those, said to be another card's;
    else `estimate`, said to be one."""
    measured = COMPILE_SECONDS.get(kernel, {})
    for key, figure in measured.items():
        if key in card:
            return figure
    if measured:
        key, (seconds, _) = max(measured.items(), key=lambda item: item[1][0][1])
        return seconds, f"measured on an {key}, not on this card"
    return estimate, "not measured: an estimate"


def gpu_name() -> str:
    """The first GPU's name ("" without one, or where it cannot be read): the card the compile figures are looked up
    for."""
    import torch

    try:
        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    except (RuntimeError, AssertionError):  # a torch built without CUDA, or a device that cannot be queried
        return ""


@dataclass(frozen=True)
class KernelFacts:
    """What decides the kernels: the run's shapes per rank and which kernels run on this machine."""
    tokens: int            # the whole sequence (what the mixers see after the all-to-all)
    sp: int
    attention: str         # the planner's attention_kernel: "fa4" or another
    heads: int             # attention heads, and the Gated DeltaNet / KDA ones, per rank after the all-to-all
    head_dim: int
    linear: Optional[tuple] = None  # (value heads, key width, value width) of a Gated DeltaNet, per rank
    mixer_kernels: tuple = ()  # ((mixer, kernel variant), ...): the run's choice (ResolvedRun.mixer_kernels)
    liger_norm: bool = False
    liger_swiglu: bool = False
    documents: bool = False
    gpu: bool = True       # nothing compiles without one (a CPU run names fa4 and gets its reference kernel)
    card: str = ""         # the GPU's name: the compile figures are the card's (COMPILE_SECONDS)


def gpu_here() -> bool:
    import torch

    return torch.cuda.is_available()


def kernels_for(facts: KernelFacts) -> list:
    """The kernels that compile on first use for these facts, in the order a step first calls them."""
    per_rank = f"{facts.tokens:,} tokens x {facts.heads} heads x {facts.head_dim}"
    out = []
    if not facts.gpu:
        return out
    if facts.attention == "fa4":
        kind = "variable-length" if facts.documents else "causal"
        out.append(FirstUseKernel("FlashAttention 4 forward and backward", "CuTe DSL", f"{kind}, {per_rank}",
                                  *compile_seconds("fa4", facts.card, (30, 120)), ("flash_attn.cute.interface",)))
    for mixer, variant in facts.mixer_kernels:
        out += mixer_kernel_entries(facts, mixer, variant, per_rank)
    liger = [name for name, on in (("RMSNorm", facts.liger_norm), ("SwiGLU", facts.liger_swiglu)) if on]
    if liger:
        tokens = -(-facts.tokens // facts.sp)
        out.append(FirstUseKernel(f"Liger's {' and '.join(liger)}", "Triton", f"{tokens:,} tokens per rank",
                                  (5, 30), "not measured: an estimate"))
    return out


def mixer_kernel_entries(facts: KernelFacts, mixer: str, variant: str, per_rank: str) -> list:
    """The kernels one mixer's chosen variant (Mixer.kernel_variants) compiles on first use; none for transformers'
    torch functions."""
    estimate = "not measured: an estimate"
    if mixer == "gated_deltanet" and variant != "torch":
        heads, dk, dv = facts.linear
        shape = f"{facts.tokens:,} tokens x {heads} heads x {dk}/{dv}"
        rule = (FirstUseKernel("FlashQLA's gated delta rule", "TileLang", shape,
                               *compile_seconds("flash_qla", facts.card, (400, 470)), ("flash_qla",))
                if variant == "flash_qla" else
                FirstUseKernel("fla's chunked gated delta rule", "Triton", shape, (30, 120), estimate))
        return [FirstUseKernel("fla's causal conv1d and fused gated RMSNorm", "Triton", shape, (15, 60), estimate),
                rule]
    if mixer == "kimi_delta" and variant != "torch":
        return [FirstUseKernel("fla's chunk_kda (Kimi Delta Attention)", "Triton", per_rank, (30, 120), estimate)]
    if mixer == "mamba2" and variant != "torch":
        return [FirstUseKernel(f"fla's causal conv1d and {variant} (Mamba2)", "Triton", per_rank, (30, 120),
                               estimate)]
    return []


def cache_folders(env=None) -> dict:
    """compiler -> the folder its cache is in, as the compilers will read it from `env` once apply_kernel_cache
    ran: its own variable, else under ULYSSES_TRAIN_KERNEL_CACHE, else its default."""
    env = os.environ if env is None else env
    root = env.get(SHARED_CACHE_VAR)
    return {compiler: os.path.expanduser(env.get(var) or (os.path.join(root, sub) if root else default))
            for compiler, (var, default, sub) in CACHES.items()}


def apply_kernel_cache(env=None) -> dict:
    """Turn on FlashAttention 4's disk cache (CUTE_DSL_CACHE_SWITCH) and, with ULYSSES_TRAIN_KERNEL_CACHE set,
    point every compiler's cache variable under it (a variable already set wins); called before any kernel package
    is imported. Returns cache_folders."""
    env = os.environ if env is None else env
    env.setdefault(CUTE_DSL_CACHE_SWITCH, "1")
    root = env.get(SHARED_CACHE_VAR)
    if root:
        for var, _, sub in CACHES.values():
            env.setdefault(var, os.path.join(os.path.expanduser(root), sub))
    return cache_folders(env)


def cache_file_counts(folders: dict) -> dict:
    """compiler -> files in its cache folder now (what a compile adds shows as a difference)."""
    return {compiler: sum(len(files) for _, _, files in os.walk(folder)) if os.path.isdir(folder) else 0
            for compiler, folder in folders.items()}


def plan_digest(kernels: list) -> str:
    """Names one plan's kernels and shapes: its marker file and the warm command's output say it."""
    text = json.dumps([asdict(k) for k in kernels], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def marker_path(kernels: list, folders: dict) -> str:
    return os.path.join(next(iter(folders.values())), MARKERS, plan_digest(kernels))


def is_warm(kernels: list, folders: dict) -> bool:
    return os.path.exists(marker_path(kernels, folders))


def mark_warm(kernels: list, folders: dict) -> str:
    path = marker_path(kernels, folders)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        json.dump([asdict(k) for k in kernels], fh, indent=1)
    return path


def check_cache_folders(folders: dict) -> None:
    """Each cache folder is a folder this process can write (or create), tried with the run folder's own probe
    (run_folder.check_writable): a ConfigError naming the folder and its variable, before a compile would fail on
    it."""
    from ulysses_train.training.run_folder import check_writable

    for compiler, folder in folders.items():
        check_writable(folder, f"the {compiler} kernel cache ({SHARED_CACHE_VAR} or {CACHES[compiler][0]})")


@contextlib.contextmanager
def node_lock(folders: dict):
    """One process per node (per cache folder) compiles; the others block here until it is done, then find the
    cache warm. The lock is the kernel's: it ends with its process, even on kill -9."""
    folder = next(iter(folders.values()))
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, ".ulysses_train_warm.lock"), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def seconds_range(kernels: list) -> tuple:
    return sum(k.seconds[0] for k in kernels), sum(k.seconds[1] for k in kernels)


def first_step_notice(kernels: list, folders: dict, warm: bool) -> Optional[str]:
    """What the trainer says before its first step: the kernels that compile on first use, roughly how long, where
    they are cached, and how to warm them; None when no kernel compiles on first use."""
    if not kernels:
        return None
    names = "; ".join(f"{k.name} ({k.compiler})" for k in kernels)
    where = ", ".join(f"{compiler} {folder}" for compiler, folder in folders.items()
                      if any(k.compiler == compiler for k in kernels))
    if warm:
        return f"kernels: warmed for this run (scripts/warm_kernels.py): {names}; cached in {where or 'process'}"
    low, high = seconds_range(kernels)
    return (f"kernels that compile on first use: {names}; roughly {low}-{high} s in the first step "
            f"({'; '.join(sorted({k.source for k in kernels}))}); cached in "
            f"{where or 'each process'} ({SHARED_CACHE_VAR} moves them). To compile before the run: python "
            f"scripts/warm_kernels.py --config <this config>")


def facts_from_run(cfg, ds_config: dict, world_size: int, gpus_per_node: int, model) -> KernelFacts:
    """facts_from_options for a run described by its config and DeepSpeed dict, its kernels chosen as a run on this
    machine chooses them (planner.options_from_run): the warm command's view of the run it warms for."""
    from ulysses_train.planner.run import options_from_run

    options = options_from_run(cfg, ds_config, world_size, gpus_per_node, model=model)
    return facts_from_options(options, model, cfg.data.packing == "documents")


def facts_from_options(options, model, documents: bool) -> KernelFacts:
    """The facts of a run as its own preflight plan sees them (`options`: its PlanOptions, whose attention kernel,
    mixer kernels, Liger's norm and SwiGLU it reads) and the model's shape (heads per rank after the all-to-all;
    `model`: anything load_model_shape takes); `documents`: packed documents (variable-length attention)."""
    from ulysses_train.planner.linear_layer import delta_rule_heads
    from ulysses_train.planner.shapes import load_model_shape

    shape = load_model_shape(model)
    sp = options.sp
    kinds = set(shape.layer_kinds)
    linear = None
    if "gated_deltanet" in kinds:
        _, value_heads, key_dim, value_dim = delta_rule_heads(shape)
        linear = (value_heads // sp, key_dim, value_dim)
    return KernelFacts(tokens=options.seq_length, sp=sp, attention=options.attention_kernel,
                       heads=max(1, shape.heads // sp), head_dim=shape.head_dim, linear=linear,
                       mixer_kernels=tuple(options.mixer_kernels.items()), liger_norm=options.offset_norm_kernel,
                       liger_swiglu=options.swiglu_kernel, documents=documents, gpu=gpu_here(), card=gpu_name())


def run_kernels(run, cuda: bool) -> list:
    """The kernels a ResolvedRun compiles on first use (kernels_for); none on CPU runs, where nothing compiles, and
    where the run's shape is one the planner cannot size."""
    from ulysses_train.planner.run import options_of_resolved_run

    if not cuda:
        return []
    try:
        return kernels_for(facts_from_options(options_of_resolved_run(run), run.planned_model,
                                              run.cfg.data.packing == "documents"))
    except NotImplementedError:
        return []


def trainer_notice(run, cuda: bool) -> Optional[str]:
    """The trainer's line before its first step (first_step_notice) for a ResolvedRun; None where nothing compiles."""
    kernels = run_kernels(run, cuda)
    folders = cache_folders()
    return first_step_notice(kernels, folders, is_warm(kernels, folders)) if kernels else None


def import_kernel_modules(kernels: list) -> None:
    """Import, now, the modules the kernels' first calls would import inside the first step. Their imports cost
    seconds even with every cache warm: on a fresh H100 with carried caches, a 4-layer Qwen3.5-9B first step took
    21.3 s against 5.9 s for the second, its profile showing FlashQLA's import (it traces its TileLang kernel
    definitions) and FlashAttention 4's (quack registers its torch custom ops) (benchmarks/RESULTS.md). Imported
    before the first step, they no longer read as a slow step."""
    import importlib

    for name in (name for kernel in kernels for name in kernel.modules):
        importlib.import_module(name)


FIRST_STEP_DESC = "compiling kernels"
"""The first step's progress-bar text while kernels compile (the bar says "train" again after it)."""
