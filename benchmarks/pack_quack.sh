#!/usr/bin/env bash
# Build, on a machine with PyPI, the two carry folders that put quack-kernels 0.6.5 (CuTe-DSL GEMMs with Python
# epilogues) and nvidia-cutlass-dsl 4.8.1 (cu13) on the GPU machine for benchmarks/quack_gemm.py. The DSL's MLIR
# library alone is 193 MB (92 MB as its wheel), over one call's 64 MiB carry, so it travels xz-compressed in a call
# of its own (.whl-quack1, kept in /tmp on the warm machine), and everything else in the next (.whl-quack2).
#   bash benchmarks/pack_quack.sh                           # here, from the repo root (~10 min of xz)
#   device call 1 (carry .whl-quack1): mkdir -p /tmp/quack && cp .whl-quack1/* /tmp/quack/
#   device call 2 (carry .whl-quack2 ...): bash benchmarks/h200_issue14.sh quack24
# The image's cuda-bindings, protobuf and einops serve; the aarch64/QNX stubs are left out.
set -euo pipefail
ROOT=$(pwd); W=$(mktemp -d)
for d in .whl-quack1 .whl-quack2; do grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude; done
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 -d "$W/w" \
  quack-kernels==0.6.5 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
  nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 'apache-tvm-ffi>=0.1.6,<0.2' \
  torch-c-dlpack-ext
mkdir -p "$W/site" "$ROOT/.whl-quack1" "$ROOT/.whl-quack2"
for whl in "$W"/w/*.whl; do (cd "$W/site" && unzip -o -q "$whl"); done
IR=nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cu13.cpython-312-x86_64-linux-gnu.so
xz -9 -T0 -c "$W/site/$IR" > "$ROOT/.whl-quack1/cutlass_ir.so.xz"
echo "$IR" > "$ROOT/.whl-quack1/PATH"
rm -rf "$W/site/$IR" "$W/site/nvidia_cutlass_dsl/cu13/lib/stubs"
(cd "$W/site" && tar cf - . | xz -9 -T0 > "$ROOT/.whl-quack2/site.tar.xz")
du -sh "$ROOT/.whl-quack1" "$ROOT/.whl-quack2"; rm -rf "$W"
