#!/usr/bin/env bash
# oom-train (host backend) against transformers over 50 steps on one config: the same initial
# weights and batches in PyTorch (scripts/compare_train_pytorch.py, on the CPU), every step's loss
# within 1e-2, and PyTorch against itself on another thread count printed beside it as the noise
# floor. Needs a Python with torch and transformers 5 ($OOM_TEST_PYTHON, default python3); exits
# 77 (skipped) without them. Usage: versus_transformers.sh path/to/oom-train CONFIG [oom-train args...];
# $COMPARE_ARGS goes to the comparison (a tighter --tolerance, say).
set -euo pipefail
train="$1"
config="$2"
shift 2
python="${OOM_TEST_PYTHON:-python3}"
here="$(cd "$(dirname "$0")/../.." && pwd)"
model_type=$(sed -nE 's/^ *"model_type": *"([a-z0-9_]+)".*/\1/p' "$config" | head -1)
if ! "$python" -c "import torch, safetensors, transformers.models.$model_type" 2> /dev/null; then
  echo "SKIP: $python has no torch, safetensors or transformers with $model_type (set OOM_TEST_PYTHON to one that has)"
  exit 77
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$train" --backend host --config "$config" --steps 50 --seq 64 --batch 2 --lr 3e-4 --log-every 50 --keep 3 \
  --save-initial --dump-batches "$work/run/batches.tok" --out "$work/run" "$@" > "$work/train.log"
"$python" "$here/scripts/compare_train_pytorch.py" --run "$work/run" --device cpu --noise-device cpu --noise-threads 1 ${COMPARE_ARGS:-} \
  2> "$work/compare.err" | tee "$work/compare.log" | grep -E 'noise floor|worst|from_pretrained|PASS|FAIL' || true
grep -q '^PASS' "$work/compare.log" || { tail -20 "$work/compare.err"; exit 1; }
