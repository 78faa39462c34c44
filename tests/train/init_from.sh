#!/usr/bin/env bash
# --init-from a directory: one of our checkpoints (or a Hugging Face model directory) starts a run
# with its weights and, without --config, the config.json beside them. Usage: init_from.sh oom-train
set -euo pipefail
train="$1"
here="$(cd "$(dirname "$0")/../.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$train" --config "$here/examples/configs/tiny-mixtral.json" --seq 32 --steps 2 --out "$work/first" > "$work/first.log"
ckpt="$work/first/checkpoint-000002"
[[ -f "$ckpt/config.json" && -f "$ckpt/model.safetensors" ]] || { echo "FAIL: no checkpoint"; exit 1; }
"$train" --init-from "$ckpt" --seq 32 --steps 2 --log-every 1 --out "$work/second" > "$work/second.log"
grep -q "config $ckpt/config.json (beside --init-from" "$work/second.log" || { echo "FAIL: $(head -3 "$work/second.log")"; exit 1; }
grep -q "model $ckpt/config.json: 2 layers, 4 experts (top 2)" "$work/second.log" || { echo "FAIL: $(grep '^oom-train: model' "$work/second.log")"; exit 1; }
# Started from the trained weights, not a fresh init: the first loss is below the fresh run's.
fresh=$(head -1 "$work/first/metrics.jsonl" | sed -E 's/.*"loss":([^,]+),.*/\1/')
resumed=$(head -1 "$work/second/metrics.jsonl" | sed -E 's/.*"loss":([^,]+),.*/\1/')
awk -v a="$resumed" -v b="$fresh" 'BEGIN { exit !(a < b) }' || { echo "FAIL: first loss $resumed, a fresh run's $fresh"; exit 1; }
# --config still picks another (here the same widths, so the weights fit).
"$train" --init-from "$ckpt" --config "$here/examples/configs/tiny-mixtral.json" --seq 32 --steps 1 --out "$work/third" > "$work/third.log"
grep -q "beside --init-from" "$work/third.log" && { echo "FAIL: --config was overridden"; exit 1; }
# Resumed without --config: the checkpoint's config (not the built-in model's).
"$train" --resume --seq 32 --steps 3 --out "$work/second" > "$work/resume.log" || { cat "$work/resume.log"; echo "FAIL: resume"; exit 1; }
grep -q "config $work/second/checkpoint-000002/config.json (the checkpoint's" "$work/resume.log" ||
  { echo "FAIL: resume read $(head -2 "$work/resume.log")"; exit 1; }
# A directory of weights without a config.json, and no --config: refused by name.
mkdir -p "$work/bare" && cp "$ckpt/model.safetensors" "$work/bare/"
if "$train" --init-from "$work/bare" --seq 32 --steps 1 --out "$work/fourth" > "$work/bare.log" 2>&1; then echo "FAIL: bare dir ran"; exit 1; fi
grep -q "the directory has no config.json; pass --config" "$work/bare.log" || { echo "FAIL: $(cat "$work/bare.log")"; exit 1; }
echo "PASS: first loss $resumed from the checkpoint, $fresh fresh"
