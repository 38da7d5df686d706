#!/usr/bin/env bash
# The H200 runs of issue 14, one device call per phase (each well under the 10-minute command limit):
#   bash benchmarks/h200_issue14.sh dense     # GPU tests, GRPO rollout engines, dense SFT with a profile
#   bash benchmarks/h200_issue14.sh hybrids   # Qwen3.5-4B and Nemotron-Nano-4B shapes with fla, four modes each
#   bash benchmarks/h200_issue14.sh round2    # the second call: GPU tests, GRPO, dense SFT, then Qwen3.5-4B with fla
#   bash benchmarks/h200_issue14.sh round3    # GPU tests, GRPO (grouped decode, merged LoRA) + rollout profile,
#                                             # and the shipped stitch prepare on 16k JPEGs (prepare_stitch.py)
#   bash benchmarks/h200_issue14.sh shapes    # dense 4B and both hybrids (fla) in ONE process, five modes each
#   bash benchmarks/h200_issue14.sh nemotron  # the fla sync test (+ mutation), Nemotron packed/baseline/stock
#   bash benchmarks/h200_issue14.sh round4    # fla sync test (+ its mutation), the three shapes, 10 timed steps a mode
#   bash benchmarks/h200_issue14.sh prepare   # stitch prepare on 16k JPEGs, then encoder variants (no compile)
#   bash benchmarks/h200_issue14.sh automodel # Qwen3.5-4B shape: NeMo AutoModel's class vs stitch packed vs stock
#   bash benchmarks/h200_issue14.sh round5    # encoder variants; dense 4B + Nemotron 4B in one process; fla sync test
#   bash benchmarks/h200_issue14.sh round5b   # fla sync test; Nemotron 4B packed/baseline/stock; stitch prepare
#   bash benchmarks/h200_issue14.sh round5c   # Nemotron 4B packed + its padded baseline, 4 timed steps
#   bash benchmarks/h200_issue14.sh round6    # unrun GPU tests; dense 4B + Qwen3.5-4B in one process, four modes
#   bash benchmarks/h200_issue14.sh round6b   # the fla sync test (long timeout), AutoModel vs stitch, Qwen3.5 test
#   bash benchmarks/h200_issue14.sh round6c   # dense 4B's four modes in one process; Qwen3.5-4B packed profiled
#   bash benchmarks/h200_issue14.sh round7    # Qwen3.5-4B's fla Gated DeltaNet path: GPU parity, five modes, dense
#   bash benchmarks/h200_issue14.sh round7b   # the same, parity differences printed, four modes, no parity run
#   bash benchmarks/h200_issue14.sh round8    # the 4B Gated DeltaNet gradient test alone, then both paths timed
#   bash benchmarks/h200_issue14.sh round8b   # dense 4B and Qwen3.5-4B, packed and baseline, in one process
#   bash benchmarks/h200_issue14.sh round8c   # dense 4B packed + stock, Qwen3.5-4B packed, each profiled: kernels
#   bash benchmarks/h200_issue14.sh round9    # Nemotron-Nano-4B's four modes in ONE process, then dense 4B's in it
#   bash benchmarks/h200_issue14.sh round10   # every LoRA GEMM shape timed (lora_gemm_shapes.py), then Qwen3.5-4B
#                                             # packed profiled with its GEMMs by input shape
#   bash benchmarks/h200_issue14.sh prepare10 # stitch prepare (torch's uint8 resize in the workers) on 16k and 64k
#                                             # JPEGs, then encode only, eager and compiled; carry .whl-demo and
#                                             # .whl-pydantic only (pyarrow repacked: benchmarks/pack_datasets.sh)
#   bash benchmarks/h200_issue14.sh prepare10b # prepare10 again with 64-row worker tasks, after one untimed warm-up run
#                                             # (prepare10's first run paid the fresh machine's cold start)
#   bash benchmarks/h200_issue14.sh round10c  # liger's head in CHUNK_TOKENS-row chunks: its GPU tests, then dense 4B
#                                             # and Qwen3.5-4B in one process: packed, packed_liger_chunks,
#                                             # packed_ungrouped, stock
#   bash benchmarks/h200_issue14.sh round10b  # SharedInputLoRA's GPU test; the LoRA GEMM shapes (with the grouped
#                                             # Gated DeltaNet inputs); Qwen3.5-4B + dense 4B packed vs
#                                             # packed_ungrouped in one process, each profiled
#   bash benchmarks/h200_issue14.sh round11   # where the host's time goes: dense 4B and Qwen3.5-4B packed, each with a
#                                             # device profile (1 step) and a cProfile of 3 steps (--host-profile)
#   bash benchmarks/h200_issue14.sh prepare11 # the encoder's side-stream copies: their GPU test, stitch prepare on 16k
#                                             # JPEGs with and without them and on 64k, then encode only (eager and
#                                             # compiled, each with and without, then max-autotune); carry .whl-demo,
#                                             # .whl-pydantic, .whl-liger
#   bash benchmarks/h200_issue14.sh prepare11b # prepare11 with every host batch copied on the side stream (1,024-image
#                                             # chunks): the GPU test and its mutation (no wait for the copy), stitch
#                                             # prepare on 16k JPEGs serial / shipped / serial / shipped, encode only
#   bash benchmarks/h200_issue14.sh round11b  # dense 4B and Qwen3.5-4B packed + stock in one process, 16 timed steps
#   bash benchmarks/h200_issue14.sh prepare11c # the main process's per-row work cut (the stream read 256 rows at a
#                                             # time, manifest lines with their shared fields serialised once): 64k
#                                             # JPEGs with .bench-old/prepare.py (the previous prepare: `git show
#                                             # bd7cd93:stitch/data/prepare.py > .bench-old/prepare.py`, untracked) and
#                                             # the new one, alternating, then the new one under py-spy --gil; carry
#                                             # .whl-demo, .whl-pydantic, .whl-pyspy
#   bash benchmarks/h200_issue14.sh prepare12 # encode only: uint8 normalised inside the compiled tower, chunks written
#                                             # in place, against .bench-old/encoder.py (`git show 47f4025:stitch_clip/
#                                             # encoder.py`, untracked) in the same process; sdpa's backends, eager
#                                             # attention, CUDA graphs, 2,048-image chunks; each variant profiled; carry
#                                             # .whl-demo, .whl-pydantic
#   bash benchmarks/h200_issue14.sh prepare12b # prepare12's sdpa variants again, each traced afresh (prepare12 reused
#                                             # one graph for all: dynamo does not guard on sdpa's backend switches),
#                                             # q/k/v as one GEMM; then stitch prepare on 65,536 JPEGs with the
#                                             # workers' shared slots and without (--no-slots), alternating
#   bash benchmarks/h200_issue14.sh prepare12c # sdpa's flash and efficient kernels against cuDNN's, eager and compiled
#                                             # (compiled ones with inductor's graph caches off: prepare12b's still
#                                             # reused one compiled graph); stitch prepare on 16,384 JPEGs twice
#   bash benchmarks/h200_issue14.sh prepare12d # prepare12c's encode part alone (its run stopped on a benchmark bug)
#   bash benchmarks/h200_issue14.sh prepare12e # the final code: the side-stream GPU test and its mutation, encode only
#                                             # against .bench-old/encoder.py (eager and compiled), stitch prepare on
#                                             # 65,536 JPEGs once
#   bash benchmarks/h200_issue14.sh prepare13 # round 13's code: the GPU test and its mutation, compiled encode against
#                                             # stock, stitch prepare on 16,384 and 65,536 JPEGs; carry .whl-demo,
#                                             # .whl-pydantic
#   bash benchmarks/h200_issue14.sh prepare14 # nvjpeg decode on the GPU: its GPU test and a mutation, then stitch prepare
#                                             # on 16,384 JPEGs (decode device / cpu, twice) and 65,536 (each once); carry
#                                             # .whl-demo, .whl-pydantic
#   bash benchmarks/h200_issue14.sh prepare14b # the GPU tests; stitch prepare on 16,384 JPEGs with 3 and 7 decode workers,
#                                             # decode device / cpu; the device path under cProfile
#   bash benchmarks/h200_issue14.sh gputests14 # the final code's GPU tests (nvjpeg decode, side stream)
#   bash benchmarks/h200_issue14.sh prepare15  # the encode thread and path hand-over against 2b80d5b, one host:
#                                             # 16k at 15 and 3 workers, 64k; carry .whl-demo .whl-pydantic
#   bash benchmarks/h200_issue14.sh prepare15b # the encode thread's split and shard timeline, new code only
#   bash benchmarks/h200_issue14.sh prepare15c # the device preprocessing's warm-up against a0a4351, one host
#   bash benchmarks/h200_issue14.sh prepare15d # 2b80d5b, a0a4351 and the final code at 64k and 16k, device decode
#   bash benchmarks/h200_issue14.sh prepare16  # the decoder's set-up beside the encoder's loader, against r15
#   bash benchmarks/h200_issue14.sh prepare16b # the same, with each thread's CPU seconds (--thread-cpu)
#   bash benchmarks/h200_issue14.sh inputs17   # device_batch taken apart (device_inputs_check.py); 16k prepare with
#                                             # the default switch interval against 0.5 ms, alternating
#   bash benchmarks/h200_issue14.sh inputs17b  # device_batch taken apart again, its first calls after each warm-up,
#                                             # and 16k prepare: r16 against this round's code (gc frozen), with gc's
#                                             # pauses
#   bash benchmarks/h200_issue14.sh inputs17c  # 16k prepare, r16 against this round's final code; the first
#                                             # device_batch under cProfile; device_batch taken apart
#   bash benchmarks/h200_issue14.sh gc18       # who starts the full collections; 16k twice, 64k once; explicit collects
#   bash benchmarks/h200_issue14.sh weights18  # closed-form resize weights, 3.12's parked objects: GPU tests, cold and
#                                             # warm device_batch against r16, 16k against r16, 64k
#   bash benchmarks/h200_issue14.sh final18    # round 18's final code against r16 at 16k (4 runs to 2), 64k once
#   bash benchmarks/h200_issue14.sh gil18      # who holds the interpreter lock in a 16k run (py-spy; carry .whl-pyspy)
#   bash benchmarks/h200_issue14.sh thread18   # the decoder's warm-up on the encode thread against its own thread, 16k
#   bash benchmarks/h200_issue14.sh slots19    # JPEG bytes in the workers' shared slots against paths read again: GPU
#                                             # tests, device_batch on slot views, 16k alternating (3 + 3), 64k each
#   bash benchmarks/h200_issue14.sh slots19b   # slots19's 16k pairs again, paths first in each pair
#   bash benchmarks/h200_issue14.sh hybrids19  # Nemotron-Nano-4B packed / baseline / stock in one process; then dense
#                                             # 4B and Qwen3.5-4B packed and stock (carry .whl .whl-liger .whl-pydantic)
#   bash benchmarks/h200_issue14.sh hybrids19b # dense 4B and Qwen3.5-4B packed and stock in one process (same carry)
#   bash benchmarks/h200_issue14.sh dense19    # dense 4B packed, baseline, llava, stock in one process (carry .whl-liger
#                                             # .whl-pydantic)
#   bash benchmarks/h200_issue14.sh writer20   # shard files hashed from memory as written, two writer threads, against
#                                             # round 19's writer (carry .whl-demo .whl-pydantic .bench-old)
#   bash benchmarks/h200_issue14.sh hybrids20  # Qwen3.5-4B and dense 4B, packed and padded baseline, in one process
#   bash benchmarks/h200_issue14.sh hybrids20b # Nemotron-Nano-4B and dense 4B packed in one process (carry .whl
#                                             # .whl-liger .whl-pydantic)
#   bash benchmarks/h200_issue14.sh graphs21   # MLP blocks as CUDA graphs: GPU tests + a mutation, dense 4B packed /
#                                             # packed_eager / baseline in one process (carry .whl-liger .whl-pydantic)
#   bash benchmarks/h200_issue14.sh graphs21b  # the same three modes for dense 4B and Qwen3.5-4B in one process (carry
#                                             # .whl .whl-liger .whl-pydantic)
#   bash benchmarks/h200_issue14.sh graphs21c  # graphs21 after the capture fix (carry .whl-liger .whl-pydantic)
#   bash benchmarks/h200_issue14.sh graphs21d  # Qwen3.5-4B packed / packed_eager / baseline in one process (carry .whl
#                                             # .whl-liger .whl-pydantic)
#   bash benchmarks/h200_issue14.sh graphs22   # shared gradient-in buffers, backward outputs copied out: GPU tests, then
#                                             # dense 4B packed / packed_eager / baseline / llava / stock in one process
#                                             # (carry .whl-liger .whl-pydantic)
#   bash benchmarks/h200_issue14.sh graphs22q  # Qwen3.5-4B and dense 4B packed and padded baseline in one process; the
#                                             # autotuning results come back as triton_autotune.tar.xz (carry .whl
#                                             # .whl-liger .whl-pydantic)
#   bash benchmarks/h200_issue14.sh graphs22n  # Nemotron-Nano-4B and dense 4B packed and padded baseline (same carry)
#   bash benchmarks/h200_issue14.sh encode23   # stitch_vit (the tower's attention as a Triton kernel): its GPU tests and a
#                                             # mutation, the attention alone against sdpa's kernels, encode only
#                                             # against the sdpa tower in one process, twice (carry .whl-pydantic)
#   bash benchmarks/h200_issue14.sh encode23b  # two compute streams, one q/k/v GEMM, CUDA graphs, with stitch_vit;
#                                             # power and clocks (carry .whl-pydantic)
#   bash benchmarks/h200_issue14.sh autotune23 # Qwen3.5-4B's first packed step on a fresh machine with the carried
#                                             # autotuning results (carry .whl .whl-liger .whl-pydantic)
#   bash benchmarks/h200_issue14.sh gputests23 # every GPU test of the suite at the round's code, fla from .whl (carry
#                                             # .whl .whl-liger .whl-pydantic)
#   bash benchmarks/h200_issue14.sh encode24   # CLIP's MLP in row chunks whose intermediate stays in L2: one MLP alone
#                                             # (mlp_l2.py), then the tower so against the shipped one and small image
#                                             # chunks, in one process, twice (carry .whl-pydantic)
#   bash benchmarks/h200_issue14.sh quack24    # quack's CuTe-DSL GEMMs with CLIP's bias/GELU/residual in the epilogue
#                                             # against cuBLAS and the compiled tower's kernels (quack_gemm.py; carry
#                                             # .whl-quack2 .whl-pydantic after a call that kept .whl-quack1 in
#                                             # /tmp/quack: pack_quack.sh)
#   bash benchmarks/h200_issue14.sh encode24b  # the shipped tower with quack's fused fc1 + GELU: GPU tests and a
#                                             # mutation, encode against the unfused tower in one process, twice (carry
#                                             # .whl-quack2 .whl-pydantic after a call that kept .whl-quack1)
#   bash benchmarks/h200_issue14.sh final24    # round 24's final code with quack: the GPU tests and a mutation, stitch
#                                             # prepare on 16k and 64k JPEGs, encode against the unfused tower (carry
#                                             # .whl-quack2 .whl-pydantic after calls that kept .whl-quack1 in /tmp/quack
#                                             # and .whl-demo in /tmp/whl-demo)
#   bash benchmarks/h200_issue14.sh grpo25     # GRPO's step on the shipped code: the rollout GPU tests and a mutation,
#                                             # the breakdown with stitch's engine and generate in one process (carry
#                                             # .whl-liger .whl-pydantic)
#   bash benchmarks/h200_issue14.sh final25    # the fused MLP's GPU tests at the final code and the rollout's, each with
#                                             # a mutation; GRPO with the chunked log-prob head against full logits,
#                                             # both profiled (carry
#                                             # .whl-quack2 .whl-pydantic .whl-liger after a call that kept .whl-quack1
#                                             # in /tmp/quack)
#   bash benchmarks/h200_issue14.sh grpo25b    # the final code: GRPO with the chunked log-prob head and with full
#                                             # logits in one process (carry .whl-liger .whl-pydantic)
#   bash benchmarks/h200_issue14.sh final25c   # after the review: dense 4B SFT's packed / baseline / llava / stock in
#                                             # one process, then GRPO (carry .whl-liger .whl-pydantic)
#   bash benchmarks/h200_issue14.sh loader15   # prepare's encoder loader thread, step by step (--loader-breakdown)
# Carry .whl-liger and .whl-pydantic (and .whl for hybrids, from pack_kernels.sh; dist for automodel, the
# nemo-automodel wheel); results and logs go to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl-liger/*.whl 2>/dev/null) \
  .whl-pydantic/*.whl
bash benchmarks/device_site.sh /tmp/site >/dev/null
export PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
# pack_datasets.sh's carry (.whl-demo): datasets, the repacked pyarrow, and huggingface_hub where the image's is older
# than datasets needs
install_datasets() {
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-demo/*.whl
  tar xJf .whl-demo/pyarrow.tar.xz -C /tmp/site
  python3 -c "import huggingface_hub as h, sys; sys.exit(tuple(map(int, h.__version__.split('.')[:2])) < (1, 31))" \
    || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-demo/hub/*.whl
}
# prepare.py + encoder.py of a variant (round 15): new (the checkout's own, kept in /tmp/new at the first call), old
# (2b80d5b) or a0 (a0a4351), the last two from their copies in .bench-old/
use_code() {
  [ -d /tmp/new ] || { mkdir -p /tmp/new && cp stitch/data/prepare.py stitch_clip/encoder.py /tmp/new/; }
  local from=/tmp/new/prepare.py enc=/tmp/new/encoder.py
  case $1 in
    old) from=.bench-old/prepare_2b80d5b.py enc=.bench-old/encoder_2b80d5b.py ;;
    a0) from=.bench-old/prepare_a0a4351.py enc=.bench-old/encoder_a0a4351.py ;;
    r15) from=.bench-old/prepare_966957e.py enc=.bench-old/encoder_966957e.py ;;
    r16) from=.bench-old/prepare_8debdc7.py enc=.bench-old/encoder_8debdc7.py ;;
    c17) from=.bench-old/prepare_9db2650.py enc=.bench-old/encoder_06bb0e9.py ;;
    c18) from=.bench-old/prepare_64bfcfd.py ;;  # 64bfcfd: the decoder's warm-up in a thread of its own (thread18)
  esac
  cp "$from" stitch/data/prepare.py; cp "$enc" stitch_clip/encoder.py
}
# Triton 3.7.1 + fla from the .whl carry (installed once a machine), on the path, autotuning results cached
use_fla() {
  [ -d /tmp/fla/fla ] || bash benchmarks/install_kernels.sh /tmp/fla
  export PYTHONPATH=/tmp/site:/tmp/fla:. TRITON_CACHE_AUTOTUNING=1
  # the autotuning results earlier calls brought back (save_autotune; round 22's: Qwen3.5-4B, Nemotron-Nano-4B and
  # dense 4B shapes on the H200), so a fresh machine does not spend ~190 s a shape set tuning fla's kernels again
  mkdir -p ~/.triton/cache && tar xJf benchmarks/triton_autotune_h200.tar.xz -C ~/.triton/cache
}
# the autotuning results in Triton's cache as $OUT/triton_autotune.tar.xz (merge them into
# benchmarks/triton_autotune_h200.tar.xz)
save_autotune() {
  (cd ~/.triton/cache && find . -name '*.autotune.json' | tar cJf "$OUT/triton_autotune.tar.xz" -T -)
}
# the run JSONs in folder $1 as one file, $OUT/$2.json (a call returns at most 8 files)
merge_json() {
  python3 -c "import glob, json, os, sys; json.dump({os.path.basename(p)[:-5]: json.load(open(p)) for p in \
    sorted(glob.glob(sys.argv[1] + '/*.json'))}, open(sys.argv[2], 'w'), indent=1)" "$1" "$OUT/$2.json"
}
# stitch prepare on 16,384 JPEGs (device decode, per-thread CPU) once per run "<code> <tag> [flags]" (use_code's code),
# in the order given, while SECONDS < $2, each cut at $3 seconds; a 2,048-image run warms the machine first; the
# results, prepare_stitch_$1_16384_<code>_<tag>, go to $OUT/prepare_stitch_$1.json
compare_codes() {
  local name=$1 guard=$2 limit=$3 run
  shift 3
  timeout 100 python3 benchmarks/prepare_stitch.py --images 2048 --skip-encode --name prepare_warmup --out /tmp \
    > /dev/null 2>&1
  for run in "$@"; do
    set -- $run
    use_code "$1"
    [ $SECONDS -lt "$guard" ] && timeout $((limit - SECONDS)) python3 benchmarks/prepare_stitch.py --images 16384 \
      --decode device --skip-encode --thread-cpu "${@:3}" --name "prepare_stitch_${name}_16384_$1_$2" \
      --out "/tmp/$name" 2>&1 | grep -E "^prepare|Error" | cut -c1-120
  done
  use_code new
  merge_json "/tmp/$name" "prepare_stitch_$name"
}
# GPU tests (pytest -k "$3", then the test files), then again with file $1 changed by sed expression $2 (they must
# fail); the file is restored after. Logs: gpu_tests.log, gpu_tests_mutated.log
tests_and_mutation() {
  local file=$1 edit=$2 select=$3
  shift 3
  timeout 150 python3 -m pytest -q -rs -p no:cacheprovider -k "$select" "$@" 2>&1 | tee "$OUT/gpu_tests.log" \
    | grep -E "passed|failed|Error" | cut -c1-400
  cp "$file" /tmp/mutated.keep
  sed -i "$edit" "$file"
  timeout 150 python3 -m pytest -q -p no:cacheprovider -k "$select" "$@" 2>&1 | tee "$OUT/gpu_tests_mutated.log" \
    | grep -E "passed|failed" | cut -c1-400
  cp /tmp/mutated.keep "$file"
}
# quack-kernels + nvidia-cutlass-dsl (pack_quack.sh): the DSL's MLIR library from an earlier call's /tmp/quack, the
# rest from .whl-quack2
use_quack() {
  # a folder named site-packages: quack fingerprints installed functions by name only where their file's path says so
  local q=/tmp/quack/site-packages
  mkdir -p $q && tar xJf .whl-quack2/site.tar.xz -C $q && xz -dc /tmp/quack/cutlass_ir.so.xz > "$q/$(cat /tmp/quack/PATH)" \
    || exit 1
  export PYTHONPATH=$q:$q/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
  python3 -c "import quack, cutlass; print('quack', quack.__version__, 'cutlass-dsl', cutlass.__version__)" 2>&1 | tail -3
}
# the fused MLP's GPU tests with the tower's others, then again with the bias left out of the fused epilogue (must fail)
fused_mlp_tests_and_mutation() {
  tests_and_mutation stitch_clip/gemm.py 's/quick_gelu(acc + bias)/quick_gelu(acc)/' "gpu or asked or hopper" \
    tests/test_fused_mlp.py tests/test_vit_attention.py tests/test_prepare_fast.py
}
# encode only, 2,048 images a call, in two runs while the call has time: variants $2 (run "a") then $3 (run "b",
# usually the same in reverse order); JSON prepare_stitch_$1_encode_{a,b}.json, logs encode_{a,b}.log
encode_runs() {
  local name=$1 order variants
  for order in a b; do
    variants=$2
    [ $order = b ] && variants=$3
    [ $SECONDS -lt 420 ] && timeout $((590 - SECONDS)) python3 benchmarks/prepare_stitch.py --skip-prepare \
      --batches 2048 --compile-batches 2048 --images 2048 --variants $variants --profile-encode \
      --name prepare_stitch_${name}_encode_$order --out "$OUT" 2>&1 | tee "$OUT/encode_$order.log" \
      | grep -E "^encode|Error" | cut -c1-300
  done
}
# the encoder's side-stream GPU test, then again with the tower no longer waiting for its chunk's copy (must fail)
side_stream_test_and_mutation() {
  tests_and_mutation stitch_clip/encoder.py '/compute.wait_stream(side)/d' on_a_gpu tests/test_prepare_fast.py
}
# stitch prepare (prepare only) on 16,384 JPEGs with torch's resize and PIL's, then 65,536 with torch's; results named
# prepare_stitch_<tag>_<images>_<resize>
prepare_torch_and_pil() {
  local tag=$1 run
  for run in "16384 torch" "16384 pil" "65536 torch"; do
    set -- $run
    timeout 150 python3 benchmarks/prepare_stitch.py --images "$1" --skip-encode $([ "$2" = pil ] && echo --pil-resize) \
      --name "prepare_stitch_${tag}_$1_$2" --out "$OUT" 2>&1 | tee "$OUT/prepare_$1_$2.log" | grep -v "^USDT" \
      | grep -E "^prepare|phase|Error" | cut -c1-1500
  done
}
# GPU kernel tests (pytest arguments: "$@"), then the fla sync test again with fla_scan's fix reverted (a fresh
# .long() per call), where it must fail; the checkout is restored after
fla_sync_tests() {
  timeout 200 python3 -m pytest -q -rs -p no:cacheprovider "$@" 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
  cp stitch_nemotron/kernels.py /tmp/kernels.py.keep
  sed -i 's/\*\*fla_seqlens(cu_seqlens))/cu_seqlens=None if cu_seqlens is None else cu_seqlens.long())/' \
    stitch_nemotron/kernels.py
  timeout 80 python3 -m pytest -q -p no:cacheprovider -k read_nothing_back tests/test_nemotron_kernels.py 2>&1 \
    | tee "$OUT/gpu_tests_mutated.log" | tail -2
  cp /tmp/kernels.py.keep stitch_nemotron/kernels.py
}
case "${1:-dense}" in
  dense)
    timeout 240 python3 -m pytest -q -x -k gpu tests/test_decode_static.py tests/test_perf_fused_kernels.py \
      tests/test_fast_paths.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
    timeout 300 python3 benchmarks/grpo_breakdown.py --shape dense4b --modes stitch,generate --prompts 8 --group 8 \
      --micro-batch-size 16 --tag _graph --out "$OUT" 2>&1 | tee "$OUT/grpo.log" | grep -v "^USDT" | tail -8
    timeout 240 python3 benchmarks/sft_throughput.py --shapes dense4b --modes packed,packed_unfused,baseline,stock \
      --profile 2 --profile-modes packed,stock --tag _fused --out "$OUT" 2>&1 | tee "$OUT/sft.log" \
      | grep -E "stock =|tokens_per_s\": [0-9]" | cut -c1-400
    ;;
  round2)
    bash benchmarks/install_kernels.sh /tmp/fla
    timeout 150 python3 -m pytest -q -x -k gpu tests/test_decode_static.py tests/test_perf_fused_kernels.py \
      tests/test_perf_lora_product.py tests/test_fast_paths.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -2
    timeout 150 python3 benchmarks/grpo_breakdown.py --shape dense4b --modes stitch,generate --prompts 8 --group 8 \
      --micro-batch-size 16 --steps 3 --warmup 1 --skip-parity --profile-rollout 1 --tag _graph2 --out "$OUT" 2>&1 \
      | tee "$OUT/grpo.log" | grep -E "^(stitch|generate) \||rollout tok/s"
    timeout 120 python3 benchmarks/sft_throughput.py --shapes dense4b --modes packed,packed_unfused,baseline,stock \
      --profile 2 --tag _fused2 --out "$OUT" 2>&1 | tee "$OUT/sft.log" | grep -E "stock =|tokens_per_s\": [0-9]" \
      | cut -c1-300
    export PYTHONPATH=/tmp/site:/tmp/fla:.
    timeout 360 python3 benchmarks/sft_throughput.py --shapes qwen35_4b --steps 4 --warmup 2 --tag _fla_all \
      --modes packed,stock,baseline,cached_padded --out "$OUT" 2>&1 | tee "$OUT/qwen35.log" \
      | grep -E "stock =|tokens_per_s\": [0-9]" | cut -c1-300
    ;;
  round3)  # GPU tests, GRPO (grouped decode attention, merged LoRA) with a rollout profile, stitch prepare itself
    # (h200_issue16.sh setup installs AutoModel into /tmp/am; without it its equal-loss tests skip, saying so)
    PYTHONPATH=$PYTHONPATH:/tmp/am timeout 200 python3 -m pytest -q -rs -p no:cacheprovider -k gpu \
      tests/test_decode_static.py tests/test_perf_fused_kernels.py tests/test_perf_lora_product.py \
      tests/test_fast_paths.py tests/test_real_size.py tests/test_automodel_backend.py 2>&1 \
      | tee "$OUT/gpu_tests.log" | tail -6
    timeout 110 python3 benchmarks/grpo_breakdown.py --shape dense4b --modes stitch --prompts 8 --group 8 \
      --micro-batch-size 16 --steps 3 --warmup 1 --skip-parity --profile-rollout 1 --tag _graph3 --out "$OUT" 2>&1 \
      | tee "$OUT/grpo.log" | grep -E "^(stitch|generate) \||rollout tok/s"
    timeout 240 python3 benchmarks/prepare_stitch.py --out "$OUT" 2>&1 | tee "$OUT/prepare.log" | grep -v "^USDT" \
      | tail -14
    ;;
  shapes)  # dense 4B and both hybrids (fla) in ONE process, five modes each, and the cross-shape ratio
    bash benchmarks/install_kernels.sh /tmp/fla
    export PYTHONPATH=/tmp/site:/tmp/fla:.
    timeout 420 python3 benchmarks/sft_throughput.py --shapes dense4b,qwen35_4b,nemotron4b --steps 4 --warmup 2 \
      --modes packed,cached_padded,baseline,llava,stock --tag _round3 --out "$OUT" 2>&1 | tee "$OUT/sft.log" \
      | grep -E "stock =|dense /" | cut -c1-400
    ;;
  round4)  # GPU kernel tests (the fla sync count, then the same test with the fix reverted, which must fail), and
    # the three shapes in ONE process with 10 timed steps a mode after 4 warm-ups, a one-step profile of packed and
    # baseline, host batch time and device syncs per step
    bash benchmarks/install_kernels.sh /tmp/fla
    export PYTHONPATH=/tmp/site:/tmp/fla:.
    fla_sync_tests tests/test_nemotron_kernels.py tests/test_qwen_kernels.py
    timeout 560 python3 benchmarks/sft_throughput.py --shapes dense4b,qwen35_4b,nemotron4b --steps 10 --warmup 4 \
      --modes packed,cached_padded,baseline,llava,stock --profile 1 --profile-modes packed,baseline --tag _round4 \
      --out "$OUT" 2>&1 | tee "$OUT/sft.log" | grep -E "stock =|dense /" | cut -c1-400
    ;;
  nemotron)  # the fla sync test and its mutation, then Nemotron-Nano-4B's shape: packed, baseline, stock
    bash benchmarks/install_kernels.sh /tmp/fla
    export PYTHONPATH=/tmp/site:/tmp/fla:.
    fla_sync_tests -k "gpu or read_nothing_back" tests/test_nemotron_kernels.py
    timeout 300 python3 benchmarks/sft_throughput.py --shapes nemotron4b --steps 10 --warmup 4 \
      --modes packed,baseline,stock --profile 1 --profile-modes packed,baseline --tag _round4 \
      --out "$OUT" 2>&1 | tee "$OUT/sft.log" | grep -E "stock =" | cut -c1-400
    ;;
  prepare)  # the shipped stitch prepare on 16k JPEGs (encode-only: eager and compiled at 2048), then the encoder
    # variants without compile (host-copy share, fused q/k/v, copy on a side stream); carry .whl-demo (datasets)
    install_datasets
    timeout 200 python3 benchmarks/prepare_stitch.py --variants stitch_eager,stitch_compile --batches 2048 \
      --out "$OUT" 2>&1 | tee "$OUT/prepare.log" | grep -v "^USDT" | grep -E "^prepare|^encode|phase" | cut -c1-900
    timeout 120 python3 benchmarks/encode_variants.py --variants shipped,on_device,fused_qkv,pipelined \
      --out "$OUT" 2>&1 | tee "$OUT/encode.log" | grep -v "^USDT" | grep -v Loading | tail -6
    ;;
  automodel)  # issue 14 point 4: AutoModel's own Qwen3.5 class beside stitch packed and stock, one process, ~3 min
    [ -d /tmp/fla/fla ] || bash benchmarks/install_kernels.sh /tmp/fla
    [ -d /tmp/am/nemo_automodel ] || bash benchmarks/h200_issue16.sh setup >/dev/null
    export PYTHONPATH=/tmp/site:/tmp/fla:/tmp/am:.
    timeout 280 python3 benchmarks/sft_automodel.py --out "$OUT" 2>&1 | tee "$OUT/sft_automodel.log" \
      | grep -v "^USDT" | tail -12
    ;;
  round5)  # encoder variants (PatchGemm vs the conv it replaced, eager and compiled), then dense 4B and
    # Nemotron-Nano-4B in ONE process (packed, baseline, stock, llava; device syncs with their sources), then the
    # fla sync test; autotuning results are kept on disk for a back-to-back second call
    bash benchmarks/install_kernels.sh /tmp/fla
    export PYTHONPATH=/tmp/site:/tmp/fla:. TRITON_CACHE_AUTOTUNING=1
    timeout 110 python3 benchmarks/encode_variants.py --variants shipped,conv_patch,shipped_compile,conv_patch_compile,pipelined_compile \
      --out "$OUT" 2>&1 | tee "$OUT/encode.log" | grep -v "^USDT" | grep -v Loading | tail -6
    timeout 390 python3 benchmarks/sft_throughput.py --shapes dense4b,nemotron4b --steps 10 --warmup 3 \
      --modes packed,baseline,stock,llava --tag _round5 --out "$OUT" 2>&1 | tee "$OUT/sft.log" \
      | grep -E "stock =|dense /" | cut -c1-400
    timeout 60 python3 -m pytest -q -rs -p no:cacheprovider -k read_nothing_back tests/test_nemotron_kernels.py 2>&1 \
      | tee "$OUT/gpu_tests.log" | tail -3
    ;;
  round5b)  # the fla sync test (now with chunk offsets known on the host), Nemotron-Nano-4B packed / baseline /
    # stock, then the shipped stitch prepare on 16k JPEGs (encoder warm-up in its loader thread, async copies back)
    bash benchmarks/install_kernels.sh /tmp/fla
    install_datasets
    export PYTHONPATH=/tmp/site:/tmp/fla:.
    timeout 100 python3 -m pytest -q -rs -p no:cacheprovider -k "read_nothing_back or gpu" tests/test_nemotron_kernels.py \
      2>&1 | tee "$OUT/gpu_tests.log" | tail -3
    timeout 330 python3 benchmarks/sft_throughput.py --shapes nemotron4b --steps 8 --warmup 2 \
      --modes packed,baseline,stock --tag _round5b --out "$OUT" 2>&1 | tee "$OUT/sft.log" \
      | grep -E "stock =|packed:" | cut -c1-300
    timeout 110 python3 benchmarks/prepare_stitch.py --skip-encode --out "$OUT" 2>&1 | tee "$OUT/prepare.log" \
      | grep -v "^USDT" | grep -E "^prepare" | cut -c1-1500
    ;;
  round5c)  # Nemotron-Nano-4B packed and its own padded baseline in one process, 4 timed steps: fla autotunes its
    # varlen kernels in packed's first step and its unpacked ones in the baseline's (110-170 s each on a fresh host)
    bash benchmarks/install_kernels.sh /tmp/fla
    export PYTHONPATH=/tmp/site:/tmp/fla:.
    timeout 520 python3 benchmarks/sft_throughput.py --shapes nemotron4b --steps 4 --warmup 2 --skip-parity \
      --modes packed,baseline --tag _round5c --out "$OUT" 2>&1 | tee "$OUT/sft.log" \
      | grep -E "stock =|packed:|baseline:" | cut -c1-300
    ;;
  round6)  # the GPU tests that never ran (a moved packed batch, fused AdamW), then dense 4B and Qwen3.5-4B in ONE
    # process: packed, cached_padded, baseline, stock, device syncs with their sources (Qwen3.5's fla rule now gets
    # the sample starts' host copy). Autotuning results stay on disk for a back-to-back round6b.
    bash benchmarks/install_kernels.sh /tmp/fla
    export PYTHONPATH=/tmp/site:/tmp/fla:. TRITON_CACHE_AUTOTUNING=1
    timeout 120 python3 -m pytest -q -rs -p no:cacheprovider -k gpu tests/test_fast_paths.py tests/test_optimizer.py \
      2>&1 | tee "$OUT/gpu_tests.log" | tail -4
    timeout 400 python3 benchmarks/sft_throughput.py --shapes dense4b,qwen35_4b --steps 8 --warmup 2 \
      --modes packed,cached_padded,baseline,stock --tag _round6 --out "$OUT" 2>&1 | tee "$OUT/sft.log" \
      | grep -E "stock =|dense /" | cut -c1-400
    ;;
  round6b)  # the fla GPU tests with room for fla's first autotune (Nemotron's sync test, Qwen3.5 packed = alone),
    # then AutoModel's own Qwen3.5 class beside stitch packed / padded / stock
    [ -d /tmp/fla/fla ] || bash benchmarks/install_kernels.sh /tmp/fla
    [ -d /tmp/am/nemo_automodel ] || bash benchmarks/h200_issue16.sh setup >/dev/null
    export PYTHONPATH=/tmp/site:/tmp/fla:. TRITON_CACHE_AUTOTUNING=1
    timeout 240 python3 -m pytest -q -rs -p no:cacheprovider -k "read_nothing_back or gpu" \
      tests/test_nemotron_kernels.py tests/test_qwen_kernels.py 2>&1 | tee "$OUT/gpu_tests_fla.log" | tail -4
    export PYTHONPATH=/tmp/site:/tmp/fla:/tmp/am:.
    timeout 280 python3 benchmarks/sft_automodel.py --out "$OUT" 2>&1 | tee "$OUT/sft_automodel.log" \
      | grep -v "^USDT" | tail -12
    ;;
  round6c)  # dense 4B: packed, baseline, llava, stock in ONE process (every dense target from one run), then
    # Qwen3.5-4B packed with a 2-step profile (where its 1.6x against dense goes), then the tiny Qwen3.5 fla test
    bash benchmarks/install_kernels.sh /tmp/fla
    export PYTHONPATH=/tmp/site:/tmp/fla:.
    timeout 200 python3 benchmarks/sft_throughput.py --shapes dense4b --steps 10 --warmup 3 \
      --modes packed,baseline,llava,stock --tag _round6c --out "$OUT" 2>&1 | tee "$OUT/sft_dense.log" \
      | grep -E "stock =" | cut -c1-300
    timeout 220 python3 benchmarks/sft_throughput.py --shapes qwen35_4b --steps 4 --warmup 2 --skip-parity \
      --modes packed --profile 2 --tag _round6c_profile --out "$OUT" 2>&1 | tee "$OUT/sft_qwen35.log" \
      | grep -E "packed:" | cut -c1-300
    timeout 110 python3 -m pytest -q -rs -p no:cacheprovider -k gpu tests/test_qwen_kernels.py 2>&1 \
      | tee "$OUT/gpu_tests_qwen.log" | tail -3
    ;;
  round7)  # Qwen3.5-4B's Gated DeltaNet on fla's GVA rule, in-kernel gates and fused gated norm (stitch_qwen/kernels.py):
    # its GPU parity test at the 4B layer shape (which also autotunes the packed kernels), then packed (profiled),
    # packed_gdn_reference (transformers' forward), cached_padded, baseline and stock in one process; then dense
    # 4B packed for the cross-shape ratio
    bash benchmarks/install_kernels.sh /tmp/fla
    export PYTHONPATH=/tmp/site:/tmp/fla:.
    timeout 200 python3 -m pytest -q -rs -p no:cacheprovider -k gpu tests/test_qwen_gdn_fast_path.py 2>&1 \
      | tee "$OUT/gpu_tests_gdn.log" | tail -3
    timeout 330 python3 benchmarks/sft_throughput.py --shapes qwen35_4b --steps 5 --warmup 2 --profile 2 \
      --modes packed,packed_gdn_reference,cached_padded,baseline,stock --tag _round7 --out "$OUT" 2>&1 \
      | tee "$OUT/sft_qwen35.log" | grep -E "stock =|tokens_per_s\": [0-9]" | cut -c1-300
    timeout 60 python3 benchmarks/sft_throughput.py --shapes dense4b --steps 8 --warmup 2 --skip-parity \
      --modes packed --tag _round7 --out "$OUT" 2>&1 | tee "$OUT/sft_dense.log" | grep -E "packed:" | cut -c1-200
    ;;
  round7b)  # round7's GPU parity test with its differences printed, then Qwen3.5-4B packed, packed_gdn_reference,
    # stock and baseline in one process (parity was round7's), then dense 4B packed on the same host
    bash benchmarks/install_kernels.sh /tmp/fla
    export PYTHONPATH=/tmp/site:/tmp/fla:.
    timeout 230 python3 -m pytest -q -s -rs --tb=short -p no:cacheprovider -k gpu tests/test_qwen_gdn_fast_path.py \
      2>&1 | tee "$OUT/gpu_tests_gdn.log" | grep -E "relative difference|passed|failed|Error" | cut -c1-1500
    timeout 270 python3 benchmarks/sft_throughput.py --shapes qwen35_4b --steps 5 --warmup 2 --skip-parity \
      --modes packed,packed_gdn_reference,stock,baseline --tag _round7b --out "$OUT" 2>&1 \
      | tee "$OUT/sft_qwen35.log" | grep -E "stock =|tokens_per_s\": [0-9]" | cut -c1-200
    timeout 50 python3 benchmarks/sft_throughput.py --shapes dense4b --steps 8 --warmup 2 --skip-parity \
      --modes packed --tag _round7b --out "$OUT" 2>&1 | tee "$OUT/sft_dense.log" | grep -E "packed:" | cut -c1-200
    ;;
  round8)  # the branch's 4B-layer GPU parity test first, with room for fla's first autotune of both paths (round7
    # and round7b cut it at 200-230 s; their "F" was a CPU test that "-k gpu" also selected, since renamed)
    bash benchmarks/install_kernels.sh /tmp/fla
    export PYTHONPATH=/tmp/site:/tmp/fla:.
    timeout 400 python3 -m pytest -q -s -rs --tb=long -p no:cacheprovider -k gpu tests/test_qwen_gdn_fast_path.py \
      2>&1 | tee "$OUT/gpu_tests_gdn.log" | tail -40
    # then, in what the call has left, the two Gated DeltaNet paths in one process with more steps than round7's 5
    # (the test has autotuned both paths' kernels at this shape on this host)
    timeout $((560 - SECONDS)) python3 benchmarks/sft_throughput.py --shapes qwen35_4b --steps 12 --warmup 2 \
      --skip-parity --modes packed,packed_gdn_reference --tag _round8 --out "$OUT" 2>&1 | tee "$OUT/sft_qwen35.log" \
      | grep -E "packed:|packed_gdn_reference:" | cut -c1-200
    ;;
  round8b)  # dense 4B, then Qwen3.5-4B (the fla Gated DeltaNet path), packed and the padded baseline, in ONE process
    bash benchmarks/install_kernels.sh /tmp/fla
    export PYTHONPATH=/tmp/site:/tmp/fla:. TRITON_CACHE_AUTOTUNING=1
    timeout 500 python3 benchmarks/sft_throughput.py --shapes dense4b,qwen35_4b --steps 8 --warmup 2 --skip-parity \
      --modes packed,baseline --tag _round8b --out "$OUT" 2>&1 | tee "$OUT/sft.log" \
      | grep -E "stock =|dense /|(packed|baseline): " | cut -c1-260
    ;;
  round8c)  # one profiled step each: dense 4B packed and stock, then Qwen3.5-4B packed (kernels, launch calls and aten
    # calls per step beside the device time: is the packed step waiting on the host or on the device?)
    bash benchmarks/install_kernels.sh /tmp/fla
    export PYTHONPATH=/tmp/site:/tmp/fla:.
    timeout 120 python3 benchmarks/sft_throughput.py --shapes dense4b --steps 3 --warmup 2 --skip-parity \
      --modes packed,stock --profile 1 --profile-modes packed,stock --tag _round8c --out "$OUT" 2>&1 \
      | tee "$OUT/sft_dense.log" | grep -E "stock ="
    timeout $((420 - SECONDS)) python3 benchmarks/sft_throughput.py --shapes qwen35_4b --steps 3 --warmup 2 \
      --skip-parity --modes packed --profile 1 --tag _round8c --out "$OUT" 2>&1 | tee "$OUT/sft_qwen.log" \
      | grep -E "packed: " | cut -c1-150
    ;;
  round9)  # Nemotron-Nano-4B: packed, cached_padded, baseline and stock in ONE process (fla autotunes its varlen
    # kernels in packed's first step, 110-173 s, and its unpacked ones in cached_padded's, ~164 s), then dense 4B's
    # same four modes in the same process for the one-process dense / Nemotron ratio; Nemotron first, so a time
    # limit cuts dense, and each finished mode is already in the JSON
    bash benchmarks/install_kernels.sh /tmp/fla
    export PYTHONPATH=/tmp/site:/tmp/fla:. TRITON_CACHE_AUTOTUNING=1
    timeout $((570 - SECONDS)) python3 benchmarks/sft_throughput.py --shapes nemotron4b,dense4b --steps 6 --warmup 2 \
      --skip-parity --modes packed,cached_padded,baseline,stock --tag _round9 --out "$OUT" 2>&1 \
      | tee "$OUT/sft.log" | grep -E "stock =|dense /|(packed|cached_padded|baseline|stock): " | cut -c1-220
    ;;
  round10)  # which projection the skinny 32-wide-tile GEMMs of Qwen3.5's packed step serve (37 ms of 198 in round8c):
    # every LoRA target's eight products timed as shipped, operands swapped, rank 64, and stock peft beside
    # LoRAProduct; then one profiled Qwen3.5-4B packed step whose GEMMs are listed by input shape
    bash benchmarks/install_kernels.sh /tmp/fla
    export PYTHONPATH=/tmp/site:/tmp/fla:. TRITON_CACHE_AUTOTUNING=1  # autotune results kept for the next process
    timeout 150 python3 benchmarks/lora_gemm_shapes.py --shapes qwen35_4b,dense4b --tag _round10 --out "$OUT" 2>&1 \
      | tee "$OUT/lora_gemm_shapes.log" | grep -E "per step" | cut -c1-400
    timeout $((560 - SECONDS)) python3 benchmarks/sft_throughput.py --shapes qwen35_4b --steps 3 --warmup 2 \
      --skip-parity --modes packed --profile 1 --tag _round10 --out "$OUT" 2>&1 | tee "$OUT/sft_qwen.log" \
      | grep -E "packed: " | cut -c1-150
    ;;
  prepare10)  # the shipped stitch prepare after its workers moved from PIL's resize to torch's uint8 kernels (4.42 ->
    # 2.48 ms a COCO-sized JPEG on one CPU core): 16,384 JPEGs with torch's resize and with PIL's (the baseline, same
    # call), 65,536 with torch's; prepare only; then encode only at 2048, eager and compiled, beside stock
    install_datasets
    prepare_torch_and_pil round10
    timeout $((570 - SECONDS)) python3 benchmarks/prepare_stitch.py --skip-prepare --variants stitch_eager,stitch_compile \
      --batches 2048 --name prepare_stitch_round10_encode --out "$OUT" 2>&1 | tee "$OUT/encode.log" \
      | grep -v "^USDT" | grep -E "^encode|Error" | cut -c1-900
    ;;
  round11)  # round10c: Qwen3.5's device step is 1.203x dense's, its wall step 1.402x, both host-bound (device busy
    # 40-52 %); Qwen3.5's host part ~244 ms against dense's ~122 ms. cProfile names the functions that take it
    bash benchmarks/install_kernels.sh /tmp/fla
    export PYTHONPATH=/tmp/site:/tmp/fla:. TRITON_CACHE_AUTOTUNING=1
    timeout $((570 - SECONDS)) python3 benchmarks/sft_throughput.py --shapes dense4b,qwen35_4b --steps 12 --warmup 3 \
      --skip-parity --modes packed --profile 1 --host-profile 3 --profile-modes packed --tag _round11 --out "$OUT" \
      2>&1 | tee "$OUT/sft.log" | grep -E "packed: |dense /" | cut -c1-300
    python3 - "$OUT" <<'PY'
import json, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).glob("sft_*4b_round11.json")):
    m = json.loads(f.read_text())["modes"]["packed"]
    h = m.get("host_profile", {})
    print(f.name, "step", m.get("step_s_median"), "device", m.get("profile", {}).get("device_ms_per_step"),
          "cprofile wall ms", h.get("wall_ms_per_step_under_cprofile"))
    print(" by package", h.get("own_ms_per_step_by_package"))
    for row in h.get("top_own_ms_per_step", [])[:25]:
        print("  own", row)
PY
    ;;
  prepare11)  # ClipImageEncoder copies a host batch in 512-image chunks on a side stream, each while the tower
    # encodes the one before (the copy and the tower took turns on one stream)
    install_datasets
    timeout 120 python3 -m pytest -q -rs -p no:cacheprovider tests/test_prepare_fast.py -k on_a_gpu 2>&1 \
      | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|Error" | cut -c1-400
    timeout 100 python3 benchmarks/prepare_stitch.py --images 2048 --skip-encode --name prepare_warmup --out /tmp \
      > /dev/null 2>&1
    for run in "16384 shipped" "16384 serial" "65536 shipped"; do
      set -- $run
      timeout 150 python3 benchmarks/prepare_stitch.py --images "$1" --skip-encode \
        $([ "$2" = serial ] && echo --serial-copy) --name "prepare_stitch_round11_$1_$2" --out "$OUT" 2>&1 \
        | tee "/tmp/prepare_$1_$2.log" | grep -E "^prepare|Error" | cut -c1-700
    done
    timeout 200 python3 benchmarks/prepare_stitch.py --skip-prepare --batches 2048 --images 4096 \
      --variants stitch_eager,stitch_eager_serial,stitch_compile,stitch_compile_serial \
      --name prepare_stitch_round11_encode --out "$OUT" 2>&1 | tee "$OUT/encode.log" | grep -E "^encode|Error" \
      | cut -c1-300
    timeout $((590 - SECONDS)) python3 benchmarks/prepare_stitch.py --skip-prepare --batches 2048 --images 4096 \
      --variants stitch_max_autotune --name prepare_stitch_round11_autotune --out "$OUT" 2>&1 \
      | tee "$OUT/autotune.log" | grep -E "^encode|Error" | cut -c1-300
    ;;
  prepare11b)  # prepare11's one run each was inconclusive for prepare (the shipped run came first, and every phase
    # of the serial run was faster); here the two alternate after one warm-up, and the side stream holds every copy
    install_datasets
    side_stream_test_and_mutation
    timeout 100 python3 benchmarks/prepare_stitch.py --images 2048 --skip-encode --name prepare_warmup --out /tmp \
      > /dev/null 2>&1
    for run in "16384 serial a" "16384 shipped a" "16384 serial b" "16384 shipped b"; do
      set -- $run
      timeout 100 python3 benchmarks/prepare_stitch.py --images "$1" --skip-encode \
        $([ "$2" = serial ] && echo --serial-copy) --name "prepare_stitch_round11b_$1_$2_$3" --out "$OUT" 2>&1 \
        | tee "/tmp/prepare_$1_$2_$3.log" | grep -E "^prepare|Error" | cut -c1-330
    done
    timeout $((590 - SECONDS)) python3 benchmarks/prepare_stitch.py --skip-prepare --batches 2048 --images 4096 \
      --variants stitch_eager,stitch_eager_serial,stitch_compile,stitch_compile_serial \
      --name prepare_stitch_round11b_encode --out "$OUT" 2>&1 | tee "$OUT/encode.log" | grep -E "^encode|Error" \
      | cut -c1-300
    ;;
  round11b)  # round11 again on whatever host this is: whether Qwen3.5's step stays within 1.2x of dense's, with
    # stock transformers beside both; 5 warm-up steps (dense's first timed steps in round11 still recompiled liger)
    use_fla
    timeout $((570 - SECONDS)) python3 benchmarks/sft_throughput.py --shapes dense4b,qwen35_4b --steps 16 --warmup 5 \
      --skip-parity --modes packed,stock --profile 1 --profile-modes packed --tag _round11b --out "$OUT" 2>&1 \
      | tee "$OUT/sft.log" | grep -E "(packed|stock): |dense /" | cut -c1-250
    ;;
  prepare12)  # where the compiled encoder's non-GEMM time goes, and which attention kernel suits 50-token rows
    install_datasets
    timeout 120 python3 -m pytest -q -rs -p no:cacheprovider tests/test_prepare_fast.py 2>&1 \
      | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|Error" | cut -c1-400
    timeout $((590 - SECONDS)) python3 benchmarks/prepare_stitch.py --skip-prepare --batches 2048 --images 4096 \
      --profile-encode --prev-encoder .bench-old/encoder.py --variants stitch_eager_prev,stitch_eager,\
stitch_compile_prev,stitch_compile,stitch_compile_flash,stitch_compile_efficient,stitch_compile_cudnn,\
stitch_compile_eager_attn,stitch_compile_math,stitch_compile_chunk2048,stitch_reduce_overhead \
      --name prepare_stitch_round12_encode --out "$OUT" 2>&1 | tee "$OUT/encode.log" | grep -E "^encode|Error" \
      | cut -c1-300
    ;;
  prepare12b)  # the attention kernels for 50-token rows measured for real, and the shared slots against segments
    install_datasets
    timeout 120 python3 -m pytest -q -rs -p no:cacheprovider tests/test_prepare_fast.py -k on_a_gpu 2>&1 \
      | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|Error" | cut -c1-400
    timeout 240 python3 benchmarks/prepare_stitch.py --skip-prepare --batches 2048 --images 4096 \
      --profile-encode --prev-encoder .bench-old/encoder.py --variants stitch_compile_prev,stitch_compile,\
stitch_compile_flash,stitch_compile_efficient,stitch_compile_cudnn,stitch_compile_qkv,stitch_compile_qkv_flash,\
stitch_compile_qkv_efficient --name prepare_stitch_round12b_encode --out "$OUT" 2>&1 | tee "$OUT/encode.log" \
      | grep -E "^encode|Error" | cut -c1-300
    timeout 100 python3 benchmarks/prepare_stitch.py --images 2048 --skip-encode --name prepare_warmup --out /tmp \
      > /dev/null 2>&1
    for run in "slots a" "segments a" "slots b" "segments b"; do
      set -- $run
      [ $SECONDS -gt 520 ] && break
      timeout $((590 - SECONDS)) python3 benchmarks/prepare_stitch.py --images 65536 --skip-encode \
        $([ "$1" = segments ] && echo --no-slots) --name "prepare_stitch_round12b_65536_$1_$2" --out "$OUT" 2>&1 \
        | grep -E "^prepare|Error" | cut -c1-330
    done
    ;;
  prepare12c|prepare12d)  # the attention kernels for 50-token rows, each variant compiled afresh; prepare at 16k
    install_datasets
    timeout 300 python3 benchmarks/prepare_stitch.py --skip-prepare --batches 2048 --images 4096 --profile-encode \
      --variants stitch_eager,stitch_eager_flash,stitch_eager_efficient,stitch_compile,stitch_compile_flash,\
stitch_compile_efficient,stitch_compile_cudnn --name "prepare_stitch_round${1#prepare}_encode" --out "$OUT" 2>&1 \
      | tee "$OUT/encode.log" | grep -E "^encode|Error" | cut -c1-300
    if [ "$1" = prepare12c ]; then
      timeout 100 python3 benchmarks/prepare_stitch.py --images 2048 --skip-encode --name prepare_warmup --out /tmp \
        > /dev/null 2>&1
      for run in a b; do
        [ $SECONDS -gt 540 ] && break
        timeout $((590 - SECONDS)) python3 benchmarks/prepare_stitch.py --images 16384 --skip-encode \
          --name "prepare_stitch_round12c_16384_$run" --out "$OUT" 2>&1 | grep -E "^prepare|Error" | cut -c1-330
      done
    fi
    ;;
  prepare12e)  # the round's final code on the GPU: its test (and the mutation it must catch), encode, prepare
    install_datasets
    side_stream_test_and_mutation
    timeout 240 python3 benchmarks/prepare_stitch.py --skip-prepare --batches 2048 --images 4096 \
      --prev-encoder .bench-old/encoder.py --variants stitch_eager_prev,stitch_eager,stitch_compile_prev,stitch_compile \
      --name prepare_stitch_round12e_encode --out "$OUT" 2>&1 | tee "$OUT/encode.log" | grep -E "^encode|Error" \
      | cut -c1-300
    timeout 100 python3 benchmarks/prepare_stitch.py --images 2048 --skip-encode --name prepare_warmup --out /tmp \
      > /dev/null 2>&1
    [ $SECONDS -lt 480 ] && timeout $((590 - SECONDS)) python3 benchmarks/prepare_stitch.py --images 65536 \
      --skip-encode --name prepare_stitch_round12e_65536 --out "$OUT" 2>&1 | grep -E "^prepare|Error" | cut -c1-330
    ;;
  prepare13)  # round 13's final code (the sidecar fix touches only the writer): its GPU test and mutation, the
    # compiled encoder against stock, and the shipped prepare at 16k and 64k on whatever host this is
    install_datasets
    side_stream_test_and_mutation
    timeout 150 python3 benchmarks/prepare_stitch.py --skip-prepare --batches 2048 --images 4096 \
      --variants stitch_compile --name prepare_stitch_round13_encode --out "$OUT" 2>&1 | tee "$OUT/encode.log" \
      | grep -E "^encode|Error" | cut -c1-300
    timeout 100 python3 benchmarks/prepare_stitch.py --images 2048 --skip-encode --name prepare_warmup --out /tmp \
      > /dev/null 2>&1
    for images in 16384 65536; do
      [ $SECONDS -lt 500 ] && timeout $((590 - SECONDS)) python3 benchmarks/prepare_stitch.py --images $images \
        --skip-encode --name prepare_stitch_round13_$images --out "$OUT" 2>&1 | grep -E "^prepare|Error" | cut -c1-330
    done
    ;;
  prepare14)  # JPEGs decoded by nvjpeg on the GPU (data.prepare.decode: device; run at a74943e, where it was called
    # auto and was the default, with sdpa's efficient attention first and a GPU test of that kernel, since reverted)
    # against the workers' CPU decode, alternating on one host; first the GPU tests, then with the crop offset broken
    install_datasets
    timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/test_device_decode.py 2>&1 \
      | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|Error" | cut -c1-400
    timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/test_prepare_fast.py -k on_a_gpu 2>&1 \
      | tee "$OUT/gpu_tests_clip.log" | grep -E "passed|failed|Error" | cut -c1-400
    cp stitch_clip/encoder.py /tmp/encoder.py.keep
    sed -i 's|self.weights(h, out_h, top, ch, device)|self.weights(h, out_h, 0, ch, device)|' \
      stitch_clip/encoder.py
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_device_decode.py -k on_a_gpu 2>&1 \
      | tee "$OUT/gpu_tests_mutated.log" | grep -E "passed|failed" | cut -c1-400
    cp /tmp/encoder.py.keep stitch_clip/encoder.py
    timeout 100 python3 benchmarks/prepare_stitch.py --images 2048 --skip-encode --name prepare_warmup --out /tmp \
      > /dev/null 2>&1
    for run in "16384 device a" "16384 cpu a" "16384 device b" "16384 cpu b" "65536 device a" "65536 cpu a"; do
      set -- $run
      [ $SECONDS -lt 480 ] && timeout $((590 - SECONDS)) python3 benchmarks/prepare_stitch.py --images $1 \
        --decode $2 --skip-encode --name prepare_stitch_round14_$1_$2_$3 --out "$OUT" 2>&1 \
        | grep -E "^prepare|Error" | cut -c1-330
    done
    ;;
  prepare14b)  # the GPU decode with few decode workers (a host with few cores per GPU), against the CPU decode with as
    # many; the side-stream test again (the encoder as before a74943e), and where the device path's main thread goes
    install_datasets
    timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/test_device_decode.py tests/test_prepare_fast.py \
      -k "on_a_gpu" 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|Error" | cut -c1-400
    timeout 100 python3 benchmarks/prepare_stitch.py --images 2048 --skip-encode --name prepare_warmup --out /tmp \
      > /dev/null 2>&1
    for run in "3 device" "3 cpu" "7 device" "7 cpu"; do
      set -- $run
      [ $SECONDS -lt 420 ] && timeout $((590 - SECONDS)) python3 benchmarks/prepare_stitch.py --images 16384 \
        --workers $1 --decode $2 --skip-encode --name prepare_stitch_round14b_16384_w$1_$2 --out "$OUT" 2>&1 \
        | grep -E "^prepare|Error" | cut -c1-250
    done
    [ $SECONDS -lt 480 ] && timeout $((590 - SECONDS)) python3 benchmarks/prepare_stitch.py --images 16384 \
      --decode device --profile --skip-encode --name prepare_stitch_round14b_16384_device_profile --out "$OUT" 2>&1 \
      | grep -E "^prepare|Error" | cut -c1-250
    ;;
  gputests14)  # the final code's GPU tests: nvjpeg decode (and its CPU-side tests on this machine), the side stream
    install_datasets
    timeout 200 python3 -m pytest -q -rs -p no:cacheprovider tests/test_device_decode.py tests/test_prepare_fast.py \
      -k "on_a_gpu or device" 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|Error" | cut -c1-400
    ;;
  prepare15)  # round 15: a shard encodes on its own thread while the main thread gathers the next, and a JPEG the
    # workers read from a file travels to the device path as its path (not 65 KB through the pipe); new code against
    # 2b80d5b's prepare.py + encoder.py (.bench-old/*_2b80d5b.py), alternating on one host; GPU tests first
    install_datasets
    timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/test_device_decode.py tests/test_prepare_fast.py \
      tests/test_prepare_workers.py -k "on_a_gpu or device or gathered" 2>&1 | tee "$OUT/gpu_tests.log" \
      | grep -E "passed|failed|Error" | cut -c1-400
    timeout 100 python3 benchmarks/prepare_stitch.py --images 2048 --skip-encode --name prepare_warmup --out /tmp \
      > /dev/null 2>&1
    for run in "new 15 device 16384" "old 15 device 16384" "new 15 cpu 16384" "old 15 cpu 16384" \
               "new 3 device 16384" "old 3 device 16384" "new 15 device 65536" "new 15 cpu 65536" \
               "old 15 device 65536"; do
      set -- $run
      use_code "$1"
      [ $SECONDS -lt 500 ] && timeout $((585 - SECONDS)) python3 benchmarks/prepare_stitch.py --images $4 \
        --workers $2 --decode $3 --skip-encode --name prepare_stitch_round15_$4_w$2_$3_$1 --out /tmp/r15 2>&1 \
        | grep -E "^prepare|Error" | cut -c1-330
    done
    use_code new
    merge_json /tmp/r15 prepare_stitch_round15
    ;;
  prepare15b)  # the encode thread's own split (encode_seconds: inputs = device_batch or stacking, encode = the
    # tower) and when each shard's encode ran (shard_encodes_s), new code only
    install_datasets
    timeout 100 python3 benchmarks/prepare_stitch.py --images 2048 --skip-encode --name prepare_warmup --out /tmp \
      > /dev/null 2>&1
    for run in "15 device 16384" "15 cpu 16384" "3 device 16384" "7 device 16384" "15 device 65536"; do
      set -- $run
      [ $SECONDS -lt 500 ] && timeout $((585 - SECONDS)) python3 benchmarks/prepare_stitch.py --images $3 \
        --workers $1 --decode $2 --skip-encode --name prepare_stitch_round15b_$3_w$1_$2 --out /tmp/r15b 2>&1 \
        | grep -E "^prepare|Error" | cut -c1-200
    done
    merge_json /tmp/r15b prepare_stitch_round15b
    ;;
  prepare15c)  # the device preprocessing warmed up in the loader thread (nvjpeg, the resize's GEMMs) and the
    # resize's weights padded by pad_sequence: the resize against 2b80d5b's (bit for bit, time), the GPU tests, then
    # stitch prepare against a0a4351's prepare.py + encoder.py (.bench-old/*_a0a4351.py), alternating on one host
    install_datasets
    python3 benchmarks/resize_crop_check.py --old .bench-old/encoder_2b80d5b.py --device cuda 2>&1 \
      | tee "$OUT/resize_crop_check.log"
    timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/test_device_decode.py tests/test_prepare_fast.py \
      -k "on_a_gpu or device" 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|Error" | cut -c1-400
    timeout 100 python3 benchmarks/prepare_stitch.py --images 2048 --skip-encode --name prepare_warmup --out /tmp \
      > /dev/null 2>&1
    for run in "new 15 device 16384" "a0 15 device 16384" "new 7 device 16384" "a0 7 device 16384" \
               "new 15 device 65536" "a0 15 device 65536" "new 15 cpu 16384"; do
      set -- $run
      use_code "$1"
      [ $SECONDS -lt 480 ] && timeout $((585 - SECONDS)) python3 benchmarks/prepare_stitch.py --images $4 \
        --workers $2 --decode $3 --skip-encode --name prepare_stitch_round15c_$4_w$2_$3_$1 --out /tmp/r15c 2>&1 \
        | grep -E "^prepare|Error" | cut -c1-200
    done
    use_code new
    merge_json /tmp/r15c prepare_stitch_round15c
    ;;
  prepare15d)  # prepare15c's 64k pair reversed its 16k pairs: the three codes again, in another order, one host
    install_datasets
    timeout 100 python3 benchmarks/prepare_stitch.py --images 2048 --skip-encode --name prepare_warmup --out /tmp \
      > /dev/null 2>&1
    for run in "a0 65536" "new 65536" "old 65536" "new 16384" "a0 16384" "old 16384"; do
      set -- $run
      use_code "$1"
      [ $SECONDS -lt 260 ] && timeout $((330 - SECONDS)) python3 benchmarks/prepare_stitch.py --images $2 \
        --decode device --skip-encode --name prepare_stitch_round15d_$2_device_$1 --out /tmp/r15d 2>&1 \
        | grep -E "^prepare|Error" | cut -c1-120
    done
    use_code new
    merge_json /tmp/r15d prepare_stitch_round15d
    ;;
  prepare16)  # round 16: the decoder's set-up in its own thread beside the encoder's loader, and the first batch's
    # input made before the encoder is waited for, against round 15's final code (r15, 966957e) on one host,
    # alternating; the device-path GPU tests first
    install_datasets
    timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/test_device_decode.py tests/test_prepare_fast.py \
      -k "gpu or device" 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|Error" | cut -c1-400
    timeout 100 python3 benchmarks/prepare_stitch.py --images 2048 --skip-encode --name prepare_warmup --out /tmp \
      > /dev/null 2>&1
    for run in "r15 16384 a" "new 16384 a" "new 16384 b" "r15 16384 b" "r15 16384 c" "new 16384 c" "new 16384 d" \
        "r15 16384 d" "new 65536 a" "r15 65536 a"; do
      set -- $run
      use_code "$1"
      [ $SECONDS -lt 420 ] && timeout $((500 - SECONDS)) python3 benchmarks/prepare_stitch.py --images $2 \
        --decode device --skip-encode --name prepare_stitch_round16_$2_$1_$3 --out /tmp/r16 2>&1 \
        | grep -E "^prepare|Error" | cut -c1-120
    done
    use_code new
    merge_json /tmp/r16 prepare_stitch_round16
    ;;
  prepare16b)  # prepare16's new code used ~5 s more CPU in the process than r15's (17 against 9-14 s): which
    # thread's, by --thread-cpu; the two codes alternating again, on whichever host this is
    install_datasets
    timeout 100 python3 benchmarks/prepare_stitch.py --images 2048 --skip-encode --name prepare_warmup --out /tmp \
      > /dev/null 2>&1
    for run in "new a" "r15 a" "r15 b" "new b" "new c" "r15 c"; do
      set -- $run
      use_code "$1"
      [ $SECONDS -lt 300 ] && timeout $((380 - SECONDS)) python3 benchmarks/prepare_stitch.py --images 16384 \
        --decode device --skip-encode --thread-cpu --name prepare_stitch_round16b_16384_$1_$2 --out /tmp/r16b 2>&1 \
        | grep -E "^prepare|Error" | cut -c1-120
    done
    use_code new
    merge_json /tmp/r16b prepare_stitch_round16b
    ;;
  inputs17)  # round 17: where the encode thread's ~210 us an image of inputs go (read, nvjpeg, resize; alone and
    # beside a busy thread), round 16's resize against this round's, then prepare with r16's code and this round's
    # (new), each with the interpreter's switch interval at 5 ms (the default, d) and 0.5 ms (s), alternating: does
    # prepare's main thread hold the encode thread's torch calls up?
    install_datasets
    timeout 200 python3 benchmarks/device_inputs_check.py --images 4096 --old .bench-old/encoder_8debdc7.py \
      --out "$OUT" 2>&1 | grep -vi warn | cut -c1-1500
    compare_codes round17 440 520 "new d_a" "r16 d_a" "new s_a --switch-interval 0.0005" \
      "r16 s_a --switch-interval 0.0005" "r16 d_b" "new d_b" "r16 s_b --switch-interval 0.0005" \
      "new s_b --switch-interval 0.0005"
    ;;
  inputs17b)  # inputs17 found the 6th device_batch of every run ~0.4 s slower than its neighbours and the first one
    # 0.3-0.5 s slower: Python's full collections (gc.freeze in prepare now), and what is cold in the first batch;
    # prepare with r16's code, c17's (gc frozen, the nested resize) and new (c17 + the decode thread), alternating
    install_datasets
    timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/test_device_decode.py tests/test_prepare_fast.py \
      -k "gpu or device" 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|Error" | cut -c1-400
    timeout 200 python3 benchmarks/device_inputs_check.py --images 4096 --old .bench-old/encoder_8debdc7.py \
      --out "$OUT" 2>&1 | grep -vi warn | cut -c1-1500
    for warm in shipped photo shipped photo; do
      timeout 60 python3 benchmarks/device_inputs_check.py --images 8192 --cold $warm --out /tmp/cold_$warm 2>&1 \
        | grep -E "^cold|Error" | cut -c1-300
    done
    compare_codes round17b 470 540 "new a" "r16 a" "c17 a" "c17 b" "r16 b" "new b" "new c" "c17 c" "r16 c"
    ;;
  inputs17c)  # round 17's final code (the start-up's imports frozen too, collection off until the first shard)
    # against r16, alternating; then the first device_batch of a fresh process profiled, and the micro benchmark
    install_datasets
    compare_codes round17c 200 260 "new a" "r16 a" "r16 b" "new b"
    timeout 60 python3 benchmarks/device_inputs_check.py --images 4096 --cold shipped --profile --out "$OUT" 2>&1 \
      | grep -vi warn | cut -c1-200
    [ $SECONDS -lt 230 ] && timeout $((300 - SECONDS)) python3 benchmarks/device_inputs_check.py --images 2048 \
      --old .bench-old/encoder_8debdc7.py --out "$OUT" 2>&1 | grep -vi warn | cut -c1-1500
    ;;
  gc18)  # who starts the full collections (gc.gen2_callers, gc.at_start), this code at 16k twice and 64k once,
    # and which installed libraries collect explicitly
    install_datasets
    grep -rn "gc\.collect(\|gc\.freeze(" /tmp/site/datasets /tmp/site/pyarrow "$(python3 -c 'import torch, os; \
      print(os.path.dirname(torch.__file__))')" 2>/dev/null | grep -v "/test" | cut -c1-160 > "$OUT/gc_calls.txt"
    compare_codes gc18 200 260 "new a" "new b"
    [ $SECONDS -lt 300 ] && timeout $((400 - SECONDS)) python3 benchmarks/prepare_stitch.py --images 65536 \
      --decode device --skip-encode --name prepare_stitch_gc18_65536_new --out "$OUT" 2>&1 \
      | grep -E "^prepare|Error" | cut -c1-120
    python3 -c "import json, sys; [print(k, json.dumps(v['prepare']['gc'])[:1500]) for k, v in \
      json.load(open(sys.argv[1])).items()]" "$OUT/prepare_stitch_gc18.json"
    python3 -c "import json, sys; print(json.dumps(json.load(open(sys.argv[1]))['prepare']['gc'])[:1500])" \
      "$OUT/prepare_stitch_gc18_65536_new.json"
    ;;
  weights18)  # the closed-form resize weights and Python 3.12's parked objects: the GPU tests, the first
    # device_batch calls of a fresh process (profiled), device_batch against r16 (speed, pixels), 16k prepare against
    # r16 alternating, 64k once
    install_datasets
    python3 -c "import sys, stitch.data.prepare as p; print(sys.version.split()[0], 'parked', p.PARKED_BY_PYTHON)"
    timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/test_device_decode.py tests/test_prepare_fast.py \
      tests/test_prepare_workers.py -k "gpu or device or parks or objects_from" 2>&1 | tee "$OUT/gpu_tests.log" \
      | grep -E "passed|failed|Error" | cut -c1-400
    timeout 60 python3 benchmarks/device_inputs_check.py --images 4096 --cold shipped --profile --out "$OUT" 2>&1 \
      | grep -vi warn | tail -36 | cut -c1-200
    timeout 150 python3 benchmarks/device_inputs_check.py --images 2048 --old .bench-old/encoder_8debdc7.py \
      --out "$OUT" 2>&1 | grep -E "pixels|images_per_s|Error" | cut -c1-1500
    compare_codes weights18 330 400 "new a" "r16 a" "new b" "r16 b"
    [ $SECONDS -lt 420 ] && timeout $((480 - SECONDS)) python3 benchmarks/prepare_stitch.py --images 65536 \
      --decode device --skip-encode --name prepare_stitch_weights18_65536_new --out "$OUT" 2>&1 \
      | grep -E "^prepare|Error" | cut -c1-120
    ;;
  final18)  # round 18's final code against r16 at 16k, four runs to two, alternating, on one host; 64k once
    install_datasets
    compare_codes final18 300 380 "new a" "r16 a" "new b" "new c" "r16 b" "new d"
    [ $SECONDS -lt 380 ] && timeout $((450 - SECONDS)) python3 benchmarks/prepare_stitch.py --images 65536 \
      --decode device --skip-encode --name prepare_stitch_final18_65536_new --out "$OUT" 2>&1 \
      | grep -E "^prepare|Error" | cut -c1-120
    ;;
  gil18)  # who holds the interpreter lock in a 16k run of round 18's code (py-spy --gil --threads at 250 Hz), after
    # a warm-up run; carry .whl-pyspy too
    install_datasets
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/spy .whl-pyspy/*.whl
    timeout 100 python3 benchmarks/prepare_stitch.py --images 2048 --skip-encode --name prepare_warmup --out /tmp \
      > /dev/null 2>&1
    timeout 150 /tmp/spy/bin/py-spy record --gil --threads --nonblocking -r 250 -f raw -o "$OUT/gil18_16384.txt" -- \
      python3 benchmarks/prepare_stitch.py --images 16384 --decode device --skip-encode --thread-cpu \
      --name prepare_stitch_gil18_16384 --out "$OUT" 2>&1 | grep -E "^prepare|Error|py-spy" | cut -c1-200
    python3 benchmarks/gil_summary.py "$OUT/gil18_16384.txt" 2>&1 | head -90
    xz -9 "$OUT/gil18_16384.txt"
    ;;
  thread18)  # the decoder's warm-up on the encode thread (new) against a thread of its own (c18, 64bfcfd), 16k,
    # alternating, one host; the GPU tests first
    install_datasets
    timeout 120 python3 -m pytest -q -rs -p no:cacheprovider tests/test_device_decode.py tests/test_prepare_fast.py \
      -k "gpu or device" 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|Error" | cut -c1-400
    compare_codes thread18 230 290 "new a" "c18 a" "new b" "c18 b" "new c" "c18 c"
    ;;
  slots19)  # round 19: each JPEG's bytes put into its chunk's shared slot by the decode worker that read them (the main
    # process reads no file) against the paths the main process reads again (--no-slots: the same code with the
    # ring off); the GPU tests and device_batch on slot views against paths first; 16k alternating, 64k each once
    install_datasets
    timeout 120 python3 -m pytest -q -rs -p no:cacheprovider tests/test_device_decode.py tests/test_prepare_fast.py \
      tests/test_shared_slots.py -k "gpu or device or slot" 2>&1 | tee "$OUT/gpu_tests.log" \
      | grep -E "passed|failed|Error" | cut -c1-400
    timeout 150 python3 benchmarks/device_inputs_check.py --images 2048 --out "$OUT" 2>&1 \
      | grep -E "pixels|images_per_s|Error" | cut -c1-1500
    compare_codes slots19 330 400 "new slots_a" "new paths_a --no-slots" "new slots_b" "new paths_b --no-slots" \
      "new slots_c" "new paths_c --no-slots"
    for run in "slots" "paths --no-slots"; do
      set -- $run
      [ $SECONDS -lt 470 ] && timeout $((540 - SECONDS)) python3 benchmarks/prepare_stitch.py --images 65536 \
        --decode device --skip-encode "${@:2}" --name "prepare_stitch_slots19_65536_$1" --out "$OUT" 2>&1 \
        | grep -E "^prepare|Error" | cut -c1-120
    done
    ;;
  writer20)  # round 20: each shard file written straight from the features' memory and hashed from it on a second
    # thread, two writer threads (new), against round 19's writer: safetensors' save_file then the file read back for
    # its sha256, on one thread (old); and the new write on one thread (w1); 16k alternating, then 64k each once
    install_datasets
    compare_codes writer20 330 400 "new new_a" "new old_a --shard-writers 1 --save-file-writer" \
      "new w1_a --shard-writers 1" "new old_b --shard-writers 1 --save-file-writer" "new new_b" "new w1_b --shard-writers 1"
    for run in "new" "old --shard-writers 1 --save-file-writer"; do
      set -- $run
      [ $SECONDS -lt 470 ] && timeout $((550 - SECONDS)) python3 benchmarks/prepare_stitch.py --images 65536 \
        --decode device --skip-encode "${@:2}" --name "prepare_stitch_writer20_65536_$1" --out "$OUT" 2>&1 \
        | grep -E "^prepare|Error" | cut -c1-120
    done
    ;;
  hybrids20)  # Qwen3.5-4B's padded baseline beside its packed mode (not run since round 9) and dense 4B's two, in ONE
    # process: the hybrid's ratio to its own baseline and to dense from one run; carry .whl .whl-liger .whl-pydantic
    use_fla
    timeout $((570 - SECONDS)) python3 benchmarks/sft_throughput.py --shapes dense4b,qwen35_4b --steps 12 --warmup 4 \
      --skip-parity --modes packed,baseline --tag _round20 --out "$OUT" 2>&1 | tee "$OUT/sft.log" \
      | grep -E "stock =|dense /|(packed|baseline): " | cut -c1-250
    ;;
  hybrids20b)  # Nemotron-Nano-4B packed beside dense 4B packed in ONE process (round 19 had them in two)
    use_fla
    timeout $((570 - SECONDS)) python3 benchmarks/sft_throughput.py --shapes dense4b,nemotron4b --steps 12 --warmup 4 \
      --skip-parity --modes packed --tag _round20b --out "$OUT" 2>&1 | tee "$OUT/sft_nemotron.log" \
      | grep -E "stock =|dense /|packed: " | cut -c1-250
    ;;
  graphs21)  # stitch.model.graphs: its GPU tests (and a mutation that feeds the graph a stale input), then dense 4B
    # packed with MLP graphs, packed_eager (no graphs) and the padded baseline in ONE process, packed ones profiled;
    # carry .whl-liger .whl-pydantic
    timeout 150 python3 -m pytest -q -rs -p no:cacheprovider -k gpu tests/test_cuda_graphs.py \
      tests/test_perf_fused_kernels.py tests/test_perf_lora_product.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
    cp stitch/model/graphs.py /tmp/graphs.py
    sed -i 's/buffer.detach().copy_(x)/pass/' stitch/model/graphs.py && grep -q "            pass" stitch/model/graphs.py
    timeout 100 python3 -m pytest -q -p no:cacheprovider -k gpu tests/test_cuda_graphs.py 2>&1 \
      | tee "$OUT/gpu_tests_mutated.log" | tail -2
    cp /tmp/graphs.py stitch/model/graphs.py
    timeout $((570 - SECONDS)) python3 benchmarks/sft_throughput.py --shapes dense4b --steps 12 --warmup 4 \
      --skip-parity --modes packed,packed_eager,baseline --profile 2 --profile-modes packed --tag _round21 \
      --out "$OUT" 2>&1 | tee "$OUT/sft.log" | grep -E "(packed|packed_eager|baseline): " | cut -c1-300
    ;;
  graphs21b)  # Qwen3.5-4B and dense 4B, packed with graphs (MLPs; Qwen3.5's Gated DeltaNet projections and gated norm
    # + out_proj), packed_eager and the padded baseline in ONE process, after the tiny GPU tests; then the tiny Qwen3.5
    # test and the stale-input mutation with the time left; carry .whl .whl-liger .whl-pydantic
    use_fla
    timeout 100 python3 -m pytest -q -rs -p no:cacheprovider -k "gpu and not qwen35" tests/test_cuda_graphs.py \
      tests/test_perf_fused_kernels.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -3
    timeout $((560 - SECONDS)) python3 benchmarks/sft_throughput.py --shapes qwen35_4b,dense4b --steps 12 --warmup 4 \
      --skip-parity --modes packed,packed_eager,baseline --tag _round21b --out "$OUT" 2>&1 | tee "$OUT/sft.log" \
      | grep -E "dense /|(packed|packed_eager|baseline): " | cut -c1-300
    [ $SECONDS -lt 500 ] && timeout $((580 - SECONDS)) python3 -m pytest -q -rs -p no:cacheprovider -k qwen35 \
      tests/test_cuda_graphs.py 2>&1 | tee "$OUT/gpu_tests_qwen35.log" | tail -3
    sed -i 's/buffer.detach().copy_(x)/pass/' stitch/model/graphs.py && grep -q "            pass" stitch/model/graphs.py \
      && [ $SECONDS -lt 560 ] && timeout $((590 - SECONDS)) python3 -m pytest -q -p no:cacheprovider \
      -k "gpu and not qwen35" tests/test_cuda_graphs.py 2>&1 | tee "$OUT/gpu_tests_mutated.log" | tail -2
    ;;
  graphs21c)  # graphs21 again after the capture fix (fresh leaves stand in for the trainable parameters while a
    # block is captured): the tiny GPU tests, then dense 4B packed (graphs: every LoRA layer and MLP), packed_eager and
    # the padded baseline in ONE process, packed ones profiled; carry .whl-liger .whl-pydantic
    timeout 100 python3 -m pytest -q -rs -p no:cacheprovider -k "gpu and not qwen35" tests/test_cuda_graphs.py \
      tests/test_perf_lora_product.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -3
    timeout $((290 - SECONDS)) python3 benchmarks/sft_throughput.py --shapes dense4b --steps 12 --warmup 4 \
      --skip-parity --modes packed,packed_eager,baseline --profile 2 --profile-modes packed --tag _round21c \
      --out "$OUT" 2>&1 | tee "$OUT/sft.log" | grep -E "(packed|packed_eager|baseline): " | cut -c1-300
    ;;
  graphs21d)  # Qwen3.5-4B alone after graphs21c's fix, on the same warm machine: packed (graphs), packed_eager and the
    # padded baseline in ONE process, 10 timed steps (the baseline did not finish inside the call); carry .whl
    # .whl-liger .whl-pydantic
    use_fla
    timeout $((285 - SECONDS)) python3 benchmarks/sft_throughput.py --shapes qwen35_4b --steps 10 --warmup 4 \
      --skip-parity --modes packed,packed_eager,baseline --tag _round21d --out "$OUT" 2>&1 | tee "$OUT/sft.log" \
      | grep -E "(packed|packed_eager|baseline): |capture failed" | cut -c1-300
    ;;
  graphs22)  # round 22's graphs (one gradient-in buffer per shape shared by every block; a backward graph's outputs
    # copied out after its replay, so the backward pool holds nothing between captures): the tiny GPU tests, then dense
    # 4B's five modes in ONE process (the peak with graphs was 32.18 GiB); carry .whl-liger .whl-pydantic
    timeout 100 python3 -m pytest -q -rs -p no:cacheprovider -k "gpu and not qwen35" tests/test_cuda_graphs.py \
      tests/test_perf_lora_product.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -3
    timeout $((560 - SECONDS)) python3 benchmarks/sft_throughput.py --shapes dense4b --steps 10 --warmup 4 \
      --skip-parity --modes packed,packed_eager,baseline,llava,stock --tag _round22 --out "$OUT" 2>&1 \
      | tee "$OUT/sft.log" | grep -E "stock =|(packed|packed_eager|baseline|llava|stock): |capture failed" | cut -c1-300
    ;;
  graphs22q|graphs22n)  # a hybrid beside dense 4B in ONE process, packed (graphs) and padded baseline each: the hybrid's
    # ratio to its own baseline and to dense from one run; carry .whl .whl-liger .whl-pydantic
    use_fla
    shape=qwen35_4b; [ "$1" = graphs22n ] && shape=nemotron4b
    timeout $((585 - SECONDS)) python3 benchmarks/sft_throughput.py --shapes $shape,dense4b --steps 10 --warmup 4 \
      --skip-parity --modes packed,baseline --tag _round22 --out "$OUT" 2>&1 | tee "$OUT/sft_$shape.log" \
      | grep -E "dense /|(packed|baseline): |capture failed" | cut -c1-300
    save_autotune
    ;;
  profile20)  # why a packed dense 4B step costs ~20 % more per token slot than a padded one (hybrids20: 56.6 against
    # 46.1 us, Qwen3.5 66.6 against 55.3): device time by kernel for both modes, against their wall time
    export PYTHONPATH=/tmp/site:.
    timeout 150 python3 benchmarks/sft_throughput.py --shapes dense4b --steps 6 --warmup 3 --skip-parity \
      --modes packed,baseline --profile 2 --profile-modes packed,baseline --tag _round20_profile --out "$OUT" 2>&1 \
      | tee "$OUT/sft_profile.log" | grep -E "(packed|baseline): " | cut -c1-250
    ;;
  slots19b)  # slots19's 16k pairs again on the same (warm) machine, each pair in the other order (paths first)
    install_datasets
    compare_codes slots19b 200 250 "new paths_d --no-slots" "new slots_d" "new paths_e --no-slots" "new slots_e" \
      "new paths_f --no-slots" "new slots_f"
    ;;
  hybrids19)  # Nemotron-Nano-4B's packed, padded baseline and stock in ONE process on the current code (last measured
    # in round 9, before round 10's liger head chunks); then, with time left, Qwen3.5-4B and dense 4B packed and
    # stock in one process; carry .whl .whl-liger .whl-pydantic
    use_fla
    timeout $((560 - SECONDS)) python3 benchmarks/sft_throughput.py --shapes nemotron4b --steps 12 --warmup 3 \
      --skip-parity --modes packed,baseline,stock --tag _round19 --out "$OUT" 2>&1 | tee "$OUT/sft.log" \
      | grep -E "stock =|(packed|baseline|stock): " | cut -c1-250
    [ $SECONDS -lt 400 ] && timeout $((570 - SECONDS)) python3 benchmarks/sft_throughput.py --shapes dense4b,qwen35_4b \
      --steps 12 --warmup 4 --skip-parity --modes packed,stock --tag _round19 --out "$OUT" 2>&1 \
      | tee "$OUT/sft_qwen.log" | grep -E "stock =|dense /|(packed|stock): " | cut -c1-250
    ;;
  hybrids19b)  # hybrids19's second part on its own (its Nemotron run left no time): dense 4B and Qwen3.5-4B packed and
    # stock in ONE process, 5 warm-up steps (fla autotunes Qwen3.5's kernels in its first)
    use_fla
    timeout $((560 - SECONDS)) python3 benchmarks/sft_throughput.py --shapes dense4b,qwen35_4b --steps 16 --warmup 5 \
      --skip-parity --modes packed,stock --tag _round19 --out "$OUT" 2>&1 | tee "$OUT/sft.log" \
      | grep -E "stock =|dense /|(packed|stock): " | cut -c1-250
    ;;
  dense19)  # dense 4B's four modes (packed, baseline, llava, stock) in ONE process on the current code, last measured
    # in round 8 (every dense target met there)
    export PYTHONPATH=/tmp/site:.
    timeout 260 python3 benchmarks/sft_throughput.py --shapes dense4b --steps 12 --warmup 4 \
      --modes packed,baseline,llava,stock --tag _round19_four --out "$OUT" 2>&1 | tee "$OUT/sft_dense.log" \
      | grep -E "stock =|(packed|baseline|llava|stock): " | cut -c1-250
    ;;
  loader15)  # where the encoder loader's ~2.8 s go (it holds back prepare's first shard): each step alone, twice
    install_datasets
    for run in a b; do
      timeout 60 python3 benchmarks/prepare_stitch.py --loader-breakdown --name loader_round15_$run --out "$OUT" 2>&1 \
        | grep -E "^loader|Error" | cut -c1-300
    done
    ;;
  prepare11c)  # which thread holds the GIL while prepare runs (py-spy samples only those), and the per-row cut timed
    install_datasets
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/spy .whl-pyspy/*.whl
    timeout 100 python3 benchmarks/prepare_stitch.py --images 2048 --skip-encode --name prepare_warmup --out /tmp \
      > /dev/null 2>&1
    cp stitch/data/prepare.py /tmp/prepare.py.new
    for run in "old a" "new a" "old b" "new b"; do
      set -- $run
      cp "$([ "$1" = old ] && echo .bench-old/prepare.py || echo /tmp/prepare.py.new)" stitch/data/prepare.py
      timeout 100 python3 benchmarks/prepare_stitch.py --images 65536 --skip-encode \
        --name "prepare_stitch_round11c_65536_$1_$2" --out "$OUT" 2>&1 | grep -E "^prepare|Error" | cut -c1-330
    done
    cp /tmp/prepare.py.new stitch/data/prepare.py
    timeout $((290 - SECONDS)) /tmp/spy/bin/py-spy record --gil --threads --nonblocking -r 250 -f raw \
      -o "$OUT/prepare_65536_gil.txt" -- python3 benchmarks/prepare_stitch.py --images 65536 --skip-encode \
      --name prepare_stitch_round11c_65536_pyspy --out "$OUT" 2>&1 | grep -E "^prepare|Error|py-spy" | cut -c1-330
    ;;
  prepare10b)  # prepare10 with the worker tasks at 64 rows (16 before: fewer hand-overs for the main process, which
    # bounded prepare10's steady state at ~0.36 ms a row); a 2,048-image run first warms the machine (prepare10's
    # first run paid CUDA's and the page cache's cold start, so its PIL baseline ran warm and the new path cold)
    install_datasets
    timeout 100 python3 benchmarks/prepare_stitch.py --images 2048 --skip-encode --name prepare_warmup --out /tmp \
      > /dev/null 2>&1
    prepare_torch_and_pil round10b
    ;;
  round10c)  # round10b's profile put Qwen3.5's two skinny cuBLAS kernels (38 ms of 194) in liger's head GEMMs: 62
    # chunks of 32 rows over the 248,320-word vocabulary. stitch now asks liger for CHUNK_TOKENS-row chunks; the GPU
    # tests check the rows and the loss, then both shapes run the shipped packed step against liger's own budget
    # (and Qwen3.5 against the ungrouped projections, dense against stock) in one process
    timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/test_fast_paths.py -k "liger" 2>&1 \
      | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|Error" | cut -c1-400
    bash benchmarks/install_kernels.sh /tmp/fla
    export PYTHONPATH=/tmp/site:/tmp/fla:. TRITON_CACHE_AUTOTUNING=1
    timeout $((570 - SECONDS)) python3 benchmarks/sft_throughput.py --shapes dense4b,qwen35_4b --steps 12 --warmup 3 \
      --skip-parity --modes packed,packed_liger_chunks,packed_ungrouped,stock --profile 1 \
      --profile-modes packed --tag _round10c --out "$OUT" 2>&1 | tee "$OUT/sft.log" \
      | grep -E "(packed|packed_liger_chunks|packed_ungrouped|stock): |dense /" | cut -c1-200
    ;;
  round10b)  # the grouped Gated DeltaNet inputs (SharedInputLoRA): its GPU test at the 4B shape (cuBLAS only), every
    # LoRA GEMM shape plus the four projections as four nodes and as one, then Qwen3.5-4B and dense 4B packed against
    # packed_ungrouped in one process (dense's pair is the same path twice: the run's noise), one profiled step each
    timeout 120 python3 -m pytest -q -rs -p no:cacheprovider -s tests/test_shared_input_lora.py -k on_a_gpu 2>&1 \
      | tee "$OUT/gpu_tests.log" | grep -E "relative|passed|failed|skipped" | cut -c1-400
    bash benchmarks/install_kernels.sh /tmp/fla
    export PYTHONPATH=/tmp/site:/tmp/fla:. TRITON_CACHE_AUTOTUNING=1
    timeout 150 python3 benchmarks/lora_gemm_shapes.py --shapes qwen35_4b,dense4b --tag _round10b --out "$OUT" 2>&1 \
      | tee "$OUT/lora_gemm_shapes.log" | grep -E "per step" | cut -c1-600
    timeout $((570 - SECONDS)) python3 benchmarks/sft_throughput.py --shapes qwen35_4b,dense4b --steps 12 --warmup 3 \
      --skip-parity --modes packed,packed_ungrouped --profile 1 --profile-modes packed --tag _round10b --out "$OUT" \
      2>&1 | tee "$OUT/sft.log" | grep -E "(packed|packed_ungrouped): " | cut -c1-200
    ;;
  hybrids)
    bash benchmarks/install_kernels.sh /tmp/fla
    export PYTHONPATH=/tmp/site:/tmp/fla:.
    timeout 330 python3 benchmarks/sft_throughput.py --shapes qwen35_4b --steps 4 --warmup 2 --tag _fla_all \
      --out "$OUT" 2>&1 | tee "$OUT/qwen35.log" | grep -E "stock =|tokens_per_s\": [0-9]" | cut -c1-300
    timeout 240 python3 benchmarks/sft_throughput.py --shapes nemotron4b --steps 3 --warmup 1 --tag _fla_all \
      --out "$OUT" 2>&1 | tee "$OUT/nemotron.log" | grep -E "stock =|tokens_per_s\": [0-9]" | cut -c1-300
    ;;
  encode23)  # round 23: stitch_vit, CLIP's attention as one Triton kernel for its 50-token rows (the image's Triton)
    # mutated: the padded keys no longer masked
    tests_and_mutation stitch_clip/_vit_attention_kernel.py \
      's/scores = tl.where(valid\[None, :\], scores, float("-inf"))/pass/' "gpu or asked" tests/test_vit_attention.py \
      tests/test_prepare_fast.py
    timeout 150 python3 benchmarks/vit_attention.py --name vit_attention_round23 --out "$OUT" 2>&1 \
      | tee "$OUT/vit_attention.log" | grep -E "b2048|Error" | cut -c1-200
    best=$(python3 -c "import json; r = json.load(open('$OUT/vit_attention_round23.json'))['rows']['2048']; \
      print(min((v['ms'], k) for k, v in r.items() if k.startswith('stitch_vit') and 'ms' in v)[1][11:])")
    encode_runs round23 stitch_compile_sdpa,stitch_compile,stitch_compile_$best,stitch_eager_sdpa,stitch_eager \
      stitch_compile,stitch_compile_sdpa,stitch_compile_$best
    ;;
  encode23b)  # chunks on two compute streams (one chunk's memory-bound kernels beside the other's GEMMs), q/k/v as one
    # GEMM, CUDA graphs, each with stitch_vit; the GPU test, and it again with a stream no longer waiting for its copy;
    # the GPU's power and clocks (nvidia-smi dmon) through the encode runs
    tests_and_mutation stitch_clip/encoder.py '/stream.wait_stream(main)  # the chunk/d' gpu tests/test_prepare_fast.py
    nvidia-smi dmon -s pc -d 1 > "$OUT/dmon.log" 2>&1 &
    variants=stitch_compile,stitch_compile_2s,stitch_compile_chunk512,stitch_compile_2s512,stitch_compile_qkv
    variants=$variants,stitch_reduce_overhead,stitch_reduce_overhead_2s512,stitch_compile_sdpa
    encode_runs round23b $variants "$(echo $variants | tr , '\n' | tac | paste -sd,)"
    kill %1
    ;;
  autotune23)  # whether benchmarks/triton_autotune_h200.tar.xz spares a fresh machine fla's autotuning: Qwen3.5-4B's
    # first packed step (177 s in graphs22q, which tuned) on a machine that has not run it
    use_fla
    timeout 400 python3 benchmarks/sft_throughput.py --shapes qwen35_4b --steps 3 --warmup 2 --skip-parity \
      --modes packed --tag _round23_autotune --out "$OUT" 2>&1 | tee "$OUT/sft_autotune.log" \
      | grep -E "packed: |warmup|Error" | cut -c1-300
    python3 -c "import json, sys; print('warmup_step_s', json.load(open(sys.argv[1]))['modes']['packed']['warmup_step_s'])" \
      "$OUT/sft_qwen35_4b_round23_autotune.json"
    ;;
  gputests23)  # every GPU test at the round's code (the tiny Qwen3.5 fla test among them), fla from the .whl carry
    use_fla
    timeout 560 python3 -m pytest -q -rs -p no:cacheprovider -k "gpu or cuda or asked" tests/test_cuda_graphs.py \
      tests/test_perf_lora_product.py tests/test_perf_fused_kernels.py tests/test_fast_paths.py tests/test_optimizer.py \
      tests/test_shared_input_lora.py tests/test_decode_static.py tests/test_vit_attention.py tests/test_prepare_fast.py \
      2>&1 | tee "$OUT/gpu_tests_all.log" | tail -15 | cut -c1-300
    ;;
  encode24)  # round 24: the MLP's fc1 -> quick-GELU -> fc2 in row chunks (its [rows, 3,072] intermediate in L2)
    nvidia-smi dmon -s pc -d 1 > "$OUT/dmon.log" 2>&1 &
    timeout 200 python3 benchmarks/mlp_l2.py --name mlp_l2_round24 --out "$OUT" 2>&1 | tee "$OUT/mlp_l2.log" \
      | grep -E "^(whole|rows|cublas|gelu)|Error" | cut -c1-250
    best=$(python3 -c "import json; r = json.load(open('$OUT/mlp_l2_round24.json'))['rows']; \
      print(','.join('stitch_compile_mlp' + k[4:-9] for _, k in sorted((v['ms'], k) for k, v in r.items() \
      if k.startswith('rows') and 'ms' in v)[:2]))")
    encode_runs round24 stitch_compile,$best,stitch_compile_chunk128,stitch_reduce_overhead_chunk64 \
      "$(echo stitch_compile,$best | tr , '\n' | tac | paste -sd,)"
    kill %1
    ;;
  quack24)  # round 24: quack (CuTe DSL) GEMMs with the MLP's GELU and the residual add in their epilogues
    use_quack
    timeout 540 python3 benchmarks/quack_gemm.py --name quack_gemm_round24 --out "$OUT" 2>&1 \
      | tee "$OUT/quack_gemm.log" | grep -E "^(plain|fc1_gelu|fc2_residual|mlp)|Error" | cut -c1-250
    ;;
  encode24b)  # round 24: fc1 + bias + quick-GELU as one quack GEMM in the shipped tower (stitch_clip/gemm.py)
    use_quack
    fused_mlp_tests_and_mutation
    nvidia-smi dmon -s pc -d 1 > "$OUT/dmon.log" 2>&1 &
    encode_runs round24b stitch_compile_unfused,stitch_compile,stitch_eager \
      stitch_compile,stitch_compile_unfused
    kill %1
    ;;
  final24)  # round 24's final code, quack installed as stitch-clip[hopper] would: its GPU tests, the shipped stitch prepare
    # end to end on JPEG (nvjpeg decode, the encoder's quack GEMM), encode only against the unfused tower
    use_quack
    # .whl-demo came in a call of its own (with the quack carry it is over 64 MiB) and waits in /tmp/whl-demo
    [ -d .whl-demo ] || cp -r /tmp/whl-demo .whl-demo
    install_datasets
    fused_mlp_tests_and_mutation
    # TAG names the results (final24: 7017cf9, fused at load; final24b: the fused MLP only with compile); the last
    # run compiles (and so fuses) though 64k is under data.prepare.compile's auto threshold
    tag=${TAG:-final24}
    for run in "16384" "65536" "65536 --compile always"; do
      set -- $run
      [ $SECONDS -lt 330 ] && timeout 200 python3 benchmarks/prepare_stitch.py --images $1 --decode device \
        --skip-encode "${@:2}" --name "prepare_stitch_${tag}_$1${2:+_compiled}" --out "$OUT" 2>&1 \
        | tee "$OUT/prepare_$1${2:+_compiled}.log" | grep -E "^prepare|Error" | cut -c1-160
    done
    encode_runs $tag stitch_compile,stitch_compile_unfused stitch_compile_unfused,stitch_compile
    # more than the 8 files a call brings back: one archive
    (cd "$OUT" && tar czf "$tag.tgz" ./*.json ./*.log && rm -f ./*.json ./*.log)
    ;;
  grpo25)  # round 25: GRPO's step on the code that ships (last timed in round 4, before the SFT step's CUDA graphs,
    # fused AdamW and the LoRA changes): the rollout engine's GPU tests (+ a mutation: the fixed cache no longer
    # stores the new keys), then the breakdown with the fixed-cache engine and transformers' generate in one process
    tests_and_mutation stitch/rollout/decode.py '/self.keys\[layer_idx\].index_copy_(2, self.slots, key)/d' \
      "gpu or cuda" tests/test_decode_static.py \
      tests/test_cuda_graphs.py
    timeout 330 python3 benchmarks/grpo_breakdown.py --shape dense4b --modes stitch,generate --prompts 8 --group 8 \
      --micro-batch-size 16 --steps 3 --warmup 1 --skip-parity --profile-rollout 1 --tag _round25 --out "$OUT" 2>&1 \
      | tee "$OUT/grpo.log" | grep -E "^(stitch|generate) \||rollout tok/s|Error" | cut -c1-250
    ;;
  final25)  # round 25's GPU checks of the code that ships: the fused MLP's tests at its final code (+ the dropped-bias
    # mutation; carry .whl-quack2 .whl-pydantic after a call that kept .whl-quack1 in /tmp/quack), then the rollout
    # engine's GPU tests with the fp32 graph-against-generate test (+ grpo25's mutation, which the bf16 test missed)
    use_quack
    fused_mlp_tests_and_mutation
    for f in gpu_tests gpu_tests_mutated; do mv "$OUT/$f.log" "$OUT/${f}_fused_mlp.log"; done
    tests_and_mutation stitch/rollout/decode.py '/self.keys\[layer_idx\].index_copy_(2, self.slots, key)/d' \
      "gpu or cuda" tests/test_decode_static.py
    # GRPO's log-probs from the head on labelled positions in chunks (shipped) against the full fp32 logits, in one
    # process, each mode's log-prob and gradient passes timed and profiled (grpo25: log-probs 0.92 s, train 0.61)
    timeout 330 python3 benchmarks/grpo_breakdown.py --shape dense4b --modes stitch,full_logits --prompts 8 --group 8 \
      --micro-batch-size 16 --steps 3 --warmup 1 --skip-parity --profile-logprobs 2 --profile-modes stitch,full_logits \
      --tag _round25_logprobs --out "$OUT" 2>&1 | tee "$OUT/grpo_logprobs.log" \
      | grep -E "^(stitch|full_logits) \||full_logits /|Error" | cut -c1-250
    ;;
  grpo25b)  # round 25's final code (the log-prob head after its review): GRPO with the chunked head and with full
    # logits in one process, no profile
    timeout 300 python3 benchmarks/grpo_breakdown.py --shape dense4b --modes stitch,full_logits --prompts 8 --group 8 \
      --micro-batch-size 16 --steps 3 --warmup 1 --skip-parity --tag _round25_final --out "$OUT" 2>&1 \
      | tee "$OUT/grpo_final.log" | grep -E "^(stitch|full_logits) \||full_logits /|Error" | cut -c1-250
    ;;
  final25c)  # after the review that made StitchedModel.loss share _labelled with token_logprobs: dense 4B SFT's four
    # modes in one process (the issue's dense targets, last met in round 22), then GRPO's step
    timeout 300 python3 benchmarks/sft_throughput.py --shapes dense4b --steps 10 --warmup 4 --skip-parity \
      --modes packed,baseline,llava,stock --tag _round25 --out "$OUT" 2>&1 | tee "$OUT/sft.log" \
      | grep -E "stock =|(packed|baseline|llava|stock): |capture failed|Error" | cut -c1-300
    timeout 200 python3 benchmarks/grpo_breakdown.py --shape dense4b --modes stitch --prompts 8 --group 8 \
      --micro-batch-size 16 --steps 3 --warmup 1 --skip-parity --tag _round25_review --out "$OUT" 2>&1 \
      | tee "$OUT/grpo_review.log" | grep -E "^stitch \||Error" | cut -c1-250
    ;;
esac
ls -la "$OUT"
