#!/usr/bin/env python3
"""Writes tests/data/gated_delta_torch.safetensors: inputs, outputs and PyTorch autograd gradients
of the Gated DeltaNet pieces as transformers' Qwen3-Next runs them, for test_gated_delta_ref to
check the CPU reference (src/reference/gated_delta.cpp) against, without PyTorch in CI.

  python3 scripts/make_gated_delta_fixture.py [--out PATH]

Needs torch, transformers (with models/qwen3_next) and safetensors; runs on the CPU in fp32.
Every gradient is of sum(output * w) for a random w kept in the file (w_* tensors). The pieces:
  core_*   transformers' torch_recurrent_gated_delta_rule(use_qk_l2norm_in_kernel=True), 2 key
           heads and 4 value heads (grouped), and the chunked form torch_chunk_gated_delta_rule's
           output beside it (core_out_chunked), which the model uses for whole sequences
  conv_*   causal_conv1d_forward over a depthwise nn.Conv1d (padding kernel - 1), activation silu
  gates_*  beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias): Qwen3NextGatedDeltaNet.forward's lines
  norm_*   Qwen3NextRMSNormGated
  block_*  the whole Qwen3NextGatedDeltaNet block: x, its weights, out, and every gradient
  b35_*    the whole Qwen3_5MoeGatedDeltaNet block, its projections stacked (qkv over z, b over a)
"""
import argparse
import os

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
import transformers
from transformers.models.qwen3_next import modeling_qwen3_next as q3n


def grads(out, inputs, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out.shape, generator=gen)
    g = torch.autograd.grad((out * w).sum(), inputs)
    return w, g


BLOCK_SHAPE = dict(hidden_size=12, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=4,
                   linear_value_head_dim=3, linear_conv_kernel_dim=4, hidden_act="silu", rms_norm_eps=1e-6,
                   num_hidden_layers=1, layer_types=["linear_attention"])


def drawn_block(block, projections):
    """`block` with its norm weight, A_log, dt_bias and `projections` drawn, so that no head's state
    is reset every token (the module's A up to 16 makes exp(g) ~ 1e-4) and every head differs."""
    with torch.no_grad():
        block.norm.weight.uniform_(0.5, 1.5)
        block.A_log.uniform_(-2.0, 0.5)
        block.dt_bias.uniform_(-0.5, 1.5)
        for lin in projections:
            lin.weight.normal_(0, 0.3)
    return block


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out", default=os.path.join(here, "..", "tests", "data", "gated_delta_torch.safetensors"))
    args = ap.parse_args()
    torch.manual_seed(0)
    t = {}

    # The gated delta rule: T 13, key heads 2, value heads 4, dk 8, dv 6.
    T, hk, hv, dk, dv = 13, 2, 4, 8, 6
    q = torch.randn(1, T, hk, dk)
    k = torch.randn(1, T, hk, dk)
    # One token's q and k of norm ~1e-3, where the l2norm's eps (1e-6 under the root) shows.
    q[0, 3] *= 1e-3 / q[0, 3].norm(dim=-1, keepdim=True)
    k[0, 5] *= 1e-3 / k[0, 5].norm(dim=-1, keepdim=True)
    q.requires_grad_()
    k.requires_grad_()
    v = torch.randn(1, T, hv, dv, requires_grad=True)
    g = (-torch.rand(1, T, hv) * 1.5 - 0.05).requires_grad_()
    beta = (torch.rand(1, T, hv) * 0.8 + 0.1).requires_grad_()
    out, _ = q3n.torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    w, (dq, dkk, dvv, dg, dbeta) = grads(out, (q, k, v, g, beta), 1)
    chunked, _ = q3n.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, chunk_size=4, use_qk_l2norm_in_kernel=True)
    t.update(core_q=q, core_k=k, core_v=v, core_g=g, core_beta=beta, core_out=out, core_out_chunked=chunked, core_w=w,
             core_dq=dq, core_dk=dkk, core_dv=dvv, core_dg=dg, core_dbeta=dbeta)

    # The causal depthwise conv + SiLU: T 11, channels 10, kernel 4.
    T, C, K = 11, 10, 4
    conv = torch.nn.Conv1d(C, C, K, groups=C, padding=K - 1, bias=False)
    x = torch.randn(1, T, C, requires_grad=True)
    y = q3n.causal_conv1d_forward(conv, x.transpose(1, 2), None, 0, activation="silu").transpose(1, 2)
    w, (dx, dw) = grads(y, (x, conv.weight), 2)
    t.update(conv_x=x, conv_w=conv.weight.squeeze(1), conv_y=y, conv_dy=w, conv_dx=dx, conv_dw=dw.squeeze(1))

    # The gates: T 9, heads 4; one a past softplus's threshold (20).
    T, H = 9, 4
    a = (torch.randn(1, T, H) * 3).detach()
    a[0, 0, 0] = 25.0
    a.requires_grad_()
    b = torch.randn(1, T, H, requires_grad=True)
    a_log = torch.log(torch.empty(H).uniform_(0.01, 16)).requires_grad_()
    dt_bias = (torch.rand(H) + 0.5).requires_grad_()
    beta_out = b.sigmoid()
    g_out = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    wb = torch.randn(beta_out.shape, generator=torch.Generator().manual_seed(3))
    wg = torch.randn(g_out.shape, generator=torch.Generator().manual_seed(4))
    da, db, da_log, ddt = torch.autograd.grad((beta_out * wb).sum() + (g_out * wg).sum(), (a, b, a_log, dt_bias))
    t.update(gates_a=a, gates_b=b, gates_A_log=a_log, gates_dt_bias=dt_bias, gates_beta=beta_out, gates_g=g_out,
             gates_wbeta=wb, gates_wg=wg, gates_da=da, gates_db=db, gates_dA_log=da_log, gates_ddt_bias=ddt)

    # The gated RMSNorm: 7 rows of 6, eps 1e-6.
    rows, dim = 7, 6
    norm = q3n.Qwen3NextRMSNormGated(dim, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(rows, dim, requires_grad=True)
    z = torch.randn(rows, dim, requires_grad=True)
    y = norm(x, z)
    w, (dx, dz, dw) = grads(y, (x, z, norm.weight), 5)
    t.update(norm_x=x, norm_z=z, norm_w=norm.weight, norm_y=y, norm_dy=w, norm_dx=dx, norm_dz=dz, norm_dw=dw)

    # The whole block, transformers' Qwen3NextGatedDeltaNet: T 10, hidden 12, 2 key heads of 4, 4
    # value heads of 3 (2 a key head), kernel 4; the module's weights, drawn (drawn_block).
    cfg = transformers.Qwen3NextConfig(**BLOCK_SHAPE)
    block = q3n.Qwen3NextGatedDeltaNet(cfg, 0)
    drawn_block(block, (block.in_proj_qkvz, block.in_proj_ba, block.out_proj))
    x = torch.randn(1, 10, 12, requires_grad=True)
    y = block(x)
    params = [block.in_proj_qkvz.weight, block.in_proj_ba.weight, block.conv1d.weight, block.A_log, block.dt_bias,
              block.norm.weight, block.out_proj.weight]
    w, grads_out = grads(y, [x] + params, 6)
    names = ["in_proj_qkvz", "in_proj_ba", "conv", "A_log", "dt_bias", "norm", "out_proj"]
    t.update(block_x=x, block_y=y, block_dy=w, block_dx=grads_out[0])
    for name, p, g in zip(names, params, grads_out[1:]):
        t["block_" + name] = p.squeeze(1) if name == "conv" else p
        t["block_d" + name] = g.squeeze(1) if name == "conv" else g

    # The same block as Qwen3.5-MoE lays it out (separate in_proj_qkv, in_proj_z, in_proj_b,
    # in_proj_a), stacked for the reference as in_proj_qkv over in_proj_z and in_proj_b over
    # in_proj_a: Qwen3_5MoeGatedDeltaNet with its own weights.
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as q35
    cfg35 = transformers.Qwen3_5MoeTextConfig(**BLOCK_SHAPE)
    b35 = q35.Qwen3_5MoeGatedDeltaNet(cfg35, 0)
    drawn_block(b35, (b35.in_proj_qkv, b35.in_proj_z, b35.in_proj_b, b35.in_proj_a, b35.out_proj))
    x = torch.randn(1, 10, 12, requires_grad=True)
    y = b35(x)
    params = [b35.in_proj_qkv.weight, b35.in_proj_z.weight, b35.in_proj_b.weight, b35.in_proj_a.weight,
              b35.conv1d.weight, b35.A_log, b35.dt_bias, b35.norm.weight, b35.out_proj.weight]
    w, g35 = grads(y, [x] + params, 7)
    t.update(b35_x=x, b35_y=y, b35_dy=w, b35_dx=g35[0],
             b35_in_proj_qkvz=torch.cat([params[0], params[1]]), b35_din_proj_qkvz=torch.cat([g35[1], g35[2]]),
             b35_in_proj_ba=torch.cat([params[2], params[3]]), b35_din_proj_ba=torch.cat([g35[3], g35[4]]),
             b35_conv=params[4].squeeze(1), b35_dconv=g35[5].squeeze(1), b35_A_log=params[5], b35_dA_log=g35[6],
             b35_dt_bias=params[6], b35_ddt_bias=g35[7], b35_norm=params[7], b35_dnorm=g35[8],
             b35_out_proj=params[8], b35_dout_proj=g35[9])

    tensors = {name: v.detach().contiguous().float() for name, v in t.items()}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    metadata = {"torch": torch.__version__, "transformers": transformers.__version__,
                "producer": "scripts/make_gated_delta_fixture.py"}
    for prefix, c in (("block_", cfg), ("b35_", cfg35)):  # each block's shape, for the test to read
        metadata.update({prefix + "key_heads": str(c.linear_num_key_heads), prefix + "key_head_dim": str(c.linear_key_head_dim),
                         prefix + "value_heads": str(c.linear_num_value_heads),
                         prefix + "value_head_dim": str(c.linear_value_head_dim), prefix + "eps": repr(c.rms_norm_eps)})
    save_file(tensors, args.out, metadata=metadata)
    print(f"wrote {args.out}: {len(tensors)} tensors (torch {torch.__version__}, transformers {transformers.__version__})")


if __name__ == "__main__":
    main()
