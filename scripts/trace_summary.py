#!/usr/bin/env python3
"""Per-kind span statistics of a recorded step's Chrome trace (oom-custom-layer --trace,
oom-train --trace-step): for each resource, its spans grouped by name with the layer number
dropped, with their count, total and median milliseconds.
Usage: trace_summary.py TRACE.json [...]"""
import json
import re
import statistics
import sys


def summarise(path):
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    threads = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    groups = {}
    for e in events:
        if e.get("ph") != "X":
            continue
        kind = re.sub(r"\b\d+\b", "N", e["name"])
        groups.setdefault((threads.get(e["tid"], str(e["tid"])), kind), []).append(e["dur"] / 1e3)
    print(path)
    for (thread, kind), ms in sorted(groups.items()):
        print(f"  {thread:12s} {kind:40s} {len(ms):4d} spans, {sum(ms):9.3f} ms, median {statistics.median(ms):8.3f} ms")


for p in sys.argv[1:]:
    summarise(p)
