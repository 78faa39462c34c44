#!/usr/bin/env bash
# A run killed with SIGKILL and resumed from its last checkpoint logs the same losses, bit for bit,
# as the same run left alone (host backend). Usage: kill_resume.sh path/to/oom-train
set -euo pipefail
train="$1"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# Extra oom-train arguments from $TRAIN_ARGS (e.g. a GPU run: --backend cuda --config ...).
# shellcheck disable=SC2206
args=(--seq 64 --steps 24 --checkpoint-every 4 --log-every 100 ${TRAIN_ARGS:---gpu-mem 14MiB})

"$train" "${args[@]}" --out "$work/straight" > "$work/straight.log"
# It learns: the loss falls by more than a nat from ln 256 = 5.55 within 24 steps.
first=$(head -1 "$work/straight/metrics.jsonl" | sed -E 's/.*"loss":([^,]+),.*/\1/')
last=$(tail -1 "$work/straight/metrics.jsonl" | sed -E 's/.*"loss":([^,]+),.*/\1/')
awk -v f="$first" -v l="$last" 'BEGIN { exit !(f - l > 1.0) }' || { echo "FAIL: loss $first -> $last did not fall"; exit 1; }
echo "loss $first -> $last over 24 steps"
# Each save says what it wrote: the checkpoint's bytes (its files', summed), its time and rate.
n_saved=$(grep -cE "^checkpoint .*/checkpoint-0000(04|08|12|16|20|24) written \([0-9.]+ [KMGT]?i?B in [0-9.]+ s, [0-9.]+ [KMGT]?i?B/s\)$" "$work/straight.log")
[[ "$n_saved" -eq 6 ]] || { echo "FAIL: $n_saved of 6 saves said what they wrote"; grep checkpoint "$work/straight.log"; exit 1; }

# Killed two steps after its second checkpoint (step 8), mid-way to the third, where the poll
# catches it there. The kill lands wherever the run is by then: on a fast GPU the steps are ~ms
# apart (an H100 ran the CUDA run's to step 12, its checkpoint 12 being saved, 2026-12-06), so any
# checkpoint from 8 to 20 with steps logged after it is the same test; a run that ends before the
# kill is started again (at most 3 tries).
killed_ok=0
for try in 1 2 3; do
  rm -rf "$work/killed"
  "$train" "${args[@]}" --out "$work/killed" > "$work/killed.log" &
  pid=$!
  for _ in $(seq 1 6000); do
    if grep -qs "checkpoint-0000[0-9][0-9]" "$work/killed/latest" && ! grep -qs "checkpoint-000004" "$work/killed/latest" &&
      [[ $(wc -l < "$work/killed/metrics.jsonl") -ge 10 ]]; then break; fi
    if ! kill -0 "$pid" 2> /dev/null; then break; fi
    sleep 0.01
  done
  kill -9 "$pid" 2> /dev/null || true
  rc=0
  wait "$pid" 2> /dev/null || rc=$?
  # 137: the SIGKILL; 0: the run ended first (tried again); anything else: it failed on its own.
  [[ $rc -eq 0 || $rc -eq 137 ]] || { echo "FAIL: try $try: the run exited $rc by itself"; cat "$work/killed.log"; exit 1; }
  killed_at=$(wc -l < "$work/killed/metrics.jsonl" 2> /dev/null || echo 0)
  latest=$(cat "$work/killed/latest" 2> /dev/null || true)
  saved=0
  [[ "$latest" =~ ^checkpoint-[0-9]{6}$ ]] && saved=$((10#${latest#checkpoint-}))
  echo "try $try: killed after $killed_at logged steps; latest: $latest"
  if [[ $rc -eq 137 && "$saved" -ge 8 && "$saved" -le 20 && "$killed_at" -gt "$saved" && "$killed_at" -le 24 ]]; then
    killed_ok=1
    break
  fi
done
[[ "$killed_ok" -eq 1 ]] || { echo "FAIL: three runs ended, or were killed, outside checkpoints 8-20 with steps after them"; exit 1; }

"$train" "${args[@]}" --out "$work/killed" --resume > "$work/resumed.log"
grep -q "resumed from .*$latest at step $saved" "$work/resumed.log"

loss() { sed -E 's/.*"step":([0-9]+).*"loss":([^,]+),.*/\1 \2/' "$1"; }
if ! diff <(loss "$work/straight/metrics.jsonl") <(loss "$work/killed/metrics.jsonl"); then
  echo "FAIL: the resumed run's losses differ from the uninterrupted run's"; exit 1
fi
[[ $(wc -l < "$work/killed/metrics.jsonl") -eq 24 ]] || { echo "FAIL: expected 24 metrics lines"; exit 1; }
python3 "$(dirname "$0")/same_tensors.py" "$work/straight/checkpoint-000024/model.safetensors" "$work/killed/checkpoint-000024/model.safetensors"
python3 "$(dirname "$0")/same_tensors.py" "$work/straight/checkpoint-000024/optimizer.safetensors" "$work/killed/checkpoint-000024/optimizer.safetensors"
echo "PASS: 24 losses and the final weights and moments are bit-identical after SIGKILL + resume"
