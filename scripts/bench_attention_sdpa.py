#!/usr/bin/env python3
"""PyTorch SDPA on the shapes of bench/kernels/bench_attention.cpp, printing the same table.

Causal GQA attention, B=1, Hq=16, Hkv=4, bf16, S = 4K, 16K, 32K, 128K. FLOPs counted as
bench_attention does: causal forward = 2*B*Hq*S*S*D, backward = 2.5x, forward+backward = 3.5x.
SDPA takes (B, H, S, D) tensors; they are made as transposed views of (B, S, H, D) so the memory
layout matches the OOM kernels' (tokens outer, heads inner).

    python3 scripts/bench_attention_sdpa.py [--head-dim 128] [--repeats 10]
"""
import argparse

import torch
import torch.nn.functional as F


def time_ms(fn, repeats, warmup=1):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    batch, hq, hkv, d = 1, 16, 4, args.head_dim
    dev = torch.device("cuda")
    print(f"torch {torch.__version__} SDPA, causal, B={batch} Hq={hq} Hkv={hkv} D={d}, {torch.cuda.get_device_name()}")
    print(f"{'S':>8} {'fwd_ms':>10} {'bwd_ms':>10} {'fwd_TF/s':>10} {'bwd_TF/s':>10} {'fwdbwd_TF/s':>12}")
    for seq in (4096, 16384, 32768, 131072):
        q = torch.randn(batch, seq, hq, d, device=dev, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
        k = torch.randn(batch, seq, hkv, d, device=dev, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
        v = torch.randn(batch, seq, hkv, d, device=dev, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
        do = torch.randn(batch, hq, seq, d, device=dev, dtype=torch.bfloat16)

        def forward():
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        def backward():
            torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

        reps = max(2, args.repeats // 3) if seq >= 131072 else args.repeats
        fwd = time_ms(forward, reps)
        bwd = time_ms(backward, reps)
        flops = 2.0 * batch * hq * seq * seq * d
        print(f"{seq:>8} {fwd:>10.3f} {bwd:>10.3f} {flops / fwd / 1e9:>10.1f} {2.5 * flops / bwd / 1e9:>10.1f} "
              f"{3.5 * flops / (fwd + bwd) / 1e9:>12.1f}")
        del q, k, v, do, out
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
