#!/usr/bin/env bash
# One lent-GPU session's checks in one call, most important first, each under its own time limit
# so that a hang costs one step, not the lease. Run on the device machine from the repository
# root with carry [".gpu-carry"] (built here by bench/gpu_carry.sh):
#
#   bash bench/gpu_check.sh [PART...]   # logs and JSON land in $OUT (or /tmp/gpu-check)
#
# Every step is capped by what is left of GPU_CHECK_BUDGET_S (default 540 s, for a 590 s call)
# counted from the script's start; a step with under 10 s left is skipped and logged as such.
# The exit status is 1 when torch sees no GPU or any step failed, timed out or was skipped.
#
# Parts (smoke and bench when none is named; the limits below are caps, not estimates):
#   tests    NIXL's VRAM path between two processes; the fused Triton kernels against their
#            torch references; engine parity and CUDA graphs (fused kernels on, the default);
#            the serving stack on one GPU
#   smoke    NIXL's VRAM path, the attention kernels' compile-once check and the serving
#            stack: ~2 min, for a lease too short for the whole of tests beside serve
#   graphs   GPU parity and CUDA graphs alone (fused kernels on): ~1 min, beside smoke when a
#            change to the graph runner has not run on a GPU yet
#   bench    `bench gpu` graphs and W1 with the fused kernels on, then off
#   profile  one decode step's host and device time
#   c1       one long disaggregated c=1 loop (400 requests, engine processes), every service
#            and engine process sampled with py-spy: where a single stream's time goes. Every
#            py-spy recording's summary (bench/spy_summary.py) goes into the log (5 .spy
#            files: beside `serve`'s 3, the log and py-spy.txt that is over the 8 files the
#            device tool brings back, so not in one call with it)
#   serve    `bench serve` with each engine in its worker, then with --engine-process (each
#            worker's engine in a process of its own, the default on GPUs since session 33),
#            then that with PDSERVE_SWITCH_INTERVAL_MS=1 (GIL hand-offs), all at
#            --stream-interval 1 (session 33 ran 8 too: the same c=1 TPOT); ~6 min, the prefill
#            worker sampled with py-spy during the first, the decode worker and its engine
#            process during the second
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
log=$out/log.txt
: >"$log"  # this run's steps alone decide its exit status
# shellcheck source=/dev/null
source .gpu-carry/setup.sh || { echo "carried packages did not install" | tee -a "$log"; exit 1; }
pytest_q=(python3 -m pytest -o addopts= -p no:cacheprovider -q -rs)

budget=${GPU_CHECK_BUDGET_S:-540}

step() {  # step LIMIT_S CMD...: runs CMD under LIMIT_S seconds (less if the budget has less
  # left), logs its output and exit code
  local limit=$1 left=$((budget - SECONDS))
  shift
  if [ "$left" -lt 10 ]; then
    echo "== skipped (budget of ${budget}s spent): $*" | tee -a "$log"
    echo "== rc=skipped" | tee -a "$log"
    return
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  echo "== $(date +%T) [${limit}s] $*" | tee -a "$log"
  timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$log"
  echo "== rc=${PIPESTATUS[0]}" | tee -a "$log"
}

versions() {
  step 30 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  step 60 python3 -c "import torch, triton, transformers, grpc, google.protobuf as pb, nixl
print(torch.__version__, torch.version.cuda, triton.__version__, transformers.__version__,
      grpc.__version__, pb.__version__, torch.cuda.get_device_name())"
}

part_tests() {
  versions
  step 60 "${pytest_q[@]}" -m gpu tests/test_kvtransfer.py
  step 150 "${pytest_q[@]}" tests/test_triton_fused.py tests/test_triton_kernels.py
  step 240 "${pytest_q[@]}" -m "not slow" tests/test_gpu_parity.py tests/test_cuda_graph.py \
    tests/test_model_parity.py
  step 150 "${pytest_q[@]}" tests/test_serving_gpu.py
}

part_smoke() {
  versions
  step 60 "${pytest_q[@]}" -m gpu tests/test_kvtransfer.py
  step 90 "${pytest_q[@]}" tests/test_triton_kernels.py -k compiles_once
  step 150 "${pytest_q[@]}" tests/test_serving_gpu.py
}

part_graphs() {
  step 150 "${pytest_q[@]}" -m "not slow" tests/test_gpu_parity.py tests/test_cuda_graph.py
}

part_bench() {
  step 120 python3 -m engine.cli bench gpu --only graphs,w1 --json-out "$out/fused.json"
  step 120 env PDSERVE_DISABLE_TRITON_FUSED=1 python3 -m engine.cli bench gpu --only graphs,w1 \
    --json-out "$out/unfused.json"
}

part_profile() {
  step 90 python3 -m bench.gpu_step_profile --batches 1,32 --top 15
}

wait_for_serving() {  # waits (up to 150 s) for the next disaggregated c=1 round that this
  # step's bench logs: the closed loops at c=8 and 32 come next. A fixed sleep missed them on
  # the H200, where a whole `bench serve` ran in 46 s (session 47).
  local before
  before=$(grep -c "disagg concurrency 1:" "$log")
  for _ in $(seq 300); do
    [ "$(grep -c "disagg concurrency 1:" "$log")" -gt "$before" ] && return 0
    sleep 0.5
  done
  return 1
}

spy() {  # spy NAME PID [THREADS]: 8 s of py-spy over PID's running threads, then its summary
  # (bench/spy_summary.py; THREADS: a regex of the threads whose functions it lists) in the log
  [ -n "$2" ] || return
  py-spy record -p "$2" -d 8 -r 250 -f raw --threads -o "$out/$1.spy" --nonblocking \
    >>"$out/py-spy.txt" 2>&1 || return
  local text
  text=$(python3 -m bench.spy_summary "$out/$1.spy" --seconds 8 --rate 250 --top 12 \
    --thread "${3:-.}" 2>&1)
  printf '== py-spy %s (pid %s)\n%s\n' "$1" "$2" "$text" >>"$log"
}

sample_prefill_worker() {  # the prefill worker (its engine runs inside it in the first run)
  wait_for_serving || return
  local pid
  pid=$(pgrep -f "engine.cli prefill" | head -1)
  [ -n "$pid" ] && spy prefill "$pid" "pdserve-engine$|MainThread"
}

sample_decode_worker() {  # the decode worker and its engine process
  wait_for_serving || return
  local worker engine
  worker=$(pgrep -f "engine.cli decode" | head -1)
  [ -n "$worker" ] || return
  engine=$(pgrep -P "$worker" -f engine.engine_proc | head -1)
  spy decode-worker "$worker" MainThread &
  [ -n "$engine" ] && spy decode-engine "$engine" "pdserve-engine$"
  wait
}

sample_c1() {  # every service and engine process, 14 s after the decode worker appears (its
  # engine's graphs are captured by then), for `part_c1`'s single long c=1 loop
  local decode
  for _ in $(seq 240); do
    decode=$(pgrep -f "engine.cli decode" | head -1)
    [ -n "$decode" ] && break
    sleep 0.5
  done
  [ -n "$decode" ] || return
  sleep 14
  local prefill router
  prefill=$(pgrep -f "engine.cli prefill" | head -1)
  router=$(pgrep -f "engine.cli router" | head -1)
  spy c1-decode-worker "$decode" MainThread &
  spy c1-decode-engine "$(pgrep -P "$decode" -f engine.engine_proc | head -1)" "pdserve-engine$" &
  spy c1-prefill-worker "$prefill" MainThread &
  spy c1-prefill-engine "$(pgrep -P "$prefill" -f engine.engine_proc | head -1)" \
    "pdserve-engine$" &
  spy c1-router "$router" MainThread
  wait
}

finish_sampler() {  # finish_sampler PID: once its bench has ended, a sampler gets
  # GPU_CHECK_SAMPLER_GRACE_S (10) to finish a recording under way, then stops: one still
  # waiting for workers that never came (a bench that failed early) would hold the lease
  local pid=$1 grace=${GPU_CHECK_SAMPLER_GRACE_S:-10}
  for _ in $(seq $((grace * 2))); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
  done
  if kill -0 "$pid" 2>/dev/null; then
    pkill -P "$pid" 2>/dev/null
    kill "$pid" 2>/dev/null
    echo "== sampler stopped: its bench ended before it could record" | tee -a "$log"
  fi
  wait "$pid" 2>/dev/null
}

part_c1() {
  sample_c1 &
  local sampler=$!
  step 150 python3 -m engine.cli bench serve --request-rates '' --concurrency 1 \
    --num-prompts 400 --rounds 1 --no-aggregated --no-inprocess --prefix-requests 0 \
    --stream-interval 1 --engine-process
  finish_sampler "$sampler"
}

part_serve() {
  sample_prefill_worker &
  local sampler=$!
  step 200 python3 -m engine.cli bench serve --request-rates '' --stream-interval 1 \
    --no-engine-process
  finish_sampler "$sampler"
  sample_decode_worker &
  sampler=$!
  step 200 python3 -m engine.cli bench serve --request-rates '' --prefix-requests 0 \
    --stream-interval 1 --engine-process --no-aggregated
  finish_sampler "$sampler"
  step 200 env PDSERVE_SWITCH_INTERVAL_MS=1 python3 -m engine.cli bench serve --request-rates '' \
    --prefix-requests 0 --stream-interval 1 --engine-process --no-aggregated
}

# Without a GPU every GPU test skips and pytest exits 0: that must not read as a pass.
python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())" \
  || { echo "torch sees no CUDA GPU here" | tee -a "$log"; exit 1; }
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(smoke bench)
for p in "${parts[@]}"; do
  case $p in
    tests | smoke | graphs | bench | profile | c1 | serve) "part_$p" ;;
    *) echo "unknown part $p (tests, smoke, graphs, bench, profile, c1, serve)" | tee -a "$log"; exit 2 ;;
  esac
done
grep "^== rc=" "$log" | sort | uniq -c
# Any step that did not exit 0 (failed, timed out: 124/137, or skipped) fails the check.
! grep -q "^== rc=[^0]" "$log"
