#!/usr/bin/env bash
# Builds OOM's libFuzzer targets (tests/fuzz: config.json/Json, safetensors, token files) with
# clang-14, ASan and UBSan in build-fuzz/, and runs each for N seconds (first argument, default 30)
# from the seed corpus in tests/fuzz/corpus/<target>/. Exits non-zero when a target crashes; the
# crashing input is left in build-fuzz/artifacts/<target>/ (replay: build-fuzz/tests/fuzz/<target> <file>).
# Needs only Debian packages; installs clang-14 and libclang-rt-14-dev (and the build deps) if missing.
set -euo pipefail

seconds=${1:-30}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${OOM_FUZZ_BUILD_DIR:-$root/build-fuzz}
targets=(fuzz_json_config fuzz_safetensors fuzz_token_file)

packages=(clang-14 libclang-rt-14-dev cmake ninja-build libfmt-dev doctest-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "fuzz: installing missing packages: ${missing[*]}"
  sudo_cmd=()
  [[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

cmake -S "$root" -B "$build" -G Ninja \
  -DCMAKE_CXX_COMPILER=clang++-14 -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DOOM_ENABLE_CUDA=OFF -DOOM_BUILD_FUZZERS=ON -DOOM_BUILD_TESTS=ON \
  -DOOM_BUILD_BENCH=OFF -DOOM_BUILD_EXAMPLES=OFF -DOOM_INSTALL=OFF >/dev/null
ninja -C "$build" "${targets[@]}"

declare -A dict=([fuzz_json_config]=json [fuzz_safetensors]=safetensors [fuzz_token_file]=token_file)
failed=()
for t in "${targets[@]}"; do
  seeds=$root/tests/fuzz/corpus/${t#fuzz_}
  work=$build/corpus/$t          # grows with what the fuzzer finds; the seeds stay untouched
  artifacts=$build/artifacts/$t/
  mkdir -p "$work" "$artifacts"
  echo "fuzz: $t for ${seconds}s"
  log=$build/$t.log
  # -rss_limit_mb: a parser that allocates gigabytes for a small input is a bug, reported as one.
  if "$build/tests/fuzz/$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=16384 \
      -dict="$root/tests/fuzz/dict/${dict[$t]}.dict" -artifact_prefix="$artifacts" -print_final_stats=1 \
      "$work" "$seeds" >"$log" 2>&1; then
    execs=$(grep -m1 -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
    echo "fuzz: $t ok: $execs executions, corpus $(ls "$work" | wc -l) inputs"
  else
    echo "fuzz: $t FAILED; last lines of $log:"
    tail -40 "$log"
    failed+=("$t")
  fi
done
if ((${#failed[@]})); then
  echo "fuzz: crashes in ${failed[*]} (inputs in $build/artifacts/)"
  exit 1
fi
