#!/usr/bin/env bash
# SkyRL's own launcher (main_base with the KDA entrypoint) training GRPO steps on one GPU: the RL
# example (examples/rl_tiny/run_rl_tiny.sh) with the recipe on the GPU and the project's sampler
# beside it. Each argument is one job, PLACEMENT:DTYPE, of the tiny recipe:
#   PLACEMENT  colocated  trainer.placement.colocate_all=true: policy, reference and sampler share
#                         the GPU, the workers offload their state while the sampler generates
#              separate   colocate_all=false: no offload between phases (the reference still
#                         shares the policy's GPU, SkyRL's colocate_policy_ref default)
#   DTYPE      fp32 | bf16   (trainer.bf16 and the sampler's model_dtype)
# Each job's console, metrics.jsonl and summary.txt (exit, the workers' built and offload lines from
# SkyRL's infra log, the GPU memory peak from nvidia-smi every 250 ms) go to $OUT/<job>/.
# STEPS (default 3) steps per job.
#
# On the device (carry [".whl-gpu", ".rlxz", ".tcache"]):
#   mkdir -p .site-rl && tar xJf .rlxz/rl.tar.xz -C .site-rl &&
#     WHEELS=.whl-gpu bash bench/device_run.sh bash bench/rl_gpu_runs.sh colocated:fp32 colocated:bf16
# DSA runs the torch kernel (model.dsa.kernel=torch): the TileLang archive does not fit in one
# device call beside the RL site, and at these lengths the selection is what matters, not speed.
set -uo pipefail

: "${OUT:=/tmp/rl_gpu_runs}"
: "${STEPS:=3}"
export PYTHONPATH="$PWD/.site-rl${PYTHONPATH:+:$PYTHONPATH}"

for job in "$@"; do
  IFS=: read -r placement dtype <<< "$job"
  case "$placement" in
    colocated) PLACE=(trainer.placement.colocate_all=true) ;;
    separate) PLACE=(trainer.placement.colocate_all=false) ;;
    *) echo "error: $job: PLACEMENT is colocated or separate" >&2; exit 2 ;;
  esac
  case "$dtype" in
    fp32) DTYPE=(trainer.bf16=false generator.inference_engine.model_dtype=float32) ;;
    bf16) DTYPE=(trainer.bf16=true generator.inference_engine.model_dtype=bfloat16) ;;
    *) echo "error: $job: DTYPE is fp32 or bf16" >&2; exit 2 ;;
  esac
  name="${placement}_${dtype}"
  dir="$OUT/$name"
  mkdir -p "$dir"
  nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader -lms 250 > "$dir/gpu_memory.csv" &
  smi=$!
  echo "== $job: $STEPS GRPO steps through main_base"
  SECONDS=0
  WORKDIR="/tmp/rl_gpu/$name" STEPS="$STEPS" bash examples/rl_tiny/run_rl_tiny.sh \
    trainer.kda.overrides.run.device=gpu trainer.kda.overrides.model.dsa.kernel=torch \
    "${PLACE[@]}" "${DTYPE[@]}" > "$dir/console.txt" 2>&1
  status=$?
  kill "$smi" 2>/dev/null
  {
    echo "exit $status after $SECONDS s"
    # SkyRL sends its workers' output to the infra log, not the console
    grep -h "built\|after offload_to_cpu" "/tmp/rl_gpu/$name"/logs/infra-*.log 2>/dev/null | sort -u
    python3 -c "
import sys
used = [int(line.split(',')[1].split()[0]) for line in open(sys.argv[1]) if 'MiB' in line]
print(f'GPU memory used (nvidia-smi, all processes): peak {max(used) / 1024:.2f} GiB over '
      f'{len(used)} samples every 250 ms')" "$dir/gpu_memory.csv"
  } | tee "$dir/summary.txt"
  rm -f "$dir/gpu_memory.csv"  # a device call brings few files back: the summary has its peak
  cp "/tmp/rl_gpu/$name/logs/metrics.jsonl" "$dir/" 2>/dev/null
  grep -E "step [0-9]+ \|" "$dir/console.txt" | sed 's/\x1b\[[0-9;]*m//g'
done
