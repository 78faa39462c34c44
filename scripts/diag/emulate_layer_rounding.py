#!/usr/bin/env python3
"""Where a bf16 decoder layer's error against fp32 comes from: OOM's CUDA layer emulated on the CPU.

The layer (src/model/cuda_decoder_layer.cpp) is written out in torch with fp32 (or fp64) math, and
each place where the product stores a bf16 tensor is a named rounding point: forward points round
the value, backward points round the gradient that reaches them. With every point on, the emulation
reproduces the H200 layer's errors against transformers' fp32 layer statistically (2026-12-03, the
5.13B widths at T = 4096, seed 0: worst 8.50e-3 / 1.29e-2 here against 8.24e-3 / 1.33e-2 measured,
fan-in-scaled / unscaled weights; docs/performance.md has the per-tensor figures); with a subset
off it says which roundings an error comes from and what keeping them in fp32 would buy, without a
GPU or a kernel change. Each run prints the worst checked tensor, the output, grad_input and every
non-expert parameter gradient's relative L2 error against the run with no rounding.

    python3 scripts/diag/emulate_layer_rounding.py [--model-config examples/configs/moe-5b.json]
        [--tokens 2048] [--seed 0] [--unscaled-init] [--reference fp32|fp64]
        [--runs "all;forward;backward;all-h,xn2_router"] [--check-transformers]

Weights, inputs and the near-tie rule (grad_output rows of tokens whose top-k choice is a near tie
zeroed, their output rows not compared) are scripts/compare_decoder_layer.py's, so a run here and a
GPU run of that script at the same --model-config / --tokens / --seed / --unscaled-init see the same
layer. --check-transformers first compares the unrounded emulation with transformers'
Qwen3MoeDecoderLayer in fp32 on the CPU (1e-6 to 7e-6 apart at T = 256 to 2048, 2026-12-03) and stops
if they differ by over 1e-4.

A run is `all`, `forward`, `backward`, `none`, or `all-P1,P2,...` (every point but those). Points
(forward: the value is stored bf16; backward: the gradient is):
  forward   xn1 qkv qk_norm rope P attn h xn2 xn2_router gate_up act y_perm moe y
  backward  d_x d_x_norm d_xn1 d_qk_raw d_qkv d_rope dS d_attn d_h d_h_norm d_xn2 d_logits
            d_xn2_experts d_x_perm d_gate_up d_act d_y_perm
P and dS are the attention kernels' bf16 operands in registers, not stores: the forward's
unnormalised probabilities (P V), the backward's P (dV) and score gradients (dS K, dS^T Q).
xn2_router is the router's read of the post-attention norm's output: in the product the same bf16
buffer the experts read, so turning it off alone (or xn2 alone) is a what-if, an fp32 copy for the
router (or for the experts). d_logits is the router backward's bf16 copy of d logits. RoPE's
angles are computed in fp64 here, in fp32 there (angles ~1e-5 rad apart at T = 4096: ~1% of one
bf16 rounding of q and k).
Needs torch (CPU is enough) and, for --check-transformers, transformers. ~10-20 s a run at 2048
tokens of the 5.13B widths on two cores.
"""
import argparse
import importlib.util
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

FORWARD = ("xn1", "qkv", "qk_norm", "rope", "P", "attn", "h", "xn2", "xn2_router", "gate_up", "act", "y_perm", "moe", "y")
BACKWARD = ("d_x", "d_x_norm", "d_xn1", "d_qk_raw", "d_qkv", "d_rope", "dS", "d_attn", "d_h", "d_h_norm", "d_xn2", "d_logits",
            "d_xn2_experts", "d_x_perm", "d_gate_up", "d_act", "d_y_perm")
POINTS = frozenset(FORWARD + BACKWARD)


def load_compare_script():
    path = os.path.join(REPO, "scripts", "compare_decoder_layer.py")
    spec = importlib.util.spec_from_file_location("compare_decoder_layer", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def parse_runs(text):
    """'all;forward;all-h,xn2' -> [(label, frozenset of points on)]; SystemExit naming an unknown point."""
    runs = []
    for label in (r.strip() for r in text.split(";")):
        if not label:
            continue
        if label == "all":
            on = POINTS
        elif label == "forward":
            on = frozenset(FORWARD)
        elif label == "backward":
            on = frozenset(BACKWARD)
        elif label == "none":
            on = frozenset()
        elif label.startswith("all-"):
            off = {p.strip() for p in label[4:].split(",") if p.strip()}
            unknown = sorted(off - POINTS)
            if unknown:
                raise SystemExit(f"--runs: unknown rounding point(s) {unknown} in {label!r}; known: "
                                 f"{' '.join(FORWARD)} | {' '.join(BACKWARD)}")
            on = POINTS - off
        else:
            raise SystemExit(f"--runs: {label!r} is not all, forward, backward, none or all-P1,P2,...")
        runs.append((label, on))
    if not runs:
        raise SystemExit("--runs names no run")
    return runs


def build(torch):
    """The emulated layer, closed over the set of active rounding points."""
    on = set()

    def bf16(t):
        return t.to(torch.bfloat16).to(t.dtype)

    class Round(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, fwd, bwd):
            ctx.bwd = bwd
            return bf16(x) if fwd in on else x.clone()

        @staticmethod
        def backward(ctx, g):
            return (bf16(g) if ctx.bwd in on else g), None, None

    def rnd(x, fwd, bwd="-"):
        return Round.apply(x, fwd, bwd)

    def rnd_grad(x, bwd):
        return Round.apply(x, "-", bwd)

    class Attention(torch.autograd.Function):
        """Causal GQA with the flash kernels' bf16 P (forward, dV) and dS (dQ, dK); the rest fp32."""

        @staticmethod
        def scores(q, k):
            T, Hq, D = q.shape
            kk = k.repeat_interleave(Hq // k.shape[1], 1)
            s = torch.einsum("thd,uhd->htu", q, kk) / math.sqrt(D)
            return s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -float("inf"))

        @staticmethod
        def forward(ctx, q, k, v):
            s = Attention.scores(q, k)
            lse = torch.logsumexp(s, -1, keepdim=True)
            # The forward kernels round the unnormalised exp(S - rowmax) that multiplies V (the
            # running max of a key tile there; the row's max here) and divide O by the fp32 sum of
            # the unrounded values at the end.
            e = torch.exp(s - s.amax(-1, keepdim=True))
            vv = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
            o = torch.einsum("htu,uhd->thd", bf16(e) if "P" in on else e, vv)
            o = o / e.sum(-1).transpose(0, 1).unsqueeze(-1)
            ctx.save_for_backward(q, k, v, o, lse)
            return o

        @staticmethod
        def backward(ctx, do):
            q, k, v, o, lse = ctx.saved_tensors
            T, Hq, D = q.shape
            Hk = k.shape[1]
            g = Hq // Hk
            p = torch.exp(Attention.scores(q, k) - lse)
            kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            dv = torch.einsum("htu,thd->uhd", bf16(p) if "P" in on else p, do)
            dp = torch.einsum("thd,uhd->htu", do, vv)
            if "attn" in on:  # D = rowsum(dO o O) reads the O the forward stored (bf16)
                o = bf16(o)
            ds = p * (dp - (do * o).sum(-1).transpose(0, 1).unsqueeze(-1))
            if "dS" in on:
                ds = bf16(ds)
            dq = torch.einsum("htu,uhd->thd", ds, kk) / math.sqrt(D)
            dk = torch.einsum("htu,thd->uhd", ds, q) / math.sqrt(D)
            return dq, dk.reshape(T, Hk, g, D).sum(2), dv.reshape(T, Hk, g, D).sum(2)

    def rms(x, w, eps):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w

    def rope(x, theta):  # x [T, heads, D], rotate-half as Qwen3
        T, D = x.shape[0], x.shape[-1]
        inv = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
        f = torch.arange(T, dtype=torch.float64)[:, None] * inv[None]
        emb = torch.cat([f, f], -1)
        cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
        return x * cos + torch.cat([-x[..., D // 2:], x[..., : D // 2]], -1) * sin

    def layer(W, x, cfg, capture):
        T, H = x.shape
        Hq, Hk, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        E, k, I = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
        eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
        # attention block: h = x + O Wo^T (dx = dh + the input norm's backward, rounded once more)
        x = rnd_grad(x, "d_x")
        xn1 = rnd(rms(rnd_grad(x, "d_x_norm"), W["input_layernorm.weight"], eps), "xn1", "d_xn1")
        q_raw = rnd(xn1 @ W["self_attn.q_proj.weight"].t(), "qkv", "d_qk_raw").reshape(T, Hq, D)
        k_raw = rnd(xn1 @ W["self_attn.k_proj.weight"].t(), "qkv", "d_qk_raw").reshape(T, Hk, D)
        v = rnd(xn1 @ W["self_attn.v_proj.weight"].t(), "qkv", "d_qkv").reshape(T, Hk, D)
        q = rnd(rms(q_raw, W["self_attn.q_norm.weight"], eps), "qk_norm", "d_rope")
        kk = rnd(rms(k_raw, W["self_attn.k_norm.weight"], eps), "qk_norm", "d_rope")
        q, kk = rnd(rope(q, theta), "rope", "d_qkv"), rnd(rope(kk, theta), "rope", "d_qkv")
        o = rnd(Attention.apply(q, kk, v), "attn", "d_attn").reshape(T, Hq * D)
        h = rnd(x + o @ W["self_attn.o_proj.weight"].t(), "h", "d_h")
        # MoE block: router over the norm's output, experts on their rows, combine, residual
        xn2_full = rnd_grad(rms(rnd_grad(h, "d_h_norm"), W["post_attention_layernorm.weight"], eps), "d_xn2")
        logits = rnd_grad(rnd(xn2_full, "xn2_router") @ W["mlp.gate.weight"].t(), "d_logits")
        capture["logits"] = logits.detach()
        top_p, top_i = torch.softmax(logits, -1).topk(k, -1)
        weights = top_p / top_p.sum(-1, keepdim=True) if cfg["norm_topk_prob"] else top_p
        xn2 = rnd_grad(rnd(xn2_full, "xn2"), "d_xn2_experts")
        moe = torch.zeros_like(x)
        for e in range(E):
            tok, slot = (top_i == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            x_perm = rnd_grad(xn2[tok], "d_x_perm")
            w_gu = torch.cat([W[f"mlp.experts.{e}.gate_proj.weight"], W[f"mlp.experts.{e}.up_proj.weight"]])
            gu = rnd(x_perm @ w_gu.t(), "gate_up", "d_gate_up")
            act = rnd(torch.nn.functional.silu(gu[:, :I]) * gu[:, I:], "act", "d_act")
            y_perm = rnd(act @ W[f"mlp.experts.{e}.down_proj.weight"].t(), "y_perm", "d_y_perm")
            moe = moe.index_add(0, tok, y_perm * weights[tok, slot][:, None])
        return rnd(h + rnd(moe, "moe"), "y")

    return on, layer


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-config", default=os.path.join(REPO, "examples", "configs", "moe-5b.json"),
                   help="a Qwen3-MoE config.json whose layer widths to emulate, or 'builtin' for "
                        "compare_decoder_layer.py's small layer (default: the 5.13B benchmark model)")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--unscaled-init", action="store_true", help="compare_decoder_layer.py's --unscaled-init weights")
    p.add_argument("--reference", choices=("fp32", "fp64"), default="fp32",
                   help="precision of the math (and of the unrounded reference run)")
    p.add_argument("--runs", default="all;forward;backward", help="';'-separated runs (see above)")
    p.add_argument("--margin", type=float, default=0.05, help="near-tie threshold in logit std units (as the script)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--check-transformers", action="store_true",
                   help="first check the unrounded emulation against transformers' fp32 layer on the CPU")
    a = p.parse_args()
    if a.tokens < 2:
        p.error(f"--tokens must be >= 2, not {a.tokens}")
    runs = parse_runs(a.runs)
    try:
        import torch
    except ImportError as e:
        print(f"emulate_layer_rounding: needs torch ({e})", file=sys.stderr)
        return 2
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    cdl = load_compare_script()
    cfg = cdl.layer_config(a.tokens) if a.model_config == "builtin" else cdl.model_layer_config(a.model_config, a.tokens)
    return emulate(torch, cdl, cfg, a.tokens, a.seed, a.unscaled_init, a.reference, runs, a.margin,
                   a.check_transformers)[0]


def emulate(torch, cdl, cfg, T, seed, unscaled_init, reference, runs, margin=0.05, check_transformers=False, out=print):
    """Runs `runs` against the unrounded run; returns (exit status, {run label: {tensor: relative error}})."""
    dtype = torch.float64 if reference == "fp64" else torch.float32
    H, k = cfg["hidden_size"], cfg["num_experts_per_tok"]

    # The same draws, in the same order, as compare_decoder_layer.py's main().
    gen = torch.Generator().manual_seed(seed)
    canon = cdl.canonical_weights(torch, cfg, gen, "cpu", fan_in_scaled=not unscaled_init)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).float()
    dy = (torch.randn(T, H, generator=gen) * 0.5).to(torch.bfloat16).float()
    canon = {n: w.to(dtype) for n, w in canon.items()}
    x, dy = x.to(dtype), dy.to(dtype)
    on, layer = build(torch)

    def run(points, grad_out):
        on.clear()
        on.update(points)
        W = {n: w.clone().requires_grad_(True) for n, w in canon.items()}
        xi = x.clone().requires_grad_(True)
        y = layer(W, xi, cfg, {})
        y.backward(grad_out)
        return y.detach(), xi.grad.detach(), {n: w.grad.detach() for n, w in W.items()}

    out(f"layer: hidden {H}, heads {cfg['num_attention_heads']}/{cfg['num_key_value_heads']} x {cfg['head_dim']}, "
        f"{cfg['num_experts']} experts top-{k}, I = {cfg['moe_intermediate_size']}, T = {T}, seed {seed}, "
        f"{'unscaled' if unscaled_init else 'fan-in-scaled'} weights, {reference} math", flush=True)
    t0 = time.time()
    on.clear()
    with torch.no_grad():  # the unrounded forward's router logits pick the near ties
        capture = {}
        layer(canon, x, cfg, capture)
        logits = capture["logits"]
    top = logits.sort(dim=-1, descending=True).values
    ambiguous = (top[:, k - 1] - top[:, k]) < margin * logits.std()
    keep = ~ambiguous
    dy[ambiguous] = 0
    ref = run(frozenset(), dy)
    out(f"router logits std {logits.std().item():.2f}; {int(ambiguous.sum())} of {T} tokens with a top-{k} near tie "
        f"(grad_output rows zeroed, output rows not compared); reference run {time.time() - t0:.0f} s", flush=True)

    rel = cdl.rel

    if check_transformers:
        try:
            import transformers
            from transformers.models.qwen3_moe import modeling_qwen3_moe as M
        except ImportError as e:
            out(f"emulate_layer_rounding: --check-transformers needs transformers ({e})", file=sys.stderr)
            return 2, {}
        config = cdl.make_hf_config(transformers, cfg, "eager")
        module = M.Qwen3MoeDecoderLayer(config, 0)
        layout = cdl.ExpertLayout(module.state_dict(), cfg["num_experts"], cfg["moe_intermediate_size"], H)
        module.load_state_dict(layout.to_module(torch, {n: w.float() for n, w in canon.items()}), strict=True)
        module = module.float().eval()
        y_hf, dx_hf, g_hf = cdl.run_torch(torch, M, module, config, x.float(), dy.float(), torch.float32)
        g_hf = layout.to_canonical(g_hf)
        errs = {"output": rel(ref[0].float()[keep], y_hf[keep]), "grad_input": rel(ref[1].float(), dx_hf)}
        errs.update({n: rel(ref[2][n].float(), g_hf[n]) for n in canon})
        worst = max(errs, key=errs.get)
        ok = errs[worst] <= 1e-4
        out(f"unrounded emulation vs transformers {transformers.__version__} fp32: worst {worst} {errs[worst]:.1e} "
            f"({'agrees' if ok else 'DISAGREES'})", flush=True)
        if not ok:
            return 1, {}

    shown = [n for n in canon if ".experts." not in n]
    results = {}
    for label, points in runs:
        t0 = time.time()
        y, dx, g = run(points, dy)
        errs = {"output": rel(y[keep], ref[0][keep]), "grad_input": rel(dx, ref[1])}
        errs.update({n: rel(g[n], ref[2][n]) for n in canon})
        results[label] = errs
        worst = max(errs, key=errs.get)
        experts = max(errs[n] for n in canon if ".experts." in n)
        out(f"[{label}] ({time.time() - t0:.0f} s) worst {worst} {errs[worst]:.2e}; output {errs['output']:.2e}, "
            f"grad_input {errs['grad_input']:.2e}, experts' worst {experts:.2e}", flush=True)
        out("    " + ", ".join(f"{n.removeprefix('self_attn.').removesuffix('.weight')} {errs[n]:.2e}" for n in shown))
    return 0, results


if __name__ == "__main__":
    load_compare_script().run_cli(main, "emulate_layer_rounding")
