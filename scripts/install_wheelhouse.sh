#!/usr/bin/env bash
# Install a wheelhouse made by build_wheelhouse.sh into SITE without any network, then print the
# export line to use it. Usage: bash scripts/install_wheelhouse.sh [DIR=.whl] [SITE=/tmp/site]
set -euo pipefail
DIR=${1:-.whl}
SITE=${2:-/tmp/site}
mkdir -p "$SITE"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$DIR"/*.whl
BUILD=$(mktemp -d)
tar -xzf "$DIR"/deepspeed-*.tar.gz -C "$BUILD"
# --upgrade: pip --target does not replace an existing bin/ otherwise, and the launcher would be missing
(cd "$BUILD"/deepspeed-* && DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation \
    --upgrade --target "$SITE" .)
rm -rf "$BUILD"
# ulysses_train itself is imported from this repository (ds_configs/ and configs/ live beside it): its absolute
# path goes on PYTHONPATH, so the package imports from any folder, not through an empty entry meaning "here"
REPO=$(cd "$(dirname "$0")/.." && pwd)
echo "export PYTHONPATH=$SITE:$REPO\${PYTHONPATH:+:\$PYTHONPATH} PATH=$SITE/bin:\$PATH"
