#!/usr/bin/env bash
# The run directory is one run's, and what it holds survives bad requests (host backend):
#   - a second oom-train in a directory in use is refused, and the first goes on;
#   - --overwrite with a bad --lr is refused before the old run's checkpoints are touched;
#   - --overwrite starts afresh over a `latest` that names a missing checkpoint;
#   - trainer_state.json's step and optimizer_steps must fit the checkpoint they are in, and a field
#     missing or of another type is named with the checkpoint's file;
#   - a checkpoint of another config is refused as such, not by its first tensor of another shape;
#   - --resume refuses --init-from, and a --seed other than the checkpoint's;
#   - a damaged latest checkpoint (a file cut short, its config.json missing or unparsable, a byte
#     changed (its checksum), a file of another step): --resume names the newest older one that
#     opens and how to use it, before planning (under a budget no plan fits);
#   - the same config in another JSON layout resumes (the built-in model's run with tiny-moe.json);
#   - --resume keeps the checkpoint's AdamW moments (bf16 ones are bf16 values in it) and refuses others, both ways;
#   - a `latest` written with CRLF still resumes;
#   - the sampler's position must be its step's; a damaged metrics.jsonl line is dropped with a
#     warning, the later steps' lines kept; killed runs' temporaries are removed;
#   - checkpoints without `latest` are a run: a new run there is refused (it had replaced them and
#     emptied metrics.jsonl), and --resume says how to name the one to continue from;
#   - a run directory moved or removed while the run trains stops the run, naming where it went
#     (its next checkpoint had made a new directory at the old path, without its metrics or lock);
#   - a checkpoint's rename into the run directory is fsync'ed before `latest` names it (strace);
#   - a kill while --keep removes an old checkpoint leaves no directory of a complete checkpoint's
#     name with files missing (strace);
#   - a checkpoint that cannot be written (a file-size limit; a full disk, where a tmpfs can be
#     mounted) stops the run naming the sizes and the checkpoint it continues from, which is kept;
#   - a metrics line that cannot be written (a file-size limit: EFBIG) stops the run with an error
#     (it had said "done" over a file cut mid-line).
# Usage: run_directory.sh path/to/oom-train
set -uo pipefail
shopt -s extglob
train="$1"
work="$(mktemp -d)"
trap 'kill $(jobs -p) 2> /dev/null; rm -rf "$work"' EXIT
fails=0
args=(--backend host --seq 64 --log-every 100)

fail() { echo "FAIL $1"; shift; [[ $# -gt 0 ]] && cat "$@"; fails=$((fails + 1)); }

# wait_for FILE PATTERN PID: until FILE holds PATTERN (the run still going), at most 60 s.
wait_for() {
  for _ in $(seq 1 6000); do
    grep -qs -- "$2" "$1" && return 0
    kill -0 "$3" 2> /dev/null || return 1
    sleep 0.01
  done
  return 1
}

"$train" "${args[@]}" --steps 8 --checkpoint-every 4 --out "$work/base" > /dev/null 2>&1 || { echo "FAIL: a good run failed"; exit 1; }

# One run at a time.
"$train" "${args[@]}" --steps 100000 --checkpoint-every 0 --out "$work/busy" > /dev/null 2> "$work/first.err" &
first=$!
if ! wait_for "$work/busy/metrics.jsonl" '"step":1,' "$first"; then
  fail "busy: the first run did not start" "$work/first.err"
else
  "$train" "${args[@]}" --steps 3 --out "$work/busy" --overwrite > /dev/null 2> "$work/second.err"
  rc=$?
  if [[ $rc -ne 2 ]] || ! grep -q "is in use by another oom-train (process $first); one run at a time" "$work/second.err" ||
     ! kill -0 "$first" 2> /dev/null; then
    fail "busy: a second run in the same directory: exit $rc" "$work/second.err"
  else
    echo "ok   busy: $(cat "$work/second.err")"
  fi
  kill -TERM "$first"
  wait "$first" 2> /dev/null
fi
# The lock goes with its holder, however it ends.
"$train" "${args[@]}" --steps 1 --out "$work/busy" --overwrite > /dev/null 2> "$work/after.err" ||
  fail "busy: the directory stays locked after its run ended" "$work/after.err"

# --overwrite with a bad learning rate: refused, the old run intact.
"$train" "${args[@]}" --steps 8 --lr 1e38 --out "$work/base" --overwrite > /dev/null 2> "$work/lr.err"
rc=$?
if [[ $rc -ne 2 ]] || ! grep -q -- "--lr 1e+38" "$work/lr.err" || [[ "$(cat "$work/base/latest")" != checkpoint-000008 ]] ||
   [[ ! -d "$work/base/checkpoint-000004" ]] || [[ $(wc -l < "$work/base/metrics.jsonl") -ne 8 ]]; then
  fail "overwrite-bad-lr: exit $rc, latest $(cat "$work/base/latest" 2> /dev/null)" "$work/lr.err"
else
  echo "ok   overwrite-bad-lr: $(cat "$work/lr.err")"
fi

# --overwrite over a broken `latest`.
cp -r "$work/base" "$work/broken"
echo checkpoint-000012 > "$work/broken/latest"
"$train" "${args[@]}" --steps 2 --out "$work/broken" --overwrite > /dev/null 2> "$work/broken.err"
rc=$?
if [[ $rc -ne 0 ]] || [[ "$(cat "$work/broken/latest")" != checkpoint-000002 ]]; then
  fail "overwrite-broken-latest: exit $rc" "$work/broken.err"
else
  echo "ok   overwrite-broken-latest: started afresh"
fi

# rechecksum DIR: DIR/checksums.json made to match its edited trainer_state.json (CRC-32C), as if
# the checkpoint had been saved so: what the checks of its fields find is tested, not the checksum.
rechecksum() {
  python3 - "$1" << 'EOF'
import json, sys
d = sys.argv[1]
def crc32c(data):
    c = 0xFFFFFFFF
    for b in data:
        c ^= b
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
    return c ^ 0xFFFFFFFF
with open(d + "/checksums.json") as f:
    sums = json.load(f)
with open(d + "/trainer_state.json", "rb") as f:
    sums["files"]["trainer_state.json"] = crc32c(f.read())
with open(d + "/checksums.json", "w") as f:
    json.dump(sums, f)
EOF
}

# trainer_state.json's fields against the checkpoint they are in.
# state_case NAME SED PATTERN: edits checkpoint-000008's trainer_state.json by SED (its checksum
# made to match), expects --resume to fail with PATTERN.
state_case() {
  local dir="$work/state-$1"
  cp -r "$work/base" "$dir"
  sed -i -E "$2" "$dir/checkpoint-000008/trainer_state.json"
  rechecksum "$dir/checkpoint-000008"
  "$train" "${args[@]}" --steps 10 --checkpoint-every 4 --out "$dir" --resume > /dev/null 2> "$work/$1.err"
  local rc=$?
  if [[ $rc -ne 2 ]] || ! grep -q -- "$3" "$work/$1.err" || [[ -d "$dir/checkpoint-000010" ]] ||
     ! cmp -s "$work/base/checkpoint-000008/model.safetensors" "$dir/checkpoint-000008/model.safetensors"; then
    fail "$1: exit $rc" "$work/$1.err"
  else
    echo "ok   $1: $(cat "$work/$1.err")"
  fi
}
state_case step-past-2-64 's/"step": 8/"step": 18446744073709551615/' 'step is 18446744073709551615, in a checkpoint named checkpoint-000008'
state_case step-other 's/"step": 8/"step": 9/' 'step is 9, in a checkpoint named checkpoint-000008'
state_case optimizer-steps 's/"optimizer_steps": 8/"optimizer_steps": 1000/' 'optimizer_steps is 1000; a checkpoint of step 8 has made 0 to 8 updates'
# A field missing or of another type: named with its checkpoint (the message had said only
# "trainer_state.json.seq", which every checkpoint holds).
state_case missing-field 's/"seq": 64,//' 'state-missing-field/checkpoint-000008/trainer_state.json.seq: missing required field'
state_case wrong-type 's/"seq": 64/"seq": "64"/' 'state-wrong-type/checkpoint-000008/trainer_state.json.seq: expected non-negative integer, got string'
state_case sampler-wrong-type 's/"position": ([0-9]+)/"position": -\1/' 'state-sampler-wrong-type/checkpoint-000008/trainer_state.json.sampler.position: expected non-negative integer'
# A sampler's step of other windows than the run's (a hand edit): refused at resume, not at the
# first draw once metrics.jsonl is open.
state_case sampler-step-windows 's/"step_windows": 1/"step_windows": 3/' 'trainer_state.json: sampler step_windows is 3, but the run.s steps draw 1 window '
# The sampler's position must be the step's (every step draws its windows): another had resumed on
# other data without a word (0 replays steps 1-2's windows; 2^64 - 1 wrapped to the first).
state_case sampler-position-zero 's/"position": 8/"position": 0/' 'sampler position is 0, but a checkpoint of step 8 drawing 1 window a step is at window 8'
state_case sampler-position-wraps 's/"position": 8/"position": 18446744073709551615/' 'sampler position is 18446744073709551615, but a checkpoint of step 8'
# The same edit without its checksum made to match: the checksum finds it first.
cp -r "$work/base" "$work/state-edited"
sed -i 's/"position": 8/"position": 0/' "$work/state-edited/checkpoint-000008/trainer_state.json"
"$train" "${args[@]}" --steps 10 --out "$work/state-edited" --resume > /dev/null 2> "$work/state-edited.err"
rc=$?
[[ $rc -eq 2 ]] && grep -q "checkpoint-000008/trainer_state.json: changed after its save: its CRC-32C is" "$work/state-edited.err" &&
  echo "ok   state-edited: $(cat "$work/state-edited.err")" || fail "state-edited: exit $rc" "$work/state-edited.err"

# Another model's config: said so (it had been refused by the first tensor of another shape).
"$train" "${args[@]}" --steps 10 --out "$work/base" --resume --config "$(dirname "$0")/../../examples/configs/tiny-moe-d128.json" \
  > /dev/null 2> "$work/other-config.err"
rc=$?
[[ $rc -eq 2 ]] && grep -q -- "--resume: .*base/checkpoint-000008 was trained with another config.json than .*tiny-moe-d128.json (.* against .*; the checkpoint's first)" "$work/other-config.err" &&
  echo "ok   resume-other-config: $(cat "$work/other-config.err")" || fail "resume-other-config: exit $rc" "$work/other-config.err"

# --resume with flags that would change nothing, silently.
"$train" "${args[@]}" --steps 10 --out "$work/base" --resume --init-from "$work/base/checkpoint-000004" > /dev/null 2> "$work/init.err"
rc=$?
[[ $rc -eq 2 ]] && grep -q -- "--resume and --init-from exclude each other" "$work/init.err" &&
  echo "ok   resume-init-from: $(cat "$work/init.err")" || fail "resume-init-from: exit $rc" "$work/init.err"
# A damaged latest checkpoint (its optimizer file cut in half): --resume names what is wrong and
# the newest older checkpoint that opens, with the line that resumes from it; which then works.
cp -r "$work/base" "$work/damaged"
cut_file="$work/damaged/checkpoint-000008/optimizer.safetensors"
truncate -s $(( $(stat -c %s "$cut_file") / 2 )) "$cut_file"
"$train" "${args[@]}" --steps 10 --checkpoint-every 4 --out "$work/damaged" --resume > /dev/null 2> "$work/damaged.err"
rc=$?
if [[ $rc -eq 2 ]] && grep -q "checkpoint-000008/optimizer.safetensors: .*; .*damaged/checkpoint-000004 opens (its files, tensor shapes and small files' checksums check out): to resume from it, \`echo checkpoint-000004 > .*damaged/latest\`" "$work/damaged.err"; then
  echo checkpoint-000004 > "$work/damaged/latest"
  # The damaged step-8 checkpoint stays until this run saves step 8: said at the resume.
  if "$train" "${args[@]}" --steps 10 --checkpoint-every 4 --out "$work/damaged" --resume > /dev/null 2> "$work/damaged2.err" &&
     [[ "$(cat "$work/damaged/latest")" == checkpoint-000010 ]] &&
     grep -q "warning: --resume continues from step 4; .*damaged holds 1 newer checkpoint (checkpoint-000008) of another continuation: each is replaced when this run saves its step, and metrics.jsonl's lines past step 4 are dropped" "$work/damaged2.err"; then
    echo "ok   damaged-latest: $(cat "$work/damaged.err")"
  else fail "damaged-latest: the advice did not resume" "$work/damaged2.err"; fi
else fail "damaged-latest: exit $rc" "$work/damaged.err"; fi

# The same damage under a budget no plan fits: the checkpoint is opened before the run is planned,
# so the damage is said (it had been "no plan fits" first, the checkpoint never looked at).
cp -r "$work/base" "$work/damaged-budget"
cut_file="$work/damaged-budget/checkpoint-000008/optimizer.safetensors"
truncate -s $(( $(stat -c %s "$cut_file") / 2 )) "$cut_file"
"$train" "${args[@]}" --steps 10 --out "$work/damaged-budget" --resume --gpu-mem 64KiB > /dev/null 2> "$work/damaged-budget.err"
rc=$?
[[ $rc -eq 2 ]] && grep -q "checkpoint-000008/optimizer.safetensors: .*damaged-budget/checkpoint-000004 opens" "$work/damaged-budget.err" &&
  echo "ok   damaged-before-planning: $(cat "$work/damaged-budget.err")" || fail "damaged-before-planning: exit $rc" "$work/damaged-budget.err"
# Damage that leaves every file whole: a changed byte in a tensor's values (found by its checksum
# when read, after opening: it had trained on), the weights file of another step (a cp between
# checkpoints: it had resumed step 4's weights with step 8's moments), a config.json that no
# longer parses (a bare parse error before any advice). Each gets the same advice.
# damage_case NAME COMMAND PATTERN: COMMAND damages $dir (a copy of base), --resume fails with
# PATTERN and the advice.
damage_case() {
  local dir="$work/damage-$1"
  cp -r "$work/base" "$dir"
  eval "$2"
  "$train" "${args[@]}" --steps 10 --checkpoint-every 4 --out "$dir" --resume > /dev/null 2> "$work/damage-$1.err"
  local rc=$?
  if [[ $rc -eq 2 ]] && grep -q -- "$3" "$work/damage-$1.err" &&
     grep -q "damage-$1/checkpoint-000004 opens (its files, tensor shapes and small files' checksums check out)" "$work/damage-$1.err" &&
     [[ "$(cat "$dir/latest")" == checkpoint-000008 ]]; then
    echo "ok   damage-$1: $(cat "$work/damage-$1.err")"
  else
    fail "damage-$1: exit $rc" "$work/damage-$1.err"
  fi
}
damage_case flipped-byte 'printf "\x5a" | dd of="$dir/checkpoint-000008/model.safetensors" bs=1 seek=$(( $(stat -c %s "$dir/checkpoint-000008/model.safetensors") - 5 )) conv=notrunc status=none' \
  "model.safetensors: tensor '.*' changed after its save: its bytes' CRC-32C is"
damage_case other-step 'cp "$dir/checkpoint-000004/model.safetensors" "$dir/checkpoint-000008/"' \
  "model.safetensors is of step 4, save [0-9a-f]*, optimizer.safetensors of step 8, save [0-9a-f]*: files of two saves"
damage_case config-edited 'sed -i "s/\"rms_norm_eps\": [^,]*/\"rms_norm_eps\": 0.5/" "$dir/checkpoint-000008/config.json"' \
  "checkpoint-000008/config.json: changed after its save: its CRC-32C is"
damage_case config-unparsable 'echo "{\"vocab_size\": 256" > "$dir/checkpoint-000008/config.json"' \
  "checkpoint-000008/config.json:.*; "

# A latest checkpoint without its config.json is damaged too: the same advice (it had been a bare
# "cannot open").
cp -r "$work/base" "$work/no-config"
rm "$work/no-config/checkpoint-000008/config.json"
"$train" "${args[@]}" --steps 10 --out "$work/no-config" --resume > /dev/null 2> "$work/no-config.err"
rc=$?
[[ $rc -eq 2 ]] && grep -q -- "--resume: .*no-config/checkpoint-000008/config.json: cannot open; .*no-config/checkpoint-000004 opens" "$work/no-config.err" &&
  echo "ok   resume-no-config: $(cat "$work/no-config.err")" || fail "resume-no-config: exit $rc" "$work/no-config.err"
# ... also for a run of its own config (not the built-in one), resumed without --config: the model
# is the newest older checkpoint's (the built-in had been taken, and no older checkpoint "opened").
sed 's/"rms_norm_eps": [^,]*/"rms_norm_eps": 1e-05/' "$(dirname "$0")/../../examples/configs/tiny-moe.json" > "$work/own.json"
"$train" "${args[@]}" --steps 8 --checkpoint-every 4 --config "$work/own.json" --out "$work/own" > /dev/null 2>&1 ||
  fail "own-config: the run failed"
rm "$work/own/checkpoint-000008/config.json"
"$train" "${args[@]}" --steps 10 --out "$work/own" --resume > "$work/own.out" 2> "$work/own.err"
rc=$?
if [[ $rc -eq 2 ]] && grep -q "config .*own/checkpoint-000004/config.json (the latest checkpoint.s is missing or damaged" "$work/own.out" &&
   grep -q -- "--resume: .*own/checkpoint-000008/config.json: cannot open; .*own/checkpoint-000004 opens" "$work/own.err"; then
  echo checkpoint-000004 > "$work/own/latest"
  if "$train" "${args[@]}" --steps 10 --checkpoint-every 4 --out "$work/own" --resume > /dev/null 2> "$work/own2.err" &&
     [[ "$(cat "$work/own/latest")" == checkpoint-000010 ]] && grep -q '"rms_norm_eps": 1e-05' "$work/own/checkpoint-000010/config.json"; then
    echo "ok   resume-no-config-own-model: $(cat "$work/own.err")"
  else fail "resume-no-config-own-model: the advice did not resume" "$work/own2.err"; fi
else fail "resume-no-config-own-model: exit $rc" "$work/own.out" "$work/own.err"; fi
# --layers N: the config's widths at N layers, as its checkpoints' config.json says; a resumed run
# keeps that depth without the flag, and another depth is another config.
"$train" "${args[@]}" --steps 2 --checkpoint-every 2 --layers 2 --out "$work/layers" > "$work/layers.log" 2>&1 ||
  fail "layers: the run failed" "$work/layers.log"
if grep -q "model built-in tiny Qwen3-MoE at 2 layers (--layers): 2 layers" "$work/layers.log" &&
   grep -q '"num_hidden_layers": 2' "$work/layers/checkpoint-000002/config.json" &&
   "$train" "${args[@]}" --steps 3 --checkpoint-every 3 --out "$work/layers" --resume > /dev/null 2> "$work/layers2.err" &&
   ! "$train" "${args[@]}" --steps 4 --out "$work/layers" --resume --layers 3 > /dev/null 2> "$work/layers3.err" &&
   grep -q "was trained with another config.json than .*at 3 layers (--layers) (num_hidden_layers: 2 against 3; the checkpoint's first)" \
     "$work/layers3.err"; then
  echo "ok   layers: $(cat "$work/layers3.err")"
else fail "layers" "$work/layers.log" "$work/layers2.err" "$work/layers3.err"; fi
# The same config written otherwise is the same model: the built-in model's run resumes with
# examples/configs/tiny-moe.json (its JSON in another layout; refused as another config when
# compared as text), its members reordered and a real written as an integer (rope_theta 10000).
cp -r "$work/base" "$work/same-config"
python3 -c '
import json, sys
c = json.load(open(sys.argv[1]))
c = dict(reversed(list(c.items())))
c["rope_theta"] = int(c["rope_theta"])
json.dump(c, open(sys.argv[2], "w"))' "$(dirname "$0")/../../examples/configs/tiny-moe.json" "$work/reordered.json"
"$train" "${args[@]}" --steps 10 --checkpoint-every 4 --out "$work/same-config" --resume --config "$work/reordered.json" \
  > "$work/same-config.log" 2>&1
rc=$?
[[ $rc -eq 0 ]] && ! cmp -s "$work/same-config/checkpoint-000008/config.json" "$work/reordered.json" &&
  [[ "$(cat "$work/same-config/latest")" == checkpoint-000010 ]] &&
  echo "ok   resume-same-config-other-layout" || fail "resume-same-config-other-layout: exit $rc" "$work/same-config.log"

# AdamW moments: a resumed run keeps the checkpoint's (bf16 here, without --moments); asking for
# others is refused both ways (the state would be rounded or widened: another run than the one
# saved). The bf16 run's moments are bf16 values in its checkpoint (the layers' and the ends'),
# and its third step differs from the fp32 run's.
"$train" "${args[@]}" --steps 10 --out "$work/base" --resume --moments bf16 > /dev/null 2> "$work/moments.err"
rc=$?
[[ $rc -eq 2 ]] && grep -q -- "--resume: .*base/checkpoint-000008 kept AdamW moments in fp32, this run keeps them in bf16; pass --moments fp32" \
  "$work/moments.err" && echo "ok   resume-other-moments: $(cat "$work/moments.err")" || fail "resume-other-moments: exit $rc" "$work/moments.err"
"$train" "${args[@]}" --steps 2 --checkpoint-every 2 --moments bf16 --out "$work/bf16" > /dev/null 2> "$work/bf16.err" ||
  fail "bf16-moments run" "$work/bf16.err"
"$train" "${args[@]}" --steps 4 --checkpoint-every 2 --out "$work/bf16" --resume > /dev/null 2> "$work/bf16-resume.err"
rc=$?
if [[ $rc -eq 0 ]] && grep -q '"moments": "bf16"' "$work/bf16/checkpoint-000004/trainer_state.json" &&
   python3 - "$work/bf16/checkpoint-000004/optimizer.safetensors" <<'PY'
import json, struct, sys
raw = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
head = json.loads(raw[8:8 + n])
moments = [k for k in head if k.startswith("exp_avg")]
assert moments and any(k.startswith("exp_avg.model.embed_tokens") for k in moments), sorted(head)[:5]
for k in moments:
    a, b = head[k]["data_offsets"]
    words = struct.unpack(f"<{(b - a) // 4}I", raw[8 + n + a:8 + n + b])
    assert all(w & 0xFFFF == 0 for w in words), f"{k}: a moment that is not a bf16 value"
print(f"{len(moments)} moment tensors, every value a bf16")
PY
then echo "ok   resume-keeps-bf16-moments"
else fail "resume-keeps-bf16-moments: exit $rc" "$work/bf16-resume.err"; fi
loss_at() { sed -n "${2}p" "$1/metrics.jsonl" | sed -E 's/.*"loss":([^,]+),.*/\1/'; }
# (The first update uses its moments unrounded, so steps 1 and 2 are alike; the third is not.)
[[ "$(loss_at "$work/base" 2)" == "$(loss_at "$work/bf16" 2)" && "$(loss_at "$work/base" 3)" != "$(loss_at "$work/bf16" 3)" ]] &&
  echo "ok   bf16-moments-step: step 2 $(loss_at "$work/bf16" 2) alike, step 3 $(loss_at "$work/base" 3) (fp32) vs $(loss_at "$work/bf16" 3)" ||
  fail "bf16-moments-step: losses at steps 2, 3: $(loss_at "$work/base" 2) $(loss_at "$work/base" 3) (fp32) vs $(loss_at "$work/bf16" 2) $(loss_at "$work/bf16" 3)"
"$train" "${args[@]}" --steps 6 --out "$work/bf16" --resume --moments fp32 > /dev/null 2> "$work/bf16-fp32.err"
rc=$?
[[ $rc -eq 2 ]] && grep -q -- "--resume: .*bf16/checkpoint-000004 kept AdamW moments in bf16, this run keeps them in fp32; pass --moments bf16" \
  "$work/bf16-fp32.err" && echo "ok   resume-bf16-moments-as-fp32: $(cat "$work/bf16-fp32.err")" ||
  fail "resume-bf16-moments-as-fp32: exit $rc" "$work/bf16-fp32.err"
"$train" "${args[@]}" --steps 10 --out "$work/base" --resume --seed 5 > /dev/null 2> "$work/seed.err"
rc=$?
[[ $rc -eq 2 ]] && grep -q -- "draws its windows with seed 0; --seed 5 would change nothing" "$work/seed.err" &&
  echo "ok   resume-other-seed: $(cat "$work/seed.err")" || fail "resume-other-seed: exit $rc" "$work/seed.err"

# A `latest` written with CRLF (and the same seed, given again) resumes.
cp -r "$work/base" "$work/crlf"
printf 'checkpoint-000008\r\n' > "$work/crlf/latest"
"$train" "${args[@]}" --steps 10 --checkpoint-every 4 --seed 0 --out "$work/crlf" --resume > /dev/null 2> "$work/crlf.err" &&
  [[ "$(cat "$work/crlf/latest")" == checkpoint-000010 ]] && echo "ok   crlf-latest: resumed to step 10" ||
  fail "crlf-latest" "$work/crlf.err"

# A run of 2 sequences a step continued from a checkpoint older than the sampler's step_windows (it
# keeps 1 there while its position moves 2 a step): each later resume checks the position against
# the run's 2 a step (it had been refused at the second resume: "position is 16, ... at window 8").
"$train" "${args[@]}" --batch 2 --steps 4 --checkpoint-every 4 --out "$work/batch2" > /dev/null 2>&1 || fail "batch2: the first run failed"
python3 -c 'import json, sys
p = sys.argv[1]; s = json.load(open(p)); del s["sampler"]["step_windows"]; json.dump(s, open(p, "w"), indent=2)' \
  "$work/batch2/checkpoint-000004/trainer_state.json"
rechecksum "$work/batch2/checkpoint-000004"
if "$train" "${args[@]}" --batch 2 --steps 8 --checkpoint-every 4 --out "$work/batch2" --resume > /dev/null 2> "$work/batch2.err" &&
   "$train" "${args[@]}" --batch 2 --steps 12 --checkpoint-every 4 --out "$work/batch2" --resume > /dev/null 2>> "$work/batch2.err" &&
   [[ "$(cat "$work/batch2/latest")" == checkpoint-000012 ]]; then
  echo "ok   batch2-from-older-sampler: resumed twice to step 12"
else
  fail "batch2-from-older-sampler" "$work/batch2.err"
fi

# A damaged line of metrics.jsonl (step 3's step a string): dropped with a warning, the later steps'
# lines kept (the resume had kept only the lines before it, steps 3-8 gone without a word). What
# killed runs left beside the run's own files (their temporaries) is removed.
cp -r "$work/base" "$work/metrics-damage"
sed -i '3s/"step":3,/"step":"3",/' "$work/metrics-damage/metrics.jsonl"
for f in builtin-corpus.tok metrics.jsonl latest; do echo x > "$work/metrics-damage/$f.tmp-1"; done
"$train" "${args[@]}" --steps 10 --checkpoint-every 4 --out "$work/metrics-damage" --resume > /dev/null 2> "$work/metrics-damage.err"
rc=$?
steps="$(grep -o '^{"step":[0-9]*' "$work/metrics-damage/metrics.jsonl" | cut -d: -f2 | tr '\n' ' ')"
if [[ $rc -ne 0 ]] || [[ "$steps" != "1 2 4 5 6 7 8 9 10 " ]] ||
   ! grep -q "metrics.jsonl: 1 damaged line (not a JSON record with a step; the first is line 3) dropped" "$work/metrics-damage.err" ||
   compgen -G "$work/metrics-damage/*.tmp-1" > /dev/null; then
  fail "metrics-damaged-line: exit $rc, steps $steps" "$work/metrics-damage.err"
else
  echo "ok   metrics-damaged-line: steps $steps; $(cat "$work/metrics-damage.err")"
fi

# Checkpoints without `latest` (removed, or a save killed between renaming its checkpoint in and
# writing `latest`): a new run there had started over them without --overwrite, emptying
# metrics.jsonl and replacing their steps' checkpoints; --resume had said "no checkpoint".
cp -r "$work/base" "$work/no-latest"
rm "$work/no-latest/latest"
"$train" "${args[@]}" --steps 8 --checkpoint-every 4 --seed 1 --out "$work/no-latest" > /dev/null 2> "$work/no-latest.err"
rc=$?
if [[ $rc -ne 2 ]] || ! grep -q "latest: missing, while .*no-latest holds 2 checkpoints, checkpoint-000004 to checkpoint-000008: to resume the run.*(echo checkpoint-000008 > .*; --overwrite starts afresh" "$work/no-latest.err" ||
   [[ $(wc -l < "$work/no-latest/metrics.jsonl") -ne 8 ]] ||
   ! cmp -s "$work/base/checkpoint-000004/model.safetensors" "$work/no-latest/checkpoint-000004/model.safetensors"; then
  fail "no-latest: a new run over checkpoints without latest: exit $rc" "$work/no-latest.err"
else
  echo "ok   no-latest: $(cat "$work/no-latest.err")"
fi
"$train" "${args[@]}" --steps 10 --checkpoint-every 4 --out "$work/no-latest" --resume > /dev/null 2> "$work/no-latest-resume.err"
rc=$?
if [[ $rc -ne 2 ]] || ! grep -q "latest: missing, while .* (echo checkpoint-000008 > " "$work/no-latest-resume.err"; then
  fail "no-latest-resume: exit $rc" "$work/no-latest-resume.err"
else
  echo "ok   no-latest-resume: $(cat "$work/no-latest-resume.err")"
fi
echo checkpoint-000008 > "$work/no-latest/latest"
"$train" "${args[@]}" --steps 10 --checkpoint-every 4 --out "$work/no-latest" --resume > /dev/null 2> "$work/no-latest-named.err" &&
  [[ "$(cat "$work/no-latest/latest")" == checkpoint-000010 ]] && echo "ok   no-latest-named: resumed to step 10" ||
  fail "no-latest-named" "$work/no-latest-named.err"

# The run directory moved (mv) or removed (rm -r) while the run trains: the run stops at its next
# step with the place named, and nothing is made at the old path (the next checkpoint had made a
# new directory there, without the run's metrics, data or lock, and the run had said "done").
# (200 steps: enough to move it mid-run on a slow machine; a run that does not stop ends anyway.)
for how in moved removed; do
  "$train" "${args[@]}" --steps 200 --checkpoint-every 4 --out "$work/$how" > /dev/null 2> "$work/$how.err" &
  pid=$!
  if ! wait_for "$work/$how/latest" checkpoint-000004 "$pid"; then
    fail "$how: the run did not reach its first checkpoint" "$work/$how.err"
    continue
  fi
  if [[ $how == moved ]]; then mv "$work/$how" "$work/$how-elsewhere"; else rm -rf "$work/$how"; fi
  rc=0
  wait "$pid" || rc=$?
  if [[ $how == moved ]]; then
    want="$work/moved was moved to $work/moved-elsewhere while the run trained; the run stops .*--out $work/moved-elsewhere --resume"
  else
    # (or, where the check fell between rm's unlink of .lock and its rmdir, the lock named as removed)
    want="$work/removed was removed while the run trained, with its checkpoints and metrics; the run stops\|$work/removed/.lock, this run's lock on the directory, was removed while the run trained (the directory being removed"
  fi
  if [[ $rc -ne 2 ]] || ! grep -q -- "$want" "$work/$how.err" || [[ -e "$work/$how" ]]; then
    fail "$how: exit $rc, $([[ -e "$work/$how" ]] && echo "a directory made at the old path" || echo "nothing at the old path")" \
      "$work/$how.err"
  else
    echo "ok   run-directory-$how: $(cat "$work/$how.err")"
  fi
done
# The moved run resumes where it now is.
"$train" "${args[@]}" --steps 6 --checkpoint-every 4 --out "$work/moved-elsewhere" --resume > "$work/moved-resumed.log" 2>&1 &&
  grep -q "resumed from .*moved-elsewhere/checkpoint-0000[0-9][0-9] at step" "$work/moved-resumed.log" &&
  echo "ok   run-directory-moved-resumes" || fail "run-directory-moved-resumes" "$work/moved-resumed.log"

# The checkpoint directory's rename is durable before `latest` names it: an fsync between that
# rename and the creation of `latest`'s temporary (both renames had waited for `latest`'s own fsync
# of the directory, and a power loss before it could keep `latest` without the checkpoint).
if command -v strace > /dev/null && strace -o /dev/null true 2> /dev/null; then
  strace -f -o "$work/sync.trace" -e trace=rename,renameat,renameat2,openat,fsync \
    "$train" "${args[@]}" --steps 1 --out "$work/sync" > /dev/null 2> "$work/sync.err"
  between=$(sed -n '/checkpoint-000001.partial", .*checkpoint-000001"/,/latest.tmp-/p' "$work/sync.trace")
  if [[ -z "$between" ]] || ! grep -q "latest.tmp-" <<< "$between" || ! grep -q "fsync(" <<< "$between"; then
    fail "checkpoint-rename-synced: no fsync between the checkpoint's rename and latest's" "$work/sync.err"
    printf '%s\n' "$between" | head -20
  else
    echo "ok   checkpoint-rename-synced"
  fi
  # Killed (SIGKILL at the second file unlinked) while --keep 1 removes checkpoint 1: what is left
  # of it must not be named as a complete checkpoint (it had been: checkpoint-000001 without its
  # optimizer.safetensors), and the next save removes it.
  # (unlink too: a libstdc++ whose remove_all calls ::remove unlinks files with unlink(2). The kill
  # must be seen, 137, or the case tested nothing.)
  killed=0
  (strace -f -o /dev/null -e trace=unlink,unlinkat -e signal=none -e inject=unlink,unlinkat:signal=KILL:when=2 \
     "$train" "${args[@]}" --steps 2 --checkpoint-every 1 --keep 1 --out "$work/pruned") > /dev/null 2>&1 || killed=$?
  broken=""
  for dir in "$work"/pruned/checkpoint-+([0-9]); do
    for file in model.safetensors optimizer.safetensors trainer_state.json config.json; do
      [[ -f "$dir/$file" ]] || broken+=" ${dir##*/}/$file"
    done
  done
  if [[ $killed -ne 137 ]]; then
    fail "checkpoint-pruning-killed: the run was not killed mid-prune (exit $killed: no second unlink seen)"
  elif [[ -n "$broken" ]] || [[ "$(cat "$work/pruned/latest")" != checkpoint-000002 ]]; then
    fail "checkpoint-pruning-killed: missing:$broken; latest $(cat "$work/pruned/latest")"
  elif ! "$train" "${args[@]}" --steps 3 --checkpoint-every 1 --keep 1 --out "$work/pruned" --resume > /dev/null 2> "$work/pruned.err" ||
       [[ "$(cd "$work/pruned" && echo checkpoint-*)" != checkpoint-000003 ]]; then
    fail "checkpoint-pruning-killed: the resumed run left $(cd "$work/pruned" && echo checkpoint-*)" "$work/pruned.err"
  else
    echo "ok   checkpoint-pruning-killed: no checkpoint named complete with files missing; the next save removed the rest"
  fi
else
  echo "skip checkpoint-rename-synced, checkpoint-pruning-killed: no working strace"
fi

# A checkpoint that cannot be written: a file-size limit (EFBIG: oom-train ignores SIGXFSZ, which had
# killed it with no word) under the 30 MiB
# optimizer file, on a run resumed from step 4. The error says the run stops and which checkpoint
# it continues from; that one, and `latest`, are as they were, and nothing partial is left.
cp -r "$work/base" "$work/unwritable"
echo checkpoint-000004 > "$work/unwritable/latest"
rm -rf "$work/unwritable/checkpoint-000008"
(
  ulimit -f 20000
  exec "$train" "${args[@]}" --steps 8 --checkpoint-every 4 --out "$work/unwritable" --resume > /dev/null 2> "$work/unwritable.err"
)
rc=$?
if [[ $rc -ne 2 ]] || ! grep -q "optimizer.safetensors.tmp-[0-9]*: cannot write: File too large" "$work/unwritable.err" ||
   ! grep -q "while saving step 8's checkpoint: the run stops; .*unwritable/checkpoint-000004 is as it was (--resume continues from it)" "$work/unwritable.err" ||
   [[ "$(cat "$work/unwritable/latest")" != checkpoint-000004 ]] || compgen -G "$work/unwritable/checkpoint-000008*" > /dev/null ||
   ! cmp -s "$work/base/checkpoint-000004/optimizer.safetensors" "$work/unwritable/checkpoint-000004/optimizer.safetensors"; then
  fail "checkpoint-unwritable: exit $rc, latest $(cat "$work/unwritable/latest")" "$work/unwritable.err"
else
  echo "ok   checkpoint-unwritable: $(tr '\n' ' ' < "$work/unwritable.err")"
fi
# A full disk: a 60 MiB tmpfs holds the corpus and one 45 MiB checkpoint, not a second beside it.
# The second is refused before a byte is written, naming what it needs and what is free (it had
# been written until the disk was full, the error naming no sizes). Where a tmpfs can be mounted
# in a private mount namespace (root, or user namespaces); the checks run inside it.
if unshare -rm true 2> /dev/null || unshare -m true 2> /dev/null; then
  mkdir -p "$work/small"
  userns=-r
  unshare -rm true 2> /dev/null || userns=
  unshare $userns -m bash -c '
    mount -t tmpfs -o size=60m tmpfs "$2" || exit 77
    "$1" --backend host --seq 64 --log-every 100 --steps 8 --checkpoint-every 4 --out "$2/run" > /dev/null 2> "$3/full-disk.err"
    echo $? > "$3/full-disk.rc"
    cat "$2/run/latest" > "$3/full-disk.latest"
    ls -a "$2/run" > "$3/full-disk.ls"' _ "$train" "$work/small" "$work"
  if [[ $? -eq 77 ]]; then
    echo "skip checkpoint-disk-full: no tmpfs mount here"
  elif [[ "$(cat "$work/full-disk.rc")" != 2 ]] ||
       ! grep -q "checkpoint-000008 needs at least 45.12 MiB (the fp32 weights and two moments of 3942912 parameters), its file system has [0-9.]* MiB free" "$work/full-disk.err" ||
       ! grep -q "the run stops; .*checkpoint-000004 is as it was" "$work/full-disk.err" ||
       [[ "$(cat "$work/full-disk.latest")" != checkpoint-000004 ]] || grep -q "checkpoint-000008" "$work/full-disk.ls"; then
    fail "checkpoint-disk-full: exit $(cat "$work/full-disk.rc"), latest $(cat "$work/full-disk.latest")" "$work/full-disk.err" "$work/full-disk.ls"
  else
    echo "ok   checkpoint-disk-full: $(tr '\n' ' ' < "$work/full-disk.err")"
  fi
else
  echo "skip checkpoint-disk-full: no private mount namespace here"
fi

# A metrics line that cannot be written: a file-size limit of 4 KiB (EFBIG; SIGXFSZ ignored by oom-train).
data="$work/base/builtin-corpus.tok"
(
  ulimit -f 4
  exec "$train" "${args[@]}" --steps 40 --checkpoint-every 0 --data "$data" --out "$work/full" > /dev/null 2> "$work/full.err"
)
rc=$?
if [[ $rc -ne 2 ]] || ! grep -q "metrics.jsonl: step [0-9]*'s line could not be written" "$work/full.err"; then
  fail "metrics-unwritable: exit $rc" "$work/full.err"
else
  echo "ok   metrics-unwritable: $(cat "$work/full.err")"
fi

# corpus_resumes NAME STEPS WARNING: the copy of base in $work/NAME, its built-in corpus damaged by
# the caller, resumes to STEPS with WARNING said, to the loss the undamaged base resumes to.
corpus_resumes() {
  local name=$1 steps=$2 warning=$3 rc
  "$train" "${args[@]}" --steps "$steps" --checkpoint-every 0 --out "$work/$name" --resume > /dev/null 2> "$work/$name.err"
  rc=$?
  "$train" "${args[@]}" --steps "$steps" --checkpoint-every 0 --out "$work/base" --resume > /dev/null 2>&1
  local loss='s/.*"loss":([0-9.e+-]+).*/\1/'
  if [[ $rc -ne 0 ]] || ! grep -q "$warning" "$work/$name.err" ||
     [[ "$(tail -1 "$work/$name/metrics.jsonl" | sed -E "$loss")" != "$(tail -1 "$work/base/metrics.jsonl" | sed -E "$loss")" ]]; then
    fail "$name: exit $rc, or other losses than the undamaged run's" "$work/$name.err"
  else
    echo "ok   $name: $(cat "$work/$name.err")"
  fi
}
# A damaged built-in corpus (it is generated) is written again with a warning, and the run resumes
# on the same tokens as an uninterrupted one (it had stopped on the header error).
cp -r "$work/base" "$work/damaged-builtin-corpus"
truncate -s 1000 "$work/damaged-builtin-corpus/builtin-corpus.tok"
corpus_resumes damaged-builtin-corpus 10 "warning: the built-in corpus .*builtin-corpus.tok is damaged (.*); writing it again (the same tokens)"
# Damage that leaves the file readable (tokens changed, all within the vocabulary): the resume sees
# other tokens and writes the corpus again (it had advised passing "the file it was trained on").
cp -r "$work/base" "$work/altered-builtin-corpus"
python3 -c "import sys; f = open(sys.argv[1], 'r+b'); f.seek(1 << 20); f.write(b'A\\x00' * 4096)" "$work/altered-builtin-corpus/builtin-corpus.tok"
corpus_resumes altered-builtin-corpus 11 "warning: the built-in corpus .* holds other tokens than .* was trained on; writing it again"

if ((fails > 0)); then
  echo "FAILED: $fails case(s)"
  exit 1
fi
echo "PASS: one run a directory; bad requests leave the run as it was; trainer_state checked; metrics write errors stop the run"
