#!/usr/bin/env bash
# What the offline H200 image lacks for the Gated DeltaNet (Qwen3.5) runs of benchmarks/hybrid_gpu.sh, in parts
# that fit the 64 MiB one device call carries. A real cluster runs `pip install deepspeed flash-linear-attention
# tilelang`; this is for the measurement machine, whose Triton (3.6.0) fla 0.6 refuses for its Hopper backward
# unless tilelang is installed (benchmarks/RESULTS.md, "The Gated DeltaNet kernels on one H200").
#
#   bash benchmarks/hybrid_bundle.sh build       # here, with PyPI: .hya/ (~55 MiB) and .hyb/ (~28 MiB)
#   bash benchmarks/hybrid_bundle.sh install-a   # there, call 1 (carry .hya): deepspeed, fla, tilelang -> /tmp/site
#   bash benchmarks/hybrid_bundle.sh install-b   # there, a later call on the same warm machine (carry .hyb): z3,
#                                                # flash-qla, and the peer's trl, liger-kernel, peft
#   eval "$(bash benchmarks/hybrid_bundle.sh env)"   # PYTHONPATH/PATH for the installed site
# With FlashAttention 4 as well (benchmarks/fa4_bundle.sh): call 1 carries .hya, call 2 .fa4a (stash), call 3
# .hyb and .fa4b (install-b, then unpack). apache-tvm-ffi and torch-c-dlpack-ext, which tilelang needs too, come
# with the FA4 bundle (pinned there to a version tilelang accepts); without it, build with WITH_TVM_FFI=1.
set -euo pipefail
SITE=/tmp/site
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
case "${1:?build | install-a | install-b | env}" in
  build)
    rm -rf .hya .hyb && mkdir -p .hya .hyb
    extra=""; [ "${WITH_TVM_FFI:-0}" = 1 ] && extra="apache-tvm-ffi==0.1.12 torch-c-dlpack-ext"
    # deepspeed's needs and datasets' (the image has torch, transformers, numpy, matplotlib, pytest, ml-dtypes,
    # cloudpickle: benchmarks/../.library device KINDS.md lists them), fla, tilelang
    python3 -m pip download --quiet --no-deps "${PLAT[@]}" -d .hya hjson pydantic pydantic-core annotated-types \
        typing-inspection datasets multiprocess dill fla-core flash-linear-attention tilelang==0.1.15 $extra
    python3 -m pip download --quiet --no-deps --no-binary=:all: -d .hya "deepspeed==${DEEPSPEED_VERSION:-0.19.8}"
    # z3 (tilelang), FlashQLA (fla hands it the gated delta rule when installed), and the peer's TRL, Liger, PEFT
    # (benchmarks/peer_trl.py)
    python3 -m pip download --quiet --no-deps "${PLAT[@]}" -d .hyb "z3-solver<4.15.5,>=4.13.0" flash-qla==0.1.3 \
        trl==1.16.0 liger-kernel==0.8.5 peft
    grep -qx '/.hya/' .git/info/exclude 2>/dev/null || printf '/.hya/\n/.hyb/\n' >> .git/info/exclude
    du -sh .hya .hyb ;;
  install-a)
    mkdir -p "$SITE"
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" .hya/*.whl
    build=$(mktemp -d) && tar -xzf .hya/deepspeed-*.tar.gz -C "$build"
    (cd "$build"/deepspeed-* && DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation \
        --upgrade --target "$SITE" .)
    rm -rf "$build"; ls "$SITE" | head -50 ;;
  install-b)
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" .hyb/*.whl
    ls "$SITE" | grep -iE "z3|flash_qla|trl|liger|peft" ;;
  env)
    echo "export PYTHONPATH=$SITE:$PWD\${PYTHONPATH:+:\$PYTHONPATH} PATH=$SITE/bin:\$PATH" ;;
  *) echo "unknown command $1" >&2; exit 2 ;;
esac
