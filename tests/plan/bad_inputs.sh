#!/usr/bin/env bash
# oom-plan's arguments, on any build: each bad one is refused with exit 2 and one stderr line naming
# the flag, before anything is planned or written; a size as oom-plan prints it reads back.
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
# A profile and a built-in machine both: the --machine had been ignored without a word.
refused profile-and-machine "both name the machine: give one" --profile "$(dirname "$0")/../../examples/profiles/h200-2026-12-06.json" --machine rtx4090
refused grad-staging-space "--grad-staging needs a non-negative integer, got ' 3'" --grad-staging " 3"
refused max-grad-norm-underflow "--max-grad-norm: '1e-50' is outside fp32's range" --max-grad-norm 1e-50
refused max-grad-norm-overflow "--max-grad-norm: '1e39' is outside fp32's range" --max-grad-norm 1e39
refused max-grad-norm-space "--max-grad-norm needs a non-negative number" --max-grad-norm " 1"
refused gpu-mem-sign "--gpu-mem: '-1GiB' is not a byte size (a sign" --gpu-mem -1GiB
refused gpu-mem-under-a-byte "--gpu-mem: '0.5' is not a byte size (less than one byte)" --gpu-mem 0.5
# A forgotten value: the next option is not taken as it (--json --longest had written a plan to a
# file named --longest); an unknown option is named as one, also last (it had "needed a value").
refused forgotten-value "--json needs a value, got the option '--longest'" --json --longest
refused unknown-last "unknown option '--longst'" --longst

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

# An empty path had meant "not given": --profile "" planned with the built-in profile.
refused empty-profile "--profile needs a path, got ''" --profile ""
"$plan" --model "" > /dev/null 2> "$work/err"
if [[ $? -ne 2 ]] || ! grep -q -- "--model needs a path, got ''" "$work/err"; then
  echo "FAIL empty-model:"; cat "$work/err"; fails=$((fails + 1))
else echo "ok   empty-model: $(cat "$work/err")"; fi

# No output may be the file of an input, or of the other output: --json onto --model had replaced
# the config with the plan, --trace onto --profile destroyed the profile, and --json X --trace X
# said both were written where only the trace was. Refused before any work, every file as it was.
profile=$(dirname "$config")/../profiles/h200-2026-12-04.json
ln -s "$work/cfg.json" "$work/cfg-link.json"
mkdir "$work/sub"
# overlap NAME PATTERN ARGS...: refused, and cfg.json and prof.json left as they were
overlap() {
  local name=$1 pattern=$2
  shift 2
  cp "$config" "$work/cfg.json"
  cp "$profile" "$work/prof.json"
  rm -f "$work/p.json" "$work/t.json"
  "$plan" --seq 32 --candidates 1 "$@" > "$work/out" 2> "$work/err"
  local rc=$?
  if [[ $rc -ne 2 ]] || ! grep -q -- "$pattern" "$work/err" || ! cmp -s "$config" "$work/cfg.json" ||
     ! cmp -s "$profile" "$work/prof.json" || [[ -s "$work/out" ]] || compgen -G "$work/[pt].json" > /dev/null; then
    echo "FAIL $name: exit $rc (want 2), want /$pattern/, the inputs kept and nothing written:"; cat "$work/err"; fails=$((fails + 1))
  else
    echo "ok   $name: $(cat "$work/err")"
  fi
}
overlap json-onto-model "--json $work/cfg.json is the same file as --model $work/cfg.json" \
  --model "$work/cfg.json" --json "$work/cfg.json"
overlap json-onto-model-by-link "--json $work/cfg-link.json is the same file as --model" --model "$work/cfg.json" --json "$work/cfg-link.json"
overlap trace-onto-profile "--trace $work/sub/../prof.json is the same file as --profile $work/prof.json" \
  --model "$work/cfg.json" --profile "$work/prof.json" --trace "$work/sub/../prof.json"
overlap json-and-trace "--trace $work/sub/../p.json is the same file as --json $work/p.json: one would be written over the other" \
  --model "$work/cfg.json" --json "$work/p.json" --trace "$work/sub/../p.json"
# Two files beside each other still are two.
cp "$config" "$work/cfg.json"
if "$plan" --model "$work/cfg.json" --seq 32 --candidates 1 --json "$work/p.json" --trace "$work/t.json" > /dev/null 2> "$work/err" &&
   [[ -s "$work/p.json" && -s "$work/t.json" ]]; then echo "ok   json-and-trace-apart"
else echo "FAIL json-and-trace-apart:"; cat "$work/err"; fails=$((fails + 1)); fi

# A budget past the profile's machine is planned as asked, with a note saying so first (a plan of
# 255 GiB on the 139 GiB H200 had read "within the budgets" with no word of it); none within it.
"$plan" --model "$config" --seq 32 --candidates 1 --gpu-mem 500GiB --host-mem 4TiB > "$work/out" 2> "$work/err"
if [[ $? -eq 0 ]] && grep -q "^note: --gpu-mem 500.00 GiB is more than the profile's GPU memory (139.00 GiB)" "$work/out" &&
   grep -q "^note: --host-mem 4.00 TiB is more than the profile's host memory (125.00 GiB)" "$work/out"; then echo "ok   budgets-past-profile"
else echo "FAIL budgets-past-profile:"; head -6 "$work/out"; cat "$work/err"; fails=$((fails + 1)); fi
"$plan" --model "$config" --seq 32 --candidates 1 --gpu-mem 100GiB --host-mem 100GiB > "$work/out" 2> "$work/err"
if grep -q "^note: --" "$work/out"; then echo "FAIL budgets-within-profile: a note"; grep "^note" "$work/out"; fails=$((fails + 1))
else echo "ok   budgets-within-profile"; fi

[[ $fails -eq 0 ]] && echo "PASS" || exit 1
