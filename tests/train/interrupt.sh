#!/usr/bin/env bash
# SIGINT (Ctrl-C) and SIGTERM stop a run after the step in flight with a checkpoint of that step
# (and --dump-batches' windows of the steps run), exit 130, and the resumed run logs the same losses, bit for bit, as the run left alone (host
# backend); a second signal ends the run at once, leaving no checkpoint `latest` would name
# half-written, also when the signals come while a checkpoint is written. Usage: interrupt.sh path/to/oom-train
set -euo pipefail
train="$1"
work="$(realpath "$(mktemp -d)")"  # resolved: strace -P below matches the path the run opens
trap 'rm -rf "$work"' EXIT
args=(--backend host --seq 64 --steps 16 --checkpoint-every 100 --log-every 100)

# wait_for FILE PATTERN PID: until FILE holds PATTERN (the run still going), at most 60 s.
wait_for() {
  for _ in $(seq 1 6000); do
    grep -qs -- "$2" "$1" && return 0
    kill -0 "$3" 2> /dev/null || { echo "FAIL: the run ended before '$2' appeared in $1"; cat "$1"; exit 1; }
    sleep 0.01
  done
  echo "FAIL: '$2' did not appear in $1 within 60 s"; exit 1
}

"$train" "${args[@]}" --out "$work/straight" > /dev/null

for sig in INT TERM; do
  run="$work/$sig"
  "$train" "${args[@]}" --out "$run" --dump-batches "$work/$sig.tok" > "$work/$sig.log" 2> "$work/$sig.err" &
  pid=$!
  wait_for "$run/metrics.jsonl" '"step":4,' "$pid"
  kill "-$sig" "$pid"
  rc=0
  wait "$pid" || rc=$?
  at=$(wc -l < "$run/metrics.jsonl")
  [[ $rc -eq 130 ]] || { echo "FAIL: SIG$sig: exit $rc, not 130"; cat "$work/$sig.err"; exit 1; }
  grep -q "interrupted by signal .* after step $at; resume with --resume" "$work/$sig.err" ||
    { echo "FAIL: SIG$sig: no 'interrupted ... after step $at'"; cat "$work/$sig.err"; exit 1; }
  [[ "$(cat "$run/latest")" == "$(printf 'checkpoint-%06d' "$at")" ]] ||
    { echo "FAIL: SIG$sig: latest is '$(cat "$run/latest")' after step $at"; exit 1; }
  # --dump-batches writes the windows of the steps run (the flag is refused with --resume: they had
  # been lost).
  grep -q "^$at windows of 65 tokens written to $work/$sig.tok (the steps up to $at, where the run was interrupted)" "$work/$sig.log" &&
    [[ -s "$work/$sig.tok" ]] || { echo "FAIL: SIG$sig: the windows of its $at steps were not written"; cat "$work/$sig.log"; exit 1; }
  "$train" "${args[@]}" --out "$run" --resume > "$work/$sig.resumed.log"
  loss() { sed -E 's/.*"step":([0-9]+).*"loss":([^,]+),.*/\1 \2/' "$1"; }
  diff <(loss "$work/straight/metrics.jsonl") <(loss "$run/metrics.jsonl") > /dev/null ||
    { echo "FAIL: SIG$sig: the resumed run's losses differ from the uninterrupted run's"; exit 1; }
  python3 "$(dirname "$0")/same_tensors.py" "$work/straight/checkpoint-000016/model.safetensors" "$run/checkpoint-000016/model.safetensors"
  echo "ok   SIG$sig after step $at: exit 130, checkpoint-$(printf '%06d' "$at"), resumed to the same 16 losses and weights"
done

# A signal while a checkpoint is written (strace delivers SIGTERM as step 8's save fsyncs its
# directory, after model.safetensors): the first lets the save finish and then stops with that
# checkpoint (130); a second, at the next fsync, ends the run mid-save (143), leaving a .partial
# that `latest` does not name beside step 4's checkpoint. Either resumes to the same losses and
# weights, and the .partial is removed by the next save.
if command -v strace > /dev/null && strace -o /dev/null true 2> /dev/null; then
  for when in 1 1+; do
    run="$work/mid-save-$when"
    want_rc=130 want_latest=checkpoint-000008
    [[ $when == 1+ ]] && want_rc=143 want_latest=checkpoint-000004
    rc=0
    (strace -f -o /dev/null -P "$run/checkpoint-000008.partial" -e trace=fsync -e signal=none -e "inject=fsync:signal=TERM:when=$when" \
       "$train" "${args[@]}" --checkpoint-every 4 --out "$run"; exit $?) > /dev/null 2> "$work/mid-save.err" || rc=$?
    partial=absent
    [[ -d "$run/checkpoint-000008.partial" ]] && partial=left
    if [[ $rc -ne $want_rc ]] || [[ "$(cat "$run/latest")" != "$want_latest" ]] ||
       [[ $partial != "$([[ $when == 1+ ]] && echo left || echo absent)" ]]; then
      echo "FAIL: SIGTERM mid-save (when=$when): exit $rc, latest $(cat "$run/latest"), .partial $partial"; cat "$work/mid-save.err"; exit 1
    fi
    "$train" "${args[@]}" --checkpoint-every 4 --out "$run" --resume > /dev/null
    loss() { sed -E 's/.*"step":([0-9]+).*"loss":([^,]+),.*/\1 \2/' "$1"; }
    diff <(loss "$work/straight/metrics.jsonl") <(loss "$run/metrics.jsonl") > /dev/null ||
      { echo "FAIL: SIGTERM mid-save (when=$when): the resumed run's losses differ"; exit 1; }
    python3 "$(dirname "$0")/same_tensors.py" "$work/straight/checkpoint-000016/model.safetensors" "$run/checkpoint-000016/model.safetensors"
    [[ ! -e "$run/checkpoint-000008.partial" ]] || { echo "FAIL: SIGTERM mid-save (when=$when): the .partial is still there"; exit 1; }
    echo "ok   SIGTERM$([[ $when == 1+ ]] && echo ' twice') mid-save: exit $rc, latest $want_latest, .partial $partial; resumed to the same 16 losses and weights"
  done
else
  echo "skip SIGTERM mid-save: no working strace"
fi

# A reader that goes away: `oom-train | tee run.log` and Ctrl-C end tee at once, and the run's
# next line went into a closed pipe whose SIGPIPE killed it without its checkpoint. The run now
# goes on without printing, and the signal still stops it with a checkpoint.
mkfifo "$work/pipe"
"$train" --backend host --seq 64 --steps 100000 --checkpoint-every 100000 --log-every 1 --out "$work/piped" \
  > "$work/pipe" 2> "$work/piped.err" &  # (many steps: the signal must come before the end on a loaded machine)
pid=$!
head -c 1 "$work/pipe" > /dev/null  # one byte, then the reading end closes
wait_for "$work/piped/metrics.jsonl" '"step":4,' "$pid"
kill -INT "$pid"
rc=0
wait "$pid" || rc=$?
at=$(wc -l < "$work/piped/metrics.jsonl")
if [[ $rc -ne 130 ]] || [[ "$(cat "$work/piped/latest" 2> /dev/null)" != "$(printf 'checkpoint-%06d' "$at")" ]] ||
   ! grep -q "writing to standard output failed (Broken pipe); the run goes on" "$work/piped.err"; then
  echo "FAIL: a closed standard output: exit $rc, latest $(cat "$work/piped/latest" 2> /dev/null || echo absent) after step $at"
  cat "$work/piped.err"; exit 1
fi
echo "ok   a closed standard output: the run went on to step $at, and SIGINT stopped it with its checkpoint (exit 130)"

# Twice: the second ends the run at once (the default action), mid-step, with no checkpoint of it.
"$train" --backend host --seq 512 --steps 100 --checkpoint-every 100 --log-every 100 --out "$work/twice" \
  > /dev/null 2> "$work/twice.err" &
pid=$!
wait_for "$work/twice/metrics.jsonl" '"step":1,' "$pid"
kill -INT "$pid"
wait_for "$work/twice.err" "signal again to stop at once" "$pid"
kill -INT "$pid"
rc=0
wait "$pid" || rc=$?
if [[ $rc -ne 130 ]] || grep -q "interrupted by signal" "$work/twice.err" || [[ -e "$work/twice/latest" ]]; then
  echo "FAIL: a second SIGINT: exit $rc, latest $(cat "$work/twice/latest" 2> /dev/null || echo absent)"; cat "$work/twice.err"; exit 1
fi
echo "ok   a second SIGINT ended the run at once (exit $rc, no checkpoint)"
echo "PASS: SIGINT and SIGTERM stop with a checkpoint and resume bit for bit, also with standard output closed; a second signal stops at once"
