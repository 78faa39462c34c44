#!/usr/bin/env bash
# The main job: builds the example trainer and trains the built-in tiny Qwen3-MoE (4 layers, 8
# experts, 3.9M parameters) on the built-in corpus, on the host backend, under a 24 MiB "device"
# budget so the planner streams every layer's weights (see the plan it prints). The loss falls from
# ln 256 = 5.55 to about 3 within the first minute. Extra arguments go to oom-train (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release > /dev/null
cmake --build build --target oom-train
fresh=(--overwrite)
for a in "$@"; do [[ "$a" == --resume ]] && fresh=(); done  # --resume continues runs/demo instead
./build/examples/train/oom-train --out runs/demo "${fresh[@]}" --steps 100 --gpu-mem 24MiB "$@"
