#!/usr/bin/env bash
# SkyRL's own launcher (main_base with the KDA entrypoint) training GRPO steps on one GPU: the RL
# example (examples/rl_tiny/run_rl_tiny.sh) with the recipe on the GPU and the project's sampler
# beside it. Each argument is one job, PLACEMENT:DTYPE[:MODEL]:
#   PLACEMENT  colocated  trainer.placement.colocate_all=true: policy, reference and sampler share
#                         the GPU, the workers offload their state while the sampler generates
#              separate   colocate_all=false: no offload between phases (the reference still
#                         shares the policy's GPU, SkyRL's colocate_policy_ref default)
#   DTYPE      fp32 | bf16   (trainer.bf16 and the dtype of the weights the sampler loads)
#   MODEL      tiny      glm53_flash_tiny, prompts of 28-40 tokens, 40 generated (the default)
#              slice     glm53_flash_slice: the full-width 4-layer slice (hidden 4096, 64 heads,
#                        vocab 154,880, 16 experts), prompts of 2,064-2,160 tokens (longer than its
#                        index_topk of 2,048), 16 generated, one row per micro-batch, the
#                        recipe's learning rate (1e-5)
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
  IFS=: read -r placement dtype model <<< "$job"
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
  case "${model:=tiny}" in
    tiny) RECIPE=glm53_flash_tiny; PROMPT_WORDS=28:40; SIZE=() ;;
    slice) RECIPE=glm53_flash_slice; PROMPT_WORDS=2064:2160
      SIZE=(trainer.max_prompt_length=2304 generator.sampling_params.max_generate_length=16
            trainer.micro_train_batch_size_per_gpu=1 trainer.micro_forward_batch_size_per_gpu=1
            trainer.policy.optimizer_config.lr=1e-5) ;;
    *) echo "error: $job: MODEL is tiny or slice" >&2; exit 2 ;;
  esac
  name="${placement}_${dtype}_${model}"
  dir="$OUT/$name"
  mkdir -p "$dir"
  nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader -lms 250 > "$dir/gpu_memory.csv" &
  smi=$!
  echo "== $job: $STEPS GRPO steps through main_base"
  SECONDS=0
  WORKDIR="/tmp/rl_gpu/$name" STEPS="$STEPS" RECIPE="$RECIPE" PROMPT_WORDS="$PROMPT_WORDS" \
    bash examples/rl_tiny/run_rl_tiny.sh \
    trainer.kda.overrides.run.device=gpu trainer.kda.overrides.model.dsa.kernel=torch \
    "${PLACE[@]}" "${DTYPE[@]}" "${SIZE[@]}" > "$dir/console.txt" 2>&1
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
