#!/usr/bin/env bash
# Build, on a machine with PyPI, the carry folder .whl-demo/ that h200_issue14.sh's prepare phases install on the GPU
# machine (it has no `datasets`): datasets and its pure-Python deps as wheels, pandas 2.2, and pyarrow 24 repacked
# to fit one 64 MiB carry beside .whl-pydantic (Arrow Flight, headers and tests dropped, libraries
# stripped, one tar.xz: ~21 MB instead of the 49 MB wheel), plus huggingface_hub 1.33 in hub/ for an image whose own
# is older than datasets needs. Run from the repo root:  bash benchmarks/pack_datasets.sh
set -euo pipefail
ROOT=$(pwd); W=$(mktemp -d); OUTD=$ROOT/.whl-demo
grep -qx '/.whl-demo/' .git/info/exclude 2>/dev/null || echo '/.whl-demo/' >> .git/info/exclude
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
mkdir -p "$OUTD/hub"
python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$OUTD" datasets==5.2.0 dill multiprocess xxhash \
  fsspec==2026.9.0 "pandas==2.2.*" pytz tzdata python-dateutil six
python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$OUTD/hub" huggingface_hub==1.33.0
python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$W" pyarrow==24.0.0
(cd "$W" && unzip -q pyarrow-24.0.0-*.whl && rm -rf pyarrow/include pyarrow/tests pyarrow/src \
  pyarrow/libarrow_flight.so* pyarrow/_flight*.so pyarrow/libarrow_python_flight.so* pyarrow/_pyarrow_cpp_tests*.so \
  && strip --strip-unneeded pyarrow/*.so* && tar cf - pyarrow pyarrow-24.0.0.dist-info | xz -6 -T0 > "$OUTD/pyarrow.tar.xz")
du -sh "$OUTD"; rm -rf "$W"
