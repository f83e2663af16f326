#!/usr/bin/env bash
# Run a command on the GPU machine with the project's wheels installed and fla's Triton autotuning
# results carried from one machine to the next (a fresh machine otherwise spends minutes
# re-tuning every kernel shape before the first timed step). Wrap a long command in
# `timeout` so this script still saves what was tuned when the device call's limit nears.
#
# Here, once (.whl/ holds the wheels the GPU image lacks, from `pip download --no-deps`):
#              mkdir -p .whl-gpu .tcache &&
#              cp .whl/*.whl .whl-gpu/ && rm .whl-gpu/ray-*.whl      # Ray is not needed on the GPU
#              echo /.whl-gpu/ >> .git/info/exclude; echo /.tcache/ >> .git/info/exclude
# On the device (carry [".whl-gpu", ".tcache"]):  bash bench/device_run.sh python3 bench/kda_layer.py ...
# Runs that use Ray (bench/model_slice.py) carry [".whl", ".tcache"] and set WHEELS=.whl.
# After the call, copy the returned triton.tgz.part* files into .tcache/ for the next call.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target .site "${WHEELS:-.whl-gpu}"/*.whl || exit 1
export PYTHONPATH="$PWD/.site:$PWD" TORCHDYNAMO_DISABLE=1 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export TRITON_CACHE_DIR="$PWD/.triton"
if ls .tcache/triton.tgz.part* >/dev/null 2>&1; then
  cat .tcache/triton.tgz.part* | tar xzf - && echo "restored Triton cache: $(du -sh .triton | cut -f1)"
fi
"$@"
status=$?
if [ -n "${OUT:-}" ] && [ -d .triton ]; then
  # Only the autotuning results (fla's kernels autotune with Triton's cache_results): they are
  # what costs minutes and take kilobytes; compiling the chosen configs again takes seconds.
  find .triton -name '*.autotune.json' | tar czf - -T - | split -b 15m - "$OUT/triton.tgz.part"
fi
exit $status
