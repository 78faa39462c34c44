#!/usr/bin/env python3
"""Per-kind span statistics of a recorded step's Chrome trace (oom-custom-layer --trace,
oom-train --trace-step): for each resource, its spans grouped by name with the layer number
dropped, with their count, total and median milliseconds.
Usage: trace_summary.py TRACE.json [...]"""
import json
import re
import statistics
import sys


def fail(path, why):
    sys.exit(f"trace_summary.py: {path}: {why}")


def read_events(path):
    try:
        with open(path) as f:
            trace = json.load(f)
    except FileNotFoundError:
        fail(path, "no such file")
    except OSError as e:
        fail(path, e.strerror or str(e))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        fail(path, f"not JSON ({e})")
    events = trace if isinstance(trace, list) else trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        fail(path, "not a Chrome trace (no traceEvents list): oom-train --trace-step and oom-custom-layer --trace write one")
    return [e for e in events if isinstance(e, dict)]


def summarise(path):
    events = read_events(path)
    threads = {e.get("tid"): (e.get("args") or {}).get("name", str(e.get("tid")))
               for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    groups = {}
    for e in events:
        if e.get("ph") != "X" or not isinstance(e.get("dur"), (int, float)):
            continue
        kind = re.sub(r"\b\d+\b", "N", str(e.get("name", "")))
        groups.setdefault((threads.get(e.get("tid"), str(e.get("tid"))), kind), []).append(e["dur"] / 1e3)
    print(path)
    for (thread, kind), ms in sorted(groups.items()):
        print(f"  {thread:12s} {kind:40s} {len(ms):4d} spans, {sum(ms):9.3f} ms, median {statistics.median(ms):8.3f} ms")


if len(sys.argv) < 2:
    sys.exit(__doc__.strip())
for p in sys.argv[1:]:
    summarise(p)
