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

"$train" "${args[@]}" --out "$work/killed" > "$work/killed.log" &
pid=$!
# Kill it two steps after its second checkpoint (step 8), mid-way to the third (step 12).
for _ in $(seq 1 6000); do
  if grep -qs "checkpoint-000008" "$work/killed/latest" && [[ $(wc -l < "$work/killed/metrics.jsonl") -ge 10 ]]; then break; fi
  if ! kill -0 "$pid" 2> /dev/null; then echo "FAIL: the run ended before it could be killed"; exit 1; fi
  sleep 0.01
done
kill -9 "$pid"
wait "$pid" 2> /dev/null || true
killed_at=$(wc -l < "$work/killed/metrics.jsonl")
echo "killed after $killed_at logged steps; latest: $(cat "$work/killed/latest")"
[[ "$(cat "$work/killed/latest")" == checkpoint-000008 ]] || { echo "FAIL: latest is not checkpoint-000008"; exit 1; }
# Step 12 logged with `latest` still at 8 is a kill during checkpoint 12's save (an H100 ran the
# CUDA run's steps ~ms apart and landed there): resuming from 8 is the same test.
[[ "$killed_at" -gt 8 && "$killed_at" -le 12 ]] || { echo "FAIL: killed after $killed_at steps, not between checkpoints 8 and 12"; exit 1; }

"$train" "${args[@]}" --out "$work/killed" --resume > "$work/resumed.log"
grep -q "resumed from .*checkpoint-000008 at step 8" "$work/resumed.log"

loss() { sed -E 's/.*"step":([0-9]+).*"loss":([^,]+),.*/\1 \2/' "$1"; }
if ! diff <(loss "$work/straight/metrics.jsonl") <(loss "$work/killed/metrics.jsonl"); then
  echo "FAIL: the resumed run's losses differ from the uninterrupted run's"; exit 1
fi
[[ $(wc -l < "$work/killed/metrics.jsonl") -eq 24 ]] || { echo "FAIL: expected 24 metrics lines"; exit 1; }
cmp "$work/straight/checkpoint-000024/model.safetensors" "$work/killed/checkpoint-000024/model.safetensors"
cmp "$work/straight/checkpoint-000024/optimizer.safetensors" "$work/killed/checkpoint-000024/optimizer.safetensors"
echo "PASS: 24 losses and the final weights and moments are bit-identical after SIGKILL + resume"
