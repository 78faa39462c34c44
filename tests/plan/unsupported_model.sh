#!/usr/bin/env bash
# oom-plan on a model this build's oom-train cannot run (tiny-moe with a dense MLP in layer 1: no
# executor takes it) still plans it, and says that nothing would run it: a host-only build in a
# note before the plans naming the layer and the feature, a CUDA build in its "would run: nothing"
# line. A model it runs gets no such note.
#   bash tests/plan/unsupported_model.sh path/to/oom-plan path/to/examples/configs/tiny-moe.json host|cuda
set -uo pipefail
plan=$1 config=$2 build=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fails=0
fail() { echo "FAIL $*"; fails=$((fails + 1)); }
python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); c["mlp_only_layers"] = [1]; json.dump(c, open(sys.argv[2], "w"))' \
  "$config" "$work/dense.json" || exit 1
"$plan" --model "$work/dense.json" --seq 64 --candidates 1 > "$work/dense.out" 2> "$work/dense.err"
rc=$?
[[ $rc -eq 0 ]] || fail "dense layer: exit $rc (want 0: the plan is still made): $(cat "$work/dense.err")"
grep -q '^=== plan 1 (chosen) ===' "$work/dense.out" || fail "dense layer: no plan printed"
if [[ $build == host ]]; then
  note="note: this build's oom-train (host backend only) cannot train this model: HostDecoderLayer: layer 1 has a dense MLP"
  grep -qF "$note" "$work/dense.out" || fail "dense layer: no note '$note...'"
  # The note comes before the plans, where it is read.
  [[ $(grep -n -m1 -F "$note" "$work/dense.out" | cut -d: -f1) -lt $(grep -n -m1 '^=== plan 1' "$work/dense.out" | cut -d: -f1) ]] ||
    fail "dense layer: the note follows the plans"
else
  grep -q '^oom-train --backend cuda would run: nothing (' "$work/dense.out" || fail "dense layer: no 'would run: nothing' line"
fi
"$plan" --model "$config" --seq 64 --candidates 1 > "$work/ok.out" 2>&1 || fail "tiny-moe: exit $?: $(tail -2 "$work/ok.out")"
! grep -q "cannot train this model" "$work/ok.out" || fail "tiny-moe: a note that it cannot be trained: $(grep 'cannot train' "$work/ok.out")"
((fails == 0)) || exit 1
echo "PASS: a model no executor of this $build build runs is planned and said to be unrunnable"
