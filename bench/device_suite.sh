#!/usr/bin/env bash
# The device benchmark suite of docs/benchmarks.md, each step under its own time limit so that one
# slow step (Triton autotuning on a fresh machine) cannot starve the others. Outputs go to $OUT.
# On the device (2 GPUs for the CP2 rows; carry [".whl", ".tcache"]):
#   WHEELS=.whl bash bench/device_run.sh bash bench/device_suite.sh [STEP ...]
# STEP: layer_256k layer_1m slice_cp1 slice_cp2 (default: all, in this order).
set -uo pipefail
out="${OUT:-bench/results/latest}"
mkdir -p "$out"

steps=" ${*:-layer_256k layer_1m slice_cp1 slice_cp2} "

step() {  # step SECONDS NAME COMMAND...: run, keep the log, then clear leftover workers
  local limit=$1 name=$2
  shift 2
  [[ "$steps" == *" $name "* ]] || return 0
  echo "== $name (limit ${limit}s): $*"
  timeout -k 5 "$limit" "$@" 2>&1 | grep --line-buffered -v Warning | tee "$out/$name.txt"
  pkill -9 -f multiprocessing.spawn; pkill -9 -f raylet; pkill -9 -f gcs_server; pkill -9 -f 'ray::'
  sleep 2
}

step "${T_L256:-100}" layer_256k python3 bench/kda_layer.py --tokens 262144 --warmup 1 --iters 3 \
  --skip-recurrence --json "$out/layer_256k.json"
step "${T_L1M:-110}" layer_1m python3 bench/kda_layer.py --tokens 1048576 --warmup 1 --iters 2 \
  --skip-recurrence --json "$out/layer_1m.json"
step "${T_SLICE1:-190}" slice_cp1 python3 bench/model_slice.py --runs 4:256,3:16384,3:32768,3:49152 \
  --json "$out/slice_cp1.json"
step "${T_SLICE2:-120}" slice_cp2 python3 bench/model_slice.py --runs 3:65536 --cp 2 \
  --exchanges a2a,allgather,state --json "$out/slice_cp2.json"
