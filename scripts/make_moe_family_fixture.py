#!/usr/bin/env python3
"""Writes tests/data/moe_families_torch.safetensors: whole decoder layers of Mixtral, OLMoE and
Qwen2-MoE as transformers runs them (MixtralDecoderLayer: GQA without q/k norm, top-k weights
renormalised; OlmoeDecoderLayer: q/k RMSNorm over the whole projection width, top-k weights as the
softmax gave them; Qwen2MoeDecoderLayer: q/k/v biases, a shared expert with a sigmoid gate), their inputs, outputs and PyTorch autograd gradients, for
tests/model/test_host_decoder_layer.cpp to check HostDecoderLayer against without PyTorch in CI.

  python3 scripts/make_moe_family_fixture.py [--out PATH]

Needs torch, transformers (5.x: experts packed as gate_up_proj / down_proj) and safetensors; runs
on the CPU in fp32. The models are examples/configs/tiny-mixtral.json, tiny-olmoe.json and
tiny-qwen2-moe.json; their layers 0 and 1. Per family F (mixtral, olmoe, qwen2) and layer L, tensors are named F.L.<what>,
as scripts/make_hybrid_layer_fixture.py names them:
  x, dy          the input (B sequences of S tokens, B x S x hidden) and the gradient given to y
  y, dx          the layer's output and the gradient of sum(y * dy) with respect to x
  w.<name>       each weight in bf16 (drawn and rounded to bf16 before the run) under the
                 checkpoint's name within the layer (model.layers.L. stripped): Mixtral's
                 block_sparse_moe.experts.E.w1 / w3 / w2 (gate, up, down), OLMoE's
                 mlp.experts.E.gate_proj / up_proj / down_proj
  g.<name>       the gradient of sum(y * dy) with respect to that weight
The draw is redone until every token's k-th and (k+1)-th routing probabilities differ by more than
1e-3, so that fp32 rounding cannot change which experts a token picks.
"""
import argparse
import os

import torch
import transformers
from transformers.models.mixtral import modeling_mixtral as mx
from transformers.models.olmoe import modeling_olmoe as ol
from transformers.models.qwen2_moe import modeling_qwen2_moe as q2

from layer_fixture import B, S, bf16, causal_mask, entries, forward_backward, routing_margin, save

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
LAYERS = (0, 1)


def draw(module, gen):
    """Every parameter drawn and rounded to bf16: norms 1 + N(0, 0.2), matrices N(0, 0.15)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale, mean = (0.2, 1.0) if name.endswith("norm.weight") else (0.15, 0.0)
            p.copy_(bf16(mean + scale * torch.randn(p.shape, generator=gen)))


def checkpoint_names(family, name, p, g):
    """(checkpoint name within the layer, weight, gradient) for one parameter of transformers' module."""
    if name == "mlp.experts.gate_up_proj":
        inter = p.shape[1] // 2
        gate, up = ("w1", "w3") if family == "mixtral" else ("gate_proj", "up_proj")
        for e in range(p.shape[0]):
            for part, rows in ((gate, slice(0, inter)), (up, slice(inter, 2 * inter))):
                yield f"mlp.experts.{e}.{part}.weight", p[e, rows], g[e, rows]
    elif name == "mlp.experts.down_proj":
        down = "w2" if family == "mixtral" else "down_proj"
        for e in range(p.shape[0]):
            yield f"mlp.experts.{e}.{down}.weight", p[e], g[e]
    else:
        yield name, p, g


def run_layer(family, layer, rotary, idx, seed):
    gen = torch.Generator().manual_seed(seed)
    mask = causal_mask()
    positions = torch.arange(S).unsqueeze(0).expand(B, S)
    for attempt in range(100):
        draw(layer, gen)
        x = torch.randn(B, S, layer.hidden_size, generator=gen)
        dy = torch.randn(B, S, layer.hidden_size, generator=gen)
        cos_sin = rotary(x, positions)
        with torch.no_grad():
            residual = x + layer.self_attn(layer.input_layernorm(x), cos_sin, mask)[0]
        if routing_margin(layer, residual) > 1e-3:
            break
    else:
        raise SystemExit(f"{family} layer {idx}: no draw with well-separated routing in 100 attempts")
    params = dict(layer.named_parameters())
    y, dx, named = forward_backward(layer, x, dy, position_embeddings=cos_sin, attention_mask=mask, position_ids=positions)
    out = {"x": x, "dy": dy, "y": y, "dx": dx}
    for name, p in params.items():
        for ckpt, w, gw in checkpoint_names(family, name, p.detach(), named[name]):
            if family == "mixtral":
                ckpt = ckpt.replace("mlp.", "block_sparse_moe.", 1)
            out[f"w.{ckpt}"] = w
            out[f"g.{ckpt}"] = gw
    print(f"{family} layer {idx}: routing margin {routing_margin(layer, residual):.2e} after {attempt + 1} draw(s), "
          f"|y| {float(y.abs().max()):.3g}, |dx| {float(dx.abs().max()):.3g}")
    return entries(family, idx, out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "tests/data/moe_families_torch.safetensors"))
    args = ap.parse_args()
    torch.manual_seed(0)

    tensors = {}
    for family, module, prefix, config, seed in (("mixtral", mx, "Mixtral", "tiny-mixtral.json", 300),
                                                 ("olmoe", ol, "Olmoe", "tiny-olmoe.json", 400),
                                                 ("qwen2", q2, "Qwen2Moe", "tiny-qwen2-moe.json", 500)):
        cfg = transformers.AutoConfig.from_pretrained(os.path.join(ROOT, "examples/configs", config))
        cfg._attn_implementation = "eager"
        rotary = getattr(module, prefix + "RotaryEmbedding")(cfg)
        for i, idx in enumerate(LAYERS):
            layer = getattr(module, prefix + "DecoderLayer")(cfg, idx)
            tensors.update(run_layer(family, layer, rotary, idx, seed + i))

    save(tensors, args.out)


if __name__ == "__main__":
    main()
