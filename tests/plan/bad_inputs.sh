#!/usr/bin/env bash
# oom-plan's arguments, on any build: each bad one is refused with exit 2 and one stderr line naming
# the flag, before anything is planned; a size as oom-plan prints it reads back.
#   bash tests/plan/bad_inputs.sh path/to/oom-plan path/to/examples/configs/tiny-moe.json
set -uo pipefail
plan=$1 config=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fails=0

# refused NAME PATTERN ARGS...: exit 2, one stderr line matching PATTERN, nothing on stdout
refused() {
  local name=$1 pattern=$2
  shift 2
  "$plan" --model "$config" --seq 32 --candidates 1 "$@" > "$work/out" 2> "$work/err"
  local rc=$?
  if [[ $rc -ne 2 ]] || ! grep -q -- "$pattern" "$work/err" || [[ $(wc -l < "$work/err") -ne 1 ]] || [[ -s "$work/out" ]]; then
    echo "FAIL $name: exit $rc (want 2), want one stderr line /$pattern/ and no plan:"; cat "$work/err"; head -3 "$work/out"
    fails=$((fails + 1))
  else
    echo "ok   $name: $(cat "$work/err")"
  fi
}

# Numbers: a sign or a space had slipped past the check of the first character (strtoull skips the
# space and takes the sign: ' -1' read as 2^64 - 1), and a real past fp32's range had become 0 or
# infinity (--max-grad-norm 1e-50 planned without clipping, exit 0).
refused seq-leading-space "--seq needs a positive integer, got ' -1'" --seq " -1"
refused gpus-leading-space "--gpus needs a positive integer, got ' -1'" --gpus " -1"
refused batch-plus "--batch needs a positive integer, got '+2'" --batch +2
refused grad-staging-space "--grad-staging needs a non-negative integer, got ' 3'" --grad-staging " 3"
refused max-grad-norm-underflow "--max-grad-norm: '1e-50' is outside fp32's range" --max-grad-norm 1e-50
refused max-grad-norm-overflow "--max-grad-norm: '1e39' is outside fp32's range" --max-grad-norm 1e39
refused max-grad-norm-space "--max-grad-norm needs a non-negative number" --max-grad-norm " 1"
refused gpu-mem-sign "--gpu-mem: '-1GiB' is not a byte size (a sign" --gpu-mem -1GiB
refused gpu-mem-under-a-byte "--gpu-mem: '0.5' is not a byte size (less than one byte)" --gpu-mem 0.5

# A size as oom-plan prints it ("least GPU memory ... about 3.84 GiB") is taken, a fraction of a
# byte rounded down; PiB, which it prints past 1024 TiB, too.
for size in "3.84GiB:3.84 GiB" "0.5 GB:476.84 MiB" "1.5PiB:1.50 PiB"; do
  if "$plan" --model "$config" --seq 32 --candidates 1 --host-mem "${size%%:*}" > "$work/out" 2> "$work/err" &&
     grep -q "GiB per GPU, ${size#*:} host" "$work/out"; then
    echo "ok   size '${size%%:*}' read as ${size#*:}"
  else
    echo "FAIL size '${size%%:*}': want a plan with ${size#*:} host:"; cat "$work/err"; head -2 "$work/out"; fails=$((fails + 1))
  fi
done

[[ $fails -eq 0 ]] && echo "PASS" || exit 1
