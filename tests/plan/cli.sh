#!/usr/bin/env bash
# oom-plan's CUDA-executor line follows the executor options: the 5.13B model at 512K with the
# plan oom-train chose on the H200 (--host-mem 85GiB) pins less with a gradient staging ring (the
# default, 3 layers) than per parameter (--grad-staging 0), and predicts a shorter step when the
# attention state is kept (the default) than rerunning whole layers (--no-keep-attention-state).
# At 128K, where the planner's plan needs more GPU memory on the executor than the H200 has, the
# line saying what oom-train would run names the checkpoint around the kept attention state (or,
# with --no-keep-attention-state, the whole-layer checkpoint, predicted slower).
# --longest finds the longest sequence that has such a line, exactly (below), and --most-layers the
# most layers of the config's widths.
#   bash tests/plan/cli.sh path/to/oom-plan path/to/examples/configs/moe-5b.json
set -uo pipefail
plan=$1 config=$2
line() { "$plan" --model "$config" --seq 524288 --host-mem 85GiB --candidates 1 "$@" | grep "^CUDA executor"; }
base=$(line --grad-staging 0 --no-keep-attention-state) || { echo "FAIL: no CUDA executor line"; exit 1; }
ring=$(line --grad-staging 3 --no-keep-attention-state)
kept=$(line --grad-staging 0 --keep-attention-state)
default=$(line)
[[ "$default" == "$(line --grad-staging 3 --keep-attention-state)" ]] || { echo "FAIL: the defaults are not a ring of 3 with kept attention"; exit 1; }
pinned() { sed -E 's/.* and ([0-9.]+) GiB pinned.*/\1/' <<< "$1"; }
step() { sed -E 's/.*predicted step ([0-9.]+) s.*/\1/' <<< "$1"; }
echo "per-parameter staging, whole-layer rerun: $(pinned "$base") GiB pinned, $(step "$base") s; ring of 3: $(pinned "$ring") GiB; kept attention: $(step "$kept") s"
awk -v a="$(pinned "$ring")" -v b="$(pinned "$base")" 'BEGIN { exit !(a + 10 < b) }' || { echo "FAIL: the ring did not cut pinned memory"; exit 1; }
# 16 layers' attention forward not run again: ~48 s with the wgmma kernels' curves (built-in h200
# profile since the seventh session; ~70 s with the mma.sync kernels' before).
awk -v a="$(step "$kept")" -v b="$(step "$base")" 'BEGIN { exit !(a + 30 < b) }' || { echo "FAIL: kept attention did not shorten the step by 30 s"; exit 1; }
run_line() { "$plan" --model "$config" --seq 131072 --candidates 1 "$@" | grep "^oom-train --backend cuda would run"; }
around=$(run_line) || { echo "FAIL: no 'would run' line at 128K"; exit 1; }
whole=$(run_line --no-keep-attention-state)
echo "128K: $around"
echo "128K, --no-keep-attention-state: $whole"
[[ "$around" == *"as checkpoint around kept attention state for the CUDA executor"* ]] || { echo "FAIL: 128K does not run around the kept attention state"; exit 1; }
[[ "$whole" == *"as checkpoint for the CUDA executor"* ]] || { echo "FAIL: 128K without kept attention state is not the whole-layer checkpoint"; exit 1; }
awk -v a="$(step "$around")" -v b="$(step "$whole")" 'BEGIN { exit !(a + 1 < b) }' || { echo "FAIL: the kept attention state did not shorten the 128K step by 1 s"; exit 1; }
# Several sequences per micro-batch: oom-train runs them too, so the line is there.
batched=$("$plan" --model "$config" --seq 4096 --batch 2 --candidates 1 | grep "^oom-train --backend cuda would run") ||
  { echo "FAIL: no 'would run' line for --batch 2"; exit 1; }
echo "4K x 2 sequences: $batched"
"$plan" --model "$config" --grad-staging -1 > /dev/null 2>&1 && { echo "FAIL: --grad-staging -1 accepted"; exit 1; }
# --moments bf16: oom-train keeps bf16 moments when asked, so what it would run is planned with
# them. Qwen1.5-MoE-A2.7B on the H200 at 4K: 4 bytes a parameter less of resident state makes
# more of its segments resident than with fp32 moments (the line read "nothing" when the executor
# kept fp32 moments under a plan that counted bf16 ones).
qwen=$(dirname "$config")/qwen1.5-moe-a2.7b.json
q_fp32=$("$plan" --model "$qwen" --seq 4096 --candidates 1)
q_bf16=$("$plan" --model "$qwen" --seq 4096 --candidates 1 --moments bf16)
resident_of() { grep "^oom-train --backend cuda would run" <<< "$1" | sed -nE 's/.* ([0-9]+) of [0-9]+ segments resident.*/\1/p'; }
r_fp32=$(resident_of "$q_fp32") r_bf16=$(resident_of "$q_bf16")
echo "Qwen1.5-MoE 4K, segments oom-train would keep resident: fp32 moments $r_fp32, bf16 moments $r_bf16"
[[ -n "$r_fp32" && -n "$r_bf16" ]] && (( r_bf16 > r_fp32 )) ||
  { echo "FAIL: --moments bf16 did not let oom-train keep more resident: $(grep "would run" <<< "$q_bf16")"; exit 1; }
# The executor's line judges its pinned memory too: at 128K the planner's first plan fits the GPU
# and pins more than oom-train's default host budget (110.76 GiB of the H200's 125).
q_long=$("$plan" --model "$qwen" --seq 131072 --candidates 1 | grep "^CUDA executor")
echo "Qwen1.5-MoE 128K: $q_long"
[[ "$q_long" == *"pinned: OVER the pinned budget of "* ]] || { echo "FAIL: pinned memory over its budget not said"; exit 1; }
# --longest: the longest sequence oom-train would run. On the whole H200 the 5.13B model reaches
# 1M tokens (some boundaries offloaded). On 80 GiB of it the answer is shorter, and it is exact in
# multiples of 1024: oom-plan --seq at the answer has a plan, 1024 tokens more has none.
longest_of() { "$plan" --model "$config" --longest "$@" | sed -nE 's/^longest sequence oom-train .*: ([0-9]+) tokens x .*/\1/p'; }
whole_gpu=$(longest_of)
echo "--longest on the H200: $whole_gpu tokens"
[[ -n "$whole_gpu" ]] && (( whole_gpu >= 1048576 )) || { echo "FAIL: the 5.13B model's longest sequence on the H200 is under 1M tokens"; exit 1; }
small=$(longest_of --gpu-mem 80GiB)
echo "--longest on 80 GiB: $small tokens"
[[ -n "$small" ]] && (( small < whole_gpu && small % 1024 == 0 )) || { echo "FAIL: --longest on 80 GiB: '$small'"; exit 1; }
"$plan" --model "$config" --gpu-mem 80GiB --seq "$small" --candidates 1 | grep -q "^oom-train --backend cuda would run (" ||
  { echo "FAIL: no plan at the longest sequence $small"; exit 1; }
# 1024 tokens more: the executor fits nothing, or the planner itself has no plan (exit 3).
past=$("$plan" --model "$config" --gpu-mem 80GiB --seq $((small + 1024)) --candidates 1 2>&1)
past_rc=$?
(( past_rc == 3 )) || grep -q "^oom-train --backend cuda would run: nothing" <<< "$past" ||
  { echo "FAIL: a plan 1024 tokens past the longest sequence $small (exit $past_rc)"; exit 1; }
# A model the executor cannot run (head_dim 32) is an error naming why, not "no sequence fits".
"$plan" --model "$(dirname "$config")/tiny-moe.json" --longest > /dev/null 2> "${TMPDIR:-/tmp}/oom-cli-longest.err"
tiny_rc=$?
(( tiny_rc == 2 )) && grep -q "head_dim = 32" "${TMPDIR:-/tmp}/oom-cli-longest.err" ||
  { echo "FAIL: --longest on tiny-moe exited $tiny_rc: $(cat "${TMPDIR:-/tmp}/oom-cli-longest.err")"; exit 1; }
rm -f "${TMPDIR:-/tmp}/oom-cli-longest.err"
# Starting past the longest, the search goes down to it.
down=$(longest_of --gpu-mem 80GiB --seq 1000000)
[[ "$down" == "$small" ]] || { echo "FAIL: --longest from --seq 1000000 on 80 GiB found '$down', not $small"; exit 1; }
"$plan" --model "$config" --longest --gpus 2 > /dev/null 2>&1 && { echo "FAIL: --longest with --gpus 2 accepted"; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$plan" --model "$config" --longest --json "$work/l.json" > /dev/null 2>&1 && { echo "FAIL: --longest with --json accepted"; exit 1; }
# --most-layers: the most layers of the config's widths oom-train would run at --seq on the H200.
# Exact: a config of that depth has a "would run" line, one layer more has none; bf16 moments (4
# bytes a parameter less) fit more layers than fp32 ones.
most_of() { "$plan" --model "$config" --most-layers "$@" | tee "$work/most.out" | sed -nE 's/^most layers oom-train .*\): ([0-9]+) layers, .*/\1/p'; }
deep=$(most_of)
grep -q "^train it: oom-train --backend cuda --config $config --layers $deep --seq 4096 --batch 1$" "$work/most.out" ||
  { echo "FAIL: --most-layers names no oom-train command: $(tail -1 "$work/most.out")"; exit 1; }
deep16=$(most_of --moments bf16)
# ... with the options it planned with, so that oom-train plans the same way.
most_of --moments bf16 --profile "$(dirname "$config")/../profiles/h100-2026-12-06.json" --micro-batches 2 > /dev/null
grep -q "^train it: oom-train --backend cuda --config $config --layers [0-9]* --seq 4096 --batch 1 --profile .*h100-2026-12-06.json --moments bf16 --micro-batches 2$" "$work/most.out" ||
  { echo "FAIL: --most-layers' command lost an option: $(tail -1 "$work/most.out")"; exit 1; }
echo "--most-layers at 4K on the H200: $deep layers with fp32 moments, $deep16 with bf16"
[[ -n "$deep" && -n "$deep16" ]] && (( deep > 16 && deep16 > deep )) || { echo "FAIL: --most-layers found '$deep' / '$deep16'"; exit 1; }
at_depth() { python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); c["num_hidden_layers"] = int(sys.argv[2]); json.dump(c, open(sys.argv[3], "w"))' "$config" "$1" "$2"; }
at_depth "$deep" "$work/at.json"
at_depth $((deep + 1)) "$work/past.json"
"$plan" --model "$work/at.json" --candidates 1 | grep -q "^oom-train --backend cuda would run (" ||
  { echo "FAIL: no plan at the most layers, $deep"; exit 1; }
past=$("$plan" --model "$work/past.json" --candidates 1 2>&1)
past_rc=$?
(( past_rc == 3 )) || grep -q "^oom-train --backend cuda would run: nothing" <<< "$past" ||
  { echo "FAIL: a plan one layer past the most layers, $deep (exit $past_rc)"; exit 1; }
"$plan" --model "$config" --most-layers --longest > /dev/null 2>&1 && { echo "FAIL: --most-layers with --longest accepted"; exit 1; }
"$plan" --model "$config" --most-layers --gpus 2 > /dev/null 2>&1 && { echo "FAIL: --most-layers with --gpus 2 accepted"; exit 1; }
# Output paths are refused before anything is planned or written, and a device or a FIFO is never
# renamed over; a size names its option; a pair oom-train refuses gets no line saying it would run.
refused() {  # refused PATTERN ARGS...: exit 2, one stderr line matching PATTERN
  local pattern=$1
  shift
  "$plan" --model "$config" --seq 4096 --candidates 1 "$@" > /dev/null 2> "$work/err"
  local rc=$?
  [[ $rc -eq 2 ]] && grep -q -- "$pattern" "$work/err" ||
    { echo "FAIL: $* gave exit $rc, want 2 and /$pattern/:"; cat "$work/err"; exit 1; }
}
mkfifo "$work/fifo"
refused "needs a file name" --json ''
refused "a directory, not a file name" --json "$work"
refused "is not a regular file" --json "$work/fifo"
refused "does not exist" --json "$work/p.json" --trace "$work/nowhere/t.json"
[[ -e "$work/p.json" ]] && { echo "FAIL: --json written though --trace was refused"; exit 1; }
compgen -G "$work/*.tmp*" > /dev/null && { echo "FAIL: a temporary file left in $work"; exit 1; }
refused "^.*--gpu-mem: " --gpu-mem 80XiB
refused "oom-train refuses the pair" --grad-staging 3 --max-grad-norm 1
"$plan" --model "$config" --seq 4096 --candidates 1 --json "$work/p.json" > /dev/null || { echo "FAIL: --json to a new file failed"; exit 1; }
[[ -s "$work/p.json" ]] || { echo "FAIL: --json wrote nothing"; exit 1; }
echo "PASS"
