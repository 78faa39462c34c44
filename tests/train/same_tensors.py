#!/usr/bin/env python3
"""same_tensors.py A B: exit 0 when two checkpoint safetensors files are the same bytes but for the
save id each save writes into its metadata ("save", which names one save), else say where they
differ and exit 1. The runs' checkpoints are compared bit for bit this way."""
import json
import struct
import sys


def masked(path):
    with open(path, "rb") as f:
        data = bytearray(f.read())
    (n,) = struct.unpack("<Q", data[:8])
    save = json.loads(data[8 : 8 + n]).get("__metadata__", {}).get("save", "")
    if save:
        at = data.find(save.encode(), 8, 8 + n)
        data[at : at + len(save)] = b"0" * len(save)
    return bytes(data)


a, b = (masked(p) for p in sys.argv[1:3])
if a != b:
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    print(f"{sys.argv[1]} {sys.argv[2]} differ: byte {first + 1} (sizes {len(a)}, {len(b)}; save ids aside)")
    sys.exit(1)
