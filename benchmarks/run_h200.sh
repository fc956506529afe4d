#!/usr/bin/env bash
# The H200 runs of docs/benchmarks.md, grouped into device calls that fit the 10-minute limit.
#
# On the device, after the set-up calls of shared/device/README.md (models in /root/models),
# from the repo root, one call each:
#     bash .vscripts/setup.sh && source .vscripts/env.sh && bash benchmarks/run_h200.sh verify
#     bash .vscripts/setup.sh && source .vscripts/env.sh && bash benchmarks/run_h200.sh profile
#     bash .vscripts/setup.sh && bash .vstage3/install_flashinfer.sh && source .vscripts/env.sh \
#         && bash benchmarks/run_h200.sh flashinfer          (carry .vstage3, see README.md)
#
#   verify      GPU tests (pytest -m gpu), host overhead, engine throughput of off / on /
#               optout interleaved, compiled, 8 rounds                           (~8 min)
#   profile     per-step profile (cProfile + CUDA kernel table), then HTTP throughput at
#               concurrency 1 and 64, compiled                                   (~9 min)
#   flashinfer  off / on with vLLM's FlashInfer sampler as the off engine's     (~5 min)
#
# Each step writes <step>.json and <step>.log under $OUT (default bench_out/) and runs under its
# own time limit; a step that fails is reported and the next one runs. The exit status is the
# number of failed steps. SMALL=1 runs every step as its CPU smoke run (--small), to check this
# script without a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench_out}
mkdir -p "$out"
small=${SMALL:-}
failed=0

# step NAME SECONDS COMMAND...: run COMMAND with its output in $out/NAME.log, tail the log.
step() {
  local name=$1 seconds=$2
  shift 2
  echo "== $name ($(date +%H:%M:%S), limit ${seconds}s): $*"
  timeout "$seconds" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$out/$name.log"
  if [ "$rc" -ne 0 ]; then
    echo "== $name FAILED (exit $rc)"
    failed=$((failed + 1))
  fi
}

# bench SCRIPT NAME SECONDS [ARGS...]: a benchmark script, full size or --small.
bench() {
  local script=$1 name=$2 seconds=$3
  shift 3
  if [ -n "$small" ]; then
    step "$name" "$seconds" python3 "benchmarks/$script.py" --small --out "$out/$name.json"
  else
    step "$name" "$seconds" python3 "benchmarks/$script.py" "$@" --out "$out/$name.json"
  fi
}

compiled=(--no-enforce-eager)
case "${1:-}" in
  verify)
    PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" VLLM_ALLOW_INSECURE_SERIALIZATION=1 \
      step gpu_tests 200 python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/test_compaction_kernel.py tests/test_gpu_engine.py
    bench bench_host_overhead host_overhead 45
    bench bench_engine_throughput engine 330 --configs off,on,optout --interleave \
      "${compiled[@]}" --reps 8
    ;;
  profile)
    bench profile_engine_step profile 200 "${compiled[@]}" --cprofile 40 --cuda-profile
    bench bench_http_throughput http 330 /root/models/qwen3-0.6b "${compiled[@]}" \
      --concurrency 1,64
    ;;
  flashinfer)
    VLLM_USE_FLASHINFER_SAMPLER=1 bench bench_engine_throughput engine_flashinfer 540 \
      --configs off,on --interleave "${compiled[@]}" --reps 4
    ;;
  *)
    echo "usage: [SMALL=1] [OUT=dir] bash benchmarks/run_h200.sh verify|profile|flashinfer" >&2
    exit 2
    ;;
esac
echo "== done: $failed failed step(s); files in $out"
exit "$failed"
