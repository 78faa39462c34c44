#!/usr/bin/env python3
"""Loads a safetensors file with the reference reader (safetensors.torch.load_file) and prints each
tensor's name, shape and dtype. With --config, also builds the transformers model of that
config.json and checks the file against the model's state dict: same names, same shapes, then a
strict load_state_dict and one forward pass. Exit status 1 on any mismatch.

  python3 scripts/check_safetensors.py build/tests/tiny-moe.safetensors --config examples/configs/tiny-moe.json

The tiny-moe file is written by the host test test_io_files (tests/io/test_safetensors.cpp).
Needs torch and safetensors; --config also needs transformers.
"""
import argparse
import json
import sys

from safetensors import safe_open
from safetensors.torch import load_file


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--config", help="config.json whose transformers model the file must match")
    ap.add_argument("--quiet", action="store_true", help="print only the summary and mismatches")
    args = ap.parse_args()

    tensors = load_file(args.file)
    with safe_open(args.file, framework="pt") as f:
        metadata = f.metadata()
    if not args.quiet:
        for name, t in tensors.items():
            print(f"{name}\t{list(t.shape)}\t{str(t.dtype).removeprefix('torch.')}")
    total = sum(t.numel() for t in tensors.values())
    print(f"{args.file}: {len(tensors)} tensors, {total} parameters, metadata {metadata}")
    if not args.config:
        return 0

    import torch
    import transformers

    with open(args.config) as f:
        cfg = json.load(f)
    config = transformers.AutoConfig.for_model(**cfg)
    model = transformers.AutoModelForCausalLM.from_config(config)
    expected = {k: v for k, v in model.state_dict().items()}
    # A tied LM head appears in the state dict but not in the checkpoint.
    if getattr(config, "tie_word_embeddings", False):
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = sorted(n for n in set(expected) & set(tensors) if tuple(expected[n].shape) != tuple(tensors[n].shape))
    for n in missing:
        print(f"MISSING   {n} {list(expected[n].shape)}")
    for n in unexpected:
        print(f"UNEXPECTED {n} {list(tensors[n].shape)}")
    for n in wrong:
        print(f"SHAPE     {n}: file {list(tensors[n].shape)}, model {list(expected[n].shape)}")
    if missing or unexpected or wrong:
        print(f"FAIL: {len(missing)} missing, {len(unexpected)} unexpected, {len(wrong)} misshaped "
              f"({type(model).__name__}, transformers {transformers.__version__})")
        return 1
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in tensors.items()},
                          strict=not getattr(config, "tie_word_embeddings", False))
    with torch.no_grad():
        ids = torch.arange(16).remainder(config.vocab_size).unsqueeze(0)
        logits = model(input_ids=ids).logits
    finite = bool(torch.isfinite(logits).all())
    print(f"OK: {len(tensors)} tensors match {type(model).__name__} (transformers {transformers.__version__}); "
          f"forward logits {list(logits.shape)}, finite={finite}")
    return 0 if finite else 1


if __name__ == "__main__":
    sys.exit(main())
