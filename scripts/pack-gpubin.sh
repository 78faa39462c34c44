#!/usr/bin/env bash
# Packs this machine's CUDA build (sm_90, the CUDA 13.0 toolkit the GPU machine has) for a device
# call to run without building: a fresh device machine spends 480-580 s of a 600 s call, and of the
# session's 1,800 s of device time, building what is built here already.
#   bash scripts/pack-gpubin.sh [BUILD_DIR]        # default build; writes gpubin/build.tgz
# (GPUBIN_DIR: another folder for the archive; the device call carries gpubin.)
# Then, in a device call with carry ["gpubin"]:
#   tar xzf gpubin/build.tgz && PREBUILT=build PARTS=... bash scripts/gpu-check.sh
# The archive holds the build directory's programs (tests, benchmarks, examples) and its ctest
# files, not objects, libraries or what tests left behind. ctest's files name absolute paths, so the
# archive runs where the working tree has the same path as here (the device tool's copy does:
# /work/main on both). The build must be current: the script refuses one whose ninja has work left.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
[[ -f "$build/CMakeCache.txt" ]] || { echo "pack-gpubin: $build is not a CMake build directory" >&2; exit 2; }
# The archive unpacks into the working tree, so the build must lie in it (named relative to it).
build=$(realpath --relative-to=. "$build")
[[ "$build" != .. && "$build" != ../* ]] || { echo "pack-gpubin: $build is outside the working tree" >&2; exit 2; }
[[ "$build" != . ]] || { echo "pack-gpubin: an in-source build would pack the working tree itself" >&2; exit 2; }
dest=${GPUBIN_DIR:-gpubin}
# CUDA on (ON, or AUTO with a compiler found) and sm_90 among the architectures, as cmake/OomCuda.cmake reads them.
cache_value() { sed -n "s/^$1:[A-Z]*=//p" "$build/CMakeCache.txt" | head -1; }
archs=$(cache_value CMAKE_CUDA_ARCHITECTURES)
if [[ "$(cache_value OOM_ENABLE_CUDA)" == OFF || -z "$(cache_value CMAKE_CUDA_COMPILER)" ]] ||
   ! tr ';' '\n' <<< "$archs" | grep -Eq '^90a?(-real|-virtual)?$'; then
  echo "pack-gpubin: $build is not a CUDA build for sm_90 (-DOOM_ENABLE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90)" >&2
  exit 2
fi
grep -q '^CMAKE_BUILD_TYPE:STRING=Release' "$build/CMakeCache.txt" ||
  { echo "pack-gpubin: $build is not a Release build: its timings would not be ours" >&2; exit 2; }
if ! cmake --build "$build" -- -n 2> /dev/null | grep -q '^ninja: no work to do'; then
  echo "pack-gpubin: $build is not current with the tree (a dry run of its build has work left, or it is not a Ninja" \
    "build): build it first" >&2
  exit 2
fi
if [[ "$build" != build ]]; then
  echo "pack-gpubin: the archive unpacks as ./$build; PREBUILT=$build runs it" >&2
fi
list=$(mktemp)
trap 'rm -f "$list"' EXIT
# Programs and ctest files; not objects, CMake's own files, nor what runs left (logs, checkpoints,
# tests' run directories, the package tests' consumer builds, which rebuild on the machine).
{ find "$build" \( -name CMakeFiles -o -name gpu-logs -o -name Testing -o -name 'train-*' -o -name 'checkpoint-*' \
  -o -path "$build/tests/package/work" -o -path "$build/tests/package/prefix" -o -name 'peer-*' \) -prune -o \
  -type f \( -perm -u+x -o -name CTestTestfile.cmake \) ! -name '*.so' ! -name '*.sh' -print 2> /dev/null || true; } | sort > "$list"  # tests may remove files meanwhile
# Google Benchmark as Debian ships it (soname libbenchmark.so.1debian), which the GPU machine's own
# build of it does not provide: the micro benchmarks (bench_checkpoint, ...) would not start there.
# The library goes into the archive as $build/carried-lib/, where gpu-check.sh's PREBUILT runs find
# it (LD_LIBRARY_PATH); nothing else is carried (CUDA, NCCL, fmt and the C++ runtime are there).
carried=$(mktemp -d)
trap 'rm -f "$list"; rm -rf "$carried"' EXIT
mkdir -p "$carried/$build/carried-lib"
while read -r program; do  # (ldd refuses scripts and static programs: nothing to carry for them)
  { ldd "$program" 2> /dev/null || true; } | sed -n 's/^[[:space:]]*\(libbenchmark[^ ]*\) => \(\/[^ ]*\) .*/\1 \2/p'
done < <(grep -v 'CTestTestfile.cmake$' "$list") | sort -u | while read -r soname path; do
  cp -L "$path" "$carried/$build/carried-lib/$soname"
done
mkdir -p "$dest"
if [[ -n "$(ls -A "$carried/$build/carried-lib")" ]]; then
  tar czf "$dest/build.tgz.tmp" -T "$list" -C "$carried" "$build/carried-lib"
else
  tar czf "$dest/build.tgz.tmp" -T "$list"
fi
# The device tool carries at most 64 MiB with the working tree (~5 MiB of it tracked files).
bytes=$(stat -c %s "$dest/build.tgz.tmp")
if ((bytes > 56 * 1048576)); then
  rm -f "$dest/build.tgz.tmp"
  echo "pack-gpubin: $((bytes / 1048576)) MiB, over what the device tool carries beside the tree (64 MiB in all)" >&2
  exit 1
fi
mv -f "$dest/build.tgz.tmp" "$dest/build.tgz"
echo "$dest/build.tgz: $(wc -l < "$list") files$(ls "$carried/$build/carried-lib" | sed 's/^/ + /' | tr '\n' ' ' | sed 's/ $//'), $((bytes / 1048576)) MiB, at $(git rev-parse --short HEAD 2> /dev/null || echo '?')$(git diff --quiet HEAD 2> /dev/null || echo ' (tree dirty)')"
