#!/usr/bin/env bash
# Build, on a machine with PyPI, the carry folder .whl/ that install_kernels.sh installs on the GPU machine:
# Triton 3.7.1 (fla needs >= 3.7.1 on Hopper; the image has 3.6) repacked to fit one 64 MiB carry, plus
# flash-linear-attention / fla-core 0.6.0 (pure Python + Triton).
#   Repack: libtriton.so stripped of symbols (462 -> 180 MB) and xz-compressed on its own; the rest of the wheel
#   minus what a training run never loads (Blackwell ptxas, CUPTI/proton profiler libraries, instrumentation
#   test lib, nvdisasm) as one tar.xz. Result: about 45 MB instead of the 189 MiB wheel.
# Run from the repo root:  bash benchmarks/pack_kernels.sh   (needs pip, unzip, strip, xz; takes ~10 min of xz)
set -euo pipefail
ROOT=$(pwd); W=$(mktemp -d); OUTD=$ROOT/.whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  -d "$W" triton==3.7.1 fla-core==0.6.0 flash-linear-attention==0.6.0
mkdir -p "$OUTD" "$W/tri"
(cd "$W/tri" && unzip -q "$W"/triton-3.7.1-*.whl -x 'triton/_C/libtriton.so' \
  'triton/backends/nvidia/bin/ptxas-blackwell' 'triton/backends/nvidia/lib/cupti/*' 'triton/_C/libproton.so' \
  'triton/instrumentation/*' 'triton/backends/nvidia/bin/nvdisasm' \
  && tar cf - triton triton-3.7.1.dist-info | xz -9 -T0 > "$OUTD/triton_rest.tar.xz")
unzip -p "$W"/triton-3.7.1-*.whl triton/_C/libtriton.so > "$W/libtriton.so"
strip --strip-unneeded "$W/libtriton.so"
xz -9e -T0 -c "$W/libtriton.so" > "$OUTD/libtriton.stripped.so.xz"
cp "$W"/fla_core-0.6.0-*.whl "$W"/flash_linear_attention-0.6.0-*.whl "$OUTD/"
(cd "$OUTD" && sha256sum triton_rest.tar.xz libtriton.stripped.so.xz fla_core-*.whl flash_linear_attention-*.whl > SHA256SUMS)
du -sh "$OUTD"; rm -rf "$W"
