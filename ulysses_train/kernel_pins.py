"""The GPU kernels at the versions measured together, defined once.

setup.py reads this file (by path: it imports nothing from the package, so the install needs nothing installed)
to build the `gpu` extra, and the trainer's kernel checks read it for what they accept and for the install line
their messages name. So the extra a user installs and the versions the trainer calls measured cannot drift apart
(tests/test_kernel_pins.py holds them together, with a version outside the range as the negative control).

The versions are those of the H200 runs in benchmarks/RESULTS.md ("Machines and versions"), with torch, Triton,
transformers and DeepSpeed as MEASURED_WITH says; apache-tvm-ffi is the one version both FlashAttention 4 and
TileLang accept in one process (benchmarks/fa4_bundle.sh).
"""
from importlib import metadata
from typing import NamedTuple, Optional

GPU_EXTRA = "gpu"
INSTALL_LINE = 'pip install "ulysses-train[gpu]"'
"""What every missing-kernel message tells the user to run (from a clone: pip install -e ".[gpu]")."""


class Pin(NamedTuple):
    dist: str       # the PyPI name
    module: str     # the module whose presence means the kernel runs
    measured: str   # the version the measurements ran with: the extra pins it
    accepted: str   # the versions the kernel checks accept without a warning (a PEP 440 specifier set)
    what: str       # what it runs here, for messages


PINS = (
    Pin("flash-attn-4", "flash_attn.cute", "4.0.0b36", ">=4.0.0b36,<4.1", "FlashAttention 4 (attention, fa4)"),
    Pin("nvidia-cutlass-dsl", "cutlass", "4.8.1", ">=4.8,<5", "the CuTe DSL that compiles FlashAttention 4"),
    Pin("apache-tvm-ffi", "tvm_ffi", "0.1.12", ">=0.1.11,<0.1.13", "the FFI FlashAttention 4 and TileLang share"),
    Pin("flash-linear-attention", "fla", "0.6.0", ">=0.6,<0.7", "fla's Gated DeltaNet and KDA kernels"),
    Pin("fla-core", "fla", "0.6.0", ">=0.6,<0.7", "fla's Triton kernels"),
    Pin("tilelang", "tilelang", "0.1.15", ">=0.1.15,<0.2", "fla's Hopper backward and FlashQLA's kernels"),
    Pin("flash-qla", "flash_qla", "0.1.3", ">=0.1.3,<0.2", "FlashQLA's fused gated delta rule"),
    Pin("liger-kernel", "liger_kernel", "0.8.5", ">=0.8,<0.9", "Liger's RMSNorm and SwiGLU kernels"),
)

MEASURED_WITH = {"torch": "2.11.0+cu130", "triton": "3.6.0", "transformers": "5.17.0", "deepspeed": "0.19.8"}
"""What the kernels ran beside (not pinned: torch's CUDA build comes from its own index, and Triton with it)."""


FA4_EXTRA = "fa4"
FA4_DISTS = ("flash-attn-4", "nvidia-cutlass-dsl", "apache-tvm-ffi")
"""FlashAttention 4 alone (`model.attn_implementation: fa4`): it and what compiles it, as measured."""


def requirement(dist: str) -> str:
    """`dist` at its measured version: the only form pip resolves for a package that has only pre-releases
    (flash-attn-4 4.0.0b36: pip finds nothing for a bare `flash-attn-4` requirement)."""
    return f"{dist}=={pin(dist).measured}"


def gpu_extra() -> list:
    """The `gpu` extra's requirements: every kernel at its measured version."""
    return [requirement(pin.dist) for pin in PINS]


def fa4_extra() -> list:
    return [requirement(dist) for dist in FA4_DISTS]


def pin(dist: str) -> Pin:
    return next(p for p in PINS if p.dist == dist)


FA4_INSTALL_LINE = f'pip install "{requirement("flash-attn-4")}"'
"""FlashAttention 4 alone, as the trainer's fa4 refusal names it."""


def installed_version(dist: str) -> Optional[str]:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def version_problem(dist: str, version: Optional[str]) -> Optional[str]:
    """Why `version` of `dist` is not one the kernel checks accept, or None (None too when it is not installed:
    a missing kernel is the checks' own message)."""
    from packaging.specifiers import SpecifierSet

    if version is None:
        return None
    wanted = pin(dist)
    if SpecifierSet(wanted.accepted, prereleases=True).contains(version, prereleases=True):
        return None
    return (f"{dist} {version} is installed, but {wanted.what} ran measured with {wanted.measured} "
            f"(accepted: {wanted.accepted}). Fix: {INSTALL_LINE}")


def installed_version_problems() -> list:
    """One line for each installed kernel outside its accepted versions (the trainer warns with them on GPUs)."""
    problems = (version_problem(p.dist, installed_version(p.dist)) for p in PINS)
    return [problem for problem in problems if problem]
