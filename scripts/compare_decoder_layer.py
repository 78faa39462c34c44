#!/usr/bin/env python3
"""Compare OOM's CUDA Qwen3-MoE decoder layer (oom-layer-check) with transformers' Qwen3MoeDecoderLayer.

On a GPU machine with torch + transformers:
    ninja -C build-cuda oom-layer-check
    python3 scripts/compare_decoder_layer.py [--tool build-cuda/examples/layer-check/oom-layer-check]
        [--tokens 301] [--seed 0] [--workdir DIR] [--tol 1e-2] [--attn sdpa|eager]
        [--model-config examples/configs/moe-5b.json]

What it does:
  1. builds a small Qwen3-MoE config (hidden 256, 8 heads / 2 kv heads of head_dim 128, 8 experts top-2,
     moe_intermediate 192, rope_theta 1e6) and writes DIR/config.json; with --model-config, one layer of
     that model's widths instead (e.g. the 5.13B benchmark model: hidden 2048, 64 experts top-8, I = 768,
     the widths at which the product's Hopper grouped expert GEMMs and register-path norms run, where the
     small layer's 192-wide experts take the cuBLAS fallbacks), its weights' spreads scaled by fan-in so
     that activations and router logits keep the small layer's statistics (--init unscaled: not; --init transformers: transformers' own
     initialisation);
  2. draws seeded random weights (bf16-representable) in Hugging Face's per-expert naming and loads them
     into transformers' Qwen3MoeDecoderLayer (layer_idx 0) in bf16 and, upcast, in fp32 -- converting to
     the fused expert layout (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]) when the
     installed transformers stores experts that way;
  3. draws input (T, H) and grad_output (T, H). Tokens whose top-k choice is a near tie (gap between the
     k-th and (k+1)-th router logit < --margin x the logits' std in the fp32 run) would be routed to
     different experts by any two implementations within bf16 noise; their grad_output rows are set
     to zero (so their routing affects no gradient: the MoE is per token) and their output rows are
     left out of the output comparison. The number is printed;
  4. writes DIR/in.safetensors, runs oom-layer-check -> DIR/out.safetensors;
  5. runs the torch layer forward and backward (output.backward(grad_output)) in bf16 and in fp32 and
     prints, per tensor, the relative error ||a - b|| / ||b|| of ours vs torch-bf16, ours vs torch-fp32
     and torch-bf16 vs torch-fp32 (the bf16 noise floor). The check (--check-against, default fp32)
     is ours vs transformers' layer run in fp32 on the same bf16 weights and inputs, i.e. the exact
     math: PASS when <= --tol. Two bf16 implementations that round differently sit about sqrt(2)
     times the noise floor apart, which on the H200 (2026-11-30) was itself up to 1.1e-2 for PyTorch's
     own bf16 q/k-norm gradients, so a 1e-2 check against torch-bf16 fails on noise rather than on
     bugs; `--check-against bf16` runs it anyway.
Exit status: 0 all PASS, 1 any FAIL, 2 setup error (no GPU, no tool, transformers missing).
"""
import argparse
import copy
import inspect
import json
import math
import os
import subprocess
import sys
import tempfile

PREFIX = "model.layers.0."


def parse_args():
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tool", default=None,
                   help="oom-layer-check (default: <repo>/build-cuda/examples/layer-check/oom-layer-check, "
                        "then build-gpu/, build/)")
    p.add_argument("--tokens", type=int, default=301)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="where config.json, in/out.safetensors go (default: a temp dir)")
    p.add_argument("--tol", type=float, default=1e-2)
    p.add_argument("--check-against", choices=("fp32", "bf16"), default="fp32",
                   help="which transformers run the tolerance applies to (default fp32: the exact math)")
    p.add_argument("--margin", type=float, default=0.05,
                   help="top-k near-tie threshold, in units of the router logits' std (default 0.05)")
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="transformers' attention implementation")
    p.add_argument("--model-config", default=None,
                   help="a Qwen3-MoE config.json whose layer widths to compare at (default: the small built-in layer)")
    p.add_argument("--init", choices=("scaled", "unscaled", "transformers"), default=None,
                   help="the weights' spreads: the small layer's scaled by fan-in (default), the small layer's at every "
                        "width (unscaled: a saturated router at hidden 2048), or transformers' own initialisation of "
                        "a Qwen3-MoE layer (every matrix N(0, initializer_range), norms 1; see canonical_weights)")
    p.add_argument("--unscaled-init", action="store_true", help="the same as --init unscaled")
    p.add_argument("--initializer-range", type=float, default=None,
                   help="with --init transformers: the std of every matrix (Qwen3MoeConfig's default 0.02)")
    a = p.parse_args()
    if a.unscaled_init:
        if a.init not in (None, "unscaled"):
            p.error(f"--unscaled-init and --init {a.init} ask for two initialisations")
        a.init = "unscaled"
    a.init = a.init or "scaled"
    if a.initializer_range is not None and a.init != "transformers":
        p.error(f"--initializer-range is for --init transformers, not --init {a.init}")
    a.initializer_range = 0.02 if a.initializer_range is None else a.initializer_range
    if not a.initializer_range > 0:
        p.error(f"--initializer-range must be > 0, not {a.initializer_range}")
    if a.tokens < 1:
        p.error(f"--tokens must be >= 1, not {a.tokens}")
    if a.tool is None:
        for b in ("build-cuda", "build-gpu", "build"):
            cand = os.path.join(repo, b, "examples", "layer-check", "oom-layer-check")
            if os.path.exists(cand):
                a.tool = cand
                break
    if a.tool is None or not os.path.exists(a.tool):
        sys.exit("compare_decoder_layer: oom-layer-check not found (build it: ninja -C build-cuda oom-layer-check, "
                 "or pass --tool PATH)")  # exit status 1 from sys.exit(str) -> make it 2 below
    return a


def layer_config(tokens):
    """The config.json both implementations read (our reader: ModelSpec; transformers: Qwen3MoeConfig)."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 1024,
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 192,  # 2I != H, so a transposed fused expert layout is detectable
        "num_hidden_layers": 1,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 128,  # OOM's attention kernel takes head_dim 128 or 256
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": max(4096, tokens),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
        "use_sliding_window": False,
        "torch_dtype": "bfloat16",
    }


# The fields of a model's config.json that shape one decoder layer (the rest stay the built-in layer's).
LAYER_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts",
                "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "rms_norm_eps", "rope_theta",
                "router_aux_loss_coef")


def model_layer_config(path, tokens):
    """layer_config with the layer widths of the Qwen3-MoE model at `path`; SystemExit naming the file and
    field when it is not one."""
    try:
        with open(path) as f:
            model = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"--model-config {path}: cannot read it as JSON ({e})")
    if not isinstance(model, dict):
        raise SystemExit(f"--model-config {path}: the top level is a JSON {type(model).__name__}, not an object")
    if model.get("model_type") != "qwen3_moe":
        raise SystemExit(f"--model-config {path}: model_type is {model.get('model_type')!r}; this comparison builds "
                         "transformers' Qwen3MoeDecoderLayer, so it needs 'qwen3_moe'")
    required = ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_experts", "num_experts_per_tok",
                "moe_intermediate_size")
    cfg = layer_config(tokens)
    for k in LAYER_FIELDS:
        if k in model:
            cfg[k] = model[k]
        elif k in required:
            raise SystemExit(f"--model-config {path}: field {k!r} is missing")
    if "head_dim" not in model:
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"] if cfg["num_attention_heads"] else 0
    for k in required + ("head_dim",):
        v = cfg[k]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise SystemExit(f"--model-config {path}: field {k!r} is {v!r}; it must be a positive integer")
    positions = model.get("max_position_embeddings", tokens)
    if isinstance(positions, bool) or not isinstance(positions, int):
        raise SystemExit(f"--model-config {path}: field 'max_position_embeddings' is {positions!r}; it must be an integer")
    cfg["max_position_embeddings"] = max(tokens, positions)
    return cfg


def canonical_weights(torch, cfg, gen, device, fan_in_scaled=True, transformers_std=None):
    """Seeded weights under HF's per-expert names (without the layer prefix), bf16-representable fp32.

    With transformers_std, the layer as transformers initialises a Qwen3-MoE model (PreTrainedModel.
    _init_weights: every linear and expert matrix, the router's included, N(0, initializer_range); the
    RMSNorm weights, q/k norms included, 1): at hidden 2048 the router's logits have std ~0.9.
    Otherwise:
    The standard deviations are the built-in small layer's. With fan_in_scaled, a matrix's is scaled by
    sqrt(its fan-in in the small layer / its fan-in here), as a width-independent initialisation does,
    so every width sees the small layer's activation and router-logit statistics (the small layer's
    weights are unchanged). Unscaled, the router's logits grow with sqrt(hidden): std 4.5 at hidden
    2048 against 1.6 at 256, a saturated softmax whose top-k weights move by about the logits' absolute
    error (|logit| x bf16's 2^-9), which then dominates every gradient's error, PyTorch's own bf16 run's
    included (2026-12-02, H200: 1.2-1.3e-2 ours, 1.8-2.0e-2 PyTorch bf16, against fp32)."""
    H, D = cfg["hidden_size"], cfg["head_dim"]
    Hq, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    E, I = cfg["num_experts"], cfg["moe_intermediate_size"]
    small = layer_config(1)

    def scale(fan_in, small_fan_in):
        return math.sqrt(small_fan_in / fan_in) if fan_in_scaled else 1.0

    s_h = scale(H, small["hidden_size"])
    s_o = scale(Hq * D, small["num_attention_heads"] * small["head_dim"])
    s_i = scale(I, small["moe_intermediate_size"])

    def rnd(shape, std, mean=0.0):
        if transformers_std is not None:  # matrices N(0, initializer_range), vectors (the norms) 1
            std, mean = (transformers_std, 0.0) if len(shape) == 2 else (0.0, 1.0)
        t = torch.randn(*shape, generator=gen, dtype=torch.float32) * std + mean
        return t.to(torch.bfloat16).to(torch.float32).to(device)

    w = {
        "input_layernorm.weight": rnd((H,), 0.1, 1.0),
        "post_attention_layernorm.weight": rnd((H,), 0.1, 1.0),
        "self_attn.q_proj.weight": rnd((Hq * D, H), 0.04 * s_h),
        "self_attn.k_proj.weight": rnd((Hkv * D, H), 0.04 * s_h),
        "self_attn.v_proj.weight": rnd((Hkv * D, H), 0.04 * s_h),
        "self_attn.o_proj.weight": rnd((H, Hq * D), 0.03 * s_o),
        "self_attn.q_norm.weight": rnd((D,), 0.1, 1.0),
        "self_attn.k_norm.weight": rnd((D,), 0.1, 1.0),
        "mlp.gate.weight": rnd((E, H), 0.1 * s_h),
    }
    for e in range(E):
        w[f"mlp.experts.{e}.gate_proj.weight"] = rnd((I, H), 0.05 * s_h)
        w[f"mlp.experts.{e}.up_proj.weight"] = rnd((I, H), 0.05 * s_h)
        w[f"mlp.experts.{e}.down_proj.weight"] = rnd((H, I), 0.05 * s_i)
    return w


class ExpertLayout:
    """How the installed transformers stores the experts, learnt from the module's state_dict."""

    def __init__(self, sd, E, I, H):
        self.E, self.I, self.H = E, I, H
        self.fused = "mlp.experts.gate_up_proj" in sd
        if self.fused:
            gu, dn = tuple(sd["mlp.experts.gate_up_proj"].shape), tuple(sd["mlp.experts.down_proj"].shape)
            if gu == (E, 2 * I, H):
                self.gu_t = False
            elif gu == (E, H, 2 * I):
                self.gu_t = True
            else:
                raise SystemExit(f"unexpected mlp.experts.gate_up_proj shape {gu}")
            if dn == (E, H, I):
                self.dn_t = False
            elif dn == (E, I, H):
                self.dn_t = True
            else:
                raise SystemExit(f"unexpected mlp.experts.down_proj shape {dn}")

    def describe(self):
        if not self.fused:
            return "per-expert modules (mlp.experts.{e}.gate_proj/up_proj/down_proj)"
        return (f"fused (mlp.experts.gate_up_proj {'[E, H, 2I]' if self.gu_t else '[E, 2I, H]'}, "
                f"down_proj {'[E, I, H]' if self.dn_t else '[E, H, I]'})")

    def to_module(self, torch, canon):
        """Canonical dict -> the module's state_dict keys."""
        out = {k: v for k, v in canon.items() if ".experts." not in k}
        if not self.fused:
            out.update({k: v for k, v in canon.items() if ".experts." in k})
            return out
        gu = torch.stack([torch.cat([canon[f"mlp.experts.{e}.gate_proj.weight"], canon[f"mlp.experts.{e}.up_proj.weight"]], 0)
                          for e in range(self.E)])  # gate first
        dn = torch.stack([canon[f"mlp.experts.{e}.down_proj.weight"] for e in range(self.E)])
        out["mlp.experts.gate_up_proj"] = gu.transpose(1, 2).contiguous() if self.gu_t else gu
        out["mlp.experts.down_proj"] = dn.transpose(1, 2).contiguous() if self.dn_t else dn
        return out

    def to_canonical(self, module_grads):
        """The module's parameter gradients -> canonical names."""
        out = {k: v for k, v in module_grads.items() if not k.startswith("mlp.experts.")}
        if not self.fused:
            out.update({k: v for k, v in module_grads.items() if k.startswith("mlp.experts.")})
            return out
        gu = module_grads["mlp.experts.gate_up_proj"]
        dn = module_grads["mlp.experts.down_proj"]
        if self.gu_t:
            gu = gu.transpose(1, 2)
        if self.dn_t:
            dn = dn.transpose(1, 2)
        for e in range(self.E):
            out[f"mlp.experts.{e}.gate_proj.weight"] = gu[e, : self.I]
            out[f"mlp.experts.{e}.up_proj.weight"] = gu[e, self.I:]
            out[f"mlp.experts.{e}.down_proj.weight"] = dn[e]
        return out


def make_hf_config(transformers, cfg, attn):
    from transformers import Qwen3MoeConfig
    wanted = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")}
    kw = wanted
    params = inspect.signature(Qwen3MoeConfig.__init__).parameters
    if not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kw = {k: v for k, v in kw.items() if k in params}
    config = Qwen3MoeConfig(**kw)
    # Some versions drop fields their __init__ does not name (transformers 5.17 ignored head_dim and
    # derived hidden/heads): set every field of ours that did not arrive.
    for k, v in wanted.items():
        if k in ("rope_theta",):
            continue
        if getattr(config, k, None) != v:
            try:
                setattr(config, k, v)
            except Exception:
                pass
    if getattr(config, "head_dim", None) != cfg["head_dim"]:
        raise SystemExit(f"cannot set head_dim={cfg['head_dim']} on this transformers' Qwen3MoeConfig")
    # transformers v5 keeps rope_theta under rope_parameters; make sure it is ours either way.
    rp = getattr(config, "rope_parameters", None)
    if isinstance(rp, dict):
        rp["rope_theta"] = cfg["rope_theta"]
        rp.setdefault("rope_type", "default")
    if hasattr(config, "rope_theta"):
        try:
            config.rope_theta = cfg["rope_theta"]
        except Exception:
            pass
    config._attn_implementation = attn
    try:
        config._experts_implementation = "eager"  # v5: plain loops (grouped_mm may not take fp32)
    except Exception:
        pass
    return config


def make_rotary(M, config, device):
    cls = M.Qwen3MoeRotaryEmbedding
    try:
        rot = cls(config=config, device=device)
    except TypeError:
        rot = cls(config=config)
    return rot.to(device)


def check_rope(torch, rot, cfg):
    D, theta = cfg["head_dim"], cfg["rope_theta"]
    want = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    got = rot.inv_freq.detach().double().cpu()
    if got.shape != want.shape or (got - want).abs().max().item() > 1e-6 * want.abs().max().item():
        raise SystemExit(f"transformers' rotary embedding does not use rope_theta={theta} over head_dim {D} "
                         f"(inv_freq[:3] = {got[:3].tolist()} vs {want[:3].tolist()}); the config was not applied")
    scale = getattr(rot, "attention_scaling", 1.0)
    if abs(float(scale) - 1.0) > 0:
        raise SystemExit(f"transformers' rotary embedding has attention_scaling {scale}, expected 1")


def run_torch(torch, M, layer, config, x, dy, dtype, capture=None):
    """Forward + backward of one layer; returns (output, grad_input, {param name: grad}) in fp32."""
    T, H = x.shape
    device = x.device
    xi = x.to(dtype).reshape(1, T, H).clone().requires_grad_(True)
    pos = torch.arange(T, device=device).reshape(1, T)
    rot = make_rotary(M, config, device)
    cos, sin = rot(xi, pos)
    mask = torch.full((T, T), torch.finfo(dtype).min, dtype=dtype, device=device).triu(1).reshape(1, 1, T, T)
    sig = inspect.signature(layer.forward).parameters
    var_kw = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in sig.values())
    kw = {}
    if "position_embeddings" in sig or var_kw:
        kw["position_embeddings"] = (cos, sin)
    if "position_ids" in sig or var_kw:
        kw["position_ids"] = pos
    if "attention_mask" in sig or var_kw:
        kw["attention_mask"] = mask
    if "use_cache" in sig:
        kw["use_cache"] = False
    if "cache_position" in sig:
        kw["cache_position"] = torch.arange(T, device=device)
    if "output_router_logits" in sig:
        kw["output_router_logits"] = False
    if "output_attentions" in sig:
        kw["output_attentions"] = False

    handle = None
    if capture is not None:
        handle = layer.mlp.register_forward_pre_hook(lambda mod, args: capture.__setitem__("xn2", args[0].detach()))
    for p in layer.parameters():
        p.grad = None
    out = layer(xi, **kw)
    if handle is not None:
        handle.remove()
    if isinstance(out, (tuple, list)):
        out = out[0]
    out.backward(dy.to(dtype).reshape(1, T, H))
    grads = {n: p.grad.detach().float() for n, p in layer.named_parameters() if p.grad is not None}
    return out.detach().float().reshape(T, H), xi.grad.detach().float().reshape(T, H), grads


def rel(a, b):
    """||a - b|| / ||b|| in fp64 (0 when both are zero, inf when only b is)."""
    a, b = a.double(), b.double()
    nb = b.norm().item()
    d = (a - b).norm().item()
    return d / nb if nb > 0 else (0.0 if d == 0 else math.inf)


def topk_sets(torch, logits, k):
    probs = torch.softmax(logits.float(), dim=-1)
    return torch.topk(probs, k, dim=-1).indices.sort(dim=-1).values


def write_safetensors(path, tensors):
    from safetensors.torch import save_file
    save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, path)


def main():
    args = parse_args()
    try:
        import torch
        import transformers
        from transformers.models.qwen3_moe import modeling_qwen3_moe as M
    except ImportError as e:
        print(f"compare_decoder_layer: needs torch and transformers with Qwen3-MoE ({e})", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("compare_decoder_layer: no CUDA device visible to torch", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be fp32
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda")
    workdir = args.workdir or tempfile.mkdtemp(prefix="oom-layer-check-")
    os.makedirs(workdir, exist_ok=True)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, workdir {workdir}")

    cfg = model_layer_config(args.model_config, args.tokens) if args.model_config else layer_config(args.tokens)
    print(f"layer: hidden {cfg['hidden_size']}, heads {cfg['num_attention_heads']}/{cfg['num_key_value_heads']} x "
          f"{cfg['head_dim']}, {cfg['num_experts']} experts top-{cfg['num_experts_per_tok']}, "
          f"I = {cfg['moe_intermediate_size']}, T = {args.tokens}"
          + (f" (widths of {args.model_config})" if args.model_config else " (the built-in small layer)"))
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    T, H, k = args.tokens, cfg["hidden_size"], cfg["num_experts_per_tok"]
    E, I = cfg["num_experts"], cfg["moe_intermediate_size"]

    gen = torch.Generator().manual_seed(args.seed)
    canon = canonical_weights(torch, cfg, gen, device, fan_in_scaled=args.init == "scaled",
                              transformers_std=args.initializer_range if args.init == "transformers" else None)
    print(f"weights: {args.init} initialisation"
          + (f" (N(0, {args.initializer_range}) matrices, norms 1)" if args.init == "transformers" else ""))
    x = (torch.randn(T, H, generator=gen)).to(torch.bfloat16).float().to(device)
    dy = (torch.randn(T, H, generator=gen) * 0.5).to(torch.bfloat16).float().to(device)

    config = make_hf_config(transformers, cfg, args.attn)
    layer16 = M.Qwen3MoeDecoderLayer(config, 0)
    layout = ExpertLayout(layer16.state_dict(), E, I, H)
    if layout.fused and getattr(layer16.mlp.experts, "is_concatenated", True) is False:
        print("compare_decoder_layer: this transformers interleaves gate/up rows in mlp.experts.gate_up_proj; "
              "the conversion here assumes [gate; up] blocks", file=sys.stderr)
        return 2
    sd = layout.to_module(torch, canon)
    missing = set(layer16.state_dict()) - set(sd)
    extra = set(sd) - set(layer16.state_dict())
    if missing or extra:
        print(f"compare_decoder_layer: state_dict mismatch: module has {sorted(missing)} we do not; "
              f"we have {sorted(extra)} it does not", file=sys.stderr)
        return 2
    layer16.load_state_dict({n: v.to(torch.bfloat16) for n, v in sd.items()}, strict=True)
    layer16 = layer16.to(device=device, dtype=torch.bfloat16).eval()
    layer32 = copy.deepcopy(layer16).float().eval()
    check_rope(torch, make_rotary(M, config, device), cfg)
    print(f"experts: {layout.describe()}; attention: {args.attn}")

    # Near-tie routing: from the fp32 layer's router input.
    cap = {}
    run_torch(torch, M, layer32, config, x, torch.zeros_like(dy), torch.float32, capture=cap)
    logits32 = cap["xn2"].reshape(T, H).float() @ canon["mlp.gate.weight"].t()
    srt = logits32.sort(dim=-1, descending=True).values
    margin = srt[:, k - 1] - srt[:, k]
    ambiguous = margin < args.margin * logits32.std()
    keep = ~ambiguous
    dy = dy.clone()
    dy[ambiguous] = 0
    print(f"tokens {T}: {int(ambiguous.sum())} with a top-{k} near tie (margin < {args.margin} x logit std "
          f"{logits32.std().item():.3f}): grad_output rows zeroed, output rows not compared")

    tensors = {PREFIX + n: v.to(torch.bfloat16) for n, v in canon.items()}
    tensors["input"] = x.to(torch.bfloat16)
    tensors["grad_output"] = dy.to(torch.bfloat16)
    in_path, out_path = os.path.join(workdir, "in.safetensors"), os.path.join(workdir, "out.safetensors")
    write_safetensors(in_path, tensors)
    cmd = [args.tool, "--config", os.path.join(workdir, "config.json"), "--in", in_path, "--out", out_path]
    print("$ " + " ".join(cmd), flush=True)
    r = subprocess.run(cmd)
    if r.returncode != 0:
        print(f"compare_decoder_layer: oom-layer-check failed with exit status {r.returncode}", file=sys.stderr)
        return 1
    from safetensors.torch import load_file
    ours = {n: v.to(device) for n, v in load_file(out_path).items()}

    cap16, cap32 = {}, {}
    y16, dx16, g16 = run_torch(torch, M, layer16, config, x, dy, torch.bfloat16, capture=cap16)
    y32, dx32, g32 = run_torch(torch, M, layer32, config, x, dy, torch.float32, capture=cap32)
    g16, g32 = layout.to_canonical(g16), layout.to_canonical(g32)

    rows = []  # (name, ours vs bf16, ours vs fp32, bf16 vs fp32, checked)
    rows.append(("output (unambiguous rows)", ours["output"][keep], y16[keep], y32[keep], True))
    rows.append(("output - input (info)", (ours["output"] - x)[keep], (y16 - x)[keep], (y32 - x)[keep], False))
    rows.append(("grad_input", ours["grad_input"], dx16, dx32, True))
    for n in canon:
        key = "grad." + PREFIX + n
        if key not in ours:
            print(f"compare_decoder_layer: {out_path} lacks {key}", file=sys.stderr)
            return 1
        if n not in g16 or n not in g32:
            print(f"compare_decoder_layer: torch produced no gradient for {n}", file=sys.stderr)
            return 1
        rows.append((n, ours[key], g16[n], g32[n], True))

    failed = 0
    w = max(len(r[0]) for r in rows) + 2
    print(f"\n{'tensor':<{w}} {'ours/bf16':>10} {'ours/fp32':>10} {'bf16/fp32':>10}  "
          f"result (tol {args.tol:g} on ours/{args.check_against})")
    closer = 0
    worst = None  # (ours/fp32, name, bf16/fp32) of the checked tensor farthest from the fp32 run
    for name, a, b16, b32, checked in rows:
        e16, e32, n16 = rel(a, b16), rel(a, b32), rel(b16, b32)
        if checked and (worst is None or e32 > worst[0]):
            worst = (e32, name, n16)
        ok = (e32 if args.check_against == "fp32" else e16) <= args.tol
        closer += checked and e32 <= n16
        verdict = ("PASS" if ok else "FAIL") if checked else "info"
        if checked and not ok:
            failed += 1
            verdict += " (bf16 noise)" if e32 <= 1.5 * n16 else " (ours off the fp32 reference)"
        print(f"{name:<{w}} {e16:10.2e} {e32:10.2e} {n16:10.2e}  {verdict}")

    # Routing of the unambiguous tokens: the same expert sets in all three.
    ours_sets = ours["routing.expert_ids"].long().sort(dim=-1).values
    gate16 = layer16.mlp.gate.weight if hasattr(layer16.mlp.gate, "weight") else None
    sets32 = topk_sets(torch, cap32["xn2"].reshape(T, H).float() @ canon["mlp.gate.weight"].t(), k)
    sets16 = topk_sets(torch, cap16["xn2"].reshape(T, H) @ gate16.t(), k) if gate16 is not None else sets32
    diff32 = int(((ours_sets != sets32).any(dim=-1) & keep).sum())
    diff16 = int(((ours_sets != sets16).any(dim=-1) & keep).sum())
    ok = diff32 == 0 and diff16 == 0
    failed += 0 if ok else 1
    print(f"{'routing (unambiguous tokens)':<{w}} {diff16:>10d} {diff32:>10d} {'':>10}  {'PASS' if ok else 'FAIL'} "
          f"(tokens whose expert set differs from torch-bf16 / torch-fp32)")

    checked_rows = sum(1 for r in rows if r[4])
    print(f"worst against the fp32 run: {worst[1]} at {worst[0]:.2e} (PyTorch's bf16 run on it: {worst[2]:.2e})")
    print(f"ours is at least as close to the fp32 run as PyTorch's bf16 run is on {closer} of {checked_rows} tensors")
    print(f"\n{'FAILED: ' + str(failed) + ' check(s)' if failed else 'all checks passed'} "
          f"(T={T}, seed {args.seed}; files in {workdir})")
    return 1 if failed else 0


def run_cli(entry, name):
    """Exits with entry()'s status; a SystemExit carrying a message (argument errors, refusals) prints
    it as "name: message" on stderr and exits 2. Also scripts/diag/emulate_layer_rounding.py's."""
    try:
        sys.exit(entry())
    except SystemExit as e:
        if isinstance(e.code, str):
            print(f"{name}: {e.code}", file=sys.stderr)
            sys.exit(2)
        raise


if __name__ == "__main__":
    run_cli(main, "compare_decoder_layer")
