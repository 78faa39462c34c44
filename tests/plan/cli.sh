#!/usr/bin/env bash
# oom-plan's CUDA-executor line follows the executor options: the 5.13B model at 512K with the
# plan oom-train chose on the H200 (--host-mem 85GiB) pins less with a gradient staging ring (the
# default, 3 layers) than per parameter (--grad-staging 0), and predicts a shorter step when the
# attention state is kept (the default) than rerunning whole layers (--no-keep-attention-state).
#   bash tests/plan/cli.sh path/to/oom-plan path/to/examples/configs/moe-5b.json
set -uo pipefail
plan=$1 config=$2
line() { "$plan" --model "$config" --seq 524288 --host-mem 85GiB --candidates 1 "$@" | grep "^CUDA executor"; }
base=$(line --grad-staging 0 --no-keep-attention-state) || { echo "FAIL: no CUDA executor line"; exit 1; }
ring=$(line --grad-staging 3 --no-keep-attention-state)
kept=$(line --grad-staging 0 --keep-attention-state)
default=$(line)
[[ "$default" == "$(line --grad-staging 3 --keep-attention-state)" ]] || { echo "FAIL: the defaults are not a ring of 3 with kept attention"; exit 1; }
pinned() { sed -E 's/.* and ([0-9.]+) GiB pinned.*/\1/' <<< "$1"; }
step() { sed -E 's/.*predicted step ([0-9.]+) s.*/\1/' <<< "$1"; }
echo "per-parameter staging, whole-layer rerun: $(pinned "$base") GiB pinned, $(step "$base") s; ring of 3: $(pinned "$ring") GiB; kept attention: $(step "$kept") s"
awk -v a="$(pinned "$ring")" -v b="$(pinned "$base")" 'BEGIN { exit !(a + 10 < b) }' || { echo "FAIL: the ring did not cut pinned memory"; exit 1; }
# 16 layers' attention forward not run again: ~48 s with the wgmma kernels' curves (built-in h200
# profile since the seventh session; ~70 s with the mma.sync kernels' before).
awk -v a="$(step "$kept")" -v b="$(step "$base")" 'BEGIN { exit !(a + 30 < b) }' || { echo "FAIL: kept attention did not shorten the step by 30 s"; exit 1; }
"$plan" --model "$config" --grad-staging -1 > /dev/null 2>&1 && { echo "FAIL: --grad-staging -1 accepted"; exit 1; }
echo "PASS"
