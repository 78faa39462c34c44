#!/usr/bin/env bash
# Runs the host executor's tests under ThreadSanitizer (host-only build in build-tsan/): every
# correct schedule must be race-free, and the schedule that drops a wait (a test hook) must be
# reported — so a missing dependency between streams cannot pass by luck. Then the safetensors
# writer's tests (it fills the next batch on another thread while the last is written).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${OOM_TSAN_BUILD_DIR:-$root/build-tsan}
cmake -S "$root" -B "$build" -G Ninja -DOOM_ENABLE_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS=-fsanitize=thread -DOOM_BUILD_BENCH=OFF -DOOM_BUILD_EXAMPLES=OFF -DOOM_INSTALL=OFF >/dev/null
ninja -C "$build" test_runtime test_io_files
echo "tsan: correct schedules"
TSAN_OPTIONS="halt_on_error=1 exitcode=66" "$build/tests/test_runtime" -tce="dropping*"
echo "tsan: the broken schedule must be reported"
if TSAN_OPTIONS="halt_on_error=1 exitcode=66" "$build/tests/test_runtime" -tc="dropping*" > "$build/broken.log" 2>&1; then
  echo "tsan: FAILED — the schedule without its wait ran clean under ThreadSanitizer" >&2
  exit 1
fi
grep -q "ThreadSanitizer: data race" "$build/broken.log" || { cat "$build/broken.log" >&2; exit 1; }
echo "tsan: ok (race reported for the broken schedule only)"
echo "tsan: the safetensors writer"
TSAN_OPTIONS="halt_on_error=1 exitcode=66" "$build/tests/test_io_files" -sf="*test_safetensors*"
echo "tsan: ok (the writer's fills and writes race-free)"
