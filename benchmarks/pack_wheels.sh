#!/usr/bin/env bash
# Build, on a machine with PyPI, the one carry folder .whl/ (<= 64 MiB) that benchmarks/gpu.sh installs on the GPU
# machine (no package index there; its image has torch, transformers, peft, pluggy, typer, accelerate, PIL, pyarrow):
#   - Triton 3.7.1 (fla refuses Triton < 3.7.1 on Hopper; the image has 3.6), repacked: libtriton.so stripped of
#     symbols and xz-compressed on its own, the rest of the wheel minus what a training run never loads (Blackwell
#     ptxas, CUPTI/proton profiler libraries, instrumentation, nvdisasm) as one tar.xz: ~45 MB, not 189 MiB;
#   - flash-linear-attention / fla-core 0.6.0 (pure Python + Triton), liger-kernel (fused norms, SwiGLU, RoPE and
#     linear cross-entropy), pydantic + pydantic-core (stitch's recipe), datasets and the pure-Python part of its
#     stack (stitch prepare; the image's pyarrow and pandas serve it), as wheels.
# Run from the repo root:  bash benchmarks/pack_wheels.sh   (needs pip, unzip, strip, xz; ~10 min of xz)
set -euo pipefail
ROOT=$(pwd); W=$(mktemp -d); OUTD=$ROOT/.whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$W" triton==3.7.1
mkdir -p "$OUTD" "$W/tri"
python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$OUTD" fla-core==0.6.0 flash-linear-attention==0.6.0 \
  liger-kernel pydantic pydantic-core annotated-types typing-inspection \
  datasets dill multiprocess fsspec xxhash
(cd "$W/tri" && unzip -q "$W"/triton-3.7.1-*.whl -x 'triton/_C/libtriton.so' \
  'triton/backends/nvidia/bin/ptxas-blackwell' 'triton/backends/nvidia/lib/cupti/*' 'triton/_C/libproton.so' \
  'triton/instrumentation/*' 'triton/backends/nvidia/bin/nvdisasm' \
  && tar cf - triton triton-3.7.1.dist-info | xz -9 -T0 > "$OUTD/triton_rest.tar.xz")
unzip -p "$W"/triton-3.7.1-*.whl triton/_C/libtriton.so > "$W/libtriton.so"
strip --strip-unneeded "$W/libtriton.so"
xz -9e -T0 -c "$W/libtriton.so" > "$OUTD/libtriton.stripped.so.xz"
(cd "$OUTD" && sha256sum triton_rest.tar.xz libtriton.stripped.so.xz ./*.whl > SHA256SUMS)
du -sh "$OUTD"; rm -rf "$W"
