#!/usr/bin/env python3
"""Loads a safetensors file with the reference reader (safetensors.torch.load_file) and prints each
tensor's name, shape and dtype. With --config, also loads it as transformers does a checkpoint
(from_pretrained on a directory holding the config and the file, which converts Hub layouts such as
per-expert MoE weights into the model's own) and fails on any missing, unexpected or misshaped
tensor, on any value that did not arrive unchanged, or on a non-finite forward pass.

  python3 scripts/check_safetensors.py build/tests/tiny-moe.safetensors --config examples/configs/tiny-moe.json

build/tests/tiny-moe.safetensors is written by the host test test_io_files. Needs torch and
safetensors; --config also needs transformers. Exit status 1 on any mismatch.
"""
import argparse
import os
import re
import shutil
import sys
import tempfile

from safetensors import safe_open
from safetensors.torch import load_file


def check_with_transformers(path, config_path, tensors):
    import torch
    import transformers

    with tempfile.TemporaryDirectory() as d:
        shutil.copy(config_path, os.path.join(d, "config.json"))
        os.symlink(os.path.abspath(path), os.path.join(d, "model.safetensors"))
        try:
            model, info = transformers.AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
        except (RuntimeError, ValueError, OSError) as e:  # transformers 5 raises on a misshaped tensor
            print(f"FAIL: transformers {transformers.__version__} cannot load {path}: {e}")
            return False
    problems = [f"{kind} {k}" for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")
                for k in info.get(kind, [])]
    # Each file tensor must arrive unchanged: under its own name, or as its slice of a packed
    # expert tensor (transformers >= 5 stores experts as experts.gate_up_proj / experts.down_proj).
    state = model.state_dict()
    for name, t in tensors.items():
        if name in state:
            got = state[name]
        elif m := re.fullmatch(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", name):
            e = int(m.group(2))
            if m.group(3) == "down_proj":
                got = state[m.group(1) + ".down_proj"][e]
            else:
                packed = state[m.group(1) + ".gate_up_proj"][e]
                half = packed.shape[0] // 2
                got = packed[:half] if m.group(3) == "gate_proj" else packed[half:]
        else:
            problems.append(f"not found in the model: {name}")
            continue
        if tuple(got.shape) != tuple(t.shape) or not torch.equal(got.float(), t.float()):
            problems.append(f"value differs after loading: {name}")
    for p in problems:
        print("FAIL", p)
    with torch.no_grad():
        ids = torch.arange(16).remainder(model.config.vocab_size).unsqueeze(0)
        logits = model(input_ids=ids).logits
    if not bool(torch.isfinite(logits).all()):
        problems.append("non-finite logits")
    print(f"{'FAIL' if problems else 'OK'}: {len(tensors)} tensors into {type(model).__name__} "
          f"(transformers {transformers.__version__}), forward logits {list(logits.shape)}")
    return not problems


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--config", help="config.json of the transformers model the file must load into")
    ap.add_argument("--quiet", action="store_true", help="print only the summary and problems")
    args = ap.parse_args()
    tensors = load_file(args.file)
    with safe_open(args.file, framework="pt") as f:
        metadata = f.metadata()
    if not args.quiet:
        for name, t in tensors.items():
            print(f"{name}\t{list(t.shape)}\t{str(t.dtype).removeprefix('torch.')}")
    print(f"{args.file}: {len(tensors)} tensors, {sum(t.numel() for t in tensors.values())} parameters, "
          f"metadata {metadata}")
    if args.config and not check_with_transformers(args.file, args.config, tensors):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
