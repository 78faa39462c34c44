#!/usr/bin/env python3
"""Times the peer of OOM's gated delta rule kernels (src/kernels/gated_delta.cu) on the GPU: the
gated delta rule as transformers' Qwen3-Next trains it where flash-linear-attention is not
installed (torch_chunk_gated_delta_rule, chunks of 64, l2norm in the kernel), forward and forward +
backward through autograd, on the shape test_gated_delta_kernels times (by default the Qwen3-Next
linear layer's: 1 sequence of 4096 tokens, 16 key and 32 value heads of 128), bf16 inputs as the
model passes them; then, where installed, flash-linear-attention's chunk_gated_delta_rule (Triton).
Prints one line per implementation in milliseconds; with --ours-forward-ms and
--ours-backward-ms (what test_gated_delta_kernels printed in the same device call) also the ratios.

  python3 scripts/bench_gated_delta_torch.py [--impl torch|fla] [--tokens 4096] [--ours-forward-ms F --ours-backward-ms B]
"""
import argparse
import time

import torch
import transformers
from transformers.models.qwen3_next import modeling_qwen3_next as q3n


def timed(fn, reps):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--k-heads", type=int, default=16)
    ap.add_argument("--v-heads", type=int, default=32)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--impl", choices=("torch", "fla", "block"), default="torch",
                    help="torch: transformers' torch_chunk_gated_delta_rule (run it where fla is not importable: "
                         "transformers takes fla's kernels where it can import them); fla: flash-linear-attention's; "
                         "block: transformers' whole Qwen3NextGatedDeltaNet at hidden 2048 (compare with "
                         "test_cuda_deltanet's timing)")
    ap.add_argument("--ours-forward-ms", type=float)
    ap.add_argument("--ours-backward-ms", type=float)
    args = ap.parse_args()
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    T, kh, vh, d = args.tokens, args.k_heads, args.v_heads, args.dim

    def leaf(*shape):
        return torch.randn(*shape, device=dev, generator=gen).to(torch.bfloat16).requires_grad_(True)

    q, k, v = leaf(1, T, kh, d), leaf(1, T, kh, d), leaf(1, T, vh, d)
    # Older transformers (4.57) take as many key as value heads: the layer repeats q and k first,
    # inside autograd, as Qwen3NextGatedDeltaNet.forward does there.
    import inspect
    grouped = "repeat_interleave" in inspect.getsource(q3n.torch_chunk_gated_delta_rule)

    def heads(x):
        return x if grouped or kh == vh else x.repeat_interleave(vh // kh, dim=2)
    g = (-(0.01 + 1.5 * torch.rand(1, T, vh, device=dev, generator=gen))).requires_grad_(True)
    beta = torch.sigmoid(torch.randn(1, T, vh, device=dev, generator=gen)).requires_grad_(True)
    dout = torch.randn(1, T, vh, d, device=dev, generator=gen)

    def forward():
        with torch.no_grad():
            q3n.torch_chunk_gated_delta_rule(heads(q), heads(k), v, g, beta, chunk_size=64, use_qk_l2norm_in_kernel=True)

    def forward_backward():
        out, _ = q3n.torch_chunk_gated_delta_rule(heads(q), heads(k), v, g, beta, chunk_size=64, use_qk_l2norm_in_kernel=True)
        torch.autograd.grad(out, [q, k, v, g, beta], dout.to(out.dtype))

    def report(name, f, fb):
        print(f"{name} {T} x {vh} heads of {d}: forward {f:.3f} ms, forward+backward {fb:.3f} ms "
              f"(torch {torch.__version__}, {torch.cuda.get_device_name()})")
        if args.ours_forward_ms and args.ours_backward_ms:
            ours = args.ours_forward_ms + args.ours_backward_ms
            print(f"ours / {name} speed: forward {f / args.ours_forward_ms:.2f}x, forward+backward {fb / ours:.2f}x")

    if args.impl == "block":  # the whole Qwen3NextGatedDeltaNet module at the Qwen3-Next-80B widths
        cfg = transformers.Qwen3NextConfig(hidden_size=2048, linear_num_key_heads=kh, linear_num_value_heads=vh,
                                           linear_key_head_dim=d, linear_value_head_dim=d, linear_conv_kernel_dim=4,
                                           num_hidden_layers=1, layer_types=["linear_attention"])
        block = q3n.Qwen3NextGatedDeltaNet(cfg, 0).to(dev, torch.bfloat16)
        xb = torch.randn(1, T, 2048, device=dev, generator=gen).to(torch.bfloat16).requires_grad_(True)
        dyb = torch.randn(1, T, 2048, device=dev, generator=gen).to(torch.bfloat16)

        def block_forward():
            with torch.no_grad():
                block(xb)

        def block_forward_backward():
            torch.autograd.grad(block(xb), [xb, *block.parameters()], dyb)

        report("Qwen3NextGatedDeltaNet (bf16)", timed(block_forward, args.reps), timed(block_forward_backward, args.reps))
        return
    if args.impl == "torch":
        report("torch_chunk_gated_delta_rule", timed(forward, args.reps), timed(forward_backward, args.reps))
        return

    # flash-linear-attention's Triton kernels, the rule's fastest public implementation, where
    # installed (the GPU machine has no internet: fla-core's wheel travels in .whl/, see
    # scripts/fetch-peer-wheels.sh). Grouped value heads natively (GVA).
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as e:
        print(f"flash-linear-attention: not installed ({e})")
        return

    def fla_forward():
        with torch.no_grad():
            chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)

    def fla_forward_backward():
        out, _ = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        torch.autograd.grad(out, [q, k, v, g, beta], dout.to(out.dtype))

    import fla
    name = f"fla {fla.__version__} chunk_gated_delta_rule"
    f = timed(fla_forward, args.reps)
    try:
        fb = timed(fla_forward_backward, args.reps)
    except RuntimeError as e:  # fla refuses its backward on some Triton versions (Hopper: < 3.7.1)
        print(f"{name} {T} x {vh} heads of {d}: forward {f:.3f} ms; backward refused: {str(e).splitlines()[0]}")
        if args.ours_forward_ms:
            print(f"ours / {name} speed: forward {f / args.ours_forward_ms:.2f}x")
        return
    report(name, f, fb)


if __name__ == "__main__":
    main()
