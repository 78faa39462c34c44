#!/usr/bin/env bash
# oom-plan's CUDA-executor line follows the executor options: the 5.13B model at 512K with the
# plan oom-train chose on the H200 (--host-mem 85GiB) pins less with a gradient staging ring and
# predicts a shorter step when the attention state is kept.
#   bash tests/plan/cli.sh path/to/oom-plan path/to/examples/configs/moe-5b.json
set -uo pipefail
plan=$1 config=$2
line() { "$plan" --model "$config" --seq 524288 --host-mem 85GiB --candidates 1 "$@" | grep "^CUDA executor"; }
base=$(line) || { echo "FAIL: no CUDA executor line"; exit 1; }
ring=$(line --grad-staging 3)
kept=$(line --keep-attention-state)
pinned() { sed -E 's/.* and ([0-9.]+) GiB pinned.*/\1/' <<< "$1"; }
step() { sed -E 's/.*predicted step ([0-9.]+) s.*/\1/' <<< "$1"; }
echo "base: $(pinned "$base") GiB pinned, $(step "$base") s; ring of 3: $(pinned "$ring") GiB; kept attention: $(step "$kept") s"
awk -v a="$(pinned "$ring")" -v b="$(pinned "$base")" 'BEGIN { exit !(a + 10 < b) }' || { echo "FAIL: the ring did not cut pinned memory"; exit 1; }
awk -v a="$(step "$kept")" -v b="$(step "$base")" 'BEGIN { exit !(a + 50 < b) }' || { echo "FAIL: kept attention did not shorten the step"; exit 1; }
"$plan" --model "$config" --grad-staging 0 > /dev/null 2>&1 && { echo "FAIL: --grad-staging 0 accepted"; exit 1; }
echo "PASS"
