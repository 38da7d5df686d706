#!/usr/bin/env bash
# One GPU call: install the carried .whl/ and .whl-data/ (benchmarks/pack_wheels.sh) into /tmp/site, register the checkout's
# plugins there (their dist-info, generated from pyproject.toml, so the plugin host finds them as installed wheels),
# then run benchmarks/bench.py for each SUITE into $OUT (default /tmp/out) and copy RESULTS.md beside the JSONs.
#   STITCH_BENCH_COMMIT=<git rev-parse HEAD here> bash benchmarks/gpu.sh sft grpo   # device call, carry [".whl"]
#   STITCH_BENCH_COMMIT=... bash benchmarks/gpu.sh prepare -- --images 16384          # bench.py options after --
#   bash benchmarks/gpu.sh tests [-- tests/rollout]   # `pytest -m gpu`, one file at a time (TEST_TIMEOUT s each), JUnit XML
# The device copy's git metadata is stale, so the JSONs take their commit from STITCH_BENCH_COMMIT (passed through).
# Setup is idempotent: a warm machine skips the installs. Each suite gets SUITE_TIMEOUT seconds (default 570).
# STITCH_CALL_ENDS (epoch seconds; `export STITCH_CALL_ENDS=$(( $(date +%s) + 570 ))` once at the call's start) caps
# every suite and test file at the call's time left minus PACK_RESERVE (default 40 s), and skips those for which under
# 30 s would be left, so a call cut off by its limit still packs the test logs and Triton's cache.
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} SITE=${SITE:-/tmp/site}
export STITCH_BENCH_COMMIT=${STITCH_BENCH_COMMIT:-}
[ -n "$STITCH_BENCH_COMMIT" ] || echo "warning: STITCH_BENCH_COMMIT is unset: the JSONs record this copy's git HEAD" >&2
mkdir -p "$OUT" "$SITE"
suites=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do suites+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
for suite in "${suites[@]}"; do  # the committed figures go along: models.json keeps the models this call does not run;
  # a JSON an earlier gpu.sh of the same call wrote stays, so `gpu.sh models -- --models A; gpu.sh models -- --models
  # B --train-lm full` fills one models.json (and each log gets both runs)
  [ -f "$OUT/$suite.json" ] || [ ! -f "benchmarks/results/$suite.json" ] || cp "benchmarks/results/$suite.json" "$OUT/"
done
for carry in .whl .whl-data; do  # each carried folder once per machine (a warm machine keeps /tmp/site)
  [ -d "$carry" ] && [ ! -f "$SITE/.installed$carry" ] || continue
  (cd "$carry" && sha256sum -c --quiet SHA256SUMS) || exit 1
  if [ -f "$carry/triton_rest.tar.xz" ]; then  # a carry without Triton keeps the image's (fla then stays off)
    tar xJf "$carry/triton_rest.tar.xz" -C "$SITE"
    xz -dc "$carry/libtriton.stripped.so.xz" > "$SITE/triton/_C/libtriton.so"
  fi
  [ -f "$carry/pyarrow.tar.xz" ] && tar xJf "$carry/pyarrow.tar.xz" -C "$SITE"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$carry"/*.whl \
    && touch "$SITE/.installed$carry"
done
python3 - "$SITE" <<'PY'
import pathlib, sys, tomllib
dest = pathlib.Path(sys.argv[1])
for pyproject in [pathlib.Path("pyproject.toml"), *sorted(pathlib.Path("plugins").glob("*/pyproject.toml"))]:
    project = tomllib.loads(pyproject.read_text())["project"]
    name, version = project["name"], project.get("version", "0.0.0")
    info = dest / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    groups = project.get("entry-points", {})
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n" for group, eps in groups.items()))
PY
export PYTHONPATH=$SITE:.
# Triton's cache from earlier calls, when carried (.whl/triton_cache.tar.xz): fla's autotuning results and the
# compiled kernels (metadata JSON + cubin, no IR text), since a fresh machine otherwise spends minutes compiling and
# tuning the same kernels. H100 and H200 share the sm_90 entries. A group file names its members by absolute path,
# so the paths are pointed at this machine's cache; a missing member makes Triton compile that kernel again.
# This call's cache (the carried entries plus its new ones) comes back as $OUT/triton_cache.tar.xz: copy it over
# .whl's for the next call. Unpacked once per machine, like the wheels: a warm machine's cache already holds it.
export TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
mkdir -p "$TRITON_CACHE_DIR"
if [ -f .whl/triton_cache.tar.xz ] && [ ! -f "$SITE/.installed-triton-cache" ]; then
  tar xJf .whl/triton_cache.tar.xz -C "$TRITON_CACHE_DIR" \
    && python3 - "$TRITON_CACHE_DIR" <<'PY' && touch "$SITE/.installed-triton-cache"
import json, pathlib, sys
for group in pathlib.Path(sys.argv[1]).glob("*/__grp__*.json"):
    data = json.loads(group.read_text())
    data["child_paths"] = {name: str(group.parent / pathlib.Path(path).name)
                           for name, path in data.get("child_paths", {}).items()}
    group.write_text(json.dumps(data))
PY
fi
python3 -c "import importlib.util as u, torch, triton; print('triton', triton.__version__, 'fla', bool(u.find_spec('fla')), torch.cuda.get_device_name())"
within() {  # within WHAT SECONDS: SECONDS, or fewer when the call ends sooner (STITCH_CALL_ENDS); under 30 s it
  # says WHAT is not run and fails
  local cap=$2 reserve=${PACK_RESERVE:-40}
  if [ -n "${STITCH_CALL_ENDS:-}" ]; then
    local left=$((STITCH_CALL_ENDS - $(date +%s) - reserve))
    [ "$left" -lt "$cap" ] && cap=$left
  fi
  if [ "$cap" -lt 30 ]; then
    echo "$1: not run, the call ends in $((cap + reserve)) s" >&2
    return 1
  fi
  echo "$cap"
}
gpu_tests() {  # the GPU tests (`-m gpu`, tests/conftest.py), one file at a time: a slow file (fla autotuning from
  # cold) is cut off at TEST_TIMEOUT seconds and the others still run; each file's JUnit XML and log go to
  # $OUT/tests.tar.xz (one file: a device call brings back at most eight)
  mkdir -p "$OUT/tests"
  local files file name status=0
  if ! python3 -m pytest -m gpu --collect-only -q -p no:cacheprovider "${@:-tests}" > "$OUT/tests/collect.log" 2>&1; then
    tail -20 "$OUT/tests/collect.log"; return 1  # an import error, or no GPU test under the paths given
  fi
  files=$(grep "::" "$OUT/tests/collect.log" | cut -d: -f1 | sort -u)
  for file in $files; do
    name=$(basename "$file" .py)
    local limit
    limit=$(within "$file" "${TEST_TIMEOUT:-150}") || { status=1; continue; }
    timeout "$limit" python3 -m pytest -m gpu -v -rs --tb=short -p no:cacheprovider \
      --junitxml="$OUT/tests/$name.xml" "$file" > "$OUT/tests/$name.log" 2>&1
    local code=$?
    [ $code -eq 124 ] && echo "$file: cut off after $limit s"
    grep -E " (PASSED|FAILED|ERROR|SKIPPED)" "$OUT/tests/$name.log" | sed 's/ \[ *[0-9]*%\]$//'
    [ $code -eq 0 ] || status=1
  done
  tar cJf "$OUT/tests.tar.xz" -C "$OUT" tests && rm -rf "$OUT/tests"
  return $status
}
rc=0
for suite in "${suites[@]}"; do
  echo "== $suite"
  if [ "$suite" = tests ]; then
    gpu_tests "$@" || rc=1
    continue
  fi
  limit=$(within "$suite" "${SUITE_TIMEOUT:-570}") || { rc=1; continue; }
  run=(python3 benchmarks/bench.py "$suite" --shape "${SHAPE:-dense4b}" --out "$OUT" "$@")
  timeout "$limit" "${run[@]}" 2>&1 | tee -a "$OUT/$suite.log" | grep -v "it/s]$" | tail -40
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
done
triton_cache() {  # $OUT/triton_cache.tar.xz: the cache files whose paths match $1 (find -regex); IR text,
  # sources and locks stay behind
  (cd "$TRITON_CACHE_DIR" && find . -type f -regex "$1" | XZ_OPT=-T0 tar cJf "$OUT/triton_cache.tar.xz" -T -)
}
triton_cache '.*\.\(json\|cubin\|so\)'
if [ "$(stat -c %s "$OUT/triton_cache.tar.xz")" -gt $((15 * 2**20)) ]; then  # a file comes back up to 16 MiB
  echo "triton_cache.tar.xz is over 15 MiB with the kernels: it keeps the autotuning results only"
  triton_cache '.*\.autotune\.json'
fi
ls -la "$OUT"
exit $rc
