#!/usr/bin/env python3
"""Trains the same model on the same data with PyTorch (transformers' model for the run's config:
Qwen3MoeForCausalLM, Qwen3NextForCausalLM, Qwen3_5MoeForCausalLM, MixtralForCausalLM,
OlmoeForCausalLM; torch.optim.AdamW) and compares
every step's loss with an oom-train run.

  oom-train --out RUN --steps 50 --save-initial --dump-batches RUN/batches.tok --keep 3 ...
  python3 scripts/compare_train_pytorch.py --run RUN [--device cuda] [--tolerance 1e-2]

It loads RUN/checkpoint-000000 (the initial weights oom-train saved) and RUN/batches.tok (every
step's windows of seq + 1 tokens, micro_batches x batch of them), and reads the lr and weight
decay from the final checkpoint's trainer_state.json (and the clipping norm, applied with
torch.nn.utils.clip_grad_norm_ when it is set). Precision follows oom-train's: fp32 master weights and AdamW state, the forward
and backward in fp32 over the bf16-rounded weights (each step rounds the master to bf16 and back,
takes the gradient with respect to those rounded weights and applies it to the master), loss = mean
cross-entropy of window[1:] given window[:-1]. Exit status 1 when any step's relative loss
difference exceeds the tolerance; the first mismatching steps are printed.
"""
import argparse
import json
import os
import struct
import sys

import numpy as np


def read_tokens(path):
    with open(path, "rb") as f:
        header = f.read(64)
        if header[:8] != b"OOMTOK01":
            sys.exit(f"{path}: not an OOMTOK01 token file")
        _version, width = struct.unpack_from("<II", header, 8)
        _vocab, count = struct.unpack_from("<QQ", header, 16)
        data = np.frombuffer(f.read(), dtype=np.uint16 if width == 2 else np.uint32)
    if data.size != count:
        sys.exit(f"{path}: {data.size} tokens, header says {count}")
    return data.astype(np.int64)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="oom-train run directory")
    ap.add_argument("--batches", help="token file of the windows (default RUN/batches.tok)")
    ap.add_argument("--device", default="cuda", help="torch device (default cuda; cpu works too)")
    ap.add_argument("--tolerance", type=float, default=1e-2, help="relative loss difference allowed per step")
    ap.add_argument("--steps", type=int, default=0, help="compare only the first N steps (default: all)")
    ap.add_argument("--noise-device", default="cpu",
                    help="also train PyTorch on this device and show how far two PyTorch runs drift apart "
                         "(the noise floor of the comparison; '' to skip)")
    ap.add_argument("--noise-bf16", action="store_true",
                    help="run the noise run's forward and backward under torch.autocast(bfloat16): the floor is then "
                         "how far PyTorch's own bf16 training drifts from its fp32 one, the yardstick for a bf16 trainer")
    ap.add_argument("--noise-threads", type=int, default=0,
                    help="train the noise run with this many CPU threads (default: torch's own); with --device cpu "
                         "and --noise-device cpu the two PyTorch runs then differ only in their reduction order")
    args = ap.parse_args()

    import torch
    import transformers
    from safetensors.torch import load_file

    run = args.run
    init = os.path.join(run, "checkpoint-000000")
    with open(os.path.join(run, "latest")) as f:
        final = os.path.join(run, f.read().strip())
    with open(os.path.join(final, "trainer_state.json")) as f:
        state = json.load(f)
    seq = int(state["seq"])
    micro_batches = int(state.get("micro_batches", 1))
    batch = int(state.get("batch", 1))  # sequences per micro-batch: input_ids of shape (batch, seq)
    base_lr = float(state["lr"])
    warmup = int(state.get("warmup", 0))
    cosine = state.get("schedule", "constant") == "cosine"
    min_lr = float(state.get("min_lr", 0.0))
    total = int(state.get("total_steps", 0))

    def learning_rate(t):  # oom-train's schedule, update t counted from 1
        import math
        if cosine and t > warmup and total > warmup:
            p = min(1.0, (t - warmup) / (total - warmup))
            return min_lr + (base_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))
        return base_lr * (t / warmup if warmup > 0 and t < warmup else 1.0)
    max_grad_norm = float(state.get("max_grad_norm", 0.0))
    metrics = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl")) if line.strip()]
    ours = {m["step"]: m["loss"] for m in metrics}
    windows = read_tokens(args.batches or os.path.join(run, "batches.tok")).reshape(-1, seq + 1)
    steps = len(windows) // (micro_batches * batch)
    steps = steps if args.steps == 0 else min(args.steps, steps)

    torch.manual_seed(0)
    config = transformers.AutoConfig.from_pretrained(init)
    config.torch_dtype = torch.float32
    try:
        config._attn_implementation = "eager"
    except Exception:
        pass
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    weights = load_file(os.path.join(init, "model.safetensors"))
    # Qwen3.5-MoE checkpoints name the text model "model.language_model." (the multimodal
    # model's layout); its text-only Qwen3_5MoeForCausalLM says "model." (from_pretrained maps
    # these itself, load_state_dict does not).
    if not any(k.startswith("model.language_model.") for k in model.state_dict()):
        weights = {("model." + k[len("model.language_model."):] if k.startswith("model.language_model.") else k): v
                   for k, v in weights.items()}
    # Mixtral checkpoints say block_sparse_moe with experts' w1 / w3 / w2 (gate, up, down);
    # transformers >= 5's module says mlp (from_pretrained maps these itself).
    if any(".block_sparse_moe." in k for k in weights) and not any(".block_sparse_moe." in k for k in model.state_dict()):
        def renamed(k):
            k = k.replace(".block_sparse_moe.", ".mlp.")
            for old, new in ((".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj.")):
                if ".mlp.experts." in k:
                    k = k.replace(old, new)
            return k
        weights = {renamed(k): v for k, v in weights.items()}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # transformers >= 5 packs experts; map per-expert names if the module wants packed ones.
    if missing:
        sd = model.state_dict()
        packed = {}
        for name in missing:
            if name.endswith("experts.gate_up_proj"):
                prefix = name[: -len("gate_up_proj")]
                e = sd[name].shape[0]
                packed[name] = torch.stack([torch.cat([weights[f"{prefix}{i}.gate_proj.weight"], weights[f"{prefix}{i}.up_proj.weight"]])
                                            for i in range(e)])
            elif name.endswith("experts.down_proj"):
                prefix = name[: -len("down_proj")]
                e = sd[name].shape[0]
                packed[name] = torch.stack([weights[f"{prefix}{i}.down_proj.weight"] for i in range(e)])
            else:
                sys.exit(f"the checkpoint lacks {name}")
        for name, t in packed.items():
            if t.shape != sd[name].shape:  # some versions store [E, H, 2I]
                t = t.transpose(1, 2).contiguous()
            sd[name].copy_(t)
        model.load_state_dict({**{k: v for k, v in weights.items() if k in sd}, **packed}, strict=False)
        print(f"(mapped per-expert tensors onto transformers {transformers.__version__}'s packed experts)")
    model.to(args.device)
    model.train()

    import copy
    reference_model = copy.deepcopy(model).to(args.noise_device) if args.noise_device else None

    # transformers adds router_aux_loss_coef x load_balancing_loss_func to the loss only with
    # output_router_logits (oom-train then adds it too).
    router_logits = {"output_router_logits": True} if getattr(config, "output_router_logits", False) else {}

    def train(model, device, bf16=False):
        params = dict(model.named_parameters())
        opt = torch.optim.AdamW(params.values(), lr=float(state["lr"]), betas=(0.9, 0.999), eps=1e-8,
                                weight_decay=float(state["weight_decay"]))
        from torch.func import functional_call
        losses = []
        for step in range(1, steps + 1):
            rounded = {k: v.detach().to(torch.bfloat16).to(torch.float32).requires_grad_(True) for k, v in params.items()}
            loss = 0.0
            for mb in range(micro_batches):  # gradient accumulation: the mean over all the step's tokens
                first = ((step - 1) * micro_batches + mb) * batch
                w = torch.from_numpy(windows[first:first + batch]).to(device)  # (batch, seq + 1)
                with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
                    out = functional_call(model, rounded, args=(), kwargs={"input_ids": w[:, :-1], "use_cache": False,
                                                                           **router_logits})
                logits = out.logits.float().reshape(-1, out.logits.shape[-1])
                part = torch.nn.functional.cross_entropy(logits, w[:, 1:].reshape(-1))
                if router_logits:  # the load-balancing loss, as the model adds it to the loss with labels
                    part = part + model.router_aux_loss_coef * out.aux_loss.float()
                part = part / micro_batches
                part.backward()
                loss = loss + part.detach()
            for k, p in params.items():
                p.grad = rounded[k].grad
            if max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(list(params.values()), max_grad_norm)
            for group in opt.param_groups:
                group["lr"] = learning_rate(step)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss))
        return losses

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    theirs_all = train(model, args.device)
    noise = None
    if reference_model is not None:
        threads = torch.get_num_threads()
        if args.noise_threads > 0:
            torch.set_num_threads(args.noise_threads)
        noise = train(reference_model, args.noise_device, bf16=args.noise_bf16)
        torch.set_num_threads(threads)
    rows = []
    first_bad = []
    for step in range(1, steps + 1):
        theirs = theirs_all[step - 1]
        mine = ours.get(step)
        rel = abs(mine - theirs) / abs(theirs) if mine is not None else float("inf")
        floor = abs(noise[step - 1] - theirs) / abs(theirs) if noise is not None else float("nan")
        ok = rel <= args.tolerance
        rows.append((step, mine, theirs, rel, ok, floor))
        if not ok and len(first_bad) < 5:
            first_bad.append(step)

    print(f"{'step':>5} {'oom-train':>12} {'pytorch':>12} {'rel diff':>10} {'torch ' + (args.noise_device or '-') + ' vs ' + args.device:>18}")
    for step, mine, theirs, rel, ok, floor in rows:
        print(f"{step:>5} {mine if mine is not None else float('nan'):>12.6f} {theirs:>12.6f} {rel:>10.2e} {floor:>18.2e}"
              f"{'' if ok else '  MISMATCH'}")
    # The final checkpoint loads with transformers' own loader, every weight accounted for.
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(final, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    print(f"from_pretrained({final}): {sum(p.numel() for p in loaded.parameters())} parameters, "
          f"{'every tensor matched' if not problems else problems}")
    worst = max(rows, key=lambda r: r[3])
    if noise is not None:
        wf = max(rows, key=lambda r: r[5])
        threads = f" with {args.noise_threads} thread(s)" if args.noise_threads > 0 else ""
        precision = "PyTorch's bf16 autocast against its fp32" if args.noise_bf16 else "same precision"
        print(f"noise floor: PyTorch on {args.noise_device}{threads} vs PyTorch on {args.device}, same weights and data, {precision}: "
              f"worst {wf[5]:.2e} at step {wf[0]}")
    print(f"{steps} steps; worst relative difference {worst[3]:.2e} at step {worst[0]} (tolerance {args.tolerance:g}); "
          f"torch {torch.__version__}, transformers {transformers.__version__}, device {args.device}")
    if first_bad:
        print(f"FAIL: first mismatching steps: {first_bad}")
        return 1
    if problems:
        print("FAIL: transformers could not load the checkpoint cleanly")
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
