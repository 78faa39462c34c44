#!/usr/bin/env bash
# Each bad input gets one clear error line naming the problem, a non-zero exit, and leaves the run
# directory without any checkpoint. Usage: bad_inputs.sh path/to/oom-train
set -uo pipefail
train="$1"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
fails=0

# expect NAME EXIT_CODE PATTERN -- ARGS...
expect() {
  local name="$1" code="$2" pattern="$3"
  shift 4
  local out="$work/$name"
  "$train" --out "$out" --steps 2 --seq 32 "$@" > "$work/$name.stdout" 2> "$work/$name.stderr"
  local rc=$?
  local lines
  lines=$(wc -l < "$work/$name.stderr")
  if [[ $rc -ne $code ]] || ! grep -q -- "$pattern" "$work/$name.stderr" || [[ $lines -ne 1 ]] ||
     compgen -G "$out/checkpoint-*" > /dev/null || [[ -e "$out/latest" ]]; then
    echo "FAIL $name: exit $rc (want $code), $lines stderr line(s), want /$pattern/:"
    cat "$work/$name.stderr"
    fails=$((fails + 1))
  else
    echo "ok   $name: $(cat "$work/$name.stderr")"
  fi
}

# A malformed config and an inconsistent one.
printf '{"model_type": "qwen3_moe", "hidden_size": 64,' > "$work/broken.json"
expect malformed-config 2 "broken.json" -- --config "$work/broken.json"
sed 's/"num_key_value_heads": 2/"num_key_value_heads": 3/' "$(dirname "$0")/../../examples/configs/tiny-moe.json" > "$work/gqa.json"
expect inconsistent-config 2 "num_key_value_heads" -- --config "$work/gqa.json"
# A forgotten value: the next option is not taken as it ("--out --overwrite" had trained into a
# directory named --overwrite); an unknown option is named as one, also last (it had "needed a value").
expect forgotten-value 2 "--data needs a value, got the option '--seq'" -- --data --seq 16
expect unknown-last 2 "unknown option '--save-intial'" -- --save-intial
# A profile and a built-in machine both: the --machine had been ignored without a word.
expect profile-and-machine 2 "--profile .* and --machine h100-80gb both name the machine: give one" -- \
  --profile "$(dirname "$0")/../../examples/profiles/h200-2026-12-06.json" --machine h100-80gb
# An output onto the run directory's own files: the built-in corpus (the run had then been unable
# to resume), its metrics, or a file in a checkpoint.
expect dump-onto-corpus 2 "is the same file as the built-in corpus (--out)" -- --dump-batches "$work/dump-onto-corpus/builtin-corpus.tok"
expect trace-onto-metrics 2 "is the same file as the run's metrics.jsonl (--out)" -- --trace-step 1 --trace "$work/trace-onto-metrics/metrics.jsonl"
expect dump-in-checkpoint 2 "is the run's checkpoint .*checkpoint-000002 or inside it, which the run writes whole" -- \
  --dump-batches "$work/dump-in-checkpoint/checkpoint-000002/batches.tok"
expect dump-as-checkpoint 2 "is the run's checkpoint .*checkpoint-000002 or inside it" -- \
  --dump-batches "$work/dump-as-checkpoint/checkpoint-000002"
expect trace-as-partial 2 "is the run's checkpoint .*checkpoint-000001.partial or inside it" -- \
  --trace-step 1 --trace "$work/trace-as-partial/checkpoint-000001.partial"
# --layers past what with_layers makes: refused before anything is built.
expect layers-too-many 2 "--layers 5000: 5000 layers: a depth from 1 to 4096 (built-in tiny Qwen3-MoE)" -- --layers 5000
# A directory as --config: said so (an ifstream opens one and reads nothing: it had been "expected
# a value, found end of input" at its first byte).
expect config-is-directory 2 "is a directory, not a file" -- --config "$work"

# A truncated safetensors file to start from.
"$train" --out "$work/good" --steps 1 --seq 32 > /dev/null || { echo "FAIL: a good run failed"; exit 1; }
head -c 5000 "$work/good/checkpoint-000001/model.safetensors" > "$work/cut.safetensors"
expect truncated-safetensors 2 "cut.safetensors" -- --init-from "$work/cut.safetensors"
# A corrupt one: a header length larger than the file.
printf '\xff\xff\xff\x00\x00\x00\x00\x00{}' > "$work/corrupt.safetensors"
expect corrupt-safetensors 2 "corrupt.safetensors" -- --init-from "$work/corrupt.safetensors"
# A directory that is no checkpoint, and a sharded index naming a shard that is not there.
mkdir -p "$work/not-a-model"
tiny="$(dirname "$0")/../../examples/configs/tiny-moe.json"
expect init-dir-without-config 2 "the directory has no config.json; pass --config" -- --init-from "$work/not-a-model"
expect empty-model-dir 2 "without model.safetensors or model.safetensors.index.json" -- --init-from "$work/not-a-model" --config "$tiny"
printf '{"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}' > "$work/not-a-model/model.safetensors.index.json"
expect missing-shard 2 "model-00001-of-00002.safetensors" -- --init-from "$work/not-a-model" --config "$tiny"

# A token file whose ids exceed the model's vocab (file vocab 300, token 280 at position 3).
{
  printf 'OOMTOK01\x01\x00\x00\x00\x02\x00\x00\x00'        # magic, version 1, 2 bytes per token
  printf '\x2c\x01\x00\x00\x00\x00\x00\x00'                # vocab 300
  printf '\x00\x02\x00\x00\x00\x00\x00\x00'                # 512 tokens
  printf '\x00\x00\x00\x00\x00\x00\x00\x00'                # documents: not recorded
  head -c 24 /dev/zero                                     # reserved
  printf 'a\x00b\x00c\x00\x18\x01'                         # 97 98 99 280
  head -c 1016 /dev/zero
} > "$work/big-vocab.tok"
expect token-beyond-vocab 2 "token 280 at position 3" -- --data "$work/big-vocab.tok"

# A plan file made without clipping, for a run that clips (oom-plan beside oom-train in the build).
plan_tool="$(dirname "$train")/../plan/oom-plan"
if [[ -x "$plan_tool" ]]; then
  "$plan_tool" --model "$(dirname "$0")/../../examples/configs/tiny-moe.json" --seq 32 --gpu-mem 1GiB --host-mem 4GiB \
    --json "$work/unclipped-plan.json" > /dev/null || { echo "FAIL: oom-plan failed"; exit 1; }
  expect plan-without-clipping 2 "planned without clipping" -- --plan "$work/unclipped-plan.json" --max-grad-norm 1
else
  echo "skip plan-without-clipping: no $plan_tool"
fi
# A plan of another model (same layers and segment names, other widths), of two GPUs, and a plan
# with budgets of its own.
if [[ -x "$plan_tool" ]]; then
  "$plan_tool" --model "$(dirname "$0")/../../examples/configs/tiny-moe-d128.json" --seq 32 --gpu-mem 1GiB --host-mem 4GiB \
    --json "$work/d128-plan.json" > /dev/null || { echo "FAIL: oom-plan failed"; exit 1; }
  expect plan-of-another-model 2 "made for another model" -- --plan "$work/d128-plan.json"
  "$plan_tool" --model "$(dirname "$0")/../../examples/configs/tiny-moe.json" --seq 32 --gpus 2 --gpu-mem 1GiB --host-mem 4GiB \
    --json "$work/two-gpu-plan.json" > /dev/null || { echo "FAIL: oom-plan --gpus 2 failed"; exit 1; }
  expect plan-of-two-gpus 2 "planned for 2 GPUs" -- --plan "$work/two-gpu-plan.json"
  expect plan-with-gpu-mem 2 "runs within the budgets it was made for" -- --plan "$work/unclipped-plan.json" --gpu-mem 2GiB
  # Another model's plan whose peaks say nothing (zero: unknown) had run: its model_fingerprint is
  # compared; a plan without one (from before it) names its config, compared as JSON. The same
  # config's plan runs on the built-in model (tiny-moe.json's JSON) without its fingerprint too.
  sed '/"peak_bytes": {/,/}/ s/: [0-9][0-9]*/: 0/' "$work/d128-plan.json" > "$work/d128-no-peaks.json"
  expect plan-of-another-model-no-peaks 2 "d128-no-peaks.json: made for another model ('.*tiny-moe-d128.json', model_fingerprint" -- \
    --plan "$work/d128-no-peaks.json"
  sed '/"model_fingerprint"/d' "$work/d128-no-peaks.json" > "$work/d128-unprinted.json"
  expect plan-of-another-model-by-name 2 "d128-unprinted.json: made for model '.*tiny-moe-d128.json', this run trains built-in" -- \
    --plan "$work/d128-unprinted.json"
  sed '/"model_fingerprint"/d' "$work/unclipped-plan.json" > "$work/unprinted.json"
  if ! "$train" --out "$work/unprinted" --steps 1 --seq 32 --plan "$work/unprinted.json" > /dev/null 2> "$work/unprinted.stderr"; then
    echo "FAIL plan-of-this-config-unprinted: the built-in model's plan without its fingerprint was refused"; cat "$work/unprinted.stderr"
    fails=$((fails + 1))
  else echo "ok   plan-of-this-config-unprinted"; fi
  # Errors from reading or checking a plan name its file, and say what is wrong: a misspelt key,
  # a segment the model lacks or named twice, an integer precision, a recompute the executors do
  # not run.
  sed 's/"grad_accumulation"/"grad_acumulation"/' "$work/unclipped-plan.json" > "$work/typo.json"
  expect plan-misspelt-key 2 "typo.json: grad_acumulation: unknown key 'grad_acumulation' in a plan" -- --plan "$work/typo.json"
  sed 's/"layers.0.norms"/"layers.9.norms"/' "$work/unclipped-plan.json" > "$work/no-such-segment.json"
  expect plan-segment-elsewhere 2 "no-such-segment.json: plan names resident segment 'layers.9.norms', which this model does not have" -- \
    --plan "$work/no-such-segment.json"
  sed 's/"layers.0.norms"/"embedding"/' "$work/unclipped-plan.json" > "$work/segment-twice.json"
  expect plan-segment-twice 2 "segment-twice.json: plan names resident segment 'embedding' twice" -- --plan "$work/segment-twice.json"
  sed 's/"weights": "bf16"/"weights": "int32"/' "$work/unclipped-plan.json" > "$work/int32.json"
  expect plan-integer-precision 2 "int32.json: precision.weights: 'int32' is not a floating-point type" -- --plan "$work/int32.json"
  sed '0,/"norm_output": "keep"/ s//"norm_output": "recompute from 3"/' "$work/unclipped-plan.json" > "$work/recompute.json"
  expect plan-recompute-source 2 "recompute.json: layer 0: norm_output recomputed from layer 3" -- --plan "$work/recompute.json"
  # A plan of bf16 moments (oom-plan --moments bf16) runs with them; the run may not ask for
  # others, and a precision the trainer does not keep is refused naming the file.
  "$plan_tool" --model "$(dirname "$0")/../../examples/configs/tiny-moe.json" --seq 32 --gpu-mem 1GiB --host-mem 4GiB --moments bf16 \
    --json "$work/bf16-moments.json" > /dev/null || { echo "FAIL: oom-plan --moments bf16 failed"; exit 1; }
  if ! "$train" --out "$work/bf16-moments" --steps 1 --seq 32 --plan "$work/bf16-moments.json" > "$work/bf16-moments.stdout" 2> "$work/bf16-moments.stderr"; then
    echo "FAIL plan-bf16-moments: a plan of bf16 moments was refused"; cat "$work/bf16-moments.stderr"
    fails=$((fails + 1))
  elif ! grep -q "^AdamW moments bf16: the plan's" "$work/bf16-moments.stdout"; then
    echo "FAIL plan-bf16-moments: the plan's moments taken without a word"; fails=$((fails + 1))
  else echo "ok   plan-bf16-moments: $(grep '^AdamW moments' "$work/bf16-moments.stdout")"; fi
  expect plan-bf16-moments-asked-fp32 2 "bf16-moments.json: planned for bf16 AdamW moments, the run asks for fp32 (--moments" -- \
    --plan "$work/bf16-moments.json" --moments fp32
  sed 's/"moments": "bf16"/"moments": "fp16"/' "$work/bf16-moments.json" > "$work/fp16-moments.json"
  expect plan-fp16-moments 2 "fp16-moments.json: its plan: precision.moments is fp16; it keeps fp32 or bf16 moments (plan again" -- \
    --plan "$work/fp16-moments.json"
  expect moments-fp16 2 "moments is fp32 or bf16 (AdamW moments), got 'fp16'" -- --moments fp16
fi
# A profile whose rates price a step at infinity is named by its file too (the error had named
# only the name inside it, "h200", which the built-in profile has as well).
sed 's/"hbm_bytes_per_s": [0-9.e+]*,/"hbm_bytes_per_s": 1e-300,/' "$(dirname "$0")/../../examples/profiles/h200-2026-12-04.json" \
  > "$work/slow-profile.json"
expect profile-prices-infinity 2 "profile 'h200' (.*slow-profile.json): its rates predict a step of inf s" -- \
  --profile "$work/slow-profile.json" --seq 256
# Output paths refused before any step runs.
expect trace-nowhere 2 "does not exist" -- --trace-step 2 --trace "$work/nowhere/t.json"
expect trace-directory 2 "a directory, not a file name" -- --trace-step 2 --trace "$work"
expect trace-without-step 2 "pass --trace-step" -- --trace "$work/t.json"
expect trace-step-past-end 2 "past the run's last step" -- --trace-step 3
expect dump-nowhere 2 "does not exist" -- --dump-batches "$work/nowhere/d.tok"
expect size-names-option 2 "--gpu-mem: " -- --gpu-mem 80XiB
# An empty path had meant "not given": --config "" trained the built-in model, --plan "" planned
# anew, --profile "" took the built-in profile, --trace "" wrote to the default place.
for flag in --config --data --init-from --plan --profile --out --trace --dump-batches; do
  expect "empty${flag}" 2 "$flag needs a path, got ''" -- "$flag" ""
done
# No file the run writes may be one it reads or another it writes (a link or another spelling of
# the same file included): --trace onto --config had replaced the config with the trace at step 1.
cp "$(dirname "$0")/../../examples/configs/tiny-moe.json" "$work/cfg.json"
cp "$(dirname "$0")/../../examples/profiles/h200-2026-12-04.json" "$work/prof.json"
ln -s "$work/prof.json" "$work/prof-link.json"
expect trace-onto-config 2 "--trace $work/cfg.json is the same file as --config $work/cfg.json" -- \
  --config "$work/cfg.json" --trace-step 1 --trace "$work/cfg.json"
expect dump-onto-profile 2 "--dump-batches $work/prof-link.json is the same file as --profile $work/prof.json" -- \
  --profile "$work/prof.json" --dump-batches "$work/prof-link.json"
expect dump-onto-trace-prediction 2 "--dump-batches $work/./t.predicted.json is the same file as --trace (its prediction) $work/t.predicted.json" -- \
  --trace-step 1 --trace "$work/t.json" --dump-batches "$work/./t.predicted.json"
if ! cmp -s "$work/cfg.json" "$(dirname "$0")/../../examples/configs/tiny-moe.json" ||
   ! cmp -s "$work/prof.json" "$(dirname "$0")/../../examples/profiles/h200-2026-12-04.json" || [[ -e "$work/t.json" ]]; then
  echo "FAIL outputs-onto-inputs: an input was written over, or a trace written"; fails=$((fails + 1))
else echo "ok   outputs-onto-inputs: the inputs as they were"; fi
# Out of host memory: a 400,000 x 4096 embedding (6.1 GiB) asked for past a 4 GB address space is
# one clear line and exit 3, nothing touched, the run directory without a checkpoint. (--host-mem:
# the default budget is held to this machine's memory, and on a small one no plan would be made.)
sed -e 's/"vocab_size": [0-9]*/"vocab_size": 400000/' -e 's/"hidden_size": [0-9]*/"hidden_size": 4096/' \
  "$(dirname "$0")/../../examples/configs/tiny-moe.json" > "$work/huge.json"
(ulimit -v 4000000 && exec "$train" --out "$work/huge" --steps 1 --seq 32 --backend host --config "$work/huge.json" --gpu-mem 40GiB --host-mem 100GiB) \
  > /dev/null 2> "$work/huge.stderr"
rc=$?
if [[ $rc -ne 3 ]] || ! grep -q "out of host memory" "$work/huge.stderr" || [[ $(wc -l < "$work/huge.stderr") -ne 1 ]] ||
   compgen -G "$work/huge/checkpoint-*" > /dev/null; then
  echo "FAIL out-of-host-memory: exit $rc"; cat "$work/huge.stderr"; fails=$((fails + 1))
else echo "ok   out-of-host-memory: $(cat "$work/huge.stderr")"; fi
# A budget no plan fits, and a missing data file.
expect tiny-budget 3 "least GPU memory" -- --gpu-mem 1MiB
expect missing-data 2 "no such data file" -- --data "$work/nowhere.tok"
# Text where a token file belongs (a new user's first try): the converter named.
for i in 1 2 3 4; do echo "Once upon a time a text file stood where a token file belongs."; done > "$work/story.txt"
expect text-as-data 2 "story.txt: not a token file .*; --data reads a token file .*make_token_file.py --bytes --out FILE.tok TEXT" \
  -- --data "$work/story.txt"
echo "hi" > "$work/hi.txt"
expect short-text-as-data 2 "shorter than the 64-byte token file header; --data reads a token file" -- --data "$work/hi.txt"
# A token file this build cannot read (a later version) is one, damaged: its own error, no converter.
{ printf 'OOMTOK01\x02\x00\x00\x00'; head -c 56 /dev/zero; } > "$work/later.tok"
expect later-token-file 2 "later.tok: token file version 2, this build reads version 1" -- --data "$work/later.tok"
if grep -q "make_token_file" "$work/later-token-file.stderr"; then
  echo "FAIL later-token-file: a token file called text"; fails=$((fails + 1))
fi
# An option of the other backend.
expect grad-staging-on-host 2 "grad-staging" -- --backend host --grad-staging 3
expect keep-attention-on-host 2 "keep-attention-state" -- --backend host --keep-attention-state
expect no-keep-attention-on-host 2 "keep-attention-state" -- --backend host --no-keep-attention-state
expect bucketed-gemms-on-host 2 "bucketed-expert-gemms" -- --backend host --bucketed-expert-gemms
expect no-bucketed-gemms-on-host 2 "bucketed-expert-gemms" -- --backend host --no-bucketed-expert-gemms
expect zero-unrouted-on-host 2 "unrouted-expert-grads" -- --backend host --zero-unrouted-expert-grads
expect no-overlap-on-host 2 "no-overlap-updates" -- --backend host --no-overlap-updates
expect no-gradient-check-on-host 2 "no-gradient-check" -- --backend host --no-gradient-check
expect planned-residency-on-host 2 "planned-residency" -- --backend host --planned-residency

# Misuse of a run directory: refused, and the run in it left as it was.
before=$(cat "$work/good/latest")
"$train" --out "$work/good" --steps 2 --seq 32 > /dev/null 2> "$work/rerun.stderr"
rc=$?
if [[ $rc -ne 2 ]] || ! grep -q "already holds a run" "$work/rerun.stderr" || [[ "$(cat "$work/good/latest")" != "$before" ]]; then
  echo "FAIL run-dir-in-use: exit $rc"; cat "$work/rerun.stderr"; fails=$((fails + 1))
else echo "ok   run-dir-in-use: $(cat "$work/rerun.stderr")"; fi
"$train" --out "$work/good" --steps 2 --seq 64 --resume > /dev/null 2> "$work/reseq.stderr"
rc=$?
if [[ $rc -ne 2 ]] || ! grep -q "seq" "$work/reseq.stderr" || [[ "$(cat "$work/good/latest")" != "$before" ]]; then
  echo "FAIL resume-other-seq: exit $rc"; cat "$work/reseq.stderr"; fails=$((fails + 1))
else echo "ok   resume-other-seq: $(cat "$work/reseq.stderr")"; fi
"$train" --out "$work/good" --steps 2 --seq 32 --batch 2 --resume > /dev/null 2> "$work/rebatch.stderr"
rc=$?
if [[ $rc -ne 2 ]] || ! grep -q "holds batch = 1, this run asks for 2" "$work/rebatch.stderr" || [[ "$(cat "$work/good/latest")" != "$before" ]]; then
  echo "FAIL resume-other-batch: exit $rc"; cat "$work/rebatch.stderr"; fails=$((fails + 1))
else echo "ok   resume-other-batch: $(cat "$work/rebatch.stderr")"; fi
# --overwrite removes the old run only once the new one is ready to train: a window the data
# cannot fill, or a plan of another model, leaves it as it was.
{
  printf 'OOMTOK01\x01\x00\x00\x00\x02\x00\x00\x00'   # magic, version 1, 2 bytes per token
  printf '\x00\x01\x00\x00\x00\x00\x00\x00'           # vocab 256
  printf '\x0a\x00\x00\x00\x00\x00\x00\x00'           # 10 tokens
  head -c 32 /dev/zero                                  # documents: not recorded; reserved
  printf 'a\x00b\x00c\x00d\x00e\x00f\x00g\x00h\x00i\x00j\x00'
} > "$work/short.tok"
for bad in "--data $work/short.tok" "--plan $work/d128-plan.json"; do
  [[ "$bad" == --plan* && ! -f "$work/d128-plan.json" ]] && continue
  # shellcheck disable=SC2086
  "$train" --out "$work/good" --steps 2 --seq 32 --overwrite $bad > /dev/null 2> "$work/overwrite.stderr"
  rc=$?
  if [[ $rc -ne 2 ]] || [[ "$(cat "$work/good/latest" 2> /dev/null)" != "$before" ]] || [[ ! -s "$work/good/metrics.jsonl" ]]; then
    echo "FAIL overwrite-keeps-run ($bad): exit $rc, latest '$(cat "$work/good/latest" 2> /dev/null)'"; cat "$work/overwrite.stderr"
    fails=$((fails + 1))
  else echo "ok   overwrite-keeps-run ($bad): $(cat "$work/overwrite.stderr")"; fi
done
# Data too short for one window is refused before the run directory is made (it had been left
# behind, empty; a file of no tokens at all still left it).
printf 'OOMTOK01\x01\x00\x00\x00\x02\x00\x00\x00\x00\x01\x00\x00\x00\x00\x00\x00' > "$work/no-tokens.tok"
head -c 40 /dev/zero >> "$work/no-tokens.tok"  # 0 tokens, documents, reserved
for short in short:10 no-tokens:0; do
  "$train" --out "$work/d-${short%:*}" --steps 1 --seq 32 --data "$work/${short%:*}.tok" > /dev/null 2> "$work/d-short.stderr"
  rc=$?
  if [[ $rc -ne 2 ]] || ! grep -q "${short#*:} tokens cannot make a window of sequence length 32" "$work/d-short.stderr" ||
     [[ -e "$work/d-${short%:*}" ]]; then
    echo "FAIL short-data-no-run-dir (${short%:*}): exit $rc, run dir $([[ -e "$work/d-${short%:*}" ]] && echo made || echo absent)"
    cat "$work/d-short.stderr"
    fails=$((fails + 1))
  else echo "ok   short-data-no-run-dir (${short%:*}): $(cat "$work/d-short.stderr")"; fi
done
# A step of more windows than the data holds (batch x micro-batches) trains on some window twice
# in that step (it had, without a word): refused before the run directory is made, naming the
# counts; a step of every window the file holds runs. Under a 4 GB address space: a step past the
# built-in corpus is over 2M tokens, which had trained in tens of GB.
{
  printf 'OOMTOK01\x01\x00\x00\x00\x02\x00\x00\x00\x00\x01\x00\x00\x00\x00\x00\x00'   # magic, version 1, u16, vocab 256
  printf '\x00\x04\x00\x00\x00\x00\x00\x00'   # 1024 tokens: 31 windows of 32 (+1 for the target)
  head -c 32 /dev/zero
  for _ in $(seq 1024); do printf 'a\x00'; done
} > "$work/windows31.tok"
short_of_step() {
  local name="$1" pattern="$2"
  shift 2
  (ulimit -v 4000000 && exec "$train" --out "$work/$name" --steps 1 --seq 32 "$@") > /dev/null 2> "$work/$name.stderr"
  local rc=$?
  if [[ $rc -ne 2 ]] || ! grep -q -- "$pattern" "$work/$name.stderr" || [[ $(wc -l < "$work/$name.stderr") -ne 1 ]] || [[ -e "$work/$name" ]]; then
    echo "FAIL $name: exit $rc, run dir $([[ -e "$work/$name" ]] && echo made || echo absent)"; cat "$work/$name.stderr"
    fails=$((fails + 1))
  else echo "ok   $name: $(cat "$work/$name.stderr")"; fi
}
short_of_step step-past-data "windows31.tok: 1024 tokens hold 31 windows of --seq 32, fewer than the 32 a step trains on (--batch 4 x --micro-batches 8)" \
  --data "$work/windows31.tok" --batch 4 --micro-batches 8
short_of_step step-past-builtin-corpus "the built-in corpus: 2097152 tokens hold 7 windows of --seq 262144, fewer than the 8 a step trains on (--batch 8 x --micro-batches 1)" \
  --seq 262144 --batch 8 --gpu-mem 20GiB
# The built-in corpus already in a run directory is checked once open: the run there left as it was.
(ulimit -v 4000000 && exec "$train" --out "$work/good" --steps 2 --seq 262144 --batch 8 --gpu-mem 20GiB --overwrite) \
  > /dev/null 2> "$work/step-past-kept.stderr"
rc=$?
if [[ $rc -ne 2 ]] || ! grep -q "good/builtin-corpus.tok: 2097152 tokens hold 7 windows of --seq 262144, fewer than the 8" "$work/step-past-kept.stderr" ||
   [[ "$(cat "$work/good/latest")" != "$before" ]]; then
  echo "FAIL step-past-builtin-corpus-kept: exit $rc"; cat "$work/step-past-kept.stderr"; fails=$((fails + 1))
else echo "ok   step-past-builtin-corpus-kept: $(cat "$work/step-past-kept.stderr")"; fi
if ! "$train" --out "$work/every-window" --steps 2 --seq 32 --data "$work/windows31.tok" --batch 31 --checkpoint-every 0 \
     > /dev/null 2> "$work/every-window.stderr"; then
  echo "FAIL every-window-a-step: a step of all 31 windows was refused"; cat "$work/every-window.stderr"; fails=$((fails + 1))
else echo "ok   every-window-a-step"; fi
# A resumed run must read the data it was trained on, and keep a cosine schedule's floor.
"$train" --out "$work/good" --steps 2 --seq 32 --resume --data "$work/short.tok" > /dev/null 2> "$work/redata.stderr"
rc=$?
if [[ $rc -ne 2 ]] || ! grep -q "was trained on the built-in corpus, this run reads .*short.tok (--data)" "$work/redata.stderr" ||
   [[ "$(cat "$work/good/latest")" != "$before" ]]; then
  echo "FAIL resume-other-data: exit $rc"; cat "$work/redata.stderr"; fails=$((fails + 1))
else echo "ok   resume-other-data: $(cat "$work/redata.stderr")"; fi
# ... but a run directory moved whole resumes (its built-in corpus moved with it), and so does a
# data file moved elsewhere with the same tokens (a warning); one of another length does not.
cp -r "$work/good" "$work/moved"
if ! "$train" --out "$work/moved" --steps 2 --seq 32 --resume > /dev/null 2> "$work/moved.stderr"; then
  echo "FAIL resume-moved-run: a moved run directory did not resume"; cat "$work/moved.stderr"; fails=$((fails + 1))
else echo "ok   resume-moved-run"; fi
"$train" --out "$work/ondata" --steps 1 --seq 32 --data "$work/good/builtin-corpus.tok" > /dev/null || { echo "FAIL: a --data run failed"; exit 1; }
cp "$work/good/builtin-corpus.tok" "$work/elsewhere.tok"
# A data file whose path is not UTF-8 (Latin-1 "café"): refused at the start, since every
# checkpoint's trainer_state.json names the data by it (it had trained until its first save, which
# then stopped the run).
ln -s "$work/good/builtin-corpus.tok" "$work/caf"$'\xe9'".tok"
expect data-path-not-utf8 2 "the path is not UTF-8, and a checkpoint's trainer_state.json" -- --data "$work/caf"$'\xe9'".tok"
if ! "$train" --out "$work/ondata" --steps 2 --seq 32 --resume --data "$work/elsewhere.tok" > /dev/null 2> "$work/elsewhere.stderr" ||
   ! grep -q "warning: --resume: .*taken as the same data" "$work/elsewhere.stderr"; then
  echo "FAIL resume-moved-data: exit $?"; cat "$work/elsewhere.stderr"; fails=$((fails + 1))
else echo "ok   resume-moved-data: $(cat "$work/elsewhere.stderr")"; fi
# A file of fewer tokens under the trained-on name.
printf 'OOMTOK01\x01\x00\x00\x00\x02\x00\x00\x00\x00\x01\x00\x00\x00\x00\x00\x00' > "$work/fewer.tok"
printf '\x00\x04\x00\x00\x00\x00\x00\x00' >> "$work/fewer.tok"   # 1024 tokens
head -c 32 /dev/zero >> "$work/fewer.tok"
for _ in $(seq 1024); do printf 'a\x00'; done >> "$work/fewer.tok"
"$train" --out "$work/ondata2" --steps 1 --seq 32 --data "$work/elsewhere.tok" > /dev/null || { echo "FAIL: a --data run failed"; exit 1; }
cp "$work/fewer.tok" "$work/elsewhere.tok"
"$train" --out "$work/ondata2" --steps 2 --seq 32 --resume --data "$work/elsewhere.tok" > /dev/null 2> "$work/fewer.stderr"
rc=$?
if [[ $rc -ne 2 ]] || ! grep -q "held [0-9]* tokens when .* was trained on it, it holds 1024 now" "$work/fewer.stderr"; then
  echo "FAIL resume-data-changed: exit $rc"; cat "$work/fewer.stderr"; fails=$((fails + 1))
else echo "ok   resume-data-changed: $(cat "$work/fewer.stderr")"; fi
# A file rewritten in place with the same count of other tokens (here: rotated by one token).
cp "$work/good/builtin-corpus.tok" "$work/rewritten.tok"
"$train" --out "$work/ondata3" --steps 1 --seq 32 --data "$work/rewritten.tok" > /dev/null || { echo "FAIL: a --data run failed"; exit 1; }
{ head -c 64 "$work/good/builtin-corpus.tok"; tail -c +67 "$work/good/builtin-corpus.tok"
  tail -c +65 "$work/good/builtin-corpus.tok" | head -c 2; } > "$work/rotated.tok"
cat "$work/rotated.tok" > "$work/rewritten.tok"
"$train" --out "$work/ondata3" --steps 2 --seq 32 --resume --data "$work/rewritten.tok" > /dev/null 2> "$work/rewritten.stderr"
rc=$?
if [[ $rc -ne 2 ]] || ! grep -q "rewritten.tok holds other tokens than when .* was trained on it (the same [0-9]* tokens in number" "$work/rewritten.stderr" ||
   [[ "$(cat "$work/ondata3/latest")" != checkpoint-000001 ]]; then
  echo "FAIL resume-data-rewritten: exit $rc"; cat "$work/rewritten.stderr"; fails=$((fails + 1))
else echo "ok   resume-data-rewritten: $(cat "$work/rewritten.stderr")"; fi
# Another path holding other tokens of the same count: refused naming both files, with no warning
# first that takes it for the same data.
cp "$work/good/builtin-corpus.tok" "$work/first.tok"
"$train" --out "$work/ondata4" --steps 1 --seq 32 --data "$work/first.tok" > /dev/null || { echo "FAIL: a --data run failed"; exit 1; }
"$train" --out "$work/ondata4" --steps 2 --seq 32 --resume --data "$work/rotated.tok" > /dev/null 2> "$work/other-path.stderr"
rc=$?
if [[ $rc -ne 2 ]] || [[ $(wc -l < "$work/other-path.stderr") -ne 1 ]] ||
   ! grep -q "checkpoint-000001 was trained on .*first.tok, and .*rotated.tok holds other tokens (the same [0-9]* tokens in number" \
     "$work/other-path.stderr"; then
  echo "FAIL resume-other-path-other-tokens: exit $rc"; cat "$work/other-path.stderr"; fails=$((fails + 1))
else echo "ok   resume-other-path-other-tokens: $(cat "$work/other-path.stderr")"; fi
# Output paths inside a run directory that does not exist yet: it is made first.
if ! "$train" --out "$work/fresh" --steps 1 --seq 32 --trace-step 1 --trace "$work/fresh/t.json" \
     --dump-batches "$work/fresh/b.tok" > /dev/null 2> "$work/fresh.stderr" || [[ ! -s "$work/fresh/t.json" || ! -s "$work/fresh/b.tok" ]]; then
  echo "FAIL outputs-in-new-run-dir"; cat "$work/fresh.stderr"; fails=$((fails + 1))
else echo "ok   outputs-in-new-run-dir"; fi
# The schedule as --help and docs/trainer.md give it: warmup lr * t / N, then min-lr + (lr - min-lr)
# * 0.5 (1 + cos(pi p)), p from 0 to 1 over the updates after the warmup (the help had said lr * 0.5
# (1 + cos) floored at --min-lr, another curve).
"$train" --out "$work/sched" --steps 4 --seq 32 --lr 1e-3 --min-lr 5e-4 --warmup 2 --schedule cosine --checkpoint-every 0 > "$work/sched.stdout" ||
  { echo "FAIL: a cosine run with warmup failed"; exit 1; }
lrs=$(sed -E 's/.*"lr":([^,]+),.*/\1/' "$work/sched/metrics.jsonl" | tr '\n' ' ')
if awk -v got="$lrs" 'BEGIN { n = split(got, g, " "); split("5e-4 1e-3 7.5e-4 5e-4", w, " ");
                              if (n != 4) exit 1; for (i = 1; i <= 4; i++) if (g[i] - w[i] > 1e-9 || w[i] - g[i] > 1e-9) exit 1 }'; then
  echo "ok   cosine-schedule: $lrs"
else echo "FAIL cosine-schedule: lr $lrs, expected 5e-4 1e-3 7.5e-4 5e-4"; fails=$((fails + 1)); fi
if grep -q "^note: --warmup" "$work/sched.stdout" 2> /dev/null; then echo "FAIL warmup-note: said within the run"; fails=$((fails + 1)); fi
# A warmup as long as the run or longer is said (the peak lr is reached at most on the last update).
"$train" --out "$work/longwarm" --steps 3 --seq 32 --warmup 10 --checkpoint-every 0 > "$work/longwarm.stdout" 2>&1 ||
  { echo "FAIL: a run with a long warmup failed"; exit 1; }
if grep -q "^note: --warmup 10 takes the whole run (--steps 3): the learning rate never reaches --lr" "$work/longwarm.stdout"; then
  echo "ok   warmup-past-run: $(grep '^note: --warmup' "$work/longwarm.stdout")"
else echo "FAIL warmup-past-run: no note"; fails=$((fails + 1)); fi
"$train" --out "$work/cos" --steps 1 --seq 32 --schedule cosine --min-lr 1e-4 > /dev/null || { echo "FAIL: a cosine run failed"; exit 1; }
"$train" --out "$work/cos" --steps 1 --seq 32 --schedule cosine --min-lr 2e-3 --resume > /dev/null 2> "$work/reminlr.stderr"
rc=$?
if [[ $rc -ne 2 ]] || ! grep -q "pass the same --min-lr" "$work/reminlr.stderr"; then
  echo "FAIL resume-other-min-lr: exit $rc"; cat "$work/reminlr.stderr"; fails=$((fails + 1))
else echo "ok   resume-other-min-lr: $(cat "$work/reminlr.stderr")"; fi
expect resume-nothing 2 "no checkpoint" -- --resume
# The cosine floor: above --lr the schedule had climbed to it (100x the peak), and the constant
# schedule had ignored it.
expect min-lr-above-lr 2 "--min-lr 0.01 is above --lr 0.0001" -- --schedule cosine --lr 1e-4 --min-lr 1e-2
expect min-lr-constant 2 "the constant schedule has none" -- --min-lr 1e-5
expect zero-batch 2 "--batch needs a positive integer, got '0'" -- --batch 0
# A count past 2^64 - 1 (strtoull would saturate), and a micro-batch past the planner's 2^32 tokens.
expect seq-out-of-range 2 "out of range" -- --seq 99999999999999999999
expect seq-past-limit 2 "a micro-batch may hold" -- --seq 4294967296 --batch 2
expect micro-batches-past-int 2 "out of range (at most 2147483647)" -- --micro-batches 4294967297
# A sign after a space had passed the check of the first character and wrapped (strtoull skips
# the space and takes the sign: ' -1' ran 2^64 - 1 steps, --seed ' -5' saved 18446744073709551611).
expect steps-leading-space 2 "--steps needs a positive integer, got ' -1'" -- --steps " -1"
expect seed-leading-space 2 "--seed needs a non-negative integer, got ' -5'" -- --seed " -5"
expect keep-plus 2 "--keep needs a positive integer, got '+3'" -- --keep +3
# A real fp32 holds only as 0 or infinity had been taken as 0 (--max-grad-norm 1e-50 saved 0.0: no
# clipping) or refused as negative (1e39).
expect max-grad-norm-underflow 2 "--max-grad-norm: '1e-50' is outside fp32's range" -- --max-grad-norm 1e-50
expect lr-underflow 2 "--lr: '1e-50' is outside fp32's range" -- --lr 1e-50
expect max-grad-norm-overflow 2 "--max-grad-norm: '1e39' is outside fp32's range" -- --max-grad-norm 1e39
expect weight-decay-space 2 "--weight-decay needs a non-negative number" -- --weight-decay " 0.1"

# Faults during training: a diverging run (absurd learning rate) skips its non-finite steps
# without updating, logs them, and stops after --max-skips in a row (exit 4); --on-nonfinite stop
# stops at the first.
"$train" --out "$work/diverge" --steps 10 --seq 32 --lr 1e30 --max-skips 3 > /dev/null 2> "$work/diverge.stderr"
rc=$?
if [[ $rc -ne 4 ]] || [[ $(grep -c "step skipped" "$work/diverge.stderr") -ne 3 ]] ||
   ! grep -q "3 consecutive non-finite losses" "$work/diverge.stderr" || ! grep -q '"loss":null' "$work/diverge/metrics.jsonl"; then
  echo "FAIL diverging-run: exit $rc"; cat "$work/diverge.stderr"; fails=$((fails + 1))
else echo "ok   diverging-run: exit 4 after $(grep -c 'step skipped' "$work/diverge.stderr") skipped steps"; fi
# The count of skips in a row is in the checkpoint: a run stopped and resumed mid-streak stops
# where the uninterrupted one did (at step 4; it had started counting again and gone on to 6).
"$train" --out "$work/diverge2" --steps 3 --seq 32 --lr 1e30 --max-skips 3 > /dev/null 2> /dev/null ||
  { echo "FAIL: a 3-step diverging run (2 skips) failed"; exit 1; }
"$train" --out "$work/diverge2" --steps 10 --seq 32 --lr 1e30 --max-skips 3 --resume > /dev/null 2> "$work/diverge2.stderr"
rc=$?
if [[ $rc -ne 4 ]] || ! grep -q "step 4: loss is" "$work/diverge2.stderr" || grep -q "step 5: loss is" "$work/diverge2.stderr" ||
   ! grep -q "3 consecutive non-finite losses" "$work/diverge2.stderr"; then
  echo "FAIL skips-across-resume: exit $rc"; cat "$work/diverge2.stderr"; fails=$((fails + 1))
else echo "ok   skips-across-resume: $(tail -1 "$work/diverge2.stderr")"; fi
# (--dump-batches' windows of the steps run are written when it stops: they had been lost.)
"$train" --out "$work/stop" --steps 10 --seq 32 --lr 1e30 --on-nonfinite stop --dump-batches "$work/stop.tok" > "$work/stop.stdout" \
  2> "$work/stop.stderr"
rc=$?
if [[ $rc -ne 4 ]] || ! grep -q "stopping on a non-finite loss at step 2" "$work/stop.stderr" || [[ ! -s "$work/stop.tok" ]] ||
   ! grep -q "^2 windows of 33 tokens written to $work/stop.tok (the steps up to 2, where the run stopped)" "$work/stop.stdout"; then
  echo "FAIL stop-on-nonfinite: exit $rc"; cat "$work/stop.stderr"; fails=$((fails + 1))
else echo "ok   stop-on-nonfinite: $(tail -1 "$work/stop.stderr")"; fi
# A count of one reads in the singular ("1 windows" had been printed).
"$train" --out "$work/one-step" --steps 1 --seq 32 --checkpoint-every 0 --dump-batches "$work/one.tok" > "$work/one.stdout" \
  2> "$work/one.stderr"
rc=$?
if [[ $rc -ne 0 ]] || ! grep -q "^1 window of 33 tokens written to $work/one.tok" "$work/one.stdout" ||
   grep -q "\b1 windows\b" "$work/one.stdout"; then
  echo "FAIL one-window: exit $rc"; cat "$work/one.stdout" "$work/one.stderr"; fails=$((fails + 1))
else echo "ok   one-window: $(grep '^1 window' "$work/one.stdout")"; fi

[[ $fails -eq 0 ]] && echo "PASS: every bad input refused cleanly, faults handled" || exit 1
