#!/usr/bin/env bash
# Where nothing fits, oom-plan names a --gpu-mem that plans, and that budget then plans (the
# error's estimate alone, "about 7.49 GiB" for Qwen3-30B-A3B at 4K, was 15% below the least that
# does, so that followed as written it found nothing). Usage: least_budget.sh path/to/oom-plan
set -uo pipefail
plan="$1"
model="$(dirname "$0")/../../examples/configs/qwen3-30b-a3b.json"
out=$("$plan" --model "$model" --seq 4096 --gpu-mem 7GiB --host-mem 2TiB 2>&1)
rc=$?
flag=$(grep -oE 'a search finds plans from [0-9.]+ GiB per GPU \(--gpu-mem [0-9]+MiB\)' <<< "$out" | grep -oE '[0-9]+MiB')
if [[ $rc -ne 3 || -z "$flag" ]]; then
  echo "FAIL: 7 GiB: exit $rc (want 3) and no --gpu-mem named:"; echo "$out"; exit 1
fi
if ! "$plan" --model "$model" --seq 4096 --gpu-mem "$flag" --host-mem 2TiB --candidates 1 | grep -q "predicted step"; then
  echo "FAIL: --gpu-mem $flag, as the error named it, found no plan"; exit 1
fi
# Where the host budget is what bars every plan, no GPU budget the machine has is named (a search
# up to 1 PiB had told a 20 GiB host to take 535 GiB of GPU memory): the host budget is.
out=$("$plan" --model "$model" --seq 4096 --gpu-mem 80GiB --host-mem 20GiB 2>&1)
if [[ $? -ne 3 ]] || ! grep -q "no GPU budget up to the h200 profile's 139.00 GiB finds a plan within the host budget of 20.00 GiB (--host-mem)" <<< "$out"; then
  echo "FAIL: a 20 GiB host:"; echo "$out"; exit 1
fi
echo "PASS: at 7 GiB the error names --gpu-mem $flag, which plans; with a 20 GiB host it names the host budget"
