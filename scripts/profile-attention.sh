#!/usr/bin/env bash
# On the GPU machine: where the wgmma attention forward's time goes. Builds bench_attention and
# test_attention_wgmma for sm_90, prints the forward timing against mma.sync, then profiles the
# default forward kernel at one sequence length with Nsight Compute (full set, source-level warp
# stall sampling) and prints the SASS lines with the most stall samples. Logs and the report go
# to <build>/profile-logs; when $OUT is set (the device tool's return folder, at most 8 files)
# they come back as $OUT/profile-logs.tgz beside $OUT/top-stalls.txt.
#   bash scripts/profile-attention.sh            # S = 16384
#   SEQ=4096 KERNEL=attention_backward_wgmma_kernel bash scripts/profile-attention.sh
# Needs ncu with access to the hardware counters (not under gVisor: device KINDS.md); clocks are
# left alone (--clock-control none).
set -uo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build-gpu}
out=$build/profile-logs
seq=${SEQ:-16384}
kernel=${KERNEL:-attention_forward_wgmma_kernel}
rm -rf "$out"
mkdir -p "$out"
# Whatever happens below, what was logged comes back (the device tool returns at most 8 files).
bring_back() {
  [[ -n "${OUT:-}" ]] || return 0
  tar czf "$OUT/profile-logs.tgz" -C "$build" profile-logs
  [[ -f "$out/top-stalls.txt" ]] && cp "$out/top-stalls.txt" "$OUT/"
  return 0
}
trap bring_back EXIT
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DOOM_ENABLE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  > "$out/configure.log" 2>&1 || { tail -20 "$out/configure.log"; exit 1; }
cmake --build "$build" -j "$(nproc)" --target bench_attention test_attention_wgmma > "$out/build.log" 2>&1 ||
  { grep -E -A5 'error|FAILED' "$out/build.log" | head -40; exit 1; }

echo "== forward timing (test_attention_wgmma timing case)"
timeout 180 "$build/tests/test_attention_wgmma" -tc="*timing*" > "$out/forward-timing.log" 2>&1
grep -E "^S=|^    " "$out/forward-timing.log"

echo "== ncu: $kernel at S = $seq (first launch)"
command -v ncu > /dev/null || { echo "no ncu on this machine"; exit 1; }
rm -f "$out/profile.ncu-rep"
timeout 300 ncu --clock-control none -k "regex:$kernel" -c 1 --set full --import-source yes \
  -o "$out/profile" "$PWD/$build/bench/kernels/bench_attention" --seq "$seq" --repeats 1 > "$out/ncu.log" 2>&1 ||
  { tail -20 "$out/ncu.log"; exit 1; }
ncu -i "$out/profile.ncu-rep" --page details > "$out/details.txt" 2>&1
ncu -i "$out/profile.ncu-rep" --page source --csv --print-source sass > "$out/source.csv" 2> "$out/source.err"
grep -E "Duration|Compute \(SM\) Throughput|L2 Cache Throughput|Issue Slots Busy|Warp Cycles Per Issued" "$out/details.txt"
python3 scripts/diag/ncu_top_stalls.py "$out/source.csv" 40 | tee "$out/top-stalls.txt"
