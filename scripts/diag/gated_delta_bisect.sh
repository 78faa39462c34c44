#!/usr/bin/env bash
# Times the chunked gated delta rule (bench_gated_delta) at several commits in one device call,
# each built from only the rule's sources and their few helpers (~20 s a tree, no oom::cuda).
#   here:        bash scripts/diag/gated_delta_bisect.sh prepare f5a1279 279f211 d075933
#                (git archive of each commit into bisect/<commit>/, git-ignored: pass the device
#                 tool carry ["bisect"]; "HEAD" is the working tree itself)
#   on the GPU:  bash scripts/diag/gated_delta_bisect.sh run [ROUNDS]   (logs in $OUT/b/)
# Forty-fourth session: the chunked forward measured 1.23x slower than the forty-first session's
# after the gpu-pending branches merged; bisect f5a1279 (forms by pass), 279f211 (lower tiles),
# d075933 (dG_last) and HEAD.
set -u
here=$(cd "$(dirname "$0")/../.." && pwd)
cd "$here"
build_one() {  # SRC OUTBIN
  local s=$1 w
  w=$(mktemp -d)
  for f in core/error.cpp core/names.cpp core/bytes.cpp cuda/check.cpp; do  # fmt breaks nvcc: g++
    g++ -O2 -std=c++20 -I"$s/include" -I"$s/src" -I/usr/local/cuda/include -c "$s/src/$f" -o "$w/$(basename "$f").o" || return 1
  done
  /usr/local/cuda/bin/nvcc -O3 -DNDEBUG -std=c++20 -arch=sm_90 --expt-relaxed-constexpr -I"$s/include" -I"$s/src" \
    -I"$s/src/kernels" -I"$s/tests" "$s/bench/kernels/bench_gated_delta.cpp" "$s/src/kernels/gated_delta.cu" \
    "$s/src/kernels/gated_delta_chunked.cu" "$w"/*.o -o "$2" -lfmt -lnccl -lcublas
}
case "${1:-}" in
  prepare)
    shift
    for c in "$@"; do mkdir -p "bisect/$c" && git archive "$c" | tar -x -C "bisect/$c"; done
    ls bisect ;;
  run)
    rounds=${2:-1}
    o=${OUT:-/tmp/out}
    mkdir -p "$o/b"
    SECONDS=0
    build_one . /tmp/bgd-HEAD > "$o/b/build-HEAD.log" 2>&1 &
    for d in bisect/*/; do c=$(basename "$d"); build_one "bisect/$c" "/tmp/bgd-$c" > "$o/b/build-$c.log" 2>&1 & done
    wait
    echo "built in $SECONDS s: $(ls /tmp/bgd-* | tr '\n' ' ')"
    for ((r = 1; r <= rounds; ++r)); do
      for b in /tmp/bgd-*; do
        n=${b#/tmp/bgd-}
        timeout 90 "$b" > "$o/b/bench-$n-$r.log" 2>&1
        echo "== $n round $r rc=$?"
        grep -E '^ +[12] ' "$o/b/bench-$n-$r.log"
      done
    done ;;
  *) echo "usage: $0 prepare COMMIT... | run [ROUNDS]"; exit 2 ;;
esac
