#!/usr/bin/env bash
# The device benchmark suite of docs/benchmarks.md, each step under its own time limit so that one
# slow step (Triton autotuning on a fresh machine) cannot starve the others. Outputs go to $OUT.
# On the device (2 GPUs for the CP2 rows; carry [".whl", ".tcache"]):
#   WHEELS=.whl bash bench/device_run.sh bash bench/device_suite.sh [STEP ...]
# STEP: gpu_tests kernels emulated layer_256k layer_1m slice_cp1 slice_memory slice_cp2 (default:
# layer_256k layer_1m slice_cp1 slice_cp2, in this order). `emulated`: the layer at CP1 and each
# CP2 rank's work on one GPU (bench/kda_layer.py --emulate-cp2) at T = 128K..1M. `slice_memory`:
# the memory plan against runs it was not revised on, one per recompute/offload setting.
set -uo pipefail
out="${OUT:-bench/results/latest}"
mkdir -p "$out"

steps=" ${*:-layer_256k layer_1m slice_cp1 slice_cp2} "

step() {  # step SECONDS NAME COMMAND...: run, keep the log, then end what the step left running
  local limit=$1 name=$2
  shift 2
  [[ "$steps" == *" $name "* ]] || return 0
  echo "== $name (limit ${limit}s): $*"
  # The step runs in a session of its own, so that everything it starts (spawned ranks, Ray's
  # daemons, which move to process groups of their own) can be found by that session id
  # afterwards, and nothing else on a shared machine is touched.
  local session_file="$out/.$name.session"
  setsid -w bash -c 'echo $$ > "$0"; exec timeout -k 5 "$@"' "$session_file" "$limit" "$@" 2>&1 \
    | grep --line-buffered -v Warning | tee "$out/$name.txt"
  local session
  session=$(cat "$session_file" 2>/dev/null)
  rm -f "$session_file"
  [[ "$session" =~ ^[0-9]+$ ]] && pkill -9 -s "$session"
  sleep 2
}

step "${T_TESTS:-240}" gpu_tests python3 -m pytest -q -s -m gpu tests/test_kernel.py tests/test_kda_gpu.py \
  tests/test_state_kernel.py
# The kernel rows the cost model is calibrated on: fla chunk_kda and our segmented kernel at the
# CP1 (8 heads), head-parallel CP2 (4 heads) and state CP2 shares (8 heads, T/2).
for t in 131072 262144 524288 1048576; do
  step "${T_KERNELS:-120}" kernels python3 bench/kda_layer.py --tokens $t --warmup 1 --iters 3 --skip-layer \
    --skip-recurrence --json "$out/kernels_T$t.json"
  [[ "$steps" != *" kernels "* ]] || mv "$out/kernels.txt" "$out/kernels_T$t.txt"
done
for t in ${EMUL_TS:-131072 262144 524288 1048576}; do
  step "${T_EMUL:-150}" emulated python3 bench/kda_layer.py --tokens $t --warmup 1 --iters 3 --emulate-cp2 \
    --json "$out/emulated_T$t.json"
  [[ "$steps" != *" emulated "* ]] || mv "$out/emulated.txt" "$out/emulated_T$t.txt"
done
step "${T_L256:-100}" layer_256k python3 bench/kda_layer.py --tokens 262144 --warmup 1 --iters 3 \
  --skip-recurrence --json "$out/layer_256k.json"
step "${T_L1M:-110}" layer_1m python3 bench/kda_layer.py --tokens 1048576 --warmup 1 --iters 2 \
  --skip-recurrence --json "$out/layer_1m.json"
step "${T_SLICE1:-190}" slice_cp1 python3 bench/model_slice.py --runs 4:256,3:16384,3:32768,3:49152 \
  --json "$out/slice_cp1.json"
step "${T_SLICEM:-300}" slice_memory python3 bench/model_slice.py \
  --runs 3:24576,2:65536,3:8192:none,3:16384:selective,3:8192:none:offload,3:65536:full:offload \
  --json "$out/slice_memory.json"
step "${T_SLICE2:-120}" slice_cp2 python3 bench/model_slice.py --runs 3:65536 --cp 2 \
  --exchanges a2a,allgather,state --json "$out/slice_cp2.json"
