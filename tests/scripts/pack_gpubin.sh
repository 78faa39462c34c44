#!/usr/bin/env bash
# scripts/pack-gpubin.sh on this build: the archive holds what a device call runs with
# PREBUILT=build (the trainer byte for byte, the ctest files) and nothing of the objects or of what
# tests left behind; a build directory outside the working tree is refused.
# Usage: pack_gpubin.sh SOURCE_DIR BUILD_DIR
set -uo pipefail
src="$1" build="$2"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
fails=0
fail() { echo "FAIL $*"; fails=$((fails + 1)); }
cd "$src" || exit 1
if ! out=$(GPUBIN_DIR="$work" bash scripts/pack-gpubin.sh "$build" 2>&1); then
  echo "FAIL: pack-gpubin.sh: $out"
  exit 1
fi
echo "$out"
rel=$(realpath --relative-to=. "$build")
list=$(tar tzf "$work/build.tgz")
for f in examples/train/oom-train tests/test_attention CTestTestfile.cmake tests/CTestTestfile.cmake; do
  grep -qx "$rel/$f" <<< "$list" || fail "the archive lacks $rel/$f"
done
if stray=$(grep -E '\.(o|a|so)$|/CMakeFiles/|/Testing/|/gpu-logs/|/checkpoint-|/train-[^/]*/|/package/(work|prefix)/' <<< "$list"); then
  fail "the archive holds $(wc -l <<< "$stray") build or run leftovers, e.g. $(head -1 <<< "$stray")"
fi
# Debian's Google Benchmark (soname libbenchmark.so.1debian, not the GPU machine's) goes along for
# the micro benchmarks, and nothing else of the system's libraries.
if [[ -f "$build/bench/micro/bench_checkpoint" ]] && ldd "$build/bench/micro/bench_checkpoint" | grep -q 'libbenchmark'; then
  soname=$(ldd "$build/bench/micro/bench_checkpoint" | grep -o 'libbenchmark[^ ]*' | head -1)
  grep -qx "$rel/carried-lib/$soname" <<< "$list" || fail "the archive lacks $rel/carried-lib/$soname (bench_checkpoint links it)"
fi
if other=$(grep "^$rel/carried-lib/." <<< "$list" | grep -v '/libbenchmark'); then
  fail "the archive carries other libraries: $other"
fi
mkdir "$work/x" && tar xzf "$work/build.tgz" -C "$work/x"
cmp -s "$work/x/$rel/examples/train/oom-train" "$build/examples/train/oom-train" || fail "the archived oom-train differs from the build's"
# A build directory outside the working tree would unpack elsewhere than its ctest files say.
mkdir "$work/outside" && cp "$build/CMakeCache.txt" "$work/outside/"
GPUBIN_DIR="$work/o" bash scripts/pack-gpubin.sh "$work/outside" > "$work/outside.log" 2>&1
rc=$?
[[ $rc -eq 2 ]] && grep -q "is outside the working tree" "$work/outside.log" || fail "outside build: exit $rc, $(cat "$work/outside.log")"
((fails == 0)) || exit 1
echo "PASS: the programs and ctest files packed, nothing else"
