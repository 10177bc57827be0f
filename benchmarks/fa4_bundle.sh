#!/usr/bin/env bash
# FlashAttention 4 (package flash-attn-4 and what it needs) for an offline GPU machine whose uploads are capped
# at 64 MiB a call. A real cluster just runs `pip install flash-attn-4`; this is for the measurement machine.
#
#   bash benchmarks/fa4_bundle.sh build           # here, with PyPI: .fa4a/ (~45 MB) and .fa4b/ (~26 MB)
#   bash benchmarks/fa4_bundle.sh stash           # there, call 1 (carry .fa4a): parts to /tmp/fa4parts
#   eval "$(bash benchmarks/fa4_bundle.sh unpack)" # there, call 2 (carry .fa4b, the machine still warm)
#
# The unpacked wheels are ~256 MB, almost all the CuTe DSL compiler (nvidia-cutlass-dsl-libs-cu12; it runs on
# CUDA 13 drivers too), ~71 MB as xz: more than one call may carry, hence the two parts.
set -euo pipefail
FA4_VERSION=${FA4_VERSION:-4.0.0b36}
CUTLASS_DSL_VERSION=${CUTLASS_DSL_VERSION:-4.8.1}
# FA4 takes apache-tvm-ffi >= 0.1.11, < 0.2; tilelang (fla's Hopper backward, benchmarks/hybrid_gpu.sh) takes < 0.1.13:
# one version both accept, as one process imports both
TVM_FFI_SPEC=${TVM_FFI_SPEC:-apache-tvm-ffi==0.1.12}
case "${1:?build | stash | unpack}" in
  build)
    work=$(mktemp -d)
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any -d "$work/wheels" \
        "flash-attn-4==$FA4_VERSION" "nvidia-cutlass-dsl==$CUTLASS_DSL_VERSION" \
        "nvidia-cutlass-dsl-libs-base==$CUTLASS_DSL_VERSION" "nvidia-cutlass-dsl-libs-core==$CUTLASS_DSL_VERSION" \
        "nvidia-cutlass-dsl-libs-cu12==$CUTLASS_DSL_VERSION" "$TVM_FFI_SPEC" torch-c-dlpack-ext \
        "quack-kernels>=0.5.3"
    mkdir -p "$work/site"
    for wheel in "$work"/wheels/*.whl; do python3 -m zipfile -e "$wheel" "$work/site"; done
    rm -rf "$work/site/nvidia_cutlass_dsl/cu12/lib/stubs"  # QNX / aarch64 stubs
    (cd "$work/site" && tar cf - . | xz -T0 -6 > "$work/fa4site.tar.xz")
    split -b 45000000 "$work/fa4site.tar.xz" "$work/fa4site.tar.xz.part-"
    rm -rf .fa4a .fa4b && mkdir -p .fa4a .fa4b
    mv "$work/fa4site.tar.xz.part-aa" .fa4a/ && mv "$work/fa4site.tar.xz.part-ab" .fa4b/
    grep -qx '/.fa4a/' .git/info/exclude 2>/dev/null || printf '/.fa4a/\n/.fa4b/\n' >> .git/info/exclude
    rm -rf "$work"; du -sh .fa4a .fa4b ;;
  stash)
    mkdir -p /tmp/fa4parts && cp .fa4a/* /tmp/fa4parts/ && ls -la /tmp/fa4parts ;;
  unpack)
    site=/tmp/fa4site
    if [ ! -d "$site/flash_attn/cute" ]; then
      [ -n "$(ls /tmp/fa4parts 2>/dev/null)" ] || { echo "echo 'fa4_bundle: part a missing: run stash first (machine was fresh)' >&2; exit 3"; exit 0; }
      mkdir -p "$site" && cat /tmp/fa4parts/* .fa4b/* | xz -d | tar x -C "$site"
    fi
    echo "export PYTHONPATH=$site:$site/nvidia_cutlass_dsl/dsl_packages:\${PYTHONPATH:-}" ;;
esac
