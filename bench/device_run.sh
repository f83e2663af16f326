#!/usr/bin/env bash
# Run a command on the GPU machine with the project's wheels installed and fla's Triton autotuning
# results carried from one machine to the next (a fresh machine otherwise spends minutes
# re-tuning every kernel shape before the first timed step). Wrap a long command in
# `timeout` so this script still saves what was tuned when the device call's limit nears.
#
# Here, once (.whl/ holds the wheels the GPU image lacks, from `pip download --no-deps`):
#              mkdir -p .whl-gpu .tcache &&
#              cp .whl/*.whl .whl-gpu/ && rm .whl-gpu/ray-*.whl      # Ray is not needed on the GPU
#              cp <an autotuning archive from earlier runs> .tcache/     # if you have one
#              echo /.whl-gpu/ >> .git/info/exclude; echo /.tcache/ >> .git/info/exclude
# On the device (carry [".whl-gpu", ".tcache"]):  bash bench/device_run.sh python3 bench/kda_layer.py ...
# Runs that use Ray (bench/model_slice.py) carry [".whl", ".tcache"] and set WHEELS=.whl.
# Restored before the command, later ones overriding earlier ones: $TRITON_AUTOTUNE_ARCHIVE
# (where set: an archive kept outside the checkout), every .tcache/*.tgz, then the older split
# archive .tcache/triton.tgz.part*. After it, the autotuning results the run added (none of the
# restored ones) come back as $OUT/triton-added.tgz, also from a call stopped at the device's
# limit (it is saved every minute while the command runs): copy that into .tcache/ under a new
# name (e.g. triton-added-<date>.tgz) for the next call.
# fla's conv autotunes per channel count, not per length: whatever runs a channel count first
# picks its config for every length after it. Run the GPU tests (few thousand rows) after the
# benchmarks, not before, or their choices serve the benchmarks' 128K-1M rows (docs/benchmarks.md).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target .site "${WHEELS:-.whl-gpu}"/*.whl || exit 1
export PYTHONPATH="$PWD/.site:$PWD" TORCHDYNAMO_DISABLE=1 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export TRITON_CACHE_DIR="$PWD/.triton"
mkdir -p .triton
for archive in "${TRITON_AUTOTUNE_ARCHIVE:-}" .tcache/*.tgz; do
  [ -f "$archive" ] && tar xzf "$archive" && echo "restored Triton autotuning: $archive"
done
if ls .tcache/triton.tgz.part* >/dev/null 2>&1; then
  cat .tcache/triton.tgz.part* | tar xzf - && echo "restored Triton autotuning: .tcache/triton.tgz.part*"
fi
# Only the autotuning results (fla's kernels autotune with Triton's cache_results): they are what
# costs minutes and take kilobytes; compiling the chosen configs again takes seconds.
autotuned() { find .triton -name '*.autotune.json' | sort; }
# The results the run added so far as $OUT/triton-added.tgz, replaced whole (written aside first).
save_added() {
  autotuned | comm -13 .triton-restored - > .triton-added
  [ -s .triton-added ] || return 0
  tar czf "$OUT/.triton-added.partial" -T .triton-added && mv "$OUT/.triton-added.partial" "$OUT/triton-added.tgz"
}
autotuned > .triton-restored
echo "Triton autotuning results before the run: $(wc -l < .triton-restored)"
if [ -n "${OUT:-}" ]; then
  # A call that reaches the device's limit is stopped without running the lines after the
  # command, so what it has tuned is also saved every minute while it runs.
  ( while sleep 60; do save_added; done ) &
  saver=$!
fi
"$@"
status=$?
if [ -n "${OUT:-}" ]; then
  kill "$saver" 2>/dev/null
  save_added
  [ -s .triton-added ] && echo "saved $(wc -l < .triton-added) new Triton autotuning results to \$OUT/triton-added.tgz"
fi
exit $status
