#!/usr/bin/env bash
# GRPO on the tiny GLM-5.3-Flash recipe through SkyRL's own launcher (main_base with the KDA
# entrypoint), on a laptop's CPU: the KDA policy and reference workers as Ray actors with gloo
# ranks, rollouts from this project's glm5_next sampler on the weights the policy publishes to
# disk, the toy environment of words_env.py. Nothing is downloaded (make_inputs.py makes the
# checkpoint, tokenizer and prompts).
#
#   WORKDIR=/tmp/rl_tiny bash examples/rl_tiny/run_rl_tiny.sh [KEY=VALUE ...]
#
# Environment: WORKDIR (default /tmp/rl_tiny; must hold no finished job), MESH=tp1|tp2cp2
# (default tp1), STEPS (default 2), FULLY_ASYNC=N (SkyRL's fully async trainer, rollouts at most
# N steps stale), PYTHON (default python3), RECIPE (default glm53_flash_tiny: the recipe and the
# checkpoint's shape), PROMPT_WORDS=MIN:MAX (the prompts' length, make_inputs.py) and LORA_RANK=R
# (LoRA of rank R on SkyRL's all-linear targets: trainer.policy.model.lora.rank; the sampler gets
# the merged weights, or the adapters alone with
# trainer.policy.megatron_config.lora_config.merge_lora=false). KEY=VALUE arguments are SkyRL
# settings: they come last, so they win.
set -euo pipefail

: "${WORKDIR:=/tmp/rl_tiny}"
: "${MESH:=tp1}"
: "${STEPS:=2}"
: "${PYTHON:=python3}"
: "${RECIPE:=glm53_flash_tiny}"
BATCH=4  # prompts per step: one mini-batch, so one optimizer step per training step
# SkyRL's filter of prompts longer than max_prompt_length runs in the experiment's own process
# (trainer.kda.prompt_filter_processes=1): for 16 prompts a pool of processes, each importing
# transformers, costs minutes on 2 cores and saves nothing.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # the examples package, here and in Ray's processes
WORKDIR="$(realpath -m "$WORKDIR")"

case "$MESH" in
  tp1) RANKS=1; MESH_ARGS=(parallel.tp=1 parallel.cp=1 parallel.ep=1 parallel.sequence_parallel=false) ;;
  # KDA under CP (the recipe's exchange), sequence parallel, experts over EP2
  tp2cp2) RANKS=4; MESH_ARGS=(parallel.tp=2 parallel.cp=2 parallel.ep=2 parallel.sequence_parallel=true) ;;
  *) echo "error: MESH=$MESH: choose tp1 or tp2cp2" >&2; exit 2 ;;
esac
for var in STEPS ${FULLY_ASYNC:+FULLY_ASYNC} ${LORA_RANK:+LORA_RANK}; do
  [[ ${!var} =~ ^[0-9]+$ ]] || { echo "error: $var=${!var}: a whole number, e.g. $var=2" >&2; exit 2; }
done
if [ -e "$WORKDIR/logs/metrics.jsonl" ]; then
  echo "error: $WORKDIR holds a finished job: use a fresh WORKDIR" >&2; exit 2
fi

ASYNC_ARGS=()
if [ -n "${FULLY_ASYNC:-}" ]; then
  # What SkyRL's fully async trainer requires: as many generation workers as the staleness bound
  # lets run, unbatched generation (a batched call cannot pause for a sync), the loss against the
  # rollout's log-probs (the policy that sampled a stale rollout is not kept), and its off-policy
  # metrics (loose thresholds: they mask only a broken sync).
  ASYNC_ARGS=(trainer.fully_async.enabled=true "trainer.fully_async.max_staleness_steps=$FULLY_ASYNC"
    "trainer.fully_async.num_parallel_generation_workers=$((BATCH * (FULLY_ASYNC + 1)))"
    generator.batched=false trainer.algorithm.policy_loss_type=rollout_is
    trainer.algorithm.off_policy_correction.outlier_token_is_threshold_low=1e-4
    trainer.algorithm.off_policy_correction.outlier_token_is_threshold_high=1e4)
fi

LORA_ARGS=()
if [ -n "${LORA_RANK:-}" ]; then
  LORA_ARGS=("trainer.policy.model.lora.rank=$LORA_RANK")
fi

"$PYTHON" -m examples.rl_tiny.make_inputs "$WORKDIR" --recipe "$RECIPE" ${PROMPT_WORDS:+--prompt-words "$PROMPT_WORDS"}
HF="$WORKDIR/$RECIPE-hf"
exec "$PYTHON" -m skyrl.train.entrypoints.main_base \
  trainer.override_entrypoint=skyrl_megatron_kda.integrations.skyrl.entrypoint \
  "trainer.kda.recipe=$RECIPE" \
  $(printf 'trainer.kda.overrides.%s ' "${MESH_ARGS[@]}") \
  "trainer.kda.overrides.run.num_workers=$RANKS" \
  trainer.kda.overrides.run.device=cpu \
  "trainer.kda.overrides.run.init_from_hf=$HF" \
  trainer.kda.sampler=glm5_next \
  "trainer.kda.env_modules=[examples.rl_tiny.words_env]" \
  trainer.kda.prompt_filter_processes=1 \
  trainer.strategy=megatron \
  trainer.logger=console \
  "trainer.policy.model.path=$HF" \
  "data.train_data=['$WORKDIR/train.jsonl']" \
  "data.val_data=[]" \
  data.dataloader.num_workers=0 \
  trainer.eval_interval=-1 \
  trainer.eval_before_train=false \
  "trainer.ckpt_path=$WORKDIR/ckpt" \
  "trainer.export_path=$WORKDIR/export" \
  "trainer.log_path=$WORKDIR/logs" \
  trainer.ckpt_interval=-1 \
  trainer.hf_save_interval=-1 \
  trainer.placement.colocate_all=false \
  "trainer.placement.policy_num_gpus_per_node=$RANKS" \
  "trainer.placement.ref_num_gpus_per_node=$RANKS" \
  trainer.algorithm.advantage_estimator=grpo \
  trainer.algorithm.temperature=1.0 \
  trainer.epochs=1 \
  "trainer.max_training_steps=$STEPS" \
  "trainer.train_batch_size=$BATCH" \
  "trainer.policy_mini_batch_size=$BATCH" \
  trainer.micro_train_batch_size_per_gpu=2 \
  trainer.micro_forward_batch_size_per_gpu=2 \
  trainer.max_prompt_length=64 \
  generator.n_samples_per_prompt=2 \
  generator.sampling_params.max_generate_length=40 \
  generator.sampling_params.temperature=1.0 \
  generator.sampling_params.logprobs=0 \
  generator.inference_engine.model_dtype=float32 \
  generator.inference_engine.num_engines=1 \
  generator.batched=true \
  generator.inference_engine.enable_ray_prometheus_stats=false \
  trainer.bf16=false \
  trainer.policy.optimizer_config.lr=3e-3 \
  "${ASYNC_ARGS[@]}" \
  "${LORA_ARGS[@]}" \
  "$@"
