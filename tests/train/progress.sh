#!/usr/bin/env bash
# oom-train on a step that runs long enough: it reports its layer passes in order (forward 0..n-1,
# then backward n-1..0), per micro-batch. --step-progress 0 makes every step "long". And a traced
# step: its measured timeline and, beside it, the prediction's, both Chrome trace JSON.
#   bash tests/train/progress.sh path/to/oom-train
set -uo pipefail
train=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if ! "$train" --backend host --out "$work/run" --steps 2 --seq 32 --micro-batches 2 --step-progress 0 --checkpoint-every 0 \
    --log-every 1 > "$work/out.txt" 2>&1; then
  echo "FAIL: oom-train exited non-zero"; cat "$work/out.txt"; exit 1
fi
# The built-in model has 4 layers: 8 passes per micro-batch, 2 micro-batches, 2 steps.
got=$(grep -E '^  step [0-9]+ micro-batch' "$work/out.txt" | sed -E 's/^  step ([0-9]+) micro-batch ([0-9])\/2: (forward|backward) layer ([0-9]+).*/\1.\2.\3.\4/' | tr '\n' ' ')
want=""
for step in 1 2; do
  for mb in 1 2; do
    for l in 0 1 2 3; do want+="$step.$mb.forward.$l "; done
    for l in 3 2 1 0; do want+="$step.$mb.backward.$l "; done
  done
done
if [[ "$got" != "$want" ]]; then
  echo "FAIL: progress lines"; echo " got: $got"; echo "want: $want"; cat "$work/out.txt"; exit 1
fi
# metrics.jsonl: every step has the host RSS and its high-water mark (VmHWM), the peak no lower.
python3 -c "import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
ok = len(rows) == 2 and all(r['host_rss_peak_bytes'] >= r['host_rss_bytes'] > 0 for r in rows)
sys.exit(0 if ok else 1)" "$work/run/metrics.jsonl" ||
  { echo "FAIL: metrics' host_rss_bytes / host_rss_peak_bytes"; cat "$work/run/metrics.jsonl"; exit 1; }
# Without --step-progress 0 (the default, 30 s) these short steps say nothing.
"$train" --backend host --out "$work/quiet" --steps 1 --seq 32 --checkpoint-every 0 > "$work/quiet.txt" 2>&1
if grep -qE '^  step [0-9]+: ' "$work/quiet.txt"; then echo "FAIL: short steps reported progress"; exit 1; fi
# Without --host-mem the budget leaves room beside the plan: the built-in h200 profile's 125 GiB,
# or this machine's memory where it has less, less what building the model holds (the host
# backend: the initial weights) and a tenth (at least 4 GiB); with --host-mem it is what was asked,
# and says nothing.
grep -qE '^host budget 112\.[0-9]+ GiB \(the profile.s 125\.00 GiB less [0-9.]+ MiB held while the model is built and 12\.50 GiB headroom' "$work/quiet.txt" ||
  grep -qE '^host budget [0-9.]+ [KMG]iB \(this machine.s [0-9.]+ [KMG]iB, below the profile.s 125\.00 GiB, less [0-9.]+ MiB held while the model is built and [0-9.]+ [KMG]iB headroom' "$work/quiet.txt" ||
  { echo "FAIL: default host budget line"; grep -i budget "$work/quiet.txt"; exit 1; }
# Where this machine has less memory than the profile, the budget is held below it.
machine_kib=$(awk '/^MemTotal:/ {print $2}' /proc/meminfo)
budget=$(sed -nE 's/^host budget ([0-9.]+ [KMG]iB).*/\1/p' "$work/quiet.txt")
python3 -c "import sys
v, unit = sys.argv[1].split()
b = float(v) * 2 ** (10 * ('KMG'.index(unit[0]) + 1))
sys.exit(0 if b < int(sys.argv[2]) * 1024 or b > 112 * 2**30 else 1)" "$budget" "$machine_kib" ||
  { echo "FAIL: host budget $budget not below this machine's $machine_kib KiB"; exit 1; }
"$train" --backend host --out "$work/budget" --steps 1 --seq 32 --checkpoint-every 0 --host-mem 2GiB > "$work/budget.txt" 2>&1
grep -q '^host budget' "$work/budget.txt" && { echo "FAIL: --host-mem still printed the default budget"; exit 1; }
grep -q 'of 2.00 GiB budget' "$work/budget.txt" || { echo "FAIL: --host-mem 2GiB not the plan's host budget"; grep -i budget "$work/budget.txt"; exit 1; }
# A window longer than the config's max_position_embeddings trains, with a note saying so (and none
# within it: the quiet run above, at 32 of the built-in config's 4096).
sed 's/"max_position_embeddings": [0-9]*/"max_position_embeddings": 16/' "$(dirname "$0")/../../examples/configs/tiny-moe.json" > "$work/short-positions.json"
"$train" --backend host --out "$work/positions" --config "$work/short-positions.json" --steps 1 --seq 32 --checkpoint-every 0 \
  > "$work/positions.txt" 2>&1 || { echo "FAIL: run past max_position_embeddings"; cat "$work/positions.txt"; exit 1; }
grep -q "^note: --seq 32 is longer than the config's max_position_embeddings (16)" "$work/positions.txt" ||
  { echo "FAIL: no note past max_position_embeddings"; head -5 "$work/positions.txt"; exit 1; }
if grep -q "max_position_embeddings" "$work/quiet.txt"; then echo "FAIL: a note within max_position_embeddings"; exit 1; fi
# --trace-step: the measured and the predicted timeline of that step, each with the layers' spans.
"$train" --backend host --out "$work/traced" --steps 2 --seq 32 --checkpoint-every 0 --trace-step 2 --trace "$work/t.json" \
  > "$work/traced.txt" 2>&1 || { echo "FAIL: traced run"; cat "$work/traced.txt"; exit 1; }
for f in "$work/t.json" "$work/t.predicted.json"; do
  if ! python3 -c "import json, sys; d = json.load(open(sys.argv[1])); ev = d['traceEvents'] if isinstance(d, dict) else d; \
names = [e.get('name', '') for e in ev]; sys.exit(0 if sum('fwd' in n for n in names) >= 4 and sum('bwd' in n for n in names) >= 4 else 1)" "$f"; then
    echo "FAIL: $f is not a trace with every layer's forward and backward"; exit 1
  fi
done
# The line oom::write_step_traces writes (oom-custom-layer --trace shares it): both files, the busy
# seconds measured / predicted, the step's.
grep -Eq "^step 2 recorded in [^ ]*t\.json \([1-9][0-9]* spans; the prediction's in [^ ]*t\.predicted\.json;.*busy s measured / predicted, gpu_compute [0-9.e+-]+ / [0-9.e+-]+.*; step [0-9.e+-]+ / [0-9.e+-]+$" \
  "$work/traced.txt" || { echo "FAIL: the traced step's line"; cat "$work/traced.txt"; exit 1; }
echo "PASS: layer passes reported in order, per micro-batch; short steps quiet; traced step measured and predicted"
