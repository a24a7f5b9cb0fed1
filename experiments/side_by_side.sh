#!/usr/bin/env bash
# Several `gpu_easy.sh` jobs at once on one device call (one SFT or GRPO run leaves an H200
# about half idle: BENCHMARKS.md, "Twenty-ninth attempt"), with what comes back kept under the
# device's limit of 8 files: every job's logs and metrics go into OUT/texts.tgz, its packed
# policies (*.tgz.part-*) stay in OUT/NAME.
#
#   bash experiments/side_by_side.sh JOBS
#
# JOBS: one job a line, `NAME PHASE VAR=VALUE ...` in shell words (quote a value that holds
# spaces: "GRPO_EXTRA=a=1 b=2"); `#` starts a comment. Each job runs
# `env VAR=VALUE ... bash experiments/gpu_easy.sh PHASE /tmp/w_NAME OUT/NAME` in the
# background, its output in OUT/NAME/log.txt; the call waits for all of them.
# DATA=DIR: a folder of training rows made beforehand (`train.parquet`, `eval.parquet` and the
# `train.key` gpu_easy.sh writes), copied into each job's WORK/data, so the jobs skip making them.
# WHEELS=DIR (default .whl): the wheels the GPU image lacks, installed to /tmp/site first.
# Prints each job's exit status and its evaluations on the 64 and the larger sets at the end.
set -euo pipefail
jobs_file=$1
: "${OUT:?OUT must name the folder whose files come back}"
WHEELS=${WHEELS:-.whl}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -d "$WHEELS" ]; then
  # The wheels are built for the GPU image's Python; elsewhere (a CPU check) pip refuses them
  # and the jobs go on with the Python's own packages, said here rather than hidden.
  if python3 -m pip install -q --no-index --no-deps --target /tmp/site "$WHEELS"/*.whl; then
    export PYTHONPATH=/tmp/site:$PYTHONPATH
  else
    echo "side_by_side: the wheels in $WHEELS were not installed (pip's error above)" >&2
  fi
fi
export HF_HUB_OFFLINE=1 CLEW=${CLEW:-python3 -m clew}
names=()
while IFS= read -r line || [ -n "$line" ]; do
  line=${line%%#*}
  [ -n "${line//[[:space:]]/}" ] || continue
  eval "set -- $line"
  [ $# -ge 2 ] || { echo "side_by_side: '$line' needs NAME PHASE [VAR=VALUE ...]" >&2; exit 2; }
  name=$1 phase=$2
  shift 2
  work=/tmp/w_$name
  mkdir -p "$work/data" "$OUT/$name"
  if [ -n "${DATA:-}" ]; then cp "$DATA"/* "$work/data/"; fi
  (
    rc=0
    env "$@" bash experiments/gpu_easy.sh "$phase" "$work" "$OUT/$name" >"$OUT/$name/log.txt" 2>&1 || rc=$?
    echo "rc $rc" >>"$OUT/$name/log.txt"
  ) &
  names+=("$name")
done <"$jobs_file"
[ ${#names[@]} -gt 0 ] || { echo "side_by_side: no job in $jobs_file" >&2; exit 2; }
wait
for name in "${names[@]}"; do
  echo "$name: $(tail -n 1 "$OUT/$name/log.txt")"
  if [ -f "$OUT/$name/final_eval.json" ]; then
    grep -h 'pass_at_1"' "$OUT/$name/final_eval.json" | sed "s/^/  /" || true
  fi
done
cd "$OUT"
tar czf texts.tgz --exclude='*.tgz.part-*' "${names[@]}"
find "${names[@]}" -type f ! -name '*.tgz.part-*' -delete
find . -type f | sort
