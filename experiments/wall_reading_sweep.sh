#!/usr/bin/env bash
# wall_reading.py for several policies at once on one GPU (issue 4, session 10).
#
#   bash experiments/wall_reading_sweep.sh WORK OUT [MINUTES]
#
# Building 8 models and their data takes about 2.5 minutes on the H200 host before training
# starts: MINUTES=6 fits a 10-minute device call (7.3 did not, session 10). 17 files land in
# OUT: tar them into one before they come back (a call returns at most 8 files).
#
# Each variant: NAME PRESET BORDER LR [init-model flags...]. A BORDER of 7 draws a
# half-cell wall border so the 14 px patches fall across the cells' centres (image 140 px
# instead of 126). Logs go to OUT/NAME.log; all variants run side by side.
set -uo pipefail
work=$(realpath -m "$1")
out=$(realpath -m "$2")
minutes=${3:-8}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
CLEW=${CLEW:-clew}
PYTHON=${PYTHON:-python3}
mkdir -p "$work" "$out"
theta='rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [12, 10, 10], "mrope_interleaved": true}'
variants=(
  "A small 0 1e-3"
  "B small 7 1e-3"
  "C small 0 3e-4"
  "D small 7 3e-4"
  "E small 0 1e-3 --text THETA"
  "F small 0 1e-3 --vision hidden_size=256 --vision num_heads=8 --vision intermediate_size=1024"
  "G tiny 7 1e-3"
  "H small 7 3e-4 --text THETA"
)
for v in "${variants[@]}"; do
  read -r name preset pad lr flags <<<"$v"
  size=$((126 + 2 * pad))
  args=()
  for f in $flags; do [ "$f" = THETA ] && args+=("$theta") || args+=("$f"); done
  $CLEW init-model --preset "$preset" --arch qwen3_vl --image-size "$size" --patch-size 14 \
    --merge-size 1 --output "$work/$name" --overwrite "${args[@]}" >"$out/$name.init.log" 2>&1 || {
    echo "$name: init-model failed" && cat "$out/$name.init.log"
    continue
  }
  (cd experiments && BORDER=$pad $PYTHON wall_reading.py "$work/$name" "$minutes" "${DEVICE:-cuda}" 64 "$lr" \
    >"$out/$name.log" 2>&1) &
done
wait
for v in "${variants[@]}"; do
  read -r name _ <<<"$v"
  echo "$name: $v | $(tail -1 "$out/$name.log")"
done
