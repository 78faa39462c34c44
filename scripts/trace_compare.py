#!/usr/bin/env python3
"""Measured against predicted, op by op: the two Chrome traces `oom-train --trace-step N` writes
(trace-step-N.json, what the GPU did; trace-step-N.predicted.json, the planner's simulation of the
same plan).

Each decoder layer's passes are paired by name: the planner's "fwd.attention L3" with the
executor's "fwd.attention layers.3" (the CUDA executor splits every layer call at its halves:
fwd.attention / fwd.mlp, bwd.mlp / bwd.attention, recompute.attention / recompute.mlp), and the
whole pass ("fwd", "bwd", "recompute") against the sum of the planner's ops of that pass (its
"regenerate boundaries up to L<n>", reruns of earlier layers, is left out). Prints one
row per layer and pass, then the totals over the layers, then the model's ends (the loss: LM head
and cross-entropy; the embedding forward and backward), each with measured / predicted: a ratio
above 1 is time the cost model does not see.

Usage: trace_compare.py TRACE [PREDICTED] [--layers]
  TRACE       trace-step-N.json; PREDICTED defaults to the same name with .predicted.json
  --layers    also print every layer's rows (default: the totals only)
"""
import argparse
import json
import re
import sys
from collections import defaultdict

# The passes of a decoder layer, each with its halves as the planner names its ops.
PASSES = {
    "fwd": ("fwd.attention", "fwd.mlp"),
    "bwd": ("bwd.mlp", "bwd.attention"),
    "recompute": ("recompute",),  # the planner prices a recompute as one op
}
# The model's ends, outside the layers: the executor's span name and the planner's op name.
ENDS = (("loss", "loss", "loss (LM head + cross-entropy)"), ("embedding", "embedding", "fwd.embedding"),
        ("embedding backward", "embedding backward", "bwd.embedding"))
MEASURED = re.compile(r"^(?P<op>fwd|bwd|recompute)(?P<half>\.attention|\.mlp)?(?: \([^)]*\))? layers\.(?P<layer>\d+)$")
PREDICTED = re.compile(r"^(?P<op>[a-z0-9_.]+) L(?P<layer>\d+)$")


def spans(path):
    """(name, seconds) of every complete event on a resource track of a Chrome trace."""
    try:
        with open(path, encoding="utf-8") as f:
            events = json.load(f)["traceEvents"]
    except FileNotFoundError:
        sys.exit(f"trace_compare: {path}: no such file")
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        sys.exit(f"trace_compare: {path}: not a Chrome trace with traceEvents ({e})")
    host_tracks = {e.get("tid") for e in events if e.get("ph") == "M" and "host" in str(e.get("args", {}).get("name", ""))}
    return [(e.get("name", ""), e.get("dur", 0) / 1e6) for e in events if e.get("ph") == "X" and e.get("tid") not in host_tracks]


def measured_times(path):
    """{(layer, op): seconds} from the executor's trace: op is a half (fwd.attention) or a pass (fwd)."""
    out = defaultdict(float)
    for name, s in spans(path):
        m = MEASURED.match(name)
        if m:
            out[(int(m["layer"]), m["op"] + (m["half"] or ""))] += s
    return out


def predicted_times(path):
    """{(layer, op): seconds} from the planner's simulated trace; each pass also as its halves' sum."""
    out = defaultdict(float)
    for name, s in spans(path):
        m = PREDICTED.match(name)
        if not m:
            continue
        layer, op = int(m["layer"]), m["op"]
        for pass_name, halves in PASSES.items():
            if op in halves:
                out[(layer, op)] += s
                if op != pass_name:
                    out[(layer, pass_name)] += s
    return out


def ends_times(measured_path, predicted_path):
    """[(row name, measured s or None, predicted s or None)] of the model's ends (the loss, the
    embedding forward and backward); the planner's loss op carries a layer suffix (L<n>)."""
    m_spans, p_spans = spans(measured_path), spans(predicted_path)
    out = []
    for row, m_name, p_name in ENDS:
        m = [s for n, s in m_spans if n == m_name]
        p = [s for n, s in p_spans if n == p_name or re.fullmatch(re.escape(p_name) + r" L\d+", n)]
        if m or p:
            out.append((row, sum(m) if m else None, sum(p) if p else None))
    return out


def rows(measured, predicted):
    """[(layer, op, measured s or None, predicted s or None)] in layer, then pass, order."""
    ops = ["fwd", "fwd.attention", "fwd.mlp", "bwd", "bwd.mlp", "bwd.attention", "recompute", "recompute.attention", "recompute.mlp"]
    layers = sorted({l for l, _ in measured} | {l for l, _ in predicted})
    out = []
    for l in layers:
        for op in ops:
            m, p = measured.get((l, op)), predicted.get((l, op))
            if m is not None or p is not None:
                out.append((l, op, m, p))
    return out


def fmt_s(x):
    return "-" if x is None else f"{x * 1e3:.3f}"


def ratio(m, p):
    return "-" if m is None or p is None or p <= 0 else f"{m / p:.2f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("predicted", nargs="?")
    ap.add_argument("--layers", action="store_true")
    a = ap.parse_args(argv)
    predicted_path = a.predicted or re.sub(r"\.json$", "", a.trace) + ".predicted.json"
    if a.trace.endswith(".predicted.json"):
        sys.exit(f"trace_compare: {a.trace} is the prediction; give the measured trace (trace-step-N.json)")
    measured, predicted = measured_times(a.trace), predicted_times(predicted_path)
    if not measured:
        sys.exit(f"trace_compare: {a.trace} has no decoder layer spans (fwd/bwd/recompute layers.N)")
    if not predicted:
        sys.exit(f"trace_compare: {predicted_path} has no decoder layer ops (fwd.attention L<n>, ...)")
    table = rows(measured, predicted)
    print(f"{'layer':>5}  {'op':<20} {'measured ms':>12} {'predicted ms':>13} {'meas/pred':>9}")
    if a.layers:
        for l, op, m, p in table:
            print(f"{l:>5}  {op:<20} {fmt_s(m):>12} {fmt_s(p):>13} {ratio(m, p):>9}")
    totals = defaultdict(lambda: [None, None])
    for _, op, m, p in table:
        t = totals[op]
        if m is not None:
            t[0] = (t[0] or 0) + m
        if p is not None:
            t[1] = (t[1] or 0) + p
    for op, (m, p) in totals.items():
        print(f"{'all':>5}  {op:<20} {fmt_s(m):>12} {fmt_s(p):>13} {ratio(m, p):>9}")
    for op, m, p in ends_times(a.trace, predicted_path):
        print(f"{'ends':>5}  {op:<20} {fmt_s(m):>12} {fmt_s(p):>13} {ratio(m, p):>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
