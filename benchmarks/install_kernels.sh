#!/usr/bin/env bash
# On the GPU machine: install the carried .whl/ (built by pack_kernels.sh) into a target folder, outside the
# image's site-packages. Usage:  bash benchmarks/install_kernels.sh [/tmp/site] && export PYTHONPATH=/tmp/site:.
# (PYTHONPATH entries precede site-packages, so Triton 3.7.1 shadows the image's 3.6 for that process only.)
set -euo pipefail
SRC=${SRC:-.whl}; DEST=${1:-/tmp/site}
(cd "$SRC" && sha256sum -c --quiet SHA256SUMS)
mkdir -p "$DEST"
tar xJf "$SRC/triton_rest.tar.xz" -C "$DEST"
xz -dc "$SRC/libtriton.stripped.so.xz" > "$DEST/triton/_C/libtriton.so"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$DEST" \
  "$SRC"/fla_core-0.6.0-*.whl "$SRC"/flash_linear_attention-0.6.0-*.whl
PYTHONPATH="$DEST" python3 -c "import triton, fla; print('triton', triton.__version__, 'fla', fla.__version__)"
