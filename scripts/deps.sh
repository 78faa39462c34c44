#!/usr/bin/env bash
# Installs the Debian packages OOM builds with, when missing (needs root or sudo), and puts the
# CUDA toolkit's nvcc on PATH when it is installed but not found. Sourced by test.sh and .ci/run.
set -euo pipefail

oom_packages=(cmake ninja-build g++ libfmt-dev doctest-dev libbenchmark-dev python3)
missing=()
for p in "${oom_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "oom: installing missing packages: ${missing[*]}"
  sudo_cmd=()
  [[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
if ! command -v nvcc >/dev/null 2>&1; then
  for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do
    if [[ -x "$d/nvcc" ]]; then export PATH="$d:$PATH"; break; fi
  done
fi
