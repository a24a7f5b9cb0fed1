#!/usr/bin/env bash
# The GPU recipe on maze_2d/easy (issue 4), one phase per device call (10 minutes each).
#
#   bash experiments/gpu_easy.sh sft   WORK OUT   # data, the small policy, SFT with eval curve
#   bash experiments/gpu_easy.sh sft_more WORK OUT  # SFT_MINUTES more SFT from WORK/sft
#   bash experiments/gpu_easy.sh grpo  WORK OUT   # GRPO from WORK/sft (resumes WORK/runs/grpo)
#
# WORK holds what the next call needs (kept on the machine while it is held); OUT gets
# the logs and metrics that come back, and the SFT checkpoint and the GRPO run's
# best-evaluated step (best.tgz) and latest policy, the second where it fits, as 15 MiB parts
# (what comes back is at most 16 MiB a file): a later call on a fresh machine
# restores them from the folder named by RESTORE (a carried copy of an earlier OUT). A grpo
# call also evaluates the policy it packs (OUT/final_eval.json, `clew eval`); an sft or
# sft_more call its start, when BIG_EVAL or ANYWHERE_EVAL asks for more mazes.
# Two phases may share a GPU (two calls of this script at once, each its own WORK and OUT):
# clew caps torch's host threads at 4 on an accelerator, without which two processes each
# rolled out 25 times slower (BENCHMARKS.md, "Fifth attempt" and "Sixth attempt").
# Every eval maze is solvable within the turn budget: max_turns=32 covers the longest
# optimal path of a 9x9 perfect maze (30 moves + stop).
set -euo pipefail
phase=$1
work=$2
out=$3
mkdir -p "$work" "$out"
CLEW=${CLEW:-clew}
PYTHON=${PYTHON:-python3}  # a Python with torch (packing with PACK_BF16=1)
SFT_MINUTES=${SFT_MINUTES:-7.5}
SFT_STEPS=${SFT_STEPS:-4000}
GRPO_STEPS=${GRPO_STEPS:-40}
GRPO_MINUTES=${GRPO_MINUTES:-}
TRAIN_ROWS=${TRAIN_ROWS:-20000}
PRESET=${PRESET:-small}
# INIT: more `clew init-model` flags, space-separated (e.g. "--vision depth=12 --vision
# deepstack_visual_indexes=[2,5,8]": the small preset with a 12-layer vision tower)
INIT=${INIT:-}
# BALANCED=1: build the policy so the frame reaches its language model (pixel statistics of
# maze frames, a centered position table; BENCHMARKS.md, "Eleventh attempt")
if [ "${BALANCED:-0}" = 1 ]; then
  INIT="--image-mean 0.83,0.83,0.83 --image-std 0.5,0.5,0.5 --position-table centered $INIT"
fi
DEVICE=${DEVICE:-cuda}
RESTORE=${RESTORE:-}
# RESTORE_PICK: which packed policy of RESTORE a fresh grpo call goes on from, the first found
# of these names (the latest policy if it came back, else the best-evaluated step)
RESTORE_PICK=${RESTORE_PICK:-policy best}
PROMPTS=${PROMPTS:-24}
SAMPLES=${SAMPLES:-8}
MAX_TURNS=${MAX_TURNS:-32}
MICRO=${MICRO:-48}
SFT_BATCH=${SFT_BATCH:-64}  # demonstrations per SFT step
SFT_MICRO=${SFT_MICRO:-}  # demonstrations per forward (the deep preset's 64 at once held 110 GiB)
# SFT_PACK=1: clew sft --pack-sequences (short episodes end to end in a forward's rows)
pack_seqs=()
if [ "${SFT_PACK:-0}" = 1 ]; then pack_seqs=(--pack-sequences); fi
DETOUR=${DETOUR:-0.0}  # share of detour turns in SFT demonstrations (wrong moves, wall bumps)
START_ANYWHERE=${START_ANYWHERE:-0.0}  # share of SFT demonstrations starting on a random open cell
SFT_EVAL_INTERVAL=${SFT_EVAL_INTERVAL:-100}
# SFT_LR (1e-3) and SFT_WARMUP (50 steps): the `deep` preset's SFT at the small preset's values
# hardly left 0% in 224 steps, at SFT_LR=5e-4 SFT_WARMUP=100 it reached 65.6% in 309
# (BENCHMARKS.md, "Fourteenth attempt" and "Fifteenth attempt")
# SFT_SCHEDULER: clew sft --scheduler (cosine and linear decay to 0 at SFT_STEPS, so set
# SFT_STEPS to what SFT_MINUTES holds)
SFT_SCHEDULER=${SFT_SCHEDULER:-constant_with_warmup}
SFT_STOP_AT=${SFT_STOP_AT:-}  # clew sft --stop-at-pass: end SFT at the first eval reaching it
# SFT_PICK="LOW HIGH": save the policy at every evaluation (clew sft --save-interval) and make
# the GRPO start the latest one whose eval pass@1 lies in [LOW, HIGH] (the final one kept as
# WORK/sft_final and packed as OUT/sft_final.tgz.part-*); SFT_PICK.txt in OUT says which step was taken.
SFT_PICK=${SFT_PICK:-}
# SFT_SAVE_BEST=1: clew sft --save-best; the best evaluation's policy comes back as
# OUT/sft_best.tgz.part-* (its tar root `sft`, so renamed to sft.tgz.part-* it is a RESTORE
# start) after the final one, when it is another step and fits; OUT/SFT_BEST.json names it
save_best=()
if [ "${SFT_SAVE_BEST:-0}" = 1 ]; then save_best=(--save-best); fi
# DAGGER_INTERVAL=N: DAgger rounds in SFT every N steps (clew sft --dagger-interval; the
# policy plays DAGGER_ROWS training rows, default 64, and the solver's branches from its
# mistakes fill DAGGER_SHARE of each batch, default 0.5, drawn from the latest
# DAGGER_KEEP_ROUNDS rounds, default 1, 0 for all)
dagger=()
if [ -n "${DAGGER_INTERVAL:-}" ]; then
  dagger=(--dagger-interval "$DAGGER_INTERVAL" --dagger-rows "${DAGGER_ROWS:-64}" --dagger-share "${DAGGER_SHARE:-0.5}" --dagger-keep-rounds "${DAGGER_KEEP_ROUNDS:-1}")
fi
PACK_BF16=${PACK_BF16:-0}  # 1: checkpoints come back with bfloat16 weights (half the parts)
# Tokens a reply may take: a keyword action is 4 (<action>, the word, </action>, <|im_end|>).
# Every decode step runs the whole batch, so one row rambling to 8 tokens doubled a turn's
# forwards (at temperature 1.0 about 1% of replies did, i.e. nearly every turn of 384 rows).
MAX_GEN=${MAX_GEN:-4}
# FORCED=1: the engine writes <action> and </action> around one sampled token a reply
# (generator.reply_prefix / reply_suffix): a turn is one forward pass instead of four.
FORCED=${FORCED:-0}
forced=()
if [ "$FORCED" = 1 ]; then
  forced=("generator.reply_prefix=<action>" "generator.reply_suffix=</action>") && MAX_GEN=1
fi
# KEEP: frames the policy sees (the current one and KEEP-1 before it; SFT, GRPO and every
# evaluation alike); a policy trained with one KEEP is evaluated with it
KEEP=${KEEP:-1}
PRECISION=${PRECISION:-bf16-mixed}  # clew sft --precision (bf16-true: the runs before session 5)
# BIG_EVAL, ANYWHERE_EVAL: larger evaluations of what a call brings back (final_evals below); unset
# or 0: none
[ "${BIG_EVAL:-}" != 0 ] || BIG_EVAL=
[ "${ANYWHERE_EVAL:-}" != 0 ] || ANYWHERE_EVAL=
# GRPO_EXTRA: more `clew train` overrides, space-separated (e.g. trainer.eval_interval=10)
# BORDER: the env's border_px (7: half a cell, so the policy's 14 px patches fall across the
# cells' centres and each holds parts of the agent's neighbours; the image grows to 140 px)
BORDER=${BORDER:-0}
# CELL_PX: the env's cell_px (14: one 14 px patch a cell; 28: four, a wall between two cells
# no longer shares a patch with both; the 9x9 maze's frame is 9 * CELL_PX + 2 * BORDER px)
CELL_PX=${CELL_PX:-14}
IMAGE_SIZE=$((9 * CELL_PX + 2 * BORDER))
opts=(--env-id maze_2d/easy --option cell_px="$CELL_PX" --option border_px="$BORDER" --option max_turns=32 --option action_format=keyword)

pack() { # pack DIR NAME: DIR as OUT/NAME.tgz.part-*
  local src=$1
  if [ "${PACK_BF16:-0}" = 1 ]; then
    # Half the parts (what comes back is at most 8 files, 64 MiB): the weights rounded once
    # to bfloat16; training goes on in float32 after the restore.
    src=$work/pack_bf16/$(basename "$1") && rm -rf "$work/pack_bf16" && mkdir -p "$src"
    cp -r "$1"/. "$src"/ && $PYTHON -c "import sys, torch; from safetensors.torch import load_file, save_file; f=sys.argv[1]; save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(f).items()}, f, metadata={'format': 'pt'})" "$src/model.safetensors"
  fi
  rm -rf "$work/parts" "$out/$2".tgz.part-* && mkdir -p "$work/parts"
  tar czf - -C "$(dirname "$src")" "$(basename "$src")" | split -b 15m - "$work/parts/$2.tgz.part-"
  # What comes back from a call is at most 8 files and 64 MiB: a second pack (sft_final,
  # best) that would pass 4 parts or 60 MiB of parts in OUT, beside the logs, stays behind
  # (two bfloat16 packs of the medium preset are 57.1 MiB; logs and metrics stay under 1 MiB).
  local parts bytes
  read -r parts bytes < <(find "$out" "$work/parts" -maxdepth 1 -name '*.tgz.part-*' -printf '%s\n' | awk '{ s += $1 } END { print NR, s + 0 }')
  if [ "$parts" -gt "${MAX_PARTS:-4}" ] || [ "$bytes" -gt $((60 * 1024 * 1024)) ]; then
    echo "$2 not brought back: with it OUT would hold $parts parts, $bytes bytes" | tee -a "$out/NOT_PACKED.txt"
    return 0
  fi
  mv "$work"/parts/* "$out"/
}
play_eval() { # play_eval MODEL DATA DIR: MODEL on DATA as it was trained, metrics in DIR
  $CLEW eval --model "$1" --data "$2" --output-dir "$3" \
    --max-turns "$MAX_TURNS" --max-generate-length "$MAX_GEN" --keep-last-k-images "$KEEP" \
    ${forced[@]+--reply-prefix "<action>" --reply-suffix "</action>"} --device "$DEVICE" --num-gifs 0
}
merge_eval() { # merge_eval PREFIX DIR: DIR/metrics.json into OUT/final_eval.json as PREFIX/*
  $PYTHON -c "import json, sys; a = json.load(open(sys.argv[1])); a.update({sys.argv[3] + '/' + k: v for k, v in json.load(open(sys.argv[2])).items()}); json.dump(a, open(sys.argv[1], 'w'), indent=2)" "$out/final_eval.json" "$2/metrics.json" "$1"
}
final_evals() { # final_evals MODEL: MODEL on the 64 eval mazes into OUT/final_eval.json, then
  # BIG_EVAL=N: on N more mazes (seeds from 2,000,000,000, apart from the train rows and the
  # 64 fixed ones), where 64 mazes leave +-4.5 points of noise; merged as big/*.
  # ANYWHERE_EVAL=N: on N eval mazes that start on a random open cell (start_anywhere=1.0),
  # merged as anywhere/*: a policy that reads where it is from the frame, not from its moves
  # since the maze's own start, solves these too (BENCHMARKS.md, "Nineteenth attempt": 87.5%
  # from the starts, 42.6% from anywhere). A call brings back at most 8 files: one JSON.
  play_eval "$1" "$work/data/eval.parquet" "$work/final_eval" \
    && cp "$work/final_eval/metrics.json" "$out/final_eval.json" || { echo "final eval failed (rc $?)"; return 0; }
  if [ -n "${BIG_EVAL:-}" ]; then
    [ -f "$work/big/eval.parquet" ] || $CLEW dataset "${opts[@]}" --split eval --num-rows "$BIG_EVAL" \
      --seed-start 2000000000 --output-dir "$work/big"
    play_eval "$1" "$work/big/eval.parquet" "$work/big_eval" && merge_eval big "$work/big_eval" \
      || echo "big eval failed (rc $?)"
  fi
  if [ -n "${ANYWHERE_EVAL:-}" ]; then
    [ -f "$work/anywhere/eval.parquet" ] || $CLEW dataset "${opts[@]}" --option start_anywhere=1.0 \
      --split eval --num-rows "$ANYWHERE_EVAL" --output-dir "$work/anywhere"
    play_eval "$1" "$work/anywhere/eval.parquet" "$work/anywhere_eval" && merge_eval anywhere "$work/anywhere_eval" \
      || echo "anywhere eval failed (rc $?)"
  fi
}
start_evals() { # start_evals: with BIG_EVAL or ANYWHERE_EVAL, final_evals of the SFT start packed
  if [ -n "${BIG_EVAL:-}${ANYWHERE_EVAL:-}" ]; then final_evals "$work/sft"; fi
}
unpack() { # unpack NAME DEST_PARENT: restore from RESTORE/NAME.tgz.part-*
  cat "$RESTORE/$1".tgz.part-* | tar xzf - -C "$2"
}
restorable() { # the first name in RESTORE_PICK with parts in RESTORE
  local name
  for name in $RESTORE_PICK; do
    if ls "$RESTORE/$name".tgz.part-* >/dev/null 2>&1; then echo "$name" && return 0; fi
  done
  return 1
}
stash_best() { # stash_best METRICS_NAME: WORK/sft/best out of the SFT checkpoint, kept as
  # WORK/sft_best/sft when its step is not the last one evaluated
  rm -rf "$work/sft_best"
  [ -d "$work/sft/best" ] || return 0
  cp "$work/sft/best/best.json" "$out/SFT_BEST.json"
  if $PYTHON - "$out/$1_metrics.jsonl" "$out/SFT_BEST.json" <<'PY'
import json, sys
last = [json.loads(line) for line in open(sys.argv[1])][-1]["step"]
sys.exit(0 if json.load(open(sys.argv[2]))["step"] != last else 1)
PY
  then mkdir -p "$work/sft_best" && mv "$work/sft/best/policy" "$work/sft_best/sft"
  else echo "the best evaluation is the last step's: no sft_best pack"
  fi
  rm -rf "$work/sft/best"
}
pack_best_sft() { # after the SFT checkpoint's own pack, so it never crowds that one out
  if [ -d "$work/sft_best/sft" ]; then pack "$work/sft_best/sft" sft_best; fi
}
pick() { # pick METRICS_NAME: with SFT_PICK, WORK/sft becomes the latest saved step in the band
  [ -n "$SFT_PICK" ] || return 0
  local step
  rm -rf "$work/sft_steps" && mkdir -p "$work/sft_steps"
  mv "$work"/sft/step_* "$work/sft_steps/" 2>/dev/null || true
  step=$($PYTHON - "$out/$1_metrics.jsonl" $SFT_PICK <<'PY'
import json, sys
low, high = float(sys.argv[2]), float(sys.argv[3])
evals = [json.loads(line) for line in open(sys.argv[1])]
band = [e["step"] for e in evals if low <= e.get("eval/all/pass_at_1", -1) <= high]
print(band[-1] if band else "")
PY
)
  if [ -z "$step" ]; then echo "no evaluation in [$SFT_PICK]; the start is the final SFT policy" | tee "$out/SFT_PICK.txt"; return 0; fi
  echo "GRPO start: SFT step $step (band $SFT_PICK)" | tee "$out/SFT_PICK.txt"
  [ -d "$work/sft_steps/step_$step" ] || { echo "step $step is the final policy" >> "$out/SFT_PICK.txt"; return 0; }
  rm -rf "$work/sft_final" && mv "$work/sft" "$work/sft_final" && mv "$work/sft_steps/step_$step" "$work/sft"
  # The final policy comes back too (OUT/sft_final.tgz.part-*): session 24's DAgger SFT went
  # on to 78.1% after the step it picked, and that policy was lost with the machine.
  pack "$work/sft_final" sft_final
}
export_policy() { # export_policy EXPORT DEST: a run's export as a standalone policy in DEST
  rm -rf "$2"
  if [ -f "$1/adapter_config.json" ]; then
    # A LoRA run (trainer.policy.model.lora.rank > 0) exports an adapter: merged into its
    # base, it is a standalone policy that a fresh machine restores and trains on (a new
    # adapter on the merged weights) and that `clew eval` plays without the base.
    $CLEW export --model "$(cat "$work/grpo_start")" --adapter "$1" --output "$2" --merge
  else
    cp -r "$1" "$2"
  fi
}
pack_best() { # pack_best LAST_EXPORT: the run's best-evaluated policy as OUT/best.tgz.part-*
  # The curve is noisy (session 25: 84.4% at step 35, 73.4% at the packed step 82), and a
  # held machine's WORK is lost with it: clew train keeps the best evaluation's policy
  # (trainer.export_best, exports/best), which comes back too unless it is the start or the
  # last step; BEST.txt says which step it is.
  local record=$work/runs/grpo/exports/best/best.json step
  [ -f "$record" ] || return 0
  step=$($PYTHON -c "import json, sys; print(json.load(open(sys.argv[1]))['step'])" "$record")
  echo "best evaluated GRPO step: $step ($record)" | tee "$out/BEST.txt"
  if [ "$step" = 0 ] || [ "$1" = "$work/runs/grpo/exports/global_step_$step/policy" ]; then return 0; fi
  export_policy "$work/runs/grpo/exports/best/policy" "$work/best" && pack "$work/best" best
}
# TRAIN_MAX_TURNS: the training mazes' own turn budget (the eval mazes keep 32). Optimal paths
# of easy mazes are 12, 16, 20 or (1 in 100) 24 moves, one turn more with the stop: at 26 every
# training maze stays solvable and a wrong branch on a long maze costs the episode, as under
# the seed's 15 turns, where at 32 it is walked back for the full reward (BENCHMARKS.md,
# "Fifteenth attempt").
TRAIN_MAX_TURNS=${TRAIN_MAX_TURNS:-}
# TRAIN_START_ANYWHERE=P: that share of the training mazes start on a random open cell (the
# env's start_anywhere option; the eval mazes keep their own starts)
TRAIN_START_ANYWHERE=${TRAIN_START_ANYWHERE:-}
data() {
  # The training rows are rebuilt when the options they were made with change (an sft call's
  # 32,000 rows from the starts are not a grpo call's 6,000 with TRAIN_START_ANYWHERE).
  local key="rows=$TRAIN_ROWS cell=$CELL_PX border=$BORDER max_turns=${TRAIN_MAX_TURNS:-32} anywhere=${TRAIN_START_ANYWHERE:-0}"
  if [ -f "$work/data/train.parquet" ] && [ "$(cat "$work/data/train.key" 2>/dev/null)" = "$key" ]; then
    return
  fi
  rm -f "$work/data/train.parquet" "$work/data/train.key"
  $CLEW dataset "${opts[@]}" ${TRAIN_MAX_TURNS:+--option max_turns="$TRAIN_MAX_TURNS"} \
    ${TRAIN_START_ANYWHERE:+--option start_anywhere="$TRAIN_START_ANYWHERE"} --split train \
    --num-rows "$TRAIN_ROWS" --output-dir "$work/data" --stats
  $CLEW dataset "${opts[@]}" --split eval --num-rows 64 --output-dir "$work/data" --stats
  echo "$key" > "$work/data/train.key"
}

if [ "$phase" = sft ]; then
  data
  $CLEW init-model --preset "$PRESET" --arch qwen3_vl --image-size "$IMAGE_SIZE" --patch-size 14 \
    --merge-size 1 --output "$work/base" --overwrite ${INIT:-}
  $CLEW sft --model "$work/base" --data "$work/data/train.parquet" \
    --eval-data "$work/data/eval.parquet" --output "$work/sft" --steps "$SFT_STEPS" \
    --max-minutes "$SFT_MINUTES" --batch-size "$SFT_BATCH" --lr "${SFT_LR:-1e-3}" \
    --warmup-steps "${SFT_WARMUP:-50}" --scheduler "$SFT_SCHEDULER" --detour-prob "$DETOUR" --start-anywhere "$START_ANYWHERE" \
    --eval-interval "$SFT_EVAL_INTERVAL" --keep-last-k-images "$KEEP" --device "$DEVICE" --precision "$PRECISION" ${SFT_STOP_AT:+--stop-at-pass "$SFT_STOP_AT"} ${SFT_MICRO:+--micro-batch-size "$SFT_MICRO"} ${pack_seqs[@]+"${pack_seqs[@]}"} \
    ${SFT_PICK:+--save-interval "$SFT_EVAL_INTERVAL"} ${dagger[@]+"${dagger[@]}"} ${save_best[@]+"${save_best[@]}"} --metrics "$out/sft_metrics.jsonl"
  stash_best sft && pick sft && pack "$work/sft" sft && pack_best_sft
  start_evals
elif [ "$phase" = sft_more ]; then
  # More SFT from WORK/sft (restored if the machine is fresh), for SFT_MINUTES more.
  data
  if [ ! -d "$work/sft" ]; then unpack sft "$work"; fi
  $CLEW sft --model "$work/sft" --data "$work/data/train.parquet" \
    --eval-data "$work/data/eval.parquet" --output "$work/sft_more" --steps "$SFT_STEPS" \
    --max-minutes "$SFT_MINUTES" --batch-size "$SFT_BATCH" --lr "${SFT_LR:-1e-3}" \
    --warmup-steps "${SFT_MORE_WARMUP:-20}" --scheduler "$SFT_SCHEDULER" --detour-prob "$DETOUR" --start-anywhere "$START_ANYWHERE" --eval-interval "$SFT_EVAL_INTERVAL" --keep-last-k-images "$KEEP" --device "$DEVICE" --precision "$PRECISION" ${SFT_STOP_AT:+--stop-at-pass "$SFT_STOP_AT"} ${SFT_MICRO:+--micro-batch-size "$SFT_MICRO"} ${pack_seqs[@]+"${pack_seqs[@]}"} \
    ${SFT_PICK:+--save-interval "$SFT_EVAL_INTERVAL"} ${dagger[@]+"${dagger[@]}"} ${save_best[@]+"${save_best[@]}"} --metrics "$out/sft_more_metrics.jsonl"
  rm -rf "$work/sft" && mv "$work/sft_more" "$work/sft" && stash_best sft_more && pick sft_more && pack "$work/sft" sft && pack_best_sft
  start_evals
elif [ "$phase" = grpo ]; then
  data
  start=$work/sft
  if [ -d "$work/runs/grpo" ] && [ -f "$work/grpo_start" ]; then
    # The machine was still held (WORK is ignored by git, so it stays between calls): the
    # run resumes from its own checkpoint, optimizer state included, from the same start.
    start=$(cat "$work/grpo_start")
  elif [ -n "$RESTORE" ] && name=$(restorable); then
    # A fresh machine: go on from a policy that came back (a new optimizer state). Session 29
    # had only call 2's best step back and renamed its parts by hand.
    rm -rf "$work/runs/grpo" "$work/restored" && mkdir -p "$work/restored"
    unpack "$name" "$work/restored" && start=$work/restored/$name
    echo "restored from $RESTORE/$name.tgz.part-*" | tee "$out/RESTORED.txt"
  elif [ ! -d "$work/sft" ]; then
    unpack sft "$work"
  fi
  echo "$start" > "$work/grpo_start"
  limit=()
  # On the INT, clew train finishes the step in progress, saves it and exports it
  # (clew.stopping): the policy packed below is the last step trained, not the last export.
  [ -n "$GRPO_MINUTES" ] && limit=(timeout --signal=INT "$(awk "BEGIN { print int($GRPO_MINUTES * 60) }")")
  "${limit[@]}" $CLEW train \
    "data.train_data=['$work/data/train.parquet']" \
    "data.val_data=['$work/data/eval.parquet']" \
    "trainer.policy.model.path=$start" \
    "trainer.log_path=$work/runs" \
    trainer.run_name=grpo \
    trainer.logger=console \
    "trainer.train_batch_size=$PROMPTS" \
    "trainer.policy_mini_batch_size=${MINI:-$PROMPTS}" \
    "trainer.micro_train_batch_size_per_gpu=$MICRO" \
    "trainer.micro_forward_batch_size_per_gpu=$MICRO" \
    trainer.epochs=100 \
    "trainer.max_steps=$GRPO_STEPS" \
    trainer.eval_interval=5 \
    trainer.eval_before_train=true \
    trainer.ckpt_interval=5 \
    trainer.hf_save_interval=5 \
    trainer.resume_mode=latest \
    "trainer.policy.optimizer_config.lr=${GRPO_LR:-1e-4}" \
    trainer.policy.optimizer_config.weight_decay=0.0 \
    "generator.n_samples_per_prompt=$SAMPLES" \
    "generator.max_turns=$MAX_TURNS" \
    "generator.keep_last_k_images=$KEEP" \
    generator.sampling_params.temperature=${GRPO_TEMPERATURE:-1.0} \
    "generator.sampling_params.max_generate_length=$MAX_GEN" \
    generator.max_input_length=8192 \
    trainer.max_prompt_length=512 \
    "trainer.device=$DEVICE" \
    ${forced[@]+"${forced[@]}"} \
    ${GRPO_EXTRA:-} || echo "clew train stopped (rc $?)"
  cat "$work/runs/grpo/metrics.jsonl" >> "$out/grpo_metrics.jsonl" || true
  last=$(ls -d "$work"/runs/grpo/exports/global_step_*/policy 2>/dev/null | sort -V | tail -1)
  if [ -n "$last" ]; then
    # The best evaluation is packed first: where only one pack fits, the best comes back
    # (session 26: the medium run's 78.1% at step 30 stayed behind its last step's 46.9%).
    pack_best "$last"
    # WORK/policy: the packed output, never a run's start
    export_policy "$last" "$work/policy_new"
    rm -rf "$work/policy" && mv "$work/policy_new" "$work/policy" && pack "$work/policy" policy
    # The policy that comes back is the last step trained, which the run's own evaluations
    # (every eval_interval steps) may not have seen: evaluate it as it was trained.
    final_evals "$work/policy"
  fi
else
  echo "usage: $0 sft|sft_more|grpo WORK OUT" >&2
  exit 2
fi
