#!/usr/bin/env bash
# Planning alone: builds oom-plan and plans a training step of the
# 5.13B benchmark model at one 128K-token sequence on one H200 (extra arguments go to oom-plan).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release > /dev/null
cmake --build build --target oom-plan
./build/examples/plan/oom-plan --model examples/configs/moe-5b.json --seq 131072 "$@"
