#!/usr/bin/env bash
# The H200 runs of docs/benchmarks.md, grouped into device calls that fit the 10-minute limit.
#
# On the device, after the set-up calls of shared/device/README.md (models in /root/models,
# .vstage3 carried: FlashInfer, the stock baseline), from the repo root, back to back (the JIT
# cache of the first call is lost once the machine goes back):
#     bash .vscripts/setup.sh && source .vscripts/env.sh && bash benchmarks/run_h200.sh jit
#     bash .vscripts/setup.sh && source .vscripts/env.sh && bash benchmarks/run_h200.sh verify
#     bash .vscripts/setup.sh && source .vscripts/env.sh && bash benchmarks/run_h200.sh engine
#     bash .vscripts/setup.sh && source .vscripts/env.sh && bash benchmarks/run_h200.sh http
# To wait in a call for models built in the background by an earlier one, match the script with
# a pattern that does not match the waiting command itself: `while pgrep -f "[m]ake_models.py"`
# (a plain `pgrep -f make_models.py` finds the call's own shell and waits out the call's limit).
#
#   jit       FlashInfer's JIT (sampling + top-k kernels: 4-8 min on a new machine, cached in
#             ~/.cache/flashinfer for the next calls on the same machine), the two libraries
#             left in $OUT for .vstage4 (below): the first call on a new machine without them
#   verify    the MRV2 GPU tests (they JIT the top-k themselves if `jit` did not run: not
#             beside `jit` in one call, whose compile they then wait for), the C loops' tests
#             as built there, the compaction and host unpack at top_k 50 and with every row
#             wider than the width cap                                               (~5 min)
#   engine    stock / on interleaved, each engine in its own process, all pinned to the same
#             5 CPUs (--pin 5), compiled, 8 rounds; the on engine also runs each round with
#             every request opted out (--same-process-optout: on/on_optout without a
#             per-process offset)                                                    (~6 min)
#   pairs     one mask engine, in-process, masked and opted-out rounds alternating, 10 rounds:
#             on/on_optout from one more process                                     (~2 min)
#   generations  `engine` with fresh engine processes 5 times, 2 rounds each: 5 clusters of
#             on/stock per call instead of 1 (with warm compile caches an engine starts in
#             ~17 s; run after `engine` on the same machine)                      (~8-9 min)
#   control   probe_machine_noise.py (vCPU speeds; where two processes taking turns run),
#             then stock / off / on (+ on_optout) at B=256 in fresh processes, 2 rounds per
#             generation: off/stock's spread across generations against on/on_optout's
#             (`pool_paired_rounds.py` prints both as cluster_spread)             (~9.5 min)
#   rounds [B]  stock / off / on (+ on_optout, + on_stock_sampler: the on engine's opted-out
#             rounds on vLLM's own FlashInfer sampler) at B=1, 64 and 256 (or B alone, e.g.
#             256), 2 generations of 6 rounds (a fresh machine's first engine starts compile,
#             ~3 min, and both generations must fit the call): issue 11's
#             ratios at every batch size with the `off` control beside them, and the mask
#             engine against stock's sampling path within one process (`pool_paired_rounds.py
#             --baseline on_stock_sampler --configs on,on_optout`); every round also has its
#             median engine step (`--metric median_step_tokens_per_s`)            (~9.5 min)
#   logprobs [B]  stock / on (+ on_optout) with logprobs=1, the same way, 4 rounds   (~5 min)
#             (one set of engine processes per call at B=1/64/256; pool the calls' JSON with
#             pool_paired_rounds.py, each call a cluster); with B (e.g. 256) that batch size
#             alone, 3 generations of 4 rounds: three clusters per call          (~6-9 min)
#   host [N]  FlashInfer's JIT (minutes on a new machine, ~30 s once cached), then N (3) runs
#             of bench_host_overhead.py --pin-fastest: criterion 4, several runs on one host
#             (~7 min on a new machine)
#   http      FlashInfer's JIT, host overhead; HTTP throughput at concurrency 1 and 64,
#             compiled, 6 rounds (the rounds of C=64 spread ~4%: pool several servers' JSON)
#             (~5 min after `host` or `verify` on the same machine)
#   http_stop HTTP at concurrency 1 and 64, rows held (off / compact) and, in the same
#             rounds, sent every step (off_stop / compact_stop: a never-matching stop
#             string), compiled, 6 rounds                                           (~6 min)
#   v1        the V1-runner GPU tests, ngram speculative decoding included           (~5 min)
#   spec      EAGLE speculative decoding on Model Runner V2, the GPU test
#   families  the MoE, hybrid and vision-language GPU tests (carry .vstage5: MoE kernels;
#             ~2 + 1 min for MoE and VL, the hybrid's Triton kernels compile on first use)
#   hybrid    the hybrid's GPU test alone (its Triton kernels compile on first use; carry .vstage5)
#   moe       the MoE's and the hybrid's stock / on throughput, eager (builds both models as
#             `families` does, or reuses them; carry .vstage5)                    (<= 9.5 min)
#   vl        the vision-language model's stock / on throughput, eager, text prompts (builds
#             it as `families` does, or reuses it)                                 (<= 5 min)
#   spec_throughput  stock / on throughput under EAGLE (a draft from the target's own weights,
#             Model Runner V2) and ngram (V1) speculative decoding, eager         (<= 9.5 min)
#   layouts [K]  on `nvidia-h200-x2` (two GPUs; the set-up calls again there, .vstage5 carried
#             for the MoE): the GPU tests of TP=2, PP=2, expert parallelism (MoE) and DP=2
#             behind `vllm serve`; K, a pytest -k expression, selects some of them (four engine
#             starts may not fit one call: e.g. `layouts "tensor or pipeline"`, then
#             `layouts "expert or data"`)                                          (<= 9.5 min)
#   layouts_throughput  on `nvidia-h200-x2`: stock / on throughput with TP=2 and PP=2, eager
#                                                                                  (<= 9.5 min)
#   profile [B]  host time per step by function at B (default 256; e.g. 1,64): off, optout,
#             on (in-process engines)
#   profile_optout [B]  with logprobs=1 at B (default 256): the on engine's masked and
#             opted-out rounds in turns within one process (on / on_optout), host time per step
#             by function and each mode's median engine step; the only engine of its process (a
#             second engine built in one process runs slower: session 35)    (~3 min; ~5 on a
#             machine whose compile cache is cold)
#   frontend  the frontend's CPU per step with vLLM's real OutputProcessor, logprobs=1, 256
#             requests, stock / on in lock step (bench_output_processor.py; no GPU used: the
#             host's CPU, which bounds an engine with logprobs)                    (~3 min)
#   paths     step costs of the sampling paths, top_k 50 (with logprobs) and 1024 (~2 min)
#
# Each step writes <step>.json and <step>.log under $OUT (default bench_out/) and runs under its
# own time limit; a step that fails is reported and the next one runs. The exit status is the
# number of failed steps. SMALL=1 runs the benchmark steps of `engine`, `logprobs`, `host` and
# `http` as their CPU smoke runs (--small), to check this script without a GPU; the tests need
# the GPU.
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
# package_dir NAME: where the installed Python package NAME lives (no import); fails, with a
# message, where NAME is not installed (a machine without the set-up calls of shared/device).
package_dir() {
  python3 -c "import importlib.util as u; s = u.find_spec('$1'); print(s.submodule_search_locations[0]) if s else exit(1)" \
    || { echo "== $1 is not installed here: run the device's set-up calls first" >&2; return 1; }
}
tests_path="$PWD:$PWD/tests:$PWD/tests/support${PYTHONPATH:+:$PYTHONPATH}"
# FlashInfer's sampling and top-k kernels, built once on this kind of machine by `jit` (below),
# can skip the JIT on a new machine: FlashInfer loads a module from its AOT directory
# (flashinfer/data/aot/<name>/<name>.so) without ninja when the file is there. `jit` leaves
# both libraries in $out as <name>.so.xz (~8 MB); copied into a git-ignored .vstage4/ here and
# carried, they are installed before any group (.vstage1 and .vstage4 together no longer fit the
# 64 MiB carry limit beside the repo: carry .vstage4 in a call of its own that copies it to
# /root/vstage4, and copy it back to .vstage4 in the call that runs a group).
# (A copy of the whole JIT cache did not work: ninja rebuilt it against this machine's paths.)
# benchmarks/build_flashinfer_aot.sh builds the same two files without a GPU (the dev machine).
# Not under SMALL=1, which runs on the dev machine's own FlashInfer.
if [ -z "$small" ] && compgen -G ".vstage4/*.so.xz" > /dev/null; then
  aot=$(package_dir flashinfer) || exit 1
  aot=$aot/data/aot
  for packed in .vstage4/*.so.xz; do
    name=$(basename "$packed" .so.xz)
    mkdir -p "$aot/$name" && xz -dc "$packed" > "$aot/$name/$name.so"
  done
  echo "== flashinfer AOT modules installed from .vstage4: $(ls "$aot")"
fi

# The C loops (core/_hand_out_native.c, engine/_take_rows_native.c), as setup.sh's install built
# them, into this checkout: the tests import the package from here (tests_path), and the device's
# copy of the working tree, like git, has no built files. Printed, so that each call says which
# loops ran.
if [ -z "$small" ]; then
  for module in core/_hand_out_native engine/_take_rows_native; do
    native=$(cd / && python3 -c "import glob, vllm_sampling_mask as p; \
print(*glob.glob(p.__path__[0] + '/$module*.so'))" 2>/dev/null)
    if [ -n "$native" ]; then
      cp $native "vllm_sampling_mask/$(dirname $module)/" && echo "== $module: C"
    else
      echo "== $module: not built by setup.sh's install (the Python loop runs)"
    fi
  done
fi

models=/root/models
# family_models CALLS: the tiny_variants builders (target t = the Qwen3-0.6B-shaped model), the
# widths test_gpu_model_families.py uses; each reuses a model already built.
family_models() {
  PYTHONPATH="$tests_path" step family_models 60 python3 -c "from tiny_variants import build_tiny_hybrid, build_tiny_moe, build_tiny_vl; \
t = '$models/qwen3-0.6b'; $1"
}

# vLLM's MoE kernels and compressed-tensors, which the slim build leaves out: .vstage5
# (moe_C.so.xz, the compressed_tensors and loguru wheels; benchmarks/README), carried alone.
# Only where they are missing (a full vLLM install has both), never under SMALL=1.
install_moe_kernels() {
  local site
  site=$(package_dir vllm)/.. || exit 1
  if [ -z "$small" ] && [ -f .vstage5/moe_C.so.xz ] \
      && [ ! -f "$site/vllm/_moe_C_stable_libtorch.abi3.so" ]; then
    xz -dc .vstage5/moe_C.so.xz > "$site/vllm/_moe_C_stable_libtorch.abi3.so"
    python3 -m pip install -q --no-index --no-deps --target "$site" .vstage5/*.whl 2>&1 \
      | grep -v "WARNING: Target directory" || true
  fi
}

flashinfer_jit() {
  step flashinfer_jit 540 python3 -c "import torch, flashinfer; x = torch.randn(4, 151936, \
device='cuda'); flashinfer.top_k(x, 50, sorted=True, deterministic=True); \
flashinfer.sampling.top_k_top_p_sampling_from_logits(x, torch.full((4,), 50, device='cuda', \
dtype=torch.int32), torch.full((4,), 0.9, device='cuda')); print('flashinfer JIT done')"
}

case "${1:-}" in
  jit)
    flashinfer_jit
    for so in ~/.cache/flashinfer/*/*/cached_ops/{topk,sampling}/*.so; do
      xz -T0 -9 -c "$so" > "$out/$(basename "$so").xz"
    done
    ls -l "$out"/*.so.xz
    ;;
  verify)
    PYTHONPATH="$tests_path" VLLM_ALLOW_INSECURE_SERIALIZATION=1 \
      step gpu_tests 330 python3 -m pytest -q -s -m gpu tests/test_candidate_sampler.py \
      tests/test_compaction_kernel.py tests/test_gpu_engine.py
    # the C loops against their Python references, as built on this machine (no GPU needed)
    PYTHONPATH="$tests_path" step native_loops 120 python3 -m pytest -q \
      tests/test_native_loops.py
    bench bench_compaction compaction 60 --batch-sizes 256,512 --vocab-sizes 151936 \
      --top-ks 50,4097 --unpack-reps 10
    ;;
  engine)
    # An engine process keeps much of the speed it drew at its start (off/stock, vLLM's own
    # code on both sides, 0.90 in one run and 1.03 in the next at B=256), so each call is one
    # sample of on/stock; on/on_optout pairs rounds of one process instead.
    bench bench_engine_throughput engine 560 --configs stock,on --same-process-optout \
      --interleave --pin 5 "${compiled[@]}" --reps 8
    ;;
  pairs)
    bench bench_engine_throughput engine_pairs 420 --configs on --same-process-optout \
      "${compiled[@]}" --reps 10
    ;;
  generations)
    bench bench_engine_throughput engine_generations 570 --configs stock,on --same-process-optout \
      --interleave --pin 5 "${compiled[@]}" --generations 5 --reps 2
    ;;
  control)
    # First the machine probe: do two processes taking turns keep a vCPU each? Then fresh
    # engine processes at B=256: off/stock (vLLM's own code on both sides) spreads from one
    # generation to the next by the per-process offset plus round noise, on/on_optout (one
    # process) by round noise alone; on/stock is criterion 1's sample. The call's time limit
    # cuts it after 3-4 generations (each is written as it finishes).
    step machine_noise 120 python3 benchmarks/probe_machine_noise.py --out "$out/machine_noise.json"
    bench bench_engine_throughput engine_control 545 --configs stock,off,on --same-process-optout \
      --interleave --pin 5 "${compiled[@]}" --generations 5 --reps 2 --batch-sizes 256
    ;;
  rounds)
    bench bench_engine_throughput engine_rounds 560 --configs stock,off,on --same-process-optout \
      --same-process-stock-sampler --interleave --pin 5 "${compiled[@]}" --generations 2 --reps 6 \
      ${2:+--batch-sizes "$2"}
    ;;
  logprobs)
    bench bench_engine_throughput engine_logprobs $([ -n "${2:-}" ] && echo 560 || echo 330) \
      --configs stock,on --same-process-optout --interleave --pin 5 "${compiled[@]}" --reps 4 \
      --logprobs 1 ${2:+--batch-sizes "$2" --generations 3}
    ;;
  host)
    # Criterion 4 on this host: ${2:-3} runs of bench_host_overhead, after FlashInfer's JIT (the
    # launch timers sample with it: minutes on a new machine, which would eat a run's limit).
    # Runs caught in one of a host's slow phases (vLLM's own encode_stock / decode_stock at
    # ~2x) are set apart by those figures (docs/benchmarks.md, "Host work per step").
    [ -n "$small" ] || flashinfer_jit
    for run in $(seq "${2:-3}"); do
      bench bench_host_overhead "host_overhead_$run" 90 --pin-fastest
    done
    ;;
  http)
    # The host-overhead step's launch timers sample with FlashInfer: its JIT first (~30 s once
    # cached; minutes on a new machine, where `host` or `verify` should run first).
    [ -n "$small" ] || flashinfer_jit
    bench bench_host_overhead host_overhead 60 --pin-fastest
    bench bench_http_throughput http 330 /root/models/qwen3-0.6b "${compiled[@]}" \
      --concurrency 1,64 --rounds 6
    ;;
  http_stop)
    # One server, rows held until the end (off / compact) against rows sent every step
    # (off_stop / compact_stop: a stop string no output contains)
    bench bench_http_throughput http_stop 480 /root/models/qwen3-0.6b "${compiled[@]}" \
      --concurrency 1,64 --modes off,compact,off_stop,compact_stop --rounds 6
    ;;
  v1)
    PYTHONPATH="$tests_path" VLLM_ALLOW_INSECURE_SERIALIZATION=1 \
      step gpu_tests_v1 420 python3 -m pytest -q -s -m gpu tests/test_gpu_engine_v1.py
    ;;
  spec)
    # tests/hang_dump: every Python process still running after HANG_DUMP_S seconds writes its
    # threads' stacks to the log (the test spawns its engine processes, so they get it too).
    PYTHONPATH="$PWD/tests/hang_dump:$tests_path" HANG_DUMP_S=250 VLLM_ALLOW_INSECURE_SERIALIZATION=1 \
      step gpu_tests_spec 300 python3 -m pytest -q -s -m gpu tests/test_gpu_engine_speculative.py
    ;;
  layouts)
    install_moe_kernels
    PYTHONPATH="$tests_path" VLLM_ALLOW_INSECURE_SERIALIZATION=1 \
      step gpu_tests_layouts 570 python3 -m pytest -q -s -m gpu tests/test_gpu_parallel_layouts.py \
      ${2:+-k "$2"}
    ;;
  layouts_throughput)
    for layout in tensor pipeline; do
      bench bench_engine_throughput "engine_${layout}_parallel" 285 --configs stock,on \
        --interleave --pin 5 --batch-sizes 64,256 --reps 3 \
        --engine-args "{\"${layout}_parallel_size\": 2}"
    done
    ;;
  families|hybrid|moe)
    install_moe_kernels
    if [ "$1" != moe ]; then  # families: the whole file; hybrid: its test alone
      selection=(tests/test_gpu_model_families.py)
      [ "$1" = hybrid ] && selection+=(-k hybrid)
      PYTHONPATH="$tests_path" VLLM_ALLOW_INSECURE_SERIALIZATION=1 \
        step "gpu_tests_$1" 560 python3 -m pytest -q -s -m gpu "${selection[@]}"
    else  # the MoE and hybrid models of the families test, built here unless it ran
      family_models "build_tiny_moe(t, '$models/qwen3-moe-tiny', hidden_size=512, head_dim=64); \
build_tiny_hybrid(t, '$models/qwen3-next-tiny', hidden_size=512, head_dim=64)"
      bench bench_engine_throughput engine_moe 210 --model "$models/qwen3-moe-tiny" \
        --configs stock,on --interleave --pin 5 --batch-sizes 64,256 --reps 3
      bench bench_engine_throughput engine_hybrid 310 --model "$models/qwen3-next-tiny" \
        --configs stock,on --interleave --pin 5 --batch-sizes 64,256 --reps 3 \
        --engine-args '{"gdn_prefill_backend": "triton"}'
    fi
    ;;
  vl)
    family_models "build_tiny_vl(t, '$models/qwen2-vl-tiny')"
    bench bench_engine_throughput engine_vl 230 --model "$models/qwen2-vl-tiny" \
      --configs stock,on --interleave --pin 5 --batch-sizes 64,256 --reps 3
    ;;
  spec_throughput)
    draft=/root/models/eagle-draft
    PYTHONPATH="$tests_path" step eagle_draft 60 python3 -c "from tiny_variants import \
build_tiny_eagle_draft as b; b('/root/models/qwen3-0.6b', '$draft')"
    bench bench_engine_throughput engine_eagle 295 --configs stock,on --interleave --pin 5 \
      --batch-sizes 64,256 --reps 3 --engine-args \
      "{\"speculative_config\": {\"method\": \"eagle\", \"model\": \"$draft\", \"num_speculative_tokens\": 3}}"
    bench bench_engine_throughput engine_ngram 230 --configs stock,on --interleave --pin 5 \
      --batch-sizes 64,256 --reps 3 --engine-args '{"speculative_config": {"method": "ngram",
      "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}}'
    ;;
  profile)
    # Host time per step by function, in-process engines (off, optout, on) at B (default 256)
    batches=${2:-256}
    bench profile_engine_step "profile_b${batches//,/_}" 540 --no-enforce-eager \
      --configs off,optout,on --batch-sizes "$batches" --reps 4 --cprofile 40
    ;;
  profile_optout)
    # logprobs=1 at B (default 256): the on engine's masked and opted-out rounds taking turns
    # in one process, host time per step by function and the median engine step
    batches=${2:-256}
    bench profile_engine_step "profile_optout_b${batches//,/_}" 540 --no-enforce-eager \
      --configs on --same-process-optout --logprobs 1 --batch-sizes "$batches" --reps 6
    ;;
  frontend)
    bench bench_output_processor output_processor 300 --rounds 12
    ;;
  paths)
    # GPU only (no --small smoke): `step`, not `bench`, so SMALL=1 does not pass --small
    step sampler_paths 90 python3 benchmarks/bench_sampler_paths.py --logprobs \
      --out "$out/sampler_paths.json"
    # top_k 1024, the widest a step samples with the candidate sampler (opted-out steps too)
    step sampler_paths_top_k_1024 90 python3 benchmarks/bench_sampler_paths.py --top-k 1024 \
      --out "$out/sampler_paths_top_k_1024.json"
    ;;
  *)
    echo "usage: [SMALL=1] [OUT=dir] bash benchmarks/run_h200.sh jit|verify|engine|pairs|generations|control|rounds [B]|logprobs [B]|http|http_stop|v1|spec|spec_throughput|families|hybrid|moe|vl|layouts|layouts_throughput|profile [B]|profile_optout [B]|frontend|paths" >&2
    exit 2
    ;;
esac
echo "== done: $failed failed step(s); files in $out"
exit "$failed"
