#!/usr/bin/env bash
# Builds everything (CUDA sources too when nvcc is present) and runs the tests.
#   bash scripts/test.sh            # build in ./build and run every test (gpu tests skip without a GPU)
# Environment: BUILD_DIR (default build), CUDA_ARCHS (default 90), OOM_ENABLE_CUDA (default AUTO),
#              JOBS (default: number of cores).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
build_dir=${BUILD_DIR:-build}
jobs=${JOBS:-$(nproc)}
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DOOM_ENABLE_CUDA="${OOM_ENABLE_CUDA:-AUTO}" -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-90}"
cmake --build "$build_dir" -j "$jobs"
ctest --test-dir "$build_dir" --output-on-failure -j "$jobs"
