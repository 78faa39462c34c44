#!/usr/bin/env python3
"""Writes the binary seed inputs in corpus/safetensors and corpus/token_file (run once; the outputs
are committed). Standard library only: the layouts are those of the safetensors reference writer
and of include/oom/io/token_file.hpp."""
import json
import os
import struct

here = os.path.dirname(os.path.abspath(__file__))
SIZES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "U32": 4, "BF16": 2, "F16": 2, "U16": 2, "F8_E4M3": 1, "U8": 1}


def safetensors(tensors, metadata=None):
    """tensors: list of (name, dtype, shape), written in the given order with patterned bytes."""
    header, data, offset = {}, b"", 0
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape in tensors:
        n = SIZES[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        data += bytes((offset + i) * 37 % 251 for i in range(n))
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + data


def token_file(tokens, vocab, width, documents=0):
    head = b"OOMTOK01" + struct.pack("<IIQQQ", 1, width, vocab, len(tokens), documents) + bytes(24)
    return head + struct.pack("<%d%s" % (len(tokens), "H" if width == 2 else "I"), *tokens)


def put(sub, name, blob):
    with open(os.path.join(here, "corpus", sub, name), "wb") as f:
        f.write(blob)


put("safetensors", "empty.safetensors", safetensors([]))
put("safetensors", "tiny.safetensors",
    safetensors([("scalar", "I64", []), ("w", "F32", [2, 3]), ("b", "BF16", [3]), ("none", "F32", [0, 4])],
                {"format": "pt"}))
put("safetensors", "tiny-moe-names.safetensors",
    safetensors([("model.embed_tokens.weight", "BF16", [4, 2]),
                 ("model.layers.0.mlp.gate.weight", "BF16", [2, 2]),
                 ("model.layers.0.mlp.experts.0.gate_proj.weight", "BF16", [1, 2]),
                 ("model.layers.0.mlp.experts.gate_up_proj", "BF16", [2, 2, 2]),
                 ("model.norm.weight", "F32", [2]), ("lm_head.weight", "U8", [3])]))
put("token_file", "u16.tok", token_file([i * 7 % 256 for i in range(40)], 256, 2, 3))
put("token_file", "u32.tok", token_file([i * 4099 % 70000 for i in range(20)], 70000, 4))
put("token_file", "short.tok", token_file([1, 2], 3, 2))
