#!/usr/bin/env python3
"""The SASS lines with the most warp-stall samples, from `ncu -i REPORT --page source --csv
--print-source sass` (scripts/profile-attention.sh). Column names differ between Nsight Compute
versions, so they are found by their words: the sampling column ("Warp Stall Sampling (All
Samples)"), the source text ("Source"), the address; and any per-reason stall columns, of which
the three largest are shown per line.

    python3 scripts/diag/ncu_top_stalls.py source.csv [N]
"""
import csv
import sys


def number(text):
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def main():
    if len(sys.argv) < 2:
        sys.exit("usage: ncu_top_stalls.py SOURCE.csv [N]")
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    with open(sys.argv[1], newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    # The header is the first row naming a source column; ncu may print a kernel line before it.
    head_at = next((i for i, r in enumerate(rows) if any(c.strip() == "Source" for c in r)), None)
    if head_at is None:
        sys.exit(f"{sys.argv[1]}: no header with a 'Source' column (is it --page source --csv output?)")
    head, body = rows[head_at], rows[head_at + 1:]
    col = {name.strip(): i for i, name in enumerate(head)}
    samples = next((i for n, i in col.items() if "Sampling" in n and "All" in n), None)
    if samples is None:
        samples = next((i for n, i in col.items() if "Sampling" in n), None)
    if samples is None:
        sys.exit(f"no warp stall sampling column among: {', '.join(col)}")
    source, address = col["Source"], col.get("Address")
    reasons = [i for n, i in col.items() if n.lower().startswith("stall") or "stall_" in n.lower()]
    lines = [r for r in body if len(r) > samples and number(r[samples]) is not None]
    total = sum(number(r[samples]) for r in lines) or 1.0
    lines.sort(key=lambda r: number(r[samples]), reverse=True)
    print(f"{len(lines)} SASS lines, {total:.0f} stall samples; the top {top} ({head[samples].strip()}):")
    for r in lines[:top]:
        why = sorted(((number(r[i]) or 0.0, head[i].strip()) for i in reasons if i < len(r)), reverse=True)[:3]
        why_text = ", ".join(f"{n} {v:.0f}" for v, n in why if v > 0)
        where = r[address] if address is not None and address < len(r) else ""
        print(f"{100 * number(r[samples]) / total:5.1f}%  {where:>8}  {r[source].strip()[:90]}" + (f"  [{why_text}]" if why_text else ""))


if __name__ == "__main__":
    main()
