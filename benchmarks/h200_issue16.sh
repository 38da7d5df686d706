#!/usr/bin/env bash
# The H200 runs of issue 16 (the MoE pair at size), one device call per model, each under the 10-minute limit.
# Carry .whl-liger, .whl-pydantic, .whl (Triton 3.7.1 + fla, from pack_kernels.sh) and dist (the nemo-automodel
# 0.7.0 wheel, installed --no-deps: its declared deps are not needed by the modules stitch imports). Setup is
# idempotent, so a warm machine skips it:
#   bash benchmarks/h200_issue16.sh setup       # liger + pydantic + plugin metadata, fla, AutoModel
#   bash benchmarks/h200_issue16.sh qwen36      # Qwen3.6-35B-A3B: snapshot (65 GiB, GPU-initialised), then
#                                               # transformers and AutoModel backends one after the other
#   bash benchmarks/h200_issue16.sh lightning   # Nemotron-3.5-Lightning-30B-A3B on transformers (AutoModel's
#                                               # Nemotron-H needs mamba_ssm, which the image lacks: refused, recorded)
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ ! -d /tmp/site/liger_kernel ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-liger/*.whl .whl-pydantic/*.whl
fi
bash benchmarks/device_site.sh /tmp/site >/dev/null
[ -d /tmp/fla/fla ] || bash benchmarks/install_kernels.sh /tmp/fla
[ -d /tmp/am/nemo_automodel ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/am \
  dist/nemo_automodel-0.7.0-py3-none-any.whl
export PYTHONPATH=/tmp/site:/tmp/fla:/tmp/am:.
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader; df -h / /dev/shm | tail -2
case "${1:-setup}" in
  setup)  # installs only (the GPU tests of the AutoModel backend run in h200_issue14.sh round3)
    ;;
  qwen36)
    timeout 585 python3 benchmarks/real_size.py --models qwen3.6-35b-a3b --backends transformers,automodel \
      --snapshots /tmp/snap --spill-dir /dev/shm/snap --disk-budget-gib 34 --out "$OUT" 2>&1 \
      | tee "$OUT/qwen36.log" | grep -v "^USDT" | tail -25
    ;;
  lightning)
    timeout 585 python3 benchmarks/real_size.py --models nemotron-3.5-lightning-30b-a3b \
      --backends transformers --snapshots /tmp/snap --spill-dir /dev/shm/snap --disk-budget-gib 30 \
      --out "$OUT" 2>&1 | tee "$OUT/lightning.log" | grep -v "^USDT" | tail -25
    ;;
esac
ls -la "$OUT"
