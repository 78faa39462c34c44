date
PARTS=peers PEERS="4096:2" PEER_MODES="plain" PEER_STEPS=4 TIME_BUDGET=130 bash scripts/gpu-check.sh > $OUT/check.log 2>&1
echo "rc $?"
tail -6 $OUT/check.log
for f in build-gpu/gpu-logs/peer-*.log; do echo "== $f"; grep -E "^step|steps 2|out of|Error|error|Traceback" $f | cut -c1-60 | tail -7; done
date
