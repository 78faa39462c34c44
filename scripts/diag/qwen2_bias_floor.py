#!/usr/bin/env python3
"""How well bf16 can compute Qwen2-MoE's q/k/v bias gradients: transformers' Qwen2MoeDecoderLayer
run in bf16 against itself in fp32 on tests/model/test_cuda_hybrid_layer.cpp's shapes and weight
statistics (tests/data/gpu-qwen2-moe-layers.json, 2 sequences of 61 tokens, matrices N(0, 1/16),
norm scales 1 + N(0, 0.1), biases N(0, 0.25), x and dy N(0, 1), all bf16-representable; near-tie
tokens' dy zeroed as that test does).

Prints, per layer and seed, the relative L2 error of PyTorch's own bf16 layer (vs fp32) on y, dx,
each bias gradient and its projection's weight gradient, and each bias gradient's cancellation in
the fp32 run: kappa = sqrt(sum_t |d_t|^2) / |sum_t d_t| (d_t: the projection's output gradient at
token t). A bias gradient is the sum over tokens of d_t, so errors of size eps |d_t| that do not
cancel leave it about eps * kappa off. Keys cancel by construction: adding one vector to every key
of a sequence shifts each query's scores by a constant, which softmax ignores, so without RoPE
the k bias gradient would be exactly zero; only RoPE's rotation by position leaves some of it.

  python3 scripts/diag/qwen2_bias_floor.py [--seeds 4]      (a CUDA GPU, torch, transformers)
"""
import argparse
import math
import os

import torch
import transformers
from transformers.models.qwen2_moe import modeling_qwen2_moe as q2

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
B, S = 2, 61


def bf16(t):
    return t.to(torch.bfloat16).to(torch.float32)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def draw(layer, gen):
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("norm.weight"):
                v = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
            elif name.endswith("_proj.bias"):
                v = 0.25 * torch.randn(p.shape, generator=gen)
            else:
                v = torch.randn(p.shape, generator=gen) / 16.0
            p.copy_(bf16(v))


def run(layer, rotary, x, dy, dtype, device, capture=None):
    layer = layer.to(device=device, dtype=dtype)
    x = x.to(device=device, dtype=dtype).requires_grad_(True)
    dy = dy.to(device=device, dtype=dtype)
    positions = torch.arange(S, device=device).unsqueeze(0).expand(B, S)
    mask = torch.full((S, S), float("-inf"), device=device).triu(1).expand(B, 1, S, S).to(dtype)
    cos_sin = rotary.to(device)(x, positions)
    hooks = []
    if capture is not None:
        for proj in ("q_proj", "k_proj", "v_proj"):
            mod = getattr(layer.self_attn, proj)
            hooks.append(mod.register_full_backward_hook(
                lambda m, gin, gout, proj=proj: capture.__setitem__(proj, gout[0].detach().float().reshape(-1, gout[0].shape[-1]))))
    params = dict(layer.named_parameters())
    y = layer(x, position_embeddings=cos_sin, attention_mask=mask, position_ids=positions)
    y = y[0] if isinstance(y, tuple) else y
    grads = torch.autograd.grad((y * dy).sum(), [x, *params.values()])
    for h in hooks:
        h.remove()
    return y.detach().float(), grads[0].float(), {k: g.float() for k, g in zip(params.keys(), grads[1:])}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=4)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("qwen2_bias_floor: needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = transformers.AutoConfig.from_pretrained(os.path.join(ROOT, "tests/data/gpu-qwen2-moe-layers.json"))
    cfg._attn_implementation = "eager"
    rotary = q2.Qwen2MoeRotaryEmbedding(cfg)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.cuda.get_device_name()}")
    worst = {}
    for layer_idx in (0, 1):
        for seed in range(args.seeds):
            gen = torch.Generator().manual_seed(1000 * layer_idx + seed)
            layer = q2.Qwen2MoeDecoderLayer(cfg, layer_idx)
            draw(layer, gen)
            H = cfg.hidden_size
            x = bf16(torch.randn(B, S, H, generator=gen))
            dy = bf16(torch.randn(B, S, H, generator=gen))
            # Near ties (the test's rule: log(p_k / p_k+1) < 0.05) get no gradient.
            with torch.no_grad():
                ref = layer.to(torch.float32)
                xd = x.cuda()
                positions = torch.arange(S, device="cuda").unsqueeze(0).expand(B, S)
                mask = torch.full((S, S), float("-inf"), device="cuda").triu(1).expand(B, 1, S, S)
                ref = ref.cuda()
                h = xd + ref.self_attn(ref.input_layernorm(xd), rotary.cuda()(xd, positions), mask)[0]
                n2 = ref.post_attention_layernorm(h).reshape(-1, H)
                probs = torch.softmax(n2 @ ref.mlp.gate.weight.T, dim=-1)
                top = torch.topk(probs, cfg.num_experts_per_tok + 1, dim=-1).values
                tie = (torch.log(top[:, -2] / top[:, -1]) < 0.05).cpu().reshape(B, S)
            dy[tie] = 0
            layer = layer.cpu()
            capture = {}
            y32, dx32, g32 = run(layer, rotary, x, dy, torch.float32, "cuda", capture)
            layer = layer.cpu().to(torch.float32)
            yb, dxb, gb = run(layer, rotary, x, dy, torch.bfloat16, "cuda")
            keep = ~tie.reshape(-1).cuda()
            row = {"y": rel(yb.reshape(-1, H)[keep], y32.reshape(-1, H)[keep]), "dx": rel(dxb, dx32)}
            for proj in ("q_proj", "k_proj", "v_proj"):
                d = capture[proj]
                kappa = float(d.pow(2).sum(0).sum().sqrt() / d.sum(0).norm())
                row[f"{proj}.bias"] = rel(gb[f"self_attn.{proj}.bias"], g32[f"self_attn.{proj}.bias"])
                row[f"{proj}.weight"] = rel(gb[f"self_attn.{proj}.weight"], g32[f"self_attn.{proj}.weight"])
                row[f"{proj} kappa"] = kappa
            print(f"layer {layer_idx} seed {seed} ({int(tie.sum())} near ties): " +
                  ", ".join(f"{k} {v:.2e}" if "kappa" not in k else f"{k} {v:.1f}" for k, v in row.items()))
            for k, v in row.items():
                worst[k] = max(worst.get(k, 0.0), v)
    print("worst over layers and seeds: " +
          ", ".join(f"{k} {v:.2e}" if "kappa" not in k else f"{k} {v:.1f}" for k, v in worst.items()))


if __name__ == "__main__":
    main()
