#!/usr/bin/env bash
# The device runs behind the step-time model (docs/step_time.md), under bench/device_run.sh:
#   carry [".whl-gpu", ".tlxz", ".tcache"];
#   mkdir -p .site-tl && tar xJf .tlxz/tl.tar.xz -C .site-tl &&
#   bash bench/device_run.sh env PYTHONPATH=$PWD/.site:$PWD/.site-tl:$PWD bash bench/step_time_runs.sh STEP...
# Steps (each writes $OUT/<name>.json and .txt):
#   share    the 1M recipe's per-rank work of the layer types that bench/kda_layer.py and
#            bench/dsa_rank_share.py do not cover, parts only: a 2-layer recipe with the rank's
#            widths (8 KDA heads, 9 local experts of 1,024 columns (ETP2), a 1,536-column dense
#            FFN (TP8), a 19,360-row vocabulary shard (TP8)) fed the rank's rows
#   slice:T  the full-width 4-layer slice (bench/model_slice.py's recipe) at T tokens with every
#            memory lever, the step and its parts
#   kda1m    the KDA layer at the 1M recipe's rank share, each CP2 exchange's rank in turn
#            (bench/kda_layer.py's per-rank emulation, as docs/benchmarks.md runs it)
#   dsa1m    the DSA attention core at the 1M recipe's rank share (bench/dsa_rank_share.py)
#   moe      the MoE block of `share` (131,072 rows, 9 experts of 1,024 columns, chunks of 8,192
#            rows) at EP=1 under each one-GPU dispatcher, allgather then alltoall, forward and
#            backward timed apart; moe_dispatch.* gives alltoall over allgather. flex (DeepEP)
#            is not run: its kernels need 2 to 8 ranks
set -uo pipefail
out=${OUT:-.}
levers="--set train.offload_activations=true --set train.loss_chunk_tokens=8192 \
  --set train.grad_reduce_in_fp32=false --set kda.kernel_head_group=16 --set train.moe_chunk_tokens=8192"
status=0
for step in "$@"; do
  case $step in
    share)
      python3 bench/rank_share.py --steps 0 --iters 1 --set model.num_layers=2 --set kda.num_heads=8 \
        --set kda.kernel_head_group=4 --set model.moe.num_experts=9 --set model.moe.ffn_hidden_size=1024 \
        --set model.dense_ffn_hidden_size=1536 --set model.vocab_size=19360 --set data.seq_len=524288 \
        --set train.moe_chunk_tokens=8192 --set train.loss_chunk_tokens=8192 \
        --rows mhc=65536 --rows moe=131072 --rows dense=524288 --rows head=524288 --rows offload=65536 \
        --json "$out/share_1m.json" 2>&1 | tee "$out/share_1m.txt" || status=1 ;;
    moe)
      for dispatcher in allgather alltoall; do
        python3 bench/rank_share.py --steps 0 --iters 5 --parts moe --set model.num_layers=2 \
          --set kda.num_heads=8 --set kda.kernel_head_group=4 --set model.moe.num_experts=9 \
          --set model.moe.ffn_hidden_size=1024 --set model.dense_ffn_hidden_size=1536 \
          --set model.vocab_size=19360 --set data.seq_len=524288 --set train.moe_chunk_tokens=8192 \
          --set train.loss_chunk_tokens=8192 --set model.moe.dispatcher=$dispatcher --rows moe=131072 \
          --json "$out/moe_$dispatcher.json" 2>&1 | tee "$out/moe_$dispatcher.txt" || status=1
      done
      python3 bench/rank_share.py --compare-moe "$out/moe_allgather.json" "$out/moe_alltoall.json" \
        --json "$out/moe_dispatch.json" 2>&1 | tee "$out/moe_dispatch.txt" || status=1 ;;
    slice:*)
      t=${step#slice:}
      # shellcheck disable=SC2086
      python3 bench/rank_share.py --steps 3 --iters 1 $levers --set data.seq_len="$t" \
        --json "$out/slice_$t.json" 2>&1 | tee "$out/slice_$t.txt" || status=1 ;;
    kda1m)
      python3 bench/kda_layer.py --tokens 1048576 --warmup 2 --iters 3 --emulate-cp2 \
        --json "$out/kda_layer_1m.json" 2>&1 | tee "$out/kda_layer_1m.txt" || status=1 ;;
    dsa1m)
      python3 bench/dsa_rank_share.py --split sequence --iters 2 --json "$out/dsa_rank_share.json" \
        2>&1 | tee "$out/dsa_rank_share.txt" || status=1 ;;
    *) echo "unknown step $step"; status=1 ;;
  esac
done
exit $status
