#!/usr/bin/env bash
# The GPU recipe on maze_2d/easy (issue 4), one phase per device call (10 minutes each).
#
#   bash experiments/gpu_easy.sh sft   WORK OUT   # data, the small policy, SFT with eval curve
#   bash experiments/gpu_easy.sh grpo  WORK OUT   # GRPO from WORK/sft (resumes WORK/grpo)
#
# WORK holds what the next call needs (kept on the machine while it is held); OUT gets
# the logs and metrics that come back. Every eval maze is solvable within the turn budget:
# max_turns=32 covers the longest optimal path of a 9x9 perfect maze (30 moves + stop).
set -euo pipefail
phase=$1
work=$2
out=$3
mkdir -p "$work" "$out"
CLEW=${CLEW:-clew}
SFT_MINUTES=${SFT_MINUTES:-7.5}
SFT_STEPS=${SFT_STEPS:-4000}
GRPO_STEPS=${GRPO_STEPS:-40}
TRAIN_ROWS=${TRAIN_ROWS:-20000}
PRESET=${PRESET:-small}
DEVICE=${DEVICE:-cuda}
opts=(--env-id maze_2d/easy --option cell_px=14 --option max_turns=32 --option action_format=keyword)

if [ "$phase" = sft ]; then
  $CLEW dataset "${opts[@]}" --split train --num-rows "$TRAIN_ROWS" --output-dir "$work/data"
  $CLEW dataset "${opts[@]}" --split eval --num-rows 64 --output-dir "$work/data" --stats
  $CLEW init-model --preset "$PRESET" --arch qwen3_vl --image-size 126 --patch-size 14 \
    --merge-size 1 --output "$work/base" --overwrite
  $CLEW sft --model "$work/base" --data "$work/data/train.parquet" \
    --eval-data "$work/data/eval.parquet" --output "$work/sft" --steps "$SFT_STEPS" \
    --max-minutes "$SFT_MINUTES" --batch-size 64 --lr 1e-3 --warmup-steps 50 \
    --eval-interval 100 --keep-last-k-images 1 --device "$DEVICE" \
    --metrics "$out/sft_metrics.jsonl"
elif [ "$phase" = grpo ]; then
  $CLEW train \
    "data.train_data=['$work/data/train.parquet']" \
    "data.val_data=['$work/data/eval.parquet']" \
    "trainer.policy.model.path=$work/sft" \
    "trainer.log_path=$work/runs" \
    trainer.run_name=grpo \
    trainer.logger=console \
    trainer.train_batch_size=24 \
    trainer.policy_mini_batch_size=24 \
    trainer.micro_train_batch_size_per_gpu=48 \
    trainer.micro_forward_batch_size_per_gpu=48 \
    trainer.epochs=100 \
    "trainer.max_steps=$GRPO_STEPS" \
    trainer.eval_interval=5 \
    trainer.eval_before_train=true \
    trainer.ckpt_interval=5 \
    trainer.hf_save_interval=-1 \
    trainer.resume_mode=latest \
    "trainer.policy.optimizer_config.lr=${GRPO_LR:-1e-4}" \
    trainer.policy.optimizer_config.weight_decay=0.0 \
    generator.n_samples_per_prompt=8 \
    generator.max_turns=32 \
    generator.keep_last_k_images=1 \
    generator.sampling_params.temperature=${GRPO_TEMPERATURE:-1.0} \
    generator.sampling_params.max_generate_length=8 \
    generator.max_input_length=8192 \
    trainer.max_prompt_length=512 \
    "trainer.device=$DEVICE"
  cp "$work/runs/grpo/metrics.jsonl" "$out/grpo_metrics.jsonl"
else
  echo "usage: $0 sft|grpo WORK OUT" >&2
  exit 2
fi
