#!/usr/bin/env python3
"""Writes tests/data/hybrid_layers_torch.safetensors: whole decoder layers of the hybrid families as
transformers runs them (Qwen3NextDecoderLayer and Qwen3_5MoeDecoderLayer: a Gated DeltaNet layer
and a gated full-attention layer of each, with zero-centred norms, partial rotary and a shared
expert), their inputs, outputs and PyTorch autograd gradients, for tests/model/test_host_decoder_layer.cpp to check
HostDecoderLayer against without PyTorch in CI.

  python3 scripts/make_hybrid_layer_fixture.py [--out PATH]

Needs torch, transformers (5.x, with models/qwen3_next and models/qwen3_5_moe) and safetensors;
runs on the CPU in fp32. The models are tests/data/tiny-qwen3-next-layers.json and
tests/data/tiny-qwen3.5-moe.json; their layers 0 (linear attention) and 3 (full attention).
Per family F (next, q35) and layer L, tensors are named F.L.<what>:
  x, dy          the input (B sequences of S tokens, B x S x hidden) and the gradient given to y
  y, dx          the layer's output and the gradient of sum(y * dy) with respect to x
  w.<name>       each weight, in bf16 (drawn and rounded to bf16 before the run), under the checkpoint's name within the
                 layer (model.layers.L. stripped): Qwen3-Next's experts one tensor per expert as
                 its checkpoints store them, Qwen3.5's packed ([experts, ...]) as its checkpoints do
  g.<name>       the gradient of sum(y * dy) with respect to that weight
The draw is redone until every token's k-th and (k+1)-th routing probabilities differ by more than
1e-3, so that fp32 rounding cannot change which experts a token picks.
"""
import argparse
import json
import os

import torch
import transformers
from transformers.models.qwen3_next import modeling_qwen3_next as q3n
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as q35
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeConfig

from layer_fixture import B, S, bf16, causal_mask, entries, forward_backward, routing_margin, save

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
LAYERS = (0, 3)


def draw(module, gen):
    """Every parameter drawn and rounded to bf16: matrices N(0, 0.15), the (1 + w) norms N(0, 0.2),
    the gated norm 1 + N(0, 0.2), A_log = log U(1, 16), dt_bias 1 + N(0, 0.2), the conv N(0, 0.3)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                v = 1 + 0.2 * torch.randn(p.shape, generator=gen)
            elif name.endswith("norm.weight"):
                v = 0.2 * torch.randn(p.shape, generator=gen)
            elif name.endswith("A_log"):
                v = torch.log(1 + 15 * torch.rand(p.shape, generator=gen))
            elif name.endswith("dt_bias"):
                v = 1 + 0.2 * torch.randn(p.shape, generator=gen)
            elif "conv1d" in name:
                v = 0.3 * torch.randn(p.shape, generator=gen)
            else:
                v = 0.15 * torch.randn(p.shape, generator=gen)
            p.copy_(bf16(v))


def run_layer(family, layer, rotary, idx, seed):
    gen = torch.Generator().manual_seed(seed)
    for attempt in range(100):
        draw(layer, gen)
        x = torch.randn(B, S, layer.hidden_size, generator=gen)
        dy = torch.randn(B, S, layer.hidden_size, generator=gen)
        positions = torch.arange(S).unsqueeze(0).expand(B, S)
        cos_sin = rotary(x, positions)
        mask = None
        if layer.block_type == "full_attention":  # eager attention: an additive causal mask
            mask = causal_mask()
        with torch.no_grad():
            residual = x + (layer.linear_attn(layer.input_layernorm(x)) if layer.block_type == "linear_attention"
                            else layer.self_attn(layer.input_layernorm(x), cos_sin, mask)[0])
        if routing_margin(layer, residual) > 1e-3:
            break
    else:
        raise SystemExit(f"{family} layer {idx}: no draw with well-separated routing in 100 attempts")
    params = dict(layer.named_parameters())
    y, dx, named = forward_backward(layer, x, dy, position_embeddings=cos_sin, attention_mask=mask, position_ids=positions)
    out = {"x": x, "dy": dy, "y": y, "dx": dx}
    for name, p in params.items():
        g = named[name]
        if family == "next" and name in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            # Qwen3-Next's checkpoints store each expert's gate_proj, up_proj and down_proj.
            inter = p.shape[1] // 2 if name.endswith("gate_up_proj") else p.shape[2]
            for e in range(p.shape[0]):
                if name.endswith("gate_up_proj"):
                    for part, rows in (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, 2 * inter))):
                        out[f"w.mlp.experts.{e}.{part}.weight"] = p.detach()[e, rows]
                        out[f"g.mlp.experts.{e}.{part}.weight"] = g[e, rows]
                else:
                    out[f"w.mlp.experts.{e}.down_proj.weight"] = p.detach()[e]
                    out[f"g.mlp.experts.{e}.down_proj.weight"] = g[e]
        else:
            out[f"w.{name}"] = p.detach()
            out[f"g.{name}"] = g
    print(f"{family} layer {idx} ({layer.block_type}): routing margin {routing_margin(layer, residual):.2e} "
          f"after {attempt + 1} draw(s), |y| {float(y.abs().max()):.3g}, |dx| {float(dx.abs().max()):.3g}")
    return entries(family, idx, out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "tests/data/hybrid_layers_torch.safetensors"))
    args = ap.parse_args()
    torch.manual_seed(0)

    tensors = {}
    cfg = transformers.AutoConfig.from_pretrained(os.path.join(ROOT, "tests/data/tiny-qwen3-next-layers.json"))
    cfg._attn_implementation = "eager"
    rotary = q3n.Qwen3NextRotaryEmbedding(cfg)
    for i, idx in enumerate(LAYERS):
        tensors.update(run_layer("next", q3n.Qwen3NextDecoderLayer(cfg, idx), rotary, idx, 100 + i))

    with open(os.path.join(ROOT, "tests/data/tiny-qwen3.5-moe.json")) as f:
        cfg35 = Qwen3_5MoeConfig(**json.load(f)).text_config
    cfg35._attn_implementation = "eager"
    rotary35 = q35.Qwen3_5MoeTextRotaryEmbedding(cfg35)
    for i, idx in enumerate(LAYERS):
        tensors.update(run_layer("q35", q35.Qwen3_5MoeDecoderLayer(cfg35, idx), rotary35, idx, 200 + i))

    save(tensors, args.out)


if __name__ == "__main__":
    main()
